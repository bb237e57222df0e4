"""Everything of a sweep that talks to Ray, and the only module that imports it: the cluster, the pre-sweep
tasks, and the Tune search whose trials run Ray Train workers. The rest of :mod:`nmtcore.sweep` runs and tests
without a Ray cluster.

**The cluster.** :func:`init_ray` starts a local one (or joins ``address``); :func:`trials_that_fit` says how
many trials it runs at once (CPUs, GPUs and each trial's memory estimate); placement groups that Ray Train
leaks are removed. Who can reach a local cluster: every Ray process of it listens on 127.0.0.1 only (GCS,
raylet, workers, dashboard and its agents; see :func:`_loopback_only`), and the dashboard keeps Ray's token
authentication (:mod:`nmtcore.sweep.dashboard` says how to sign in): loopback alone does not keep out other
users of the same machine. A joined cluster keeps its own binding and auth, after :func:`check_cluster` has
seen that every node reaches the storage, the data and MLflow.

**The pre-sweep tasks.** :func:`run_pre_sweep_task` runs the work the trials share
(:mod:`nmtcore.sweep.pre_sweep`) once, as a named Ray task on the driver's node, and streams its progress.

**The search.** A sweep's trials run as one Ray Tune search whose trials each run the unchanged nmtcore
trainer inside a Ray Train ``TorchTrainer`` (:class:`TrialTrainer`: without the helper actors it does not use),
or, for a one-worker CPU trial (``trial_in_actor``, the default), in the Tune trial actor itself: the same
``_train_loop``, reporting to Tune directly, without a Train controller and worker process of its own::

    driver (nmtcore.sweep.driver)     Tune trial actor (_trial_main)      Train workers (_train_loop)
    ─────────────────────────────     ──────────────────────────────      ───────────────────────────
    run_tune(...)                      find / create the MLflow child      run_experiment(cfg, callbacks)
      Tuner(search alg, ASHA).fit()      (by trial key: re-attach)           _RayReport: metrics +
      _SweepCallback: end child runs   TrialTrainer(name = trial key)          checkpoint every epoch
        of stopped/failed trials,        .fit()                              _TrialTracking (rank 0):
        remove leaked worker PGs                                               config, epochs, test,
                                                                               costs → the child run

Search algorithm: a space of grid/choice dimensions is enumerated (Tune's variant generator; seeds are one
more grid dimension); a space with ranges is sampled by Optuna's TPE, seeded, with seeds as Tune
``Repeater`` repeats. ASHA (on the validation metric, time in epochs) stops poor trials early.

Where things run: the cluster above (by default a local one of all cores, bound to 127.0.0.1), trials as
many at once as fit (``cpus_per_trial``/``gpus_per_trial`` per trial: reserved by the Train workers, or by the
Tune actor of a trial that trains in it).
The work the trials share runs before them as named Ray tasks (:mod:`nmtcore.sweep.pre_sweep`).

Failure policy: a crashing trial is retried by Tune (``max_failures``) from its last checkpoint; a trial
whose loss becomes NaN/inf ends FAILED with the reason in MLflow, and Tune's retries of it end at once
without training (it would fail identically); a trial whose worker group cannot start fails after
``controller_failure_limit`` start timeouts instead of waiting forever; placement groups whose creating
Train controller died (the leak that hangs ASHA sweeps with TorchTrainer trials) are removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import optuna
import psutil
import ray
import ray.train
from ray import tune
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator, Repeater
from ray.tune.search.optuna import OptunaSearch

from nmtcore import tracking
from nmtcore.bert import ensure_bert
from nmtcore.checkpoint import epoch_checkpoints
from nmtcore.config import ExperimentConfig
from nmtcore.engine import (
    Callback,
    NonFiniteLossError,
    RunSummary,
    Trainer,
    run_experiment,
)
from nmtcore.sweep.lifecycle import (
    FAILURE_KIND_TAG,
    TRIAL_STATE_TAG,
    TUNE_STATUS_TAG,
    TrialState,
    end_trial,
    find_child_run,
    open_child_run,
    set_trial_state,
)
from nmtcore.sweep.idle_cpus import BorrowIdleCpus
from nmtcore.sweep.memory import GIB
from nmtcore.sweep.plan import (
    SEED_KEY,
    trial_config,
    trial_key,
    trial_overrides,
    trial_point,
)
from nmtcore.sweep.dashboard import private_token_file
from nmtcore.sweep.progress import HEARTBEAT_S, PhaseProgress, console_line, duration
from nmtcore.sweep.settings import SweepError, SweepSettings, is_uri
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
from nmtcore.sweep.trial import (
    MEMORY_TAG,
    NonFiniteTrialError,
    SweepContext,
    TrialLaunch,
    TrialOutOfMemoryError,
    TrialTracking,
    all_gather,
    all_reduce_sum,
    epoch_of,
    failure_reason,
    final_metrics_from_run,
    is_out_of_memory,
    last_epoch_metrics,
    run_name,
)
from nmtcore.tracking import schema

log = logging.getLogger("nmtcore.sweep")

T = TypeVar("T")

# A Tune trial actor whose trial runs Train workers only waits on them: it reserves no CPU (Tune refuses an
# empty reservation, so a little logical memory instead), and a trial's CPUs all go to its workers: 2 one-CPU
# trials fit on 2 cores, and on two 1-CPU nodes, wherever Ray puts the trial actors. A trial that trains in
# its actor reserves its CPUs there (trial_actor_resources).
DRIVER_RESOURCES = {"cpu": 0, "memory": 256 * 1024**2}


def trial_actor_resources(ctx: SweepContext) -> dict[str, float] | Callable[[dict[str, Any]], Any]:
    """What a trial's Tune actor reserves: :data:`DRIVER_RESOURCES`; where the trial trains in it
    (``ctx.in_actor``), a function of the trial's config giving the trial's CPUs, GPUs and its own memory estimate
    with the actor's share, as Train workers reserve theirs (:func:`actor_memory`)."""
    if not ctx.in_actor:
        return dict(DRIVER_RESOURCES)

    def resources(config: dict[str, Any]) -> Any:
        cfg = trial_config(ctx.base, trial_overrides(ctx.space, config, ctx.base_seed), ctx.scratch_dir or ".",
                           ctx.threads_per_worker)
        bundle = {"CPU": ctx.cpus_per_worker, "memory": actor_memory(ctx.trial_estimate(cfg).total)}
        if ctx.gpus_per_worker:
            bundle["GPU"] = ctx.gpus_per_worker
        return tune.PlacementGroupFactory([bundle])

    return resources


