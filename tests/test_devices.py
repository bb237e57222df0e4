"""``nmtcore.devices``: which precision a CPU gets, and the warning when bf16 is forced where it is slow."""

from __future__ import annotations

import logging

import pytest
import torch

from nmtcore import devices


@pytest.fixture
def cpu_bf16(monkeypatch: pytest.MonkeyPatch):
    """Set whether the CPU reports bf16 matrix instructions; the once-per-process warning starts fresh."""
    def set_support(supported: bool) -> None:
        monkeypatch.setattr(devices, "cpu_supports_bf16", lambda: supported)
        devices._warn_slow_cpu_bf16.cache_clear()
    yield set_support
    devices._warn_slow_cpu_bf16.cache_clear()


def test_auto_takes_bf16_only_where_the_cpu_has_bf16_instructions(cpu_bf16, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="nmtcore.devices")
    cpu_bf16(True)
    assert devices.autocast_dtype("auto", "cpu") is torch.bfloat16
    assert devices.autocast_dtype("bf16", "cpu") is torch.bfloat16
    cpu_bf16(False)
    assert devices.autocast_dtype("auto", "cpu") is None
    assert devices.autocast_dtype("fp32", "cpu") is None
    assert not caplog.records  # nothing forced bf16 where it is slow


def test_forcing_bf16_on_a_cpu_without_it_keeps_bf16_and_warns_once(cpu_bf16, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="nmtcore.devices")
    cpu_bf16(False)
    assert devices.autocast_dtype("bf16", "cpu") is torch.bfloat16  # the user's choice stands
    assert devices.autocast_dtype("bf16", "cpu") is torch.bfloat16
    warned = [r for r in caplog.records if "precision=bf16" in r.getMessage()]
    assert len(warned) == 1 and "precision=auto" in warned[0].getMessage()
