"""``bench/faults.py`` (the reliability table of docs/reliability.md) runs and reports what it saw: three of its
cases, each a real ``nmtcore`` process, in a few seconds each."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_fault_table_runs_its_cases_and_checks_them():
    r = subprocess.run([sys.executable, str(REPO / "bench" / "faults.py"), "--only", "lr-zero", "config-dir",
                        "eval-uneven"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    assert [row.split(" | ")[0].strip("| ") for row in rows] == ["lr-zero", "config-dir", "eval-uneven"]
    assert "| 2 | nmtcore: error: train.lr: must be > 0, got 0.0 | nothing written |" in rows[0]
    assert "3 cases, 0 ended otherwise than expected" in r.stdout
