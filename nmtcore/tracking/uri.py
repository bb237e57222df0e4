"""Where runs are stored, resolved the same way in every process (no MLflow import here).

:func:`default_tracking_uri`: ``$MLFLOW_TRACKING_URI`` if set, else a sqlite database
``$NMTCORE_HOME/mlflow.db``, else ``./mlruns-nmtcore/mlflow.db`` resolved against the current directory.
Sqlite paths are always made absolute: MLflow's own default (``sqlite:///mlflow.db``) is relative, and a Ray
trial running in its own working directory then silently writes a fresh empty database there.
"""

from __future__ import annotations

import os
from pathlib import Path

from nmtcore.tracking.errors import TrackingError, one_line

SQLITE_PREFIX = "sqlite:///"


def default_tracking_uri() -> str:
    """Tracking URI used when none is given; sqlite paths are absolute.

    Order: ``$MLFLOW_TRACKING_URI`` (normalised like any URI passed to :class:`Tracker`), else
    ``sqlite:///$NMTCORE_HOME/mlflow.db``, else ``sqlite:///<cwd>/mlruns-nmtcore/mlflow.db``.
    Resolve it once in a driver and pass the result to workers: the last fallback depends on
    the current directory.
    """
    env_uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if env_uri:
        return resolve_tracking_uri(env_uri)
    home = os.environ.get("NMTCORE_HOME", "").strip()
    base = Path(home).expanduser() if home else Path("mlruns-nmtcore")
    return SQLITE_PREFIX + str((base / "mlflow.db").resolve())


def resolve_tracking_uri(uri: str | os.PathLike | None = None) -> str:
    """Normalise a tracking URI: ``None`` → :func:`default_tracking_uri`; a relative sqlite path →
    absolute; a bare path ending in ``.db`` → ``sqlite:///<absolute path>``; other URIs unchanged."""
    if uri is None:
        return default_tracking_uri()
    uri = os.fspath(uri).strip()
    if "://" not in uri and uri.endswith(".db"):
        return SQLITE_PREFIX + str(Path(uri).expanduser().resolve())
    path, query = sqlite_path(uri)
    if path is None or path == ":memory:" or os.path.isabs(path):
        return uri
    return SQLITE_PREFIX + str(Path(path).expanduser().resolve()) + query


def sqlite_path(uri: str) -> tuple[str | None, str]:
    """``sqlite:////abs/x.db?timeout=5`` → ``("/abs/x.db", "?timeout=5")``; non-sqlite → ``(None, "")``."""
    if not uri.startswith(SQLITE_PREFIX):
        return None, ""
    rest = uri[len(SQLITE_PREFIX):]
    path, sep, query = rest.partition("?")
    return path, sep + query


def check_local_store(uri: str) -> Path | None:
    """For a sqlite URI: create the store directory and check it is writable (one-line errors)."""
    path, _ = sqlite_path(uri)
    if path is None or path == ":memory:":
        return None
    db = Path(path)
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = "a file is in the way" if isinstance(e, FileExistsError) else e.strerror or one_line(e)
        raise TrackingError(f"cannot create tracking store directory {db.parent} ({uri}): {why}") from None
    # sqlite also writes a journal next to the database, so the directory must be writable too.
    if not os.access(db.parent, os.W_OK | os.X_OK):
        raise TrackingError(f"tracking store directory {db.parent} is not writable ({uri})")
    if db.exists() and not os.access(db, os.R_OK | os.W_OK):
        raise TrackingError(f"tracking store {db} is not writable ({uri})")
    return db.parent


def is_tracking_server(tracking_uri: str) -> bool:
    """Whether the URI names a tracking server every node can reach (not a local sqlite/file store)."""
    return tracking_uri.split("://", 1)[0].lower() in ("http", "https", "databricks")


def ui_command(tracking_uri: str, port: int = 5000) -> str:
    """The shell command that serves the MLflow UI for a local store on 127.0.0.1 (quick start: one
    worker, no job execution), or the server's own address."""
    if is_tracking_server(tracking_uri):
        return f"open {tracking_uri}"
    return (f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --backend-store-uri {tracking_uri} "
            f"--host 127.0.0.1 --port {port} --workers 1")
