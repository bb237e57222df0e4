"""One experiment end to end: its BERT made sure of, data prepared, the registered model built, trained
(resuming if checkpoints exist), the test sets decoded and scored; the result is a typed :class:`RunSummary`.

:func:`build_trainer` is the one way a :class:`~nmtcore.engine.trainer.Trainer` is assembled from a config
(used by :func:`run_experiment`, the benches and the tests alike).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Sequence

import torch

from nmtcore import bleu
from nmtcore.bert import ensure_bert
from nmtcore.config import ExperimentConfig
from nmtcore.data import PreparedData, prepare_data
from nmtcore.engine.shared_phases import PhaseShare
from nmtcore.engine.summary import RunSummary, TestScore, WarmStartSummary
from nmtcore.engine.trainer import Callback, Trainer
from nmtcore.engine.warm_start import warm_start
from nmtcore.models import build_model, prepare_model_resources


def setup_torch(cfg: ExperimentConfig) -> None:
    """Threads and the global seed (dropout, initialisation) as ``cfg.train`` says."""
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.train.seed)


def build_trainer(cfg: ExperimentConfig, data: PreparedData | None = None, callbacks: Sequence[Callback] = (),
                  device: torch.device | None = None) -> Trainer:
    """Seed torch, prepare the data (unless given), run the model's own preprocessing, build the registered
    model and its trainer. ``cfg``'s BERT must exist already (:func:`nmtcore.bert.ensure_bert`)."""
    setup_torch(cfg)
    data = data or prepare_data(cfg.data)
    cfg = prepare_model_resources(cfg, data)  # the model class's own preprocessing (none for most)
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
    return Trainer(cfg, model, data, list(callbacks), device)


def run_experiment(cfg: ExperimentConfig, callbacks: Sequence[Callback] = (), resume: bool = True,
                   device: torch.device | None = None, data: PreparedData | None = None,
                   phase_share: PhaseShare | None = None) -> RunSummary:
    """Prepare data, build the registered model, train (resuming if checkpoints exist; else, with a
    ``phase_share``, starting where another run's first phases ended if they are this run's; else warm-starting
    from ``train.init_from`` if set), then decode every test split with ``cfg.decode`` and score it."""
    cfg = ensure_bert(cfg)  # resolve (or make here) the experiment's BERT before the model is built
    trainer = build_trainer(cfg, data, callbacks, device)
    cfg, data, model = trainer.cfg, trainer.data, trainer.model
    resumed = trainer.resume() if resume else False
    shared = trainer.start_shared(phase_share) if phase_share is not None else False
    warm = None
    if cfg.train.init_from and not resumed and not shared:
        loaded = warm_start(model, cfg.train.init_from, cfg, data.vocab)
        warm = WarmStartSummary(source=cfg.train.init_from, loaded=len(loaded.loaded), fresh=len(loaded.fresh))
    fit = trainer.fit()
    summary = RunSummary(fit=fit, resumed=resumed, final_model=trainer.finalize_model(),
                         parameters=model.num_parameters(), trainable_parameters=model.num_parameters(trainable=True),
                         train_tokens_per_s=trainer.train_tokens_per_s, warm_start=warm)
    hyp_dir = Path(cfg.output_dir).resolve() / "hyps"
    hyp_dir.mkdir(parents=True, exist_ok=True)
    for name in cfg.data.test_splits:
        split = data.splits[name]
        t0 = time.perf_counter()
        hyps = trainer.translate(split)
        wall = time.perf_counter() - t0
        path = hyp_dir / f"{name}.{cfg.data.tgt_lang}"
        path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        summary.test[name] = score_test(hyps, list(split.raw_tgt), path, wall)
    for cb in callbacks:
        cb.on_train_end(trainer, summary)
    return summary


def score_test(hyps: list[str], refs: list[str], hyp_path: Path, decode_wall_s: float) -> TestScore:
    """A test split's decode scored: sacreBLEU BLEU (its brevity penalty, length ratio and precisions) and chrF."""
    b = bleu.corpus_bleu(hyps, refs)
    return TestScore(bleu=b.score, chrf=bleu.corpus_chrf(hyps, refs).score, signature=b.signature,
                     hyp_path=str(hyp_path), decode_wall_s=decode_wall_s,
                     sentences_per_s=len(hyps) / decode_wall_s if decode_wall_s > 0 else 0.0, bp=b.bp,
                     len_ratio=b.len_ratio, precisions=b.precisions)
