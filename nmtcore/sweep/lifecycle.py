"""A sweep's record in MLflow: one parent run (role ``sweep``) with one nested child run per trial (role
``trial``), and the life of a trial as tags on its child run.

A child is identified by its trial key (a hash of the trial's overrides, seed included), so a retried or
resumed trial finds and re-attaches its run instead of creating a second one. A trial's state is one
:class:`TrialState`, written only through :func:`set_trial_state` / :func:`end_trial`; the report and the
driver read it back with :func:`trial_state`.

What a researcher opens in the MLflow UI (:func:`publish_sweep_views`, :func:`note_sweep_report`): a shared
view of the experiment's runs table holding this sweep's arms only (the varied keys, the control flag, test
BLEU/chrF and the validation metric as columns, best test BLEU first, and charts of test BLEU against the
varied keys and the validation curves), and on the parent run a Markdown description with links to it and,
at the end, the report's table and figures.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from nmtcore.sweep.space import ARM_KEY
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
from nmtcore.tracking import schema
from nmtcore.tracking.runs import (
    EXPERIMENT_KIND_TAG,
    MODEL_TRAINING_KIND,
    NOTE_TAG,
    SHARED_VIEW_PREFIX,
    get_experiment_tags,
    quote,
    set_experiment_tags,
    set_shared_view,
)
from nmtcore.tracking.uri import artifact_src, compare_url, experiment_url, run_url, ui_address

# The tag names (nmtcore.tracking.schema owns them), under the names the sweep modules know them by.
SWEEP_TAG, ROLE_TAG, TRIAL_KEY_TAG, TRIAL_STATE_TAG = schema.SWEEP, schema.ROLE, schema.TRIAL_KEY, schema.TRIAL_STATE
FAILURE_KIND_TAG, TUNE_STATUS_TAG, ARM_TAG, CONTROL_TAG = (schema.FAILURE_KIND, schema.TUNE_STATUS, schema.ARM,
                                                           schema.CONTROL)


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
              reason: str | None = None, tags: Mapping[str, Any] | None = None, only_if_running: bool = True) -> bool:
    """End a trial's run from outside the process that trained in it (the driver cleaning up after a
    stopped, failed or interrupted trial), unless it already ended (``only_if_running``). Returns whether it
    was ended."""
    status = state.end_status
    if status is None:
        raise ValueError(f"{state} does not end a run")
    return terminate_run(run_id, status, tracking_uri, reason=reason,
                         tags={**(tags or {}), TRIAL_STATE_TAG: state.value}, only_if_running=only_if_running)


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
                   tracking_uri: str | os.PathLike | None = None,
                   params: Mapping[str, Any] | None = None) -> tuple[str, bool]:
    """Run id of the child of ``parent_run_id`` for ``trial_key``: the existing one if a previous
    attempt created it (re-attach; nothing is duplicated), else a new RUNNING child with ``tags`` and
    ``params``. Returns ``(run_id, created)``. The run is left open: whoever trains in it ends it."""
    existing = find_child_run(parent_run_id, trial_key, tracking_uri)
    if existing is not None:
        return existing.run_id, False
    tracker = Tracker(tracking_uri, run_name=run_name, parent_run_id=parent_run_id,
                      tags={**tags, TRIAL_KEY_TAG: trial_key, ROLE_TAG: "trial",
                            TRIAL_STATE_TAG: TrialState.RUNNING.value})
    if params:
        tracker.log_params(params)
    return tracker.run_id, True


# ------------------------------------------------------------------------------ the MLflow UI's views
ARM_PARAM = "arm"  # child-run params (besides the config's): what the UI sorts and filters by
CONTROL_PARAM = "control"
NOTE_TABLE_CHARS = 5000  # the report table's share of a parent run's description (a tag holds 8000)


@dataclass(frozen=True)
class SweepViews:
    """Where the MLflow UI shows a sweep: the UI's address and routes relative to it."""

    ui: str  # http://127.0.0.1:5000 (the printed ``mlflow ui`` command) or the tracking server
    arms: str  # the runs table: this sweep's arms, varied keys and test BLEU, best first
    charts: str  # the same view as charts: test BLEU against the varied keys, validation curves
    parent: str  # the parent run: description with links, the report as artifacts

    def url(self, route: str) -> str:
        """The full address of one of these routes."""
        return f"{self.ui}/{route}"


VIEW_PREFIX = "sweep-"


def view_key(sweep: str) -> str:
    """The shared-view key of a sweep: ``sweep-<name>``, characters a tag key or a URL would mangle replaced."""
    return VIEW_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "_", sweep)


