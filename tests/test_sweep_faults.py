"""Faults from outside a trial's own code (slow: minutes each), on one local Ray cluster (2 CPUs) per module:

* the process that trains (a one-worker trial's Tune actor, or its Ray Train worker with
  ``trial_in_actor=False``) killed with SIGKILL by another process in the middle of an epoch: Tune retries the
  trial from its last checkpoint (Tune's, or Train's) into the same MLflow child run, and the resumed trial's
  results equal those of an uninterrupted trial with the same config and seed, bit for bit;
* an out-of-memory error raised inside one trial: that trial ends ERROR in Tune and FAILED in MLflow
  with the error in its tags, while the other trial completes;
* load: 12 trials queued on 2 CPUs all complete, none duplicated or lost, within a memory bound.

The worker crash via ``os._exit`` and the driver ``kill -9`` are in ``test_sweep_recovery.py``.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from nmtcore import tracking
from nmtcore.engine import Callback
from nmtcore.sweep import driver, lifecycle, ray_backend
from nmtcore.sweep.ray_backend import tuner as rb_tuner
from nmtcore.testing.sweeps import runs_of, tiny_base, tiny_settings
from search_spaces import SearchSpace, grid

pytestmark = pytest.mark.slow

GiB = 1024**3


def counts(expected_keys: set[str], children: list[tracking.RunRecord]) -> dict[str, int]:
    """Trials expected / completed / duplicated (extra child runs for a key) / lost (no complete run)."""
    keys = [c.tags[lifecycle.TRIAL_KEY_TAG] for c in children]
    complete = {c.tags[lifecycle.TRIAL_KEY_TAG] for c in children
                if c.status == "FINISHED" and c.tags.get(lifecycle.TRIAL_STATE_TAG) == "complete"}
    return {"expected": len(expected_keys), "completed": len(complete & expected_keys),
            "duplicated": len(keys) - len(set(keys)), "lost": len(expected_keys - complete)}


# ------------------------------------------------------------------------------- 1. SIGKILL of a worker
class ParkInEpoch2(Callback):
    """At the first log past the middle of epoch 2 (once per sweep: the pid file is the marker), write the
    training process's pid and wait to be killed, so the test's SIGKILL lands mid-epoch. Training is untouched."""

    def __init__(self, pid_file: str, wait_s: float = 120.0) -> None:
        self.pid_file, self.wait_s = pid_file, wait_s

    def on_log(self, trainer, metrics):
        if trainer.state.epoch != 1 or os.path.exists(self.pid_file):  # state.epoch = epochs completed
            return
        per_epoch = trainer.state.history[0]["num_updates"]
        if trainer.state.num_updates - per_epoch < per_epoch / 2:
            return
        tmp = f"{self.pid_file}.tmp"
        Path(tmp).write_text(json.dumps({"pid": os.getpid(), "epoch": trainer.state.epoch + 1,
                                         "num_updates": trainer.state.num_updates}))
        os.replace(tmp, self.pid_file)
        time.sleep(self.wait_s)  # not killed by then: the test fails (no retry, attach count 1)


def _kill_when_parked(pid_file: Path, store_uri: str, experiment: str, seen: dict, stop: threading.Event) -> None:
    """Test-process thread: wait for the parked worker's pid, note what MLflow holds, SIGKILL it."""
    try:
        while not pid_file.exists():
            if stop.wait(0.2):
                return
        info = json.loads(pid_file.read_text())
        proc = psutil.Process(info["pid"])
        seen.update(info, title=" ".join(proc.cmdline()).strip() or proc.name(), ppid=proc.ppid())
        (child,) = runs_of(experiment, store_uri)[1]
        seen["valid_loss_steps_at_kill"] = [s for s, _ in tracking.get_run_metrics(child.run_id, store_uri)
                                            .get("valid_loss", [])]
        os.kill(info["pid"], signal.SIGKILL)
        proc.wait(timeout=30)
        seen["killed"] = True
    except Exception as e:  # reported by the test
        seen["error"] = repr(e)


