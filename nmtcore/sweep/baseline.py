"""The shared converged baseline: trained once, stored by everything that determines its weights, reused by
every study and sweep that needs the same one (the papers' procedure: BERT-fused, the document-context and
the mask-fusion models start from a trained Transformer).

A baseline lives in ``<root>/<key>/``::

    run/           the training run's output directory (checkpoints: an interrupted training resumes there)
    baseline.pt    the final weights with their config and vocabulary (what arms warm-start from)
    meta.json      what it is and how it ended (written last: a baseline without it is not finished)
    uses.jsonl     one line per sweep that used it

``key`` hashes the weight-determining config (everything but output paths, thread count, logging and
decoding), the data and vocabulary checksums, and the source of the code that trains a Transformer (its
syntax tree without docstrings), so two configs that differ in any weight-determining field get two
baselines and a code change retrains. Concurrent sweeps serialise on a lock; the second one reuses.
Training it is a tracked run of its own (role ``baseline`` in MLflow, linked from each sweep's parent run).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from nmtcore import tracking
from nmtcore.checkpoint import epoch_checkpoints, load_checkpoint, save_checkpoint
from nmtcore.config import ExperimentConfig
from nmtcore.data import prepare_data
from nmtcore.engine import Callback, RunSummary, Trainer, run_experiment
from nmtcore.engine.stopping import PATIENCE, StopRule, loss_still_falling, replay
from nmtcore.files import atomic_write_text, file_lock
from nmtcore.sweep.lifecycle import ROLE_TAG
from nmtcore.sweep.settings import SweepError
from nmtcore.tracking import schema
from nmtcore.tracking.callback import TrackingCallback

log = logging.getLogger("nmtcore.sweep")

BASELINE_FORMAT = 1  # bump when the store's layout or the key's meaning changes
KEY_TAG = schema.BASELINE_KEY
# Config keys that change no weight: where things are written, how many threads, logging, decoding.
NOT_WEIGHTS = ("name", "output_dir", "train.save_dir", "train.num_threads", "train.log_interval",
               "train.valid_bleu", "data.data_dir", "data.cache_dir", "data.download", "data.test_splits",
               "model.bert.cache_dir")
# The stopping rule's settings: a finished baseline trained under other values of these alone is adoptable when its
# recorded epochs, replayed under this rule, stop where it stopped (the same weights).
RULE_KEYS = ("train.patience", "train.min_delta", "train.loss_guard")
# The code that decides a baseline's weights (a Transformer trained by the engine on prepared data).
CODE = ("nmtcore/models/base.py", "nmtcore/models/transformer.py", "nmtcore/nn", "nmtcore/engine", "nmtcore/data",
        "nmtcore/devices.py", "nmtcore/checkpoint.py")


@dataclass(frozen=True)
class Baseline:
    """A finished baseline: its key, the weights to warm-start from, what it recorded, whether this call
    trained it."""

    key: str
    path: Path
    meta: Mapping[str, Any]
    trained_now: bool

    @property
    def converged(self) -> bool:
        """True only when the patience rule stopped its training (:mod:`nmtcore.engine.stopping`)."""
        return bool(self.meta.get("converged", False))

    @property
    def stopped_by(self) -> str:
        """Which rule stopped its training: patience, cap or schedule."""
        return str(self.meta.get("fit", {}).get("stopped_by", "schedule"))


def code_digest(entries: tuple[str, ...] = CODE, exclude: tuple[str, ...] = ()) -> str:
    """SHA-256 over the syntax trees (docstrings dropped) of the modules in ``entries`` (files or folders,
    relative to the repository; default :data:`CODE`) but those under ``exclude``."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    files = sorted(p for entry in entries for p in ((root / entry).rglob("*.py") if (root / entry).is_dir()
                                                      else [root / entry])
                   if not p.relative_to(root).as_posix().startswith(exclude))
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                    and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + ast.dump(tree).encode() + b"\0")
    return h.hexdigest()


def weight_config(cfg: ExperimentConfig) -> dict[str, Any]:
    """The flat config without the keys that change no weight (:data:`NOT_WEIGHTS`, the decode section)."""
    return {k: v for k, v in cfg.flat().items() if k not in NOT_WEIGHTS and not k.startswith("decode.")}


def baseline_key(cfg: ExperimentConfig, data_checksums: Mapping[str, str], code: str | None = None) -> str:
    """The content address of the baseline ``cfg`` trains on data with these checksums (of the training and
    validation files and the vocabulary: the test sets decide no weight)."""
    return _hash_key(weight_config(cfg), cfg, data_checksums, code)


