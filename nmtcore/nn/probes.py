"""Probes the diagnostics run over a model's validation pass (:meth:`nmtcore.models.NMTModel.usage_probe`): how a
joint attention (:func:`~nmtcore.nn.layers.attend_parts`) divides its probability mass among the parts of its keys.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

from torch import Tensor, nn


class PartShares:
    """The mean attention mass each named part of a joint attention's keys receives, over the real query positions
    (every head and every tapped layer weighs the same). A module whose attention calls ``attend_parts(...,
    tap=self.tap)`` is tapped by :func:`tapping`; the real queries of the forward under way are set by
    :meth:`set_queries` (a model's forward pre-hook), and only forwards whose query length matches them count
    (teacher-forced passes, not incremental decoding steps)."""

    def __init__(self, names: Iterable[str]) -> None:
        self.names = tuple(names)
        self.sums = [0.0] * len(self.names)
        self.count = 0  # (query, head, layer) entries
        self.real: Tensor | None = None  # (B, Tq) bool: the queries that count

    def set_queries(self, real: Tensor) -> None:
        """The real (not padding) query positions of the next forwards, (B, Tq) bool."""
        self.real = real

    def __call__(self, masses: list[Tensor]) -> None:
        """``attend_parts``' tap: one (B, H, Tq) mass per part, in the order of :attr:`names`."""
        if len(masses) != len(self.names):
            raise ValueError(f"PartShares: {len(masses)} parts tapped, {len(self.names)} named ({self.names})")
        real = self.real
        if real is None or real.shape != (masses[0].size(0), masses[0].size(2)):
            return
        keep = real[:, None, :].expand_as(masses[0])  # (B, H, Tq)
        for i, m in enumerate(masses):
            self.sums[i] += float(m[keep].sum())
        self.count += int(keep.sum())

    def shares(self, prefix: str) -> dict[str, float]:
        """``{prefix/name: mean mass}`` (the shares sum to 1); nothing when no query counted."""
        if not self.count:
            return {}
        return {f"{prefix}/{name}": total / self.count for name, total in zip(self.names, self.sums)}


@contextlib.contextmanager
def tapping(modules: Iterable[nn.Module], tap: PartShares) -> Iterator[PartShares]:
    """Set ``module.tap = tap`` on each of ``modules`` for the block (their attention hands ``attend_parts`` its
    tap), and back to None after it."""
    modules = list(modules)
    for m in modules:
        m.tap = tap
    try:
        yield tap
    finally:
        for m in modules:
            m.tap = None


__all__ = ["PartShares", "tapping"]