@pytest.mark.parametrize("in_actor", [True, False], ids=["tune-actor", "train-worker"])
def test_sigkilled_trainer_resumes_and_matches_an_uninterrupted_trial(in_actor, ray_cluster, store, tmp_path,
                                                                      deadline):
    name = "sigkill" if in_actor else "sigkill-w"
    space = SearchSpace(name, "t", "transformer", params={"model.d_model": grid((32,))})
    base = tiny_base(tmp_path, **{"train.max_epochs": 3})
    t0 = time.perf_counter()
    # The reference trains in its Tune actor (the default) either way: the process must not change a bit.
    ref = driver.run_sweep(space, base, tiny_settings(tmp_path / "ref", f"{name}-ref", store, max_failures=2),
                          log_to_driver=False)
    t_ref = time.perf_counter() - t0

    pid_file = tmp_path / "worker.json"
    seen: dict = {}
    stop = threading.Event()
    killer = threading.Thread(target=_kill_when_parked, args=(pid_file, store, name, seen, stop), daemon=True)
    killer.start()
    t0 = time.perf_counter()
    try:
        result = driver.run_sweep(space, base, tiny_settings(tmp_path / "kill", name, store, max_failures=2,
                                                             trial_in_actor=in_actor),
                                 trial_callbacks=[ParkInEpoch2(str(pid_file))], log_to_driver=False)
    finally:
        stop.set()
        killer.join(timeout=60)
    t_kill = time.perf_counter() - t0

    # The kill happened from outside, to the trial's Tune actor or its Train worker, while epoch 2 was running
    # (epoch 1 logged, 2 not).
    assert seen.get("killed") and "error" not in seen, seen
    assert "ray::" in seen["title"] and ("ImplicitFunc" if in_actor else "TrainWorker") in seen["title"], seen
    assert seen["epoch"] == 2 and seen["valid_loss_steps_at_kill"] == [1], seen

    assert not result.interrupted and [t.status for t in result.trials] == ["TERMINATED"]
    (child,) = runs_of(name, store)[1]
    (ref_child,) = runs_of(f"{name}-ref", store)[1]
    assert child.tags[ray_backend.TRIAL_PROCESS_TAG] == ("tune actor" if in_actor else "train workers")
    assert ref_child.tags[ray_backend.TRIAL_PROCESS_TAG] == "tune actor"
    assert child.tags[lifecycle.TRIAL_KEY_TAG] == ref_child.tags[lifecycle.TRIAL_KEY_TAG]  # same overrides, seed
    assert {k: v for k, v in child.params.items() if "output_dir" not in k and "save_dir" not in k} == \
           {k: v for k, v in ref_child.params.items() if "output_dir" not in k and "save_dir" not in k}
    assert child.status == "FINISHED" and child.tags[lifecycle.TRIAL_STATE_TAG] == "complete"
    assert child.tags["nmtcore.attach_count"] == "2"  # the retry re-attached the same run
    assert tracking.FAILURE_REASON_TAG not in child.tags  # the crash's reason was cleared by the successful retry
    c = counts({child.tags[lifecycle.TRIAL_KEY_TAG]}, runs_of(name, store)[1])
    assert c == {"expected": 1, "completed": 1, "duplicated": 0, "lost": 0}, c

    hist, ref_hist = tracking.get_run_metrics(child.run_id, store), tracking.get_run_metrics(ref_child.run_id, store)
    assert [s for s, _ in hist["valid_loss"]] == [1, 2, 3]  # epoch 1 not retrained, epoch 2 from its start
    # Bit-identical: every per-epoch metric, the test scores, and every update-level loss/lr. Updates of
    # epoch 2 logged before the kill were logged again by the retry: both values equal the reference's.
    timing = ("wall_s", "tokens_per_s", "sentences_per_s", "cost/")
    compared = []
    for key, ref_values in ref_hist.items():
        if any(t in key for t in timing):
            continue
        compared.append(key)
        values = hist[key]
        assert sorted(set(values)) == sorted(set(ref_values)), (key, values, ref_values)
        assert {s for s, _ in values} == {s for s, _ in ref_values} and \
               len(dict(values)) == len(set(values)), (key, values)  # a re-logged step has one value
    for key in ("valid_loss", "valid_bleu", "train_loss", "test/test/bleu", "test/test/chrf", "update/train_loss",
                "final/num_updates", "final/best_valid_loss"):
        assert key in compared, key
    relogged = len(hist["update/train_loss"]) - len(ref_hist["update/train_loss"])
    assert relogged >= 2  # the killed attempt had logged half of epoch 2
    final = {t.trial_key: t.metrics for t in result.trials}[child.tags[lifecycle.TRIAL_KEY_TAG]]
    ref_final = ref.trials[0].metrics
    assert (final["valid_loss"], final["test_bleu"]) == (ref_final["valid_loss"], ref_final["test_bleu"])
    tune_failures = [getattr(t, "num_failures", None) for t in rb_tuner._saved_trials(result.experiment_path)]
    assert tune_failures == [1], tune_failures  # Tune retried the trial once (not a fresh trial, not none)
    print(f"\nSIGKILL of worker pid {seen['pid']} at update {seen['num_updates']} (epoch 2): trials {c}; "
          f"epoch-3 valid_loss {final['valid_loss']!r} vs uninterrupted {ref_final['valid_loss']!r}, test BLEU "
          f"{final['test_bleu']!r} vs {ref_final['test_bleu']!r}; {len(compared)} metric histories identical "
          f"({relogged} re-logged updates equal); wall {t_kill:.0f} s (uninterrupted {t_ref:.0f} s); killed "
          f"{seen['title']!r}")


