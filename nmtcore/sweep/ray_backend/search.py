"""The Tune search of a space: its parameter space (grid dimensions enumerated, ranges sampled by Optuna's TPE,
seeds as one more dimension or as repeats), the scheduler (ASHA on the validation metric, time in epochs), and
how many samples; nothing here starts Ray."""

from __future__ import annotations


import tempfile
from typing import Any

import optuna
from ray import tune
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, TrialScheduler
from ray.tune.search import BasicVariantGenerator, Repeater
from ray.tune.search.optuna import OptunaSearch

from nmtcore.sweep.plan import SEED_KEY
from nmtcore.sweep.settings import SweepSettings
from nmtcore.sweep.space import (
    ARM_KEY,
    CELL_KEY,
    Choice,
    Grid,
    IntRange,
    LogUniform,
    SearchSpace,
    Uniform,
)



# ----------------------------------------------------------------------------------------- the search
def param_space(space: SearchSpace, seeds: int, base_seed: int, cells: bool | None = None) -> dict[str, Any]:
    """Tune's ``param_space``: a grid of the space's cells (control included) and seeds, or, for the search
    of a sampled space (``cells=False``), its ranges as Tune domains (seeds are Optuna repeats)."""
    cells = not space.sampled if cells is None else cells
    if cells:
        out_cells: dict[str, Any] = {CELL_KEY: tune.grid_search(list(range(len(space.cells()))))}
        if seeds > 1:
            out_cells[SEED_KEY] = tune.grid_search([base_seed + i for i in range(seeds)])
        return out_cells
    out: dict[str, Any] = {}
    for key, dom in space.params.items():
        if isinstance(dom, Grid):
            out[key] = tune.grid_search(list(dom.values))
        elif isinstance(dom, Choice):
            out[key] = tune.choice(list(dom.values))
        elif isinstance(dom, Uniform):
            out[key] = tune.uniform(dom.low, dom.high)
        elif isinstance(dom, LogUniform):
            out[key] = tune.loguniform(dom.low, dom.high)
        elif isinstance(dom, IntRange):
            out[key] = tune.randint(dom.low, dom.high + 1)  # Tune's upper bound is exclusive
    if space.arms:
        out[ARM_KEY] = tune.choice(list(space.arms))
    return out


def search_algorithm(space: SearchSpace, settings: SweepSettings, max_concurrent: int = 0,
                     cells: bool | None = None) -> Any:
    """Optuna TPE (seeded; wrapped in a ``Repeater`` for seeds) for the search of a sampled space, else
    the grid enumerator of the cells (which must carry the concurrency cap itself: Tune ignores
    ``max_concurrent_trials`` for an explicit variant generator)."""
    if not space.sampled if cells is None else cells:
        return BasicVariantGenerator(max_concurrent=max_concurrent)
    sampler = optuna.samplers.TPESampler(seed=settings.optuna_seed)
    searcher = OptunaSearch(sampler=sampler, metric=space.metric, mode=space.mode)
    return Repeater(searcher, repeat=settings.seeds) if settings.seeds > 1 else searcher


def scheduler(space: SearchSpace, settings: SweepSettings, max_epochs: int, cells: bool | None = None) -> Any:
    """ASHA on the space's metric with epochs as time, or FIFO (every trial runs to the end). A control
    arm is never stopped early: cells with a control run under FIFO."""
    early = space.early_stopping if settings.early_stopping is None else settings.early_stopping
    cells = not space.sampled if cells is None else cells
    if not early or (cells and any(c.control for c in space.cells())):
        return FIFOScheduler()
    return LastEpochSafeASHA(time_attr="epoch", max_t=max_epochs, grace_period=min(settings.grace_period, max_epochs),
                             reduction_factor=settings.reduction_factor, stop_last_trials=False)


class LastEpochSafeASHA(ASHAScheduler):
    """ASHA that never stops a trial at its last epoch's report, where it is about to decode and score the test
    set. ``stop_last_trials=False`` alone does not do it: Tune's brackets put a rung at ``max_t`` itself whenever
    ``max_t / grace_period`` is a power of the reduction factor (epochs 1, 2, 4 for 4 epochs), and the worse of
    two trials reaching it was stopped there, its 4 epochs trained and its test BLEU lost (seen in CI)."""

    def on_trial_result(self, tune_controller: Any, trial: Any, result: dict[str, Any]) -> str:
        if float(result.get(self._time_attr) or 0) >= self._max_t:
            return TrialScheduler.CONTINUE
        return super().on_trial_result(tune_controller, trial, result)


def reuse_trial_actors(trial_scheduler: Any) -> bool:
    """Whether a trial's Tune actor runs the next trial too (Tune's ``reuse_actors``), sparing each further
    trial the start of a process that imports torch, MLflow and Ray Train (6-7 s on 2 cores, docs/performance.md "What a
    sweep costs a trial"). Only under FIFO, where a trial ends when its function returns, i.e. once its Train
    run has finished: a trial stopped early (ASHA) leaves its function blocked in ``TorchTrainer.fit``, and a
    reused actor would keep that Train run going and fail to reset for the next trial (Tune errors that trial).
    A trial that fails is never reused (Tune does not cache its actor)."""
    return type(trial_scheduler) is FIFOScheduler  # ASHA and Tune's other early stoppers derive from it


def preview_samples(space: SearchSpace, n: int, seeds: int = 1, base_seed: int = 1,
                    optuna_seed: int = 0) -> list[dict[str, Any]]:
    """The first ``n`` trial configs the sweep's own search algorithm generates (no trial runs): grid
    expansion for grids, Optuna's suggestions for sampled spaces. What a trial receives, for tests and
    dry runs."""
    from ray.tune.search.variant_generator import generate_variants

    pspace = param_space(space, seeds, base_seed)
    if not space.sampled:
        return [cfg for _, cfg in generate_variants(pspace)][:n]  # one pass over the cells (num_samples=1)
    settings = SweepSettings(name="preview", storage=tempfile.gettempdir(), seeds=seeds, optuna_seed=optuna_seed)
    algorithm = search_algorithm(space, settings)
    algorithm.set_search_properties(space.metric, space.mode, pspace)
    return [algorithm.suggest(f"preview_{i:05d}") for i in range(n)]


def num_samples(space: SearchSpace, settings: SweepSettings, cells: bool | None = None) -> int:
    """Tune's ``num_samples``: one pass over the cells (seeds are a grid dimension), or the Optuna trials."""
    if not space.sampled if cells is None else cells:
        return 1
    return (settings.num_samples or space.num_samples) * settings.seeds
