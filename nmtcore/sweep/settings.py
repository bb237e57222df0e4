"""How a sweep runs (not what it varies: that is the :class:`~nmtcore.sweep.space.SearchSpace`)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from nmtcore.allocator import AllocatorError, allocator_choice, preload_env, resolve_allocator
from nmtcore.tracking import resolve_tracking_uri
from nmtcore.sweep.timelimit import TimeLimitError, parse_duration

DEFAULT_EXPERIMENT = "nmtcore-sweeps"
REQUIRED_FIELD = dataclasses.MISSING


def option(default: Any, help: str, flag: str = "") -> Any:
    """A settings field that is also a command-line flag of every sweep entry point
    (:mod:`nmtcore.cli.sweep`): ``--field-name`` unless ``flag`` names another."""
    metadata = {"help": help, **({"flag": flag} if flag else {})}
    return field(metadata=metadata) if default is dataclasses.MISSING else field(default=default, metadata=metadata)


class SweepError(ValueError):
    """A sweep cannot start as configured (space, cluster, storage, tracking); one line says what to change."""


@dataclass(frozen=True)
class SweepSettings:
    """How a sweep runs (not what it varies: that is the :class:`~nmtcore.sweep.space.SearchSpace`).

    Paths are made absolute by :func:`resolve_settings`: Ray trials run in their own working
    directories, where a relative path would silently mean something else.

    Args:
        name: the sweep's name: the Tune experiment directory ``<storage>/<name>``, the MLflow parent
            run's name and its ``nmtcore.sweep`` tag.
        storage: Ray Tune/Train results (checkpoints, experiment state): a local path or a cloud URI.
        tracking_uri: MLflow store; ``None`` = :func:`nmtcore.tracking.default_tracking_uri`.
        experiment: MLflow experiment holding the parent and child runs.
        seeds: repeats of every configuration with seeds ``train.seed``, ``+1``, ...
        max_concurrent: trials running at once; 0 = as many as the cluster's resources allow.
        num_samples: Optuna trials (sampled spaces); 0 = the space's default.
        early_stopping: ASHA on the space's metric; ``None`` = the space's default.
        grace_period / reduction_factor: ASHA's minimum epochs and halving rate.
        workers_per_trial: Train workers per trial (DDP when > 1).
        trial_in_actor: a trial of one worker and no GPU trains in its Tune actor (no Ray Train controller and
            worker of its own: ~9 s less per trial and fewer processes beside its threads); multi-worker (DDP)
            and GPU trials always run Ray Train workers.
        borrow_idle_cpus: single-worker CPU trials on a single-node cluster raise their torch threads onto
            CPUs no Ray work holds and give them back when Ray hands them out (:mod:`nmtcore.sweep.idle_cpus`).
        cpus_per_trial / gpus_per_trial: resources of one trial, split evenly over its workers
            (fractional GPUs allowed); torch threads per worker follow the CPUs unless the config
            sets ``train.num_threads``.
        max_failures: Tune retries of a crashed trial, each from its last checkpoint.
        controller_failure_limit: worker-group start timeouts tolerated before a trial fails.
        worker_start_timeout_s: how long one worker-group start may take.
        address: an existing Ray cluster to join (``ray://`` or ``host:port``); ``None`` = start a
            local one (or use the one this process already started).
        resume: continue the sweep ``<storage>/<name>`` instead of starting one.
        time_limit: how long the sweep may run from its start (:func:`~nmtcore.sweep.timelimit.parse_duration`);
            it then stops by sending its process SIGTERM, which the sweep's command turns into Tune's graceful
            stop (:mod:`nmtcore.sweep.timelimit`).
        reuse_trials: copy a finished trial of any sweep in the store whose reuse key is this trial's instead of
            training it again (:mod:`nmtcore.sweep.reuse`); and keep each trial's phase ends in
            ``<storage>/phase-ends``, where a trial whose first phases are another's starts from them
            (:mod:`nmtcore.engine.shared_phases`).
        estimate: print (and log to the parent run as ``estimate.json``) what the baseline and the trials will
            cost here once the shared work is done (:mod:`nmtcore.sweep.cost`); resumed, what is left of them
            (``estimate-left.json``); ``None`` counts as no.
        dashboard: start the Ray dashboard (local clusters only), on ``dashboard_host``.
        num_cpus: logical CPUs of a local cluster; ``None`` = all cores.
        allocator: the C allocator of the trials' training processes and of the shared baseline's
            (:mod:`nmtcore.allocator`); ``None`` = ``$NMTCORE_ALLOCATOR``, else ``auto`` (tcmalloc where installed).
        ray_temp_dir: Ray's session directory for a local cluster (``None`` = Ray's default).
        scratch_dir: trial output directories (node-local is fine); ``None`` = ``<storage>/<name>/trials``
            for a local storage path, else a temporary directory.
        report_dir: where the report is written; ``None`` = ``<storage>/<name>/report``; "" = no report.
        baseline_store: where shared baselines live (:mod:`nmtcore.sweep.baseline`); ``None`` = the data
            cache's ``baselines/``.
        optuna_seed: seed of Optuna's TPE sampler.
        verbose: Tune's console verbosity (0-3).
    """

    name: str = option(REQUIRED_FIELD, "sweep name (default: <study>-<variant>)")
    storage: str = option(REQUIRED_FIELD, "Ray results: a shared path or a cloud URI in cluster mode (default: runs/sweeps)")
    tracking_uri: str | None = option(None, "MLflow tracking URI (default: $MLFLOW_TRACKING_URI or local sqlite)")
    experiment: str = option(DEFAULT_EXPERIMENT, "MLflow experiment")
    seeds: int = option(1, "repeats of every configuration with seeds s, s+1, ...")
    max_concurrent: int = option(0, "trials at once (0: as resources allow)")
    num_samples: int = option(0, "Optuna trials for sampled spaces (0: the space's)")
    early_stopping: bool | None = option(None, "ASHA early stopping on the validation metric (default: the space's)",
                                         flag="--asha")
    grace_period: int = 1
    reduction_factor: int = 2
    workers_per_trial: int = option(1, "Ray Train workers per trial (DDP if > 1)")
    cpus_per_trial: float = option(1.0, "CPUs of one trial")
    gpus_per_trial: float = option(0.0, "GPUs of one trial; may be fractional (0.5: two trials per GPU)")
    borrow_idle_cpus: bool = option(True, "a running trial trains on more threads while CPUs of its (single) node "
                                          "are idle, e.g. in a sweep's last wave (nmtcore.sweep.idle_cpus)")
    trial_in_actor: bool = option(True, "a one-worker CPU trial trains in its Tune trial actor instead of starting a "
                                        "Ray Train controller and worker process of its own (docs/performance.md 'What a sweep "
                                        "costs a trial')")
    borrow_check_s: float = 30.0  # how often a trial looks for idle CPUs (and for lent ones taken back)
    max_failures: int = option(2, "retries of a crashed trial from its checkpoint")
    controller_failure_limit: int = 2
    worker_start_timeout_s: float = 120.0
    address: str | None = option(None, "join this Ray cluster (host:port) instead of starting a local one")
    resume: bool = option(False, "continue the interrupted sweep of the same --name")
    time_limit: str | None = option(None, "be gone by then, counted from the sweep's start: minutes or e.g. "
                                          "2h50m; the sweep stops as SIGTERM stops it (continue with --resume), "
                                          "right after the last epoch checkpoint a trial can write before the "
                                          "limit (nmtcore.sweep.timelimit)")
    reuse_trials: bool = option(True, "a trial already trained in this MLflow store by any sweep with the same "
                                      "config, seed, code, data and starting weights is copied into this sweep "
                                      "instead of trained again (nmtcore.sweep.reuse); a trial whose first "
                                      "phases another trial trained (BERT-JAM's M0-M2 warm-up) starts where they "
                                      "ended (nmtcore.engine.shared_phases)")
    estimate: bool | None = option(None, "before the baseline and the trials, measure this machine's speed on every "
                                         "distinct trial model (a few updates each) and print what they will cost "
                                         "(default: real runs yes, a resumed one what is left of it; smoke tests no)")
    dashboard: bool = option(True, "start the Ray dashboard (local clusters)")
    dashboard_host: str = "127.0.0.1"
    num_cpus: int | None = option(None, "logical CPUs of the local Ray cluster (default: all cores)")
    memory_gb: float | None = option(None, "memory the local Ray cluster may reserve for trials, GiB (default: "
                                           "Ray's share of what is free); trials are packed by their estimates")
    allocator: str | None = option(None, "C allocator of the processes that train: auto (tcmalloc where installed), "
                                         "tcmalloc, jemalloc, system or a library's path (default: $NMTCORE_ALLOCATOR, "
                                         "else auto; nmtcore.allocator)")
    ray_temp_dir: str | None = None
    scratch_dir: str | None = None
    report_dir: str | None = option(None, "report folder (default: <storage>/<name>/report)")
    baseline_store: str | None = option(None, "where shared baselines are kept (default: the data cache's "
                                              "baselines/; in cluster mode a path every node sees)")
    optuna_seed: int = 0
    verbose: int = 1

    def __post_init__(self) -> None:
        if not self.name or "/" in self.name:
            raise SweepError(f"sweep name must be non-empty without '/', got {self.name!r}")
        checks = [
            (self.seeds >= 1, "seeds must be >= 1"),
            (self.max_concurrent >= 0, "max_concurrent must be >= 0"),
            (self.num_samples >= 0, "num_samples must be >= 0"),
            (self.workers_per_trial >= 1, "workers_per_trial must be >= 1"),
            (self.cpus_per_trial > 0, "cpus_per_trial must be > 0"),
            (self.gpus_per_trial >= 0, "gpus_per_trial must be >= 0"),
            (self.max_failures >= 0, "max_failures must be >= 0"),
            (self.memory_gb is None or self.memory_gb > 0, "memory_gb must be > 0"),
            (self.controller_failure_limit >= 0, "controller_failure_limit must be >= 0"),
            (self.grace_period >= 1 and self.reduction_factor >= 2, "ASHA needs grace_period >= 1, reduction_factor >= 2"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SweepError(msg)
        if self.time_limit is not None:
            try:
                parse_duration(self.time_limit)
            except TimeLimitError as e:
                raise SweepError(str(e)) from None
        try:
            resolve_allocator(self.allocator)
        except AllocatorError as e:
            raise SweepError(str(e)) from None

    def worker_env(self) -> dict[str, str]:
        """What the processes that train add to their environment: the allocator's preload. On a joined cluster
        only an explicit choice applies (this machine's libraries say nothing of the nodes')."""
        choice = allocator_choice(self.allocator)
        if self.address and choice == "auto":
            return {}
        return preload_env(choice)  # {} where this process already preloads one (a local cluster's workers inherit it)


def default_storage() -> str:
    """``$NMTCORE_HOME/sweeps`` if set, else ``./runs/sweeps`` (absolute)."""
    home = os.environ.get("NMTCORE_HOME", "").strip()
    return str((Path(home).expanduser() / "sweeps") if home else Path("runs/sweeps").resolve())


def resolve_settings(settings: SweepSettings) -> SweepSettings:
    """Absolute storage/scratch/report paths and a resolved tracking URI."""
    storage = settings.storage if is_uri(settings.storage) else str(Path(settings.storage).expanduser().resolve())
    exp_dir = join(storage, settings.name)
    if settings.scratch_dir:
        scratch = str(Path(settings.scratch_dir).expanduser().resolve())
    elif is_uri(storage):
        scratch = str(Path(tempfile.gettempdir()) / "nmtcore-sweeps" / settings.name)
    else:
        scratch = str(Path(exp_dir) / "trials")
    if settings.report_dir is None:
        report_dir = str(Path(exp_dir) / "report") if not is_uri(storage) else str(Path(scratch) / "report")
    else:
        report_dir = str(Path(settings.report_dir).expanduser().resolve()) if settings.report_dir else ""
    temp = str(Path(settings.ray_temp_dir).expanduser().resolve()) if settings.ray_temp_dir else None
    store = str(Path(settings.baseline_store).expanduser().resolve()) if settings.baseline_store else None
    return replace(settings, storage=storage, scratch_dir=scratch, report_dir=report_dir, ray_temp_dir=temp,
                   baseline_store=store,
                   tracking_uri=resolve_tracking_uri(settings.tracking_uri))


def phase_store(settings: SweepSettings) -> str:
    """Where a sweep's trials keep their phase ends and find other sweeps' (:mod:`nmtcore.engine.shared_phases`):
    ``<storage>/phase-ends``, shared by every sweep of that storage; "" (nothing shared) with ``--no-reuse-trials``
    or a storage that is not a local path."""
    if not settings.reuse_trials or is_uri(settings.storage):
        return ""
    return str(Path(settings.storage) / PHASE_ENDS)


PHASE_ENDS = "phase-ends"


def is_uri(path: str) -> bool:
    """A cloud URI (``s3://``...), not a local path."""
    return "://" in path and not path.startswith("file://")


def join(base: str, *parts: str) -> str:
    """``base/parts`` for a local path or a URI."""
    return "/".join([base.rstrip("/"), *parts]) if is_uri(base) else str(Path(base, *parts))