def view_columns(varied_keys: Sequence[str], control: bool, metric: str,
                 test_split: str) -> tuple[list[str], list[str]]:
    """(param names, metric names) the sweep's view shows: the varied config keys (an ablation's arm as the
    ``arm`` param), the control flag when there is a control; test BLEU and chrF, the validation metric."""
    params = [ARM_PARAM if k == ARM_KEY else k for k in varied_keys] + ([CONTROL_PARAM] if control else [])
    tested = [f"test/{test_split}/bleu", f"test/{test_split}/chrf"] if test_split else []
    return params, tested + ([metric] if metric not in tested else [])


def sweep_view_state(sweep: str, params: Sequence[str], metrics: Sequence[str],
                     test_splits: Sequence[str] = ()) -> dict[str, Any]:
    """The runs-page state of a sweep's shared view (MLflow 3.17's keys): its trial runs only (so they
    are listed flat, not folded under the parent), the columns, best first, and the charts."""
    section = "nmtcore-sweep"
    chart = {"metricSectionId": section, "deleted": False, "isGenerated": False, "runsCountToCompare": 100}
    first = metrics[0]
    charts: list[dict[str, Any]] = [
        {**chart, "uuid": "nmtcore-parallel", "type": "PARALLEL", "selectedParams": list(params),
         "selectedMetrics": [first], "showAllRuns": True},
        {**chart, "uuid": "nmtcore-bar", "type": "BAR", "metricKey": first},
    ]
    for m in metrics[2:]:  # the validation metric, per epoch
        charts.append({**chart, "uuid": f"nmtcore-line-{m}", "type": "LINE", "metricKey": m, "selectedMetricKeys": [m],
                       "lineSmoothness": 0, "xAxisKey": "step", "xAxisScaleType": "linear", "scaleType": "linear",
                       "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
                       "ignoreOutliers": False, "useGlobalXaxisKey": False, "useGlobalLineSmoothing": True,
                       "range": {}})
    columns = [f"params.`{p}`" for p in params] + [f"metrics.`{m}`" for m in metrics]
    # The UI adds a chart for every other metric, in a section per key prefix: those sections come after
    # this sweep's (isAccordionReordered keeps the order given) and start folded.
    folded = [{"uuid": f"nmtcore-{name}", "name": name, "display": False, "isReordered": False, "deleted": False,
               "isGenerated": True}
              for name in ("Model metrics", *(f"test/{split}" for split in test_splits), "final", "cost", "update")]
    return {
        "searchFilter": f"tags.`{SWEEP_TAG}` = '{quote(sweep)}' and tags.`{ROLE_TAG}` = 'trial'",
        "orderByKey": f"metrics.`{first}`", "orderByAsc": False,
        "selectedColumns": columns, "columnOrder": columns,
        "compareRunSections": [{"uuid": section, "name": f"sweep {sweep}: test BLEU against the varied keys",
                                "display": True, "isReordered": True, "deleted": False, "isGenerated": False},
                               *folded],
        "compareRunCharts": charts, "isAccordionReordered": True,
    }


def publish_sweep_views(parent_run_id: str, space: Any, tracking_uri: str | os.PathLike | None = None,
                        ui_port: int = 5000) -> SweepViews:
    """Make the MLflow UI show this sweep as a researcher reads it, and say where: the experiment marked a
    model-training one with a description listing its sweeps, the sweep's shared view, and the parent run's
    description (links; :func:`note_sweep_report` adds the report). Reads the sweep's name, varied keys and
    test set from the parent run's tags; ``space`` (a :class:`~nmtcore.sweep.space.SearchSpace`) says
    whether there is a control and which validation metric. Idempotent (a resumed sweep calls it again)."""
    uri = resolve_tracking_uri(tracking_uri)
    parent = get_run(parent_run_id, uri)
    sweep = parent.tags[SWEEP_TAG]
    exp = parent.experiment_id
    recorded = schema.SweepTags.from_tags(parent.tags)
    params, metrics = view_columns(space.varied_keys, any(c.control for c in space.cells()), space.metric,
                                   recorded.test_split)
    splits = list(recorded.test_splits)
    set_shared_view(exp, view_key(sweep), sweep_view_state(sweep, params, metrics, splits), uri)
    views = _views(uri, exp, parent_run_id, sweep, ui_port)
    tags = get_experiment_tags(exp, uri)
    keys = sorted(k[len(SHARED_VIEW_PREFIX):] for k in tags if k.startswith(SHARED_VIEW_PREFIX + VIEW_PREFIX))
    listing = "\n".join(f"- [{k[len(VIEW_PREFIX):]}]({experiment_url(exp, k)}): its arms, best test BLEU first "
                         f"([charts]({experiment_url(exp, k, charts=True)}))" for k in keys)
    set_experiment_tags(exp, {EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND,
                              NOTE_TAG: "Sweeps run by nmtcore: one parent run per sweep (its description links "
                                        "its views and report), one child run per trial.\n\n" + listing}, uri)
    set_run_tags(parent_run_id, {NOTE_TAG: _parent_note(parent, views)}, uri)
    return views


