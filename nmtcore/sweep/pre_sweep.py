"""The work a sweep's trials share, run once before them as named Ray tasks on the driver's node
(:func:`nmtcore.sweep.ray_backend.run_pre_sweep_task`): the data ("prepare data ..."), every distinct BERT
("prepare BERT ...": made here if nothing answers, with its quality figure), its frozen-feature cache ("prepare
BERT features ...") and the protocol's baseline ("train baseline ..." or "reuse baseline ..."). The dashboard lists
them under the sweep's job; the console shows their progress (:class:`nmtcore.sweep.progress.PhaseProgress`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from nmtcore.bert import prepare_bert_inputs
from nmtcore.bert.ensure import ensure_bert_resolved
from nmtcore.bert.features import FeatureCache
from nmtcore.bert.layer import BertLayer, attach_shared_features
from nmtcore.config import DataConfig, ExperimentConfig
from nmtcore.data import PreparedData, prepare_data
from nmtcore.engine import setup_torch
from nmtcore.engine.phases import start_schedule
from nmtcore.models import build_model, prepare_model_resources
from nmtcore.sweep.baseline import Baseline, baseline_key, default_root, ensure_baseline, find_baseline
from nmtcore.sweep.memory import BertFootprint
from nmtcore.sweep.ray_backend import driver_node_gpus, run_pre_sweep_task


log = logging.getLogger("nmtcore.sweep")

_DATA_CHECKSUMS: dict[str, dict[str, str]] = {}  # data section -> its checksums, prepared in this process's sweeps


def _data_key(data: DataConfig) -> str:
    return json.dumps(asdict(data), sort_keys=True, default=repr)


def _prepare_data_checksums(data: DataConfig) -> dict[str, str]:
    return dict(prepare_data(data).checksums)


def prepare_data_task(data: DataConfig) -> dict[str, str]:
    """Prepare a data section (read, vocabulary, encode: cached) as the task "prepare data <corpus> <src>-<tgt>";
    returns its checksums."""
    checksums = run_pre_sweep_task(f"prepare data {data.corpus} {data.src_lang}-{data.tgt_lang}",
                                   _prepare_data_checksums, data)
    _DATA_CHECKSUMS[_data_key(data)] = checksums
    return checksums


def data_checksums(data: DataConfig) -> dict[str, str]:
    """The checksums of a data section this process's sweeps prepared already, or :func:`prepare_data_task`'s."""
    return _DATA_CHECKSUMS.get(_data_key(data)) or prepare_data_task(data)


def ensure_bert_task(cfg: ExperimentConfig, what: str, quality: bool = True) -> tuple[ExperimentConfig, BertFootprint]:
    """:func:`nmtcore.bert.ensure_bert` as the task "prepare BERT <what>" (made here if nothing answers:
    minutes, with its steps on the console), with (``quality``) its quality figure measured once (cached) so
    every trial using it reports what its BERT knows. Returns the config and the BERT's footprint (weights and
    shape, for the trials' memory estimates)."""
    return run_pre_sweep_task(f"prepare BERT {what}", _ensure_bert_footprint, cfg, quality, progress_kw="progress")


def _ensure_bert_footprint(cfg: ExperimentConfig, quality: bool = True,
                           progress: Callable[[str], None] | None = None) -> tuple[ExperimentConfig, BertFootprint]:
    made, resolved = ensure_bert_resolved(cfg, progress=progress, quality=quality)
    assert resolved is not None  # distinct_berts hands over BERT-consuming configs only
    return made, BertFootprint.of_directory(resolved.path)


def bert_features_task(cfg: ExperimentConfig, what: str, shallower: Sequence[ExperimentConfig] = ()) -> bool:
    """Build the frozen-feature cache of ``cfg``'s BERT as the task "prepare BERT features <what>" (minutes
    for a wide BERT on the whole corpus, with a line per ~15 s of it), so that no trial spends its slot on it
    silently; every trial then finds it. Those of ``shallower`` whose BERT is a bottom truncation of this one
    are built in the same pass (:func:`build_features`). Returns whether the model reads cached features at all."""
    return run_pre_sweep_task(f"prepare BERT features {what}", build_features, cfg, tuple(shallower))


