"""A Ray worker stopped by SIGTERM while Python runs a weakref callback (the sweep's interrupt test once failed on
exactly this: "Exception ignored in: <function WeakSet...>", a traceback from Ray's SIGTERM handler, and a worker
that went on). Ray's handler is stood in for by one that raises ``SystemExit`` as it does; no cluster (~1 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# The signal arrives inside a weakref callback, and the handler runs there (the loop in the callback gives the
# interpreter a place to run it); the module then loops for a long time and says so if it got past the loop.
WORKER = """
import os, signal, sys, weakref

def sigterm_handler(signum, frame):  # as a Ray worker's: SystemExit wherever the main thread is
    sys.exit(1)

signal.signal(signal.SIGTERM, sigterm_handler)
if sys.argv[1] == "quiet":
    from nmtcore.sweep.ray_backend.cluster import exit_quietly_on_sigterm
    exit_quietly_on_sigterm()
    exit_quietly_on_sigterm()  # twice, as a reused actor calls it: one hook

class Held:
    pass

def on_collected(ref):
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(100_000):
        pass

held = Held()
ref = weakref.ref(held, on_collected)
del held
for _ in range(30_000_000):
    pass
print("went on after SIGTERM", flush=True)
"""


@pytest.mark.parametrize("mode", ["quiet", "python's default"])
def test_sigterm_inside_a_weakref_callback_stops_the_worker_without_a_traceback(mode):
    proc = subprocess.run([sys.executable, "-c", WORKER, mode.split()[0]], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    if mode == "quiet":
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert proc.stderr == "" and proc.stdout == ""
    else:  # what the hook is for: Python prints the SystemExit it cannot raise, and the process goes on
        assert "Exception ignored in" in proc.stderr and "Traceback" in proc.stderr
        assert "went on after SIGTERM" in proc.stdout and proc.returncode == 0


def test_other_unraisable_errors_are_still_printed():
    code = WORKER.split("class Held")[0] + """
class Broken:
    def __del__(self):
        raise ValueError("a finalizer's own error")

Broken()
print("went on", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code, "quiet"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "went on" in proc.stdout
    assert "Exception ignored in" in proc.stderr and "a finalizer's own error" in proc.stderr
