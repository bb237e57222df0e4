"""Running a sweep end to end, in the driver process: check the plan, make what trials share, open the
MLflow parent run, run the trials on the Ray backend, clean up, report.

Identity and de-duplication: a trial is identified by its *trial key*, a hash of its flat overrides (seed
included). Its MLflow child run carries the key as a tag, its Ray Train run is named after it and its
checkpoints live under it, so a retried trial (crash) or a resumed sweep (``--resume``) re-attaches the same
child run and continues from the same checkpoint; a trial whose child run is already complete is not
trained again (its final metrics are reported back to Tune).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from nmtcore import tracking
from nmtcore.config import SPEED_ONLY_KEYS, BertConfig, ConfigError, ExperimentConfig
from nmtcore.engine import Callback
from nmtcore.sweep import cost, pre_sweep, ray_backend, timing
from nmtcore.sweep.dashboard import dashboard_access
from nmtcore.sweep.lifecycle import (
    TrialState,
    end_trial,
    find_child_run,
    note_sweep_report,
    publish_sweep_views,
    sweep_children,
)
from nmtcore.sweep.memory import BertFootprint, trial_memory
from nmtcore.sweep.plan import (
    baseline_config,
    bert_key,
    distinct_berts,
    expected_trials,
    stream_label,
    trial_key,
    trial_overrides,
    validate_space,
)
from nmtcore.sweep.report import make_report
from nmtcore.sweep.results import UNKEYED_START
from nmtcore.sweep.settings import (
    SweepError,
    SweepSettings,
    is_uri,
    join,
    phase_store,
    resolve_settings,
)
from nmtcore.sweep.space import SearchSpace
from nmtcore.sweep.state import STATE_FILE, ResumeState, mark_started, started_space
from nmtcore.sweep.timelimit import TimeLimit, clock_time, parse_duration
from nmtcore.tracking import schema


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
    """What :func:`run_sweep` did: where its record is, whether it finished, its trials and report."""

    name: str
    parent_run_id: str
    tracking_uri: str
    experiment_path: str
    interrupted: bool
    trials: list[TrialRecord]
    report_files: list[str]
    dashboard_url: str | None
    wall_s: float


def run_sweep(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings, *,
              baseline: ExperimentConfig | None = None,
              trial_callbacks: Sequence[Callback] = (),
              on_trial_end: Callable[[dict[str, Any]], None] | None = None,
              log_to_driver: bool = True) -> SweepResult:
    """Run (or with ``settings.resume`` continue) a sweep and write its report.

    With a protocol (:class:`~nmtcore.sweep.space.Protocol`) that warm-starts, the shared baseline is made
    sure of before the trials (trained once, or reused: :func:`~nmtcore.sweep.baseline.ensure_baseline`) and
    every arm and the control start from it; the control arm runs with the arms (the order of the work before
    the trials: :func:`before_trials`).

    Args:
        space: what to vary; its ``model`` (if any) is set on ``base`` (keeping the base's sizes).
        base: the experiment every trial starts from, with the arms' budget.
        settings: how to run it (:class:`~nmtcore.sweep.settings.SweepSettings`).
        baseline: the shared baseline's experiment (default: ``base`` with the protocol's baseline model and
            budget, :func:`~nmtcore.sweep.plan.baseline_config`).
        trial_callbacks: extra trainer callbacks run inside every trial worker (must pickle).
        on_trial_end: called in this process with a plain dict when a trial ends (status, config,
            run id, last result).
    Raises:
        SweepError / SpaceError / ConfigError: before anything runs, with a one-line message.
    """
    t0 = time.perf_counter()
    clock = timing.PhaseClock(t0=t0)
    settings = resolve_settings(settings)
    limit = TimeLimit(time.time() + parse_duration(settings.time_limit)) if settings.time_limit else None
    exp_dir = join(settings.storage, settings.name)
    state, space, base, settings = _resumed(space, base, settings, exp_dir)
    validate_space(space, base, settings.seeds)
    if state is None and not is_uri(settings.storage):
        mark_started(exp_dir, space.name)
    worker_env = settings.worker_env()  # the processes that train: the baseline task and the trials' workers
    if limit is not None:
        print(f"sweep {settings.name}: time limit {settings.time_limit}: it stops by {clock_time(limit.stop_at)} "
              "(as SIGTERM stops it; continue with --resume)", flush=True)
        limit.start()
    started_ray = not ray_backend.ray_is_running()
    with clock.phase("Ray start"):
        dashboard_url = ray_backend.init_ray(
            settings.address, settings.num_cpus, settings.dashboard, settings.dashboard_host, settings.ray_temp_dir,
            log_to_driver, {"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(settings.worker_start_timeout_s)},
            memory_gb=settings.memory_gb, worker_env=worker_env if settings.trial_in_actor else None)
    try:
        if settings.address:
            ray_backend.check_cluster(settings, base)
        print_where(settings, None, dashboard_url, exp_dir)
        data, footprints, estimated, made = before_trials(space, base, settings, baseline, state is None,
                                                          worker_env, t0, clock, _done_before(state, settings))
        if made is not None:
            base = base.with_overrides({"train.init_from": str(made.path)})
        if limit is not None and estimated is not None:  # a new trial's first checkpoint, foreseen
            limit.expected.update(estimated.epochs_s)
        parent = _open_parent(space, base, settings, state, exp_dir, data, made, estimated)
        ctx = _context(space, base, settings, parent, exp_dir, footprints, trial_callbacks, worker_env, data)
        interrupted, trials, report_files = _run_trials(ctx, space, base, settings, parent, exp_dir, state,
                                                       on_trial_end, dashboard_url, clock, limit)
    finally:
        if limit is not None:
            limit.cancel()
        if started_ray:
            ray_backend.shutdown_ray()  # a cluster this call started ends with it; a joined or caller's one stays
    return SweepResult(name=settings.name, parent_run_id=parent.run_id, tracking_uri=parent.tracking_uri,
                       experiment_path=exp_dir, interrupted=interrupted, trials=trials, report_files=report_files,
                       dashboard_url=dashboard_url, wall_s=time.perf_counter() - t0)


def _resumed(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings,
             exp_dir: str) -> tuple[ResumeState | None, SearchSpace, ExperimentConfig, SweepSettings]:
    """A resumed sweep's saved state, with the space, base config and settings it started with (``None`` and
    the arguments for a new sweep); refuses a resume with nothing to resume and a new sweep whose name is taken."""
    state_path = Path(exp_dir) / STATE_FILE
    if settings.resume:
        if is_uri(settings.storage) or not state_path.is_file():
            if not is_uri(settings.storage) and started_space(exp_dir) == space.name:  # stopped before its trials
                print(f"sweep {settings.name}: stopped before its trials began, so there is nothing to resume: "
                      "starting it again (the data, BERTs, feature caches and baseline checkpoints it made are "
                      "reused)", flush=True)
                return None, space, base, replace(settings, resume=False)
            raise SweepError(f"no sweep {settings.name!r} to resume at {exp_dir} (no {STATE_FILE}): a sweep resumes "
                             "where its checkpoints are. Elsewhere (a store filled by `nmtcore import`, say), start "
                             "it under a new --name without --resume: the trials the store holds finished are copied "
                             "by key, not trained again, once the baseline they started from is the same")
        state = ResumeState.read(state_path)
        if state.space != space.name:
            raise SweepError(f"sweep {settings.name!r} ran space {state.space}, not {space.name}")
        settings = replace(settings, seeds=state.seeds, tracking_uri=state.tracking_uri)
        # The sweep continues with the base config it started with, but for settings that change no result, which
        # it takes from this command (a newer default, or a --set: activation checkpointing off, say).
        state = _speed_settings_from(state, base, exp_dir, settings.name)
        return state, space.with_model(state.model or space.model), state.base, settings
    if state_path.exists() or (not is_uri(settings.storage) and (Path(exp_dir) / "tuner.pkl").exists()):
        raise SweepError(f"sweep {settings.name!r} already exists at {exp_dir}: pass --resume to continue it "
                         "or --name to start another")
    return None, space, base, settings


def _speed_settings_from(state: ResumeState, command: ExperimentConfig, exp_dir: str, name: str) -> ResumeState:
    """``state`` with the values of :data:`~nmtcore.config.SPEED_ONLY_KEYS` that this command's base config
    (``command``) sets otherwise, said on the console and written to the state file; unchanged if none."""
    was, now = state.base.flat(), command.flat()
    changed = {k: now[k] for k in SPEED_ONLY_KEYS if k in now and k in was and now[k] != was[k]}
    if not changed:
        return state
    for k, v in changed.items():
        print(f"sweep {name}: resumed with {k}={v} (it started with {was[k]}): speed and memory only, the same "
              "numbers", flush=True)
    state = replace(state, base=state.base.with_overrides(changed))
    if not is_uri(exp_dir):
        state.write(exp_dir)
    return state


def before_trials(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings,
                  baseline: ExperimentConfig | None, new: bool, env: Mapping[str, str], t0: float,
                  clock: timing.PhaseClock | None = None, done: Mapping[str, cost.TrialProgress] | None = None,
                  ) -> tuple[dict[str, str], dict[str, BertFootprint], cost.Estimate | None, Any]:
    """The work before a sweep's trials, as pre-sweep tasks: the data, what the trials share
    (:func:`prepare_shared`), the cost estimate (with ``settings.estimate``: a ``new`` sweep's, or what is left
    of a resumed one, whose trials have ``done`` what :func:`~nmtcore.sweep.cost.sweep_progress` says) and, for a
    protocol that warm-starts, the shared baseline (a ``new`` sweep's: a resumed one has its trials' own
    checkpoints). A baseline still to train trains as soon as the BERTs are made and the estimate is printed:
    it reads no BERT, so the BERTs' quality figures and feature caches wait for it instead of it for them.
    Returns the data checksums, the BERTs' footprints, the estimate and the baseline (None: none). ``clock``
    times each step as a phase of the sweep's time split (:mod:`~nmtcore.sweep.timing`)."""
    phase = (clock or timing.PhaseClock()).phase
    with phase("data"):
        pre_sweep.prepare_data_task(base.data)  # fails fast on missing data; the later steps reuse its checksums
    warm = new and space.protocol is not None and space.protocol.warm_start
    bcfg = (baseline or baseline_config(space, base)) if warm else None
    if bcfg is not None and not pre_sweep.baseline_stored(bcfg, settings.baseline_store):
        with phase("BERTs made"):
            make_berts(base, space)  # one that cannot be made fails here, before hours of baseline
        with phase("cost estimate"):
            estimated = _estimate(space, base, settings, baseline, None) if settings.estimate else None
        with phase("baseline"):
            made = _baseline(bcfg, settings, env)
        with phase("BERTs' quality and features"):
            data, footprints = prepare_shared(base, space)
        return data, footprints, estimated, made
    with phase("BERTs, quality and features"):
        data, footprints = prepare_shared(base, space)
    with phase("cost estimate"):
        estimated = (_estimate(space, base, settings, baseline, t0, done)
                     if settings.estimate and (new or done is not None) else None)
    if bcfg is None:
        return data, footprints, estimated, None
    with phase("baseline"):
        return data, footprints, estimated, _baseline(bcfg, settings, env)


