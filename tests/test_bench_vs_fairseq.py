"""bench/vs_fairseq.py's interleaved decoding: the peer's decoder run again (its flags, its threads, its figure read
back), the two sides alternating with the order flipping, the ratios per round."""

from __future__ import annotations

import argparse
import importlib.util
import stat
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def vs_fairseq():
    sys.path.insert(0, str(BENCH))  # it imports decode_speed from bench/
    try:
        spec = importlib.util.spec_from_file_location("bench_vs_fairseq", BENCH / "vs_fairseq.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module


def fake_peer(root: Path, body: str) -> Path:
    """A peer folder whose fairseq-generate is a shell script; it logs its arguments and threads to calls.log."""
    exe = root / "venv_fairseq" / "bin" / "fairseq-generate"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/bash\necho \"$OMP_NUM_THREADS $MKL_NUM_THREADS $*\" >> \"$(dirname \"$0\")/calls.log\"\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return root


GENERATE = ('beam=$(echo "$*" | sed -E "s/.*--beam ([0-9]+).*/\\1/")\n'
            'echo "2026-11-29 00:23:01 | INFO | fairseq_cli.generate | Translated 1,000 sentences (12,226 tokens) in '
            '7.5s ($((600 / beam)).5 sentences/s, 1630.31 tokens/s)" >&2\n')


def test_the_peer_decodes_with_its_flags_and_threads_and_its_speed_is_read(vs_fairseq, tmp_path):
    peer = fake_peer(tmp_path, GENERATE)
    assert vs_fairseq.peer_generate(peer, 5, 2) == 120.5
    assert vs_fairseq.peer_generate(peer, 1, 2) == 600.5
    calls = (peer / "venv_fairseq" / "bin" / "calls.log").read_text().splitlines()
    assert calls[0].startswith("2 2 data/fs-bin --path runs/qual/checkpoint_best.pt --cpu --gen-subset test --beam 5 "
                               "--batch-size 128 --max-len-a 1.2 --max-len-b 10")


def test_a_failing_peer_decoder_stops_the_bench_with_its_output(vs_fairseq, tmp_path):
    peer = fake_peer(tmp_path, 'echo "checkpoint not found" >&2\nexit 3\n')
    with pytest.raises(SystemExit, match=r"exit 3[\s\S]*checkpoint not found"):
        vs_fairseq.peer_generate(peer, 5, 2)


def test_rounds_alternate_the_order_and_the_ratio_is_the_median_of_the_rounds(vs_fairseq, tmp_path, monkeypatch):
    peer = fake_peer(tmp_path, GENERATE)  # fairseq: 120.5 beam 5, 600.5 greedy, every round
    ours = iter([241.0, 361.5, 301.25])  # beam-5 sentences/s of nmtcore's three fresh processes
    log = peer / "venv_fairseq" / "bin" / "calls.log"
    order = []

    def decode_fresh(args, precision, echo=True):
        order.append(("nmtcore", len(log.read_text().splitlines()) if log.exists() else 0))
        assert precision == "auto" and not echo
        return {"qual_beam5": {"sent_per_s": next(ours)}, "qual_greedy": {"sent_per_s": 900.75}}

    monkeypatch.setattr(vs_fairseq, "decode_fresh", decode_fresh)
    args = argparse.Namespace(peer_dir=str(peer), decode_rounds=3, threads=2)
    got = vs_fairseq.interleaved_decoding(args, "auto")
    # fairseq's two decodes before nmtcore's in rounds 1 and 3, after it in round 2
    assert order == [("nmtcore", 2), ("nmtcore", 2), ("nmtcore", 6)]
    assert len(log.read_text().splitlines()) == 6
    assert got["beam5_sent_per_s"] == pytest.approx(2.5)  # median of 2.0, 3.0, 2.5
    assert (got["beam5_min"], got["beam5_max"]) == (pytest.approx(2.0), pytest.approx(3.0))
    assert got["greedy_sent_per_s"] == pytest.approx(900.75 / 600.5)


def test_each_precision_is_benchmarked_in_a_process_of_its_own(vs_fairseq):
    """Several precisions: the script runs itself once per precision with that precision alone and its own output
    folder, the rest of the command line kept."""
    argv = ["--data-dir", "d", "--precisions", "auto,fp32", "--out=o", "--skip-qual"]
    assert vs_fairseq.with_option(argv, "--precisions", "fp32") == ["--data-dir", "d", "--out=o", "--skip-qual",
                                                                    "--precisions", "fp32"]
    assert vs_fairseq.with_option(vs_fairseq.with_option(argv, "--precisions", "auto"), "--out", "o/auto") == [
        "--data-dir", "d", "--skip-qual", "--precisions", "auto", "--out", "o/auto"]
    assert vs_fairseq.with_option(["--x"], "--out", "o") == ["--x", "--out", "o"]
