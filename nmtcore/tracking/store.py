"""The MLflow store's writer, :class:`Tracker`; with :mod:`nmtcore.tracking.runs` (reading runs back, editing
them from outside a run) the only modules of nmtcore that import MLflow.

A :class:`Tracker` wraps exactly one MLflow run through :class:`mlflow.MlflowClient` with explicit run ids,
never MLflow's global "active run" stack, so several trackers (a sweep's parent run and its trial runs, or
two trainings in one test) coexist in one process. Everything the rest of nmtcore needs (start, resume,
log, end, read back, search) is here; callers never touch MLflow objects and only see
:class:`~nmtcore.tracking.errors.TrackingError`. Where runs are stored: :mod:`nmtcore.tracking.uri`.
Artifacts of experiments created here go next to a sqlite database (``<db dir>/artifacts``), not into
MLflow's default ``./mlruns`` of whatever directory the first run happened to start in. The file store
(``file:./mlruns``) is in maintenance mode in MLflow 3 and is not used. Create a new sqlite store from one
process (the sweep driver's parent run does it) before parallel trials open it: creating its schema takes
seconds and is not meant to run concurrently. A new sqlite store's schema is built in a file beside it and
linked into place when complete (:func:`~nmtcore.tracking.runs.ensure_sqlite_schema`), so a process killed
while it is made (a SIGTERM in a sweep's first seconds) leaves no store rather than a half-made one that
every later run fails on.

Failure policy — tracking is part of the experiment's record, so:

* **at start** (constructing a :class:`Tracker`) every problem is fatal and fast: an unreachable
  server fails after one attempt (no retry back-off; ``start_timeout_s`` bounds a hanging
  connection) and an unwritable store directory fails before MLflow touches it, each with a
  one-line :class:`TrackingError` naming the URI or path;
* **mid-run**, MLflow first retries transient HTTP errors itself (``MLFLOW_HTTP_REQUEST_*``
  settings); a call that still fails with a transient error (connection error, HTTP 5xx, sqlite
  "database is locked") is logged as a warning and counted in :attr:`Tracker.failed_calls`
  instead of killing hours of training. ``strict=True`` makes those raise too. Errors that are the
  caller's fault (e.g. a resumed run logging a *different* value for an existing param) always raise.
"""

from __future__ import annotations


import contextlib
import logging
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, TypeVar

from mlflow import MlflowClient
from mlflow.entities import Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.validation import (
    MAX_PARAM_VAL_LENGTH,
    MAX_PARAMS_TAGS_PER_BATCH,
    MAX_TAG_VAL_LENGTH,
)

from nmtcore.interrupts import uninterrupted
from nmtcore.tracking import schema
from nmtcore.tracking.errors import TrackingError, one_line, truncate
from nmtcore.tracking.provenance import failure_reason, tag_value
from nmtcore.tracking.uri import check_local_store, resolve_tracking_uri
from nmtcore.tracking.runs import (
    DEFAULT_EXPERIMENT,
    END_STATUSES,
    FAILURE_REASON_TAG,
    PARENT_RUN_TAG,
    _check_key,
    _chunks,
    _fail_fast_http,
    _is_transient,
    ensure_sqlite_schema,
    metric_batches,
)


if TYPE_CHECKING:
    from nmtcore.config import ExperimentConfig


logger = logging.getLogger(__name__)


T = TypeVar("T")


