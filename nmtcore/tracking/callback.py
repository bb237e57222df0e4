"""Feeds one training run into one :class:`~nmtcore.tracking.store.Tracker`: the trainer's callback."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from nmtcore.allocator import allocator_in_use
from nmtcore.bert import bert_layers
from nmtcore.bert.quality import cached_quality
from nmtcore.config import SPEED_ONLY_KEYS
from nmtcore.diagnostics import PREFIX, measure
from nmtcore.engine import Callback
from nmtcore.tracking import schema
from nmtcore.tracking.provenance import provenance_tags
from nmtcore.tracking.runs import get_run_metrics
from nmtcore.tracking.store import Tracker

if TYPE_CHECKING:
    from nmtcore.config import ExperimentConfig
    from nmtcore.engine import RunSummary, Trainer
    from nmtcore.engine.summary import TestScore

STOPPED_BY_TAG = schema.STOPPED_BY
DIAGNOSTICS_FILE = "diagnostics.json"  # a trial's diagnostics whole, beside its diag/ metrics
STOP_METRIC_TAG = schema.STOP_METRIC

def bert_tags(model: Any, cfg: "ExperimentConfig") -> dict[str, str]:
    """What the run's BERT is: its name, where it was found, its size and type, and its quality figure on
    held-out text of the source language (:mod:`nmtcore.bert.quality`) when it has been measured."""
    layers = bert_layers(model)
    if not layers:
        return {}
    bl = layers[0]
    r = bl.resolved
    tags = {schema.BERT: str(r.spec), schema.BERT_RESOLVED: r.name, schema.BERT_SOURCE: r.source,
            schema.BERT_PATH: str(r.path), schema.BERT_LAYERS: str(bl.num_layers),
            schema.BERT_HIDDEN: str(bl.hidden_size), schema.BERT_TYPE: bl.model_type}
    try:
        q = cached_quality(r, cfg.data.src_lang, Path(bl.cfg.cache_dir or cfg.data.resolved_cache_dir()))
    except Exception:  # noqa: BLE001 - a figure we cannot read is a missing figure, not a failed run
        q = None
    if q is not None:
        tags[schema.BERT_QUALITY] = f"{q.figure:.4f}"
        tags[schema.BERT_QUALITY_DETAIL] = q.describe()
    return tags


def test_metrics(split: str, scores: "TestScore") -> dict[str, float]:
    """A test split's scores as the run's metrics (``test/<split>/...``), what a sweep's report reads."""
    return {f"test/{split}/bleu": scores.bleu, f"test/{split}/chrf": scores.chrf, f"test/{split}/bp": scores.bp,
            f"test/{split}/len_ratio": scores.len_ratio,
            **{f"test/{split}/prec{n}": p for n, p in enumerate(scores.precisions, 1)},
            f"test/{split}/sentences_per_s": scores.sentences_per_s}


class TrackingCallback(Callback):
    """Config and provenance at start, update-level training figures (step = update), per-epoch metrics
    (step = epoch), and at the end the test scores, cost figures, hypotheses and a summary JSON."""

    def __init__(self, tracker: Tracker, cfg: "ExperimentConfig") -> None:
        self.tracker, self.cfg = tracker, cfg

    def on_train_start(self, trainer: "Trainer") -> None:
        self.tracker.log_config(self.cfg, changeable=SPEED_ONLY_KEYS)
        tags = {schema.checksum(k): v for k, v in trainer.data.checksums.items()}
        tags.update({schema.MODEL: self.cfg.model.name, schema.CORPUS: self.cfg.data.corpus,
                     schema.LANGS: f"{self.cfg.data.src_lang}-{self.cfg.data.tgt_lang}",
                     schema.DEVICE: str(trainer.device), schema.AMP_DTYPE: str(trainer.amp_dtype),
                     schema.ALLOCATOR: allocator_in_use()})  # step times and memory depend on it
        if hasattr(os, "getpriority"):  # POSIX
            tags[schema.NICE] = str(os.getpriority(os.PRIO_PROCESS, 0))
        tags.update(bert_tags(trainer.model, self.cfg))
        self.tracker.set_tags(provenance_tags(tags))
        if trainer.state.history:  # resumed: the checkpoint may be newer than the run's record
            self.relog_missing_epochs(trainer.state.history)

    def relog_missing_epochs(self, history: list[dict[str, float]]) -> None:
        """Log the epochs of a resumed run's history that the run does not hold yet: a process killed after an
        epoch's checkpoint was written but before its metrics were logged resumes past that epoch, which would
        otherwise be missing from the run for good."""
        logged = {step for step, _ in get_run_metrics(self.tracker.run_id, self.tracker.tracking_uri)
                  .get("valid_loss", [])}
        for metrics in history:
            epoch = int(metrics.get("epoch", 0))
            if epoch and epoch not in logged:
                self.tracker.log_metrics(metrics, step=epoch)

    def on_log(self, trainer: "Trainer", metrics: Mapping[str, float]) -> None:
        self.tracker.log_metrics({f"update/{k}": v for k, v in metrics.items() if k != "num_updates"},
                                 step=int(trainer.state.num_updates))

    def on_epoch_end(self, trainer: "Trainer", epoch: int, metrics: Mapping[str, float],
                     checkpoint: Path | None) -> None:
        self.tracker.log_metrics(metrics, step=epoch)

    def on_train_end(self, trainer: "Trainer", summary: "RunSummary") -> None:
        final: dict[str, float] = {}
        for split, scores in summary.test.items():
            final.update(test_metrics(split, scores))
            self.tracker.log_artifact(scores.hyp_path, artifact_path="hypotheses")
            self.tracker.set_tags({schema.bleu_signature(split): scores.signature})
        figures = {"parameters": summary.parameters, "trainable_parameters": summary.trainable_parameters,
                   "train_tokens_per_s": summary.train_tokens_per_s, "fit_wall_s": summary.fit.fit_wall_s,
                   "num_updates": summary.fit.num_updates, "best_valid_loss": summary.fit.best_valid_loss}
        final.update({f"final/{k}": float(v) for k, v in figures.items() if math.isfinite(float(v))})
        self.tracker.log_metrics(final, step=summary.epochs)
        if summary.warm_start is not None:  # how much of the baseline this run started from
            w = summary.warm_start
            self.tracker.set_tags({schema.WARM_START_SOURCE: w.source, schema.WARM_START_LOADED: w.loaded,
                                   schema.WARM_START_FRESH: w.fresh})
        diagnostics = measure(trainer)  # how it scores and decodes; how much it used BERT (where it has one)
        if diagnostics:
            self.tracker.log_metrics({PREFIX + k: v for k, v in diagnostics.items() if math.isfinite(v)},
                                     step=summary.epochs)
            self.tracker.log_dict(diagnostics, DIAGNOSTICS_FILE)
        self.tracker.set_tags({STOPPED_BY_TAG: summary.fit.stopped_by, STOP_METRIC_TAG: summary.fit.stop_metric})
        self.tracker.log_dict(summary.to_dict(), "summary.json")
