"""Checkpoint files: atomic writes, checksum-verified safe loads, averaging.

A checkpoint is one ``torch.save`` file holding only tensors and plain containers (so it loads with
``torch.load(weights_only=True)``: no arbitrary pickle), plus a ``.sha256`` sidecar written after it.
A write goes to a temporary file in the same directory, is fsync'ed, then renamed into place, and the
sidecar is renamed last: a killed writer leaves either the previous pair or an orphan temp file, never
a file that verifies. Loading refuses a file whose checksum does not match.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from nmtcore.files import atomic_file, atomic_write_bytes, sha256_file


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not match the model it is loaded into."""


def save_checkpoint(path: Path, payload: dict[str, Any]) -> Path:
    """Atomically save ``payload`` to ``path`` and its checksum to ``path.sha256``."""
    path = Path(path)
    with atomic_file(path) as tmp:
        with open(tmp, "wb") as f:
            torch.save(payload, f)
        digest = sha256_file(tmp, memo=False)
    atomic_write_bytes(path.with_name(path.name + ".sha256"), f"{digest}  {path.name}\n".encode())
    return path


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint`, verifying its checksum first."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    sidecar = path.with_name(path.name + ".sha256")
    if not sidecar.is_file():
        raise CheckpointError(f"{path}: no checksum file {sidecar.name} (incomplete write?)")
    expected = sidecar.read_text().split()[0] if sidecar.read_text().strip() else ""
    actual = sha256_file(path, memo=False)
    if actual != expected:
        raise CheckpointError(f"{path}: checksum mismatch (corrupt or partially written checkpoint)")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refuses anything but tensors and plain containers
        # torch's message is a page of advice on how to load it anyway; only its reason belongs here.
        reason = next((line.split(_WO_REASON, 1)[1] for line in str(e).splitlines() if _WO_REASON in line), str(e))
        raise CheckpointError(f"{path}: cannot load safely (it holds more than tensors and plain containers; "
                              f"unpickling it could run code): {_first_sentence(reason)}") from e
    except Exception as e:  # a file whose sidecar matches but is not a whole torch.save archive
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated, or not written by "
                              f"torch.save?): {_first_sentence(str(e))}") from e


_WO_REASON = "WeightsUnpickler error:"


def _first_sentence(text: str) -> str:
    """The first sentence of an exception message, without terminal colour codes."""
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines() if line.strip()]
    return lines[0].split(". ")[0].rstrip(".") if lines else "unknown error"


def epoch_checkpoints(save_dir: Path) -> list[Path]:
    """Epoch checkpoints with a checksum sidecar, oldest first."""
    found = []
    for p in Path(save_dir).glob("epoch*.pt"):
        m = re.fullmatch(r"epoch(\d+)\.pt", p.name)
        if m and p.with_name(p.name + ".sha256").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint and its checksum sidecar (the sidecar first, so no checksum outlives its file)."""
    path.with_name(path.name + ".sha256").unlink(missing_ok=True)  # sidecar first: never a verifiable orphan
    path.unlink(missing_ok=True)


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """Element-wise mean of the model weights of ``paths`` (floating tensors; others from the last)."""
    if not paths:
        raise CheckpointError("average_checkpoints: no checkpoints given")
    states = [load_checkpoint(p)["model"] for p in paths]
    keys = set(states[0])
    for p, s in zip(paths, states):
        if set(s) != keys:
            raise CheckpointError(f"{p}: parameter names differ from {paths[0]}; cannot average")
    out = {}
    for k in states[-1]:
        if states[-1][k].is_floating_point():
            out[k] = torch.stack([s[k].double() for s in states]).mean(0).to(states[-1][k].dtype)
        else:
            out[k] = states[-1][k]
    return out


def load_model_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model`` strictly, with a one-line error naming the first mismatch."""
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise CheckpointError(f"{source}: parameter names do not match the model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise CheckpointError(f"{source}: {k} has shape {tuple(v.shape)}, model expects "
                                  f"{tuple(own[k].shape)} (different vocabulary or dimensions?)")
    model.load_state_dict(state)
