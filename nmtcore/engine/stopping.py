"""When a run has converged: the stopping rule, and which rule ended a run.

A run is *converged* only when the patience rule fired: ``train.patience`` epochs in a row did not beat the
best ``train.stop_metric`` by more than ``train.min_delta`` (and, with ``train.loss_guard``, did not set a new
lowest validation loss either). A run that reached ``train.max_epochs`` or
``train.max_updates`` with the rule on was stopped by its **cap**; a run without the rule (or whose fixed
phase schedule ended) was stopped by its **schedule**. Reports say which (:data:`STOPPED_BY`) and call only
the first converged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from nmtcore.config import TrainConfig
from nmtcore.config.sections import STOP_METRICS

PATIENCE, CAP, SCHEDULE = "patience", "cap", "schedule"
STOPPED_BY = (PATIENCE, CAP, SCHEDULE)
# The relative fall of the validation loss below its lowest so far that counts as a gain: for the loss guard
# (``train.loss_guard``) and for asking whether a run was still improving when it stopped.
LOSS_GAIN = 0.002


@dataclass(frozen=True)
class StopRule:
    """``metric`` watched with ``patience`` epochs and a minimum gain ``min_delta`` (``patience`` 0: off)."""

    metric: str
    patience: int
    min_delta: float
    loss_guard: bool = False  # a new lowest validation loss also counts as a gain (train.loss_guard)

    @classmethod
    def from_config(cls, tc: TrainConfig) -> "StopRule":
        """The rule ``train.stop_metric`` / ``train.patience`` / ``train.min_delta`` / ``train.loss_guard``
        describe."""
        return cls(tc.stop_metric, tc.patience, tc.min_delta, tc.loss_guard)

    @property
    def higher_is_better(self) -> bool:
        """BLEU rises as a run improves, a loss falls (:data:`nmtcore.config.STOP_METRICS`)."""
        return STOP_METRICS[self.metric]

    @property
    def worst(self) -> float:
        """The starting best: any finite value improves on it."""
        return -math.inf if self.higher_is_better else math.inf

    def improves(self, value: float, best: float) -> bool:
        """Whether ``value`` beats ``best`` by more than the minimum gain."""
        if not math.isfinite(best):
            return math.isfinite(value)
        gain = value - best if self.higher_is_better else best - value
        return gain > self.min_delta

    def loss_fell(self, losses: list[float], updates: list[float], warmup_updates: int) -> bool:
        """Whether the guard counts the last of these epochs as a gain (always False without the guard): its
        validation loss is the lowest since the warm-up ended (:func:`loss_still_falling`)."""
        return self.loss_guard and loss_still_falling(losses, updates, warmup_updates)

    def fired(self, bad_epochs: int) -> bool:
        """Whether ``bad_epochs`` epochs in a row without a gain end the run."""
        return self.patience > 0 and bad_epochs >= self.patience

    def judge(self, epochs: list[Mapping[str, float]], best: float, bad_epochs: int,
              warmup_updates: int) -> tuple[bool, int]:
        """The rule after the last of ``epochs`` (each epoch's ``valid_loss``, ``num_updates`` and this rule's
        metric, all epochs so far): whether it is a new best, and the epochs in a row without a gain now. An
        epoch that ends inside the learning-rate warm-up never counts against patience: a rising rate makes a
        trained model worse before it makes it better, and the papers' second stage restarts the whole warm-up on
        the converged baseline (docs/convergence.md)."""
        last = epochs[-1]
        if self.improves(last[self.metric], best):
            return True, 0
        if self.loss_fell([e["valid_loss"] for e in epochs], [e.get("num_updates", math.nan) for e in epochs],
                          warmup_updates):
            return False, 0  # still learning by the loss: not a bad epoch; the best stays the metric's
        return False, bad_epochs + (not last.get("num_updates", math.inf) <= warmup_updates)


@dataclass(frozen=True)
class Replay:
    """Where a rule stops a recorded run: the epoch it fires after (None: it never fires on these epochs), the best
    epoch and its metric."""

    stopped_at: int | None
    best_epoch: int
    best_score: float


def replay(rule: StopRule, history: Sequence[Mapping[str, float]], warmup_updates: int) -> Replay:
    """``rule`` run over a recorded run's epochs (``history``: per epoch ``valid_loss``, ``num_updates`` and the
    rule's metric), as the trainer runs it epoch by epoch (one phase)."""
    best, best_epoch, bad = math.nan, 0, 0
    for epoch in range(1, len(history) + 1):
        improved, bad = rule.judge(list(history[:epoch]), best, bad, warmup_updates)
        if improved:
            best, best_epoch = history[epoch - 1][rule.metric], epoch
        if rule.fired(bad):
            return Replay(epoch, best_epoch, best)
    return Replay(None, best_epoch, best)


def stopped_by(stop_reason: str, rule_on: bool) -> str:
    """Which rule ended a run, from :class:`~nmtcore.engine.summary.FitResult`'s ``stop_reason`` and whether the
    patience rule applied in its last phase: ``patience``, ``cap`` (``max_epochs``/``max_updates`` reached with the
    rule on) or ``schedule`` (no rule: a fixed number of epochs, or a phase schedule that ran its length)."""
    if stop_reason.startswith("early_stopping"):
        return PATIENCE
    if rule_on and stop_reason in ("max_epochs", "max_updates"):
        return CAP
    return SCHEDULE


def loss_still_falling(losses: list[float], updates: list[float], warmup_updates: int) -> bool:
    """Whether a run's validation loss was still falling at the last of these epochs: it is below the lowest loss
    of the earlier epochs that ended after the learning-rate warm-up (``updates``: the update count at each
    epoch's end; every earlier epoch when they are not known) by more than :data:`LOSS_GAIN` of it. The first
    epoch after the warm-up falls by definition.

    The warm-up's end, not the run's start, is the reference: the papers' second stage restarts the warm-up on a
    converged model, whose loss the rising rate first pushes up; a run recovering from that is still learning
    although its loss has not yet come back below its first epoch's."""
    if not losses or not math.isfinite(losses[-1]):
        return False
    known = len(updates) == len(losses)  # an epoch whose update count is unknown (NaN) counts as after the warm-up
    earlier = [loss for i, loss in enumerate(losses[:-1]) if not known or not updates[i] <= warmup_updates]
    finite = [loss for loss in earlier if math.isfinite(loss)]
    return not finite or losses[-1] < min(finite) * (1.0 - LOSS_GAIN)
