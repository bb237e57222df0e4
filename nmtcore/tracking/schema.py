"""Every MLflow tag the platform writes, by name, and the typed records that write and read the two sets a
reader needs whole: a sweep's parent run (:class:`SweepTags`) and a trial's child run (:class:`TrialTags`).

One module owns the names so that a reader (the report, the resume, the UI views) and the writer cannot drift
apart, and so that an old store's spellings are handled in one place (``from_tags``). Tag values are strings
in MLflow; the records convert. A test keeps ``"nmtcore.`` tag literals out of every other module (tests/test_architecture.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

PREFIX = "nmtcore."

# ---------------------------------------------------------------------------------- any run (tracking)
FAILURE_REASON = "nmtcore.failure_reason"  # "<ExceptionType>: <first line>" on a FAILED run
ATTACH_COUNT = "nmtcore.attach_count"  # how often a run was re-attached (resumes, retries)
STOPPED_BY = "nmtcore.stopped_by"  # which rule ended the run: patience (converged), cap or schedule
STOP_METRIC = "nmtcore.stop_metric"
MODEL = "nmtcore.model"
CORPUS = "nmtcore.corpus"
LANGS = "nmtcore.langs"
DEVICE = "nmtcore.device"
AMP_DTYPE = "nmtcore.amp_dtype"
ALLOCATOR = "nmtcore.allocator"
NICE = "nmtcore.nice"  # the training process's niceness as it started: other work on the machine preempts a higher one
WARM_START_SOURCE = "nmtcore.warm_start_source"
WARM_START_LOADED = "nmtcore.warm_start_loaded"
WARM_START_FRESH = "nmtcore.warm_start_fresh"
CHECKSUM_PREFIX = "nmtcore.checksum."  # + a data file's name: its sha256
BLEU_SIGNATURE_PREFIX = "nmtcore.bleu_signature."  # + a test split: sacreBLEU's signature

# The BERT a run used (tracking.callback writes them, the report reads them).
BERT = "nmtcore.bert"
BERT_RESOLVED = "nmtcore.bert_resolved"
BERT_SOURCE = "nmtcore.bert_source"
BERT_PATH = "nmtcore.bert_path"
BERT_LAYERS = "nmtcore.bert_layers"
BERT_HIDDEN = "nmtcore.bert_hidden"
BERT_TYPE = "nmtcore.bert_type"
BERT_QUALITY = "nmtcore.bert_quality"
BERT_QUALITY_DETAIL = "nmtcore.bert_quality_detail"

# Provenance (tracking.provenance).
PYTHON_VERSION = "nmtcore.python_version"
TORCH_VERSION = "nmtcore.torch_version"
NMTCORE_VERSION = "nmtcore.nmtcore_version"
SACREBLEU_VERSION = "nmtcore.sacrebleu_version"
MLFLOW_VERSION = "nmtcore.mlflow_version"
HOSTNAME = "nmtcore.hostname"
CPU = "nmtcore.cpu"  # the CPU model, its logical CPUs and its widest kernels (nmtcore.host.cpu_description)
CHANGED_ON_RESUME = "nmtcore.changed_on_resume"  # speed-only settings a resumed run changed: "key: old -> new; ..."
GIT_SHA = "nmtcore.git_sha"
GIT_DIRTY = "nmtcore.git_dirty"

# ------------------------------------------------------------------------------------ sweeps (lifecycle)
SWEEP = "nmtcore.sweep"  # the sweep's name, on the parent and on every child
ROLE = "nmtcore.role"  # "sweep", "trial" or "baseline"
TRIAL_KEY = "nmtcore.trial_key"
TRIAL_STATE = "nmtcore.trial_state"
FAILURE_KIND = "nmtcore.failure_kind"  # "nonfinite": deterministic, not worth a retry
TUNE_STATUS = "nmtcore.tune_status"
TUNE_TRIAL_ID = "nmtcore.tune_trial_id"
IMPORTED_FROM = "nmtcore.imported_from"  # on a run made by ``nmtcore import``: the id of the run it copies
REUSE_KEY = "nmtcore.reuse_key"  # what decides a trial's results (:mod:`nmtcore.sweep.reuse`)
REUSED_FROM = "nmtcore.reused_from"  # on a trial copied from an earlier one with its reuse key: that run's id
REUSED_FROM_SWEEP = "nmtcore.reused_from_sweep"  # ...and that run's sweep
# On a trial that started where another's first phases ended (nmtcore.engine.shared_phases): which phases, from whom;
# and the epochs they took (the report counts them as the other trial's cost).
SHARED_PHASES = "nmtcore.shared_phases"
SHARED_PHASES_EPOCHS = "nmtcore.shared_phases_epochs"
ARM = "nmtcore.arm"  # "control", or the arm's name ("L2-H128", "p_net=0.3", an ablation arm's name)
CONTROL = "nmtcore.control"  # "true" on the control arm's runs
STUDY = "nmtcore.study"
SPACE = "nmtcore.space"
VARIED_KEYS = "nmtcore.varied_keys"  # comma-separated
SEARCH = "nmtcore.search"
SPACE_JSON = "nmtcore.space_json"
TEST_SPLIT = "nmtcore.test_split"  # the first test split (older stores have only this one)
TEST_SPLITS = "nmtcore.test_splits"  # comma-separated
# Test sets decoded after the sweep by ``nmtcore retest`` (comma-separated). The sweep itself never writes it, so a
# resumed sweep, which sets its tags again, keeps it.
TEST_SPLITS_ADDED = "nmtcore.test_splits_added"
RETESTED_PREFIX = "nmtcore.retested."  # + a split: on a trial's run, when and with which code it was decoded later
REDIAGNOSED = "nmtcore.rediagnosed"  # on a trial's run: when, with which code and weights its diagnostics were measured again
EXPERIMENT_PATH = "nmtcore.experiment_path"
PROTOCOL = "nmtcore.protocol"
LEAKED_PLACEMENT_GROUPS_REMOVED = "nmtcore.leaked_placement_groups_removed"
CONFIG_KEY = "nmtcore.config_key"
SEED = "nmtcore.seed"
WARM_START = "nmtcore.warm_start"
NODE_IDS = "nmtcore.node_ids"  # comma-separated Ray node ids a trial trained on
WORLD_SIZE = "nmtcore.world_size"
MEMORY_ESTIMATE_GIB = "nmtcore.memory_estimate_gib"  # a trial's memory estimate, as Ray reserved it per worker
TRIAL_PROCESS = "nmtcore.trial_process"  # where a trial trained: its Tune actor, or Ray Train workers
MAX_THREADS = "nmtcore.max_threads"  # > train.num_threads: idle CPUs were used
STOPPED_AT_EPOCH = "nmtcore.stopped_at_epoch"
VARIED_VALUE_PREFIX = "varied."  # + a varied key: its value on a trial's run

# ----------------------------------------------------------------------------- the shared baseline (sweep)
BASELINE_KEY = "nmtcore.baseline_key"
BASELINE_RUN_ID = "nmtcore.baseline_run_id"
BASELINE_CONVERGED = "nmtcore.baseline_converged"
BASELINE_VALID_LOSSES = "nmtcore.baseline_valid_losses"
BASELINE_ADOPTED_FROM = "nmtcore.baseline_adopted_from"
CONVERGED = "nmtcore.converged"  # on the baseline's own run


def checksum(name: str) -> str:
    """The tag holding data file ``name``'s checksum."""
    return CHECKSUM_PREFIX + name


