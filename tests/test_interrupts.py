"""A stopping signal (SIGTERM, SIGINT under the CLI) never cuts an MLflow store write in half.

Cut short inside a sqlite transaction, a write can leave the store locked for the rest of the process, and the run
it meant to end KILLED stays RUNNING (seen in ``test_cli``'s SIGTERM test on a loaded machine, and reproduced by
signalling a metric-logging loop at random moments). Here the signal arrives in the middle of a write, on purpose:
the write completes, then the command stops.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest
from mlflow import MlflowClient

from nmtcore import tracking
from nmtcore.interrupts import Stopped, interrupt, uninterrupted


@pytest.fixture
def cli_handler():
    """SIGTERM handled as the CLI handles it (restored after)."""
    before = signal.signal(signal.SIGTERM, interrupt)
    yield
    signal.signal(signal.SIGTERM, before)


def test_a_signal_in_a_block_is_raised_when_the_outermost_block_ends(cli_handler):
    done = []
    with pytest.raises(Stopped) as stopped:
        with uninterrupted():
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("inner")
            done.append("outer")  # still running after the inner block: the signal waits for the outermost
    assert done == ["inner", "outer"] and stopped.value.signum == signal.SIGTERM
    with pytest.raises(Stopped):  # outside a block: at once
        os.kill(os.getpid(), signal.SIGTERM)
        done.append("never")
    assert done == ["inner", "outer"]
    with uninterrupted():  # the pending signal was consumed: a later block ends quietly
        pass


def test_a_block_in_another_thread_holds_nothing(cli_handler):
    seen = []

    def other():
        with uninterrupted():
            seen.append("ran")

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == ["ran"]
    with pytest.raises(Stopped):  # the main thread's count was not touched by the other thread
        os.kill(os.getpid(), signal.SIGTERM)


def _signal_during(monkeypatch, name):
    """Make MlflowClient.<name> receive SIGTERM at its start, then do its work."""
    real = getattr(MlflowClient, name)

    def signalled(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(MlflowClient, name, signalled)


def test_a_signal_during_a_tracker_write_lets_it_finish_then_the_run_ends_killed(cli_handler, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tracking.Tracker(uri, experiment="stop")
    _signal_during(monkeypatch, "log_batch")
    with pytest.raises(Stopped):
        run.log_metrics({"valid_bleu": 12.5}, step=3)
    monkeypatch.undo()
    run.end("KILLED")
    [rec] = tracking.load_runs(experiment="stop", tracking_uri=uri)
    assert rec.status == "KILLED" and rec.metrics["valid_bleu"] == 12.5


def test_a_signal_during_a_module_level_write_lets_it_finish(cli_handler, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tracking.Tracker(uri, experiment="stop")
    _signal_during(monkeypatch, "log_batch")
    with pytest.raises(Stopped):
        tracking.set_run_tags(run.run_id, {"nmtcore.note": "kept"}, uri)
    monkeypatch.undo()
    run.end("KILLED")
    [rec] = tracking.load_runs(experiment="stop", tracking_uri=uri)
    assert rec.status == "KILLED" and rec.tags["nmtcore.note"] == "kept"


def test_a_signal_while_a_run_starts_ends_that_run_killed(cli_handler, tmp_path, monkeypatch):
    """Stopped while the run is being created: the Tracker is never returned, so nobody else could end the run;
    it ends KILLED rather than staying RUNNING."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.Tracker(uri, experiment="stop").end()  # the store and its experiment exist
    _signal_during(monkeypatch, "create_run")
    with pytest.raises(Stopped):
        tracking.Tracker(uri, experiment="stop", run_name="cut")
    monkeypatch.undo()
    assert [r.status for r in tracking.load_runs(experiment="stop", tracking_uri=uri) if r.run_name == "cut"] == [
        "KILLED"]


def test_a_ray_worker_s_own_handler_waits_for_the_write_too():
    """A Ray worker's SIGTERM handler raises SystemExit where the main thread is; wrapped as trials wrap it
    (``exit_quietly_on_sigterm``), a signal in a store write runs it after the write."""
    from nmtcore.sweep.ray_backend.cluster import exit_quietly_on_sigterm

    def ray_handler(signum, frame):
        raise SystemExit(f"signal {signum}")

    before = signal.signal(signal.SIGTERM, ray_handler)
    try:
        exit_quietly_on_sigterm()
        wrapped = signal.getsignal(signal.SIGTERM)
        assert wrapped is not ray_handler and wrapped.nmtcore_deferring
        exit_quietly_on_sigterm()
        assert signal.getsignal(signal.SIGTERM) is wrapped  # not wrapped twice
        done = []
        with pytest.raises(SystemExit, match=f"signal {int(signal.SIGTERM)}"):
            with uninterrupted():
                os.kill(os.getpid(), signal.SIGTERM)
                done.append("the write went on")
        assert done == ["the write went on"]
        with pytest.raises(SystemExit):  # outside a write: at once
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("never")
        assert done == ["the write went on"]
    finally:
        signal.signal(signal.SIGTERM, before)