# Tune reuses a finished trial's actor (FIFO sweeps) only for a trial asking for the same resources: a trial's
# reservation is rounded up to this step, so trials whose estimates differ by a little share actors.
ACTOR_MEMORY_STEP = 256 * 1024**2


def actor_memory(estimate: int) -> int:
    """The memory a Tune actor training a trial of ``estimate`` bytes reserves: the estimate and the actor's own
    share (:data:`DRIVER_RESOURCES`), rounded up to :data:`ACTOR_MEMORY_STEP`."""
    total = DRIVER_RESOURCES["memory"] + estimate
    return -(-total // ACTOR_MEMORY_STEP) * ACTOR_MEMORY_STEP


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
LOCAL_RAY_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}


def remove_leaked_placement_groups() -> int:
    """Remove placement groups whose creating actor is dead (and that are not detached); returns how
    many. Such a group is a Train worker group's reservation outliving its controller (a trial
    stopped by ASHA or killed): its resources would otherwise stay reserved until the cluster ends.
    Groups created by a driver (Tune's own trial reservations) have no creating actor and are kept."""
    try:
        from ray.core.generated import gcs_pb2
        from ray.util.placement_group import (
            PlacementGroup,
            PlacementGroupID,
            remove_placement_group,
        )

        table = ray.util.placement_group_table()
        accessor = ray._private.state.state._global_state_accessor  # noqa: SLF001 - no public API has the creator
    except Exception as e:  # pragma: no cover - depends on Ray internals
        log.debug("placement-group check unavailable: %s", e)
        return 0
    removed = 0
    for pg_hex, info in table.items():
        if info.get("state") not in ("CREATED", "PENDING", "RESCHEDULING"):
            continue
        try:
            pg_id = PlacementGroupID(bytes.fromhex(pg_hex))
            data = gcs_pb2.PlacementGroupTableData.FromString(accessor.get_placement_group_info(pg_id))
            creator = bytes(data.creator_actor_id)
            if data.is_detached or not creator or set(creator) == {0xFF} or not data.creator_actor_dead:
                continue
            remove_placement_group(PlacementGroup(pg_id))
            removed += 1
            log.warning("removed leaked placement group %s %s (its creating actor died)", pg_hex, info.get("bundles"))
        except Exception as e:  # pragma: no cover - racing with Ray's own cleanup
            log.debug("placement group %s: %s", pg_hex, e)
    return removed


LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node IP is 127.0.0.1, every port on it


