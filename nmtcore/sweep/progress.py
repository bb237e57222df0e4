"""A sweep's console: time-stamped lines, and the progress of one long phase (a bar and an ETA where a line
counts units of work, "still running" when it is silent for :data:`HEARTBEAT_S`, how long it took)."""

from __future__ import annotations

import re
import time
from typing import Callable


HEARTBEAT_S = 30.0  # a pre-sweep task silent this long gets a "still running" line on the console


class PhaseProgress:
    """The console of one long phase: its progress lines, with a bar and an ETA where a line counts units
    of work ("step 300/1000", "epoch 2/10"), "still running" when it is silent for :data:`HEARTBEAT_S`, and
    how long it took."""

    UNIT = re.compile(r"\b(step|epoch|update|sentence)s? (\d+)/(\d+)\b")

    def __init__(self, name: str, out: Callable[[str], None] | None = None) -> None:
        self.name = name
        self.out = out or console_line
        self.t0 = time.monotonic()
        self.first: dict[str, tuple[float, int]] = {}  # unit -> (time, count) when first seen
        self.last: tuple[str, int, int] | None = None  # (unit, done, total)
        self.t_last = self.t0  # when ``last`` was seen

    def started(self, where: str) -> None:
        self.out(f"{self.name}: started ({where})")

    def line(self, text: str) -> None:
        m = self.UNIT.search(text)
        if m is None:
            self.out(f"{self.name}: {text}")
            return
        unit, done, total = m.group(1), int(m.group(2)), int(m.group(3))
        self.first.setdefault(unit, (time.monotonic(), done))
        self.last = (unit, done, total)
        self.t_last = time.monotonic()
        eta = "" if "to go" in text else self._eta()
        self.out(f"{self.name}: {self.bar(done, total)} {text}{eta}")

    def heartbeat(self) -> None:
        last = f"; last: {self.last[0]} {self.last[1]}/{self.last[2]}{self._eta()}" if self.last else ""
        self.out(f"{self.name}: still running, {duration(time.monotonic() - self.t0)} elapsed{last}")

    def finished(self) -> None:
        self.out(f"{self.name}: done in {duration(time.monotonic() - self.t0)}")

    @staticmethod
    def bar(done: int, total: int, width: int = 20) -> str:
        frac = min(1.0, done / total) if total else 1.0
        full = int(round(frac * width))
        return f"[{'#' * full}{'.' * (width - full)}] {frac:4.0%}"

    def _eta(self) -> str:
        if self.last is None:
            return ""
        unit, done, total = self.last
        t_first, n_first = self.first[unit]
        if done <= n_first or done >= total:
            return ""
        rate = (self.t_last - t_first) / (done - n_first)  # per unit, between the first and the last line
        left = max(0.0, rate * (total - done) - (time.monotonic() - self.t_last))
        return f" (about {duration(left)} to go)"


def console_line(text: str) -> None:
    """One line of a sweep's console, stamped with the wall-clock time (so a log shows where time went)."""
    print(f"{time.strftime('%H:%M:%S')} {text}", flush=True)


def duration(seconds: float) -> str:
    """``42 s``, ``12.5 min``: how long something took or will take, as the console says it."""
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"
