"""The work the trials share (:mod:`nmtcore.sweep.pre_sweep`), run once as a named Ray task on the driver's node:
its log lines streamed to the console, the CPUs it may use freed of idle trial reservations first."""

from __future__ import annotations


import contextlib
import logging
import os
import queue
import threading
import time
from typing import Any, Callable, Mapping, TypeVar

import ray
import ray.train

from nmtcore.sweep.progress import HEARTBEAT_S, PhaseProgress

from nmtcore.sweep.ray_backend._private import remove_leaked_placement_groups
from nmtcore.sweep.ray_backend.cluster import cluster_nodes, exit_quietly_on_sigterm, restore_worker_nice
T = TypeVar("T")


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

    exit_quietly_on_sigterm()
    restore_worker_nice()
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
