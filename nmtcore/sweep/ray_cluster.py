"""The Ray cluster a sweep runs on: starting a local one (or joining ``address``), who can reach it, what it
has room for, and cleaning up after Ray Train.

Who can reach the local cluster: every Ray process of it listens on 127.0.0.1 only (GCS, raylet, workers,
dashboard and its agents; see :func:`init_ray` for how), and the dashboard keeps Ray's token authentication
(on by default for a cluster ``ray.init`` starts; ``RAY_AUTH_MODE=disabled`` turns it off): loopback alone
does not keep out other users of the same machine. :func:`dashboard_access` says how to sign in (the token
is never printed: consoles end up in logs and issues). A joined cluster keeps its own binding and auth,
after :func:`check_cluster` has seen that every node reaches the storage, the data and MLflow.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Mapping

import ray

from nmtcore import tracking
from nmtcore.config import ExperimentConfig
from nmtcore.sweep.memory import GIB
from nmtcore.sweep.settings import SweepError, SweepSettings, is_uri

log = logging.getLogger("nmtcore.sweep")

# Environment for every Ray process a sweep starts (local cluster or runtime_env when joining).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "0",
    "NMTCORE_NO_PROGRESS": "1",
}


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
             env: Mapping[str, str] | None = None, memory_gb: float | None = None) -> str | None:
    """Start a local Ray cluster (or join ``address``) unless this process is already connected;
    returns the dashboard URL (``http://127.0.0.1:8265``) or None.

    A local cluster is always a new one (never a ``ray start`` cluster found on the machine: joining one
    is what ``address`` is for), single-node, and bound to 127.0.0.1 (:func:`_loopback_only`). Its
    dashboard keeps Ray's token authentication (:func:`dashboard_access`).
    """
    env_vars = {**RAY_ENV, **(env or {})}
    for k, v in env_vars.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"log_to_driver": log_to_driver, "runtime_env": {"env_vars": env_vars},
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
            _private_token_file()
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


def token_source() -> tuple[str, Path | None]:
    """Where Ray takes its auth token from, as Ray looks (``$RAY_AUTH_TOKEN``, the file in
    ``$RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``): (a phrase for people, the file or None)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "$RAY_AUTH_TOKEN of the sweep's environment", None
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
        return f"the file {path} ($RAY_AUTH_TOKEN_PATH)", path
    path = Path.home() / ".ray" / "auth_token"
    return f"the file {path}", path


def _private_token_file() -> None:
    """Ray writes a token it generates world-readable (0644); the token opens the dashboard, so 0600."""
    if os.environ.get("RAY_AUTH_MODE") == "disabled":
        return
    _, path = token_source()
    with contextlib.suppress(OSError):
        if path is not None and path.is_file() and path.stat().st_uid == os.getuid() and path.stat().st_mode & 0o077:
            path.chmod(0o600)


def dashboard_auth_mode(url: str, timeout_s: float = 3.0) -> str:
    """``token`` or ``disabled`` as the dashboard at ``url`` says (its public ``/api/authentication_mode``),
    or ``unknown``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/api/authentication_mode", timeout=timeout_s) as r:
            return str(json.loads(r.read()).get("authentication_mode", "unknown"))
    except Exception:
        return "unknown"


def dashboard_access(url: str | None, local: bool) -> list[str]:
    """Lines telling a user how to open the Ray dashboard at ``url``: where it listens and how to sign in
    (the command and the token's file; never the token itself)."""
    if not url:
        return ["Ray dashboard:   (not started)"]
    where = "local cluster, every Ray port on 127.0.0.1 only" if local else "the joined cluster's"
    lines = [f"Ray dashboard:   {url}  ({where})"]
    mode = dashboard_auth_mode(url)
    source, _ = token_source()
    if mode == "token":
        lines += ["  sign in once:  the dashboard asks for Ray's auth token: paste what `ray get-auth-token` prints",
                  f"                 (run where the sweep runs; the token is {source}); the browser keeps it 30 days"]
    elif mode == "disabled":
        lines.append("  no sign-in:    token auth is off (RAY_AUTH_MODE=disabled): anyone who reaches "
                     f"{url.split('://', 1)[-1]} can use it" + (" (this machine only)" if local else ""))
    else:
        lines.append(f"  sign in:       if asked for a token, paste what `ray get-auth-token` prints ({source})")
    return lines


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


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


def ray_is_running() -> bool:
    """Whether this process is connected to a Ray cluster."""
    return ray.is_initialized()
