"""Sweeps that meet trouble (slow: minutes): ASHA stopping TorchTrainer trials must not hang the sweep,
an interrupted sweep resumes without lost or duplicated trials or runs, a crashed trial resumes from its
last checkpoint, and a leaked worker reservation is removed. One local Ray cluster (2 CPUs) per module."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.allocator import find_library
from nmtcore.engine import Callback
from nmtcore.sweep import driver, lifecycle, ray_backend, timing
from nmtcore.sweep import settings as sweep_settings
from nmtcore.testing.sweeps import tiny_base, tiny_settings
from search_spaces import SearchSpace, grid

pytestmark = pytest.mark.slow


def children_of(name: str, uri: str):
    return [r for r in tracking.load_runs(name, uri) if r.parent_run_id is not None]


def test_asha_stops_torchtrainer_trials_early_and_the_sweep_finishes(ray_cluster, store, tmp_path, deadline):
    """4 TorchTrainer trials, 2 at a time; the two with a hopeless learning rate are stopped by ASHA at
    their first rung. The measured failure this guards: a stopped trial's worker reservation leaked and
    the next trial waited for it forever."""
    space = SearchSpace("asha", "t", "transformer", params={"train.lr": grid((5e-3, 4e-3, 1e-6, 2e-6))},
                        metric="valid_loss", mode="min", early_stopping=True)
    t0 = time.perf_counter()
    result = driver.run_sweep(space, tiny_base(tmp_path, **{"train.max_epochs": 4, "train.warmup_updates": 10}),
                             tiny_settings(tmp_path, "asha", store, max_concurrent=2, grace_period=1),
                             log_to_driver=False)
    wall = time.perf_counter() - t0
    assert not result.interrupted and [t.status for t in result.trials] == ["TERMINATED"] * 4
    children = children_of("asha", store)
    assert len(children) == 4 and all(c.status == "FINISHED" for c in children)
    states = {float(c.params["train.lr"]): c.tags[lifecycle.TRIAL_STATE_TAG] for c in children}
    # ASHA keeps the top 1/2 at each rung: the hopeless ones stop at epoch 1; of the two good ones
    # running side by side, the worse may stop at a rung too.
    assert states[1e-6] == states[2e-6] == "stopped_early", states
    assert "complete" in (states[5e-3], states[4e-3]), states
    stopped = [lr for lr, s in states.items() if s == "stopped_early"]
    for c in children:
        if c.tags[lifecycle.TRIAL_STATE_TAG] == "stopped_early":
            assert int(float(c.tags["nmtcore.stopped_at_epoch"])) < 4
    print(f"ASHA sweep: {wall:.0f} s, stopped early: {stopped}, leaked groups removed: "
          f"{tracking.get_run(result.parent_run_id, store).tags.get('nmtcore.leaked_placement_groups_removed', 0)}")


def test_resume_after_interrupt_loses_and_duplicates_nothing(ray_cluster, store, tmp_path, deadline):
    """Interrupt (as Ctrl-C does) after the first of 3 trials ends, then --resume: 3 trials, 3 child runs,
    the finished trial is not trained again and the interrupted one continues its own run."""
    space = SearchSpace("resume", "t", "transformer", params={"model.d_model": grid((32, 48, 64))})
    base = tiny_base(tmp_path)

    def interrupt(info):
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful interrupt, like Ctrl-C

    first = driver.run_sweep(space, base, tiny_settings(tmp_path, "resume", store, max_concurrent=1),
                            on_trial_end=interrupt, log_to_driver=False)
    assert first.interrupted
    parent = tracking.get_run(first.parent_run_id, store)
    assert parent.status == "KILLED" and "--resume" in parent.tags[tracking.FAILURE_REASON_TAG]
    before = {c.tags[lifecycle.TRIAL_KEY_TAG]: c for c in children_of("resume", store)}
    done = [c for c in before.values() if c.tags[lifecycle.TRIAL_STATE_TAG] == "complete"]
    assert len(done) == 1

    second = driver.run_sweep(space, base, tiny_settings(tmp_path, "resume", store, max_concurrent=1, resume=True),
                             log_to_driver=False)
    assert not second.interrupted and second.parent_run_id == first.parent_run_id
    assert sorted(t.status for t in second.trials) == ["TERMINATED"] * 3
    after = children_of("resume", store)
    assert len(after) == 3 and len({c.tags[lifecycle.TRIAL_KEY_TAG] for c in after}) == 3
    assert all(c.status == "FINISHED" and c.tags[lifecycle.TRIAL_STATE_TAG] == "complete" for c in after)
    by_key = {c.tags[lifecycle.TRIAL_KEY_TAG]: c for c in after}
    for key, run in before.items():  # every run of the first attempt was re-attached, none replaced
        assert by_key[key].run_id == run.run_id
    untouched = by_key[done[0].tags[lifecycle.TRIAL_KEY_TAG]]
    assert untouched.end_time == done[0].end_time  # the finished trial did not train again
    for c in after:
        steps = [s for s, _ in tracking.get_run_metrics(c.run_id, store)["valid_loss"]]
        assert steps[-1] == 2 and len(steps) <= 3, steps  # at most the interrupted epoch logged twice
    assert tracking.get_run(first.parent_run_id, store).status == "FINISHED"


def test_crashed_trial_resumes_from_its_last_checkpoint(ray_cluster, store, tmp_path, deadline):
    marker = tmp_path / "crashed-once"

    class CrashAfterEpoch2(Callback):
        """Kills the worker process once, right after epoch 2 was checkpointed and logged."""

        def __init__(self, marker: str) -> None:
            self.marker = marker

        def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
            if epoch == 2 and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os._exit(1)

    space = SearchSpace("crash", "t", "transformer", params={"model.d_model": grid((32,))})
    result = driver.run_sweep(space, tiny_base(tmp_path, **{"train.max_epochs": 3}),
                             tiny_settings(tmp_path, "crash", store, max_failures=2),
                             trial_callbacks=[CrashAfterEpoch2(str(marker))], log_to_driver=False)
    assert marker.exists() and [t.status for t in result.trials] == ["TERMINATED"]
    (child,) = children_of("crash", store)
    assert child.status == "FINISHED" and child.tags[lifecycle.TRIAL_STATE_TAG] == "complete"
    assert child.tags["nmtcore.attach_count"] == "2"  # the retry re-attached the same run
    steps = [s for s, _ in tracking.get_run_metrics(child.run_id, store)["valid_loss"]]
    assert steps == [1, 2, 3]  # epochs 1-2 not retrained: the retry started from the epoch-2 checkpoint
    # Its cost counts the epochs the crashed attempt trained and validated, beside the retry's own time.
    history = tracking.get_run_metrics(child.run_id, store)
    earlier = sum(v for s, v in history["train_wall_s"] + history["valid_wall_s"] if s <= 2)
    assert child.metrics["cost/earlier_attempts_s"] == pytest.approx(earlier, rel=1e-6)
    assert child.metrics["cost/wall_s"] > earlier


def test_leaked_worker_reservation_is_removed(ray_cluster):
    """A placement group whose creating actor died (a stopped trial's Train controller) is removed;
    Tune's own reservations (created by the driver) are kept."""
    import ray
    from ray.util.placement_group import placement_group

    @ray.remote(num_cpus=0)
    class Controller:
        def reserve(self):
            pg = placement_group([{"CPU": 1}], strategy="PACK")
            ray.get(pg.ready())
            return pg.id.hex()

    mine = placement_group([{"CPU": 0.5}])
    ray.get(mine.ready())
    owner = Controller.remote()
    leaked = ray.get(owner.reserve.remote())
    ray.kill(owner)
    time.sleep(1.0)
    assert ray_backend.remove_leaked_placement_groups() == 1
    time.sleep(0.5)
    table = ray.util.placement_group_table()
    assert table[leaked]["state"] == "REMOVED" and table[mine.id.hex()]["state"] == "CREATED"
    ray.util.remove_placement_group(mine)


DRIVER = """
import os, sys
sys.path.insert(0, {repo!r})
from pathlib import Path
from nmtcore.sweep import driver, lifecycle, ray_backend, settings as sweep_settings
from search_spaces import SearchSpace, grid
from nmtcore.testing.synthetic import tiny_experiment
space = SearchSpace("kill", "t", "transformer", params={{"model.d_model": grid((32, 48, 64))}})
base = tiny_experiment(Path({tmp!r}), **{{"train.max_epochs": 3, "train.valid_bleu": True, "train.num_threads": 1}})
settings = sweep_settings.SweepSettings(name="kill", storage={storage!r}, tracking_uri={uri!r}, experiment="kill",
                               max_concurrent=1, num_cpus=2, dashboard=False, ray_temp_dir={temp!r}, verbose=0)
driver.run_sweep(space, base, settings, log_to_driver=False)
"""


def test_resume_after_kill_9_of_the_driver(ray_cluster, store, tmp_path, deadline):
    """``kill -9`` of a sweep's driver (and its local Ray) mid-sweep, then --resume: Tune's last snapshot
    may be older than what happened, so a finished trial can look unfinished; MLflow's record decides:
    no finished trial trains again and no trial gets a second child run."""
    import subprocess
    import sys

    temp = tempfile.mkdtemp(prefix="rk-", dir="/tmp")
    storage = str(tmp_path / "ray_results")
    script = DRIVER.format(repo=str(Path(__file__).resolve().parents[1]), tmp=str(tmp_path), storage=storage,
                           uri=store, temp=temp)
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True,
                            stdout=open(tmp_path / "driver.log", "w"), stderr=subprocess.STDOUT)
    try:
        def progress():
            runs = children_of("kill", store)
            done = [r for r in runs if r.tags.get(lifecycle.TRIAL_STATE_TAG) == "complete"]
            started = [r for r in runs if r.tags.get(lifecycle.TRIAL_STATE_TAG) != "complete" and "valid_loss" in r.metrics]
            return len(done) >= 1 and len(started) >= 1

        t0 = time.time()
        while not progress():
            assert proc.poll() is None, (tmp_path / "driver.log").read_text()[-3000:]
            assert time.time() - t0 < 600, "the first trial did not finish in 10 minutes"
            time.sleep(1.0)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started: no goodbyes
        proc.wait()
        _kill_session_processes(temp)
    before = {c.tags[lifecycle.TRIAL_KEY_TAG]: c for c in children_of("kill", store)}
    done = {k for k, c in before.items() if c.tags[lifecycle.TRIAL_STATE_TAG] == "complete"}

    result = driver.run_sweep(SearchSpace("kill", "t", "transformer", params={"model.d_model": grid((32, 48, 64))}),
                             tiny_base(tmp_path, **{"train.max_epochs": 3}),
                             sweep_settings.SweepSettings(name="kill", storage=storage, tracking_uri=store, experiment="kill",
                                                 max_concurrent=1, resume=True, verbose=0,
                                                 report_dir=str(tmp_path / "report")), log_to_driver=False)
    assert not result.interrupted
    # the killed session's time, to its last record (the first trial's end at the latest), before the resume's
    split = timing.read(result.parent_run_id, store)
    assert len(split) == 2 and "recorded" in split[0] and "recorded" not in split[1], split
    assert split[0]["phases"]["trials"] > 0 and split[0]["wall_s"] > split[0]["phases"]["trials"]
    after = children_of("kill", store)
    assert len(after) == 3 and len({c.tags[lifecycle.TRIAL_KEY_TAG] for c in after}) == 3
    assert all(c.status == "FINISHED" and c.tags[lifecycle.TRIAL_STATE_TAG] == "complete" for c in after)
    for c in after:
        if c.tags[lifecycle.TRIAL_KEY_TAG] in before:
            assert c.run_id == before[c.tags[lifecycle.TRIAL_KEY_TAG]].run_id
        if c.tags[lifecycle.TRIAL_KEY_TAG] in done:
            assert c.end_time == before[c.tags[lifecycle.TRIAL_KEY_TAG]].end_time  # not trained again
        steps = [s for s, _ in tracking.get_run_metrics(c.run_id, store)["valid_loss"]]
        assert steps[-1] == 3 and sorted(set(steps)) == [1, 2, 3], steps