def _hash_key(weights: Mapping[str, Any], cfg: ExperimentConfig, data_checksums: Mapping[str, str],
              code: str | None) -> str:
    """:func:`baseline_key` of the weight config ``weights`` (``cfg`` names the splits whose checksums count)."""
    splits = (cfg.data.train_split, cfg.data.valid_split)
    data = {k: v for k, v in data_checksums.items() if k == "vocab" or k.rsplit(".", 1)[0] in splits}
    blob = json.dumps({"format": BASELINE_FORMAT, "config": dict(weights), "data": data,
                       "code": code or code_digest()}, sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def default_root(cfg: ExperimentConfig) -> Path:
    """``<data cache>/baselines`` (``$NMTCORE_CACHE`` or ``~/.cache/nmtcore``): shared by every study here."""
    return cfg.data.resolved_cache_dir() / "baselines"


def find_baseline(root: Path, key: str) -> Baseline | None:
    """The finished baseline ``key`` under ``root``, or None."""
    meta_path = Path(root) / key / "meta.json"
    if not meta_path.is_file():
        return None
    return Baseline(key, Path(root) / key / "baseline.pt", json.loads(meta_path.read_text(encoding="utf-8")), False)


def ensure_baseline(cfg: ExperimentConfig, root: str | Path | None = None, *, tracking_uri: str | None = None,
                    experiment: str = "nmtcore-baselines", used_by: str = "",
                    progress: Callable[[str], None] = print,
                    callbacks: tuple[Callback, ...] = ()) -> Baseline:
    """The baseline ``cfg`` trains: found in the store, or trained now (resuming an interrupted training),
    tracked as its own MLflow run, stored, and returned. ``used_by`` is recorded in ``uses.jsonl``."""
    root = Path(root) if root is not None else default_root(cfg)
    data = prepare_data(cfg.data)
    key = baseline_key(cfg, data.checksums)
    found = find_baseline(root, key)
    if found is None:
        with file_lock(root / f"{key}.lock"):
            found = find_baseline(root, key)  # a concurrent sweep may have finished it meanwhile
            if found is None:
                for other in adoptable(cfg, data.checksums, root):
                    progress(f"baseline {key[:12]}: none trained by this code; {other['key']} (trained "
                             f"{other['created']}) has the same config and data, other engine code: if the change "
                             f"touches no weight, stop now and add --adopt-baseline {other['key']} to reuse it")
                found = _train(cfg, root, key, data, tracking_uri, experiment, progress, callbacks)
    else:
        progress(f"baseline {key[:12]}: reused ({found.meta['fit']['epochs']} epochs, valid loss "
                 f"{found.meta['fit']['best_valid_loss']:.4f}, trained {found.meta['created']})")
    with open(root / key / "uses.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps({"used_by": used_by, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                            "trained_now": found.trained_now}) + "\n")
    return found


def uses(root: str | Path, key: str) -> list[dict[str, Any]]:
    """Who used baseline ``key`` so far (oldest first)."""
    path = Path(root) / key / "uses.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()] if path.is_file() else []


class _Store(Callback):
    """Saves the final weights (after testing: what ``finalize_model`` chose) with their config and vocab."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer: Trainer, summary: RunSummary) -> None:
        save_checkpoint(self.path, {"model": trainer.model.state_dict(), "config": trainer.cfg.to_dict(),
                                    "vocab": trainer.data.vocab.to_tensor_payload()})


class EpochProgress(Callback):
    """One console line per epoch: what trains, the epoch's validation loss, elapsed time and an ETA."""

    def __init__(self, label: str, max_epochs: int, progress: Callable[[str], None] = print) -> None:
        self.label, self.max_epochs, self.progress = label, max_epochs, progress
        self.t0 = time.perf_counter()
        self.first_epoch = 1

    def on_train_start(self, trainer: Trainer) -> None:
        self.t0 = time.perf_counter()
        self.first_epoch = trainer.state.epoch + 1
        self.progress(f"{self.label}: training, epochs {self.first_epoch}..{self.max_epochs}"
                      + (" (resumed)" if trainer.state.epoch else ""))

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float], checkpoint: Path | None) -> None:
        done = epoch - self.first_epoch + 1
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.max_epochs - epoch)
        self.progress(f"{self.label}: epoch {epoch}/{self.max_epochs} valid_loss {metrics['valid_loss']:.4f} "
                      f"({_minutes(elapsed)} elapsed, about {_minutes(eta)} to go at most)")