def bleu_signature(split: str) -> str:
    """The tag holding sacreBLEU's signature for test split ``split``."""
    return BLEU_SIGNATURE_PREFIX + split


def _csv(value: str | None) -> tuple[str, ...]:
    return tuple(s for s in (value or "").split(",") if s)


def _flag(value: str | None) -> bool | None:
    """A boolean tag: written as ``str(bool)`` ("True"/"False") or lower-case; None when absent."""
    return None if value is None else value.strip().lower() == "true"


@dataclass(frozen=True)
class SweepTags:
    """What a sweep's parent run says about the sweep: what it studies, how, and from which baseline."""

    name: str
    study: str = ""
    space: str = ""
    model: str = ""
    varied_keys: tuple[str, ...] = ()
    search: str = ""
    space_json: str = "{}"
    test_splits: tuple[str, ...] = ()
    experiment_path: str = ""
    protocol: str = ""
    baseline_key: str = ""
    baseline_run_id: str = ""
    baseline_converged: bool | None = None
    baseline_valid_losses: tuple[float, ...] = ()
    added_test_splits: tuple[str, ...] = ()  # decoded after the sweep (``nmtcore retest``); not in :meth:`to_tags`

    @property
    def all_test_splits(self) -> tuple[str, ...]:
        """The sweep's own test sets, then those ``nmtcore retest`` added."""
        return tuple(dict.fromkeys(self.test_splits + self.added_test_splits))

    @property
    def space_description(self) -> dict[str, Any]:
        """The search space as the sweep described it (``SearchSpace.describe``); {} when absent."""
        return json.loads(self.space_json or "{}")

    @property
    def test_split(self) -> str:
        return self.test_splits[0] if self.test_splits else ""

    def to_tags(self) -> dict[str, str]:
        tags = {SWEEP: self.name, ROLE: "sweep", STUDY: self.study, SPACE: self.space, MODEL: self.model,
                VARIED_KEYS: ",".join(self.varied_keys), SEARCH: self.search, SPACE_JSON: self.space_json,
                TEST_SPLIT: self.test_split, TEST_SPLITS: ",".join(self.test_splits),
                EXPERIMENT_PATH: self.experiment_path, PROTOCOL: self.protocol}
        if self.baseline_key:
            tags.update({BASELINE_KEY: self.baseline_key, BASELINE_RUN_ID: self.baseline_run_id,
                         BASELINE_CONVERGED: str(self.baseline_converged),
                         BASELINE_VALID_LOSSES: json.dumps(list(self.baseline_valid_losses))})
        return tags

    @classmethod
    def from_tags(cls, tags: Mapping[str, str], default_name: str = "") -> "SweepTags":
        """The record of a parent run's ``tags`` (older stores: one ``test_split``, booleans in either case)."""
        return cls(name=tags.get(SWEEP, default_name), study=tags.get(STUDY, ""), space=tags.get(SPACE, ""),
                   model=tags.get(MODEL, ""), varied_keys=_csv(tags.get(VARIED_KEYS)), search=tags.get(SEARCH, ""),
                   space_json=tags.get(SPACE_JSON) or "{}",
                   test_splits=_csv(tags.get(TEST_SPLITS) or tags.get(TEST_SPLIT)),
                   experiment_path=tags.get(EXPERIMENT_PATH, ""), protocol=tags.get(PROTOCOL, ""),
                   baseline_key=tags.get(BASELINE_KEY, ""), baseline_run_id=tags.get(BASELINE_RUN_ID, ""),
                   baseline_converged=_flag(tags.get(BASELINE_CONVERGED)),
                   baseline_valid_losses=tuple(json.loads(tags.get(BASELINE_VALID_LOSSES) or "[]")),
                   added_test_splits=_csv(tags.get(TEST_SPLITS_ADDED)))


