"""What a trial reports to Ray after a resume: the epochs it trained but never reported (stopped between an
epoch's checkpoint and its report) are reported before training goes on, the newest with its checkpoint."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import ray.train

from nmtcore.sweep.ray_backend import trial as rb_trial


def _epoch_file(d: Path, epoch: int) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"epoch{epoch}.pt"
    path.write_bytes(f"weights of epoch {epoch}".encode())
    path.with_name(path.name + ".sha256").write_text(f"checksum {epoch}\n")
    return path


def _history(epochs: int) -> list[dict[str, float]]:
    return [{"epoch": float(e), "valid_bleu": 30.0 + e, "valid_loss": 5.0 - 0.1 * e} for e in range(1, epochs + 1)]


def test_ray_s_checkpoint_names_the_newest_reported_epoch_by_number_not_by_name(tmp_path: Path) -> None:
    """``epoch10.pt`` is newer than ``epoch9.pt`` (file names sort the other way); a newer local checkpoint is
    kept, and the reported epoch is still Ray's."""
    ray_dir = tmp_path / "ray"
    _epoch_file(ray_dir, 9), _epoch_file(ray_dir, 10)
    save_dir = tmp_path / "save"
    assert rb_trial._restore_train_checkpoint(save_dir, ray.train.Checkpoint.from_directory(str(ray_dir))) == 10
    assert sorted(p.name for p in save_dir.iterdir()) == ["epoch10.pt", "epoch10.pt.sha256"]

    local = tmp_path / "local"
    _epoch_file(local, 12)
    only8 = tmp_path / "ray8"
    _epoch_file(only8, 8)
    assert rb_trial._restore_train_checkpoint(local, ray.train.Checkpoint.from_directory(str(only8))) == 8
    assert sorted(p.name for p in local.glob("epoch*.pt")) == ["epoch12.pt"]
    assert rb_trial._restore_train_checkpoint(local, None) == 0


@pytest.mark.parametrize("reported, expected", [(8, [9]), (7, [8, 9]), (9, []), (0, list(range(1, 10)))])
def test_a_resumed_trial_reports_the_epochs_ray_never_received(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                reported: int, expected: list[int]) -> None:
    calls: list[tuple[dict, dict[str, bytes] | None]] = []

    def tune_report(metrics, checkpoint=None):  # Tune copies the checkpoint's files before report returns
        files = None if checkpoint is None else {p.name: p.read_bytes() for p in Path(checkpoint.path).iterdir()}
        calls.append((metrics, files))

    monkeypatch.setattr(rb_trial.tune, "report", tune_report)
    save_dir = tmp_path / "checkpoints"
    _epoch_file(save_dir, 8), _epoch_file(save_dir, 9)
    trainer = SimpleNamespace(state=SimpleNamespace(history=_history(9)), save_dir=save_dir, rank=0, shared_start=None)
    report = rb_trial._RayReport("valid_bleu", in_actor=True, reported_epoch=reported)
    report.on_train_start(trainer)

    assert [m["epoch"] for m, _ in calls] == expected
    assert all(list(m)[:2] == ["epoch", "valid_bleu"] and m["valid_bleu"] == 30.0 + m["epoch"] for m, _ in calls)
    # only the newest goes with a checkpoint: the one a further resume restores
    assert [c is not None for _, c in calls] == [e == 9 for e in expected]
    if expected:
        assert calls[-1][1] == {"epoch9.pt": b"weights of epoch 9", "epoch9.pt.sha256": b"checksum 9\n"}
    assert report.reported_epoch == max(reported, 9)
    calls.clear()
    report.on_train_start(trainer)  # nothing twice
    assert calls == []


@pytest.mark.parametrize("stop", [SystemExit(0), SystemExit(1), KeyboardInterrupt()],
                         ids=["tune stops it", "sigterm", "ctrl-c"])