def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
             dashboard_host: str = "127.0.0.1", temp_dir: str | None = None, log_to_driver: bool = True,
             env: Mapping[str, str] | None = None, memory_gb: float | None = None,
             worker_env: Mapping[str, str] | None = None) -> str | None:
    """Start a local Ray cluster (or join ``address``) unless this process is already connected;
    returns the dashboard URL (``http://127.0.0.1:8265``) or None. ``env`` is set here and in every Ray
    process of the sweep; ``worker_env`` (an allocator's preload) only in the worker processes Ray starts for
    it (trial actors that train, tasks), where it takes effect at their start.

    A local cluster is always a new one (never a ``ray start`` cluster found on the machine: joining one
    is what ``address`` is for), single-node, and bound to 127.0.0.1 (:func:`_loopback_only`). Its
    dashboard keeps Ray's token authentication (:func:`nmtcore.sweep.dashboard.dashboard_access`).
    """
    local = {} if address else {k: os.environ.get(k, v) for k, v in LOCAL_RAY_ENV.items()}
    env_vars = {**RAY_ENV, **local, **(env or {})}
    for k, v in env_vars.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"log_to_driver": log_to_driver,
                                  "runtime_env": {"env_vars": {**env_vars, **(worker_env or {})}},
                                  "configure_logging": True, "logging_level": logging.WARNING}
        if address:
            ctx = ray.init(address=address, **kwargs)
        else:
            with _loopback_only():
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
    else:
        url = None
        with contextlib.suppress(Exception):
            url = ray._private.worker.get_dashboard_url()  # noqa: SLF001
    if url and not url.startswith("http"):
        url = f"http://{url}"
    return url or None


@contextlib.contextmanager
def _loopback_only() -> Any:
    """While a local cluster starts: Ray's node IP is 127.0.0.1, so the GCS, the raylet, every worker and the
    dashboard's agents listen there only (``dashboard_host`` covers the dashboard's HTTP port alone, and
    ``_node_ip_address="127.0.0.1"`` is swapped for the routable address by Ray itself).

    The one switch Ray has is ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (it also makes the cluster
    single-node, which a local cluster is). Ray reads it once, at ``import ray``, and this module is
    imported before anyone knows whether the sweep will join a cluster (``--address``: there the driver
    must be reachable from the other nodes). So the choice is made here, when a *local* cluster starts:
    the variable is set for the processes ``ray.init`` spawns (they read it at their own import) and Ray's
    constant for this process, both restored afterwards. A joined cluster is untouched, and so is a user's
    explicit ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=1`` (a local head other nodes may join).
    """
    from ray._private import ray_constants

    if os.environ.get(LOOPBACK_VAR) == "1":
        yield
        return
    saved_env, saved_const = os.environ.get(LOOPBACK_VAR), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[LOOPBACK_VAR] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_const
        if saved_env is None:
            os.environ.pop(LOOPBACK_VAR, None)
        else:
            os.environ[LOOPBACK_VAR] = saved_env


# A local cluster's own processes (GCS, raylet, the dashboard and its modules, the log monitor, the agents) run at
# nice 0 and Ray's workers, trials included, at nice 15: each of the control plane's wake-ups (hundreds a second)
# preempts a trial's threads at once, and a 2-thread trial on 2 cores waits for the preempted one. At nice 19 they
# run beside the trials instead of ahead of them: inside a sweep, a 2-epoch 2-thread trial trained in 98.5 / 94.2 s
# with the daemons (not yet the agents) at 19 against 102.5 / 98.3 s at Ray's default, in ABBA order (direct runs
# 100.3 / 90.6 s; results/bench/2026-11-29-trial-in-actor/).
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


def workers_have(env: Mapping[str, str]) -> bool:
    """Whether the workers Ray starts for this connection get every variable of ``env`` (the job's runtime
    environment sets it): a trial actor can then train on the allocator a Train worker would have preloaded."""
    if not env:
        return True
    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return all(job_env.get(k) == v for k, v in env.items())


def shutdown_ray() -> None:
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


# ---------------------------------------------------------------------------------- the pre-sweep tasks
TASK_ENV_PREFIXES = ("NMTCORE_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "MLFLOW_")
_DONE = object()


class _LineHandler(logging.Handler):
    """Forwards ``nmtcore.*`` log records (BERT pretraining's steps...) as progress lines."""

    def __init__(self, lines: queue.Queue[Any]) -> None:
        super().__init__(logging.INFO)
        self.lines = lines

    def emit(self, record: logging.LogRecord) -> None:
        prefix = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        self.lines.put(prefix + record.getMessage())


@ray.remote(num_returns="streaming")
def _pre_sweep_task(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], threads: int,
                    progress_kw: str | None) -> Any:
    """Run ``fn`` (in a thread of this Ray task) and stream ``("line", text)`` for every progress line it
    gives (its ``progress_kw`` callback and its ``nmtcore`` log records), then ``("result", value)``."""
    import torch

    lines: queue.Queue[Any] = queue.Queue()
    out: dict[str, Any] = {}
    logger = logging.getLogger("nmtcore")
    handler = _LineHandler(lines)
    saved = (logger.level, logger.propagate, torch.get_num_threads())
    logger.setLevel(logging.INFO)
    logger.propagate = False  # the lines reach the driver through this stream, not twice through Ray's logs
    logger.addHandler(handler)
    torch.set_num_threads(max(1, threads))
    if progress_kw:
        kwargs = {**kwargs, progress_kw: lines.put}

    def work() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the task
            out["error"] = e
        finally:
            lines.put(_DONE)

    worker = threading.Thread(target=work, name="pre-sweep", daemon=True)
    worker.start()
    try:
        while (item := lines.get()) is not _DONE:
            yield ("line", item)
    finally:
        worker.join()
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]
        torch.set_num_threads(saved[2])
    if "error" in out:
        raise out["error"]
    yield ("result", out["value"])


