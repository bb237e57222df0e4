"""Sweeps: a search space and a base experiment become one Ray Tune search whose trials each run the
unchanged nmtcore trainer inside a Ray Train ``TorchTrainer``, tracked as MLflow child runs of one
parent run. The only module of nmtcore that imports Ray.

Shape of a sweep (``run_sweep``)::

    driver (this process)            Tune trial actor (_trial_main)      Train workers (_train_loop)
    ─────────────────────            ──────────────────────────────      ───────────────────────────
    validate space + config          find / create the MLflow child      run_experiment(cfg, callbacks)
    MLflow parent run                  (by trial key: re-attach)           _RayReport: metrics +
    ray.init / join cluster          TorchTrainer(name = trial key)          checkpoint every epoch
    Tuner(search alg, ASHA) .fit()     .fit()                              _TrialTracking (rank 0):
    _SweepCallback: end child runs                                           config, epochs, test,
      of stopped/failed trials,                                              costs → the child run
      remove leaked worker PGs
    report (nmtcore.report)

Search algorithm: a space of grid/choice dimensions is enumerated (Tune's variant generator; seeds
are one more grid dimension); a space with ranges is sampled by Optuna's TPE, seeded, with seeds as
Tune ``Repeater`` repeats. ASHA (on the validation metric, time in epochs) stops poor trials early.

Identity and de-duplication: a trial is identified by its *trial key*, a hash of its flat overrides
(seed included). Its MLflow child run carries the key as a tag, its Ray Train run is named after it
and its checkpoints live under it, so a retried trial (crash) or a resumed sweep (``--resume``)
re-attaches the same child run and continues from the same checkpoint; a trial whose child run is
already complete is not trained again (its final metrics are reported back to Tune).

Where things run: by default a local Ray cluster of all cores (dashboard on 127.0.0.1:8265, URL
printed; Ray's token auth stays on unless ``RAY_AUTH_MODE=disabled``), trials as many at once as fit
(``cpus_per_trial``/``gpus_per_trial`` per trial; a trial's Tune actor reserves no CPU). With
``address`` the sweep joins an existing cluster instead, and first checks that MLflow is a tracking
server and that trial storage and data are visible from every node (:func:`check_cluster`).

Failure policy: a crashing trial is retried by Tune (``max_failures``) from its last checkpoint; a
trial whose loss becomes NaN/inf ends FAILED with the reason in MLflow, and Tune's retries of it end at
once without training (it would fail identically); a trial whose worker group cannot start fails after ``controller_failure_limit``
start timeouts instead of waiting forever; placement groups whose creating Train controller died (the
leak that hangs ASHA sweeps with TorchTrainer trials) are removed by the driver.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import optuna
import ray
import ray.train
import torch.distributed as dist
from ray import tune
from ray.train.torch import TorchTrainer
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search import BasicVariantGenerator, Repeater
from ray.tune.search.optuna import OptunaSearch

from nmtcore import tracking
from nmtcore.config import ConfigError, ExperimentConfig, flatten
from nmtcore.train import Callback, NonFiniteLossError, Trainer, run_experiment
from search_spaces import ARM_KEY, Choice, Grid, IntRange, LogUniform, SearchSpace, SpaceError, Uniform

log = logging.getLogger("nmtcore.sweep")

SEED_KEY = "train.seed"
TRIAL_INDEX_KEY = "__trial_index__"  # set by tune's Repeater on repeated samples
STATE_FILE = "nmtcore_sweep.json"
DEFAULT_EXPERIMENT = "nmtcore-sweeps"
# The Tune trial actor only waits on its TorchTrainer: it reserves no CPU (Tune refuses an empty
# reservation, so a little logical memory instead), and a trial's CPUs all go to its workers: 2 one-CPU
# trials fit on 2 cores, and on two 1-CPU nodes, wherever Ray puts the trial actors.
DRIVER_RESOURCES = {"cpu": 0, "memory": 256 * 1024**2}
# Environment for every Ray process this module starts (local cluster or runtime_env when joining).
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_V2_MIGRATION_WARNINGS": "0",
    "TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S": "0",
    "NMTCORE_NO_PROGRESS": "1",
}


class SweepError(ValueError):
    """A sweep cannot start as configured (space, cluster, storage, tracking); one line says what to change."""


class NonFiniteTrialError(RuntimeError):
    """A trial's loss became NaN/inf; retrying would reproduce it, so the trial stays FAILED."""


# ============================================================================== settings and results
@dataclass(frozen=True)
class SweepSettings:
    """How a sweep runs (not what it varies: that is the :class:`SearchSpace`).

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
        cpus_per_trial / gpus_per_trial: resources of one trial, split evenly over its workers
            (fractional GPUs allowed); torch threads per worker follow the CPUs unless the config
            sets ``train.num_threads``.
        max_failures: Tune retries of a crashed trial, each from its last checkpoint.
        controller_failure_limit: worker-group start timeouts tolerated before a trial fails.
        worker_start_timeout_s: how long one worker-group start may take.
        address: an existing Ray cluster to join (``ray://`` or ``host:port``); ``None`` = start a
            local one (or use the one this process already started).
        resume: continue the sweep ``<storage>/<name>`` instead of starting one.
        dashboard: start the Ray dashboard (local clusters only), on ``dashboard_host``.
        num_cpus: logical CPUs of a local cluster; ``None`` = all cores.
        ray_temp_dir: Ray's session directory for a local cluster (``None`` = Ray's default).
        scratch_dir: trial output directories (node-local is fine); ``None`` = ``<storage>/<name>/trials``
            for a local storage path, else a temporary directory.
        report_dir: where the report is written; ``None`` = ``<storage>/<name>/report``; "" = no report.
        optuna_seed: seed of Optuna's TPE sampler.
        verbose: Tune's console verbosity (0-3).
    """

    name: str
    storage: str
    tracking_uri: str | None = None
    experiment: str = DEFAULT_EXPERIMENT
    seeds: int = 1
    max_concurrent: int = 0
    num_samples: int = 0
    early_stopping: bool | None = None
    grace_period: int = 1
    reduction_factor: int = 2
    workers_per_trial: int = 1
    cpus_per_trial: float = 1.0
    gpus_per_trial: float = 0.0
    max_failures: int = 2
    controller_failure_limit: int = 2
    worker_start_timeout_s: float = 120.0
    address: str | None = None
    resume: bool = False
    dashboard: bool = True
    dashboard_host: str = "127.0.0.1"
    num_cpus: int | None = None
    ray_temp_dir: str | None = None
    scratch_dir: str | None = None
    report_dir: str | None = None
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
            (self.controller_failure_limit >= 0, "controller_failure_limit must be >= 0"),
            (self.grace_period >= 1 and self.reduction_factor >= 2, "ASHA needs grace_period >= 1, reduction_factor >= 2"),
        ]
        for ok, msg in checks:
            if not ok:
                raise SweepError(msg)


