"""The work a sweep's trials share, run once before them as named Ray tasks on the driver's node: the data
("prepare data ..."), every distinct BERT ("prepare BERT ...": made here if nothing answers, with its quality
figure) and the protocol's baseline ("train baseline ..." or "reuse baseline ..."). The dashboard lists
them under the sweep's job; the console shows their progress lines, with a bar and an ETA where a line
counts units of work, and "still running" when one is silent for :data:`HEARTBEAT_S`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import re
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, TypeVar

import ray

from nmtcore.bert import prepare_bert_inputs
from nmtcore.bert.ensure import ensure_bert_resolved
from nmtcore.config import DataConfig, ExperimentConfig
from nmtcore.data import prepare_data
from nmtcore.engine import setup_torch
from nmtcore.models import build_model, prepare_model_resources
from nmtcore.sweep.baseline import Baseline, baseline_key, default_root, ensure_baseline, find_baseline
from nmtcore.sweep.memory import BertFootprint
from nmtcore.sweep.ray_cluster import cluster_nodes, remove_leaked_placement_groups

T = TypeVar("T")

log = logging.getLogger("nmtcore.sweep")

HEARTBEAT_S = 30.0  # a pre-sweep task silent this long gets a "still running" line on the console
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


class PhaseProgress:
    """The console of one long phase: its progress lines, with a bar and an ETA where a line counts units
    of work ("step 300/1000", "epoch 2/10"), "still running" when it is silent for :data:`HEARTBEAT_S`, and
    how long it took."""

    UNIT = re.compile(r"\b(step|epoch|update|sentence)s? (\d+)/(\d+)\b")

    def __init__(self, name: str, out: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.out = out or console_line
        self.t0 = time.monotonic()
        self.first: dict[str, tuple[float, int]] = {}  # unit -> (time, count) when first seen
        self.last: tuple[str, int, int] | None = None  # (unit, done, total)
        self.t_last = self.t0  # when ``last`` was seen

    def started(self, where: str) -> None:
        self.out(f"{self.name}: started ({where})")

    def line(self, text: str) -> None:
        m = self.UNIT.search(text)
        if m is None:
            self.out(f"{self.name}: {text}")
            return
        unit, done, total = m.group(1), int(m.group(2)), int(m.group(3))
        self.first.setdefault(unit, (time.monotonic(), done))
        self.last = (unit, done, total)
        self.t_last = time.monotonic()
        eta = "" if "to go" in text else self._eta()
        self.out(f"{self.name}: {self.bar(done, total)} {text}{eta}")

    def heartbeat(self) -> None:
        last = f"; last: {self.last[0]} {self.last[1]}/{self.last[2]}{self._eta()}" if self.last else ""
        self.out(f"{self.name}: still running, {duration(time.monotonic() - self.t0)} elapsed{last}")

    def finished(self) -> None:
        self.out(f"{self.name}: done in {duration(time.monotonic() - self.t0)}")

    @staticmethod
    def bar(done: int, total: int, width: int = 20) -> str:
        frac = min(1.0, done / total) if total else 1.0
        full = int(round(frac * width))
        return f"[{'#' * full}{'.' * (width - full)}] {frac:4.0%}"

    def _eta(self) -> str:
        if self.last is None:
            return ""
        unit, done, total = self.last
        t_first, n_first = self.first[unit]
        if done <= n_first or done >= total:
            return ""
        rate = (self.t_last - t_first) / (done - n_first)  # per unit, between the first and the last line
        left = max(0.0, rate * (total - done) - (time.monotonic() - self.t_last))
        return f" (about {duration(left)} to go)"


def console_line(text: str) -> None:
    """One line of a sweep's console, stamped with the wall-clock time (so a log shows where time went)."""
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def duration(seconds: float) -> str:
    """``42 s``, ``12.5 min``: how long something took or will take, as the console says it."""
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def free_cpus(cpus: float, settle_s: float = 5.0) -> float:
    """The CPUs Ray has free now, waiting up to ``settle_s`` for all ``cpus`` to come back: Ray reports a task's
    CPUs free a moment after the task ended, so the next pre-sweep task would otherwise take 1 of 2 CPUs (and
    run on one thread) for no reason; what another sweep really holds stays held, and we go on without it."""
    deadline = time.monotonic() + settle_s
    while (free := ray.available_resources().get("CPU", 0.0)) < cpus and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def run_pre_sweep_task(name: str, fn: Callable[..., T], *args: Any, gpus: float = 0.0,
                       progress_kw: str | None = None, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` as a Ray task named ``name`` (so the dashboard lists it, under the sweep's
    job), on the driver's node with its CPUs (torch threads to match) and ``gpus``, with the driver's
    cache and hub settings; blocks until it ends, printing its progress (:class:`PhaseProgress`). Returns
    its value; raises its exception as it was raised (a user error stays a one-line error)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node_id = ray.get_runtime_context().get_node_id()
    node = next((n for n in cluster_nodes() if n["node_id"] == node_id), None)
    cpus = max(1.0, float(node["cpus"])) if node else 1.0
    # Reserve the node's CPUs, or what is free of them: a reservation another sweep of this process left
    # behind (a stopped trial's worker group) must not make this task wait forever for CPUs that never free.
    remove_leaked_placement_groups()
    reserve = max(1.0, min(cpus, float(int(free_cpus(cpus)))))
    env = {k: v for k, v in os.environ.items() if k.startswith(TASK_ENV_PREFIXES)}
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


_DATA_CHECKSUMS: dict[str, dict[str, str]] = {}  # data section -> its checksums, prepared in this process's sweeps


def _data_key(data: DataConfig) -> str:
    return json.dumps(asdict(data), sort_keys=True, default=repr)


def _prepare_data_checksums(data: DataConfig) -> dict[str, str]:
    return dict(prepare_data(data).checksums)


def prepare_data_task(data: DataConfig) -> dict[str, str]:
    """Prepare a data section (read, vocabulary, encode: cached) as the task "prepare data <corpus> <src>-<tgt>";
    returns its checksums."""
    checksums = run_pre_sweep_task(f"prepare data {data.corpus} {data.src_lang}-{data.tgt_lang}",
                                   _prepare_data_checksums, data)
    _DATA_CHECKSUMS[_data_key(data)] = checksums
    return checksums


def ensure_bert_task(cfg: ExperimentConfig, what: str) -> tuple[ExperimentConfig, BertFootprint]:
    """:func:`nmtcore.bert.ensure_bert` as the task "prepare BERT <what>" (made here if nothing answers:
    minutes, with its steps on the console), with its quality figure measured once (cached) so every trial
    using it reports what its BERT knows. Returns the config and the BERT's footprint (weights and shape,
    for the trials' memory estimates)."""
    return run_pre_sweep_task(f"prepare BERT {what}", _ensure_bert_footprint, cfg, progress_kw="progress")


def _ensure_bert_footprint(cfg: ExperimentConfig,
                           progress: Callable[[str], None] | None = None) -> tuple[ExperimentConfig, BertFootprint]:
    made, resolved = ensure_bert_resolved(cfg, progress=progress, quality=True)
    assert resolved is not None  # distinct_berts hands over BERT-consuming configs only
    return made, BertFootprint.of_directory(resolved.path)


def bert_features_task(cfg: ExperimentConfig, what: str) -> bool:
    """Build the frozen-feature cache of ``cfg``'s BERT as the task "prepare BERT features <what>" (minutes
    for a wide BERT on the whole corpus, with a line per ~15 s of it), so that no trial spends its slot on it
    silently; every trial then finds it. Returns whether the model reads cached features at all."""
    return run_pre_sweep_task(f"prepare BERT features {what}", build_features, cfg)


def build_features(cfg: ExperimentConfig) -> bool:
    """The feature cache that a trial of ``cfg`` reads, built the way its trainer builds it (data prepared,
    the registered model built, its BERT stream attached: the same cache keys). ``cfg``'s BERT must exist
    already. Returns whether the model reads cached features (False: its BERT trains or runs every step)."""
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    cfg = prepare_model_resources(cfg, data)
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
    layer = prepare_bert_inputs(model, data)
    return layer is not None and layer.cache_wanted


def ensure_baseline_task(cfg: ExperimentConfig, root: str | Path | None = None, **kwargs: Any) -> Baseline:
    """:func:`nmtcore.sweep.baseline.ensure_baseline` (same arguments) as the task "train baseline <key>"
    ("reuse baseline <key>" when it is in the store), on a GPU of the driver's node if it has one."""
    checksums = _DATA_CHECKSUMS.get(_data_key(cfg.data)) or prepare_data_task(cfg.data)
    key = baseline_key(cfg, checksums)
    found = find_baseline(Path(root) if root is not None else default_root(cfg), key)
    node_id = ray.get_runtime_context().get_node_id()
    gpus = next((n["gpus"] for n in cluster_nodes() if n["node_id"] == node_id), 0)
    return run_pre_sweep_task(f"{'reuse' if found else 'train'} baseline {key[:12]}", ensure_baseline, cfg, root,
                              gpus=1.0 if gpus >= 1 and found is None else 0.0, progress_kw="progress", **kwargs)
