"""One Tune run of a sweep: the Tuner built (or restored, with live callbacks and the concurrency that fits the
cluster it resumes on), fitted, and what it left (:class:`TuneOutcome`)."""

from __future__ import annotations


import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ray import tune

from nmtcore.sweep.plan import config_key, trial_overrides
from nmtcore.sweep.settings import SweepSettings, is_uri
from nmtcore.sweep.space import SearchSpace
from nmtcore.sweep.timelimit import TimeLimit
from nmtcore.sweep.timing import RECORD_EVERY_S
from nmtcore.sweep.trial import SweepContext

from nmtcore.sweep.ray_backend._private import replace_callbacks, set_concurrency
from nmtcore.sweep.ray_backend.callbacks import (_SessionRecord, _SweepCallback, _TimeLimitCallback, _TrialNames,
                                                  _TrialsConsole, _trial_name)
from nmtcore.sweep.ray_backend.cluster import DRIVER_RESOURCES, trials_that_fit
from nmtcore.sweep.ray_backend.search import num_samples, param_space, reuse_trial_actors, scheduler, search_algorithm
from nmtcore.sweep.ray_backend.trial import _named_trainable, actor_memory, trial_actor_resources

log = logging.getLogger("nmtcore.sweep")


def _saved_trials(exp_dir: str) -> list[Any]:
    """Trials as Tune saved them (what a resume would continue), or [] if unreadable."""
    quiet = logging.getLogger("ray.tune")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return list(tune.ExperimentAnalysis(exp_dir).trials)
    except Exception as e:  # pragma: no cover - e.g. a cloud URI without credentials here
        log.warning("could not read the saved experiment state at %s: %s", exp_dir, e)
        return []
    finally:
        quiet.setLevel(level)


# ============================================================================== the Tune run
@dataclass
class TuneOutcome:
    """What a Tune run left: its trials as Tune saved them (``trial_id``, ``status``, ``config``,
    ``last_result``) and how many leaked worker reservations were removed on the way."""

    trials: list[Any]
    leaked_removed: int


def _config_key_of(space: SearchSpace, base_seed: int, trial: Any) -> str:
    """A Tune trial's config key, as its MLflow run is tagged and the cost estimate keys its epochs."""
    return config_key(trial_overrides(space, trial.config, base_seed))


def run_tune(ctx: SweepContext, settings: SweepSettings, exp_dir: str, max_epochs: int, restore: bool,
             cells: bool | None = None, on_trial_end: Callable[[dict[str, Any]], None] | None = None,
             before_fit: Callable[[], None] | None = None, limit: TimeLimit | None = None,
             record: Callable[[], None] | None = None) -> TuneOutcome:
    """Run (``restore``: continue) one Tune run of ``ctx.space`` under ``exp_dir``: its cells (a grid study,
    or a sampled study's control), or (``cells=False``) the search of a sampled space. Blocks until it ends
    or is interrupted. ``before_fit`` is called once the Tuner is ready (the driver prints where to watch);
    ``limit``: the sweep's time limit, told of every trial's checkpoints (it stops the sweep once none fits);
    ``record``: called as the trials start, every :data:`~nmtcore.sweep.timing.RECORD_EVERY_S` and as each trial
    ends (the driver stores the session's time split so far)."""
    space = ctx.space
    cells = not space.sampled if cells is None else cells
    # Per worker: its estimate, and its share of the trial actor's own small reservation.
    if not ctx.trial_memory_bytes:
        per_worker = 0
    elif ctx.in_actor:  # one worker, the actor itself: what it reserves for the largest trial
        per_worker = actor_memory(ctx.trial_memory_bytes)
    else:
        per_worker = ctx.trial_memory_bytes + DRIVER_RESOURCES["memory"] // ctx.workers
    fits = trials_that_fit(settings, per_worker)
    if settings.max_concurrent > fits:
        log.warning("--max-concurrent %d > %d trials that fit the cluster: capped", settings.max_concurrent, fits)
    max_concurrent = min(settings.max_concurrent or fits, fits)
    callback = _SweepCallback(ctx, on_trial_end)
    console = _TrialsConsole(_TrialNames(space, ctx.base_seed), space.metric, max_epochs)
    key_of = functools.partial(_config_key_of, space, ctx.base_seed)
    live = ([callback, console] + ([_TimeLimitCallback(limit, key_of)] if limit is not None else [])
            + ([_SessionRecord(record, RECORD_EVERY_S)] if record is not None else []))
    trainable = tune.with_resources(tune.with_parameters(_named_trainable(ctx.name), ctx=ctx),
                                    trial_actor_resources(ctx))
    pspace = param_space(space, settings.seeds, ctx.base_seed, cells)
    name = Path(exp_dir).name
    if restore and tune.Tuner.can_restore(exp_dir):
        tuner = tune.Tuner.restore(exp_dir, trainable=trainable, param_space=pspace, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        # A restored Tuner keeps the callbacks and limits it was created with (pickled); ours must be live,
        # and the concurrency must fit the cluster the sweep resumes on.
        replace_callbacks(tuner, live)
        set_concurrency(tuner, max_concurrent)
    else:
        trial_scheduler = scheduler(space, settings, max_epochs, cells)
        tuner = tune.Tuner(
            trainable, param_space=pspace,
            tune_config=tune.TuneConfig(
                metric=space.metric, mode=space.mode,
                search_alg=search_algorithm(space, settings, max_concurrent, cells),
                scheduler=trial_scheduler,
                num_samples=num_samples(space, settings, cells),
                # A trial's own reservation holds no CPU (DRIVER_RESOURCES): without this cap Tune would start
                # every trial at once and the surplus would wait for worker CPUs until they time out.
                max_concurrent_trials=None if cells else max_concurrent,
                reuse_actors=reuse_trial_actors(trial_scheduler),
                trial_name_creator=_TrialNames(space, ctx.base_seed), trial_dirname_creator=_trial_name),
            run_config=tune.RunConfig(name=name, storage_path=str(Path(exp_dir).parent) if not is_uri(exp_dir)
                                      else exp_dir.rsplit("/", 1)[0],
                                      failure_config=tune.FailureConfig(max_failures=settings.max_failures),
                                      # Trials training in their actor report epoch checkpoints to Tune.
                                      checkpoint_config=tune.CheckpointConfig(num_to_keep=1),
                                      callbacks=live, verbose=settings.verbose))
    if before_fit is not None:
        before_fit()
    tuner.fit()
    # Tune's saved state, not the live trial objects: an interrupted run marks its running trials TERMINATED
    # in memory but saves them as unfinished, to be resumed.
    return TuneOutcome(trials=_saved_trials(exp_dir) or callback.trials, leaked_removed=callback.leaked_removed)
