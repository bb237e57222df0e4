"""Optimiser and learning-rate schedule (fairseq's ``adam`` + ``inverse_sqrt``)."""

from __future__ import annotations

import math
from typing import Iterable

import torch

from nmtcore.config import TrainConfig


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.Adam:
    """Adam(β1, β2, ε) over the trainable parameters; the fused kernel where the device has one."""
    params = [p for p in params if p.requires_grad]
    kwargs = dict(lr=cfg.warmup_init_lr if cfg.warmup_updates > 0 else cfg.lr, betas=tuple(cfg.adam_betas),
                  eps=cfg.adam_eps, weight_decay=cfg.weight_decay)
    try:
        return torch.optim.Adam(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # no fused kernel for this device / dtype
        return torch.optim.Adam(params, **kwargs)


class InverseSqrtSchedule:
    """fairseq ``inverse_sqrt``: linear warmup from ``warmup_init_lr`` to ``lr`` over ``warmup_updates``,
    then ``lr · sqrt(warmup_updates / num_updates)``. ``lr_at(n)`` is the rate for the update after
    ``n`` completed updates, as fairseq's ``step_update(n)``."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.lr, self.warmup, self.init_lr = cfg.lr, cfg.warmup_updates, cfg.warmup_init_lr

    def lr_at(self, num_updates: int) -> float:
        """The learning rate after ``num_updates`` updates: linear warm-up, then decay with 1/sqrt(updates)."""
        if self.warmup > 0 and num_updates < self.warmup:
            return self.init_lr + num_updates * (self.lr - self.init_lr) / self.warmup
        return self.lr * math.sqrt(max(self.warmup, 1) / max(num_updates, 1))

    def apply(self, optimizer: torch.optim.Optimizer, num_updates: int) -> float:
        """Set every parameter group's learning rate to :meth:`lr_at` and return it."""
        lr = self.lr_at(num_updates)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
