"""Activation checkpointing of a layer stack: while a layer trains, only its inputs are kept for the
backward pass and its forward runs again there (:func:`torch.utils.checkpoint.checkpoint`, non-reentrant,
RNG state preserved, so dropout masks are the same in both passes and the gradients are the eager ones).

Used over the layers of a BERT being fine-tuned (BERT-JAM phase 3, PLM-sponsored's encoder and decoder
BERTs), whose activations otherwise dominate a trial's peak memory. A frozen layer, a layer in eval mode
and a forward without autograd run as before.
"""

from __future__ import annotations

import functools
from typing import Any, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class _RecomputedForward:
    """A checkpointed layer's ``forward``, set on the instance: its class, parameters and state_dict stay
    as they are (checkpoints and weight fingerprints do not change). Holds the layer itself, not a bound
    method, so a deep copy of the model checkpoints its own copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        m = self.module
        forward = functools.partial(type(m).forward, m)
        if m.training and torch.is_grad_enabled() and any(p.requires_grad for p in m.parameters()):
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return forward(*args, **kwargs)


def checkpoint_layers(layers: Iterable[nn.Module]) -> int:
    """Checkpoint each of ``layers`` (idempotent); returns how many layers are checkpointed."""
    n = 0
    for layer in layers:
        if not is_checkpointed(layer):
            layer.forward = _RecomputedForward(layer)
        n += 1
    return n


def is_checkpointed(layer: nn.Module) -> bool:
    """Whether :func:`checkpoint_layers` has wrapped ``layer``."""
    return isinstance(layer.__dict__.get("forward"), _RecomputedForward)