def _train(cfg: ExperimentConfig, root: Path, key: str, data: Any, tracking_uri: str | None, experiment: str,
           progress: Callable[[str], None], callbacks: tuple[Callback, ...]) -> Baseline:
    home = (root / key).resolve()  # an adopted baseline's key is a link to the directory it was trained in
    home.mkdir(parents=True, exist_ok=True)
    if not (home / INPUTS_FILE).is_file():  # what the key hashed, so that later code can adopt it
        atomic_write_text(home / INPUTS_FILE, json.dumps(key_inputs(cfg, data.checksums, key), indent=1,
                                                         default=repr) + "\n")
    cfg = cfg.with_overrides({"output_dir": str(home / "run"), "train.save_dir": ""})
    t0 = time.perf_counter()
    label = f"baseline {key[:12]}"
    # Its own run, found by key and role: a sweep's parent run carries the key of the baseline it used too (and
    # comes into another store with `nmtcore import`), and must never be re-attached as the baseline's.
    old = (tracking.search_runs(f"tags.`{KEY_TAG}` = '{key}' and tags.`{ROLE_TAG}` = 'baseline'", tracking_uri)
           if _store_exists(tracking_uri) else [])
    tags = {ROLE_TAG: "baseline", KEY_TAG: key, schema.MODEL: cfg.model.name}
    tracker = (tracking.Tracker(tracking_uri, run_id=old[-1].run_id, tags=tags) if old else
               tracking.Tracker(tracking_uri, experiment=experiment, run_name=f"baseline {cfg.model.name} {key[:8]}",
                                tags=tags))
    with tracker:
        summary = run_experiment(cfg, callbacks=[TrackingCallback(tracker, cfg), EpochProgress(label, cfg.train.max_epochs,
                                                                                               progress),
                                                 _Store(home / "baseline.pt"), *callbacks],
                                 resume=True, data=data)
        history = [float(v) for _, v in tracking.get_run_metrics(tracker.run_id, tracker.tracking_uri)
                   .get("valid_loss", [])]
        # The code the key hashed (inputs.json, written when this key's training began), not the code on disk now:
        # a checkout updated while it trained changes neither its key nor its weights (its process imported the
        # code at its start), and a record of the new code would make it unadoptable.
        code = json.loads((home / INPUTS_FILE).read_text(encoding="utf-8")).get("code") or code_digest()
        meta = {"format": BASELINE_FORMAT, "key": key, "config": cfg.to_dict(), "weight_config": weight_config(cfg),
                "data": dict(data.checksums), "code": code, "fit": summary.to_dict(),
                "valid_losses": history, "converged": summary.fit.converged,
                "still_improving": loss_still_falling(history, [], 0),
                "test": {k: {"bleu": v.bleu, "chrf": v.chrf} for k, v in summary.test.items()},
                "wall_s": time.perf_counter() - t0, "mlflow_run_id": tracker.run_id,
                "tracking_uri": tracker.tracking_uri, "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        tracker.set_tags({schema.CONVERGED: meta["converged"]})
    atomic_write_text(home / "meta.json", json.dumps(meta, indent=1, default=str) + "\n")
    progress(f"{label}: done in {_minutes(meta['wall_s'])}, {summary.epochs} epochs, valid loss "
             f"{summary.fit.best_valid_loss:.4f}, stopped by {summary.fit.stopped_by}"
             + ("" if meta["converged"] else " (NOT CONVERGED: the patience rule did not fire)"))
    return Baseline(key, home / "baseline.pt", meta, True)


INPUTS_FILE = "inputs.json"  # a baseline's key inputs (config, data, code digest), written before it trains
ADOPTIONS_FILE = "adoptions.jsonl"  # one line per later code's key that was pointed at this baseline


def key_inputs(cfg: ExperimentConfig, data_checksums: Mapping[str, str], key: str) -> dict[str, Any]:
    """What :func:`baseline_key` hashed for ``key``: the weight config, the data checksums it kept, the code."""
    splits = (cfg.data.train_split, cfg.data.valid_split)
    return {"format": BASELINE_FORMAT, "key": key, "weight_config": weight_config(cfg), "code": code_digest(),
            "data": {k: v for k, v in data_checksums.items() if k == "vocab" or k.rsplit(".", 1)[0] in splits}}


class AdoptError(SweepError):
    """A stored baseline cannot be adopted by this code (one line says why)."""


def adopt_baseline(cfg: ExperimentConfig, old_key: str, root: str | Path | None = None, *,
                   tracking_uri: str | None = None, reason: str = "") -> str:
    """Point this code's key for ``cfg``'s baseline at the baseline stored (finished, or trained part way) under
    ``old_key`` by older code, and return the new key: for a code change that changes no weight (a comment, a
    new attribute), which would otherwise retrain a baseline that took hours.

    Refused unless the stored baseline's recorded key inputs (its ``meta.json``, or the ``inputs.json`` written
    before it trained) give exactly ``old_key`` and name the same weight config and data as ``cfg`` now: only the
    code may differ. The new key becomes a link to the old directory (its checkpoints, so an interrupted training
    resumes there), the adoption is appended to its ``adoptions.jsonl`` (code digests, time, ``reason``), and its
    MLflow run is tagged with the new key (``nmtcore.baseline_adopted_from``: the old one)."""
    root = Path(root) if root is not None else default_root(cfg)
    data = prepare_data(cfg.data)
    new_key = baseline_key(cfg, data.checksums)
    old_dir = root / old_key
    if new_key == old_key:
        raise AdoptError(f"baseline {old_key[:12]} already has this code's key: nothing to adopt")
    if not old_dir.is_dir():
        stored = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        raise AdoptError(f"no baseline {old_key} under {root} (stored: {', '.join(stored) or 'none'})")
    if (root / new_key / "meta.json").is_file():
        raise AdoptError(f"{root / new_key} exists already: this code has a finished baseline of its own")
    if (root / new_key).exists():
        raise AdoptError(f"{root / new_key} holds this code's own baseline, trained part way: continue it (the same "
                         f"command without --adopt-baseline), or remove that folder to adopt {old_key[:12]} instead")
    # An adopted key is a link to the baseline it adopted (code changed twice): adopt that one, checking the
    # link's own code as recorded when it was made.
    origin = old_dir.resolve().name if old_dir.is_symlink() else old_key
    old_dir = root / origin
    record = next((json.loads((old_dir / f).read_text(encoding="utf-8")) for f in ("meta.json", INPUTS_FILE)
                   if (old_dir / f).is_file()), None)
    if record is None:
        raise AdoptError(f"baseline {old_key[:12]} records no key inputs (neither meta.json nor {INPUTS_FILE}): "
                         "cannot check that only the code differs")
    mine = key_inputs(cfg, data.checksums, new_key)
    theirs = record.get("weight_config") or {}
    diff = _config_diff(theirs, mine["weight_config"])
    if diff and not set(diff) <= set(RULE_KEYS):
        raise AdoptError(f"baseline {old_key[:12]} trained another config ({', '.join(diff[:5])}): not adoptable")
    if diff:  # only the stopping rule differs: the same weights if the rule would have stopped it where it stopped
        if "fit" not in record:
            raise AdoptError(f"baseline {old_key[:12]} did not finish under its rule ({', '.join(diff)} differ): "
                             "only a finished one can be replayed under this rule")
        why = _replays_the_same(old_dir, record, cfg)
        if why:
            raise AdoptError(f"baseline {old_key[:12]} trained under another stopping rule ({', '.join(diff)}) and "
                             f"{why}: not adoptable")
        changed = ", ".join(f"{k}: {_with_new_defaults(theirs, mine['weight_config']).get(k)!r} -> "
                            f"{mine['weight_config'][k]!r}" for k in diff)
        reason = "; ".join(x for x in (reason, f"stopping rule changed ({changed}); its recorded epochs replayed "
                                               "under the new rule stop where it stopped") if x)
    # The directory that trained is checked, not a link's key: a link made under a changed stopping rule hashed
    # the config of its day, which no record keeps; the link itself was checked when it was made.
    if _hash_key(theirs, cfg, data.checksums, record.get("code")) != origin:
        raise AdoptError(f"baseline {old_key[:12]} trained on other data or under another key format: not adoptable")
    (root / new_key).symlink_to(origin, target_is_directory=True)
    with open(old_dir / ADOPTIONS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({"key": new_key, "code": mine["code"], "from_code": record.get("code"), "reason": reason,
                            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}) + "\n")
    if _store_exists(tracking_uri):
        for run in tracking.search_runs(f"tags.`{KEY_TAG}` = '{old_key}'", tracking_uri):
            tracking.set_run_tags(run.run_id, {KEY_TAG: new_key, schema.BASELINE_ADOPTED_FROM: old_key},
                                  tracking_uri)
    return new_key


def checkpointed_epochs(run_dir: Path) -> int:
    """The last epoch an interrupted training under ``run_dir`` saved whole (with its checksum), or 0."""
    saved = epoch_checkpoints(run_dir / "checkpoints")
    return int(saved[-1].stem[len("epoch"):]) if saved else 0


def stored_baselines(root: str | Path) -> list[dict[str, Any]]:
    """Every baseline directory under ``root``: its key, whether it finished (and converged), the epochs its
    checkpoints reached, the keys adopted onto it."""
    out = []
    root = Path(root)
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()) if root.is_dir() else []:
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8")) if (d / "meta.json").is_file() else None
        adopted = [a["key"] for a in _adoptions(d)]
        out.append({"key": d.name, "finished": meta is not None, "converged": bool(meta and meta.get("converged")),
                    "epochs": meta["fit"]["epochs"] if meta else checkpointed_epochs(d / "run"), "adopted_as": adopted,
                    "created": meta.get("created") if meta else None})
    return out


