"""``--time-limit`` (nmtcore.sweep.timelimit): the duration it reads, when it stops a sweep (right after the last
epoch checkpoint that fits, the timer at the latest), that it stops once, and that its stop is the command's
graceful SIGTERM."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from nmtcore.sweep.ray_backend.callbacks import _TimeLimitCallback
from nmtcore.sweep.settings import SweepError, SweepSettings
from nmtcore.sweep.timelimit import TimeLimit, TimeLimitError, parse_duration


@pytest.mark.parametrize("text, seconds", [("170", 10200), ("2.5", 150), ("2h50m", 10200), ("3h", 10800),
                                           ("45m", 2700), ("1h 5min", 3900), (" 90M ", 5400)])
def test_durations_read_as_minutes_or_hours_and_minutes(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "2h50", "h", "nan", "inf"])
def test_a_bad_duration_fails_naming_the_option(text):
    with pytest.raises(TimeLimitError, match="^time_limit: "):
        parse_duration(text)
    with pytest.raises(SweepError, match="^time_limit: "):
        SweepSettings(name="x", storage="/tmp/x", time_limit=text)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limit_at(stop_at: float, clock: Clock, stops: list[int]) -> TimeLimit:
    return TimeLimit(stop_at, margin_s=60.0, stop=lambda: stops.append(1), clock=clock)


def test_it_waits_while_a_running_trial_can_still_checkpoint_before_the_limit():
    """Stop-by is the limit less the margin (2000 − 60); a trial's next checkpoint is its last plus its last
    epoch's time. The sweep stops only once every running trial's next one falls after stop-by, and never while a
    running trial has not reported an epoch yet."""
    clock, stops = Clock(), []
    limit = limit_at(2000.0, clock, stops)
    assert not limit.nothing_more_fits([])
    limit.checkpointed("a", 600.0)  # at 1000: next at 1600, before 1940
    assert not limit.nothing_more_fits(["a"])
    clock.now = 1600.0
    limit.checkpointed("a", 600.0)  # next at 2200: after
    assert limit.nothing_more_fits(["a"])
    assert not limit.nothing_more_fits(["a", "b"])  # b has written nothing yet: it may
    limit.checkpointed("b", 300.0)  # at 1600: next at 1900, before 1940
    assert not limit.nothing_more_fits(["a", "b"])
    limit.forget("b")  # b ended (done, or failed)
    assert limit.nothing_more_fits(["a"]) and not stops


def test_the_callback_stops_the_sweep_once_after_the_last_checkpoint_that_fits():
    clock, stops = Clock(), []
    limit = limit_at(2000.0, clock, stops)
    callback = _TimeLimitCallback(limit)
    a, b = SimpleNamespace(trial_id="a", status="RUNNING"), SimpleNamespace(trial_id="b", status="RUNNING")
    callback.on_trial_result(1, [a, b], a, {"time_this_iter_s": 500.0})  # a: next at 1500
    callback.on_trial_result(1, [a, b], b, {"time_this_iter_s": 800.0})  # b: next at 1800
    assert not stops
    clock.now = 1500.0
    callback.on_trial_result(2, [a, b], a, {"time_this_iter_s": 500.0})  # a: next at 2000 > 1940; b's 1800 fits
    assert not stops
    clock.now = 1800.0
    callback.on_trial_result(2, [a, b], b, {"time_this_iter_s": 800.0})  # b: next at 2600: nothing more fits
    assert stops == [1] and "no running trial can write another epoch checkpoint" in limit.fired
    callback.on_trial_result(3, [a, b], a, {"time_this_iter_s": 500.0})
    limit.fire("the timer")
    assert stops == [1]  # a second SIGTERM would skip Tune's graceful stop
    # A finished trial no longer holds the sweep up.
    clock2, stops2 = Clock(), []
    limit2 = limit_at(2000.0, clock2, stops2)
    cb2 = _TimeLimitCallback(limit2)
    c = SimpleNamespace(trial_id="c", status="RUNNING")
    cb2.on_trial_result(1, [a, c], a, {"time_this_iter_s": 2000.0})
    cb2.on_trial_complete(1, [a, c], c)
    assert not stops2  # c is still listed as running in this step, with no checkpoint: wait
    c.status = "TERMINATED"
    cb2.on_trial_result(2, [a, c], a, {"time_this_iter_s": 2000.0})
    assert stops2 == [1]


def test_a_resumed_trial_counts_from_its_restart_with_its_last_sessions_epoch_time():
    """A trial resumed from a checkpoint has Tune's last result of the earlier session: its next checkpoint is
    foreseen from the restart; a new trial's is not (it holds the sweep until it writes one)."""
    clock, stops = Clock(), []
    limit = limit_at(2000.0, clock, stops)
    callback = _TimeLimitCallback(limit)
    resumed = SimpleNamespace(trial_id="r", status="RUNNING", last_result={"epoch": 4, "time_this_iter_s": 1200.0})
    new = SimpleNamespace(trial_id="n", status="RUNNING", last_result={})
    callback.on_trial_start(1, [resumed, new], resumed)
    callback.on_trial_start(1, [resumed, new], new)
    assert limit.checkpoints == {"r": (1000.0, 1200.0)}  # next at 2200: after 1940
    assert not limit.nothing_more_fits(["r", "n"])
    callback.on_trial_result(2, [resumed, new], new, {"time_this_iter_s": 1000.0})  # n: next at 2000
    assert stops == [1]


def test_the_callback_pickles_without_its_limit():
    """Tune pickles a new Tuner's callbacks (tuner.pkl); the limit's timer thread cannot be, and a restored Tuner
    gets live callbacks anyway."""
    import time

    callback = _TimeLimitCallback(TimeLimit(time.time() + 3600.0, stop=lambda: None).start())
    try:
        assert pickle.loads(pickle.dumps(callback)).limit is None
    finally:
        callback.limit.cancel()


