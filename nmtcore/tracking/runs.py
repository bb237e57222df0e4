"""Runs already in the store: reading them back (:class:`RunRecord`: params, metrics, tags; searches; artifacts)
and editing them from outside a run (ending a stale run, tags, artifacts, an experiment's tags and the UI's
shared views), with the MLflow UI's tag names and the helpers the writer (:mod:`nmtcore.tracking.store`)
shares. With the store, the only modules of nmtcore that import MLflow."""

from __future__ import annotations


import base64
import contextlib
import json
import logging
import os
import socket
import sqlite3
import tempfile
import threading
import time
import uuid
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, Iterator, Mapping, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_METRICS_PER_BATCH, MAX_TAG_VAL_LENGTH

from nmtcore.interrupts import uninterrupted
from nmtcore.tracking import schema
from nmtcore.tracking.errors import TrackingError, one_line, truncate
from nmtcore.tracking.provenance import tag_value
from nmtcore.tracking.uri import resolve_tracking_uri, sqlite_path




logger = logging.getLogger(__name__)


T = TypeVar("T")


FAILURE_REASON_TAG = schema.FAILURE_REASON


PARENT_RUN_TAG = "mlflow.parentRunId"  # what the MLflow UI nests child runs by


END_STATUSES = ("FINISHED", "FAILED", "KILLED")


DEFAULT_EXPERIMENT = "nmtcore"


# What the MLflow UI (3.17) reads from tags. A run's or an experiment's description is Markdown in
# NOTE_TAG; the experiment kind is what the UI's own kind selector writes (the landing tab follows the
# URL's workflowType instead, see experiment_url); a shared view (runs table columns, sort, filter and
# charts) is an experiment tag SHARED_VIEW_PREFIX + key opened by the URL parameter viewStateShareKey=key.
NOTE_TAG = "mlflow.note.content"


EXPERIMENT_KIND_TAG = "mlflow.experimentKind"


MODEL_TRAINING_KIND = "custom_model_development"


SHARED_VIEW_PREFIX = "mlflow.sharedViewState."


# Serialises temporary MLflow environment overrides (_env_override); re-entrant so they may nest.
_ENV_LOCK = threading.RLock()


@contextlib.contextmanager
def _env_override(values: Mapping[str, str]) -> Iterator[None]:
    """Set MLflow environment knobs (read per call) for the duration of a block, then restore them.

    Process-wide: an MLflow call from another thread during the block sees them too.
    """
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _fail_fast_http(timeout_s: float) -> contextlib.AbstractContextManager[None]:
    """One attempt, bounded time: MLflow's defaults (7 retries, backoff factor 2, 120 s timeout)
    would hang for minutes on a dead server before the first epoch. Mid-run calls keep the
    user's retry settings."""
    return _env_override({"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
                          "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(round(timeout_s))))})


# --------------------------------------------------------------------------------- read helpers
@dataclass(frozen=True)
class RunRecord:
    """A run as plain data: latest metric values, params and tags as strings."""

    run_id: str
    run_name: str
    experiment_id: str
    status: str
    start_time: int | None  # ms since the epoch
    end_time: int | None
    artifact_uri: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)

    @property
    def parent_run_id(self) -> str | None:
        return self.tags.get(PARENT_RUN_TAG)


def load_runs(experiment: str = DEFAULT_EXPERIMENT, tracking_uri: str | os.PathLike | None = None,
              filter_string: str = "", parent_run_id: str | None = None) -> list[RunRecord]:
    """All runs of ``experiment``, oldest first; optionally only children of ``parent_run_id``.

    ``filter_string`` uses MLflow's search syntax (``"params.`model.name` = 'transformer'"``).
    A missing experiment gives ``[]``; a missing sqlite store raises (reading must not create one).
    """
    with _reader(tracking_uri) as client:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            return []
        filters = [f for f in (filter_string.strip(),) if f]
        if parent_run_id is not None:
            filters.append(f"tags.`{PARENT_RUN_TAG}` = '{parent_run_id}'")
        runs: list[RunRecord] = []
        token = None
        while True:
            page = client.search_runs([exp.experiment_id], filter_string=" and ".join(filters),
                                      order_by=["attributes.start_time ASC"], page_token=token)
            runs.extend(_record(r) for r in page)
            token = page.token
            if not token:
                return runs


def get_run(run_id: str, tracking_uri: str | os.PathLike | None = None) -> RunRecord:
    """One run by id."""
    with _reader(tracking_uri) as client:
        return _record(client.get_run(run_id))


def get_run_metrics(run_id: str, tracking_uri: str | os.PathLike | None = None,
                    keys: Collection[str] | None = None) -> dict[str, list[tuple[int, float]]]:
    """Full metric histories of a run (of ``keys`` only, where given): ``{"valid.bleu": [(step, value), ...]}``
    sorted by step.

    A step logged twice (e.g. re-run after a resume) appears twice, in logging order.
    """
    with _reader(tracking_uri) as client:
        run = client.get_run(run_id)
        out: dict[str, list[tuple[int, float]]] = {}
        for key in sorted(k for k in run.data.metrics if keys is None or k in keys):
            hist = sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp))
            out[key] = [(int(m.step), float(m.value)) for m in hist]
        return out


