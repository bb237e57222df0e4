"""A trial's Ray side: the Tune trial (:func:`_trial_main`: open or re-attach its MLflow child run, then train
here or in Ray Train workers), its resources, and the training loop each worker runs (:func:`_train_loop`: the
unchanged nmtcore experiment, reporting epochs and checkpoints to Ray through a callback)."""

from __future__ import annotations


import contextlib
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

import ray
import ray.train
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback

from nmtcore import tracking
from nmtcore.bert import ensure_bert
from nmtcore.checkpoint import epoch_checkpoints
from nmtcore.engine import (
    Callback,
    NonFiniteLossError,
    PhaseShare,
    RunSummary,
    Trainer,
    run_experiment,
)
from nmtcore.sweep import reuse
from nmtcore.sweep.lifecycle import (
    FAILURE_KIND_TAG,
    TRIAL_STATE_TAG,
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
from nmtcore.sweep.trial import (
    MEMORY_TAG,
    SHARED_KEY,
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

from nmtcore.sweep.ray_backend._private import TrialTrainer, poll_less
from nmtcore.sweep.ray_backend.cluster import (DRIVER_RESOURCES, exit_quietly_on_sigterm, restore_worker_nice,
                                               single_node_idle_cpus)

log = logging.getLogger("nmtcore.sweep")


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


def _trial_main(config: dict[str, Any], ctx: SweepContext) -> None:
    """One Tune trial: open (or re-attach) its MLflow child run, then train, here (``ctx.in_actor``) or in a
    TorchTrainer's workers."""
    poll_less()
    exit_quietly_on_sigterm()
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
    trial_id = tune.get_context().get_trial_id()
    cfg = trial_config(ctx.base, overrides, Path(ctx.scratch_dir) / key, ctx.threads_per_worker)
    tags = ctx.child_tags(overrides, point, control)
    rkey = _reuse_key(cfg, ctx)
    if rkey:
        tags[reuse.REUSE_KEY_TAG] = rkey
    source = reuse.find_trained(rkey, ctx.tracking_uri) if rkey and existing is None and ctx.reuse_trials else None
    if source is not None:  # trained before, by this sweep's rules the same trial: copied, not trained again
        copied = reuse.copy_trial(source, ctx.parent_run_id, key, name, {**tags, schema.TUNE_TRIAL_ID: trial_id},
                                  ctx.child_params(point, control), ctx.tracking_uri)
        tune.report(final_metrics_from_run(tracking.get_run(copied, ctx.tracking_uri)))
        return
    run_id, _ = open_child_run(ctx.parent_run_id, key, name, tags, ctx.tracking_uri,
                               params=ctx.child_params(point, control))
    set_trial_state(run_id, TrialState.RUNNING, ctx.tracking_uri,
                    tags={schema.TUNE_TRIAL_ID: trial_id, **({reuse.REUSE_KEY_TAG: rkey} if rkey else {})})
    memory = ctx.trial_estimate(cfg)
    tracking.set_run_tags(run_id, {MEMORY_TAG: f"{memory.total / GIB:.2f}"}, ctx.tracking_uri)
    launch = TrialLaunch(cfg=cfg, run_id=run_id, tracking_uri=ctx.tracking_uri, trial_key=key, trial_id=trial_id,
                         test_split=ctx.test_split, metric=ctx.metric, threads=ctx.threads_per_worker,
                         borrow_idle_cpus=ctx.borrow_idle_cpus, borrow_check_s=ctx.borrow_check_s,
                         gpus=ctx.gpus_per_worker * ctx.workers, callbacks=tuple(ctx.trial_callbacks),
                         in_actor=ctx.in_actor, phase_share=_phase_share(cfg, ctx, f"{name} (run {run_id})"))
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


def _reuse_key(cfg: Any, ctx: SweepContext) -> str:
    """The trial's reuse key (:func:`nmtcore.sweep.reuse.reuse_key`); "" where it cannot be made (the trial then
    trains, untagged, and no later trial copies it)."""
    try:
        return reuse.reuse_key(cfg, ctx.data_checksums, "cuda" if ctx.gpus_per_worker > 0 else "cpu")
    except Exception as e:  # noqa: BLE001 - a key is an economy: the trial is not at stake
        logging.getLogger("nmtcore.sweep").warning("trial %s: no reuse key: %s: %s", cfg.name, type(e).__name__, e)
        return ""


def _phase_share(cfg: Any, ctx: SweepContext, owner: str) -> PhaseShare | None:
    """Where the trial keeps its phase ends and finds another trial's (:mod:`nmtcore.engine.shared_phases`); None
    where the sweep shares none (``--no-reuse-trials``, a storage that is not a local path) or the context cannot be
    made (the trial then trains every phase itself)."""
    if not ctx.phase_store:
        return None
    try:
        context = reuse.phase_context(cfg, ctx.data_checksums, "cuda" if ctx.gpus_per_worker > 0 else "cpu")
    except Exception as e:  # noqa: BLE001 - sharing is an economy: the trial is not at stake
        log.warning("trial %s: shares no phases: %s: %s", cfg.name, type(e).__name__, e)
        return None
    return PhaseShare(store=Path(ctx.phase_store), context=context, owner=f"{owner} of sweep {ctx.name}",
                      ignore=reuse.NOT_RESULTS)


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

    def __init__(self, metric: str = "", in_actor: bool = False, reported_epoch: int = 0) -> None:
        self.in_actor = in_actor
        self.cpu_s = 0.0
        self.metric = metric
        self.reported_epoch = reported_epoch  # the newest epoch Ray holds a report (and checkpoint) of
        self.last_epoch: dict[str, float] = {}
        self._cpu0 = time.process_time()

    def on_train_start(self, trainer: Trainer) -> None:
        """Report the epochs a resumed run holds that Ray never received: a trial stopped after an epoch's
        checkpoint was written but before its report resumes past that epoch, whose result would otherwise be
        missing from Tune's record (and its schedulers) for good. The newest goes with its checkpoint."""
        missing = [m for m in trainer.state.history if int(m.get("epoch", 0)) > self.reported_epoch]
        newest = epoch_checkpoints(trainer.save_dir)[-1:] if trainer.rank == 0 else []
        shared = trainer.shared_start
        for i, metrics in enumerate(missing):
            epoch = int(metrics["epoch"])
            last = i == len(missing) - 1 and newest and epoch_of(newest[0]) == epoch
            if shared is not None and epoch <= shared.epoch:  # another trial's: the console says so once
                metrics = {**metrics, SHARED_KEY: shared.describe()}
            self.on_epoch_end(trainer, epoch, metrics, newest[0] if last else None)
        self.reported_epoch = max([self.reported_epoch, *(int(m["epoch"]) for m in missing)])

    def on_epoch_end(self, trainer: Trainer, epoch: int, metrics: dict[str, float],
                     checkpoint: Path | None) -> None:
        report = first_keys({k: v if isinstance(v, str) else float(v) for k, v in metrics.items()},
                            epoch=float(epoch), metric=self.metric)
        self.last_epoch = dict(report)
        if checkpoint is None:
            self.report(report)
            return
        # Hard links (not copies) into a fresh directory Ray uploads and then deletes. Removed here too, also when
        # the report is where Tune stops the trial (it raises): a link left behind keeps a rotated-out checkpoint's
        # data on disk.
        tmp = Path(tempfile.mkdtemp(prefix="nmtcore-ckpt-"))
        try:
            for src in (checkpoint, checkpoint.with_name(checkpoint.name + ".sha256")):
                if src.exists():
                    _link_or_copy(src, tmp / src.name)
            self.report(report, tmp)
        finally:
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


STOPPED_REASON = "stopped before it finished (by the sweep: its scheduler, time limit or an interrupt)"

LAUNCH_KEY = "launch"  # Ray Train's train_loop_config is a dict: the typed payload under one key


def _train_loop(loop_config: dict[str, Any]) -> None:
    """A Ray Train worker, or the Tune trial actor itself (``TrialLaunch.in_actor``; Ray refuses ``ray.train``'s
    calls there): the unchanged nmtcore experiment, reporting through callbacks."""
    exit_quietly_on_sigterm()
    restore_worker_nice()
    lc: TrialLaunch = loop_config[LAUNCH_KEY]
    cfg = ensure_bert(lc.cfg, threads=lc.threads)  # made once by the driver; here it only resolves
    in_actor = lc.in_actor
    rank = 0 if in_actor else ray.train.get_context().get_world_rank()
    if in_actor and cfg.train.compile:  # a reused actor: compile afresh, as a new process would (no stale graphs)
        import torch._dynamo

        torch._dynamo.reset()
    node_ids = all_gather(ray.get_runtime_context().get_node_id())
    reported = _restore_train_checkpoint(Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints"),
                                         tune.get_checkpoint() if in_actor else ray.train.get_checkpoint())
    reporter = _RayReport(lc.metric, in_actor, reported_epoch=reported)
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
    # Rank 0's tracker ends the child run: FINISHED, FAILED with the one-line reason, or KILLED (stopped).
    with tracker if tracker is not None else contextlib.nullcontext():
        try:
            summary = run_experiment(cfg, callbacks=callbacks, resume=True, phase_share=lc.phase_share)
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
        except BaseException:
            # Stopped under the trial: Tune stopping it (its report ends the training with sys.exit(0): the
            # scheduler, a time limit, an interrupt) or the worker's SIGTERM. Not a normal end, even with status 0:
            # KILLED, as the driver ends a trial it finds still running (--resume continues it, no estimate counts
            # it done), unless the driver has already ended it (stopped early by the scheduler: it then keeps that).
            if tracker is not None:
                with contextlib.suppress(Exception):
                    end_trial(lc.run_id, TrialState.KILLED, lc.tracking_uri, reason=STOPPED_REASON)
                    tracker.end(tracking.get_run(lc.run_id, lc.tracking_uri).status)  # as it stands, not FINISHED
            raise
        final = dict(reporter.last_epoch) or last_epoch_metrics(cfg)
        test = summary.test.get(lc.test_split) or next(iter(summary.test.values()), None)
        final.update({"test_bleu": test.bleu if test else float("nan"),
                      "test_chrf": test.chrf if test else float("nan"), "trial_complete": 1.0,
                      "node_ids": ",".join(node_ids), "stopped_by": summary.fit.stopped_by,
                      "best_epoch": float(summary.fit.best_epoch)})
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


def _restore_train_checkpoint(save_dir: Path, ckpt: Any) -> int:
    """Put the latest checkpoint Ray holds for the trial (Train's or Tune's: a retried trial's, possibly from
    another node) into the trainer's checkpoint directory unless a checkpoint at least as new is already there.
    Returns the epoch of Ray's checkpoint (0 = none): the newest epoch Ray has a report of."""
    if ckpt is None:
        return 0
    with ckpt.as_directory() as d:
        files = sorted(Path(d).glob("epoch*.pt"), key=epoch_of)
        if not files:
            return 0
        reported = max(epoch_of(files[-1]), 0)
        newest_local = epoch_checkpoints(save_dir)[-1:] if save_dir.exists() else []
        if newest_local and epoch_of(newest_local[0]) >= epoch_of(files[-1]):
            return reported
        save_dir.mkdir(parents=True, exist_ok=True)
        for src in [files[-1], files[-1].with_name(files[-1].name + ".sha256")]:
            if src.exists():
                tmp = save_dir / f".{src.name}.{uuid.uuid4().hex}.tmp"
                shutil.copyfile(src, tmp)
                os.replace(tmp, save_dir / src.name)
        log.info("restored %s from Ray Train checkpoint %s", files[-1].name, ckpt.path)
    return reported


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _named_trainable(sweep: str) -> Callable[[dict[str, Any], SweepContext], None]:
    """:func:`_trial_main` under a name that says which sweep it belongs to: Ray shows every trial's actor
    with this name (the dashboard's Actors page, "Repr"), and its tasks as ``<name>.train``."""
    def trial(config: dict[str, Any], ctx: SweepContext) -> None:
        _trial_main(config, ctx)

    trial.__name__ = trial.__qualname__ = f"trial of {sweep}"
    return trial
