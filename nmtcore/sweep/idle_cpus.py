"""Idle CPUs lent to running trials: a sweep's last wave does not leave cores idle.

A grid of 5 one-CPU trials on 2 cores runs in waves of 2, 2 and 1; the last trial trains on one thread
while the other core idles (on the main job, ~16 of its ~50 minutes). Fractional CPUs for every trial
(an even share from the start) were measured slower (more workers than cores, memory for all at once).
Instead a running single-worker CPU trial raises its torch threads onto CPUs of its node that no Ray work
holds, shared evenly among the trials running there, and gives them back as soon as Ray hands them to
someone else (a new trial, another sweep's task): Ray's accounting is unchanged, nothing waits on a lent
CPU, and the oversubscription after a CPU is taken lasts at most one check (``every_s``).

A CPU must be seen idle on two checks in a row before it is used: between two trials of a wave it is free
for a few seconds only. Single-node clusters only (a trial cannot tell on a multi-node cluster which free
CPUs are its node's without Ray's private per-node state); GPU and multi-worker trials keep their threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from nmtcore.engine import Callback, Trainer

logger = logging.getLogger(__name__)


def threads_to_use(own: int, total: float, idle: float) -> int:
    """A trial's threads: its ``own`` plus its even share of the ``idle`` CPUs among the trials that hold the
    ``total - idle`` busy ones (each assumed to hold ``own``, as a sweep's trials do)."""
    busy = max(total - idle, float(own))
    running = max(1, round(busy / own))
    return own + int((idle + 1e-9) // running)


class BorrowIdleCpus(Callback):
    """Raises torch's threads onto idle CPUs of the node (see the module docstring); every change is logged
    and counted (``max_threads``)."""

    def __init__(self, probe: Callable[[], tuple[float, float]], every_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``probe()`` says (CPUs of the trial's node, CPUs of it no Ray work holds); (0, 0) turns lending off
        (:func:`nmtcore.sweep.ray_backend.single_node_idle_cpus`)."""
        self.every_s, self.probe, self.clock = every_s, probe, clock
        self.own = 0
        self.max_threads = 0
        self._last = -float("inf")
        self._seen_idle = 0

    def on_train_start(self, trainer: Trainer) -> None:
        self.own = self.max_threads = torch.get_num_threads()
        self.check()

    def on_log(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        self.check()

    def check(self) -> None:
        """Sets torch's threads for what is idle now, at most once per ``every_s``."""
        now = self.clock()
        if not self.own or now - self._last < self.every_s:
            return
        self._last = now
        try:
            total, idle = self.probe()
        except Exception as e:  # the cluster going away must not fail a trial over a speed-up
            logger.debug("idle CPUs: probe failed (%s)", e)
            total, idle = 0.0, 0.0
        share = threads_to_use(self.own, total, idle) if total else self.own
        self._seen_idle = self._seen_idle + 1 if share > self.own else 0
        want = share if self._seen_idle >= 2 else self.own
        if want == torch.get_num_threads():
            return
        torch.set_num_threads(want)
        self.max_threads = max(self.max_threads, want)
        if want > self.own:
            logger.info("%d idle CPU(s) on the node, no trial waiting for them: training on %d threads",
                        want - self.own, want)
        else:
            logger.info("the lent CPU(s) are held again by Ray: back to %d thread(s)", want)