def list_artifacts(run_id: str, tracking_uri: str | os.PathLike | None = None) -> list[str]:
    """All artifact file paths of a run, recursively, sorted (``["config.yaml", "hyps/test.de"]``)."""
    with _reader(tracking_uri) as client:
        files: list[str] = []
        pending: list[str | None] = [None]
        while pending:
            for info in client.list_artifacts(run_id, pending.pop()):
                (pending if info.is_dir else files).append(info.path)
        return sorted(files)


def read_artifact_text(run_id: str, artifact_file: str, tracking_uri: str | os.PathLike | None = None) -> str:
    """The text of one artifact file (downloaded to a temporary directory)."""
    # No tqdm bar on stderr for a one-file read.
    with _reader(tracking_uri) as client, tempfile.TemporaryDirectory() as tmp, \
            _env_override({"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}):
        local = client.download_artifacts(run_id, artifact_file, tmp)
        return Path(local).read_text(encoding="utf-8")


def search_runs(filter_string: str, tracking_uri: str | os.PathLike | None = None) -> list[RunRecord]:
    """Runs of every active experiment matching MLflow's ``filter_string``, oldest first."""
    with _reader(tracking_uri) as client:
        exp_ids = [e.experiment_id for e in client.search_experiments()]
        runs: list[RunRecord] = []
        token = None
        while exp_ids:
            page = client.search_runs(exp_ids, filter_string=filter_string,
                                      order_by=["attributes.start_time ASC"], page_token=token)
            runs.extend(_record(r) for r in page)
            token = page.token
            if not token:
                break
        return runs


def terminate_run(run_id: str, status: str, tracking_uri: str | os.PathLike | None = None,
                  reason: str | None = None, tags: Mapping[str, Any] | None = None,
                  only_if_running: bool = True) -> bool:
    """End a run from outside the process that trained in it (a sweep driver cleaning up after a
    stopped or crashed trial): set ``tags`` and the one-line ``reason``, then the status. With
    ``only_if_running`` a run that already ended keeps its status. Returns whether it was ended."""
    if status not in END_STATUSES:
        raise ValueError(f"status must be one of {', '.join(END_STATUSES)}, got {status!r}")
    uri = resolve_tracking_uri(tracking_uri)
    with _reader(uri) as client:
        run = client.get_run(run_id)
        if only_if_running and run.info.status != "RUNNING":
            return False
        all_tags = {k: truncate(tag_value(v), MAX_TAG_VAL_LENGTH) for k, v in (tags or {}).items()}
        if reason:
            all_tags[FAILURE_REASON_TAG] = truncate(" ".join(reason.split()), 500)
        if all_tags:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in all_tags.items()], synchronous=True)
        client.set_terminated(run_id, status)
        return True


def set_run_tags(run_id: str, tags: Mapping[str, Any], tracking_uri: str | os.PathLike | None = None) -> None:
    """Set tags on any run by id (values stringified and truncated)."""
    with _reader(tracking_uri) as client:
        client.log_batch(run_id, tags=[RunTag(k, truncate(tag_value(v), MAX_TAG_VAL_LENGTH))
                                       for k, v in tags.items()], synchronous=True)