def _baseline(cfg: ExperimentConfig, settings: SweepSettings, env: Mapping[str, str]) -> Any:
    """The shared baseline, trained or reused (:func:`~nmtcore.sweep.pre_sweep.ensure_baseline_task`)."""
    return pre_sweep.ensure_baseline_task(cfg, settings.baseline_store, env=env, tracking_uri=settings.tracking_uri,
                                          used_by=settings.name)


def _estimate(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings,
              baseline: ExperimentConfig | None, t0: float | None,
              done: Mapping[str, cost.TrialProgress] | None = None) -> cost.Estimate | None:
    """What the baseline and the trials will cost here (:func:`nmtcore.sweep.cost.dry_run`), printed; None if it
    could not be measured (an estimate is advice: the sweep goes on). ``t0``: when the sweep started, its shared
    work done since; None: the shared work is still to come (the features' builds are timed and counted).
    ``done``: a resumed sweep's trials so far: the estimate is of what is left."""
    try:
        estimated = cost.dry_run(space, base, settings, baseline=baseline, progress=lambda line: None,
                                 shared_s=None if t0 is None else time.perf_counter() - t0, done=done)
    except Exception as e:  # noqa: BLE001 - the sweep itself is not at stake
        logging.getLogger("nmtcore.sweep").warning("no cost estimate: %s: %s", type(e).__name__, e)
        return None
    lines = estimated.lines()
    if done is not None:
        lines[0] = f"left of this sweep, {lines[0]}"
    print("\n".join(lines), flush=True)
    return estimated


