"""The Ray cluster a sweep runs on: a local one (all cores, every port on 127.0.0.1, token auth on) or a joined
one (checked to reach the storage, the data and MLflow); its control plane reniced below the trials; how many
trials fit it at once (CPUs, GPUs, each trial's memory estimate)."""

from __future__ import annotations


import _thread
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Mapping

import psutil
import ray
import ray.train

from nmtcore import tracking
from nmtcore.config import ExperimentConfig
from nmtcore.interrupts import defer_while_writing
from nmtcore.sweep.memory import GIB
from nmtcore.sweep.dashboard import private_token_file
from nmtcore.sweep.settings import SweepError, SweepSettings, is_uri

from nmtcore.sweep.ray_backend._private import LOOPBACK_VAR, dashboard_url, loopback_only

log = logging.getLogger("nmtcore.sweep")


# A Tune trial actor whose trial runs Train workers only waits on them: it reserves no CPU (Tune refuses an
# empty reservation, so a little logical memory instead), and a trial's CPUs all go to its workers: 2 one-CPU
# trials fit on 2 cores, and on two 1-CPU nodes, wherever Ray puts the trial actors. A trial that trains in
# its actor reserves its CPUs there (trial_actor_resources).
DRIVER_RESOURCES = {"cpu": 0, "memory": 256 * 1024**2}


# ---------------------------------------------------------------------------------------------- the cluster
# Environment for every Ray process a sweep starts (local cluster or runtime_env when joining).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "0",
    "NMTCORE_NO_PROGRESS": "1",
}


# And for a local cluster only (a user's own setting wins; a joined cluster keeps Ray's defaults): no Ray Train
# preemption watcher, one more process per trial polling the GCS every 5 s for node drains, which a one-machine
# cluster does not have. A one-epoch 2-thread trial on 2 cores paid 30-43% for the sweep without it against
# 36-66% with it (bench/sweep_overhead.py, three pairs, noisy).
# And the niceness a local cluster's workers take back (restore_worker_nice).
WORKER_NICE_VAR = "NMTCORE_WORKER_NICE"
WORKER_NICE = 15  # Ray's: the raylet starts its workers 15 above its own niceness (its worker_niceness), capped at 19
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", WORKER_NICE_VAR: str(WORKER_NICE)}


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
             dashboard_host: str = "127.0.0.1", temp_dir: str | None = None, log_to_driver: bool = True,
             env: Mapping[str, str] | None = None, memory_gb: float | None = None,
             worker_env: Mapping[str, str] | None = None) -> str | None:
    """Start a local Ray cluster (or join ``address``) unless this process is already connected;
    returns the dashboard URL (``http://127.0.0.1:8265``) or None. ``env`` is set here and in every Ray
    process of the sweep; ``worker_env`` (an allocator's preload) only in the worker processes Ray starts for
    it (trial actors that train, tasks), where it takes effect at their start.

    A local cluster is always a new one (never a ``ray start`` cluster found on the machine: joining one
    is what ``address`` is for), single-node, and bound to 127.0.0.1 (:func:`loopback_only`). Its
    dashboard keeps Ray's token authentication (:func:`nmtcore.sweep.dashboard.dashboard_access`).
    """
    local = {} if address else {k: os.environ.get(k, v) for k, v in LOCAL_RAY_ENV.items()}
    env_vars = {**RAY_ENV, **local, **(env or {})}
    for k, v in env_vars.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        # ray.init replaces the process's SIGTERM handler (a sys.exit, then its core's crash handler, which
        # aborts with a stack dump): a handler the caller set (a sweep's: one line, 143) is put back after it.
        sigterm = signal.getsignal(signal.SIGTERM)
        kwargs: dict[str, Any] = {"log_to_driver": log_to_driver,
                                  "runtime_env": {"env_vars": {**env_vars, **(worker_env or {})}},
                                  "configure_logging": True, "logging_level": logging.WARNING}
        if address:
            ctx = ray.init(address=address, **kwargs)
        else:
            with loopback_only():
                if memory_gb:  # the memory Ray may reserve for tasks and trials (default: ~70% of what is free)
                    kwargs["_memory"] = int(memory_gb * GIB)
                ctx = ray.init(address="local", num_cpus=num_cpus or os.cpu_count(), include_dashboard=dashboard,
                               dashboard_host=dashboard_host, _temp_dir=temp_dir, **kwargs)
            node_ip = (getattr(ctx, "address_info", None) or {}).get("node_ip_address", "127.0.0.1")
            if node_ip != "127.0.0.1" and os.environ.get(LOOPBACK_VAR) != "1":
                log.warning("the local Ray cluster listens on %s, not only on 127.0.0.1 (this Ray version no longer "
                            "honours %s=0): keep its token authentication on", node_ip, LOOPBACK_VAR)
            private_token_file()
            global _local_cluster_pid
            _local_cluster_pid = os.getpid()
            yield_control_plane()
        url = getattr(ctx, "dashboard_url", None)
        if callable(sigterm) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)
    else:
        url = dashboard_url()
    if url and not url.startswith("http"):
        url = f"http://{url}"
    return url or None