# ------------------------------------------------------------------------------- 2. out of memory
OOM_TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB (fault test: d_model=32)"


class OutOfMemoryInSmallModel(Callback):
    """The d_model=32 trial runs out of memory at its first log, on every attempt."""

    def on_log(self, trainer, metrics):
        if trainer.cfg.model.d_model == 32:
            import torch

            raise getattr(torch, "OutOfMemoryError", MemoryError)(OOM_TEXT)


def test_out_of_memory_trial_fails_with_reason_and_the_other_completes(ray_cluster, store, tmp_path, deadline):
    space = SearchSpace("oom", "t", "transformer", params={"model.d_model": grid((32, 64))})
    t0 = time.perf_counter()
    result = driver.run_sweep(space, tiny_base(tmp_path), tiny_settings(tmp_path, "oom", store, max_failures=1),
                             trial_callbacks=[OutOfMemoryInSmallModel()], log_to_driver=False)
    wall = time.perf_counter() - t0
    assert not result.interrupted
    status = {t.overrides["model.d_model"]: t.status for t in result.trials}
    assert status == {32: "ERROR", 64: "TERMINATED"}, status
    _, children = runs_of("oom", store)
    assert len(children) == 2 and len({c.tags[lifecycle.TRIAL_KEY_TAG] for c in children}) == 2
    by_d = {c.params["model.d_model"]: c for c in children}
    bad, good = by_d["32"], by_d["64"]
    name = "OutOfMemoryError" if hasattr(__import__("torch"), "OutOfMemoryError") else "MemoryError"
    reason = bad.tags.get(tracking.FAILURE_REASON_TAG, "")
    assert bad.status == "FAILED" and reason == f"{name}: {OOM_TEXT}", (bad.status, reason)
    assert bad.tags[lifecycle.TRIAL_STATE_TAG] == "failed" and bad.tags["nmtcore.tune_status"] == "ERROR"
    assert bad.tags.get(lifecycle.FAILURE_KIND_TAG) == "oom"  # not mistaken for a NaN, nor for a crash
    # Not retried blindly: Tune's retry (max_failures=1) ends at once, without training or re-attaching.
    assert bad.tags["nmtcore.attach_count"] == "1"
    assert "valid_loss" not in bad.metrics and "test/test/bleu" not in bad.metrics
    assert good.status == "FINISHED" and good.tags[lifecycle.TRIAL_STATE_TAG] == "complete"
    assert good.tags["nmtcore.attach_count"] == "1" and tracking.FAILURE_REASON_TAG not in good.tags
    assert [s for s, _ in tracking.get_run_metrics(good.run_id, store)["valid_loss"]] == [1, 2]
    assert "test/test/bleu" in good.metrics
    table = (tmp_path / "report" / "table.md").read_text()
    assert "1 failed" in table and name in table
    print(f"\nOOM: trial d_model=32 {status[32]} / MLflow {bad.status} ({reason!r}, attach count "
          f"{bad.tags['nmtcore.attach_count']}); d_model=64 {status[64]} / {good.status}; wall {wall:.0f} s")


# ------------------------------------------------------------------------------- 3. load
TRIAL_PROCESSES = ("ray::ImplicitFunc", "ray::TrainController", "ray::RayTrainWorker")
EXITING_S = 5.0  # how long an actor Tune has let go (its CPUs freed) may take to exit