def _done_before(state: ResumeState | None, settings: SweepSettings) -> dict[str, cost.TrialProgress] | None:
    """A resumed sweep's trials so far, for its estimate (None: a new sweep, no estimate asked for, or its store
    cannot say: no estimate then)."""
    if state is None or not settings.estimate:
        return None
    try:
        return cost.sweep_progress(state.parent_run_id, state.tracking_uri)
    except tracking.TrackingError as e:
        logging.getLogger("nmtcore.sweep").warning("no estimate of what is left: %s", e)
        return None


def _open_parent(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings, state: ResumeState | None,
                 exp_dir: str, data: Mapping[str, str], made: Any, estimated: cost.Estimate | None) -> tracking.Tracker:
    """The sweep's MLflow parent run, tagged with what it studies and how: created (with the base config, the
    settings, the space, the estimate, and the state file a resume reads) or, resuming, re-attached."""
    model = space.model or base.model.name
    baseline = {} if made is None else dict(
        baseline_key=made.key, baseline_run_id=made.meta["mlflow_run_id"], baseline_converged=made.converged,
        baseline_valid_losses=tuple(made.meta["valid_losses"]))
    tags = schema.SweepTags(
        name=settings.name, study=space.study, space=space.name, model=model, varied_keys=tuple(space.varied_keys),
        search=describe_search(space, settings), space_json=json.dumps(space.describe(), default=repr),
        test_splits=tuple(base.data.test_splits), experiment_path=exp_dir,
        protocol=describe_protocol(space, made, base), **baseline).to_tags()
    if state is not None:
        tags.pop(schema.PROTOCOL, None)  # a resume has no baseline to name: the first session's line stays
        parent = tracking.Tracker(settings.tracking_uri, run_id=state.parent_run_id, tags=tags)
        if estimated is not None:  # what was left when it resumed (the first estimate.json stays)
            parent.log_dict(estimated.to_dict(), "estimate-left.json")
        return parent
    parent = tracking.Tracker(settings.tracking_uri, experiment=settings.experiment, run_name=settings.name,
                              tags=tracking.provenance_tags({**tags, **{schema.checksum(k): v for k, v in data.items()}}))
    parent.log_config(base)
    parent.log_params({f"sweep.{k}": v for k, v in asdict(settings).items()
                       if k not in ("resume", "verbose") and v is not None})
    parent.log_dict(space.describe(), "search_space.json")
    if estimated is not None:
        parent.log_dict(estimated.to_dict(), "estimate.json")
    if not is_uri(settings.storage):
        ResumeState(space=space.name, model=model, parent_run_id=parent.run_id, tracking_uri=parent.tracking_uri,
                    seeds=settings.seeds, base=base).write(exp_dir)
    return parent