def build_features(cfg: ExperimentConfig, shallower: Sequence[ExperimentConfig] = ()) -> bool:
    """The feature cache that a trial of ``cfg`` reads, built the way its trainer builds it (data prepared,
    the registered model built, its first phase applied, its BERT stream attached: the same cache keys); the
    features of every config of ``shallower`` whose BERT is a bottom truncation of ``cfg``'s are computed in the
    same pass of ``cfg``'s BERT (:func:`nmtcore.bert.layer.attach_shared_features`: bit for bit their own),
    the others are left to their own build. Every BERT must exist already. Returns whether ``cfg``'s model
    reads cached features (False: its BERT trains from the first update or runs every step)."""
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    layer = bert_stream_layer(cfg, data, use_cache=False)
    if layer is None or not layer.cache_wanted:
        return False
    members = [(layer, {name: split.bert for name, split in data.splits.items()})]
    for other in shallower:
        other_data = prepare_data(other.data)
        if other_data.splits.keys() != data.splits.keys():
            continue
        other_layer = bert_stream_layer(other, other_data, use_cache=False)
        if other_layer is not None and other_layer.cache_wanted and other_layer.truncates(layer):
            members.append((other_layer, {name: split.bert for name, split in other_data.splits.items()}))
    # Streams that read the same layers (BERT-JAM's M0, M1 and M3: every layer of one BERT) share one entry.
    shallower_labels = [label for label in dict.fromkeys(_layers_label(m) for m, _ in members[1:])
                        if label != _layers_label(layer)]
    if shallower_labels:
        log.info("BERT features of %s computed in the same pass (bottom truncations of %s)",
                 ", ".join(shallower_labels), _layers_label(layer))
    cache = FeatureCache(data.cfg.resolved_cache_dir() / "bert_features")
    for name in data.splits:
        attach_shared_features(cache, name, [(m, streams[name]) for m, streams in members])
    return True


def _layers_label(layer: BertLayer) -> str:
    """``minilm layers 0-6``: a BERT stream as the shared pass's log line names it."""
    picked = list(layer.layers)
    span = (f"{picked[0]}-{picked[-1]}" if len(picked) > 2 and picked == list(range(picked[0], picked[-1] + 1))
            else ",".join(map(str, picked)))
    return f"{layer.resolved.spec} layer{'s' if len(picked) > 1 else ''} {span}"


def bert_stream_layer(cfg: ExperimentConfig, data: PreparedData, use_cache: bool = True) -> Any:
    """The BertLayer a trial of ``cfg`` reads its BERT stream through, as its trainer sets it up (the registered
    model built, its first phase applied, the stream attached to ``data``: the same feature-cache keys); None
    for a model without BERT. ``use_cache``: build the missing features (True) or only attach the stream and
    leave the features to the caller (False)."""
    cfg = prepare_model_resources(cfg, data)
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
    start_schedule(cfg, model)  # as the trainer: a BERT its first phase fine-tunes gets no cache
    return prepare_bert_inputs(model, data, stream_only=not use_cache)


def _stored(cfg: ExperimentConfig, root: str | Path | None) -> tuple[str, Baseline | None]:
    """The key of the baseline ``cfg`` trains and that baseline if it is in the store, finished (the data is
    prepared first, if this process has not)."""
    key = baseline_key(cfg, data_checksums(cfg.data))
    return key, find_baseline(Path(root) if root is not None else default_root(cfg), key)


def baseline_stored(cfg: ExperimentConfig, root: str | Path | None = None) -> bool:
    """Whether the baseline ``cfg`` trains is in the store, finished."""
    return _stored(cfg, root)[1] is not None


def ensure_baseline_task(cfg: ExperimentConfig, root: str | Path | None = None, env: Mapping[str, str] | None = None,
                         **kwargs: Any) -> Baseline:
    """:func:`nmtcore.sweep.baseline.ensure_baseline` (same arguments) as the task "train baseline <key>"
    ("reuse baseline <key>" when it is in the store), on a GPU of the driver's node if it has one, with ``env``
    added to the task process's environment (as the trials': the allocator's preload)."""
    key, found = _stored(cfg, root)
    gpus = driver_node_gpus()
    return run_pre_sweep_task(f"{'reuse' if found else 'train'} baseline {key[:12]}", ensure_baseline, cfg, root,
                              gpus=1.0 if gpus >= 1 and found is None else 0.0, progress_kw="progress", env=env, **kwargs)
