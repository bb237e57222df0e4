"""Small sweeps for the tests: a tiny base experiment, sweep settings in a temporary directory, the runs
a sweep left in MLflow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nmtcore import tracking
from nmtcore.config import ExperimentConfig
from nmtcore.sweep.settings import SweepSettings
from nmtcore.testing.synthetic import tiny_experiment


def tiny_base(tmp: Path, **overrides: Any) -> ExperimentConfig:
    """The synthetic task with a tiny model, 2 epochs, validation BLEU on, 1 thread."""
    return tiny_experiment(tmp, **{"train.max_epochs": 2, "train.valid_bleu": True, "train.num_threads": 1,
                                   **overrides})


def tiny_settings(tmp: Path, name: str, uri: str, **kw: Any) -> SweepSettings:
    """Settings of a quiet sweep named ``name`` with its results and report under ``tmp``. It trains every trial
    unless ``reuse_trials=True``: a test module's sweeps share one store, and a trial of one test would otherwise
    be copied into the next (:mod:`nmtcore.sweep.reuse`)."""
    kw.setdefault("reuse_trials", False)
    return SweepSettings(name=name, storage=str(tmp / "ray_results"), tracking_uri=uri, verbose=0,
                         report_dir=str(tmp / "report"), experiment=name, **kw)


def runs_of(experiment: str, uri: str) -> tuple[list[tracking.RunRecord], list[tracking.RunRecord]]:
    """(parent runs, child runs) of an MLflow experiment."""
    runs = tracking.load_runs(experiment, uri)
    return [r for r in runs if r.parent_run_id is None], [r for r in runs if r.parent_run_id is not None]


def listening_sockets(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket that process ``pid`` and its descendants listen on: what a local Ray
    cluster exposes."""
    import contextlib

    import psutil

    root = psutil.Process(pid)
    out = set()
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                    if c.status == psutil.CONN_LISTEN}
    return out
