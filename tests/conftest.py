"""Shared test fixtures: hand-built batches, the shared data, a deadline, one Ray cluster and one MLflow
store per module that asks for them. Helpers live in :mod:`nmtcore.testing` (no test imports another)."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NMTCORE_NO_PROGRESS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RAY_AUTH_MODE"] = "disabled"  # tests talk to Ray's dashboard API without a token

from nmtcore.testing.zoo import make_batch

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The team's shared data directory ($NMTCORE_DATA or ../shared/data); skips the test if absent."""
    d = Path(os.environ.get("NMTCORE_DATA", SHARED_DATA))
    if not (d / "multi30k").is_dir():
        pytest.skip(f"shared data not found at {d}")
    return d


@pytest.fixture
def deadline():
    """Fail (never hang) a test that runs past 15 minutes: SIGALRM interrupts Tune's loop."""
    def fire(signum, frame):
        raise TimeoutError("sweep hung for 15 minutes")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(900)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def small_batch():
    g = torch.Generator().manual_seed(0)
    lens_s, lens_t = [5, 3, 7], [4, 6, 2]
    src = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lens_s]
    tgt = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lens_t]
    return make_batch(src, tgt)


@pytest.fixture(scope="module")
def ray_cluster():
    """One local Ray cluster (2 CPUs, no dashboard) for the module, its session files cleaned after."""
    from nmtcore.allocator import allocator_choice, preload_env
    from nmtcore.sweep import ray_backend

    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths are length-limited
    # As a sweep starts one: the allocator's preload for the workers that train (one-worker trials: their actors).
    ray_backend.init_ray(num_cpus=2, dashboard=False, temp_dir=str(temp), log_to_driver=False,
                         worker_env=preload_env(allocator_choice()))
    yield
    ray_backend.shutdown_ray()
    shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A sqlite MLflow store whose schema exists (created once, before parallel trials open it)."""
    from nmtcore import tracking

    uri = "sqlite:///" + str(tmp_path_factory.mktemp("mlflow") / "mlflow.db")
    tracking.Tracker(uri, experiment="warmup").end()
    return uri