def test_the_session_record_is_written_as_trials_start_every_period_and_as_each_ends(monkeypatch):
    """The driver's record of the session's time: at the first step, then not again within the period, again
    after it, and at every trial's end or error; pickled with the Tuner it leaves the driver's callable behind."""
    from nmtcore.sweep.ray_backend import callbacks

    now = [1000.0]
    monkeypatch.setattr(callbacks.time, "monotonic", lambda: now[0])
    calls = []
    cb = callbacks._SessionRecord(lambda: calls.append(now[0]), every_s=300.0)
    cb.on_step_end(0, [])
    now[0] += 299.0
    cb.on_step_end(1, [])
    assert calls == [1000.0]
    now[0] += 1.0
    cb.on_step_end(2, [])
    cb.on_trial_complete(3, [], trial=None)
    now[0] += 10.0
    cb.on_trial_error(4, [], trial=None)
    assert calls == [1000.0, 1300.0, 1300.0, 1310.0]
    restored = pickle.loads(pickle.dumps(cb))
    assert restored.record is None and restored.every_s == 300.0
    restored.on_step_end(5, [])  # without a record to call: nothing happens, nothing fails


def test_the_timer_stops_at_the_limit_less_the_margin():
    import time

    done = threading.Event()
    limit = TimeLimit(time.time() + 60.3, margin_s=60.0, stop=done.set).start()
    assert done.wait(5) and "60 s away" in limit.fired
    quiet = threading.Event()
    TimeLimit(time.time() + 60.3, margin_s=60.0, stop=quiet.set).start().cancel()
    assert not quiet.wait(1)


SCRIPT = """
import time
from nmtcore.cli.sweep import SigtermAsCtrlC
from nmtcore.sweep.timelimit import TimeLimit

with SigtermAsCtrlC() as stop:
    TimeLimit(time.time() + 0.5, margin_s=0.0).start()
    try:
        time.sleep(30)
    except KeyboardInterrupt:
        print("stopped by signal", stop.received)
"""


def test_its_stop_is_the_sweep_commands_sigterm():
    """The default stop sends this process SIGTERM, which a sweep command (``SigtermAsCtrlC``) turns into the same
    stop as Ctrl-C: Tune's graceful one during the trials, a KeyboardInterrupt elsewhere."""
    import signal

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"stopped by signal {int(signal.SIGTERM)}" in done.stdout
    assert "time limit: " in done.stderr and "stopping the sweep as SIGTERM does" in done.stderr


def test_a_new_trial_is_foreseen_from_the_estimate_of_its_epoch():
    """The sweep's cost estimate knows each trial's epoch time (by config key): a trial that starts new is
    foreseen as if it had written a checkpoint at its start. One that Tune starts minutes before the limit, beside
    trials that cannot write another either, stops the sweep at once instead of holding it to the timer; one
    whose first epoch fits does not; a trial the estimate does not know holds the sweep as before."""
    from nmtcore.sweep.cost import RunCost, estimate

    est = estimate([], None, False, [RunCost("arm", 10, 420.0, 30.0, "cap"), RunCost("ctl", 10, 90.0, 10.0, "cap")],
                   2, "m", keys=["k_arm", "k_ctl"])
    assert est.epochs_s == (("k_arm", 420.0), ("k_ctl", 90.0))
    clock, stops = Clock(), []
    limit = limit_at(2000.0, clock, stops)  # stop by 1940
    limit.expected.update(est.epochs_s)
    keys = {"old": "k_old", "arm": "k_arm", "ctl": "k_ctl", "other": "k_unknown"}
    callback = _TimeLimitCallback(limit, key_of=lambda t: keys[t.trial_id])
    old = SimpleNamespace(trial_id="old", status="RUNNING", last_result={})
    callback.on_trial_result(5, [old], old, {"time_this_iter_s": 600.0})  # next at 1600
    clock.now = 1600.0
    callback.on_trial_result(6, [old], old, {"time_this_iter_s": 600.0})  # next at 2200: only old runs...
    assert stops == [1]  # ...so it stops (the existing rule)
    # Again with a second trial, 'done', which finishes at 1600; a new trial starts in its place beside 'old'
    # (next checkpoint at 2200): 'ctl' would checkpoint at 1690 (fits), 'arm' at 2020 (does not).
    for new_id, fits in (("ctl", True), ("arm", False), ("other", None)):
        clock.now, stops = 1000.0, []
        limit = limit_at(2000.0, clock, stops)
        limit.expected.update(est.epochs_s)
        callback = _TimeLimitCallback(limit, key_of=lambda t: keys[t.trial_id])
        done = SimpleNamespace(trial_id="done", status="RUNNING", last_result={})
        callback.on_trial_result(5, [old, done], done, {"time_this_iter_s": 500.0})  # next at 1500: fits
        callback.on_trial_result(5, [old, done], old, {"time_this_iter_s": 1200.0})  # next at 2200: cannot
        clock.now = 1600.0
        callback.on_trial_complete(6, [old, done], done)
        done.status = "TERMINATED"
        assert not stops
        new = SimpleNamespace(trial_id=new_id, status="PENDING", last_result={})
        callback.on_trial_start(6, [old, done, new], new)
        if fits is False:
            assert stops == [1] and f"{new}" in limit.fired, limit.fired
        else:
            assert not stops
            # 'other': not in the estimate, nothing foreseen: it holds the early stop until it checkpoints
            assert (new_id in limit.checkpoints) == (fits is True)
