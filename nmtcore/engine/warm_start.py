"""Warm starts: a trained checkpoint (the baseline's) initialises a model before training — the papers'
procedure for BERT-fused, the document-context and the mask-fusion models."""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from nmtcore.checkpoint import CheckpointError, load_checkpoint
from nmtcore.config import ExperimentConfig

log = logging.getLogger("nmtcore.engine")


@dataclass
class WarmStart:
    """What :func:`warm_start` did: parameter names loaded from the checkpoint and those left as built."""

    loaded: list[str]
    fresh: list[str]


# Fields that must agree between a warm-start checkpoint and the model (else shapes or semantics differ).
_WARM_START_FIELDS = ("encoder_layers", "decoder_layers", "d_model", "ffn_dim", "heads", "share_embeddings",
                      "pre_norm", "activation")


def warm_start(model: nn.Module, path: str | os.PathLike, cfg: ExperimentConfig, vocab: Any) -> WarmStart:
    """Initialise ``model`` from a trained checkpoint (BERT-fused / BERT-JAM's warm start from a baseline).

    Every tensor of the checkpoint must exist in the model with the same shape; model tensors it lacks
    (BERT attention, GLU, the pretrained BERT itself) keep their construction values and are reported.
    Raises :class:`CheckpointError` naming the mismatch on a different vocabulary, a differing dimension
    field (``model.d_model``...) or a tensor whose shape or name does not fit.
    """
    ckpt = load_checkpoint(Path(path))
    if "vocab" in ckpt and ckpt["vocab"]["checksum"] != vocab.checksum:
        raise CheckpointError(f"{path}: vocabulary {ckpt['vocab']['checksum'][:12]} differs from this run's "
                              f"{vocab.checksum[:12]} (warm start needs the baseline's data and vocab settings)")
    theirs = ckpt.get("config", {}).get("model", {})
    for key in _WARM_START_FIELDS:
        if key in theirs and theirs[key] != getattr(cfg.model, key):
            raise CheckpointError(f"{path}: model.{key} is {theirs[key]!r} in the checkpoint but "
                                  f"{getattr(cfg.model, key)!r} here")
    own = model.state_dict()
    state = ckpt["model"]
    for k, v in state.items():
        if k not in own:
            raise CheckpointError(f"{path}: checkpoint tensor {k} has no counterpart in {type(model).__name__}")
        if own[k].shape != v.shape:
            raise CheckpointError(f"{path}: {k} has shape {tuple(v.shape)} in the checkpoint, model expects "
                                  f"{tuple(own[k].shape)} (different vocabulary or dimensions?)")
    model.load_state_dict({**own, **state})
    fresh = [k for k in own if k not in state]
    log.info("warm start from %s: %d tensors loaded, %d kept as built: %s", path, len(state), len(fresh),
             sorted({re.sub(r"\.\d+\.", ".*.", k) for k in fresh if not k.startswith("bert.bert.")})
             + (["bert.bert.* (pretrained BERT)"] if any(k.startswith("bert.bert.") for k in fresh) else []))
    return WarmStart(loaded=list(state), fresh=fresh)
