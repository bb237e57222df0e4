"""The C allocator under nmtcore's processes (:mod:`nmtcore.allocator`).

glibc's allocator tuned for tensors freed and reallocated every step (``tune_allocator``): the same allocation
pattern pays page faults without it and none with it; a user's own allocator settings win. The allocator a
training process is started on (``NMTCORE_ALLOCATOR``, preloaded): the choice is resolved or refused in one line,
a process re-executes itself once on it, a user's own preload wins. (A sweep's trials and ``nmtcore train``
tag the allocator they ran on: tests/test_sweep.py, tests/test_cli.py.)

Each case runs in a fresh interpreter: the tuning and the preload are process-wide and cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nmtcore.allocator import AllocatorError, find_library, on_glibc, preload_env, resolve_allocator

pytestmark = pytest.mark.skipif(not on_glibc(), reason="tune_allocator acts on glibc only")

# 20 times a 64 MiB tensor written and freed (above glibc's largest adaptive mmap threshold, 32 MiB: by default
# each one is a fresh mapping), after 10 untimed ones (a tuned heap takes a few rounds to hold a free block that
# fits the aligned request); prints whether the allocator was tuned and the minor page faults of the 20.
PATTERN = """
import resource, sys
import torch
from nmtcore.allocator import tune_allocator
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
    # Tuned: the heap hands back the block it kept. Now and then one of the 20 is a fresh block (the heap's top
    # taken by another allocation): 16384 faults in 2 of 12 runs on a 2-core Intel machine (2026-11-28), 0 in
    # the others; four blocks' worth still tells this apart from the untuned twenty.
    assert tuned_faults < pages // 5, tuned_faults


@pytest.mark.parametrize("env", [{"MALLOC_MMAP_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"},
                                 {"LD_PRELOAD": "/nonexistent/libjemalloc.so"}])
def test_a_users_own_allocator_settings_are_left_alone(env):
    tuned, _ = run_pattern("tune", **env)
    assert not tuned


# ------------------------------------------------------------------------------------- preloading (training)
def _loaded(soname: str) -> str:
    """Path of a library this process has mapped (it exists on this machine)."""
    for line in open("/proc/self/maps", encoding="utf-8"):
        if line.rstrip().endswith("/" + soname):
            return line.split()[-1]
    pytest.skip(f"{soname} is not mapped in this process")


REEXEC = """
import os, sys
from nmtcore.allocator import allocator_in_use, reexec_with_allocator
print("start", flush=True)
reexec_with_allocator()
print(os.environ.get("LD_PRELOAD", ""), allocator_in_use(), sys.argv[1:], flush=True)
"""


def run_reexec(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "NMTCORE_ALLOCATOR")}
    return subprocess.run([sys.executable, "-c", REEXEC, "a b", "--x"], env={**clean, **env}, capture_output=True,
                          text=True, check=True, timeout=120).stdout.splitlines()


def test_a_choice_is_resolved_to_a_library_or_refused_in_one_line(tmp_path):
    assert resolve_allocator("system") is None
    assert resolve_allocator("auto") == find_library("tcmalloc")  # None where it is not installed
    libm = _loaded("libm.so.6")
    assert resolve_allocator(libm) == libm
    with pytest.raises(AllocatorError, match="unknown allocator 'tcmaloc'"):
        resolve_allocator("tcmaloc")
    with pytest.raises(AllocatorError, match="does not exist"):
        resolve_allocator(str(tmp_path / "libnothing.so"))
    for name in ("tcmalloc", "jemalloc"):
        if find_library(name) is None:
            with pytest.raises(AllocatorError, match=f"'{name}' is not installed here .*apt install"):
                resolve_allocator(name)
        else:
            assert resolve_allocator(name) == find_library(name)


def test_the_preload_keeps_other_preloads_and_a_users_own_allocator_wins():
    libm = _loaded("libm.so.6")
    assert preload_env(libm, env={}) == {"LD_PRELOAD": libm}
    assert preload_env(libm, env={"LD_PRELOAD": "/opt/libtrace.so"}) == {"LD_PRELOAD": f"{libm} /opt/libtrace.so"}
    assert preload_env(libm, env={"LD_PRELOAD": "/opt/libjemalloc.so.2"}) == {}
    assert preload_env("system", env={}) == {}


def test_a_process_reexecutes_itself_once_on_the_chosen_library_with_its_arguments():
    libm = _loaded("libm.so.6")  # any library shows the mechanics
    out = run_reexec(NMTCORE_ALLOCATOR=libm)
    assert out[0] == "start" and out[1] == "start", out  # printed by the process, then by its re-executed self
    assert out[2] == f"{libm} system ['a b', '--x']", out  # once, with the same arguments
    assert run_reexec(NMTCORE_ALLOCATOR="system") == ["start", " system ['a b', '--x']"]
    # The user's own preload is left as it is: no re-execution.
    own = run_reexec(NMTCORE_ALLOCATOR=libm, LD_PRELOAD="/nonexistent/libjemalloc.so")
    assert own[0] == "start" and own[1].startswith("/nonexistent/libjemalloc.so system"), own


@pytest.mark.skipif(find_library("tcmalloc") is None, reason="tcmalloc is not installed (apt install libtcmalloc-minimal4)")
def test_auto_starts_the_process_on_tcmalloc_where_it_is_installed():
    out = run_reexec()
    assert out[:2] == ["start", "start"] and out[2].split()[1] == "tcmalloc", out


def test_a_sweep_refuses_a_bad_choice_and_gives_its_training_processes_what_applies(monkeypatch):
    from nmtcore.sweep.settings import SweepError, SweepSettings

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("NMTCORE_ALLOCATOR", raising=False)
    libm = _loaded("libm.so.6")
    with pytest.raises(SweepError, match="unknown allocator 'tcmaloc'"):
        SweepSettings(name="x", storage="/tmp", allocator="tcmaloc")
    assert SweepSettings(name="x", storage="/tmp", allocator=libm).worker_env() == {"LD_PRELOAD": libm}
    assert SweepSettings(name="x", storage="/tmp", allocator="system").worker_env() == {}
    tcmalloc = find_library("tcmalloc")
    assert SweepSettings(name="x", storage="/tmp").worker_env() == ({"LD_PRELOAD": tcmalloc} if tcmalloc else {})
    # A joined cluster: this machine's libraries say nothing of the nodes' unless the choice is explicit.
    assert SweepSettings(name="x", storage="/tmp", address="10.0.0.1:6379").worker_env() == {}
    assert SweepSettings(name="x", storage="/tmp", address="10.0.0.1:6379", allocator=libm).worker_env() == \
        {"LD_PRELOAD": libm}
    monkeypatch.setenv("NMTCORE_ALLOCATOR", "system")
    assert SweepSettings(name="x", storage="/tmp").worker_env() == {}
    monkeypatch.setenv("LD_PRELOAD", "/opt/libjemalloc.so.2")  # the user's own: the local cluster inherits it
    assert SweepSettings(name="x", storage="/tmp", allocator=libm).worker_env() == {}