def exit_quietly_on_sigterm() -> None:
    """In a Ray worker (a trial's actor, its Train workers, a pre-sweep task): a SIGTERM that lands while Python
    runs a weakref callback or a finalizer still stops the process, without a traceback in the sweep's output.

    Ray's worker turns SIGTERM (a sweep being stopped, the cluster shutting down) into ``SystemExit``, raised
    wherever the main thread is. Inside such a callback Python cannot raise it: it prints "Exception ignored
    in ..." with the traceback and the worker goes on. Here that ``SystemExit`` is not printed and the signal is
    sent again, so the handler raises it once the callback has returned. Other unraisable errors (a
    ``SystemExit`` the SIGTERM handler did not raise included) are printed as before.

    Ray's handler is also wrapped (:func:`nmtcore.interrupts.defer_while_writing`): a SIGTERM that lands in an MLflow
    store write waits for it, as the CLI's does, instead of cutting the write's sqlite transaction and leaving the
    store locked while the trial ends its run. Idempotent."""
    handler = signal.getsignal(signal.SIGTERM)
    if callable(handler) and not getattr(handler, "nmtcore_deferring", False):
        with contextlib.suppress(ValueError):  # not the main thread: the handler stays as it is
            signal.signal(signal.SIGTERM, defer_while_writing(handler))
    if getattr(sys.unraisablehook, "nmtcore_quiet_sigterm", False):
        return
    before = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and _raised_by_sigterm_handler(unraisable.exc_traceback):
            _thread.start_new_thread(_sigterm_again, ())  # not from here: the handler would run inside the hook
            return
        before(unraisable)

    hook.nmtcore_quiet_sigterm = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _sigterm_again(delay_s: float = 0.01) -> None:
    """Send this process SIGTERM after ``delay_s``, from a thread of its own (``threading.Thread.start`` would wait
    in the caller, where the handler would then run)."""
    time.sleep(delay_s)
    os.kill(os.getpid(), signal.SIGTERM)


def _raised_by_sigterm_handler(tb: Any) -> bool:
    """Whether the process's SIGTERM handler (a Python function) is one of the frames of ``tb``."""
    code = getattr(signal.getsignal(signal.SIGTERM), "__code__", None)
    while code is not None and tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


# A local cluster's own processes (GCS, raylet, the dashboard and its modules, the log monitor, the agents) run at
# nice 0 and Ray's workers, trials included, at nice 15: each of the control plane's wake-ups (hundreds a second)
# preempts a trial's threads at once, and a 2-thread trial on 2 cores waits for the preempted one. At nice 19 they
# run beside the trials instead of ahead of them: inside a sweep, a 2-epoch 2-thread trial trained in 98.5 / 94.2 s
# with the daemons (not yet the agents) at 19 against 102.5 / 98.3 s at Ray's default, in ABBA order (direct runs
# 100.3 / 90.6 s; results/bench/2026-11-29-trial-in-actor/). The workers the reniced raylet starts then begin at 19
# too: each takes Ray's 15 back (restore_worker_nice).
CONTROL_PLANE_NICE = 19


RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent")  # the node's agents: control plane, named like workers


_local_cluster_pid: int | None = None  # the process that started the local cluster (init_ray), while it runs


