"""A sweep trial apart from Ray: what it is shipped (:class:`SweepContext`), how its child run is tagged and
finished (:class:`TrialTracking`), how its final metrics are read back, and how a failure becomes one line.
The Ray side (:mod:`nmtcore.sweep.ray_backend`) calls these."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch.distributed as dist

from nmtcore import tracking
from nmtcore.checkpoint import epoch_checkpoints, load_checkpoint
from nmtcore.config import ExperimentConfig
from nmtcore.engine import PhaseShare, RunSummary, Trainer
from nmtcore.sweep.lifecycle import ARM_PARAM, CONTROL_PARAM, TRIAL_STATE_TAG, TrialState
from nmtcore.sweep.memory import BertFootprint, MemoryEstimate, trial_memory
from nmtcore.sweep.plan import SEED_KEY, TRIAL_INDEX_KEY, bert_key, config_key, fmt, plain
from nmtcore.sweep.space import ARM_KEY, CONTROL, SearchSpace
from nmtcore.tracking import schema
from nmtcore.tracking.callback import TrackingCallback

# Config keys a run name abbreviates, in the papers' notation (BERT-JAM's Table 6: "L4-H256").
SHORT_NAMES = {"model.bert.layers": "L", "model.bert.hidden": "H"}


def arm_name(point: Mapping[str, Any], control: bool) -> str:
    """What a trial's arm is called in run names and Tune's table: ``control``, ``L4-H256`` (BERT layers and
    hidden size, abbreviated), an ablation arm's own name, else ``p_net=0.3 kd_alpha=0.5``."""
    if control:
        return CONTROL
    values = {k: plain(v) for k, v in point.items() if k != TRIAL_INDEX_KEY}
    short = "-".join(f"{SHORT_NAMES[k]}{fmt(v)}" for k, v in values.items() if k in SHORT_NAMES)
    rest = [str(v) if k == ARM_KEY else f"{k.rsplit('.', 1)[-1]}={fmt(v)}"
            for k, v in values.items() if k not in SHORT_NAMES]
    return " ".join(([short] if short else []) + rest) or "base"


def run_name(point: Mapping[str, Any], control: bool, seed: int) -> str:
    """A child run's name: its arm and seed (``L4-H256 seed 2``, ``control seed 1``)."""
    return f"{arm_name(point, control)} seed {seed}"


@dataclass(frozen=True)
class TrialLaunch:
    """What a trial's training process is launched with (a Ray Train worker, or the Tune actor itself): the
    resolved config and where it reports. Built by the trial's driver side, pickled once per worker."""

    cfg: ExperimentConfig
    run_id: str  # the MLflow child run rank 0 logs to (opened by the trial before launch)
    tracking_uri: str
    trial_key: str
    trial_id: str  # Tune's id, tagged on the run so a resume can match them
    test_split: str  # the split whose BLEU the trial reports to Tune
    metric: str  # the sweep's metric: Tune's status table shows it second
    threads: int  # torch threads per worker
    borrow_idle_cpus: bool = False
    borrow_check_s: float = 0.0
    gpus: float = 0.0  # the trial's GPUs, all workers together (a cost figure)
    callbacks: tuple[Any, ...] = ()  # a caller's own trainer callbacks (tests inject faults this way)
    in_actor: bool = False  # train in the Tune actor (one CPU worker) rather than Ray Train's workers
    phase_share: PhaseShare | None = None  # where its phase ends are kept and others' found (None: not shared)

    def __post_init__(self) -> None:
        if not self.run_id or not self.trial_key:
            raise ValueError("a trial is launched with its MLflow run and its key")
        if self.threads < 0 or self.gpus < 0:
            raise ValueError(f"threads and gpus must be >= 0, got {self.threads}, {self.gpus}")


class NonFiniteTrialError(RuntimeError):
    """A trial's loss became NaN/inf; retrying would reproduce it, so the trial stays FAILED."""


class TrialOutOfMemoryError(RuntimeError):
    """A trial ran out of memory; retrying it as it was packed would too, so the trial stays FAILED."""


MEMORY_TAG = schema.MEMORY_ESTIMATE_GIB
_OOM_MARKS = ("OutOfMemoryError", "MemoryError", "out of memory", "running low on memory", "killed due to memory")