def free_cpus(cpus: float, settle_s: float = 5.0) -> float:
    """The CPUs Ray has free now, waiting up to ``settle_s`` for all ``cpus`` to come back: Ray reports a task's
    CPUs free a moment after the task ended, so the next pre-sweep task would otherwise take 1 of 2 CPUs (and
    run on one thread) for no reason; what another sweep really holds stays held, and we go on without it."""
    deadline = time.monotonic() + settle_s
    while (free := ray.available_resources().get("CPU", 0.0)) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def run_pre_sweep_task(name: str, fn: Callable[..., T], *args: Any, gpus: float = 0.0,
                       progress_kw: str | None = None, env: Mapping[str, str] | None = None, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` as a Ray task named ``name`` (so the dashboard lists it, under the sweep's
    job), on the driver's node with its CPUs (torch threads to match) and ``gpus``, with the driver's
    cache and hub settings and ``env`` added to its process's environment (a task that trains: the allocator's
    preload, :meth:`~nmtcore.sweep.settings.SweepSettings.worker_env`); blocks until it ends, printing its
    progress (:class:`PhaseProgress`). Returns its value; raises its exception as it was raised (a user error
    stays a one-line error)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in cluster_nodes() if n["node_id"] == node_id), None)
    cpus = max(1.0, float(node["cpus"])) if node else 1.0
    # Reserve the node's CPUs, or what is free of them: a reservation another sweep of this process left
    # behind (a stopped trial's worker group) must not make this task wait forever for CPUs that never free.
    remove_leaked_placement_groups()
    reserve = max(1.0, min(cpus, float(int(free_cpus(cpus)))))
    env = {**{k: v for k, v in os.environ.items() if k.startswith(TASK_ENV_PREFIXES)}, **(env or {})}
    progress = PhaseProgress(name)
    progress.started(f"Ray task, {reserve:g} CPU{'s' if reserve != 1 else ''}" + (f", {gpus:g} GPU" if gpus else "")
                     + (f" ({cpus - reserve:g} of the node's held by others)" if reserve < cpus else ""))
    gen = _pre_sweep_task.options(
        name=name, num_cpus=reserve, num_gpus=gpus, runtime_env={"env_vars": env},
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=True),
    ).remote(fn, args, kwargs, int(reserve), progress_kw)
    try:
        while True:
            ready, _ = ray.wait([gen], timeout=HEARTBEAT_S)
            if not ready:
                progress.heartbeat()
                continue
            try:
                kind, value = ray.get(next(gen))
            except StopIteration:
                raise RuntimeError(f"{name}: the task ended without a result") from None
            if kind == "line":
                progress.line(str(value))
                continue
            progress.finished()
            return value
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, BaseException):
            raise cause from None  # the task's own error, as the driver raised it before these were tasks
        raise
    except BaseException:
        with contextlib.suppress(Exception):
            ray.cancel(gen)
        raise


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
    # Rungs at grace·rf^k < max_epochs; a trial reaching max_epochs is left alone (stop_last_trials=False):
    # ASHA would otherwise stop it at its last epoch's report, before it decodes and scores the test set.
    return ASHAScheduler(time_attr="epoch", max_t=max_epochs, grace_period=min(settings.grace_period, max_epochs),
                         reduction_factor=settings.reduction_factor, stop_last_trials=False)


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


# How often a Tune trial asks its result queue actor whether the Train run reported, in seconds. Ray's default
# is 0.2 s: five remote calls a second for the trial's whole life. A call returns as soon as a result is there,
# so a longer wait delays no report (the end of a trial is noticed up to this much later).
RESULT_POLL_S = 1.0


def _poll_less() -> None:
    """Make this process's Tune result wait :data:`RESULT_POLL_S` (best effort: a private setting of this Ray
    version, checked by ``tests/test_sweep_polling.py``)."""
    try:
        from ray.train._internal import session as train_session
    except ImportError:  # pragma: no cover - another Ray version
        return
    if isinstance(getattr(train_session, "_RESULT_FETCH_TIMEOUT", None), (int, float)):
        train_session._RESULT_FETCH_TIMEOUT = RESULT_POLL_S  # noqa: SLF001


class TrialTrainer(TorchTrainer):
    """Ray Train's ``TorchTrainer`` without two helper actors a sweep trial pays for and does not use.

    Each is one more Ray process per trial, and on this project's 2-core machines one cost 7.7-10.6 CPU seconds over
    one 2-thread trial, taken from the trial's own threads (per-process CPU, docs/performance.md "What a sweep
    costs a trial"):

    * the dataset manager (``DatasetsCallback``): created for every run even with no Ray dataset; trials read
      their data themselves, so a trainer given ``datasets`` keeps it;
    * the placement-group cleaner (``PlacementGroupCleanerCallback``): a detached actor asking the GCS every
      second whether the controller lives, to free its worker reservation if it died. The sweep already does
      that for every trial, from the driver: ``remove_leaked_placement_groups`` before each trial starts,
      after each ends and every ``pg_check_s`` (:class:`_SweepCallback`).
    """

    def _create_default_callbacks(self) -> list[Any]:
        from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
        from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback

        unused = (PlacementGroupCleanerCallback,) if self.datasets else (PlacementGroupCleanerCallback,
                                                                          DatasetsCallback)
        return [c for c in super()._create_default_callbacks() if not isinstance(c, unused)]


def _trial_main(config: dict[str, Any], ctx: SweepContext) -> None:
    """One Tune trial: open (or re-attach) its MLflow child run, then train, here (``ctx.in_actor``) or in a
    TorchTrainer's workers."""
    _poll_less()
    overrides = trial_overrides(ctx.space, config, ctx.base_seed)
    key = trial_key(overrides)
    existing = find_child_run(ctx.parent_run_id, key, ctx.tracking_uri)
    if existing is not None and existing.tags.get(TRIAL_STATE_TAG) == TrialState.COMPLETE.value:
        # Trained and scored by an earlier attempt (e.g. before a driver crash the experiment state
        # did not record): report its results instead of training a duplicate. A process killed between
        # marking the run complete and ending it left it RUNNING: end it as what it is.
        if existing.status == "RUNNING":
            end_trial(existing.run_id, TrialState.COMPLETE, ctx.tracking_uri)
        tune.report(final_metrics_from_run(existing))
        return
    if existing is not None and existing.tags.get(FAILURE_KIND_TAG) == "nonfinite":
        raise NonFiniteTrialError(existing.tags.get(tracking.FAILURE_REASON_TAG, "non-finite loss"))
    if existing is not None and existing.tags.get(FAILURE_KIND_TAG) == "oom":
        # The same config in the same packing would run out of memory again: not retried blindly.
        raise TrialOutOfMemoryError(existing.tags.get(tracking.FAILURE_REASON_TAG, "out of memory"))
    point, control = trial_point(ctx.space, config)
    name = run_name(point, control, overrides.get(SEED_KEY, ctx.base_seed))
    run_id, _ = open_child_run(ctx.parent_run_id, key, name, ctx.child_tags(overrides, point, control),
                               ctx.tracking_uri, params=ctx.child_params(point, control))
    trial_id = tune.get_context().get_trial_id()
    set_trial_state(run_id, TrialState.RUNNING, ctx.tracking_uri, tags={schema.TUNE_TRIAL_ID: trial_id})
    cfg = trial_config(ctx.base, overrides, Path(ctx.scratch_dir) / key, ctx.threads_per_worker)
    memory = ctx.trial_estimate(cfg)
    tracking.set_run_tags(run_id, {MEMORY_TAG: f"{memory.total / GIB:.2f}"}, ctx.tracking_uri)
    launch = TrialLaunch(cfg=cfg, run_id=run_id, tracking_uri=ctx.tracking_uri, trial_key=key, trial_id=trial_id,
                         test_split=ctx.test_split, metric=ctx.metric, threads=ctx.threads_per_worker,
                         borrow_idle_cpus=ctx.borrow_idle_cpus, borrow_check_s=ctx.borrow_check_s,
                         gpus=ctx.gpus_per_worker * ctx.workers, callbacks=tuple(ctx.trial_callbacks),
                         in_actor=ctx.in_actor)
    try:
        if ctx.in_actor:  # this actor reserved the trial's CPUs and memory estimate (trial_actor_resources)
            _train_loop({LAUNCH_KEY: launch})
        else:
            _trainer(ctx, key, memory.total, {LAUNCH_KEY: launch}).fit()
    except Exception as e:
        reason = failure_reason(e)
        oom = is_out_of_memory(reason)
        if oom:
            reason = (f"{reason} (out of memory; its estimate was {memory.describe()}: lower data.max_tokens or "
                      "--max-concurrent, or give the sweep more memory)")
        with contextlib.suppress(Exception):  # the worker may already have ended it with the exact reason
            end_trial(run_id, TrialState.FAILED, ctx.tracking_uri, reason=reason)
        if oom:
            with contextlib.suppress(Exception):
                tracking.set_run_tags(run_id, {FAILURE_KIND_TAG: "oom"}, ctx.tracking_uri)
        if "NonFiniteLossError" in reason:
            raise NonFiniteTrialError(reason) from None
        if oom:
            raise TrialOutOfMemoryError(reason) from None
        raise


def _trainer(ctx: SweepContext, key: str, memory_bytes: int, loop_config: dict[str, Any]) -> TrialTrainer:
    """The trial's Ray Train run: ``ctx.workers`` workers, each reserving its CPUs, GPUs and the memory
    estimate (trials beyond the node's memory wait, not crash)."""
    resources = {"CPU": ctx.cpus_per_worker, "memory": memory_bytes}
    if ctx.gpus_per_worker:
        resources["GPU"] = ctx.gpus_per_worker
    return TrialTrainer(
        _train_loop, train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(num_workers=ctx.workers, use_gpu=ctx.gpus_per_worker > 0,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            # A stable name per trial key: a retried trial resumes this Train run's last checkpoint.
            name=f"{ctx.name}-{key}", storage_path=ctx.train_storage,
            failure_config=ray.train.FailureConfig(max_failures=0,
                                                   controller_failure_limit=ctx.controller_failure_limit),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            callbacks=[TuneReportCallback()],
            # Set when each worker process starts: an allocator can only be preloaded then (nmtcore.allocator).
            worker_runtime_env={"env_vars": dict(ctx.worker_env)} if ctx.worker_env else None),
    )


class _RayReport(Callback):
    """Reports every epoch's metrics to Ray Train (rank 0 adds the epoch checkpoint), or to Tune where the
    trial trains in its Tune actor (``in_actor``), and sums the workers' CPU seconds at the end (all ranks take
    part in the all-reduce).

    Order matters: Tune's status table shows the first four metrics of the first results, so every report
    starts with ``epoch`` and the sweep's ``metric``."""

    def __init__(self, metric: str = "", in_actor: bool = False) -> None:
        self.in_actor = in_actor
        self.cpu_s = 0.0
        self.metric = metric
        self.last_epoch: dict[str, float] = {}
        self._cpu0 = time.process_time()

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float],
                     checkpoint: Path | None) -> None:
        report = first_keys({k: float(v) for k, v in metrics.items()}, epoch=float(epoch), metric=self.metric)
        self.last_epoch = dict(report)
        if checkpoint is None:
            self.report(report)
            return
        # Hard links (not copies) into a fresh directory Ray uploads and then deletes.
        tmp = Path(tempfile.mkdtemp(prefix="nmtcore-ckpt-"))
        for src in (checkpoint, checkpoint.with_name(checkpoint.name + ".sha256")):
            if src.exists():
                _link_or_copy(src, tmp / src.name)
        self.report(report, tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        """To Tune where the trial trains in its actor (Tune copies a checkpoint into the trial's directory and
        keeps the last one), else to Ray Train (which uploads it, then deletes ``checkpoint_dir``)."""
        if self.in_actor:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(checkpoint_dir))
                        if checkpoint_dir else None)
        elif checkpoint_dir is None:
            ray.train.report(metrics)
        else:
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(str(checkpoint_dir)),
                             delete_local_checkpoint_after_upload=True)

    def on_train_end(self, trainer: Trainer, summary: RunSummary) -> None:
        self.cpu_s = all_reduce_sum(time.process_time() - self._cpu0)


TRIAL_PROCESS_TAG = schema.TRIAL_PROCESS


LAUNCH_KEY = "launch"  # Ray Train's train_loop_config is a dict: the typed payload under one key


def _train_loop(loop_config: dict[str, Any]) -> None:
    """A Ray Train worker, or the Tune trial actor itself (``TrialLaunch.in_actor``; Ray refuses ``ray.train``'s
    calls there): the unchanged nmtcore experiment, reporting through callbacks."""
    lc: TrialLaunch = loop_config[LAUNCH_KEY]
    cfg = ensure_bert(lc.cfg, threads=lc.threads)  # made once by the driver; here it only resolves
    in_actor = lc.in_actor
    rank = 0 if in_actor else ray.train.get_context().get_world_rank()
    if in_actor and cfg.train.compile:  # a reused actor: compile afresh, as a new process would (no stale graphs)
        import torch._dynamo

        torch._dynamo.reset()
    node_ids = all_gather(ray.get_runtime_context().get_node_id())
    _restore_train_checkpoint(Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints"),
                              tune.get_checkpoint() if in_actor else ray.train.get_checkpoint())
    reporter = _RayReport(lc.metric, in_actor)
    callbacks: list[Callback] = [reporter]  # Ray first, then MLflow, then the caller's: an epoch is
    tracker: tracking.Tracker | None = None  # checkpointed and logged before user code can fail it
    if rank == 0:
        tracker = tracking.Tracker(lc.tracking_uri, run_id=lc.run_id)
        callbacks.append(TrialTracking(tracker, cfg, reporter, node_ids, lc.gpus,
                                        {schema.TUNE_TRIAL_ID: lc.trial_id,
                                         TRIAL_PROCESS_TAG: "tune actor" if in_actor else "train workers"}))
    borrow = BorrowIdleCpus(single_node_idle_cpus, lc.borrow_check_s) if lc.borrow_idle_cpus else None
    if borrow is not None:
        callbacks.append(borrow)
    callbacks += list(lc.callbacks)
    # Rank 0's tracker ends the child run: FINISHED, or FAILED with the one-line reason.
    with tracker if tracker is not None else contextlib.nullcontext():
        try:
            summary = run_experiment(cfg, callbacks=callbacks, resume=True)
        except NonFiniteLossError:
            if tracker is not None:
                tracker.set_tags({FAILURE_KIND_TAG: "nonfinite", TRIAL_STATE_TAG: TrialState.FAILED.value})
            raise
        except Exception as e:
            # Any other error (out of memory...): the run ends FAILED below; its state must say so too
            # (else a FAILED run stays "running": the driver's clean-up only touches RUNNING runs).
            if tracker is not None:
                with contextlib.suppress(Exception):  # never mask the error that ended the trial
                    kind = {FAILURE_KIND_TAG: "oom"} if is_out_of_memory(failure_reason(e)) else {}
                    tracker.set_tags({TRIAL_STATE_TAG: TrialState.FAILED.value, **kind})
            raise
        final = dict(reporter.last_epoch) or last_epoch_metrics(cfg)
        test = summary.test.get(lc.test_split) or next(iter(summary.test.values()), None)
        final.update({"test_bleu": test.bleu if test else float("nan"),
                      "test_chrf": test.chrf if test else float("nan"), "trial_complete": 1.0,
                      "node_ids": ",".join(node_ids)})
        if borrow is not None and tracker is not None:
            tracker.set_tags({schema.MAX_THREADS: borrow.max_threads})  # > train.num_threads: idle CPUs were used
        reporter.report(first_keys(final, epoch=float(summary.epochs), metric=lc.metric))


TABLE_KEYS = ("valid_loss", "valid_bleu", "train_loss")  # after the sweep's metric, in Tune's table


def first_keys(metrics: Mapping[str, Any], epoch: float, metric: str) -> dict[str, Any]:
    """``metrics`` with ``epoch`` first, then the sweep's metric and :data:`TABLE_KEYS`: the four columns
    Tune's status table shows (it takes the first four of a trial's first result)."""
    out: dict[str, Any] = {"epoch": epoch}
    out.update((k, metrics[k]) for k in (metric, *TABLE_KEYS) if k in metrics)
    out.update((k, v) for k, v in metrics.items() if k not in out)
    return out


def _restore_train_checkpoint(save_dir: Path, ckpt: Any) -> None:
    """Put the latest checkpoint Ray holds for the trial (Train's or Tune's: a retried trial's, possibly from
    another node) into the trainer's checkpoint directory unless a checkpoint at least as new is already there."""
    if ckpt is None:
        return
    with ckpt.as_directory() as d:
        files = sorted(Path(d).glob("epoch*.pt"))
        if not files:
            return
        newest_local = epoch_checkpoints(save_dir)[-1:] if save_dir.exists() else []
        if newest_local and epoch_of(newest_local[0]) >= epoch_of(files[-1]):
            return
        save_dir.mkdir(parents=True, exist_ok=True)
        for src in [files[-1], files[-1].with_name(files[-1].name + ".sha256")]:
            if src.exists():
                tmp = save_dir / f".{src.name}.{uuid.uuid4().hex}.tmp"
                shutil.copyfile(src, tmp)
                os.replace(tmp, save_dir / src.name)
        log.info("restored %s from Ray Train checkpoint %s", files[-1].name, ckpt.path)


class _SweepCallback(tune.Callback):
    """Keeps MLflow in step with Tune and keeps the cluster free of leaked worker reservations.

    * a trial stopped by the scheduler (ASHA) leaves its child run RUNNING: end it FINISHED, tagged
      ``stopped_early`` with the epoch it reached;
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
        if run is not None and run.status == "RUNNING":
            epoch = (trial.last_result or {}).get("epoch")
            end_trial(run.run_id, TrialState.STOPPED_EARLY, self.ctx.tracking_uri,
                      tags={schema.STOPPED_AT_EPOCH: epoch if epoch is not None else "",
                            TUNE_STATUS_TAG: "TERMINATED"})
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
        self._say(f"trial {self.name_of(trial)}: started" + (f" (resumes after epoch {epoch})" if epoch else ""))

    def on_trial_result(self, iteration: int, trials: list[Any], trial: Any, result: dict[str, Any],
                        **info: Any) -> None:
        epoch = int(result.get("epoch") or 0)
        value = result.get(self.metric)
        shown = f" {self.metric} {value:.2f}" if isinstance(value, (int, float)) else ""
        self._say(f"trial {self.name_of(trial)}: {PhaseProgress.bar(epoch, self.max_epochs)} "
                  f"epoch {epoch}/{self.max_epochs}{shown} ({self._ran(trial)} so far)")

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        epoch = self._epoch(trial)
        how = "finished" if epoch >= self.max_epochs else f"stopped by the scheduler after epoch {epoch}"
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


def _set_concurrency(tuner: tune.Tuner, n: int) -> None:
    tune_config = getattr(getattr(tuner, "_local_tuner", None), "_tune_config", None)
    if tune_config is None:  # pragma: no cover - Ray internals moved
        log.warning("could not set the restored Tuner's concurrency to %d", n)
        return
    if isinstance(tune_config.search_alg, BasicVariantGenerator):
        tune_config.search_alg.max_concurrent = n
    else:
        tune_config.max_concurrent_trials = n


def _replace_callbacks(tuner: tune.Tuner, ours: list[tune.Callback]) -> None:
    internal = getattr(tuner, "_local_tuner", None)
    run_config = getattr(internal, "_run_config", None) if internal is not None else None
    if run_config is None:  # pragma: no cover - Ray internals moved
        log.warning("could not re-install the sweep callbacks on the restored Tuner")
        return
    others = [c for c in (run_config.callbacks or []) if not isinstance(c, (_SweepCallback, _TrialsConsole))]
    run_config.callbacks = [*others, *ours]


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


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


def _named_trainable(sweep: str) -> Callable[[dict[str, Any], SweepContext], None]:
    """:func:`_trial_main` under a name that says which sweep it belongs to: Ray shows every trial's actor
    with this name (the dashboard's Actors page, "Repr"), and its tasks as ``<name>.train``."""
    def trial(config: dict[str, Any], ctx: SweepContext) -> None:
        _trial_main(config, ctx)

    trial.__name__ = trial.__qualname__ = f"trial of {sweep}"
    return trial


# ============================================================================== the Tune run
@dataclass
class TuneOutcome:
    """What a Tune run left: its trials as Tune saved them (``trial_id``, ``status``, ``config``,
    ``last_result``) and how many leaked worker reservations were removed on the way."""

    trials: list[Any]
    leaked_removed: int


def run_tune(ctx: SweepContext, settings: SweepSettings, exp_dir: str, max_epochs: int, restore: bool,
             cells: bool | None = None, on_trial_end: Callable[[dict[str, Any]], None] | None = None,
             before_fit: Callable[[], None] | None = None) -> TuneOutcome:
    """Run (``restore``: continue) one Tune run of ``ctx.space`` under ``exp_dir``: its cells (a grid study,
    or a sampled study's control), or (``cells=False``) the search of a sampled space. Blocks until it ends
    or is interrupted. ``before_fit`` is called once the Tuner is ready (the driver prints where to watch)."""
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
    trainable = tune.with_resources(tune.with_parameters(_named_trainable(ctx.name), ctx=ctx),
                                    trial_actor_resources(ctx))
    pspace = param_space(space, settings.seeds, ctx.base_seed, cells)
    name = Path(exp_dir).name
    if restore and tune.Tuner.can_restore(exp_dir):
        tuner = tune.Tuner.restore(exp_dir, trainable=trainable, param_space=pspace, resume_unfinished=True,
                                   resume_errored=False, restart_errored=False)
        # A restored Tuner keeps the callbacks and limits it was created with (pickled); ours must be live,
        # and the concurrency must fit the cluster the sweep resumes on.
        _replace_callbacks(tuner, [callback, console])
        _set_concurrency(tuner, max_concurrent)
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
                                      callbacks=[callback, console], verbose=settings.verbose))
    if before_fit is not None:
        before_fit()
    tuner.fit()
    # Tune's saved state, not the live trial objects: an interrupted run marks its running trials TERMINATED
    # in memory but saves them as unfinished, to be resumed.
    return TuneOutcome(trials=_saved_trials(exp_dir) or callback.trials, leaked_removed=callback.leaked_removed)