class PeakRSS(threading.Thread):
    """Samples, every ``interval`` s, the memory summed over this process (the driver), its descendants and
    any process naming this Ray session's directory; keeps the peaks. RSS counts pages shared between
    processes (torch's libraries in every worker) once per process; PSS (every ``pss_every``-th sample)
    divides them among their sharers, so its sum is the footprint."""

    def __init__(self, interval: float = 0.5, pss_every: int = 4) -> None:
        super().__init__(daemon=True)
        self.interval, self.pss_every = interval, pss_every
        self.peak = self.peak_pss = 0
        self.peak_procs = 0
        self.peak_kinds: dict[str, int] = {}
        self.samples = 0
        self.trial_pids: list[tuple[float, dict[int, str]]] = []  # per sample: its time, the trial processes
        self._stop_event = threading.Event()
        import ray

        self.session = ray._private.worker._global_node.get_session_dir_path()  # noqa: SLF001

    def processes(self) -> dict[int, psutil.Process]:
        me = psutil.Process()
        procs = {me.pid: me}
        for p in me.children(recursive=True):
            procs[p.pid] = p
        for p in psutil.process_iter(["cmdline"]):
            if self.session in " ".join(p.info.get("cmdline") or []):
                procs.setdefault(p.pid, p)
        return procs

    def trial_processes(self) -> list[str]:
        """Titles of live processes that belong to a trial (its Tune actor, Train controller, workers)."""
        out = []
        for p in self.processes().values():
            try:
                title = " ".join(p.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            if title.startswith(TRIAL_PROCESSES):
                out.append(title)
        return out

    def sample(self) -> None:
        procs = self.processes()
        with_pss = self.samples % self.pss_every == 0
        total = pss = 0
        kinds: dict[str, int] = {}
        trial: dict[int, str] = {}
        t = time.monotonic()
        for p in procs.values():
            try:
                if with_pss:
                    full = p.memory_full_info()
                    total, pss = total + full.rss, pss + full.pss
                else:
                    total += p.memory_info().rss
                kind = (p.cmdline() or [p.name()])[0].split("/")[-1][:40]
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kinds[kind] = kinds.get(kind, 0) + 1
            if kind.startswith(TRIAL_PROCESSES):
                trial[p.pid] = kind
        self.trial_pids.append((t, trial))
        self.samples += 1
        self.peak_pss = max(self.peak_pss, pss)
        if total > self.peak:
            self.peak, self.peak_procs, self.peak_kinds = total, len(procs), kinds

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)

    def trial_processes_at_once(self, exit_s: float) -> tuple[int, int]:
        """The most trial processes seen in one sample: all of them, and those not in their last ``exit_s``
        seconds of life. Tune frees an actor's CPUs when it lets the actor go (a trial that ended, a cached actor
        it evicts), so a successor can start while that process is still exiting, its run already ended; a
        process seen in a sample and again ``exit_s`` later was not exiting then. Those alive at the last
        sample count."""
        last_seen: dict[int, float] = {}
        for t, pids in self.trial_pids:
            for pid in pids:
                last_seen[pid] = t
        end = self.trial_pids[-1][0] if self.trial_pids else 0.0
        every = max((len(pids) for _, pids in self.trial_pids), default=0)
        held = max((sum(1 for pid in pids if last_seen[pid] >= t + exit_s or last_seen[pid] == end)
                    for t, pids in self.trial_pids), default=0)
        return every, held


