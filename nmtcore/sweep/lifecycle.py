"""A sweep's record in MLflow: one parent run (role ``sweep``) with one nested child run per trial (role
``trial``), and the life of a trial as tags on its child run.

A child is identified by its trial key (a hash of the trial's overrides, seed included), so a retried or
resumed trial finds and re-attaches its run instead of creating a second one. A trial's state is one
:class:`TrialState`, written only through :func:`set_trial_state` / :func:`end_trial`; the report and the
driver read it back with :func:`trial_state`.
"""

from __future__ import annotations

import enum
import os
from typing import Any, Mapping

from nmtcore.tracking import (
    FAILURE_REASON_TAG,
    PARENT_RUN_TAG,
    RunRecord,
    Tracker,
    TrackingError,
    get_run,
    resolve_tracking_uri,
    search_runs,
    set_run_tags,
    terminate_run,
)
from nmtcore.tracking.store import quote

SWEEP_TAG = "nmtcore.sweep"  # the sweep's name, on the parent and on every child
ROLE_TAG = "nmtcore.role"  # "sweep" or "trial"
TRIAL_KEY_TAG = "nmtcore.trial_key"
TRIAL_STATE_TAG = "nmtcore.trial_state"
FAILURE_KIND_TAG = "nmtcore.failure_kind"  # "nonfinite": deterministic, not worth a retry
TUNE_STATUS_TAG = "nmtcore.tune_status"
ARM_TAG = "nmtcore.arm"  # "control", or the cell's label ("layers=2 hidden=128", an ablation arm's name)
CONTROL_TAG = "nmtcore.control"  # "true" on the control arm's runs


class TrialState(str, enum.Enum):
    """Where a trial's child run stands."""

    RUNNING = "running"  # training (or about to)
    COMPLETE = "complete"  # trained, tested and scored
    STOPPED_EARLY = "stopped_early"  # stopped by the scheduler (ASHA) before its last epoch
    FAILED = "failed"  # ended by an error (reason in nmtcore.failure_reason)
    KILLED = "killed"  # the sweep was interrupted while it ran; a resume re-attaches it

    @property
    def end_status(self) -> str | None:
        """The MLflow run status a trial ending in this state gets (None: the run stays open)."""
        return {"complete": "FINISHED", "stopped_early": "FINISHED", "failed": "FAILED",
                "killed": "KILLED"}.get(self.value)


def trial_state(run: RunRecord) -> str:
    """A child run's state as the report counts it: its :class:`TrialState` value, ``failed`` for any
    FAILED run, else the MLflow status in lower case for runs without a state tag."""
    state = run.tags.get(TRIAL_STATE_TAG, "")
    if run.status == "FAILED":
        return TrialState.FAILED.value
    if state == TrialState.COMPLETE.value and run.status == "FINISHED":
        return TrialState.COMPLETE.value
    if state == TrialState.STOPPED_EARLY.value:
        return TrialState.STOPPED_EARLY.value
    return state or run.status.lower()


def set_trial_state(run_id: str, state: TrialState, tracking_uri: str | os.PathLike | None = None,
                    tags: Mapping[str, Any] | None = None) -> None:
    """Tag a running trial with ``state`` (and ``tags``) without ending its run."""
    set_run_tags(run_id, {**(tags or {}), TRIAL_STATE_TAG: state.value}, tracking_uri)


def end_trial(run_id: str, state: TrialState, tracking_uri: str | os.PathLike | None = None,
              reason: str | None = None, tags: Mapping[str, Any] | None = None) -> bool:
    """End a trial's run from outside the process that trained in it (the driver cleaning up after a
    stopped, failed or interrupted trial), unless it already ended. Returns whether it was ended."""
    status = state.end_status
    if status is None:
        raise ValueError(f"{state} does not end a run")
    return terminate_run(run_id, status, tracking_uri, reason=reason,
                         tags={**(tags or {}), TRIAL_STATE_TAG: state.value})


def find_sweep_run(sweep: str, tracking_uri: str | os.PathLike | None = None) -> RunRecord:
    """The parent run of a sweep, by run id or by sweep name (the newest if a name was reused)."""
    uri = resolve_tracking_uri(tracking_uri)
    if len(sweep) == 32 and all(c in "0123456789abcdef" for c in sweep):
        try:
            return get_run(sweep, uri)
        except TrackingError:
            pass  # a sweep may be named like a run id; fall through to the name lookup
    runs = search_runs(f"tags.`{SWEEP_TAG}` = '{quote(sweep)}' and tags.`{ROLE_TAG}` = 'sweep'", uri)
    if not runs:
        raise TrackingError(f"no sweep named {sweep!r} in {uri}")
    return runs[-1]


def sweep_children(parent_run_id: str, tracking_uri: str | os.PathLike | None = None) -> list[RunRecord]:
    """The trial runs nested under a sweep's parent run, oldest first."""
    return search_runs(f"tags.`{PARENT_RUN_TAG}` = '{quote(parent_run_id)}'", tracking_uri)


def find_child_run(parent_run_id: str, trial_key: str,
                   tracking_uri: str | os.PathLike | None = None) -> RunRecord | None:
    """The child run of ``parent_run_id`` carrying ``trial_key`` (the oldest if several), or None."""
    runs = search_runs(f"tags.`{PARENT_RUN_TAG}` = '{quote(parent_run_id)}' and "
                       f"tags.`{TRIAL_KEY_TAG}` = '{quote(trial_key)}'", tracking_uri)
    return runs[0] if runs else None


def open_child_run(parent_run_id: str, trial_key: str, run_name: str, tags: Mapping[str, Any],
                   tracking_uri: str | os.PathLike | None = None) -> tuple[str, bool]:
    """Run id of the child of ``parent_run_id`` for ``trial_key``: the existing one if a previous
    attempt created it (re-attach; nothing is duplicated), else a new RUNNING child. Returns
    ``(run_id, created)``. The run is left open: whoever trains in it ends it."""
    existing = find_child_run(parent_run_id, trial_key, tracking_uri)
    if existing is not None:
        return existing.run_id, False
    tracker = Tracker(tracking_uri, run_name=run_name, parent_run_id=parent_run_id,
                      tags={**tags, TRIAL_KEY_TAG: trial_key, ROLE_TAG: "trial",
                            TRIAL_STATE_TAG: TrialState.RUNNING.value})
    return tracker.run_id, True


__all__ = ["ARM_TAG", "CONTROL_TAG", "FAILURE_KIND_TAG", "FAILURE_REASON_TAG", "ROLE_TAG", "SWEEP_TAG", "TRIAL_KEY_TAG", "TRIAL_STATE_TAG",
           "TUNE_STATUS_TAG", "TrialState", "end_trial", "find_child_run", "find_sweep_run", "open_child_run",
           "set_trial_state", "sweep_children", "trial_state"]
