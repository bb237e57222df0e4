"""Shared test fixtures: tiny configs for every registered model and hand-built batches."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NMTCORE_NO_PROGRESS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

PAD, BOS, EOS = 0, 2, 3


def shared_data_dir() -> Path:
    """The team's shared data directory ($NMTCORE_DATA or ../shared/data); skips the test if absent."""
    d = Path(os.environ.get("NMTCORE_DATA", SHARED_DATA))
    if not (d / "multi30k").is_dir():
        pytest.skip(f"shared data not found at {d}")
    return d


@pytest.fixture
def deadline():
    """Fail (never hang) a test that runs past 15 minutes: SIGALRM interrupts Tune's loop."""
    def fire(signum, frame):
        raise TimeoutError("sweep hung for 15 minutes")

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(900)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def make_batch(src: list[list[int]], tgt: list[list[int]]):
    """A right-padded Batch from token lists (without bos/eos)."""
    from nmtcore.data import Batch

    def pad(rows, prefix, suffix):
        rows = [prefix + r + suffix for r in rows]
        width = max(len(r) for r in rows)
        t = torch.full((len(rows), width), PAD, dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r)] = torch.tensor(r)
        return t

    s = pad(src, [], [EOS])
    ti, to = pad(tgt, [BOS], []), pad(tgt, [], [EOS])
    return Batch(src=s, src_mask=s.eq(PAD), tgt_in=ti, tgt_out=to, tgt_mask=to.eq(PAD),
                 ids=torch.arange(len(src)), extras={})


@pytest.fixture
def small_batch():
    g = torch.Generator().manual_seed(0)
    lens_s, lens_t = [5, 3, 7], [4, 6, 2]
    src = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lens_s]
    tgt = [torch.randint(4, 40, (n,), generator=g).tolist() for n in lens_t]
    return make_batch(src, tgt)
