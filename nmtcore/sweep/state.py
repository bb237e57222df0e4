"""The record a sweep leaves beside its Tune experiment so that ``--resume`` continues it as it started: the
space and model, the parent MLflow run, the tracking store, the seeds and the whole base config.

Versioned (:data:`FORMAT`): a state file written by a newer nmtcore, or a damaged one, is refused with one
line saying which, never half-read. Files from before the version field (format 0) hold the same fields and
are read as format 1.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nmtcore.config import ConfigError, ExperimentConfig
from nmtcore.files import atomic_write_text
from nmtcore.sweep.settings import SweepError

STATE_FILE = "nmtcore_sweep.json"
# Written when a new sweep begins, before its shared work: a sweep stopped before its trials (while the BERTs,
# their features or the baseline were made) has no state yet, and ``--resume`` then starts it again.
STARTED_FILE = "nmtcore_sweep.started.json"
FORMAT = 1  # bump when a field changes meaning; read older formats explicitly in ResumeState.read
_FIELDS = ("space", "model", "parent_run_id", "tracking_uri", "seeds", "base")


@dataclass(frozen=True)
class ResumeState:
    """What a resumed sweep continues with."""

    space: str
    model: str
    parent_run_id: str
    tracking_uri: str
    seeds: int
    base: ExperimentConfig

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, "space": self.space, "model": self.model,
                           "parent_run_id": self.parent_run_id, "tracking_uri": self.tracking_uri,
                           "seeds": self.seeds, "base": self.base.to_dict()}, indent=1)

    def write(self, exp_dir: str | Path) -> Path:
        """Write (atomically) ``exp_dir``/:data:`STATE_FILE`; returns its path."""
        path = Path(exp_dir) / STATE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, self.to_json() + "\n")
        return path

    @classmethod
    def read(cls, path: str | Path) -> "ResumeState":
        """The state in ``path``; a one-line :class:`SweepError` for a damaged file, a newer format or a field
        missing."""
        path = Path(path)
        try:
            raw: Any = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SweepError(f"{path}: the sweep's state cannot be read ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); start the sweep again under a new --name")
        if not isinstance(raw, dict):
            raise SweepError(f"{path}: the sweep's state is not a JSON object")
        version = raw.get("format", 0)
        if not isinstance(version, int) or version > FORMAT:
            raise SweepError(f"{path}: state format {version!r} is newer than this nmtcore reads ({FORMAT}): "
                             "resume it with the version that started it")
        missing = [k for k in _FIELDS if k not in raw and k != "model"]
        if missing:
            raise SweepError(f"{path}: the sweep's state lacks {', '.join(missing)}")
        try:
            base = ExperimentConfig.from_dict(raw["base"])
        except (ConfigError, TypeError, ValueError) as e:
            raise SweepError(f"{path}: the sweep's base config no longer loads: {str(e).splitlines()[0]}") from None
        return cls(space=str(raw["space"]), model=str(raw.get("model") or ""), parent_run_id=str(raw["parent_run_id"]),
                   tracking_uri=str(raw["tracking_uri"]), seeds=int(raw["seeds"]), base=base)


def mark_started(exp_dir: str | Path, space: str) -> None:
    """Record that sweep ``exp_dir`` (of ``space``) began: a ``--resume`` before its trials then starts it
    again instead of finding nothing to resume."""
    path = Path(exp_dir) / STARTED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"space": space}) + "\n")


def started_space(exp_dir: str | Path) -> str | None:
    """The space of the sweep that began at ``exp_dir`` (:func:`mark_started`), or None: never begun here, or a
    marker that cannot be read."""
    try:
        raw = json.loads((Path(exp_dir) / STARTED_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return str(raw["space"]) if isinstance(raw, dict) and "space" in raw else None