def yield_control_plane(nice: int = CONTROL_PLANE_NICE) -> int:
    """Give the control plane of the local cluster this process started :data:`CONTROL_PLANE_NICE`: every thread
    of its descendants that is not a Ray worker (``ray::…`` but :data:`RAY_AGENTS`, or one still starting);
    returns how many threads it changed. Does nothing on a joined cluster. Called when the cluster starts and as
    trials start (the dashboard starts its modules a moment later)."""
    if _local_cluster_pid != os.getpid():
        return 0
    changed = 0
    for proc in psutil.Process().children(recursive=True):
        try:
            name = proc.name()
            if name.startswith("ray::") and name not in RAY_AGENTS or any("default_worker" in a
                                                                         for a in proc.cmdline()[:4]):
                continue
            for thread in proc.threads():
                if os.getpriority(os.PRIO_PROCESS, thread.id) < nice:
                    os.setpriority(os.PRIO_PROCESS, thread.id, nice)
                    changed += 1
        except (psutil.Error, OSError):  # gone, or not ours to change
            continue
    return changed


def restore_worker_nice() -> int:
    """In a worker of a local cluster (:data:`WORKER_NICE_VAR` set): every thread of this process whose niceness is
    above the variable's value is brought down to it; returns how many. The raylet runs at :data:`CONTROL_PLANE_NICE`
    (:func:`yield_control_plane`), so the workers it starts after that (trials, pre-sweep tasks, the baseline's)
    begin there with it, 19, instead of at Ray's 15 above it, and any other work on the machine takes their cores.
    Threads a thread starts later inherit its niceness. Lowering a niceness takes the privilege to (root,
    CAP_SYS_NICE or RLIMIT_NICE): without it nothing changes. Linux only (per-thread niceness)."""
    value = os.environ.get(WORKER_NICE_VAR, "")
    if not value.lstrip("-").isdigit() or not sys.platform.startswith("linux"):
        return 0
    nice, changed = int(value), 0
    for tid in os.listdir("/proc/self/task"):
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except OSError:  # not permitted, or the thread has ended
            continue
    return changed


def workers_have(env: Mapping[str, str]) -> bool:
    """Whether the workers Ray starts for this connection get every variable of ``env`` (the job's runtime
    environment sets it): a trial actor can then train on the allocator a Train worker would have preloaded."""
    if not env:
        return True
    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return all(job_env.get(k) == v for k, v in env.items())


def shutdown_ray() -> None:
    """Disconnect from Ray (stopping the local cluster this process started) and forget that cluster."""
    global _local_cluster_pid
    if ray.is_initialized():
        ray.shutdown()
    _local_cluster_pid = None


def ray_is_running() -> bool:
    """Whether this process is connected to a Ray cluster."""
    return ray.is_initialized()


def cluster_nodes() -> list[dict[str, Any]]:
    """Alive nodes: id, address, CPUs, GPUs, Ray's ``memory`` resource (bytes)."""
    return [{"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "cpus": n["Resources"].get("CPU", 0),
             "gpus": n["Resources"].get("GPU", 0), "memory": n["Resources"].get("memory", 0)}
            for n in ray.nodes() if n.get("Alive")]


def single_node_idle_cpus() -> tuple[float, float]:
    """(CPUs of the cluster, CPUs no Ray work holds) on a single-node cluster; (0, 0) on a larger one, where
    the free CPUs Ray reports are not all the asking trial's node's (:mod:`nmtcore.sweep.idle_cpus`)."""
    nodes = cluster_nodes()
    if len(nodes) != 1:
        return 0.0, 0.0
    return float(nodes[0]["cpus"]), float(ray.available_resources().get("CPU", 0.0))


def check_cluster(settings: SweepSettings, base: ExperimentConfig) -> None:
    """For a sweep joining an existing cluster: MLflow must be a tracking server and trial storage
    (and the data directory) must be visible from every node. Raises :class:`SweepError` saying what
    to change. Call after connecting."""
    uri = settings.tracking_uri or tracking.default_tracking_uri()
    if not tracking.is_tracking_server(uri):
        raise SweepError(f"cluster mode needs an MLflow tracking server every node can reach, not {uri}: start one "
                         "(mlflow server --backend-store-uri sqlite:////shared/mlflow.db --host 0.0.0.0 --port 5000) "
                         "and pass --tracking-uri http://<host>:5000")
    paths = []
    if not is_uri(settings.storage):
        paths.append(("trial storage (--storage)", settings.storage))
    data_dir = base.data.resolved_data_dir()
    if data_dir is not None:
        paths.append(("data directory (--data-dir)", str(data_dir)))
    for what, path in paths:
        missing = _nodes_missing(path)
        if missing:
            raise SweepError(f"cluster mode: {what} {path} is not visible from node(s) {', '.join(missing)}: "
                             "use a shared filesystem path mounted on every node or a cloud URI (s3://, gs://)")