@dataclass(frozen=True)
class TrialTags:
    """What a trial's child run says about the trial: its sweep, arm, configuration and seed. The varied
    keys' values go beside it as ``varied.<key>`` tags (:data:`VARIED_VALUE_PREFIX`)."""

    sweep: str
    study: str
    space: str
    model: str
    varied_keys: tuple[str, ...]
    config_key: str
    seed: int
    arm: str
    control: bool
    warm_start: str
    varied: Mapping[str, Any] = field(default_factory=dict)  # read back as text

    def to_tags(self) -> dict[str, Any]:
        """The tags (values the tracker writes as text: a varied list in YAML flow style, as params are)."""
        tags: dict[str, Any] = {
            SWEEP: self.sweep, STUDY: self.study, SPACE: self.space, MODEL: self.model,
            VARIED_KEYS: ",".join(self.varied_keys), CONFIG_KEY: self.config_key, SEED: self.seed, ARM: self.arm,
            CONTROL: str(self.control).lower(), WARM_START: self.warm_start}
        tags.update({VARIED_VALUE_PREFIX + k: v for k, v in dict(self.varied).items()})
        return tags

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> "TrialTags":
        """The record of a child run's ``tags``."""
        return cls(sweep=tags.get(SWEEP, ""), study=tags.get(STUDY, ""), space=tags.get(SPACE, ""),
                   model=tags.get(MODEL, ""), varied_keys=_csv(tags.get(VARIED_KEYS)),
                   config_key=tags.get(CONFIG_KEY, ""), seed=int(tags.get(SEED) or 0), arm=tags.get(ARM, ""),
                   control=tags.get(CONTROL) == "true", warm_start=tags.get(WARM_START, ""),
                   varied={k[len(VARIED_VALUE_PREFIX):]: v for k, v in tags.items()
                           if k.startswith(VARIED_VALUE_PREFIX)})

