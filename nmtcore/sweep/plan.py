"""A sweep's plan, pure Python (no Ray): which trials a search space and a base experiment make, their
overrides, keys, labels and configs, and everything that can be checked before anything runs.

A trial's config is the base experiment with the trial's flat overrides applied by the one override
engine (:meth:`~nmtcore.config.ExperimentConfig.with_overrides`), so a trial trains exactly what
``nmtcore train --set ...`` with the same overrides would.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Mapping, Sequence

from nmtcore.config import MODEL_CONFIGS, ConfigError, ExperimentConfig
from nmtcore.sweep.space import CELL_KEY, SearchSpace, SpaceError, point_label

SEED_KEY = "train.seed"
TRIAL_INDEX_KEY = "__trial_index__"  # set by tune's Repeater on repeated samples


def trial_point(space: SearchSpace, sample: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The varied values of one Tune sample and whether it is the control: a grid's sample names a cell
    (:meth:`~nmtcore.sweep.space.SearchSpace.cells`), a sampled space's sample holds the values."""
    if CELL_KEY in sample:
        cell = space.cells()[int(plain(sample[CELL_KEY]))]
        return dict(cell.point), cell.control
    return {k: plain(sample[k]) for k in space.varied_keys if k in sample}, False


def trial_overrides(space: SearchSpace, sample: Mapping[str, Any], base_seed: int) -> dict[str, Any]:
    """The flat config overrides of one Tune sample: its cell's (or sampled point's) overrides plus the
    trial's seed (a grid dimension, or ``base_seed + __trial_index__`` under Optuna repeats)."""
    if CELL_KEY in sample:
        overrides = dict(space.cells()[int(plain(sample[CELL_KEY]))].overrides)
    else:
        overrides = space.overrides(trial_point(space, sample)[0])
    if SEED_KEY in sample:
        overrides[SEED_KEY] = int(plain(sample[SEED_KEY]))
    elif TRIAL_INDEX_KEY in sample:
        overrides[SEED_KEY] = base_seed + int(plain(sample[TRIAL_INDEX_KEY]))
    return overrides