def is_out_of_memory(reason: str) -> bool:
    """Whether a failure (its one-line reason) says the trial ran out of memory: a Python
    ``MemoryError``, torch's ``OutOfMemoryError``, or Ray's memory monitor killing the worker."""
    return any(mark.lower() in reason.lower() for mark in _OOM_MARKS)


@dataclass(frozen=True)
class SweepContext:
    """Everything a trial needs, shipped once through the object store (``tune.with_parameters``)."""

    name: str
    space: SearchSpace
    base: ExperimentConfig
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
    borrow_idle_cpus: bool = False  # single-worker CPU trials only (:mod:`nmtcore.sweep.idle_cpus`)
    borrow_check_s: float = 30.0
    bert_footprints: Mapping[str, BertFootprint] = field(default_factory=dict)  # by plan.bert_key
    trial_memory_bytes: int = 0  # the largest trial's estimate (sets how many run at once)
    worker_env: Mapping[str, str] = field(default_factory=dict)  # the training processes' (allocator preload)
    in_actor: bool = False  # a one-worker CPU trial trains in its Tune actor (SweepSettings.trial_in_actor)
    data_checksums: Mapping[str, str] = field(default_factory=dict)  # of the prepared data (a reuse key's part)
    reuse_trials: bool = False  # copy a trial trained before with the same reuse key (nmtcore.sweep.reuse)
    phase_store: str = ""  # where trials keep and find phase ends (nmtcore.engine.shared_phases); "": not shared

    def trial_estimate(self, cfg: ExperimentConfig) -> MemoryEstimate:
        """The memory estimate of the trial that trains ``cfg`` (its BERT's footprint included)."""
        return trial_memory(cfg, self.bert_footprints.get(bert_key(cfg)))

    def child_tags(self, overrides: Mapping[str, Any], point: Mapping[str, Any], control: bool) -> dict[str, Any]:
        """Tags of a trial's child run: the sweep, the study, its arm (:func:`arm_name`: the run name's), the
        varied keys and their values, the seed, where it warm-started from."""
        return schema.TrialTags(
            sweep=self.name, study=self.space.study, space=self.space.name,
            model=overrides.get("model.name") or self.base.model.name, varied_keys=tuple(self.space.varied_keys),
            config_key=config_key(overrides), seed=overrides.get(SEED_KEY, self.base_seed),
            arm=arm_name(point, control), control=control,
            warm_start=self.base.train.init_from or "none (from scratch)",
            varied={key: plain(value) for key, value in point.items()}).to_tags()

    def child_params(self, point: Mapping[str, Any], control: bool) -> dict[str, str]:
        """Params of a trial's child run besides its config (which holds every varied key under its own
        name): the arm and the control flag, so the runs table and the compare view sort and filter by them."""
        return {ARM_PARAM: arm_name(point, control), CONTROL_PARAM: str(control).lower()}


def final_metrics_from_run(run: tracking.RunRecord) -> dict[str, Any]:
    """The last report of a trial that already finished in MLflow, rebuilt from its run (for a retried trial
    that must not train again): its metrics, the test BLEU and chrF under the names a trial reports."""
    metrics = {k: v for k, v in run.metrics.items() if not k.startswith(("update/", "final/", "cost/", "test/"))}
    for key, value in run.metrics.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "test" and parts[2] in ("bleu", "chrf"):
            metrics.setdefault(f"test_{parts[2]}", value)
    metrics["trial_complete"] = 1.0
    metrics["deduplicated"] = 1.0
    if run.tags.get(schema.STOPPED_BY):
        metrics["stopped_by"] = run.tags[schema.STOPPED_BY]
    if run.tags.get(schema.REUSED_FROM):
        metrics["reused_from"] = run.tags[schema.REUSED_FROM]
        metrics["reused_from_sweep"] = run.tags.get(schema.REUSED_FROM_SWEEP, "?")
    return metrics