def default_storage() -> str:
    """``$NMTCORE_HOME/sweeps`` if set, else ``./runs/sweeps`` (absolute)."""
    home = os.environ.get("NMTCORE_HOME", "").strip()
    return str((Path(home).expanduser() / "sweeps") if home else Path("runs/sweeps").resolve())


def resolve_settings(settings: SweepSettings) -> SweepSettings:
    """Absolute storage/scratch/report paths and a resolved tracking URI."""
    storage = settings.storage if _is_uri(settings.storage) else str(Path(settings.storage).expanduser().resolve())
    exp_dir = _join(storage, settings.name)
    if settings.scratch_dir:
        scratch = str(Path(settings.scratch_dir).expanduser().resolve())
    elif _is_uri(storage):
        scratch = str(Path(tempfile.gettempdir()) / "nmtcore-sweeps" / settings.name)
    else:
        scratch = str(Path(exp_dir) / "trials")
    if settings.report_dir is None:
        report_dir = str(Path(exp_dir) / "report") if not _is_uri(storage) else str(Path(scratch) / "report")
    else:
        report_dir = str(Path(settings.report_dir).expanduser().resolve()) if settings.report_dir else ""
    temp = str(Path(settings.ray_temp_dir).expanduser().resolve()) if settings.ray_temp_dir else None
    return replace(settings, storage=storage, scratch_dir=scratch, report_dir=report_dir, ray_temp_dir=temp,
                   tracking_uri=tracking.resolve_tracking_uri(settings.tracking_uri))


@dataclass
class TrialRecord:
    """One trial as the sweep ended it."""

    trial_id: str
    trial_key: str
    status: str  # Tune's: TERMINATED, ERROR, PENDING, RUNNING, PAUSED
    run_id: str | None
    overrides: dict[str, Any]
    metrics: dict[str, Any]
    node_ids: list[str] = field(default_factory=list)


@dataclass
class SweepResult:
    name: str
    parent_run_id: str
    tracking_uri: str
    experiment_path: str
    interrupted: bool
    trials: list[TrialRecord]
    report_files: list[str]
    dashboard_url: str | None
    wall_s: float


# ============================================================================== pure helpers (tested)
def trial_overrides(space: SearchSpace, sample: Mapping[str, Any], base_seed: int) -> dict[str, Any]:
    """The flat config overrides of one Tune sample: the space's overrides for the sampled point plus
    the trial's seed (a grid dimension, or ``base_seed + __trial_index__`` under Optuna repeats)."""
    point = {k: _plain(sample[k]) for k in space.varied_keys if k in sample}
    overrides = space.overrides(point)
    if SEED_KEY in sample:
        overrides[SEED_KEY] = int(_plain(sample[SEED_KEY]))
    elif TRIAL_INDEX_KEY in sample:
        overrides[SEED_KEY] = base_seed + int(_plain(sample[TRIAL_INDEX_KEY]))
    return overrides


def trial_key(overrides: Mapping[str, Any]) -> str:
    """A short stable id of a trial's overrides (order-insensitive; floats by repr)."""
    text = json.dumps({k: _plain(v) for k, v in overrides.items()}, sort_keys=True, default=repr)
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def config_key(overrides: Mapping[str, Any]) -> str:
    """The trial key without the seed: trials that differ only by seed share it (report groups)."""
    return trial_key({k: v for k, v in overrides.items() if k != SEED_KEY})


def apply_overrides(base: ExperimentConfig, overrides: Mapping[str, Any]) -> ExperimentConfig:
    """``base`` with flat ``overrides`` applied in one step, validated once at the end.

    Unlike :meth:`ExperimentConfig.with_overrides`, a ``model.name`` change keeps every base model
    field the new model's config also has (a study's BERT model on the base config's Transformer
    sizes) and may be combined with the new model's own fields (``model.p_net``) in the same call: a
    BERT model's config is only valid once a trial's BERT is set. Unknown keys still raise."""
    d = base.to_dict()
    model = overrides.get("model.name")
    if model is not None and model != d["model"]["name"]:
        check_registered(model)
        from nmtcore.models import MODEL_REGISTRY

        keep = set(_dataclass_keys(MODEL_REGISTRY[model][0]))
        d["model"] = _nest({k: v for k, v in flatten(d["model"]).items() if k in keep})
    for key, value in overrides.items():
        node = d
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{key}: unknown key ({part} is not a section)")
        node[parts[-1]] = list(value) if isinstance(value, tuple) else value
    return ExperimentConfig.from_dict(d)


def check_registered(model: str) -> None:
    """Raise :class:`SpaceError` naming the registered models if ``model`` is not one of them."""
    from nmtcore.models import MODEL_REGISTRY

    if model not in MODEL_REGISTRY:
        raise SpaceError(f"model {model!r} is not registered (registered: {', '.join(sorted(MODEL_REGISTRY))})")


def trial_config(base: ExperimentConfig, overrides: Mapping[str, Any], output_dir: str | os.PathLike,
                 threads: int = 0) -> ExperimentConfig:
    """The experiment one trial trains: ``base`` + ``overrides``, writing under ``output_dir``;
    ``threads`` sets ``train.num_threads`` unless the base config fixes it."""
    extra: dict[str, Any] = {"output_dir": str(output_dir), "train.save_dir": ""}
    if threads and not base.train.num_threads:
        extra["train.num_threads"] = threads
    return apply_overrides(base, {**overrides, **extra})


