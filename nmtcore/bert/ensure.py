"""Make sure an experiment's BERT exists before its model is built: resolve it, or make it here."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from nmtcore.bert import distill, made_here, pretrain
from nmtcore.bert.distilled import DistillSpec
from nmtcore.bert.quality import quality_of
from nmtcore.bert.resolve import (DISTILLED, PRETRAINED_HERE, BertNotFoundError, BertSpec, ResolvedBert,
                                  offline_for_size, resolve_bert)
from nmtcore.config import BertConfig, DataConfig, ExperimentConfig
from nmtcore.data import DataError

log = logging.getLogger("nmtcore.bert")


def with_bert_defaults(cfg: ExperimentConfig) -> ExperimentConfig:
    """``cfg`` with ``model.bert.cache_dir`` (the experiment's cache) and, for a size,
    ``model.bert.pretrain_corpus`` (the experiment's source side) filled in when unset."""
    bc = cfg.model.bert
    if not bc.enabled:
        return cfg
    defaults: dict[str, Any] = {}
    if not bc.cache_dir:
        defaults["cache_dir"] = str(cfg.data.resolved_cache_dir())
    if bc.layers > 0 and not bc.pretrain_corpus:
        defaults["pretrain_corpus"] = f"{cfg.data.corpus}:{cfg.data.src_lang}"
    if defaults:  # only the BERT section is rebuilt (and re-validated), not the whole experiment
        cfg = replace(cfg, model=replace(cfg.model, bert=replace(bc, **defaults)))
    return cfg


def build_bert(bc: BertConfig, data: DataConfig, threads: int | None = None,
               progress: Callable[[str], None] | None = None) -> ResolvedBert:
    """Resolve ``bc``'s BERT, making it here first if it is one the platform makes (a truncation or an
    offline copy: seconds to a minute; a distilled student or an MLM-pretrained BERT: minutes). Idempotent,
    cheap once made; concurrent builders of one BERT serialise on a lock and the second reuses the first."""
    cache = Path(bc.cache_dir) if bc.cache_dir else data.resolved_cache_dir()
    spec = BertSpec.from_config(bc)

    def resolve() -> ResolvedBert:
        return resolve_bert(spec, cache_dir=cache, pretrain_corpus=bc.pretrain_corpus, pretrain_steps=bc.pretrain_steps)

    try:
        return resolve()
    except BertNotFoundError:
        name = bc.name or offline_for_size(bc.layers, bc.hidden, bc.pretrain_corpus, bc.pretrain_steps)
        if not name.startswith((DISTILLED, PRETRAINED_HERE)):
            raise
    data_cfg = replace(data, cache_dir=str(cache))
    if name.startswith(DISTILLED):
        log.info("BERT %s: no hub answers; distilling %s on this machine", spec, name)
        distill.distill_bert(DistillSpec.parse(name), data_cfg, cache, threads=threads, progress=progress)
    else:
        here = made_here.PretrainSpec.parse(name)
        log.info("BERT %s: no hub answers; pretraining %s on this machine", spec, here.name)
        pretrain.pretrain_bert(here, data_cfg, threads=threads, progress=progress)
    return resolve()


def ensure_bert(cfg: ExperimentConfig, threads: int | None = None, progress: Callable[[str], None] | None = None,
                quality: bool = False) -> ExperimentConfig:
    """:func:`build_bert` for the experiment's BERT; returns ``cfg`` with the BERT defaults
    (:func:`with_bert_defaults`) so the model finds what was made. ``quality``: also measure (once, cached)
    its quality figure on held-out text of the source language, which every run using it then reports
    (skipped, with a log line, when Multi30k's text of that language cannot be found). Call it once per
    distinct BERT in a sweep driver before trials start."""
    return ensure_bert_resolved(cfg, threads, progress, quality)[0]


def ensure_bert_resolved(cfg: ExperimentConfig, threads: int | None = None,
                         progress: Callable[[str], None] | None = None,
                         quality: bool = False) -> tuple[ExperimentConfig, ResolvedBert | None]:
    """:func:`ensure_bert`, also returning the BERT it resolved (None when the experiment has none)."""
    cfg = with_bert_defaults(cfg)
    bc = cfg.model.bert
    if not bc.enabled:
        return cfg, None
    resolved = build_bert(bc, cfg.data, threads=threads, progress=progress)
    if quality:
        try:
            q = quality_of(resolved, cfg.data.src_lang, replace(cfg.data, download=False), Path(bc.cache_dir))
            (progress or log.info)(f"BERT {resolved.name}: {q.describe()}")
        except DataError as e:
            log.info("BERT %s: no quality figure (%s)", resolved.name, e)
    return cfg, resolved
