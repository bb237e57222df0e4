"""bench/all.py's plumbing: each step's figures, log and load; the peer's failure; bad arguments."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "all.py"


@pytest.fixture(scope="module")
def bench_all():
    spec = importlib.util.spec_from_file_location("bench_all", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_step_keeps_its_figure_lines_once_its_log_and_its_own_cpu(bench_all, tmp_path):
    body = ("print('RESULT plm_sponsored: sentences/s vs baseline=0.28 (bar >= 0.5)'); print('progress 10%'); "
            "import time; t = time.process_time()\n"
            "while time.process_time() - t < 1.0: pass\n"
            "print('RESULT plm_sponsored: sentences/s vs baseline=0.28 (bar >= 0.5)'); "
            "print('  \"overhead_per_trial_frac\": 0.195,')")
    step = bench_all.run_step("decode_speed", [sys.executable, "-c", body], {"X": "1"}, tmp_path)
    assert step["exit"] == 0 and step["env"] == {"X": "1"}
    # Figures are whole lines: a line of a bench's indented JSON is not one (sweep_overhead prints a RESULT line).
    assert step["figures"] == ["RESULT plm_sponsored: sentences/s vs baseline=0.28 (bar >= 0.5)"]
    assert "progress 10%" in (tmp_path / "decode_speed.log").read_text()
    # The child's second of CPU is counted as the step's own (one thread: at most a core), not as others'.
    assert step["own_cores"] * step["wall_s"] >= 0.9 and step["own_cores"] <= 1.2, step
    assert step["others_cores"] >= 0


def test_a_failed_peer_skips_the_comparison_and_the_run_fails(tmp_path):
    peer = tmp_path / "peer.sh"
    peer.write_text("echo 'peer=fairseq-0.12.2 run=thr train_tgt_tok_per_s=1'; exit 3\n")
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, str(SCRIPT), "--data-dir", str(data), "--out", str(out), "--steps",
                          "peer,vs_fairseq", "--peer-script", str(peer)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "vs_fairseq: skipped, the peer failed" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["peer"] and summary["steps"][0]["exit"] == 3
    assert summary["steps"][0]["figures"] == ["peer=fairseq-0.12.2 run=thr train_tgt_tok_per_s=1"]
    assert "| peer | 3 |" in (out / "summary.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--steps", "peer,nope"], "--steps: unknown nope"),
    (["--steps", "vs_fairseq"], "vs_fairseq needs the peer's figures"),
    (["--peer-log", "/nonexistent/peer.log"], "--peer-log: no file"),
    (["--peer-script", "/nonexistent/peer.sh"], "--peer-script: no file"),
])
def test_bad_arguments_are_refused_naming_the_option(tmp_path, args, message):
    run = subprocess.run([sys.executable, str(SCRIPT), "--data-dir", str(tmp_path), *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_the_bert_step_bench_alternates_each_change_and_prints_its_ratio(shared_data, tmp_path):
    """``bench/bert_step.py`` on BERT-JAM's phase 3 (a fine-tuned MiniLM), one block of one small update each way:
    a RESULT line per change; unknown cases or changes are one-line errors."""
    script = SCRIPT.parent / "bert_step.py"
    run = subprocess.run([sys.executable, str(script), "--data-dir", str(shared_data), "--threads", "1",
                          "--cases", "bert_jam_ft", "--block", "1", "--rounds", "1", "--max-tokens", "300"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    results = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert [line.split(":")[0] for line in results] == ["RESULT bert_jam_ft dropout", "RESULT bert_jam_ft cast",
                                                         "RESULT bert_jam_ft glu_bmm"]
    assert all(0.2 < float(line.split("=")[1].split()[0]) < 5 for line in results), results
    bad = subprocess.run([sys.executable, str(script), "--cases", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown nope" in bad.stderr
