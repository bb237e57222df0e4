"""The driver's Tune callbacks: :class:`_SweepCallback` keeps each trial's MLflow record in step with Tune (ends
the child runs of stopped and failed trials, removes leaked worker reservations), :class:`_TrialsConsole` prints
the trials' progress lines, :class:`_TimeLimitCallback` stops the sweep before its ``--time-limit``,
:class:`_SessionRecord` keeps the session's time split on MLflow while trials run; and the names Tune shows for
trials."""

from __future__ import annotations


import contextlib
import logging
import math
import time
from typing import Any, Callable

from ray import tune

from nmtcore import tracking
from nmtcore.sweep.lifecycle import (FAILURE_KIND_TAG, TUNE_STATUS_TAG, TrialState, end_trial, find_child_run,
                                     trial_state)
from nmtcore.sweep.plan import SEED_KEY, trial_key, trial_overrides, trial_point
from nmtcore.sweep.progress import HEARTBEAT_S, PhaseProgress, console_line, duration
from nmtcore.sweep.space import SearchSpace
from nmtcore.sweep.timelimit import TimeLimit, clock_time
from nmtcore.sweep.trial import SHARED_KEY, SweepContext, failure_reason, is_out_of_memory, run_name
from nmtcore.tracking import schema

from nmtcore.sweep.ray_backend._private import remove_leaked_placement_groups
from nmtcore.sweep.ray_backend.cluster import yield_control_plane

log = logging.getLogger("nmtcore.sweep")


class _SweepCallback(tune.Callback):
    """Keeps MLflow in step with Tune and keeps the cluster free of leaked worker reservations.

    * a trial stopped by the scheduler (ASHA) leaves its child run RUNNING, or KILLED by its own process: end
      it FINISHED, tagged ``stopped_early`` with the epoch it reached;
    * a trial that errored for good: end its child run FAILED with the reason;
    * before each trial starts, after each ends, and every ``pg_check_s``: remove placement groups
      whose creating actor (a Train controller of a stopped trial) is dead — nothing can ever use
      them, and a leaked one makes the next trial's worker group wait forever.
    """

    def __init__(self, ctx: SweepContext, on_trial_end: Callable[[dict[str, Any]], None] | None = None,
                 pg_check_s: float = 10.0) -> None:
        self.ctx = ctx
        self.on_trial_end_hook = on_trial_end
        self.pg_check_s = pg_check_s
        self._last_pg_check = 0.0
        self.trials: list[Any] = []
        self.leaked_removed = 0

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        self.trials = trials
        if time.monotonic() - self._last_pg_check > self.pg_check_s:
            self._clean()

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.trials = trials
        self._clean()
        yield_control_plane()

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        run = self._child(trial)
        # Stopped by the scheduler: still RUNNING, or already KILLED by its own process (Tune's stop reaches the
        # training as an exit; it cannot tell a scheduler's stop from a stopped sweep's)
        if run is not None and (run.status == "RUNNING" or trial_state(run) == TrialState.KILLED.value):
            epoch = (trial.last_result or {}).get("epoch")
            end_trial(run.run_id, TrialState.STOPPED_EARLY, self.ctx.tracking_uri,
                      reason=f"stopped early by the scheduler at epoch {'?' if epoch is None else f'{epoch:g}'}",
                      tags={schema.STOPPED_AT_EPOCH: epoch if epoch is not None else "",
                            TUNE_STATUS_TAG: "TERMINATED"}, only_if_running=False)
        self._ended(trial, "TERMINATED", run)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        run = self._child(trial)
        if run is not None:
            reason = "trial failed"
            with contextlib.suppress(Exception):
                err = trial.get_pickled_error()
                reason = failure_reason(err) if err is not None else reason
            # Ray's memory monitor killing a trial actor that trains (ctx.in_actor) ends the trial here, not
            # in _trial_main: its retry must see the kind too, and end at once.
            oom = {FAILURE_KIND_TAG: "oom"} if is_out_of_memory(reason) else {}
            end_trial(run.run_id, TrialState.FAILED, self.ctx.tracking_uri, reason=reason,
                      tags={TUNE_STATUS_TAG: "ERROR", **oom})
            with contextlib.suppress(Exception):  # a run the worker already ended FAILED: say what Tune saw
                tracking.set_run_tags(run.run_id, {TUNE_STATUS_TAG: "ERROR"}, self.ctx.tracking_uri)
        self._ended(trial, "ERROR", run)

    def _ended(self, trial: Any, status: str, run: Any) -> None:
        self._clean()
        if self.on_trial_end_hook is not None:
            self.on_trial_end_hook({"trial_id": trial.trial_id, "status": status, "config": dict(trial.config),
                                    "run_id": getattr(run, "run_id", None), "last_result": dict(trial.last_result or {})})

    def _child(self, trial: Any) -> tracking.RunRecord | None:
        try:
            key = trial_key(trial_overrides(self.ctx.space, trial.config, self.ctx.base_seed))
            return find_child_run(self.ctx.parent_run_id, key, self.ctx.tracking_uri)
        except Exception as e:  # never let bookkeeping kill the sweep
            log.warning("could not look up the MLflow run of trial %s: %s", trial.trial_id, e)
            return None

    def _clean(self) -> None:
        self._last_pg_check = time.monotonic()
        self.leaked_removed += remove_leaked_placement_groups()