def validate_space(space: SearchSpace, base: ExperimentConfig, seeds: int = 1) -> None:
    """Everything that can be checked before Ray starts, each failure one line:

    the model is registered; every example point (all grid values, both ends of every range, every
    arm) builds a valid config; distinct points give distinct configs; the metric is produced
    (``valid_bleu`` needs ``train.valid_bleu``); ``--seeds`` does not fight a varied seed.
    """
    model = space.model or base.model.name
    check_registered(model)
    if seeds > 1 and SEED_KEY in space.config_keys():
        raise SpaceError(f"{space.name}: varies {SEED_KEY}; --seeds would repeat it")
    if space.metric == "valid_bleu" and not base.train.valid_bleu:
        raise SpaceError(f"{space.name}: metric valid_bleu needs train.valid_bleu=true")
    seen: dict[str, dict[str, Any]] = {}
    for point in space.example_points():
        overrides = trial_overrides(space, point, base.train.seed)
        try:
            cfg = apply_overrides(base, overrides)
        except ConfigError as e:
            raise SpaceError(f"{space.name}: {e}") from None
        flat = json.dumps(cfg.flat(), sort_keys=True, default=repr)
        if flat in seen and seen[flat] != point:
            raise SpaceError(f"{space.name}: points {seen[flat]} and {point} give the same config")
        seen[flat] = point


def run_label(point: Mapping[str, Any], seed: int | None = None) -> str:
    """A readable MLflow run name from the sampled point: ``layers=2 hidden=128 seed=1``."""
    parts = [f"{k.rsplit('.', 1)[-1]}={_fmt(_plain(v))}" for k, v in point.items() if k != TRIAL_INDEX_KEY]
    if seed is not None:
        parts.append(f"seed={seed}")
    return " ".join(parts) or "base"


# ============================================================================== Ray: search construction
def param_space(space: SearchSpace, seeds: int, base_seed: int) -> dict[str, Any]:
    """Tune's ``param_space`` for a space (grid dimensions as ``grid_search``, ranges as Tune domains)."""
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
        out[ARM_KEY] = tune.choice(list(space.arms)) if space.sampled else tune.grid_search(list(space.arms))
    if seeds > 1 and not space.sampled:
        out[SEED_KEY] = tune.grid_search([base_seed + i for i in range(seeds)])
    return out


def search_algorithm(space: SearchSpace, settings: SweepSettings, max_concurrent: int = 0) -> Any:
    """Optuna TPE (seeded; wrapped in a ``Repeater`` for seeds) for sampled spaces, else the grid
    enumerator (which must carry the concurrency cap itself: Tune ignores ``max_concurrent_trials``
    for an explicit variant generator)."""
    if not space.sampled:
        return BasicVariantGenerator(max_concurrent=max_concurrent)
    sampler = optuna.samplers.TPESampler(seed=settings.optuna_seed)
    searcher = OptunaSearch(sampler=sampler, metric=space.metric, mode=space.mode)
    return Repeater(searcher, repeat=settings.seeds) if settings.seeds > 1 else searcher


def scheduler(space: SearchSpace, settings: SweepSettings, max_epochs: int) -> Any:
    """ASHA on the space's metric with epochs as time, or FIFO (every trial runs to the end)."""
    early = space.early_stopping if settings.early_stopping is None else settings.early_stopping
    if not early:
        return FIFOScheduler()
    # Rungs at grace·rf^k < max_epochs; a trial reaching max_epochs is left alone (stop_last_trials=False):
    # ASHA would otherwise stop it at its last epoch's report, before it decodes and scores the test set.
    return ASHAScheduler(time_attr="epoch", max_t=max_epochs, grace_period=min(settings.grace_period, max_epochs),
                         reduction_factor=settings.reduction_factor, stop_last_trials=False)


def preview_samples(space: SearchSpace, n: int, seeds: int = 1, base_seed: int = 1,
                    optuna_seed: int = 0) -> list[dict[str, Any]]:
    """The first ``n`` trial configs the sweep's own search algorithm generates (no trial runs): grid
    expansion for grids, Optuna's suggestions for sampled spaces. What a trial receives, for tests and
    dry runs."""
    from ray.tune.search.variant_generator import generate_variants

    pspace = param_space(space, seeds, base_seed)
    if not space.sampled:
        return [cfg for _, cfg in generate_variants(pspace)][:n]  # one pass over the grid (num_samples=1)
    settings = SweepSettings(name="preview", storage=tempfile.gettempdir(), seeds=seeds, optuna_seed=optuna_seed)
    algorithm = search_algorithm(space, settings)
    algorithm.set_search_properties(space.metric, space.mode, pspace)
    return [algorithm.suggest(f"preview_{i:05d}") for i in range(n)]


def num_samples(space: SearchSpace, settings: SweepSettings) -> int:
    if not space.sampled:
        return 1  # one pass over the grid; seeds are a grid dimension
    return (settings.num_samples or space.num_samples) * settings.seeds


# ============================================================================== the trial (Tune actor)
@dataclass(frozen=True)
class _SweepContext:
    """Everything a trial needs, shipped once through the object store (``tune.with_parameters``)."""

    name: str
    space: SearchSpace
    base: dict[str, Any]
    base_seed: int
    tracking_uri: str
    parent_run_id: str
    train_storage: str
    scratch_dir: str
    workers: int
    cpus_per_worker: float
    gpus_per_worker: float
    threads_per_worker: int
    controller_failure_limit: int
    metric: str
    test_split: str
    trial_callbacks: tuple[Any, ...] = ()

    def child_tags(self, overrides: Mapping[str, Any], sample: Mapping[str, Any]) -> dict[str, Any]:
        tags = {tracking.SWEEP_TAG: self.name, "nmtcore.study": self.space.study, "nmtcore.space": self.space.name,
                "nmtcore.model": overrides.get("model.name") or self.base["model"]["name"],
                "nmtcore.varied_keys": ",".join(self.space.varied_keys), "nmtcore.config_key": config_key(overrides),
                "nmtcore.seed": overrides.get(SEED_KEY, self.base_seed)}
        for key in self.space.varied_keys:
            if key in sample:
                tags[f"varied.{key}"] = _plain(sample[key])
        return tags


