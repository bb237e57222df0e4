"""Experiment tracking: where runs are stored (:mod:`~nmtcore.tracking.uri`), the MLflow store — its writer
(:mod:`~nmtcore.tracking.store`) and its readers (:mod:`~nmtcore.tracking.runs`), the only modules importing
MLflow — every tag name (:mod:`~nmtcore.tracking.schema`), provenance, and the trainer's callback
(:mod:`nmtcore.tracking.callback`, imported on its own: it pulls in the trainer)."""

from nmtcore.tracking.errors import TrackingError
from nmtcore.tracking.provenance import failure_reason, provenance_tags
from nmtcore.tracking.runs import (END_STATUSES, FAILURE_REASON_TAG, PARENT_RUN_TAG, RunRecord, get_run,
                                   get_run_metrics, list_artifacts, load_runs, log_run_artifacts, log_run_metrics,
                                   read_artifact_text, search_runs, set_run_tags, terminate_run)
from nmtcore.tracking.store import Tracker
from nmtcore.tracking.uri import default_tracking_uri, is_tracking_server, resolve_tracking_uri, ui_command

__all__ = ["END_STATUSES", "FAILURE_REASON_TAG", "PARENT_RUN_TAG", "RunRecord", "Tracker", "TrackingError",
           "default_tracking_uri", "failure_reason", "get_run", "get_run_metrics", "is_tracking_server",
           "list_artifacts", "load_runs", "log_run_artifacts", "log_run_metrics", "provenance_tags",
           "read_artifact_text", "resolve_tracking_uri", "search_runs", "set_run_tags", "terminate_run", "ui_command"]
