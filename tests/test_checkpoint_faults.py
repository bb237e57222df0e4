"""Checkpoint faults: a process killed while writing, corrupt files and mismatched checkpoints never
get loaded; the previous checkpoint stays usable."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from nmtcore.checkpoint import (
    CheckpointError,
    epoch_checkpoints,
    load_checkpoint,
    load_model_weights,
    save_checkpoint,
)
from nmtcore.models import build_model
from nmtcore.testing.synthetic import tiny_experiment

KILL_DURING_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    import nmtcore.checkpoint as ck
    from nmtcore.testing.synthetic import tiny_experiment
    from nmtcore.engine import run_experiment
    from pathlib import Path

    real_save = torch.save
    def dying_save(obj, f, *a, **k):
        if obj.get("train_state", {}).get("epoch") == int(sys.argv[2]):
            real_save(obj, f, *a, **k)
            f.flush()
            f.truncate(f.tell() // 2)          # half the bytes reached the disk...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the process dies mid-write
        return real_save(obj, f, *a, **k)
    ck.torch.save = dying_save
    run_experiment(tiny_experiment(Path(sys.argv[1]), **{"train.max_epochs": 3}))
""")


def test_killed_during_checkpoint_write_keeps_previous_checkpoint(tmp_path):
    r = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(tmp_path), "2"], capture_output=True, timeout=300,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == -9, r.stderr.decode()[-2000:]
    save_dir = tmp_path / "run" / "checkpoints"
    leftovers = [p.name for p in save_dir.iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the killed write should have left its temp file behind"
    assert [p.name for p in epoch_checkpoints(save_dir)] == ["epoch1.pt"]  # the half file is never listed
    assert load_checkpoint(save_dir / "epoch1.pt")["train_state"]["epoch"] == 1

    # Resuming picks epoch 1 and finishes the run.
    from nmtcore.engine import run_experiment

    summary = run_experiment(tiny_experiment(tmp_path, **{"train.max_epochs": 3}))
    assert summary.resumed and summary.epochs == 3


def test_corrupt_or_unverified_checkpoints_are_refused(tmp_path):
    path = save_checkpoint(tmp_path / "epoch1.pt", {"model": {"w": torch.ones(3)}})
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)
    assert epoch_checkpoints(tmp_path) == [path]  # listed (it has a sidecar) but refused on load
    (tmp_path / "epoch2.pt").write_bytes(b"not a checkpoint")  # no sidecar: never listed
    assert epoch_checkpoints(tmp_path) == [path]
    with pytest.raises(CheckpointError, match="no checksum file"):
        load_checkpoint(tmp_path / "epoch2.pt")


def test_pickled_code_is_never_executed(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = save_checkpoint(tmp_path / "evil.pt", {"model": Evil()})
    with pytest.raises(CheckpointError, match="cannot load safely"):
        load_checkpoint(path)


def test_mismatched_checkpoint_names_the_parameter(tmp_path):
    cfg = tiny_experiment(tmp_path)
    small = build_model(cfg.model, 96, 0, 2, 3)
    other_vocab = build_model(cfg.model, 120, 0, 2, 3)
    with pytest.raises(CheckpointError, match=r"src_embed.weight has shape \(120, 64\), model expects \(96, 64\)"):
        load_model_weights(small, other_vocab.state_dict(), "ckpt.pt")
    wider = build_model(cfg.with_overrides({"model.d_model": 128, "model.ffn_dim": 128}).model, 96, 0, 2, 3)
    with pytest.raises(CheckpointError, match="different vocabulary or dimensions"):
        load_model_weights(small, wider.state_dict(), "ckpt.pt")