def adoptable(cfg: ExperimentConfig, data_checksums: Mapping[str, str], root: str | Path) -> list[dict[str, Any]]:
    """The finished baselines under ``root`` that :func:`adopt_baseline` would accept for ``cfg``: the same weight
    config and data, trained by other code (``key``, ``created``), newest first."""
    mine = weight_config(cfg)
    out = []
    for row in (r for r in stored_baselines(root) if r["finished"]):
        meta = json.loads((Path(root) / row["key"] / "meta.json").read_text(encoding="utf-8"))
        diff = _config_diff(meta.get("weight_config") or {}, mine)
        if not set(diff) <= set(RULE_KEYS) or (diff and _replays_the_same(Path(root) / row["key"], meta, cfg)):
            continue
        if meta.get("code") and _hash_key(meta["weight_config"], cfg, data_checksums, meta["code"]) == row["key"]:
            out.append({"key": row["key"], "created": row["created"]})
    return sorted(out, key=lambda r: str(r["created"]), reverse=True)


def _config_diff(stored: Mapping[str, Any], mine: Mapping[str, Any]) -> list[str]:
    """The weight settings in which a stored baseline's recorded config differs from ``mine`` (a setting added
    since counting as its default), sorted."""
    theirs = _with_new_defaults(stored, mine)
    return sorted(k for k in set(theirs) | set(mine) if repr(theirs.get(k)) != repr(mine.get(k)))