def _kill_session_processes(temp_dir: str) -> None:
    """SIGKILL processes of the Ray session under ``temp_dir`` that outlived their driver (by pid)."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    for line in out.splitlines()[1:]:
        pid, _, args = line.strip().partition(" ")
        if temp_dir in args and int(pid) != os.getpid():
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    shutil.rmtree(temp_dir, ignore_errors=True)


def test_protocol_baseline_is_trained_once_for_two_sweeps_and_a_resume(ray_cluster, store, tmp_path, deadline):
    """A warm-starting study: the first sweep trains the shared baseline (one tracked run), a second sweep of
    the same study reuses it, an interrupted third one resumes without touching it; every sweep has its
    control arm, warm-started like the arms, first in its report."""
    from nmtcore.sweep import baseline as baseline_store
    from nmtcore.tracking import schema
    from nmtcore.sweep.space import Protocol

    # Both arms differ from the control (the base has dropout 0.0: an arm equal to the control is refused).
    space = SearchSpace("protocol", "t", "transformer", params={"model.dropout": grid((0.1, 0.2))},
                        protocol=Protocol())
    base = tiny_base(tmp_path)
    root = tmp_path / "baselines"
    first = driver.run_sweep(space, base, tiny_settings(tmp_path, "proto-a", store, baseline_store=str(root)),
                             log_to_driver=False)
    second = driver.run_sweep(space, base, tiny_settings(tmp_path, "proto-b", store, baseline_store=str(root)),
                              log_to_driver=False)

    def interrupt(info):
        os.kill(os.getpid(), signal.SIGUSR1)

    third = driver.run_sweep(space, base, tiny_settings(tmp_path, "proto-c", store, baseline_store=str(root),
                                                        max_concurrent=1), on_trial_end=interrupt, log_to_driver=False)
    assert third.interrupted
    protocol = tracking.get_run(third.parent_run_id, store).tags[schema.PROTOCOL]
    resumed = driver.run_sweep(space, base, tiny_settings(tmp_path, "proto-c", store, baseline_store=str(root),
                                                          max_concurrent=1, resume=True), log_to_driver=False)
    # the resume has no baseline to name: the first session's protocol line, which names it, stays
    assert tracking.get_run(resumed.parent_run_id, store).tags[schema.PROTOCOL] == protocol
    assert not first.interrupted and not second.interrupted and not resumed.interrupted
    keys = {tracking.get_run(r.parent_run_id, store).tags[baseline_store.KEY_TAG]
            for r in (first, second, third)}
    assert len(keys) == 1
    key = keys.pop()
    assert f"warm-started from baseline {key} " in protocol
    trained = tracking.search_runs(f"tags.`{baseline_store.KEY_TAG}` = '{key}' and "
                                   "tags.`nmtcore.role` = 'baseline'", store)
    assert len(trained) == 1  # trained once
    # by a pre-sweep task started on the allocator the trials get (tcmalloc where installed)
    assert trained[0].tags["nmtcore.allocator"] == ("tcmalloc" if find_library("tcmalloc") else "system")
    uses = baseline_store.uses(root, key)
    assert [u["trained_now"] for u in uses] == [True, False, False]  # the resume never asked for it again
    for result in (first, second, resumed):
        children = [r for r in tracking.load_runs(result.name, store) if r.parent_run_id == result.parent_run_id]
        control = [c for c in children if c.tags[lifecycle.CONTROL_TAG] == "true"]
        assert len(children) == 3 and len(control) == 1
        assert all(c.tags["nmtcore.warm_start"] == str(root / key / "baseline.pt") for c in children)
        if result is not resumed:  # a trial resumed from its own checkpoint does not warm-start again
            assert all(int(c.tags["nmtcore.warm_start_loaded"]) > 0 for c in children)
        table = Path(next(f for f in result.report_files if f.endswith("table.json"))).read_text()
        import json

        rows = json.loads(table)
        assert rows[0]["arm"] == "control" and rows[0]["delta"] == 0.0 and len(rows) == 3