def log_run_metrics(run_id: str, metrics: Mapping[str, float], step: int,
                    tracking_uri: str | os.PathLike | None = None) -> None:
    """Log metrics at ``step`` in any run by id, without touching its status (test sets decoded after a sweep)."""
    with _reader(tracking_uri) as client:
        for batch in metric_batches(metrics, step):
            client.log_batch(run_id, metrics=batch, synchronous=True)


def metric_batches(metrics: Mapping[str, float], step: int) -> Iterator[list[Metric]]:
    """``metrics`` at ``step``, timestamped now, keys checked, in batches MLflow's ``log_batch`` takes."""
    now = int(time.time() * 1000)
    entities = []
    for key, value in metrics.items():
        _check_key(key)
        entities.append(Metric(key, float(value), now, int(step)))
    return _chunks(entities, MAX_METRICS_PER_BATCH)


def log_run_artifacts(run_id: str, paths: list[str | os.PathLike], artifact_path: str | None = None,
                      tracking_uri: str | os.PathLike | None = None) -> None:
    """Copy local files into any run's artifacts by id, without touching its status (reports added to a
    finished sweep's parent run)."""
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"artifact {path} does not exist")
    with _reader(tracking_uri) as client:
        for path in paths:
            client.log_artifact(run_id, os.fspath(path), artifact_path)


def set_experiment_tags(experiment_id: str, tags: Mapping[str, Any],
                        tracking_uri: str | os.PathLike | None = None) -> None:
    """Set tags on an experiment (values stringified and truncated to MLflow's limit)."""
    with _reader(tracking_uri) as client:
        for key, value in tags.items():
            _check_key(key)
            client.set_experiment_tag(experiment_id, key, truncate(tag_value(value), MAX_TAG_VAL_LENGTH))


def get_experiment_tags(experiment_id: str, tracking_uri: str | os.PathLike | None = None) -> dict[str, str]:
    """An experiment's tags."""
    with _reader(tracking_uri) as client:
        return dict(client.get_experiment(experiment_id).tags)


def set_shared_view(experiment_id: str, key: str, state: Mapping[str, Any],
                    tracking_uri: str | os.PathLike | None = None) -> None:
    """Store a runs-page view (``selectedColumns``, ``orderByKey``, ``searchFilter``, ``compareRunCharts``...)
    that :func:`experiment_url` with ``view=key`` opens. Plain JSON, or the UI's ``deflate;`` + base64 zlib
    form when the JSON is longer than a tag holds."""
    text = json.dumps(dict(state), separators=(",", ":"))
    if len(text) > MAX_TAG_VAL_LENGTH:
        text = "deflate;" + base64.b64encode(zlib.compress(text.encode())).decode()
    if len(text) > MAX_TAG_VAL_LENGTH:
        raise ValueError(f"shared view {key!r} is too large for an MLflow tag ({len(text)} characters)")
    set_experiment_tags(experiment_id, {SHARED_VIEW_PREFIX + key: text}, tracking_uri)


def quote(value: str) -> str:
    """A value quoted for MLflow's search syntax."""
    return value.replace("'", "\\'")


# ------------------------------------------------------------------------------------- internals
@contextlib.contextmanager
def _reader(tracking_uri: str | os.PathLike | None) -> Iterator[MlflowClient]:
    """A client for reading (and the module's few writes); MLflow errors become one-line :class:`TrackingError`s
    naming the URI. A stopping signal waits for the block (:func:`nmtcore.interrupts.uninterrupted`): cut short, a
    sqlite transaction can keep the store locked."""
    uri = resolve_tracking_uri(tracking_uri)
    path, _ = sqlite_path(uri)
    if path is not None and path != ":memory:" and not os.path.exists(path):
        raise TrackingError(f"no tracking store at {path} ({uri})")
    ensure_sqlite_schema(uri)
    with uninterrupted():
        try:
            yield MlflowClient(uri)
        except (MlflowException, OSError) as e:
            raise TrackingError(f"cannot read from {uri}: {one_line(e)}") from None


def _record(run: Any) -> RunRecord:
    info, data = run.info, run.data
    return RunRecord(run_id=info.run_id, run_name=info.run_name or "", experiment_id=info.experiment_id,
                     status=info.status, start_time=info.start_time, end_time=info.end_time,
                     artifact_uri=info.artifact_uri, params=dict(data.params),
                     metrics=dict(data.metrics), tags=dict(data.tags))