def _trial_main(config: dict[str, Any], ctx: _SweepContext) -> None:
    """One Tune trial: open (or re-attach) its MLflow child run, then train in a TorchTrainer."""
    overrides = trial_overrides(ctx.space, config, ctx.base_seed)
    key = trial_key(overrides)
    existing = tracking.find_child_run(ctx.parent_run_id, key, ctx.tracking_uri)
    if existing is not None and existing.tags.get(tracking.TRIAL_STATE_TAG) == "complete":
        # Trained and scored by an earlier attempt (e.g. before a driver crash the experiment state
        # did not record): report its results instead of training a duplicate.
        tune.report(_final_metrics_from_run(existing))
        return
    if existing is not None and existing.tags.get(tracking.FAILURE_KIND_TAG) == "nonfinite":
        raise NonFiniteTrialError(existing.tags.get(tracking.FAILURE_REASON_TAG, "non-finite loss"))
    point = {k: config[k] for k in ctx.space.varied_keys if k in config}
    run_id, _ = tracking.open_child_run(ctx.parent_run_id, key, run_label(point, overrides.get(SEED_KEY)),
                                        ctx.child_tags(overrides, config), ctx.tracking_uri)
    trial_id = tune.get_context().get_trial_id()
    tracking.set_run_tags(run_id, {"nmtcore.tune_trial_id": trial_id, tracking.TRIAL_STATE_TAG: "running"},
                          ctx.tracking_uri)
    base = ExperimentConfig.from_dict(ctx.base)
    cfg = trial_config(base, overrides, Path(ctx.scratch_dir) / key, ctx.threads_per_worker)
    resources = {"CPU": ctx.cpus_per_worker}
    if ctx.gpus_per_worker:
        resources["GPU"] = ctx.gpus_per_worker
    trainer = TorchTrainer(
        _train_loop,
        train_loop_config={"cfg": cfg.to_dict(), "run_id": run_id, "tracking_uri": ctx.tracking_uri,
                           "trial_key": key, "trial_id": trial_id, "test_split": ctx.test_split,
                           "threads": ctx.threads_per_worker,
                           "gpus": ctx.gpus_per_worker * ctx.workers, "callbacks": list(ctx.trial_callbacks)},
        scaling_config=ray.train.ScalingConfig(num_workers=ctx.workers, use_gpu=ctx.gpus_per_worker > 0,
                                               resources_per_worker=resources),
        run_config=ray.train.RunConfig(
            # A stable name per trial key: a retried trial resumes this Train run's last checkpoint.
            name=f"{ctx.name}-{key}", storage_path=ctx.train_storage,
            failure_config=ray.train.FailureConfig(max_failures=0,
                                                   controller_failure_limit=ctx.controller_failure_limit),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1),
            callbacks=[TuneReportCallback()]),
    )
    try:
        trainer.fit()
    except Exception as e:
        reason = failure_reason(e)
        with contextlib.suppress(Exception):  # the worker may already have ended it with the exact reason
            tracking.terminate_run(run_id, "FAILED", ctx.tracking_uri, reason=reason,
                                   tags={tracking.TRIAL_STATE_TAG: "failed"})
        if "NonFiniteLossError" in reason:
            raise NonFiniteTrialError(reason) from None
        raise


def _final_metrics_from_run(run: tracking.RunRecord) -> dict[str, Any]:
    metrics = {k: v for k, v in run.metrics.items() if not k.startswith(("update/", "final/", "cost/", "test/"))}
    for key, value in run.metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "test" and parts[2] in ("bleu", "chrf"):
            metrics.setdefault(f"test_{parts[2]}", value)
    metrics["trial_complete"] = 1.0
    metrics["deduplicated"] = 1.0
    return metrics


# ============================================================================== the workers (Ray Train)
class _RayReport(Callback):
    """Reports every epoch's metrics to Ray Train (rank 0 adds the epoch checkpoint), and sums the
    workers' CPU seconds at the end (all ranks take part in the all-reduce)."""

    def __init__(self) -> None:
        self.cpu_s = 0.0
        self.last_epoch: dict[str, float] = {}
        self._cpu0 = time.process_time()

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float],
                     checkpoint: Path | None) -> None:
        report = {k: float(v) for k, v in metrics.items()}
        report["epoch"] = float(epoch)
        self.last_epoch = dict(report)
        if checkpoint is None:
            ray.train.report(report)
            return
        # Hard links (not copies) into a fresh directory Ray uploads and then deletes.
        tmp = Path(tempfile.mkdtemp(prefix="nmtcore-ckpt-"))
        for src in (checkpoint, checkpoint.with_name(checkpoint.name + ".sha256")):
            if src.exists():
                _link_or_copy(src, tmp / src.name)
        ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(str(tmp)),
                         delete_local_checkpoint_after_upload=True)
        shutil.rmtree(tmp, ignore_errors=True)

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.cpu_s = _all_reduce_sum(time.process_time() - self._cpu0)


class _TrialTracking(tracking.TrackingCallback):
    """The child run's record (rank 0): the tracker's config/epoch/test logging plus the trial's node
    ids, cost figures, test references (for the report's paired bootstrap) and the completion mark."""

    def __init__(self, tracker: tracking.Tracker, cfg: ExperimentConfig, reporter: _RayReport,
                 node_ids: list[str], gpus: float, extra_tags: Mapping[str, Any]) -> None:
        super().__init__(tracker, cfg)
        self.reporter, self.node_ids, self.gpus, self.extra_tags = reporter, node_ids, gpus, dict(extra_tags)
        self.t0 = time.perf_counter()

    def on_train_start(self, trainer: Trainer) -> None:
        super().on_train_start(trainer)
        self.tracker.set_tags({**self.extra_tags, "nmtcore.node_ids": ",".join(self.node_ids),
                               "nmtcore.world_size": trainer.world_size})

    def on_train_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        super().on_train_end(trainer, summary)
        wall = time.perf_counter() - self.t0
        cost = {"cost/parameters": summary.get("parameters", 0), "cost/trainable_parameters":
                summary.get("trainable_parameters", 0), "cost/train_tokens_per_s": summary.get("train_tokens_per_s", 0.0),
                "cost/wall_s": wall, "cost/cpu_s": self.reporter.cpu_s, "cost/gpu_s": wall * self.gpus}
        self.tracker.log_metrics(cost, step=int(summary.get("epochs", 0)))
        for name in self.cfg.data.test_splits:
            refs = trainer.data.splits[name].raw_tgt
            self.tracker.log_text("".join(r + "\n" for r in refs), f"references/{name}.{self.cfg.data.tgt_lang}")
        self.tracker.set_tags({tracking.TRIAL_STATE_TAG: "complete"})


