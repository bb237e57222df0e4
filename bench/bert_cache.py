"""Epoch time of a BERT-consuming model on Multi30k with the frozen-feature cache vs recomputing BERT
every step (the original BERT-fused code's behaviour, bert-nmt issue #18), and vs the plain baseline
epoch, measured side by side in one run.

The BERT-consuming models (``--model``, one or ``all``; each with a frozen BERT, ``model.bert.name=minilm``
by default): ``bert_fused`` (BERT's last layer attended from every encoder and decoder layer, drop-net 1.0),
``bert_jam`` (its first phase: every BERT layer through the GLU into joint attention, BERT frozen; the
schedule scaled to fit), ``mask_fusion`` (multi-layer GLU fusion, the mask knowledge matrix, adaptive
fusion), ``doc_context`` (BERT reading ``[CLS] context [SEP] sentence [SEP]`` with the fixed context, as
Multi30k has no documents; gated context attention in both stacks) and ``kd`` (the baseline distilling from
the frozen BERT, ``train.kd_alpha=0.9``: the BERT stream, the teacher's states pooled per NMT token, a
projection and the KD loss). PLM-sponsored fine-tunes its BERTs, so it has no cached epoch: its cost per
update is ``bench/finetune_memory.py``'s. Every run trains the ``multi30k_small`` preset's epoch (the
trainer's own batches, same seed; ``--max-updates N`` times its first N updates) through
``Trainer.train_epoch``. The baseline is timed before the first model and again after each model's two runs,
and a model's ratios are against the mean of the baseline runs just before and just after it: on a shared
2-core machine the same 30 baseline updates ran at 2054 and then 2427 target tokens/s 20 minutes apart in one run
(at 1570 in another, that morning), so a single baseline timing moved every ratio of a run by up to a third.
The baselines' spread is printed with each model. The cache is built (or found) before the cached epoch starts;
its one-time cost is in that run's setup_s. Bar (the issue): cached epoch <= 1.3 x baseline epoch.

The ratio is of seconds per target token, which is what a whole epoch's ratio is (every run of an epoch
trains the same target tokens): N updates of two models do not hold the same tokens (the BERT stream changes
the batch order, and the document model's token budget counts its context, so its batches carry fewer target
tokens and its epoch has more updates). The plain time of the N updates is printed beside it.

  python bench/bert_cache.py --data-dir ../shared/data [--threads 2] [--bert minilm] [--model all]
                             [--max-updates N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from nmtcore.allocator import allocator_in_use, reexec_with_allocator
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer, setup_torch


# name -> (what it is, overrides on multi30k_small); each reads a frozen BERT (model.bert.name from --bert).
MODELS = {
    "bert_fused": ("BERT-fused, p_net 1.0", {"model.name": "bert_fused"}),
    "bert_jam": ("BERT-JAM phase 1, BERT frozen", {"model.name": "bert_jam", "train.phase_scale": 0.1,
                                                   "train.max_epochs": 6}),
    "mask_fusion": ("mask fusion, theta 0.03", {"model.name": "mask_fusion"}),
    "doc_context": ("document context, fixed context", {"model.name": "doc_context", "model.context_type": "fixed"}),
    "kd": ("baseline + KD teacher, alpha 0.9", {"train.kd_alpha": 0.9}),
}


def epoch(cfg, data, label: str, updates: int = 0) -> dict[str, float]:
    """Build the model and trainer (BERT stream and cache included), then time one training epoch (its first
    ``updates`` updates if > 0: set after the trainer is built, as a run may not cut a phase schedule short but
    a timing of its first phase may)."""
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, data, device=torch.device("cpu"))
    if updates:
        trainer.cfg = trainer.cfg.with_overrides({"train.max_updates": updates})
    setup_s = time.perf_counter() - t0
    m = trainer.train_epoch(1)
    print(f"{label}: epoch_s={m['train_wall_s']:.1f} updates={int(m['num_updates'])} "
          f"tgt_tokens={int(m['train_tokens'])} tgt_tok_per_s={m['train_tokens_per_s']:.0f} "
          f"setup_s={setup_s:.1f} (model build + BERT stream + cache build/load) loadavg={os.getloadavg()[0]:.1f}",
          flush=True)
    return {"epoch_s": m["train_wall_s"], "setup_s": setup_s,
            "s_per_token": m["train_wall_s"] / max(m["train_tokens"], 1.0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bert", default="minilm", help="model.bert.name of the BERT-consuming model")
    p.add_argument("--model", choices=(*MODELS, "all"), default="bert_fused",
                   help="the BERT-consuming model (all: each in turn, against one baseline epoch)")
    p.add_argument("--precision", default="auto", help="train.precision (auto = bf16 where the CPU has it)")
    p.add_argument("--max-updates", type=int, default=0, help="time only the first N updates of each epoch")
    p.add_argument("--fresh-cache", action="store_true", help="delete the feature cache first (time its build)")
    p.add_argument("--smoke-test", action="store_true", help="a few updates each, to check the script runs")
    args = p.parse_args()
    reexec_with_allocator()  # on the allocator a trial trains on (nmtcore.allocator)
    updates = 5 if args.smoke_test else args.max_updates
    base = preset("multi30k_small").with_overrides({
        "data.data_dir": args.data_dir, "data.download": False, "train.num_threads": args.threads,
        "train.precision": args.precision, "train.valid_bleu": False,
        "output_dir": "bench/out/bert_cache"})
    setup_torch(base)
    data = prepare_data(base.data)
    cache = base.data.resolved_cache_dir() / "bert_features"
    if args.fresh_cache and cache.exists():
        shutil.rmtree(cache)
    m = base.model
    print(f"threads={torch.get_num_threads()} allocator={allocator_in_use()} precision={args.precision} "
          f"model={m.encoder_layers}+{m.decoder_layers} "
          f"d={m.d_model} vocab={len(data.vocab)} max_tokens={base.data.max_tokens} "
          f"train_sentences={len(data.train)} bert={args.bert} "
          f"updates_per_run={'full epoch' if not updates else updates}", flush=True)

    # Untimed first: the process's first updates pay one-time costs (allocator, oneDNN kernels), which made the
    # baseline, timed first, 31-41 s for the same 30 updates in two runs and every ratio after it too small.
    epoch(base, data, "warm-up, not timed (baseline)", 10)
    before = epoch(base, data, "baseline (no BERT)", updates)
    results = []
    for name in (MODELS if args.model == "all" else [args.model]):
        what, overrides = MODELS[name]
        bert = {**overrides, "model.bert.name": args.bert}
        cached = epoch(base.with_overrides(bert), data, f"{name} ({what}), cached features", updates)
        size = sum(f.stat().st_size for f in Path(cache).rglob("*.npy")) / 2**20 if cache.exists() else 0.0
        print(f"feature cache: {cache} ({size:.0f} MiB on disk, all entries); a first-time build is part of the "
              "setup_s above (none once cached: reused across epochs, phases and sweep trials)", flush=True)
        recompute = epoch(base.with_overrides({**bert, "model.bert.use_cache": False}), data,
                          f"{name} ({what}), BERT recomputed every step", updates)
        after = epoch(base, data, "baseline (no BERT)", updates)
        baseline = {k: (before[k] + after[k]) / 2 for k in ("epoch_s", "s_per_token")}
        per = {k: r["s_per_token"] / baseline["s_per_token"] for k, r in (("cached", cached), ("recompute", recompute))}
        results.append(f"RESULT {name}: cached/baseline={per['cached']:.3f} (bar <= 1.3) "
                       f"recompute/baseline={per['recompute']:.3f} recompute/cached={per['recompute'] / per['cached']:.3f} "
                       f"(per target token = whole epoch; time of the {updates or 'epoch'} updates alone: cached/baseline="
                       f"{cached['epoch_s'] / baseline['epoch_s']:.3f}; baseline before / after it: "
                       f"{1 / before['s_per_token']:.0f} / {1 / after['s_per_token']:.0f} tgt tok/s, "
                       f"cached/baseline against each: {cached['s_per_token'] / before['s_per_token']:.3f} / "
                       f"{cached['s_per_token'] / after['s_per_token']:.3f})")
        print(results[-1], flush=True)
        before = after
    print("\n".join(["summary:", *results]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