def _is_transient(e: BaseException) -> bool:
    # OSError covers requests' ConnectionError/Timeout; MLflow maps exhausted HTTP retries, 5xx
    # answers and sqlite "database is locked" (TEMPORARILY_UNAVAILABLE) to status codes >= 500.
    if isinstance(e, OSError):
        return True
    return isinstance(e, MlflowException) and e.get_http_status_code() >= 500


def _check_key(key: str) -> None:
    # Truncating keys could merge two params into one; better to refuse.
    if not key or len(key) > MAX_ENTITY_KEY_LENGTH:
        raise ValueError(f"MLflow key must have 1..{MAX_ENTITY_KEY_LENGTH} characters, got {key[:60]!r}"
                         f" ({len(key)} characters)")


def _chunks(items: list[T], size: int) -> Iterator[list[T]]:
    for i in range(0, len(items), size):
        yield items[i: i + size]


# ---------------------------------------------------------------------------------- sqlite schema
def ensure_sqlite_schema(tracking_uri: str) -> None:
    """Give a sqlite tracking URI a complete MLflow schema; other URIs are left alone.

    MLflow creates a missing database's tables in place, one migration after another, over several seconds;
    a process killed in between leaves a database that holds part of them, and MLflow then fails on it for
    good (``table _alembic_tmp_... already exists``). Here a missing database is built under a temporary
    name in the same directory and hard-linked to its real name only when complete: a kill leaves either
    no store or a whole one. Two processes creating it at once each build their own; the first link wins
    and the other discards its copy. An existing database that an interrupted creation left half-made
    (before this was done here) is reported in one line, with what it holds, instead of MLflow's traceback.
    """
    path, query = sqlite_path(tracking_uri)
    if path is None or path == ":memory:":
        return
    db = Path(path)
    if db.exists():
        _check_complete(db, tracking_uri)
        return
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    _remove_dead_drafts(db)
    draft = db.with_name(f"{_draft_prefix(db)}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    draft_uri = f"sqlite:///{draft}{query}"
    try:
        store = SqlAlchemyStore(draft_uri, str(db.parent / "artifacts"))
        store.engine.dispose()
        getattr(SqlAlchemyStore, "_engine_map", {}).pop(draft_uri, None)  # MLflow caches one engine per URI
        try:
            os.link(draft, db)
        except FileExistsError:
            pass  # another process linked its complete copy first
        except OSError:  # a filesystem without hard links: a rename, which can only lose a same-instant race
            if not db.exists():
                os.replace(draft, db)
    finally:
        for leftover in (draft, draft.with_name(draft.name + "-journal")):
            leftover.unlink(missing_ok=True)


def _draft_prefix(db: Path) -> str:
    return f".{db.name}.creating-"


def _remove_dead_drafts(db: Path) -> None:
    """Drafts that a killed process of this host left behind (a live process's, or another host's, stay)."""
    mine = f"{_draft_prefix(db)}{socket.gethostname()}-"
    for draft in db.parent.glob(f"{mine}*"):
        pid = draft.name[len(mine):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            draft.unlink(missing_ok=True)
        except PermissionError:
            pass  # alive, another user's


def _check_complete(db: Path, tracking_uri: str) -> None:
    try:
        with contextlib.closing(sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=30)) as con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return  # an empty file: MLflow creates the schema (a store made before this function existed)
            scratch = sorted(t for t in tables if t.startswith("_alembic_tmp_"))
            if not scratch and "alembic_version" in tables:
                return
            runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] if "runs" in tables else 0
    except sqlite3.DatabaseError as e:
        raise TrackingError(f"tracking store {db} is not a readable sqlite database ({tracking_uri}): "
                            f"{one_line(e)}") from None
    why = f"table {scratch[0]} is a migration's scratch table" if scratch else "it has no schema version"
    advice = ("it holds no runs: delete it and run again" if runs == 0 else
              f"it holds {runs} runs: copy it aside, then try `mlflow db upgrade {tracking_uri}`")
    raise TrackingError(f"tracking store {db} was left half-made by an interrupted schema creation ({why}); "
                        f"{advice}")