class TrialTracking(TrackingCallback):
    """The child run's record (rank 0): the tracker's config/epoch/test logging plus the trial's node
    ids, cost figures, test references (for the report's paired bootstrap) and the completion mark."""

    def __init__(self, tracker: tracking.Tracker, cfg: ExperimentConfig, reporter: Any,
                 node_ids: list[str], gpus: float, extra_tags: Mapping[str, Any]) -> None:
        super().__init__(tracker, cfg)
        self.reporter, self.node_ids, self.gpus, self.extra_tags = reporter, node_ids, gpus, dict(extra_tags)
        self.t0 = time.perf_counter()
        self.earlier_s = 0.0  # the epochs earlier attempts of this trial finished (a resumed trial)
        self.shared_s = 0.0  # the epochs of phases it took from another trial, as that trial measured them

    def on_train_start(self, trainer: Trainer) -> None:
        super().on_train_start(trainer)
        # A trial resumed from its checkpoint (a sweep stopped at a session's end, a crash): its restored history holds
        # the epochs earlier attempts trained and validated, which its cost must count too. The epochs of phases
        # another trial trained (a shared start, this attempt's or an earlier one's) are that trial's cost.
        shared = trainer.shared_start.epoch if trainer.shared_start is not None else self.shared_epochs()
        self.shared_s = sum(_wall(h) for h in trainer.state.history if int(h.get("epoch", 0)) <= shared)
        self.earlier_s = sum(_wall(h) for h in trainer.state.history if int(h.get("epoch", 0)) > shared)
        tags = {**self.extra_tags, schema.NODE_IDS: ",".join(self.node_ids), schema.WORLD_SIZE: trainer.world_size}
        if trainer.shared_start is not None:
            tags.update({schema.SHARED_PHASES: trainer.shared_start.describe(),
                         schema.SHARED_PHASES_EPOCHS: trainer.shared_start.epoch})
        self.tracker.set_tags(tags)

    def shared_epochs(self) -> int:
        """The epochs this trial's run took from another's phases at an earlier attempt's start (0: none)."""
        run = tracking.get_run(self.tracker.run_id, self.tracker.tracking_uri)
        return int(run.tags.get(schema.SHARED_PHASES_EPOCHS, 0) or 0)

    def on_train_end(self, trainer: Trainer, summary: RunSummary) -> None:
        super().on_train_end(trainer, summary)
        this = time.perf_counter() - self.t0
        wall = this + self.earlier_s  # earlier attempts: their finished epochs (not their start-up, nor a lost epoch)
        cost = {"cost/parameters": summary.parameters, "cost/trainable_parameters": summary.trainable_parameters,
                "cost/train_tokens_per_s": summary.train_tokens_per_s,
                "cost/wall_s": wall, "cost/cpu_s": self.reporter.cpu_s, "cost/gpu_s": wall * self.gpus,  # CPU: this attempt
                **({"cost/earlier_attempts_s": self.earlier_s} if self.earlier_s else {}),
                **({"cost/shared_phases_s": self.shared_s} if self.shared_s else {})}
        self.tracker.log_metrics(cost, step=summary.epochs)
        for name in self.cfg.data.test_splits:
            refs = trainer.data.splits[name].raw_tgt
            self.tracker.log_text("".join(r + "\n" for r in refs), f"references/{name}.{self.cfg.data.tgt_lang}")
        self.tracker.set_tags({TRIAL_STATE_TAG: TrialState.COMPLETE.value})


# The key of a Tune result that replays an epoch of phases another trial trained (nmtcore.engine.shared_phases); its
# value says which phases and from whom.
SHARED_KEY = "shared_phases"


def _wall(epoch: Mapping[str, float]) -> float:
    """An epoch's training and validation seconds (its history entry)."""
    return float(epoch.get("train_wall_s", 0.0)) + float(epoch.get("valid_wall_s", 0.0))


def last_epoch_metrics(cfg: ExperimentConfig) -> dict[str, float]:
    """The newest epoch's validation metrics (from the newest checkpoint's history), so the final
    report to Tune still carries the searched metric."""
    save_dir = Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints")
    ckpts = epoch_checkpoints(save_dir)
    if not ckpts:
        return {}
    history = load_checkpoint(ckpts[-1])["train_state"]["history"]
    return {k: float(v) for k, v in history[-1].items()} if history else {}


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


def all_gather(value: str) -> list[str]:
    """``value`` from every worker of a distributed trial (just ``[value]`` in a one-worker one)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return [str(v) for v in out]
    return [value]


def all_reduce_sum(value: float) -> float:
    """The sum of ``value`` over the workers of a distributed trial (``value`` in a one-worker one)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        import torch

        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t.item())
    return value


def epoch_of(path: Path) -> int:
    """The epoch number in a checkpoint's file name (``epoch12.pt`` → 12; -1 when it has none)."""
    digits = "".join(c for c in path.stem if c.isdigit())
    return int(digits) if digits else -1
