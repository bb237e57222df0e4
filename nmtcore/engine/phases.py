"""Phases are data (BERT-JAM Section 2.4): a schedule of :class:`~nmtcore.config.PhaseConfig`
(``train.phases``, else the model's :meth:`~nmtcore.models.NMTModel.default_phases`) that the trainer reads at
epoch boundaries — which named parameter groups train, the GLU scale told to the model, early stopping.

A schedule is honoured or refused, never cut: ``train.max_epochs`` (and ``train.max_updates``) must cover
every phase, else a one-line :class:`~nmtcore.config.ConfigError` before training; ``train.phase_scale``
scales every phase explicitly (each >= 1 epoch), and the trainer logs the schedule it runs.
"""

from __future__ import annotations

import math

from torch import nn

from nmtcore.config import ConfigError, ExperimentConfig, PhaseConfig
from nmtcore.config.sections import describe_phases
from nmtcore.models import NMTModel


def schedule_of(cfg: ExperimentConfig, model: NMTModel) -> tuple[PhaseConfig, ...]:
    """The phase schedule the run follows: ``train.phases``, else the model's ``default_phases()``, else ()
    (one implicit phase that leaves ``requires_grad`` as the model set it), scaled by ``train.phase_scale``.
    Raises a one-line :class:`~nmtcore.config.ConfigError` when ``train.max_epochs`` cannot run all of it."""
    if cfg.train.phases:
        return cfg.train.schedule(cfg.train.phases, "train.phases")
    phases = tuple(model.default_phases())
    return cfg.train.schedule(phases, f"model {cfg.model.name}'s default schedule")



def start_schedule(cfg: ExperimentConfig, model: NMTModel) -> tuple[PhaseConfig, ...]:
    """:func:`schedule_of`, with its first phase's trainable set applied to ``model`` (no schedule: ``requires_grad``
    stays as the model set it). What trains from the first update decides whether a BERT gets a frozen-feature
    cache (:func:`nmtcore.bert.prepare_bert_inputs`): one fine-tuned from the start would never read it."""
    phases = schedule_of(cfg, model)
    if phases:
        apply_phase(model, phases[0])
    return phases

def check_update_budget(phases: tuple[PhaseConfig, ...], max_updates: int, updates_per_epoch: int) -> None:
    """``train.max_updates`` must not cut a closed schedule either: one-line :class:`ConfigError` naming the
    updates the schedule needs (``updates_per_epoch`` × its epochs) and the budget."""
    length = schedule_length(phases)
    if not max_updates or not phases or math.isinf(length):
        return
    need = int(length) * updates_per_epoch
    if max_updates < need:
        raise ConfigError(f"train.max_updates: {max_updates} updates cannot run the {int(length)}-epoch phase schedule "
                          f"({describe_phases(phases)}, {updates_per_epoch} updates per epoch = {need} updates); set "
                          f"train.max_updates=0 or >= {need}, or shorten the schedule with train.phase_scale")


def phase_start(phases: tuple[PhaseConfig, ...], index: int) -> int:
    """First epoch (1-based) of phase ``index``."""
    return 1 + sum(p.epochs for p in phases[:index])


def phase_index(phases: tuple[PhaseConfig, ...], epoch: int) -> int:
    """The phase epoch ``epoch`` (1-based) belongs to (the last one past the schedule's end)."""
    for i in range(len(phases)):
        if phases[i].epochs == 0 or epoch < phase_start(phases, i) + phases[i].epochs:
            return i
    return len(phases) - 1


def saved_phase(phases: tuple[PhaseConfig, ...], history: list[dict[str, float]], epoch: int) -> int:
    """The phase a checkpoint was saved in: its last epoch's (``phase`` in the epoch history, 1-based), else
    (a checkpoint before any epoch, or one without phases recorded) the one ``epoch`` falls in."""
    if history and "phase" in history[-1]:
        return min(int(history[-1]["phase"]) - 1, len(phases) - 1)
    return phase_index(phases, max(epoch, 1))


def schedule_length(phases: tuple[PhaseConfig, ...]) -> float:
    """Total epochs of the schedule; inf without one or with an open-ended last phase."""
    if not phases or phases[-1].epochs == 0:
        return math.inf
    return sum(p.epochs for p in phases)


def parameter_groups(model: NMTModel) -> dict[str, list[nn.Parameter]]:
    """The model's named parameter groups (:meth:`~nmtcore.models.NMTModel.parameter_groups`), checked:
    every parameter must be in exactly one group."""
    groups = model.parameter_groups()
    seen: dict[int, str] = {}
    for name, params in groups.items():
        for p in params:
            if id(p) in seen:
                raise ValueError(f"parameter in groups {seen[id(p)]!r} and {name!r} of {type(model).__name__}")
            seen[id(p)] = name
    if len(seen) != len({id(p) for p in model.parameters()}):
        raise ValueError(f"{type(model).__name__}.parameter_groups() leaves parameters out")
    return groups


def apply_phase(model: NMTModel, phase: PhaseConfig) -> dict[str, int]:
    """Make exactly the groups ``phase.trainable`` trainable and tell the model (``set_phase``). Returns
    trainable parameter counts per group."""
    groups = parameter_groups(model)
    unknown = sorted(set(phase.trainable) - set(groups))
    if unknown:
        raise ConfigError(f"train.phases[{phase.name}].trainable: unknown parameter group(s) {unknown}; "
                          f"{type(model).__name__} has {sorted(groups)}")
    for name, params in groups.items():
        for p in params:
            p.requires_grad_(name in phase.trainable)
    model.set_phase(phase)
    return {name: sum(p.numel() for p in params if p.requires_grad) for name, params in groups.items()}