def trial_key(overrides: Mapping[str, Any]) -> str:
    """A short stable id of a trial's overrides (order-insensitive; floats by repr)."""
    text = json.dumps({k: plain(v) for k, v in overrides.items()}, sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def config_key(overrides: Mapping[str, Any]) -> str:
    """The trial key without the seed: trials that differ only by seed share it (report groups)."""
    return trial_key({k: v for k, v in overrides.items() if k != SEED_KEY})


def check_registered(model: str) -> None:
    """Raise :class:`SpaceError` naming the registered models if ``model`` is not one of them."""
    if model not in MODEL_CONFIGS:
        raise SpaceError(f"model {model!r} is not registered (registered: {', '.join(sorted(MODEL_CONFIGS))})")


def trial_config(base: ExperimentConfig, overrides: Mapping[str, Any], output_dir: str | os.PathLike,
                 threads: int = 0) -> ExperimentConfig:
    """The experiment one trial trains: ``base`` + ``overrides``, writing under ``output_dir``;
    ``threads`` sets ``train.num_threads`` unless the base config fixes it."""
    extra: dict[str, Any] = {"output_dir": str(output_dir), "train.save_dir": ""}
    if threads and not base.train.num_threads:
        extra["train.num_threads"] = threads
    return base.with_overrides({**overrides, **extra})


def validate_space(space: SearchSpace, base: ExperimentConfig, seeds: int = 1) -> None:
    """Everything that can be checked before Ray starts, each failure one line:

    the model is registered; every cell and every example point (all grid values, both ends of every
    range, every arm) builds a valid config; distinct points give distinct configs; the metric is produced
    (``valid_bleu`` needs ``train.valid_bleu``); ``--seeds`` does not fight a varied seed; a warm-starting
    protocol only warm-starts families whose parameters extend the baseline's.
    """
    model = space.model or base.model.name
    check_registered(model)
    if seeds > 1 and SEED_KEY in space.config_keys():
        raise SpaceError(f"{space.name}: varies {SEED_KEY}; --seeds would repeat it")
    if space.metric == "valid_bleu" and not base.train.valid_bleu:
        raise SpaceError(f"{space.name}: metric valid_bleu needs train.valid_bleu=true")
    overrides = [dict(c.overrides) for c in space.cells()]
    if space.sampled:
        overrides += [space.overrides(point) for point in space.example_points()]
    seen: dict[str, dict[str, Any]] = {}
    for o in overrides:
        try:
            cfg = base.with_overrides(o)
        except ConfigError as e:
            raise SpaceError(f"{space.name}: {e}") from None
        if space.protocol is not None and space.protocol.warm_start and not type(cfg.model).warm_starts_from_baseline:
            raise SpaceError(f"{space.name}: {cfg.model.name} cannot be warm-started from a {space.protocol.baseline_model}"
                             " baseline (its parameters do not extend the baseline's); set the study's protocol "
                             "warm_start=False")
        flat = json.dumps(cfg.flat(), sort_keys=True, default=repr)
        if flat in seen and seen[flat] != o:
            raise SpaceError(f"{space.name}: overrides {seen[flat]} and {o} give the same config")
        seen[flat] = o


def baseline_config(space: SearchSpace, base: ExperimentConfig) -> ExperimentConfig:
    """The shared baseline of a warm-starting study: the base experiment with the protocol's baseline model
    (no BERT) and the baseline's own budget."""
    if space.protocol is None:
        raise SpaceError(f"{space.name} has no protocol, hence no baseline")
    return base.with_overrides({**space.protocol.control_overrides(), **space.protocol.baseline_budget})


def run_label(point: Mapping[str, Any], seed: int | None = None) -> str:
    """A readable MLflow run name from the trial's point: ``layers=2 hidden=128 seed 1``, ``control seed 1``."""
    label = point_label({k: plain(v) for k, v in point.items() if k != TRIAL_INDEX_KEY})
    return f"{label} seed {seed}" if seed is not None else label


def distinct_berts(space: SearchSpace, base: ExperimentConfig, streams: bool = False) -> list[ExperimentConfig]:
    """One trial config per distinct BERT the space uses (every grid point; a sampled space's model), so a
    driver can make each exist once before trials start. ``streams``: one per distinct input stream of a BERT
    instead (:func:`stream_key`): a document model's real, random and fixed context are three streams of one
    BERT, each with feature caches of its own."""
    points: list[Any] = space.example_points() if not space.sampled else [None]
    seen: set[str] = set()
    out: list[ExperimentConfig] = []
    for point in points:
        overrides = trial_overrides(space, point, base.train.seed) if point is not None else (
            {"model.name": space.model} if space.model else {})
        try:
            cfg = base.with_overrides(overrides)
        except ConfigError:
            continue  # a sampled space's range ends were checked by validate_space; nothing to prepare
        key = bert_key(cfg) + (stream_key(cfg) if streams else "")
        if cfg.model.bert.enabled and key not in seen:
            seen.add(key)
            out.append(cfg)
    return out


# Besides the BERT itself, what decides the stream it reads (its feature-cache keys): the model that builds the stream,
# and a document model's context (the previous sentence, random words or a fixed sentence before [SEP]).
STREAM_KEYS = ("model.name", "model.context_type", "model.fixed_context", "model.random_context_seed")


def stream_key(cfg: ExperimentConfig) -> str:
    """What identifies a trial's BERT input stream beyond its BERT (:data:`STREAM_KEYS`)."""
    flat = cfg.flat()
    return json.dumps({k: flat.get(k) for k in STREAM_KEYS}, sort_keys=True, default=str)


def stream_label(cfg: ExperimentConfig, streams: Sequence[ExperimentConfig]) -> str:
    """What the console adds to a BERT's name for ``cfg``'s stream: ``", random context"`` where ``streams`` (those
    of :func:`distinct_berts` with ``streams=True``) hold more than one stream of that BERT, else nothing."""
    if sum(bert_key(s) == bert_key(cfg) for s in streams) < 2:
        return ""
    return f", {getattr(cfg.model, 'context_type', cfg.model.name)} context"


def bert_key(cfg: ExperimentConfig) -> str:
    """What identifies a trial's BERT: its ``model.bert.*`` settings (one pre-sweep task per distinct key)."""
    return json.dumps({k: v for k, v in cfg.flat().items() if k.startswith("model.bert.")}, sort_keys=True, default=str)


def plain(v: Any) -> Any:
    """numpy scalars (as Tune samples them) → Python scalars."""
    item = getattr(v, "item", None)
    return item() if callable(item) and not isinstance(v, (list, tuple, dict, str)) else v


def fmt(v: Any) -> str:
    """A value as a run name shows it (floats to 4 significant digits)."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def expected_trials(space: SearchSpace, seeds: int, num_samples: int = 0) -> int:
    """How many trials a complete sweep has: every cell per seed, plus the samples per seed."""
    sampled = (num_samples or space.num_samples) * seeds if space.sampled else 0
    return len(space.cells()) * seeds + sampled