def _train_loop(lc: dict[str, Any]) -> None:
    """Ray Train worker: the unchanged nmtcore experiment, reporting through callbacks."""
    cfg = _prepare_resources(ExperimentConfig.from_dict(lc["cfg"]), threads=lc.get("threads"))
    context = ray.train.get_context()
    rank = context.get_world_rank()
    node_ids = _all_gather(ray.get_runtime_context().get_node_id())
    _restore_train_checkpoint(Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints"))
    reporter = _RayReport()
    callbacks: list[Callback] = [reporter]  # Ray first, then MLflow, then the caller's: an epoch is
    tracker: tracking.Tracker | None = None  # checkpointed and logged before user code can fail it
    if rank == 0:
        tracker = tracking.Tracker(lc["tracking_uri"], run_id=lc["run_id"])
        callbacks.append(_TrialTracking(tracker, cfg, reporter, node_ids, lc["gpus"],
                                        {"nmtcore.tune_trial_id": lc["trial_id"]}))
    callbacks += lc.get("callbacks", [])
    # Rank 0's tracker ends the child run: FINISHED, or FAILED with the one-line reason.
    with tracker if tracker is not None else contextlib.nullcontext():
        try:
            summary = run_experiment(cfg, callbacks=callbacks, resume=True)
        except NonFiniteLossError:
            if tracker is not None:
                tracker.set_tags({tracking.FAILURE_KIND_TAG: "nonfinite", tracking.TRIAL_STATE_TAG: "failed"})
            raise
        except Exception:
            # Any other error (out of memory...): the run ends FAILED below; its state must say so too
            # (else a FAILED run stays "running": the driver's clean-up only touches RUNNING runs).
            if tracker is not None:
                with contextlib.suppress(Exception):  # never mask the error that ended the trial
                    tracker.set_tags({tracking.TRIAL_STATE_TAG: "failed"})
            raise
        final = dict(reporter.last_epoch) or _last_epoch_metrics(cfg)
        test = summary["test"].get(lc["test_split"]) or next(iter(summary["test"].values()), {})
        final.update({"epoch": float(summary["epochs"]), "test_bleu": test.get("bleu", float("nan")),
                      "test_chrf": test.get("chrf", float("nan")), "trial_complete": 1.0,
                      "node_ids": ",".join(node_ids)})
        ray.train.report(final)


def _last_epoch_metrics(cfg: ExperimentConfig) -> dict[str, float]:
    """The newest epoch's validation metrics (from the newest checkpoint's history), so the final
    report to Tune still carries the searched metric."""
    from nmtcore.checkpoint import epoch_checkpoints, load_checkpoint

    save_dir = Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints")
    ckpts = epoch_checkpoints(save_dir)
    if not ckpts:
        return {}
    history = load_checkpoint(ckpts[-1])["train_state"]["history"]
    return {k: float(v) for k, v in history[-1].items()} if history else {}


def _restore_train_checkpoint(save_dir: Path) -> None:
    """Put Ray Train's latest checkpoint (a retried trial's, possibly from another node) into the
    trainer's checkpoint directory unless a checkpoint at least as new is already there."""
    from nmtcore.checkpoint import epoch_checkpoints

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return
    with ckpt.as_directory() as d:
        files = sorted(Path(d).glob("epoch*.pt"))
        if not files:
            return
        newest_local = epoch_checkpoints(save_dir)[-1:] if save_dir.exists() else []
        if newest_local and _epoch_of(newest_local[0]) >= _epoch_of(files[-1]):
            return
        save_dir.mkdir(parents=True, exist_ok=True)
        for src in [files[-1], files[-1].with_name(files[-1].name + ".sha256")]:
            if src.exists():
                tmp = save_dir / f".{src.name}.{uuid.uuid4().hex}.tmp"
                shutil.copyfile(src, tmp)
                os.replace(tmp, save_dir / src.name)
        log.info("restored %s from Ray Train checkpoint %s", files[-1].name, ckpt.path)


# ============================================================================== driver side
class _SweepCallback(tune.Callback):
    """Keeps MLflow in step with Tune and keeps the cluster free of leaked worker reservations.

    * a trial stopped by the scheduler (ASHA) leaves its child run RUNNING: end it FINISHED, tagged
      ``stopped_early`` with the epoch it reached;
    * a trial that errored for good: end its child run FAILED with the reason;
    * before each trial starts, after each ends, and every ``pg_check_s``: remove placement groups
      whose creating actor (a Train controller of a stopped trial) is dead — nothing can ever use
      them, and a leaked one makes the next trial's worker group wait forever.
    """

    def __init__(self, ctx: _SweepContext, on_trial_end: Callable[[dict[str, Any]], None] | None = None,
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

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        run = self._child(trial)
        if run is not None and run.status == "RUNNING":
            epoch = (trial.last_result or {}).get("epoch")
            tracking.terminate_run(run.run_id, "FINISHED", self.ctx.tracking_uri,
                                   tags={tracking.TRIAL_STATE_TAG: "stopped_early",
                                         "nmtcore.stopped_at_epoch": epoch if epoch is not None else "",
                                         "nmtcore.tune_status": "TERMINATED"})
        self._ended(trial, "TERMINATED", run)

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any) -> None:
        run = self._child(trial)
        if run is not None:
            reason = "trial failed"
            with contextlib.suppress(Exception):
                err = trial.get_pickled_error()
                reason = failure_reason(err) if err is not None else reason
            tracking.terminate_run(run.run_id, "FAILED", self.ctx.tracking_uri, reason=reason,
                                   tags={tracking.TRIAL_STATE_TAG: "failed", "nmtcore.tune_status": "ERROR"})
            with contextlib.suppress(Exception):
                tracking.set_run_tags(run.run_id, {"nmtcore.tune_status": "ERROR"}, self.ctx.tracking_uri)
        self._ended(trial, "ERROR", run)

    def _ended(self, trial: Any, status: str, run: Any) -> None:
        self._clean()
        if self.on_trial_end_hook is not None:
            self.on_trial_end_hook({"trial_id": trial.trial_id, "status": status, "config": dict(trial.config),
                                    "run_id": getattr(run, "run_id", None), "last_result": dict(trial.last_result or {})})

    def _child(self, trial: Any) -> tracking.RunRecord | None:
        try:
            key = trial_key(trial_overrides(self.ctx.space, trial.config, self.ctx.base_seed))
            return tracking.find_child_run(self.ctx.parent_run_id, key, self.ctx.tracking_uri)
        except Exception as e:  # never let bookkeeping kill the sweep
            log.warning("could not look up the MLflow run of trial %s: %s", trial.trial_id, e)
            return None

    def _clean(self) -> None:
        self._last_pg_check = time.monotonic()
        self.leaked_removed += remove_leaked_placement_groups()


def remove_leaked_placement_groups() -> int:
    """Remove placement groups whose creating actor is dead (and that are not detached); returns how
    many. Such a group is a Train worker group's reservation outliving its controller (a trial
    stopped by ASHA or killed): its resources would otherwise stay reserved until the cluster ends.
    Groups created by a driver (Tune's own trial reservations) have no creating actor and are kept."""
    try:
        from ray.core.generated import gcs_pb2
        from ray.util.placement_group import PlacementGroup, PlacementGroupID, remove_placement_group

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


# ============================================================================== Ray lifecycle
def init_ray(address: str | None = None, num_cpus: int | None = None, dashboard: bool = True,
             dashboard_host: str = "127.0.0.1", temp_dir: str | None = None, log_to_driver: bool = True,
             env: Mapping[str, str] | None = None) -> str | None:
    """Start a local Ray cluster (or join ``address``) unless this process is already connected;
    returns the dashboard URL (``http://127.0.0.1:8265``) or None."""
    env_vars = {**RAY_ENV, **(env or {})}
    for k, v in env_vars.items():
        os.environ.setdefault(k, v)
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"log_to_driver": log_to_driver, "runtime_env": {"env_vars": env_vars},
                                  "configure_logging": True, "logging_level": logging.WARNING}
        if address:
            ctx = ray.init(address=address, **kwargs)
        else:
            ctx = ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=dashboard,
                           dashboard_host=dashboard_host, _temp_dir=temp_dir, **kwargs)
        url = getattr(ctx, "dashboard_url", None)
    else:
        url = None
        with contextlib.suppress(Exception):
            url = ray._private.worker.get_dashboard_url()  # noqa: SLF001
    if url and not url.startswith("http"):
        url = f"http://{url}"
    return url or None


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()