def _replays_the_same(home: Path, meta: Mapping[str, Any], cfg: ExperimentConfig) -> str:
    """"" if ``cfg``'s stopping rule, replayed on the epochs a finished baseline recorded (its last epoch
    checkpoint's history), stops it at the epoch it stopped at with the same best epoch (so the same weights are
    tested and handed on); else what differs. A rule that would have run on past a patience stop cannot be
    replayed: that is a difference."""
    fit = meta.get("fit") or {}
    saved = epoch_checkpoints(home / "run" / "checkpoints")
    if not saved:
        return "its epoch checkpoints are gone (nothing to replay)"
    history = load_checkpoint(saved[-1])["train_state"]["history"]
    if len(history) != fit.get("epochs"):
        return f"its last checkpoint holds {len(history)} epochs, not the {fit.get('epochs')} it trained"
    then = replay(StopRule.from_config(cfg.train), history, cfg.train.warmup_updates)
    expected = fit["epochs"] if fit.get("stopped_by") == PATIENCE else None
    if (then.stopped_at, then.best_epoch) == (expected, fit.get("best_epoch")):
        return ""
    would = (f"would stop it after epoch {then.stopped_at}" if then.stopped_at else
             f"would not stop it within its {len(history)} epochs")
    return (f"this rule {would} (best {then.best_epoch}), not where it stopped (after epoch {fit.get('epochs')}, "
            f"best {fit.get('best_epoch')}, by {fit.get('stopped_by')})")


def _with_new_defaults(stored: Mapping[str, Any], mine: Mapping[str, Any]) -> dict[str, Any]:
    """``stored`` with every weight setting it lacks and ``mine`` has filled in with the setting's default: a key
    added to the config after a baseline trained did not exist for it, and a new setting's default keeps the
    behaviour the code had before it (``train.loss_guard`` false); a non-default value still differs."""
    defaults = weight_config(ExperimentConfig())
    return {**{k: defaults[k] for k in mine if k not in stored and k in defaults}, **stored}


def _adoptions(directory: Path) -> list[dict[str, Any]]:
    """The adoptions recorded in a baseline directory's ``adoptions.jsonl``, oldest first."""
    path = directory / ADOPTIONS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _store_exists(tracking_uri: str | None) -> bool:
    try:
        tracking.search_runs("tags.`nmtcore.role` = 'baseline'", tracking_uri)
        return True
    except tracking.TrackingError:
        return False


def _minutes(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