def _context(space: SearchSpace, base: ExperimentConfig, settings: SweepSettings, parent: tracking.Tracker,
             exp_dir: str, footprints: Mapping[str, BertFootprint], trial_callbacks: Sequence[Callback],
             worker_env: Mapping[str, str], data: Mapping[str, str] | None = None) -> ray_backend.SweepContext:
    """What every trial is launched with (:class:`~nmtcore.sweep.ray_backend.SweepContext`)."""
    workers = settings.workers_per_trial
    # A one-worker CPU trial trains in its Tune actor where that actor starts on the trials' allocator (Ray was
    # started here with its preload, or needs none); else in a Train worker, whose start takes the preload.
    one_cpu_worker = workers == 1 and not settings.gpus_per_trial
    in_actor = settings.trial_in_actor and one_cpu_worker
    if in_actor and not ray_backend.workers_have(worker_env):
        logging.getLogger("nmtcore.sweep").info(
            "trials train in Ray Train workers: this Ray connection's workers do not preload %s",
            worker_env.get("LD_PRELOAD"))
        in_actor = False
    return ray_backend.SweepContext(
        name=settings.name, space=space, base=base, base_seed=base.train.seed,
        tracking_uri=parent.tracking_uri, parent_run_id=parent.run_id,
        train_storage=join(exp_dir, "train_runs"), scratch_dir=settings.scratch_dir or "",
        workers=workers, cpus_per_worker=settings.cpus_per_trial / workers,
        gpus_per_worker=settings.gpus_per_trial / workers,
        threads_per_worker=max(1, int(settings.cpus_per_trial // workers)),
        controller_failure_limit=settings.controller_failure_limit, metric=space.metric,
        test_split=base.data.test_splits[0] if base.data.test_splits else "", trial_callbacks=tuple(trial_callbacks),
        bert_footprints=dict(footprints), trial_memory_bytes=trial_memory_bytes(space, base, footprints),
        borrow_idle_cpus=settings.borrow_idle_cpus and one_cpu_worker,
        borrow_check_s=settings.borrow_check_s, worker_env=dict(worker_env),
        in_actor=in_actor, data_checksums=dict(data or {}), reuse_trials=settings.reuse_trials,
        phase_store=phase_store(settings))



def _run_trials(ctx: ray_backend.SweepContext, space: SearchSpace, base: ExperimentConfig, settings: SweepSettings,
                parent: tracking.Tracker, exp_dir: str, state: ResumeState | None,
                on_trial_end: Callable[[dict[str, Any]], None] | None,
                dashboard_url: str | None,
                clock: timing.PhaseClock | None = None,
                limit: TimeLimit | None = None) -> tuple[bool, list[TrialRecord], list[str]]:
    """Every Tune run of the sweep (:func:`phases`), then its bookkeeping: orphaned child runs ended, the
    parent tagged interrupted (KILLED) or the report made, and the session's time split (``clock``) stored on
    the parent beside the earlier sessions' and printed. Returns (interrupted, the trials, the report files)."""
    interrupted = True
    report_files: list[str] = []
    clock = clock or timing.PhaseClock()
    earlier = timing.read(parent.run_id, parent.tracking_uri) if state is not None else []
    with parent:
        saved: list[Any] = []
        leaked = 0
        with clock.phase("trials"):
            for cells, exp in phases(space, exp_dir):
                outcome = ray_backend.run_tune(
                    ctx, settings, exp, base.train.max_epochs, restore=state is not None, cells=cells,
                    on_trial_end=on_trial_end, limit=limit,
                    before_fit=lambda: print_where(settings, parent, dashboard_url, exp, space),
                    record=lambda: _describe(lambda: timing.record(parent, clock, earlier, final=False)))
                saved += outcome.trials
                leaked += outcome.leaked_removed
        interrupted = (len(saved) < expected_trials(space, settings.seeds, settings.num_samples)
                       or any(t.status not in ("TERMINATED", "ERROR") for t in saved))
        trials = trial_records(saved, space, base.train.seed, parent.run_id, parent.tracking_uri)
        end_orphans(parent.run_id, parent.tracking_uri, interrupted)
        _describe(lambda: timing.record(parent, clock, earlier))  # what the report reads
        if not interrupted:
            _describe(lambda: retest_added(parent.run_id, parent.tracking_uri, clock=clock))
        if interrupted:
            parent.set_tags({tracking.FAILURE_REASON_TAG: "sweep interrupted; continue it with --resume"})
        elif settings.report_dir:
            with clock.phase("report"):
                report_files = [str(p) for p in make_report(parent.run_id, parent.tracking_uri,
                                                            settings.report_dir, log=True)]
                _describe(lambda: note_sweep_report(parent.run_id, report_files, parent.tracking_uri))
            _describe(lambda: timing.record(parent, clock, earlier))  # with the report's own time
        print("\n".join([f"sweep {settings.name}: time split (wall clock)"]
                        + [f"  {line}" for line in timing.describe([*earlier, clock.session()])]), flush=True)
        if leaked:
            parent.set_tags({schema.LEAKED_PLACEMENT_GROUPS_REMOVED: leaked})
        if interrupted:
            parent.end("KILLED")
    return interrupted, trials, report_files


def phases(space: SearchSpace, exp_dir: str) -> list[tuple[bool, str]]:
    """The Tune runs of a sweep, in order: ``(cells, experiment dir)``. A grid study is one run of its cells
    (control included); a sampled study with a control runs its control cells first (``<name>-control``),
    then the search."""
    if not space.sampled:
        return [(True, exp_dir)]
    runs = [(True, exp_dir + "-control")] if space.cells() else []
    return runs + [(False, exp_dir)]


def describe_protocol(space: SearchSpace, made: Any, base: ExperimentConfig | None = None) -> str:
    """One line on how the arms were trained and compared: the space's budget keys with the values the arms'
    ``base`` config really has (``--set``/``--arms-set`` may have changed them; without ``base``, the space's)."""
    p = space.protocol
    if p is None:
        return "none: trials compared with the space's reference"
    start = (f"warm-started from baseline {made.key} (stopped by {made.stopped_by}: "
             f"{'converged' if made.converged else 'NOT CONVERGED'})"
             if made is not None else UNKEYED_START if p.warm_start else "from scratch")
    flat = base.flat() if base is not None else {}
    budget = {k: flat.get(k, v) for k, v in space.budget.items()}
    changed = [k for k, v in space.budget.items() if budget[k] != v]
    text = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(budget.items()))
    stage = (("second stage" if p.warm_start else "budget") + ", arms and control alike: "
             + (text or "the base experiment's"))
    if changed:
        stage += f" (the study's {', '.join(f'{k}={space.budget[k]}' for k in sorted(changed))} overridden)"
    def setting(key: str, default: Any = None) -> Any:  # what the arms ran, else what the study's budget says
        return flat.get(key, budget.get(key, default))

    if setting("train.patience"):
        stage += (f"; to convergence: stopped after {setting('train.patience')} epochs without a gain of more than "
                  f"{setting('train.min_delta', 0)} in {setting('train.stop_metric', 'valid_loss')}"
                  f"{' nor a new lowest validation loss' if setting('train.loss_guard') else ''}, "
                  f"capped at {setting('train.max_epochs')} epochs")
    elif "train.max_epochs" in budget:
        stage += " (a fixed number of epochs, not to convergence)"
    if p.warm_start and base is not None:
        stage += (f"; the schedule restarted: update 0, a fresh optimizer, warm-up {base.train.warmup_updates} "
                  f"updates to lr {base.train.lr:g}")
    if space.arm_overrides:
        stage += "; set on every arm but the control (--set): " + ", ".join(
            f"{k}={v}" for k, v in sorted(space.arm_overrides.items()))
    return f"arms {start}; control arm: {'yes' if p.control else 'no'}; {stage}"


def prepare_shared(base: ExperimentConfig, space: SearchSpace) -> tuple[dict[str, str], dict[str, BertFootprint]]:
    """Prepare once, before the trials, what parallel trials would otherwise each make, each as a named Ray
    task on the driver's node (the dashboard lists them; the console shows their progress): the data's checksums
    (prepared by the sweep's first task, "prepare data ..."), every distinct BERT of the grid
    ("prepare BERT ...": downloaded, or made here when the hub is unreachable, :func:`nmtcore.bert.ensure_bert`)
    and, for a frozen BERT, the feature cache its trials read ("prepare BERT features ...").
    Returns the data checksums and each BERT's footprint (by :func:`~nmtcore.sweep.plan.bert_key`)."""
    checksums = pre_sweep.data_checksums(base.data)
    footprints: dict[str, BertFootprint] = {}
    made_bert: dict[str, BertConfig] = {}
    for cfg in distinct_berts(space, base):
        made, footprints[bert_key(cfg)] = pre_sweep.ensure_bert_task(cfg, _bert_name(cfg))
        made_bert[bert_key(cfg)] = made.model.bert
    cached: list[tuple[int, str, ExperimentConfig]] = []  # the frozen BERTs' streams whose features the trials read
    streams = distinct_berts(space, base, streams=True)
    for cfg in streams:
        made = replace(cfg, model=replace(cfg.model, bert=made_bert[bert_key(cfg)]))
        b = made.model.bert
        if b.freeze and b.use_cache and not b.dropout_when_frozen:
            cached.append((footprints[bert_key(cfg)].layers, _bert_name(cfg) + stream_label(cfg, streams), made))
    # Deepest first: its pass also computes the features of its bottom truncations, whose own tasks then hit.
    cached.sort(key=lambda c: -c[0])
    for i, (_, what, made) in enumerate(cached):
        pre_sweep.bert_features_task(made, what, shallower=[c for _, _, c in cached[i + 1:]])
    return checksums, footprints


def make_berts(base: ExperimentConfig, space: SearchSpace) -> None:
    """Make every distinct BERT of the grid ("prepare BERT ..." tasks), without their quality figures or
    feature caches (:func:`prepare_shared` adds those): what the cost estimate's probes need."""
    for cfg in distinct_berts(space, base):
        pre_sweep.ensure_bert_task(cfg, _bert_name(cfg), quality=False)


def _bert_name(cfg: ExperimentConfig) -> str:
    """A BERT as the console names it: its name (a directory's last part), or ``L<layers>-H<hidden>``."""
    b = cfg.model.bert
    return (Path(b.name).name if Path(b.name).is_dir() else b.name) if b.name else f"L{b.layers}-H{b.hidden}"


def trial_memory_bytes(space: SearchSpace, base: ExperimentConfig, footprints: Mapping[str, BertFootprint]) -> int:
    """The largest memory estimate (:func:`~nmtcore.sweep.memory.trial_memory`) over the trials the space
    can produce (every grid point; both ends of every range), which sets how many run at once."""
    points: list[Any] = space.example_points() or [{}]
    biggest = 0
    for point in points:
        try:
            cfg = base.with_overrides(trial_overrides(space, point, base.train.seed))
        except ConfigError:
            continue
        biggest = max(biggest, trial_memory(cfg, footprints.get(bert_key(cfg))).total)
    return biggest


def trial_records(trials: list[Any], space: SearchSpace, base_seed: int, parent_run_id: str,
                  tracking_uri: str) -> list[TrialRecord]:
    """Tune's saved trials joined with their child runs."""
    out = []
    for t in trials:
        overrides = trial_overrides(space, t.config, base_seed)
        key = trial_key(overrides)
        run = None
        with contextlib.suppress(Exception):
            run = find_child_run(parent_run_id, key, tracking_uri)
        result = dict(t.last_result or {})
        nodes = run.tags.get(schema.NODE_IDS, "").split(",") if run is not None else []
        out.append(TrialRecord(trial_id=t.trial_id, trial_key=key, status=t.status,
                               run_id=run.run_id if run else None, overrides=overrides,
                               metrics={k: v for k, v in result.items() if isinstance(v, (int, float, str))},
                               node_ids=[n for n in nodes if n]))
    return out


def end_orphans(parent_run_id: str, tracking_uri: str, interrupted: bool) -> None:
    """Child runs still RUNNING when the sweep stops: KILLED (re-attached if the sweep is resumed)."""
    reason = "sweep interrupted; resume it with --resume" if interrupted else "its trial never finished"
    for run in sweep_children(parent_run_id, tracking_uri):
        if run.status == "RUNNING":
            end_trial(run.run_id, TrialState.KILLED, tracking_uri, reason=reason)


def print_where(settings: SweepSettings, parent: tracking.Tracker | None, dashboard_url: str | None, exp_dir: str,
                space: SearchSpace | None = None) -> None:
    """Tell the user where to watch the sweep. As soon as Ray is up (``parent`` None): the dashboard, where the
    pre-sweep tasks show, and how to sign in to it. As the trials start: the MLflow UI and the page to open,
    this sweep's view of its arms (made here for ``space``: :func:`~nmtcore.sweep.lifecycle.publish_sweep_views`),
    the dashboard again, the Tune experiment and where the report goes."""
    ray_lines = dashboard_access(dashboard_url, local=not settings.address)
    if parent is None:
        head = f"sweep {settings.name}: Ray cluster ready; the work the trials share runs first, as Ray tasks"
        print("\n".join([head, *(f"  {line}" for line in ray_lines)]), flush=True)
        return
    views = _describe(lambda: publish_sweep_views(parent.run_id, space, parent.tracking_uri)) if space else None
    lines = [f"sweep {settings.name}: MLflow parent run {parent.run_id} in {parent.tracking_uri}",
             f"  MLflow UI:       {tracking.ui_command(parent.tracking_uri)}"]
    if views is not None:
        lines += [f"    then open:     {views.url(views.arms)}",
                  ("                   this sweep's arms (varied keys, test BLEU, best first; 'Chart': BLEU "
                   "against the varied keys);"),
                  f"                   the sweep's page: {views.url(views.parent)}"]
    lines += [f"  {ray_lines[0]}", f"  Tune experiment: {exp_dir}"]
    if settings.report_dir:
        lines.append(f"  report (at end): {settings.report_dir} (and on the sweep's page)")
    print("\n".join(lines), flush=True)


def retest_added(parent_run_id: str, tracking_uri: str, decode: Any = None,
                 clock: timing.PhaseClock | None = None) -> dict[str, int]:
    """The test splits ``nmtcore retest`` added to this sweep (:mod:`~nmtcore.sweep.retest`), decoded by the trials
    that completed since (a sweep resumed after the retest): its report then has every arm on them. Returns how
    many trials were decoded per split (``decode``: :func:`~nmtcore.sweep.retest.decode_as_tested` by default);
    timed as the phase ``retest`` of ``clock`` when there is any."""
    from nmtcore.sweep import retest

    added = schema.SweepTags.from_tags(tracking.get_run(parent_run_id, tracking_uri).tags).added_test_splits
    if not added:
        return {}
    with (clock or timing.PhaseClock()).phase("retest"):
        return retest.retest_sweep(parent_run_id, added, tracking_uri, decode=decode or retest.decode_as_tested,
                                   say=lambda line: print(line, flush=True))


def _describe(publish: Callable[[], Any]) -> Any:
    """Run a call that only describes the sweep in MLflow's UI; a failure is a warning, never the sweep's end."""
    try:
        return publish()
    except Exception as e:  # noqa: BLE001 - views are a convenience; the record itself is intact
        logging.getLogger("nmtcore.sweep").warning("could not describe the sweep in MLflow's UI: %s", e)
        return None


def describe_search(space: SearchSpace, settings: SweepSettings) -> str:
    """One line: the search algorithm, early stopping, seeds."""
    early = space.early_stopping if settings.early_stopping is None else settings.early_stopping
    algo = f"optuna-tpe(seed={settings.optuna_seed})" if space.sampled else "grid"
    return f"{algo}{' + asha' if early else ''}, seeds={settings.seeds}"