def test_a_trial_stopped_under_it_ends_its_run_killed_not_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   stop: BaseException) -> None:
    """Tune stops a trial by ending its training with ``sys.exit(0)`` in the trial's next report. That once ended
    the trial's run FINISHED with its state still "running": the driver's clean-up (RUNNING runs only) missed it,
    and a resumed sweep's estimate counted it done. It is KILLED, as the driver ends a trial it finds running."""
    from nmtcore import tracking
    from nmtcore.sweep.lifecycle import TRIAL_STATE_TAG, TrialState
    from nmtcore.sweep.trial import TrialLaunch
    from nmtcore.testing.sweeps import tiny_base

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    with tracking.Tracker(uri, experiment="stopped") as run:
        run.set_tags({TRIAL_STATE_TAG: TrialState.RUNNING.value})
    tracking.Tracker(uri, run_id=run.run_id)  # open again, as the trial's tracker finds it
    cfg = tiny_base(tmp_path, **{"train.max_epochs": 3})
    reports: list[dict] = []

    def tune_report(metrics, checkpoint=None):  # the trial's first epoch reaches Tune, which then stops it
        reports.append(metrics)
        raise stop

    monkeypatch.setattr(rb_trial.tune, "report", tune_report)
    monkeypatch.setattr(rb_trial.tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(rb_trial, "all_gather", lambda value: [value])
    monkeypatch.setattr(rb_trial.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    monkeypatch.setattr(rb_trial, "poll_less", lambda: None)
    launch = TrialLaunch(cfg=cfg, run_id=run.run_id, tracking_uri=uri, trial_key="k", trial_id="t0",
                         test_split="test", metric="valid_bleu", threads=1, in_actor=True)
    with pytest.raises(type(stop)):
        rb_trial._train_loop({rb_trial.LAUNCH_KEY: launch})
    assert [m["epoch"] for m in reports] == [1.0]
    ended = tracking.get_run(run.run_id, uri)
    assert (ended.status, ended.tags[TRIAL_STATE_TAG]) == ("KILLED", "killed"), (ended.status, ended.tags)
    assert ended.tags[tracking.FAILURE_REASON_TAG] == rb_trial.STOPPED_REASON


def test_a_trial_the_driver_ended_first_keeps_that_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's stop, seen by the driver before the trial's process: the driver has ended the run
    stopped early (FINISHED) by the time the training exits, and the trial leaves it so."""
    from nmtcore import tracking
    from nmtcore.sweep.lifecycle import TRIAL_STATE_TAG, TrialState, end_trial
    from nmtcore.sweep.trial import TrialLaunch
    from nmtcore.testing.sweeps import tiny_base

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    with tracking.Tracker(uri, experiment="stopped") as run:
        run.set_tags({TRIAL_STATE_TAG: TrialState.RUNNING.value})
    tracking.Tracker(uri, run_id=run.run_id)

    def tune_report(metrics, checkpoint=None):
        end_trial(run.run_id, TrialState.STOPPED_EARLY, uri, reason="stopped early by the scheduler at epoch 1")
        raise SystemExit(0)

    monkeypatch.setattr(rb_trial.tune, "report", tune_report)
    monkeypatch.setattr(rb_trial.tune, "get_checkpoint", lambda: None)
    monkeypatch.setattr(rb_trial, "all_gather", lambda value: [value])
    monkeypatch.setattr(rb_trial.ray, "get_runtime_context", lambda: SimpleNamespace(get_node_id=lambda: "node"))
    launch = TrialLaunch(cfg=tiny_base(tmp_path, **{"train.max_epochs": 3}), run_id=run.run_id, tracking_uri=uri,
                         trial_key="k", trial_id="t0", test_split="test", metric="valid_bleu", threads=1,
                         in_actor=True)
    with pytest.raises(SystemExit):
        rb_trial._train_loop({rb_trial.LAUNCH_KEY: launch})
    ended = tracking.get_run(run.run_id, uri)
    assert (ended.status, ended.tags[TRIAL_STATE_TAG]) == ("FINISHED", "stopped_early"), (ended.status, ended.tags)


@pytest.mark.parametrize("left_by_process", ["RUNNING", "KILLED"])
def test_the_driver_ends_a_trial_the_scheduler_stopped_as_stopped_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       left_by_process: str) -> None:
    """Tune completes a trial the scheduler (ASHA) stopped: its run, still RUNNING or already KILLED by the trial's
    own process, ends FINISHED and ``stopped_early`` at the epoch it reached. A trial that completed keeps its end."""
    from nmtcore import tracking
    from nmtcore.sweep import lifecycle
    from nmtcore.sweep.plan import trial_key, trial_overrides
    from nmtcore.sweep.ray_backend import callbacks as rb_callbacks
    from nmtcore.sweep.space import SearchSpace, grid
    from nmtcore.sweep.trial import SweepContext
    from nmtcore.testing.sweeps import tiny_base
    from nmtcore.tracking import schema

    uri = f"sqlite:///{tmp_path}/m.db"
    space = SearchSpace("asha", "t", "transformer", params={"train.lr": grid((1e-3, 2e-3))})
    with tracking.Tracker(uri, experiment="asha", run_name="sweep") as parent:
        pass
    ctx = SweepContext(name="asha", space=space, base=tiny_base(tmp_path), base_seed=1, tracking_uri=uri,
                       parent_run_id=parent.run_id, train_storage=str(tmp_path), scratch_dir=str(tmp_path),
                       workers=1, cpus_per_worker=1.0, gpus_per_worker=0.0, threads_per_worker=1,
                       controller_failure_limit=1, metric="valid_loss", test_split="test", in_actor=True)
    monkeypatch.setattr(rb_callbacks, "remove_leaked_placement_groups", lambda: 0)  # no cluster here
    runs = {}
    for lr, state in ((1e-3, left_by_process), (2e-3, "complete")):
        config = {"train.lr": lr}
        run_id, _ = lifecycle.open_child_run(parent.run_id, trial_key(trial_overrides(space, config, 1)),
                                             f"lr={lr} seed 1", {}, uri)
        lifecycle.set_trial_state(run_id, lifecycle.TrialState.RUNNING, uri)
        if state == "KILLED":
            lifecycle.end_trial(run_id, lifecycle.TrialState.KILLED, uri, reason=rb_trial.STOPPED_REASON)
        elif state == "complete":
            lifecycle.end_trial(run_id, lifecycle.TrialState.COMPLETE, uri)
        runs[lr] = run_id
        trial = SimpleNamespace(trial_id=f"t{lr}", config=config, last_result={"epoch": 2.0})
        rb_callbacks._SweepCallback(ctx).on_trial_complete(3, [], trial)
    stopped, complete = (tracking.get_run(runs[lr], uri) for lr in (1e-3, 2e-3))
    assert (stopped.status, stopped.tags[lifecycle.TRIAL_STATE_TAG]) == ("FINISHED", "stopped_early")
    assert stopped.tags[schema.STOPPED_AT_EPOCH] == "2.0"
    assert stopped.tags[tracking.FAILURE_REASON_TAG] == "stopped early by the scheduler at epoch 2"
    assert (complete.status, complete.tags[lifecycle.TRIAL_STATE_TAG]) == ("FINISHED", "complete")


def test_the_checkpoint_links_are_removed_when_the_report_stops_the_trial(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Tune stops a trial inside its report (``sys.exit``): the directory of hard links the report handed over was
    left in the temp folder each time, and each kept a checkpoint's data alive after the trial had rotated it out,
    until the disk filled."""
    handed: list[Path] = []

    def tune_report(metrics, checkpoint=None):
        handed.append(Path(checkpoint.path))
        raise SystemExit(0)

    monkeypatch.setattr(rb_trial.tune, "report", tune_report)
    monkeypatch.setattr(rb_trial.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    checkpoint = _epoch_file(tmp_path / "checkpoints", 3)
    report = rb_trial._RayReport("valid_bleu", in_actor=True, reported_epoch=2)
    with pytest.raises(SystemExit):
        report.on_epoch_end(SimpleNamespace(), 3, _history(3)[-1], checkpoint)
    assert len(handed) == 1 and not handed[0].exists()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert checkpoint.exists()  # the trial's own checkpoint stays