def note_sweep_report(parent_run_id: str, report_files: Sequence[str | os.PathLike],
                      tracking_uri: str | os.PathLike | None = None, ui_port: int = 5000) -> None:
    """Put the report (its table, its figures inline, the compare view of the arms) into the parent run's
    description; the files themselves are the run's ``report/`` artifacts."""
    uri = resolve_tracking_uri(tracking_uri)
    parent = get_run(parent_run_id, uri)
    views = _views(uri, parent.experiment_id, parent_run_id, parent.tags[SWEEP_TAG], ui_port)
    files = [Path(f) for f in report_files]
    table = next((f.read_text(encoding="utf-8") for f in files if f.name == "table.md"), "")
    figures = [f.name for f in files if f.suffix == ".png"]
    children = [r.run_id for r in sweep_children(parent_run_id, uri)]
    set_run_tags(parent_run_id, {NOTE_TAG: _parent_note(parent, views, table, figures, children)}, uri)


def _views(uri: str, exp: str, parent_run_id: str, sweep: str, ui_port: int) -> SweepViews:
    key = view_key(sweep)
    return SweepViews(ui=ui_address(uri, ui_port), arms=experiment_url(exp, key),
                      charts=experiment_url(exp, key, charts=True), parent=run_url(exp, parent_run_id))


def _parent_note(parent: RunRecord, views: SweepViews, table: str = "", figures: Sequence[str] = (),
                 children: Sequence[str] = ()) -> str:
    """The parent run's description (Markdown; links are routes, so they work on any UI address)."""
    recorded = schema.SweepTags.from_tags(parent.tags)
    space = recorded.space_description
    varied = ", ".join(f"`{k}`" for k in recorded.varied_keys)
    what = (f"Varies {varied or 'nothing'}; trials chosen by `{space.get('metric', '?')}`; tested on "
            f"`{recorded.test_split}`. Protocol: {recorded.protocol}. Search: {recorded.search}.")
    lines = [f"**Sweep `{recorded.name}`**: {space.get('description') or recorded.study}",
             "", what, "",
             f"- [The arms, best test BLEU first]({views.arms}) (columns: the varied keys, test BLEU and chrF)",
             f"- [Charts]({views.charts}): test BLEU against the varied keys, validation curves per epoch"]
    if children:
        lines.append(f"- [Compare the arms side by side]({compare_url(parent.experiment_id, list(children))})")
    if not table:
        lines += ["", ("The report (table and figures) comes here and under this run's artifacts `report/` "
                       "when the sweep ends.")]
        return "\n".join(lines) + "\n"
    lines.append("- Report files: " + ", ".join(
        f"[{name}]({run_url(parent.experiment_id, parent.run_id, 'report/' + name)})"
        for name in ["table.md", *figures]))
    if len(table) > NOTE_TABLE_CHARS:  # the first test set's table; the whole one is report/table.md
        table = table[:NOTE_TABLE_CHARS].rsplit("\n", 1)[0] + "\n\n(cut here: the whole table is report/table.md)"
    lines += ["", table.strip(), ""]
    lines += [f"![{name}]({artifact_src(parent.run_id, 'report/' + name)})" for name in figures]
    return "\n".join(lines) + "\n"


__all__ = ["ARM_PARAM", "ARM_TAG", "CONTROL_PARAM", "CONTROL_TAG", "FAILURE_KIND_TAG", "FAILURE_REASON_TAG",
           "ROLE_TAG", "SWEEP_TAG", "SweepViews", "TRIAL_KEY_TAG", "TRIAL_STATE_TAG", "TUNE_STATUS_TAG", "TrialState",
           "end_trial", "find_child_run", "find_sweep_run", "note_sweep_report", "open_child_run",
           "publish_sweep_views", "set_trial_state", "sweep_children", "trial_state", "view_key"]
