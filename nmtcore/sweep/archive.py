"""A sweep's MLflow record in one file, and back into a store: what its report reads, carried between machines.

``nmtcore report`` rebuilds a sweep's tables from its MLflow store, and that store lives where the sweep ran. A
machine wiped between sessions takes it along, and with it every later report of that sweep, a pooled report
of its seeds with another sweep's (``nmtcore report --sweep A --sweep B``) included. :func:`export_sweep` writes
the sweep's parent run and trial runs to one gzip'd JSON file: status, params, tags, every metric's history, and
the text artifacts a report reads (each test set's hypotheses and references, ``summary.json``, the sweep's
``estimate.json`` and ``time_split.json``). :func:`import_sweep` recreates them in another store under the same
sweep name, each run tagged with the run it was copied from. Checkpoints are not carried: ``nmtcore lengths``,
which decodes the trials' weights again, still needs the original store.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmtcore import tracking
from nmtcore.files import atomic_write_bytes
from nmtcore.sweep.lifecycle import ROLE_TAG, SWEEP_TAG, find_sweep_run, sweep_children
from nmtcore.sweep.settings import DEFAULT_EXPERIMENT
from nmtcore.tracking import schema
from nmtcore.tracking.runs import PARENT_RUN_TAG

FORMAT = 1
IMPORTED_FROM_TAG = schema.IMPORTED_FROM
# The artifacts a report reads; anything else (checkpoints, figures, configs) stays behind.
ARTIFACT_DIRS = ("hypotheses/", "references/")
ARTIFACT_FILES = ("summary.json", "estimate.json", "time_split.json")
MAX_ARTIFACT_BYTES = 4 << 20
# MLflow's own bookkeeping tags: set again by the importing store.
_DROPPED_TAGS = (PARENT_RUN_TAG, "mlflow.runName")


@dataclass(frozen=True)
class Archived:
    """What an export or an import moved: the sweep's name, its trial runs, and where it went (the file, or the
    new parent run's id)."""

    sweep: str
    trial_runs: int
    where: str


def export_sweep(sweep: str, out: str | os.PathLike, tracking_uri: str | os.PathLike | None = None) -> Archived:
    """Write sweep ``sweep`` (name or parent run id) of the store at ``tracking_uri`` to ``out`` (gzip'd JSON)."""
    uri = tracking.resolve_tracking_uri(tracking_uri)
    parent = find_sweep_run(sweep, uri)
    runs = [parent, *sweep_children(parent.run_id, uri)]
    doc = {"format": FORMAT, "sweep": parent.tags.get(SWEEP_TAG, sweep), "exported": time.strftime("%Y-%m-%dT%H:%M:%S"),
           "source": uri, "runs": [run_record(r, uri) for r in runs]}
    atomic_write_bytes(Path(out), gzip.compress(json.dumps(doc, sort_keys=True).encode("utf-8"), mtime=0))
    return Archived(doc["sweep"], len(runs) - 1, os.fspath(out))


def run_record(run: tracking.RunRecord, uri: str) -> dict[str, Any]:
    """What the archive keeps of ``run``: its name, status, params, tags (but MLflow's own), every metric's
    history and the text artifacts a report reads."""
    artifacts = {}
    for name in tracking.list_artifacts(run.run_id, uri):
        if name.startswith(ARTIFACT_DIRS) or name in ARTIFACT_FILES:
            text = tracking.read_artifact_text(run.run_id, name, uri)
            if len(text.encode("utf-8")) <= MAX_ARTIFACT_BYTES:
                artifacts[name] = text
    return {"run_id": run.run_id, "run_name": run.run_name, "status": run.status, "params": run.params,
            "tags": {k: v for k, v in run.tags.items() if k not in _DROPPED_TAGS},
            "metrics": tracking.get_run_metrics(run.run_id, uri), "artifacts": artifacts}


def read_archive(path: str | os.PathLike) -> dict[str, Any]:
    """An exported sweep, checked: its format, a parent run first, trial runs after it."""
    try:
        doc = json.loads(gzip.decompress(Path(path).read_bytes()).decode("utf-8"))
    except (OSError, EOFError, ValueError) as e:
        raise tracking.TrackingError(f"{path}: not a sweep archive written by nmtcore export ({e})") from None
    if doc.get("format") != FORMAT:
        raise tracking.TrackingError(f"{path}: archive format {doc.get('format')!r}, this nmtcore reads {FORMAT}")
    runs = doc.get("runs") or []
    if not runs or runs[0]["tags"].get(ROLE_TAG) != "sweep":
        raise tracking.TrackingError(f"{path}: its first run is not a sweep's parent run")
    return doc


def import_sweep(path: str | os.PathLike, tracking_uri: str | os.PathLike | None = None,
                 experiment: str = DEFAULT_EXPERIMENT) -> Archived:
    """Recreate the sweep exported to ``path`` in the store at ``tracking_uri`` (``where``: its new parent run
    id). Refuses a store that already has a sweep of that name."""
    doc = read_archive(path)
    uri = tracking.resolve_tracking_uri(tracking_uri)
    name = doc["sweep"]
    try:
        there = find_sweep_run(name, uri)
    except tracking.TrackingError:
        there = None
    if there is not None:
        raise tracking.TrackingError(f"a sweep named {name!r} is already in {uri} (parent run {there.run_id}); "
                                     "import into another store")
    first, *trials = doc["runs"]
    parent = tracking.Tracker(uri, experiment=experiment, run_name=first["run_name"], strict=True,
                              tags={**first["tags"], IMPORTED_FROM_TAG: first["run_id"]})
    fill_run(parent, first)
    for rec in trials:
        child = parent.child(run_name=rec["run_name"], tags={**rec["tags"], IMPORTED_FROM_TAG: rec["run_id"]})
        fill_run(child, rec)
        child.end(_end_status(rec))
    parent.end(_end_status(first))
    return Archived(name, len(trials), parent.run_id)


def _end_status(rec: dict[str, Any]) -> str:
    """The run's recorded end status; one exported while still running is ended KILLED."""
    return rec["status"] if rec["status"] in ("FINISHED", "FAILED", "KILLED") else "KILLED"


def fill_run(run: tracking.Tracker, rec: dict[str, Any]) -> None:
    """Params, every metric's history (a step logged twice stays twice, in order) and the artifacts of ``rec``."""
    if rec["params"]:
        run.log_params(rec["params"])
    by_step: dict[int, list[dict[str, float]]] = collections.defaultdict(list)
    for key, history in rec["metrics"].items():
        seen: collections.Counter[int] = collections.Counter()
        for step, value in history:
            layer = seen[step]
            seen[step] += 1
            while len(by_step[step]) <= layer:
                by_step[step].append({})
            by_step[step][layer][key] = value
    for step in sorted(by_step):
        for metrics in by_step[step]:
            run.log_metrics(metrics, step)
    for name, text in rec["artifacts"].items():
        run.log_text(text, name)


__all__ = ["IMPORTED_FROM_TAG", "Archived", "export_sweep", "fill_run", "import_sweep", "read_archive", "run_record"]