class _TrialsConsole(tune.Callback):
    """The console of the trial phase, one timestamped line at a time: a trial started; each epoch it reports
    (a bar over the sweep's epochs, the metric, how long the trial has run); how it ended; and, whenever the
    console has been silent for :data:`~nmtcore.sweep.progress.HEARTBEAT_S`, where every trial stands (Tune's
    own status table is not printed when the output is not a terminal, and an epoch can take many minutes)."""

    def __init__(self, name_of: Callable[[Any], str], metric: str, max_epochs: int,
                 out: Callable[[str], None] | None = None, heartbeat_s: float = HEARTBEAT_S) -> None:
        self.name_of, self.metric, self.max_epochs = name_of, metric, max_epochs
        self.out = out or console_line
        self.heartbeat_s = heartbeat_s
        self.started: dict[str, float] = {}
        self.said_shared: set[str] = set()  # the trials whose shared start has been told
        self._last_line = time.monotonic()

    def _say(self, text: str) -> None:
        self.out(text)
        self._last_line = time.monotonic()

    def _epoch(self, trial: Any) -> int:
        return int((trial.last_result or {}).get("epoch") or 0)

    def _ran(self, trial: Any) -> str:
        t0 = self.started.get(trial.trial_id)
        return "" if t0 is None else duration(time.monotonic() - t0)

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self.started.setdefault(trial.trial_id, time.monotonic())
        epoch = self._epoch(trial)
        # Tune knows the last epoch the trial reported; its newest checkpoint can be one later (saved, then the
        # stop came before the report), and that is where it continues.
        self._say(f"trial {self.name_of(trial)}: started" + (
            f" (resumed: last reported epoch {epoch}; it continues from its newest checkpoint)" if epoch else ""))

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        if result.get(SHARED_KEY):  # an epoch of phases another trial trained (nmtcore.engine.shared_phases)
            if trial.trial_id not in self.said_shared:
                self.said_shared.add(trial.trial_id)
                self._say(f"trial {self.name_of(trial)}: starts where another trial's phases ended, not trained "
                          f"again: {result[SHARED_KEY]}")
            return
        epoch = int(result.get("epoch") or 0)
        value = result.get(self.metric)
        shown = f" {self.metric} {value:.2f}" if isinstance(value, (int, float)) else ""
        self._say(f"trial {self.name_of(trial)}: {PhaseProgress.bar(epoch, self.max_epochs)} "
                  f"epoch {epoch}/{self.max_epochs}{shown} ({self._ran(trial)} so far)")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        result = trial.last_result or {}
        epoch, rule = self._epoch(trial), result.get("stopped_by")
        if result.get("reused_from"):  # trained before by another sweep: copied (nmtcore.sweep.reuse)
            self._say(f"trial {self.name_of(trial)}: copied, not trained again: run {result['reused_from']} of sweep "
                      f"{result.get('reused_from_sweep', '?')} trained the same config with the same seed, code, data "
                      f"and starting weights (stopped after epoch {epoch}{f' by {rule}' if rule else ''})")
            return
        if rule:  # the trial trained to its end: its own stopping rule (or cap, or schedule) ended it
            best = f", best epoch {int(result['best_epoch'])}" if result.get("best_epoch") else ""
            how = f"done after epoch {epoch}: stopped by {rule}{best}"
        elif result.get("trial_complete"):  # scored by an earlier attempt (its record predates stopped_by)
            how = f"done after epoch {epoch}"
        else:
            how = f"stopped by the scheduler after epoch {epoch}"
        self._say(f"trial {self.name_of(trial)}: {how} in {self._ran(trial)}")

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._say(f"trial {self.name_of(trial)}: FAILED after epoch {self._epoch(trial)} ({self._ran(trial)}); "
                  "Tune retries it from its last checkpoint while it has retries left (not one that ran out of "
                  "memory or whose loss became non-finite: those end at once)")

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if time.monotonic() - self._last_line >= self.heartbeat_s:
            self._say(self.standing(trials))

    def standing(self, trials: list[Any]) -> str:
        """``trials: 2 running, 1 pending, 1 done · L2-H384 seed 1 epoch 1/3, 12.5 min; …``"""
        counts: dict[str, int] = {}
        for t in trials:
            counts[t.status] = counts.get(t.status, 0) + 1
        words = {"RUNNING": "running", "PENDING": "pending", "PAUSED": "paused", "TERMINATED": "done",
                 "ERROR": "failed"}
        head = ", ".join(f"{n} {words.get(status, status.lower())}" for status, n in counts.items())
        running = "; ".join(f"{self.name_of(t)} epoch {self._epoch(t)}/{self.max_epochs}, {self._ran(t)}"
                            for t in trials if t.status == "RUNNING")
        return f"trials: {head or 'none yet'}" + (f" · {running}" if running else "")


