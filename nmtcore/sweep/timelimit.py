"""``--time-limit``: a sweep that must be gone by a given time (a batch job's wall time, a machine lent for a
session) stops itself as SIGTERM stops it, so ``--resume`` continues it from its trials' checkpoints.

Trials save a checkpoint at the end of each epoch, so what a stop loses is each running trial's work since its last
one, wherever between the checkpoints the stop falls. Stopping at the limit saves no more than stopping right after
the last checkpoint any trial can still write before it. So the sweep stops at that checkpoint
(:meth:`TimeLimit.nothing_more_fits`, the driver's Tune callback), which frees the machine sooner, and at the limit
at the latest (a timer). Both stops begin :data:`STOP_MARGIN_S` before the limit: Tune saves its state, the trials'
actors end and the MLflow runs close in that time.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

STOP_MARGIN_S = 90.0  # the stop begins this long before the limit


class TimeLimitError(ValueError):
    """A ``--time-limit`` that cannot be read."""


def parse_duration(text: str) -> float:
    """Seconds of ``text``: minutes as a bare number (``170``, ``2.5``), or hours and minutes (``2h50m``,
    ``3h``, ``45m``)."""
    s = text.strip().lower()
    try:
        seconds = float(s) * 60.0
    except ValueError:
        m = re.fullmatch(r"(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m(?:in)?)?", s)
        if not s or m is None or not any(m.groups()):
            raise TimeLimitError(f"time_limit: {text!r} is not a duration (minutes, or e.g. 2h50m)") from None
        seconds = float(m.group(1) or 0) * 3600.0 + float(m.group(2) or 0) * 60.0
    if not math.isfinite(seconds) or seconds <= 0:
        raise TimeLimitError(f"time_limit: {text!r} must be a positive duration")
    return seconds


@dataclass
class TimeLimit:
    """The limit of one sweep command, as a wall-clock time (``time.time()``), and what it knows of the running
    trials' checkpoints: ``checkpoints[trial] = (when the last one was written, the epoch before it took s)``.
    ``stop`` stops the sweep (default: SIGTERM to this process, which the sweep's command turns into Tune's
    graceful stop)."""

    stop_at: float
    margin_s: float = STOP_MARGIN_S
    stop: Callable[[], None] = field(default=lambda: os.kill(os.getpid(), signal.SIGTERM))
    clock: Callable[[], float] = time.time
    checkpoints: dict[str, tuple[float, float]] = field(default_factory=dict)
    # One epoch's estimated seconds per trial config key (the sweep's cost estimate): a new trial's first
    # checkpoint foreseen from its start, as a resumed trial's is from its last epoch's time.
    expected: dict[str, float] = field(default_factory=dict)
    fired: str = ""  # why it stopped the sweep ("" while it has not)
    _timer: threading.Timer | None = None

    @property
    def stop_by(self) -> float:
        """When the stop begins at the latest."""
        return self.stop_at - self.margin_s

    def checkpointed(self, trial: str, epoch_s: float) -> None:
        """``trial`` wrote a checkpoint now, after an epoch of ``epoch_s`` seconds (or resumed from one now, its
        last epoch having taken ``epoch_s`` in an earlier session)."""
        self.checkpoints[trial] = (self.clock(), epoch_s)

    def started(self, trial: str, key: str) -> bool:
        """A new trial (config key ``key``) started now: with an estimate of its epoch, its first checkpoint is
        foreseen as if it had written one now. Returns whether it could be."""
        if key not in self.expected:
            return False
        self.checkpoints[trial] = (self.clock(), self.expected[key])
        return True

    def forget(self, trial: str) -> None:
        """``trial`` is no longer running."""
        self.checkpoints.pop(trial, None)

    def nothing_more_fits(self, running: list[str]) -> bool:
        """Whether no trial of ``running`` (their ids) is expected to write another checkpoint before the stop
        must begin: each has written one (or started with an estimated epoch: :meth:`started`), and its last one
        plus its last epoch's time falls after :attr:`stop_by`. A running trial with neither (its first epoch under
        way, no estimate) may still write one: then the timer decides."""
        if not running or any(t not in self.checkpoints for t in running):
            return False
        return all(when + epoch_s > self.stop_by for when, epoch_s in (self.checkpoints[t] for t in running))

    def fire(self, why: str) -> None:
        """Stop the sweep once, saying why on stderr."""
        if self.fired:
            return
        self.fired = why
        print(f"\ntime limit: {why}; stopping the sweep as SIGTERM does (its trials' checkpoints are kept)",
              file=sys.stderr, flush=True)
        self.stop()

    def start(self) -> "TimeLimit":
        """Arm the timer that stops the sweep at :attr:`stop_by` whatever the trials are doing."""
        self._timer = threading.Timer(max(0.0, self.stop_by - self.clock()), self.fire,
                                      args=(f"{clock_time(self.stop_at)} is {self.margin_s:.0f} s away",))
        self._timer.daemon = True
        self._timer.start()
        return self

    def cancel(self) -> None:
        """Disarm the timer (the sweep ended on its own)."""
        if self._timer is not None:
            self._timer.cancel()


def clock_time(t: float) -> str:
    """``t`` (``time.time()``) as the local HH:MM:SS."""
    return time.strftime("%H:%M:%S", time.localtime(t))


__all__ = ["STOP_MARGIN_S", "TimeLimit", "TimeLimitError", "clock_time", "parse_duration"]
