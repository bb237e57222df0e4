"""Make sure an experiment's BERT exists before its model is built: resolve it, or make it here."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from nmtcore.bert import made_here, pretrain
from nmtcore.bert.resolve import PRETRAINED_HERE, BertNotFoundError, BertSpec, resolve_bert
from nmtcore.config import ExperimentConfig

log = logging.getLogger("nmtcore.bert")


def ensure_bert(cfg: ExperimentConfig, threads: int | None = None) -> ExperimentConfig:
    """Resolve the experiment's BERT before its model is built; pretrain it here if it is a size (or a
    ``pretrained-here`` name) nothing else answers. Returns ``cfg`` with ``model.bert.cache_dir`` and
    ``model.bert.pretrain_corpus`` defaulted from the data section (the experiment's cache, its source
    side), so the model finds what was pretrained. Idempotent and cheap once the BERT exists; call it
    once per distinct BERT in a sweep driver before trials start (concurrent calls serialise on a lock).
    """
    bc = cfg.model.bert
    if not bc.enabled:
        return cfg
    defaults: dict[str, Any] = {}
    platform_made = bc.layers > 0 or bc.name.startswith(PRETRAINED_HERE)
    if platform_made and not bc.cache_dir:
        defaults["cache_dir"] = str(cfg.data.resolved_cache_dir())
    if bc.layers > 0 and not bc.pretrain_corpus:
        defaults["pretrain_corpus"] = f"{cfg.data.corpus}:{cfg.data.src_lang}"
    if defaults:  # only the BERT section is rebuilt (and re-validated), not the whole experiment
        cfg = replace(cfg, model=replace(cfg.model, bert=replace(bc, **defaults)))
    bc = cfg.model.bert
    try:
        resolve_bert(BertSpec.from_config(bc), cache_dir=bc.cache_dir or None, pretrain_corpus=bc.pretrain_corpus,
                     pretrain_steps=bc.pretrain_steps)
        return cfg
    except BertNotFoundError:
        if not platform_made:
            raise
    here = (made_here.PretrainSpec.parse(bc.name) if bc.name else
            made_here.PretrainSpec.for_size(bc.layers, bc.hidden, bc.pretrain_corpus, bc.pretrain_steps))
    log.info("BERT %s is not reachable: pretraining %s on this machine", BertSpec.from_config(bc), here.name)
    data_cfg = replace(cfg.data, cache_dir=bc.cache_dir or str(cfg.data.resolved_cache_dir()))
    pretrain.pretrain_bert(here, data_cfg, threads=threads)
    return cfg