def cluster_nodes() -> list[dict[str, Any]]:
    """Alive nodes: id, address, CPUs, GPUs."""
    return [{"node_id": n["NodeID"], "address": n.get("NodeManagerAddress"), "cpus": n["Resources"].get("CPU", 0),
             "gpus": n["Resources"].get("GPU", 0)} for n in ray.nodes() if n.get("Alive")]


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
    if not _is_uri(settings.storage):
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


# ============================================================================== the sweep
def run_sweep(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings, *,
              trial_callbacks: Sequence[Callback] = (),
              on_trial_end: Callable[[dict[str, Any]], None] | None = None,
              log_to_driver: bool = True) -> SweepResult:
    """Run (or with ``settings.resume`` continue) a sweep and write its report.

    Args:
        space: what to vary; its ``model`` (if any) is set on ``base`` (keeping the base's sizes).
        base: the experiment every trial starts from.
        settings: how to run it (:class:`SweepSettings`).
        trial_callbacks: extra trainer callbacks run inside every trial worker (must pickle).
        on_trial_end: called in this process with a plain dict when a trial ends (status, config,
            run id, last result).
    Raises:
        SweepError / SpaceError / ConfigError: before anything runs, with a one-line message.
    """
    t0 = time.perf_counter()
    settings = resolve_settings(settings)
    exp_dir = _join(settings.storage, settings.name)
    state_path = Path(exp_dir) / STATE_FILE
    state: dict[str, Any] | None = None
    if settings.resume:
        if _is_uri(settings.storage) or not state_path.is_file():
            raise SweepError(f"no sweep {settings.name!r} to resume at {exp_dir} (no {STATE_FILE})")
        state = json.loads(state_path.read_text())
        if state["space"] != space.name:
            raise SweepError(f"sweep {settings.name!r} ran space {state['space']}, not {space.name}")
        base = ExperimentConfig.from_dict(state["base"])  # the sweep continues with the config it started with
        settings = replace(settings, seeds=state["seeds"], tracking_uri=state["tracking_uri"])
        space = space.with_model(state.get("model", space.model))
    else:
        if state_path.exists() or (not _is_uri(settings.storage) and (Path(exp_dir) / "tuner.pkl").exists()):
            raise SweepError(f"sweep {settings.name!r} already exists at {exp_dir}: pass --resume to continue it "
                             "or --name to start another")
    validate_space(space, base, settings.seeds)
    model = space.model or base.model.name

    started_ray = not ray.is_initialized()
    dashboard_url = init_ray(settings.address, settings.num_cpus, settings.dashboard, settings.dashboard_host,
                             settings.ray_temp_dir, log_to_driver,
                             {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(settings.worker_start_timeout_s)})
    try:
        if settings.address:
            check_cluster(settings, base)
        data = _prewarm(base, space)

        tags = {tracking.SWEEP_TAG: settings.name, tracking.ROLE_TAG: "sweep", "nmtcore.study": space.study,
                "nmtcore.space": space.name, "nmtcore.model": model,
                "nmtcore.varied_keys": ",".join(space.varied_keys), "nmtcore.search": _describe_search(space, settings),
                "nmtcore.space_json": json.dumps(space.describe(), default=repr),
                "nmtcore.test_split": base.data.test_splits[0] if base.data.test_splits else "",
                "nmtcore.experiment_path": exp_dir}
        if state is not None:
            parent = tracking.Tracker(settings.tracking_uri, run_id=state["parent_run_id"], tags=tags)
        else:
            parent = tracking.Tracker(settings.tracking_uri, experiment=settings.experiment, run_name=settings.name,
                                      tags=tracking.provenance_tags({**tags, **{f"nmtcore.checksum.{k}": v
                                                                               for k, v in data.items()}}))
            parent.log_config(base)
            parent.log_params({f"sweep.{k}": v for k, v in asdict(settings).items()
                               if k not in ("resume", "verbose") and v is not None})
            parent.log_dict(space.describe(), "search_space.json")
            if not _is_uri(settings.storage):
                Path(exp_dir).mkdir(parents=True, exist_ok=True)
                state_path.write_text(json.dumps({"space": space.name, "model": model, "parent_run_id": parent.run_id,
                                                  "tracking_uri": parent.tracking_uri, "seeds": settings.seeds,
                                                  "base": base.to_dict()}, indent=1))

        workers = settings.workers_per_trial
        ctx = _SweepContext(
            name=settings.name, space=space, base=base.to_dict(), base_seed=base.train.seed,
            tracking_uri=parent.tracking_uri, parent_run_id=parent.run_id,
            train_storage=_join(exp_dir, "train_runs"), scratch_dir=settings.scratch_dir or "",
            workers=workers, cpus_per_worker=settings.cpus_per_trial / workers,
            gpus_per_worker=settings.gpus_per_trial / workers,
            threads_per_worker=max(1, int(settings.cpus_per_trial // workers)),
            controller_failure_limit=settings.controller_failure_limit, metric=space.metric,
            test_split=base.data.test_splits[0] if base.data.test_splits else "", trial_callbacks=tuple(trial_callbacks))
        fits = trials_that_fit(settings)
        if settings.max_concurrent > fits:
            log.warning("--max-concurrent %d > %d trials that fit the cluster: capped", settings.max_concurrent, fits)
        max_concurrent = min(settings.max_concurrent or fits, fits)
        callback = _SweepCallback(ctx, on_trial_end)
        trainable = tune.with_resources(tune.with_parameters(_trial_main, ctx=ctx), DRIVER_RESOURCES)
        pspace = param_space(space, settings.seeds, base.train.seed)

        interrupted = True
        report_files: list[str] = []
        with parent:
            if state is not None and tune.Tuner.can_restore(exp_dir):
                tuner = tune.Tuner.restore(exp_dir, trainable=trainable, param_space=pspace, resume_unfinished=True,
                                           resume_errored=False, restart_errored=False)
            else:
                tuner = tune.Tuner(
                    trainable, param_space=pspace,
                    tune_config=tune.TuneConfig(
                        metric=space.metric, mode=space.mode, search_alg=search_algorithm(space, settings, max_concurrent),
                        scheduler=scheduler(space, settings, base.train.max_epochs), num_samples=num_samples(space, settings),
                        # A trial's own reservation holds no CPU (DRIVER_RESOURCES): without this cap Tune would start
                        # every trial at once and the surplus would wait for worker CPUs until they time out.
                        max_concurrent_trials=max_concurrent if space.sampled else None, reuse_actors=False,
                        trial_name_creator=_trial_name, trial_dirname_creator=_trial_name),
                    run_config=tune.RunConfig(name=settings.name, storage_path=settings.storage,
                                              failure_config=tune.FailureConfig(max_failures=settings.max_failures),
                                              callbacks=[callback], verbose=settings.verbose))
            if state is not None:
                # A restored Tuner keeps the callbacks and limits it was created with (pickled); ours must
                # be live, and the concurrency must fit the cluster the sweep resumes on.
                _replace_callbacks(tuner, callback)
                _set_concurrency(tuner, max_concurrent)
            _print_where(settings, parent, dashboard_url, exp_dir)
            tuner.fit()
            saved = _saved_trials(exp_dir) or callback.trials
            expected = num_samples(space, settings) if space.sampled else (space.grid_size() or 1) * settings.seeds
            # Tune's saved state, not the live trial objects: an interrupted run marks its running trials
            # TERMINATED in memory but saves them as unfinished, to be resumed.
            interrupted = len(saved) < expected or any(t.status not in ("TERMINATED", "ERROR") for t in saved)
            trials = _trial_records(saved, ctx)
            _end_orphans(ctx, interrupted)
            if interrupted:
                parent.set_tags({tracking.FAILURE_REASON_TAG: "sweep interrupted; continue it with --resume"})
            elif settings.report_dir:
                from nmtcore import report

                report_files = [str(p) for p in report.make_report(parent.run_id, parent.tracking_uri,
                                                                   settings.report_dir, log=True)]
            if callback.leaked_removed:
                parent.set_tags({"nmtcore.leaked_placement_groups_removed": callback.leaked_removed})
            if interrupted:
                parent.end("KILLED")
    finally:
        if started_ray:
            shutdown_ray()  # a cluster this call started ends with it; a joined or caller's cluster stays
    return SweepResult(name=settings.name, parent_run_id=parent.run_id, tracking_uri=parent.tracking_uri,
                       experiment_path=exp_dir, interrupted=interrupted, trials=trials, report_files=report_files,
                       dashboard_url=dashboard_url, wall_s=time.perf_counter() - t0)


def trials_that_fit(settings: SweepSettings) -> int:
    """How many trials the connected cluster runs at once: per node, the trials whose CPUs (and GPUs)
    fit on it, summed. Raises :class:`SweepError` if not even one fits."""
    total = 0
    biggest = {"cpus": 0.0, "gpus": 0.0}
    per_node_cpus = settings.cpus_per_trial if settings.workers_per_trial == 1 else \
        settings.cpus_per_trial / settings.workers_per_trial
    for node in cluster_nodes():
        biggest = {"cpus": max(biggest["cpus"], node["cpus"]), "gpus": max(biggest["gpus"], node["gpus"])}
        n = int(node["cpus"] // per_node_cpus + 1e-9) if per_node_cpus else 0
        if settings.gpus_per_trial:
            per_node_gpus = settings.gpus_per_trial / settings.workers_per_trial
            n = min(n, int(node["gpus"] // per_node_gpus + 1e-9))
        total += n
    if settings.workers_per_trial > 1:
        total //= settings.workers_per_trial
    if total < 1:
        raise SweepError(f"a trial needs {settings.cpus_per_trial} CPUs and {settings.gpus_per_trial} GPUs; the "
                         f"largest node has {biggest['cpus']:g} CPUs and {biggest['gpus']:g} GPUs "
                         "(lower --cpus-per-trial / --gpus-per-trial)")
    return total


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


def _replace_callbacks(tuner: tune.Tuner, callback: _SweepCallback) -> None:
    internal = getattr(tuner, "_local_tuner", None)
    run_config = getattr(internal, "_run_config", None) if internal is not None else None
    if run_config is None:  # pragma: no cover - Ray internals moved
        log.warning("could not re-install the sweep callback on the restored Tuner")
        return
    others = [c for c in (run_config.callbacks or []) if not isinstance(c, _SweepCallback)]
    run_config.callbacks = [*others, callback]


def _trial_records(trials: list[Any], ctx: _SweepContext) -> list[TrialRecord]:
    out = []
    for t in trials:
        overrides = trial_overrides(ctx.space, t.config, ctx.base_seed)
        key = trial_key(overrides)
        run = None
        with contextlib.suppress(Exception):
            run = tracking.find_child_run(ctx.parent_run_id, key, ctx.tracking_uri)
        result = dict(t.last_result or {})
        nodes = run.tags.get("nmtcore.node_ids", "").split(",") if run is not None else []
        out.append(TrialRecord(trial_id=t.trial_id, trial_key=key, status=t.status,
                               run_id=run.run_id if run else None, overrides=overrides,
                               metrics={k: v for k, v in result.items() if isinstance(v, (int, float, str))},
                               node_ids=[n for n in nodes if n]))
    return out


def _end_orphans(ctx: _SweepContext, interrupted: bool) -> None:
    """Child runs still RUNNING when the sweep stops: KILLED (re-attached if the sweep is resumed)."""
    reason = "sweep interrupted; resume it with --resume" if interrupted else "its trial never finished"
    for run in tracking.sweep_children(ctx.parent_run_id, ctx.tracking_uri):
        if run.status == "RUNNING":
            tracking.terminate_run(run.run_id, "KILLED", ctx.tracking_uri, reason=reason,
                                   tags={tracking.TRIAL_STATE_TAG: "killed"})


def _prewarm(base: ExperimentConfig, space: SearchSpace) -> dict[str, str]:
    """Prepare in the driver, once, what parallel trials would otherwise each make: the data (fails
    fast on missing data; the vocabulary is cached) and every distinct BERT of the grid (downloaded, or
    pretrained here when the hub is unreachable: :func:`nmtcore.bert.ensure_bert`). Returns the data
    checksums."""
    from nmtcore.data import prepare_data

    checksums = dict(prepare_data(base.data).checksums)
    seen: set[str] = set()
    points: list[Any] = space.example_points() if not space.sampled else [None]
    for point in points:
        overrides = trial_overrides(space, point, base.train.seed) if point is not None else (
            {"model.name": space.model} if space.model else {})
        try:
            cfg = apply_overrides(base, overrides)
        except ConfigError:
            continue  # a sampled space's range ends were checked by validate_space; nothing to prepare
        key = json.dumps({k: v for k, v in cfg.flat().items() if k.startswith("model.bert.")}, sort_keys=True)
        if cfg.model.bert.enabled and key not in seen:
            seen.add(key)
            b = cfg.model.bert
            what = b.name or f"L{b.layers}-H{b.hidden}"
            print(f"preparing BERT {what} (resolved, or pretrained on this machine if nothing answers) ...", flush=True)
            t0 = time.perf_counter()
            _prepare_resources(cfg)
            print(f"  BERT {what} ready in {time.perf_counter() - t0:.0f} s", flush=True)
    return checksums


def _prepare_resources(cfg: ExperimentConfig, threads: int | None = None) -> ExperimentConfig:
    """The config with its external resources ready (a BERT resolved or pretrained), via the BERT
    layer's ``ensure_bert`` when the config names a BERT; idempotent and cheap once done."""
    if not cfg.model.bert.enabled:
        return cfg
    import importlib

    ensure = getattr(importlib.import_module("nmtcore.bert"), "ensure_bert", None)
    return ensure(cfg, threads=threads) if ensure is not None else cfg


def _print_where(settings: SweepSettings, parent: tracking.Tracker, dashboard_url: str | None, exp_dir: str) -> None:
    lines = [f"sweep {settings.name}: MLflow parent run {parent.run_id} in {parent.tracking_uri}",
             f"  MLflow UI:       {tracking.ui_command(parent.tracking_uri)}",
             f"  Ray dashboard:   {dashboard_url or '(not started)'}",
             f"  Tune experiment: {exp_dir}"]
    if settings.report_dir:
        lines.append(f"  report (at end): {settings.report_dir}")
    print("\n".join(lines), flush=True)


def _describe_search(space: SearchSpace, settings: SweepSettings) -> str:
    early = space.early_stopping if settings.early_stopping is None else settings.early_stopping
    algo = f"optuna-tpe(seed={settings.optuna_seed})" if space.sampled else "grid"
    return f"{algo}{' + asha' if early else ''}, seeds={settings.seeds}"


# ============================================================================== small utilities
def failure_reason(e: BaseException) -> str:
    """The innermost cause of a (possibly Ray-wrapped) trial failure, as one line."""
    inner: BaseException = e
    failures = getattr(inner, "worker_failures", None)
    if failures:
        inner = next(iter(failures.values()))
    cause = getattr(inner, "cause", None)  # RayTaskError keeps the user exception here
    if isinstance(cause, BaseException):
        inner = cause
    while inner.__cause__ is not None:
        inner = inner.__cause__
    text = str(inner)
    # A Ray-wrapped error prints the worker's traceback: its last "Name: message" line is the cause.
    for line in reversed(text.splitlines()):
        head = line.split(":", 1)[0].strip()
        if head.endswith(("Error", "Exception")) and " " not in head:
            return tracking.failure_reason(RuntimeError(line.strip())).replace("RuntimeError: ", "", 1)
    return tracking.failure_reason(inner)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def _dataclass_keys(cls: type, prefix: str = "") -> list[str]:
    """Flat dotted field names of a config dataclass (nested dataclasses expanded)."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out: list[str] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _dataclass_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


def _all_gather(value: str) -> list[str]:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return [str(v) for v in out]
    return [value]


def _all_reduce_sum(value: float) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())
    return value


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _epoch_of(path: Path) -> int:
    digits = "".join(c for c in path.stem if c.isdigit())
    return int(digits) if digits else -1


def _trial_name(trial: Any) -> str:
    return f"trial_{trial.trial_id}"


def _is_uri(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts]) if _is_uri(base) else str(Path(base, *parts))


def _plain(v: Any) -> Any:
    """numpy scalars (as Tune samples them) → Python scalars."""
    item = getattr(v, "item", None)
    return item() if callable(item) and not isinstance(v, (list, tuple, dict, str)) else v


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
