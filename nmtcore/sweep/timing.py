"""Where a sweep's wall-clock time went, phase by phase and session by session.

A sweep measures each phase of its own run (Ray's start, the data, the BERTs, the cost estimate, the shared
baseline, the BERTs' quality figures and feature caches, the trials, the report) and keeps the figures on its
MLflow parent run as ``time_split.json``: one entry per session, so a sweep spread over several sessions with
``--resume`` keeps every session's split. The report prints them beside the estimate made before training;
the console prints the session's split when it ends. While the trials run the entry is rewritten every
:data:`RECORD_EVERY_S` and as each trial ends, so a session killed outright (``kill -9``, a machine's end) keeps
its time up to then, marked as such.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from nmtcore import tracking
from nmtcore.sweep.progress import duration

ARTIFACT = "time_split.json"
RECORD_EVERY_S = 300.0  # how often a running session's entry is rewritten while its trials run


@dataclass
class PhaseClock:
    """The seconds one session of a sweep spent in each phase, in the order the phases began."""

    started: str = field(default_factory=lambda: _dt.datetime.now().astimezone().isoformat(timespec="seconds"))
    seconds: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)
    running: dict[str, float] = field(default_factory=dict)  # phases under way: name -> perf_counter at their start

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as ``name`` (added to what that phase already took this session)."""
        t = self.running[name] = time.perf_counter()
        try:
            yield
        finally:
            del self.running[name]
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def session(self, final: bool = True) -> dict[str, Any]:
        """This session so far: when it started, each phase's seconds (a phase under way: so far) and the wall
        time since the start. ``final=False``: a record taken while it runs (``recorded`` says when), which a
        later record replaces; the last one a killed session wrote stays so marked."""
        now = time.perf_counter()
        seconds = dict(self.seconds)
        for name, t in self.running.items():
            seconds[name] = seconds.get(name, 0.0) + now - t
        entry = {"started": self.started, "phases": seconds, "wall_s": now - self.t0}
        if not final:
            entry["recorded"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
        return entry


def record(parent: tracking.Tracker, clock: PhaseClock, earlier: Sequence[dict[str, Any]],
           final: bool = True) -> list[dict[str, Any]]:
    """Store ``earlier`` sessions and this one as the parent run's ``time_split.json``; returns the sessions.
    ``final=False`` while the session still runs (:meth:`PhaseClock.session`)."""
    sessions = [*earlier, clock.session(final)]
    parent.log_dict({"sessions": sessions}, ARTIFACT)
    return sessions


def read(run_id: str, tracking_uri: str | None) -> list[dict[str, Any]]:
    """The sessions a sweep's parent run recorded (empty for a sweep that recorded none)."""
    with contextlib.suppress(tracking.TrackingError, OSError, ValueError, KeyError):
        return list(json.loads(tracking.read_artifact_text(run_id, ARTIFACT, tracking_uri))["sessions"])
    return []


def describe(sessions: Sequence[dict[str, Any]]) -> list[str]:
    """One line per session (``phase time; ...; wall time``), then the total over sessions when there are
    several. The wall time counts what no phase covers too (opening the MLflow run, Ray's shutdown)."""
    lines = []
    for i, s in enumerate(sessions, 1):
        phases = "; ".join(f"{name} {duration(sec)}" for name, sec in s.get("phases", {}).items())
        started = f"started {s.get('started', '?')}"
        head = f"session {i} ({started})" if len(sessions) > 1 else started
        cut = (f" (ended without its last record: its time up to {s['recorded']}, the last one it wrote)"
               if "recorded" in s else "")
        lines.append(f"{head}: {phases}; wall {duration(float(s.get('wall_s', 0.0)))}{cut}")
    if len(sessions) > 1:
        total = sum(float(s.get("wall_s", 0.0)) for s in sessions)
        lines.append(f"all {len(sessions)} sessions: wall {duration(total)}")
    return lines