# ---------------------------------------------------------------------------------------- Tracker
class Tracker:
    """One MLflow run: start (or re-attach), log config/metrics/artifacts/tags, end.

    The run starts in the constructor, so a dead tracking server or unwritable store fails before
    any training work. Use as a context manager: leaving the block normally ends the run FINISHED;
    an exception ends it FAILED (``KeyboardInterrupt``: KILLED; ``SystemExit(0)``: FINISHED) with the
    one-line reason in the tag ``nmtcore.failure_reason``, and the exception propagates.

    Args:
        tracking_uri: MLflow tracking URI or ``.db`` path; ``None`` = :func:`default_tracking_uri`.
        experiment: experiment name, created if missing (artifacts next to a sqlite store).
            Ignored when ``parent_run_id`` or ``run_id`` is given (the run's experiment is used).
        run_name: display name of a new run (MLflow invents one if ``None``).
        parent_run_id: nest the new run under this run (tag ``mlflow.parentRunId``), created in the
            parent's experiment so the UI can nest it.
        run_id: re-attach to this existing run instead of creating one (resume after a crash); a
            terminated run is set back to RUNNING.
        tags: tags set at start, e.g. :func:`provenance_tags` plus data/vocabulary checksums.
        strict: raise on transient mid-run logging failures instead of warning (see module doc).
        start_timeout_s: bound on each HTTP request made while starting.
    """

    def __init__(self, tracking_uri: str | os.PathLike | None = None, experiment: str = DEFAULT_EXPERIMENT,
                 run_name: str | None = None, parent_run_id: str | None = None, run_id: str | None = None,
                 tags: Mapping[str, Any] | None = None, *, strict: bool = False,
                 start_timeout_s: float = 10.0) -> None:
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.strict = strict
        self.failed_calls = 0  # transient mid-run failures swallowed (strict=False)
        self._ended = False
        self.resumed = run_id is not None
        store_dir = check_local_store(self.tracking_uri)
        run = None
        try:
            ensure_sqlite_schema(self.tracking_uri)
            with _fail_fast_http(start_timeout_s), uninterrupted():
                self._client = MlflowClient(self.tracking_uri)
                if run_id is not None:
                    run = self._reattach(run_id)
                else:
                    run = self._create(experiment, run_name, parent_run_id, tags, store_dir)
        except TrackingError:
            raise
        except (MlflowException, OSError) as e:
            raise TrackingError(f"cannot start MLflow run at {self.tracking_uri}: {one_line(e)}") from None
        except KeyboardInterrupt:  # stopped while the run was being started: no caller will end it, so end it here
            if run is not None:
                with contextlib.suppress(MlflowException, OSError):
                    self._client.set_terminated(run.info.run_id, "KILLED")
            raise
        self._run_id: str = run.info.run_id
        self.experiment_id: str = run.info.experiment_id
        self.artifact_uri: str = run.info.artifact_uri
        if run_id is not None and tags:
            self.set_tags(tags)

    def _create(self, experiment: str, run_name: str | None, parent_run_id: str | None,
                tags: Mapping[str, Any] | None, store_dir: Path | None) -> Any:
        all_tags = {k: tag_value(v) for k, v in (tags or {}).items()}
        if parent_run_id is not None:
            parent = self._get_run_or_fail(parent_run_id, "parent run")
            experiment_id = parent.info.experiment_id
            all_tags[PARENT_RUN_TAG] = parent_run_id
        else:
            experiment_id = self._experiment_id(experiment, store_dir)
        return self._client.create_run(experiment_id, tags=all_tags, run_name=run_name)

    def _reattach(self, run_id: str) -> Any:
        run = self._get_run_or_fail(run_id, "run")
        if run.info.lifecycle_stage == "deleted":
            raise TrackingError(f"run {run_id} is deleted in {self.tracking_uri}; restore it or start a new run")
        if run.info.status != "RUNNING":
            self._client.update_run(run_id, status="RUNNING")
        if FAILURE_REASON_TAG in run.data.tags:  # the previous attempt's reason is stale now
            self._client.delete_tag(run_id, FAILURE_REASON_TAG)
        attach = int(run.data.tags.get(schema.ATTACH_COUNT, "0") or 0) + 1
        self._client.set_tag(run_id, schema.ATTACH_COUNT, str(attach))
        return run

    def _get_run_or_fail(self, run_id: str, what: str) -> Any:
        try:
            return self._client.get_run(run_id)
        except MlflowException as e:
            if e.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise TrackingError(f"{what} {run_id} not found in {self.tracking_uri}") from None
            raise

    def _experiment_id(self, name: str, store_dir: Path | None) -> str:
        exp = self._client.get_experiment_by_name(name)
        if exp is None:
            location = str(store_dir / "artifacts") if store_dir is not None else None
            try:
                return self._client.create_experiment(name, artifact_location=location)
            except MlflowException as e:
                # Another process (a parallel trial) created it between our lookup and create.
                if e.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                exp = self._client.get_experiment_by_name(name)
                if exp is None:
                    raise
        if exp.lifecycle_stage == "deleted":
            raise TrackingError(f"experiment {name!r} is deleted in {self.tracking_uri}; "
                                "restore it or use another name")
        return exp.experiment_id

    # ----------------------------------------------------------------------- properties & context
    @property
    def run_id(self) -> str:
        """The MLflow run id (store it in checkpoints to re-attach on resume)."""
        return self._run_id

    @property
    def ended(self) -> bool:
        """Whether :meth:`end` has been called."""
        return self._ended

    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._ended:
            return False
        # sys.exit(0) inside the block is a normal end (e.g. an entry script's --smoke-test).
        if exc is None or (isinstance(exc, SystemExit) and exc.code in (0, None)):
            self.end("FINISHED")
            return False
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        try:
            self.set_tags({FAILURE_REASON_TAG: failure_reason(exc)})
            self.end(status)
        except Exception as e:  # never mask the exception that ended the run
            logger.warning("could not mark MLflow run %s %s: %s", self._run_id, status, one_line(e))
        return False

    def __repr__(self) -> str:
        return f"Tracker(run_id={self._run_id!r}, tracking_uri={self.tracking_uri!r})"

    # ----------------------------------------------------------------------------------- logging
    def log_config(self, cfg: "ExperimentConfig", changeable: Collection[str] = ()) -> None:
        """Log every config field as a dotted param (``train.lr``) and the YAML as ``config.yaml``.

        Sequences are logged in YAML flow style (``[0.9, 0.98]``), which reads well in the UI and
        parses back through ``ExperimentConfig.with_overrides``; values longer than MLflow's limit
        are truncated in the param (the artifact keeps them whole).

        A re-attached run (a resume) keeps the params it was logged with. A key of ``changeable`` (settings that
        change no result: :data:`nmtcore.config.SPEED_ONLY_KEYS`) whose value differs now is recorded in the tag
        ``nmtcore.changed_on_resume`` instead; any other difference is a one-line :class:`TrackingError`.
        """
        params = {k: truncate(tag_value(v), MAX_PARAM_VAL_LENGTH) for k, v in cfg.flat().items()}
        if self.resumed:
            data = self._get_run_or_fail(self._run_id, "run").data
            changed = {k: (data.params[k], v) for k, v in params.items() if k in data.params and data.params[k] != v}
            refused = sorted(k for k in changed if k not in changeable)
            if refused:
                k = refused[0]
                raise TrackingError(f"run {self._run_id} was logged with {k}={changed[k][0]}, and this attempt has "
                                    f"{k}={changed[k][1]}: a resumed run keeps the config it started with "
                                    f"({len(refused)} such key(s): {', '.join(refused)})")
            if changed:
                earlier = data.tags.get(schema.CHANGED_ON_RESUME, "")
                now = "; ".join(f"{k}: {old} -> {new}" for k, (old, new) in sorted(changed.items()))
                self.set_tags({schema.CHANGED_ON_RESUME: f"{earlier}; {now}" if earlier else now})
                params = {k: v for k, v in params.items() if k not in changed}
        self.log_params(params)
        self.log_text(cfg.to_yaml(), "config.yaml")

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log params (immutable in MLflow: re-logging the same value is fine, a new value raises)."""
        entities = []
        for key, value in params.items():
            _check_key(key)
            entities.append(Param(key, truncate(tag_value(value), MAX_PARAM_VAL_LENGTH)))
        for batch in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._call("log params", self._client.log_batch, self._run_id, params=batch, synchronous=True)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log scalar metrics at ``step`` (use the epoch or update number, stable across resumes)."""
        for batch in metric_batches(metrics, step):
            self._call("log metrics", self._client.log_batch, self._run_id, metrics=batch, synchronous=True)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        """Set run tags (values stringified and truncated to MLflow's limit)."""
        entities = []
        for key, value in tags.items():
            _check_key(key)
            entities.append(RunTag(key, truncate(tag_value(value), MAX_TAG_VAL_LENGTH)))
        for batch in _chunks(entities, MAX_PARAMS_TAGS_PER_BATCH):
            self._call("set tags", self._client.log_batch, self._run_id, tags=batch, synchronous=True)

    def log_text(self, text: str, artifact_file: str) -> None:
        """Store ``text`` as the artifact ``artifact_file`` (e.g. ``"hyps/test.de"``)."""
        self._call("log text", self._client.log_text, self._run_id, text, artifact_file)

    def log_dict(self, d: Mapping[str, Any], artifact_file: str) -> None:
        """Store a dict as a JSON (``.json``) or YAML (``.yaml``/``.yml``) artifact."""
        self._call("log dict", self._client.log_dict, self._run_id, dict(d), artifact_file)

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Copy a local file into the run's artifacts (under ``artifact_path`` if given)."""
        if not os.path.exists(path):
            raise FileNotFoundError(f"artifact {path} does not exist")
        self._call("log artifact", self._client.log_artifact, self._run_id, os.fspath(path), artifact_path)

    def end(self, status: str = "FINISHED") -> None:
        """Terminate the run with ``FINISHED``, ``FAILED`` or ``KILLED``; later calls do nothing."""
        if status not in END_STATUSES:
            raise ValueError(f"status must be one of {', '.join(END_STATUSES)}, got {status!r}")
        if self._ended:
            return
        self._call("end run", self._client.set_terminated, self._run_id, status)
        self._ended = True

    def child(self, run_name: str | None = None, tags: Mapping[str, Any] | None = None) -> "Tracker":
        """Start a run nested under this one, in the same store and experiment."""
        return Tracker(self.tracking_uri, run_name=run_name, parent_run_id=self._run_id, tags=tags,
                       strict=self.strict)

    def _call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        try:
            with uninterrupted():  # a stopping signal waits for the write: cut short, it can leave the store locked
                return fn(*args, **kwargs)
        except (MlflowException, OSError) as e:
            if self.strict or not _is_transient(e):
                raise TrackingError(f"MLflow {what} failed for run {self._run_id} at {self.tracking_uri}: "
                                    f"{one_line(e)}") from e
            self.failed_calls += 1
            logger.warning("MLflow %s failed for run %s (%s); training continues", what, self._run_id,
                           one_line(e))
            return None