def _nodes_missing(path: str) -> list[str]:
    """Ids of alive nodes that do not see a marker file written under ``path`` by this process."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    Path(path).mkdir(parents=True, exist_ok=True)
    marker = Path(path) / f".nmtcore-shared-check-{uuid.uuid4().hex}"
    marker.write_text(socket.gethostname())
    try:
        @ray.remote(num_cpus=0)
        def sees(p: str) -> bool:
            return os.path.exists(p)

        nodes = [n["node_id"] for n in cluster_nodes()]
        refs = [sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(str(marker))
                for n in nodes]
        return [n[:12] for n, ok in zip(nodes, ray.get(refs, timeout=120)) if not ok]
    finally:
        marker.unlink(missing_ok=True)


def how_many(total: float, each: float) -> int:
    """How many ``each`` fit in ``total``, as Ray counts fractional resources: 5 × 0.4 CPU fit in 2 (floor
    division says 4: 0.4 is stored a little above 0.4), 10 × 0.1 GPU in 1."""
    return int(total / each + 1e-9)


def trials_that_fit(settings: SweepSettings, trial_bytes: int = 0) -> int:
    """How many trials the connected cluster runs at once: per node, the trials whose CPUs (and GPUs) fit on
    it and, with ``trial_bytes`` (a trial worker's memory estimate, :mod:`nmtcore.sweep.memory`), whose memory
    fits in the node's Ray ``memory`` resource; summed over nodes. Raises :class:`SweepError` if not even one
    fits."""
    total = 0
    biggest = {"cpus": 0.0, "gpus": 0.0, "memory": 0.0}
    per_node_cpus = settings.cpus_per_trial if settings.workers_per_trial == 1 else \
        settings.cpus_per_trial / settings.workers_per_trial
    limits: list[str] = []
    for node in cluster_nodes():
        biggest = {k: max(biggest[k], node[k]) for k in biggest}
        n = how_many(node["cpus"], per_node_cpus) if per_node_cpus else 0
        if settings.gpus_per_trial:
            per_node_gpus = settings.gpus_per_trial / settings.workers_per_trial
            n = min(n, how_many(node["gpus"], per_node_gpus))
        if trial_bytes:
            by_memory = int(node["memory"] // trial_bytes)
            if by_memory < n:
                limits.append(f"node {node['node_id'][:8]}: {by_memory} by memory ({node['memory'] / GIB:.1f} GiB "
                              f"for trials of {trial_bytes / GIB:.2f} GiB), {n} by CPUs/GPUs")
            n = min(n, by_memory)
        total += n
    if settings.workers_per_trial > 1:
        total //= settings.workers_per_trial
    if total < 1:
        memory = (f", {trial_bytes / GIB:.2f} GiB of memory (estimated)" if trial_bytes else "")
        raise SweepError(f"a trial needs {settings.cpus_per_trial} CPUs and {settings.gpus_per_trial} GPUs{memory}; "
                         f"the largest node has {biggest['cpus']:g} CPUs, {biggest['gpus']:g} GPUs and "
                         f"{biggest['memory'] / GIB:.1f} GiB of Ray memory (lower --cpus-per-trial / --gpus-per-trial, "
                         "or data.max_tokens, or raise --memory-gb)")
    for line in limits:
        log.warning("fewer trials at once than CPUs allow: %s", line)
    return total


def driver_node_gpus() -> float:
    """The GPUs of the node this process runs on (0 when Ray does not list it)."""
    node_id = ray.get_runtime_context().get_node_id()
    return float(next((n["gpus"] for n in cluster_nodes() if n["node_id"] == node_id), 0))
