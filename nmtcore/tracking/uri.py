"""Where runs are stored, resolved the same way in every process, and where a browser finds them in the MLflow
UI (no MLflow import here).

:func:`default_tracking_uri`: ``$MLFLOW_TRACKING_URI`` if set, else a sqlite database
``$NMTCORE_HOME/mlflow.db``, else ``./mlruns-nmtcore/mlflow.db`` resolved against the current directory.
Sqlite paths are always made absolute: MLflow's own default (``sqlite:///mlflow.db``) is relative, and a Ray
trial running in its own working directory then silently writes a fresh empty database there.
"""

from __future__ import annotations

import json
import os
import tempfile
import urllib.parse
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
    # sqlite also writes a journal next to the database, so the directory must be writable too. Probed with a
    # real file (removed at once): as root, permission bits say nothing (/proc, read-only mounts).
    try:
        with tempfile.NamedTemporaryFile(dir=db.parent, prefix=".nmtcore-probe-"):
            pass
    except OSError:
        raise TrackingError(f"tracking store directory {db.parent} is not writable ({uri})") from None
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


# ------------------------------------------------------------------------ the MLflow UI's addresses
def ui_address(tracking_uri: str, port: int = 5000) -> str:
    """Where a browser finds the MLflow UI of ``tracking_uri``: the server itself, or the local ``mlflow ui``
    that :func:`~nmtcore.tracking.uri.ui_command` starts (127.0.0.1, ``port``)."""
    if tracking_uri.split("://", 1)[0].lower() in ("http", "https"):
        return tracking_uri.rstrip("/")
    return f"http://127.0.0.1:{port}"


def experiment_url(experiment_id: str, view: str | None = None, charts: bool = False) -> str:
    """The UI route (``#/...``, relative to :func:`ui_address`) of an experiment's runs table, as a model
    training experiment (MLflow 3.17 opens every experiment on its GenAI overview unless the URL says
    ``workflowType=machine_learning``), with the shared view ``view`` and its charts if asked."""
    query = {**({"viewStateShareKey": view} if view else {}), **({"compareRunsMode": "CHART"} if charts else {}),
             "workflowType": "machine_learning"}
    return f"#/experiments/{experiment_id}/runs?{urllib.parse.urlencode(query, quote_via=urllib.parse.quote)}"


def compare_url(experiment_id: str, run_ids: list[str]) -> str:
    """The UI route of the compare view of ``run_ids`` (params, metrics and plots side by side)."""
    runs = urllib.parse.quote(json.dumps(list(run_ids), separators=(",", ":")))
    return f"#/compare-runs?runs={runs}&experiments={urllib.parse.quote(json.dumps([experiment_id]))}"


def run_url(experiment_id: str, run_id: str, artifact: str | None = None) -> str:
    """The UI route of a run's page (as a model-training run), or of one of its artifacts (rendered: images,
    Markdown, HTML...)."""
    page = f"#/experiments/{experiment_id}/runs/{run_id}"
    return f"{page}/artifacts/{artifact}" if artifact else f"{page}?workflowType=machine_learning"


def artifact_src(run_id: str, artifact: str) -> str:
    """A URL, relative to :func:`ui_address`, that serves one artifact file (for images in a Markdown note)."""
    return "get-artifact?" + urllib.parse.urlencode({"path": artifact, "run_uuid": run_id})