def _max_overlap(runs: list[tracking.RunRecord]) -> int:
    events = sorted([(r.start_time, 1) for r in runs] + [(r.end_time, -1) for r in runs], key=lambda e: (e[0], e[1]))
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def test_twelve_trials_queue_and_complete_without_loss(ray_cluster, store, tmp_path, deadline):
    values = tuple(range(16, 64, 4))  # 12 model widths (heads=4 divides each): 12 distinct trial keys
    space = SearchSpace("load", "t", "transformer", params={"model.d_model": grid(values)}, metric="valid_loss",
                        mode="min")
    s = tiny_settings(tmp_path, "load", store, cpus_per_trial=0.5)
    fits = ray_backend.trials_that_fit(s)
    assert fits == 4  # 2 CPUs / 0.5: the other 8 trials must queue
    rss = PeakRSS()
    rss.start()
    t0 = time.perf_counter()
    try:
        result = driver.run_sweep(space, tiny_base(tmp_path, **{"train.valid_bleu": False}), s, log_to_driver=False)
    finally:
        wall = time.perf_counter() - t0
        rss.stop()
    assert not result.interrupted
    assert len(result.trials) == 12 and [t.status for t in result.trials] == ["TERMINATED"] * 12
    assert len({t.trial_key for t in result.trials}) == 12
    parents, children = runs_of("load", store)
    assert len(parents) == 1 and parents[0].status == "FINISHED"
    expected = {t.trial_key for t in result.trials}
    c = counts(expected, children)
    assert c == {"expected": 12, "completed": 12, "duplicated": 0, "lost": 0}, c
    assert len(children) == 12 and all(r.tags["nmtcore.attach_count"] == "1" for r in children)
    assert sorted(int(r.params["model.d_model"]) for r in children) == list(values)
    for r in children:
        assert [step for step, _ in tracking.get_run_metrics(r.run_id, store)["valid_loss"]] == [1, 2], r.run_name
    running = _max_overlap(children)
    assert 2 <= running <= fits, running  # queued: never more at once than fit, but more than one
    assert rss.samples >= 10 and rss.peak_procs >= 5, (rss.samples, rss.peak_procs)  # the sampler saw Ray
    # A one-worker trial trains in its Tune actor, which holds the trial's CPUs: no Train controller or workers,
    # and never more trial processes than trials fit, but for actors exiting after Tune has freed their CPUs
    # (their runs ended: the overlap above counts the runs). CI once saw 5 at the memory peak; Tune reuses 4 here.
    kinds = {kind for _, pids in rss.trial_pids for kind in pids.values()}
    assert kinds and all(k.startswith("ray::ImplicitFunc") for k in kinds), kinds
    every, held = rss.trial_processes_at_once(exit_s=EXITING_S)
    assert 1 <= held <= fits, (every, held, rss.peak_kinds)
    assert rss.peak_pss < 12 * GiB, rss.peak_pss / GiB  # the footprint: ~7.3 GiB measured
    assert rss.peak < 20 * GiB, rss.peak / GiB  # shared pages counted once per process: 11-12 GiB measured
    # No trial's processes outlive the sweep (they would hold memory until the cluster ends).
    t_end = time.monotonic()
    while rss.trial_processes() and time.monotonic() - t_end < 30:
        time.sleep(1.0)
    assert rss.trial_processes() == [], rss.trial_processes()
    left_s = time.monotonic() - t_end
    print(f"\nLOAD: {c['expected']} trials expected, {c['completed']} completed, {c['duplicated']} duplicated, "
          f"{c['lost']} lost; {len(children)} child runs FINISHED; at most {running} running at once "
          f"(cpus_per_trial 0.5, {fits} fit); wall {wall:.0f} s; peak RSS {rss.peak / GiB:.2f} GiB over "
          f"{rss.peak_procs} processes (driver + Ray: {rss.peak_kinds}), peak PSS {rss.peak_pss / GiB:.2f} GiB, "
          f"{rss.samples} samples; trial processes at once {held} ({every} counting those exiting); trial "
          f"processes gone {left_s:.0f} s after the sweep")


def test_an_exiting_actor_beside_its_successor_is_not_counted_and_a_fifth_trainer_is():
    """The load test's process count, on made-up samples (0.5 s apart): four actors for the whole sweep and one
    let go that is still exiting 2 s into its successor's life count 4; a fifth actor that lives on counts 5."""
    def sampler(timeline: list[tuple[float, dict[int, str]]]) -> PeakRSS:
        rss = PeakRSS.__new__(PeakRSS)  # no sampling thread, no Ray session: only the samples
        rss.trial_pids = timeline
        return rss

    actor = "ray::ImplicitFunc.train"
    four = {pid: actor for pid in range(4)}
    exiting = [(i / 2, {**four, **({9: actor} if 20 <= i < 24 else {})}) for i in range(60)]
    assert sampler(exiting).trial_processes_at_once(exit_s=EXITING_S) == (5, 4)
    staying = [(i / 2, {**four, **({9: actor} if i >= 20 else {})}) for i in range(60)]
    assert sampler(staying).trial_processes_at_once(exit_s=EXITING_S) == (5, 5)