class _TimeLimitCallback(tune.Callback):
    """Tells the sweep's :class:`~nmtcore.sweep.timelimit.TimeLimit` of each epoch checkpoint (a trial's result:
    trials report with a checkpoint at every epoch's end) and stops the sweep right after one once no running trial
    can write another before the limit. Pickled with the Tuner, it leaves the limit behind (a restored Tuner gets
    a live one)."""

    def __init__(self, limit: TimeLimit | None, key_of: Callable[[Any], str] | None = None) -> None:
        self.limit = limit
        self.key_of = key_of  # a trial's config key (what the estimate's epoch times are keyed by)

    def __getstate__(self) -> dict[str, Any]:
        return {"limit": None, "key_of": None}

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        # A resumed trial continues from its checkpoint now, and its last epoch's time is known from the session
        # that reported it: its next checkpoint can be foreseen before it writes one here. A new trial's, from
        # the sweep's estimate of its epoch, where there is one.
        if self.limit is None:
            return
        epoch_s = (trial.last_result or {}).get("time_this_iter_s")
        if epoch_s:
            self.limit.checkpointed(trial.trial_id, float(epoch_s))
        elif self.key_of is None or not self.limit.started(trial.trial_id, self._key(trial)):
            return
        running = sorted({t.trial_id for t in trials if t.status == "RUNNING"} | {trial.trial_id})
        if self.limit.nothing_more_fits(running):  # e.g. a trial started minutes before the limit
            self.limit.fire(f"no running trial, {trial} just started included, can write another epoch checkpoint "
                            f"before {clock_time(self.limit.stop_at)} (less {self.limit.margin_s:.0f} s to stop in)")

    def _key(self, trial: Any) -> str:
        try:
            return self.key_of(trial)  # type: ignore[misc]  # (on_trial_start asks only with one set)
        except Exception:  # noqa: BLE001 - never let foresight stop a sweep
            return ""

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        if self.limit is None:
            return
        self.limit.checkpointed(trial.trial_id, float(result.get("time_this_iter_s") or 0.0))
        running = [t.trial_id for t in trials if t.status == "RUNNING"]
        if self.limit.nothing_more_fits(running):
            self.limit.fire(f"no running trial can write another epoch checkpoint before {clock_time(self.limit.stop_at)}"
                            f" (less {self.limit.margin_s:.0f} s to stop in)")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        if self.limit is not None:
            self.limit.forget(trial.trial_id)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        if self.limit is not None:
            self.limit.forget(trial.trial_id)


class _SessionRecord(tune.Callback):
    """Calls ``record`` (the driver's: store this session's time split so far) at the trials' first step, every
    ``every_s`` after, and as each trial ends: a session killed outright keeps its time up to its last record.
    Pickled with the Tuner, it leaves ``record`` behind (a restored Tuner gets a live one)."""

    def __init__(self, record: Callable[[], None] | None, every_s: float) -> None:
        self.record, self.every_s = record, every_s
        self._last = -math.inf

    def __getstate__(self) -> dict[str, Any]:
        return {"record": None, "every_s": self.every_s, "_last": -math.inf}

    def _now(self) -> None:
        self._last = time.monotonic()
        if self.record is not None:
            self.record()

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self._now()

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._now()

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        self._now()


def _trial_name(trial: Any) -> str:
    return f"trial_{trial.trial_id}"


class _TrialNames:
    """Tune's name of a trial (its status table's first column): the arm and seed, as the trial's MLflow
    run is named, then Tune's trial id: ``L4-H256 seed 1 (a1b2c_00003)``."""

    def __init__(self, space: SearchSpace, base_seed: int) -> None:
        self.space, self.base_seed = space, base_seed

    def __call__(self, trial: Any) -> str:
        try:
            point, control = trial_point(self.space, trial.config)
            seed = trial_overrides(self.space, trial.config, self.base_seed).get(SEED_KEY, self.base_seed)
            return f"{run_name(point, control, seed)} ({trial.trial_id})"
        except Exception:  # never let a display name stop a sweep
            return _trial_name(trial)
