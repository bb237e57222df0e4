"""Cluster mode (slow): a head node and a second worker node started with ``ray start`` on 127.0.0.1,
an MLflow tracking server, and a sweep joining them with ``address``: its two trials run on the two
nodes. Also: joining a cluster with a local sqlite store is refused up front, saying what to change."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.sweep import driver
from nmtcore.sweep import ray_backend
from nmtcore.sweep import settings as sweep_settings
from nmtcore.testing.synthetic import tiny_experiment
from search_spaces import SearchSpace, grid

pytestmark = pytest.mark.slow
# The CLIs as modules of this interpreter: a virtual environment on top of the system's packages has no
# ``ray``/``mlflow`` scripts of its own next to its python.
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
MLFLOW = [sys.executable, "-m", "mlflow"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a process in its own process group (so it and its children are stopped together)."""
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **(env or {})})


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for(check, what: str, timeout: float = 120.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"{what} did not come up in {timeout:.0f} s")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Head (1 CPU) + worker (1 CPU) on 127.0.0.1 and an MLflow server; everything stopped by pid."""
    tmp = tmp_path_factory.mktemp("cluster")
    temp_dir = tempfile.mkdtemp(prefix="rc-", dir="/tmp")
    gcs = free_port()
    common = ["--num-cpus", "1", "--block", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    procs = [start([*RAY, "start", "--head", "--port", str(gcs), "--temp-dir", temp_dir, "--include-dashboard",
                    "false", "--ray-client-server-port", str(free_port()), *common], tmp / "head.log")]
    address = f"127.0.0.1:{gcs}"
    wait_for(lambda: subprocess.run([*RAY, "status", "--address", address], capture_output=True).returncode == 0,
             "ray head")
    procs.append(start([*RAY, "start", "--address", address, *common], tmp / "worker.log"))
    port = free_port()
    procs.append(start([*MLFLOW, "server", "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}",
                        "--default-artifact-root", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port",
                        str(port), "--workers", "1"], tmp / "mlflow.log",
                       env={"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}))
    uri = f"http://127.0.0.1:{port}"
    wait_for(lambda: urllib.request.urlopen(f"{uri}/health", timeout=2).status == 200, "mlflow server")
    ray_backend.init_ray(address=address, log_to_driver=False)
    wait_for(lambda: len(ray_backend.cluster_nodes()) == 2, "the second node")
    try:
        yield address, uri, tmp
    finally:
        ray_backend.shutdown_ray()
        for p in reversed(procs):
            stop(p)
        subprocess.run(["rm", "-rf", temp_dir])


def test_cluster_mode_refuses_a_local_store(cluster, tmp_path):
    address, _, _ = cluster
    s = sweep_settings.resolve_settings(sweep_settings.SweepSettings(name="x", storage=str(tmp_path), address=address,
                                                   tracking_uri=f"sqlite:///{tmp_path / 'm.db'}"))
    with pytest.raises(sweep_settings.SweepError, match="needs an MLflow tracking server.*--tracking-uri http"):
        ray_backend.check_cluster(s, tiny_experiment(tmp_path))


def test_trials_run_on_both_nodes(cluster, tmp_path):
    address, uri, _ = cluster
    space = SearchSpace("cluster", "t", "transformer", params={"model.d_model": grid((32, 64))})
    base = tiny_experiment(tmp_path, **{"train.max_epochs": 2, "train.valid_bleu": True, "train.num_threads": 1})
    settings = sweep_settings.SweepSettings(name="cluster", storage=str(tmp_path / "shared"), tracking_uri=uri,
                                   address=address, verbose=0, experiment="cluster", report_dir=str(tmp_path / "r"))
    result = driver.run_sweep(space, base, settings, log_to_driver=False)
    assert not result.interrupted and [t.status for t in result.trials] == ["TERMINATED"] * 2
    nodes = {t.overrides["model.d_model"]: t.node_ids for t in result.trials}
    print("node ids per trial:", {d: [n[:12] for n in ids] for d, ids in nodes.items()})
    assert all(len(ids) == 1 for ids in nodes.values())
    assert nodes[32] != nodes[64]  # one 1-CPU trial per 1-CPU node: both nodes trained
    assert {n["node_id"] for n in ray_backend.cluster_nodes()} == {ids[0] for ids in nodes.values()}
    children = [r for r in tracking.load_runs("cluster", uri) if r.parent_run_id]
    assert len(children) == 2 and all(c.status == "FINISHED" for c in children)
