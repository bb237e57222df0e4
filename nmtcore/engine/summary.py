"""What a training run reports: typed results of :meth:`~nmtcore.engine.trainer.Trainer.fit` and of
:func:`~nmtcore.engine.experiment.run_experiment` (plain data: no torch, JSON-ready with ``to_dict``)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class FitResult:
    """How :meth:`Trainer.fit` ended: epochs and updates done, why it stopped (with a schedule: why its last
    phase stopped, ``end_of_schedule``, ``early_stopping(patience=N)``, ``max_epochs`` or ``max_updates``),
    the phase it ended in (None without a schedule), the best epoch by ``train.stop_metric``; the schedule run
    (phase → epochs, after ``train.phase_scale``), that scale, the epoch each phase began, and which rule
    ended the run (:func:`nmtcore.engine.stopping.stopped_by`) with the metric it watched."""

    epochs: int
    num_updates: int
    stop_reason: str
    phase: str | None
    best_epoch: int
    best_valid_loss: float
    fit_wall_s: float
    schedule: dict[str, int] = field(default_factory=dict)
    phase_scale: float = 1.0
    phase_starts: dict[str, int] = field(default_factory=dict)
    stopped_by: str = "schedule"  # nmtcore.engine.stopping.STOPPED_BY: patience (converged), cap or schedule
    stop_metric: str = "valid_loss"
    best_score: float = float("nan")  # the best epoch's stop_metric

    @property
    def converged(self) -> bool:
        """True only when the patience rule ended the run."""
        return self.stopped_by == "patience"


@dataclass
class TestScore:
    """One test split decoded with ``cfg.decode``: sacreBLEU BLEU and chrF, where the hypotheses are, speed; BLEU's
    brevity penalty, its 1- to 4-gram precisions (%) and the output's length over the references' (BLEU's tokens):
    a shorter output loses BLEU at equal precision."""

    __test__ = False  # not a pytest test class

    bleu: float
    chrf: float
    signature: str
    hyp_path: str
    decode_wall_s: float
    sentences_per_s: float
    bp: float = math.nan
    len_ratio: float = math.nan
    precisions: tuple[float, ...] = ()


@dataclass
class WarmStartSummary:
    """What a warm start loaded: the checkpoint, and how many tensors were loaded or left as built."""

    source: str
    loaded: int
    fresh: int


@dataclass
class RunSummary:
    """What :func:`run_experiment` returns (and the tracking callback logs)."""

    fit: FitResult
    resumed: bool
    final_model: str
    parameters: int
    trainable_parameters: int
    train_tokens_per_s: float
    test: dict[str, TestScore] = field(default_factory=dict)
    warm_start: WarmStartSummary | None = None

    @property
    def epochs(self) -> int:
        return self.fit.epochs

    @property
    def stop_reason(self) -> str:
        return self.fit.stop_reason

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready), the fit's fields at the top level."""
        d = asdict(self)
        return {**d.pop("fit"), **d}
