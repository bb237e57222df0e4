"""glibc's allocator tuned for tensors freed and reallocated every step (``nmtcore.devices.tune_allocator``): the
same allocation pattern pays page faults without it and none with it; a user's own allocator settings win.

Each case runs in a fresh interpreter: the tuning is process-wide and cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nmtcore.devices import on_glibc

pytestmark = pytest.mark.skipif(not on_glibc(), reason="tune_allocator acts on glibc only")

# 20 times a 64 MiB tensor written and freed (above glibc's largest adaptive mmap threshold, 32 MiB: by default
# each one is a fresh mapping), after 10 untimed ones (a tuned heap takes a few rounds to hold a free block that
# fits the aligned request); prints whether the allocator was tuned and the minor page faults of the 20.
PATTERN = """
import resource, sys
import torch
from nmtcore.devices import tune_allocator
tuned = tune_allocator() if sys.argv[1] == "tune" else False
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
start = faults()
for _ in range(20):
    torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
print(tuned, faults() - start)
"""


def run_pattern(mode: str, **env: str) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], env={**clean, **env}, capture_output=True, text=True,
                         check=True).stdout.split()
    return out[0] == "True", int(out[1])


def test_a_tuned_process_reuses_freed_large_blocks_instead_of_faulting_in_fresh_pages():
    tuned, tuned_faults = run_pattern("tune")
    untuned, default_faults = run_pattern("default")
    assert tuned and not untuned
    pages = 20 * (64 << 20) // 4096  # what 20 fresh 64 MiB mappings fault in (4 KiB pages)
    assert default_faults > pages // 2, default_faults  # glibc as is: every block is new memory
    assert tuned_faults < pages // 20, tuned_faults  # tuned: the heap hands back the block it kept


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                 {"LD_PRELOAD": "/nonexistent/libjemalloc.so"}])
def test_a_users_own_allocator_settings_are_left_alone(env):
    tuned, _ = run_pattern("tune", **env)
    assert not tuned
