"""Provenance: which code, software and machine produced a run, and the one-line reason a run failed."""

from __future__ import annotations

import contextlib
import getpass
import importlib.metadata
import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import Any, Mapping

import nmtcore
from nmtcore.host import cpu_description
from nmtcore.tracking import schema
from nmtcore.tracking.errors import truncate


def provenance_tags(extra: Mapping[str, Any] | None = None,
                    repo_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Tags that say which code and software produced a run.

    ``nmtcore.git_sha`` (when ``repo_dir`` — by default the checkout holding the nmtcore package —
    is a git repository with a commit; also as MLflow's ``mlflow.source.git.commit`` so the UI shows
    it), ``nmtcore.git_dirty`` (``"true"`` if tracked or untracked files differ from HEAD), versions
    of python/torch/nmtcore/sacrebleu/mlflow (read from package metadata: torch is not imported),
    ``nmtcore.hostname``, ``nmtcore.cpu`` (the CPU model, its logical CPUs and widest kernels: which machine a
    figure is from) and ``mlflow.user``. ``extra`` (e.g. data and vocabulary checksums) is
    added last and wins on key clashes; values are stringified.
    """
    tags: dict[str, str] = {
        schema.PYTHON_VERSION: platform.python_version(),
        schema.TORCH_VERSION: _dist_version("torch"),
        schema.NMTCORE_VERSION: getattr(nmtcore, "__version__", "unknown"),
        schema.SACREBLEU_VERSION: _dist_version("sacrebleu"),
        schema.MLFLOW_VERSION: _dist_version("mlflow"),
        schema.HOSTNAME: socket.gethostname(),
        schema.CPU: cpu_description(),
    }
    with contextlib.suppress(Exception):
        tags["mlflow.user"] = getpass.getuser()
    repo = Path(repo_dir) if repo_dir is not None else Path(__file__).resolve().parent
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is not None:
        sha = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD")
        if sha:
            tags[schema.GIT_SHA] = sha
            tags["mlflow.source.git.commit"] = sha
        status = _git(repo, "status", "--porcelain")
        if status is not None:
            tags[schema.GIT_DIRTY] = "true" if status else "false"
    for k, v in (extra or {}).items():
        tags[k] = tag_value(v)
    return tags


def failure_reason(exc: BaseException) -> str:
    """One line for the ``nmtcore.failure_reason`` tag: ``"ValueError: first line of message"``."""
    msg = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
    return truncate(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__, 500)


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git(repo: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def tag_value(value: Any) -> str:
    """A tag or param value as text: sequences in YAML flow style (``[0.9, 0.98]``), which reads well in the
    UI and parses back through ``ExperimentConfig.with_overrides``."""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        import sys

        import yaml

        return yaml.safe_dump(list(value), default_flow_style=True, width=sys.maxsize).strip()
    return str(value)
