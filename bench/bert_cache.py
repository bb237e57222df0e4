"""Training cost of each BERT-consuming model on Multi30k with the frozen-feature cache against the plain
baseline's, per target token, measured side by side in one run (and, run after run, against recomputing BERT
every step: the original BERT-fused code's behaviour, bert-nmt issue #18).

The BERT-consuming models (``--model``, one or ``all``; each with a frozen BERT, ``model.bert.name=minilm``
by default): ``bert_fused`` (BERT's last layer attended from every encoder and decoder layer, drop-net 1.0),
``bert_jam`` (its first phase: every BERT layer through the GLU into joint attention, BERT frozen; the
schedule scaled to fit), ``mask_fusion`` (multi-layer GLU fusion, the mask knowledge matrix, adaptive
fusion), ``doc_context`` (BERT reading ``[CLS] context [SEP] sentence [SEP]`` with the fixed context, as
Multi30k has no documents; gated context attention in both stacks) and ``kd`` (the baseline distilling from
the frozen BERT, ``train.kd_alpha=0.9``: the BERT stream, the teacher's states pooled per NMT token, a
projection and the KD loss). PLM-sponsored fine-tunes its BERTs, so it has no cached epoch: its cost per
update is ``bench/finetune_memory.py``'s. Every model trains on the ``multi30k_small`` preset's batches (the
trainer's own, same seed: the token budget counts NMT tokens only, so a BERT arm's batches are its control's).
Bar (the issue): cached epoch <= 1.3 x baseline epoch. The ratio is of seconds per target token, a whole
epoch's ratio.

``--mode interleaved`` (the default) builds the baseline's and every model's trainer in one process (each on
its own prepared data: a trainer attaches its BERT stream to the splits) and, for each model, alternates it
with the baseline in ``--rounds`` pairs of ``--block``-update blocks, the pair's order flipping each round;
both sides of a pair train on the same batches (same epoch, same positions), batch collation included, as in
an epoch. Drift slower than a block then hits both alike: run after run on one 2-core machine, the same
code's BERT-JAM row read 1.53 one evening and 1.19-1.20 the next night, and one run's baselines spread
2254-2943 target tokens/s. It prints the ratio over all blocks with the median and range of the per-block
ratios, and each model's matrix-multiply work per target token against the baseline's
(``torch.utils.flop_counter`` over one update, forward and backward: every mm/addmm/bmm/attention product):
where a model's architecture alone does 1.3x the baseline's products, no overhead removal brings its epoch
under the bar on a machine where steps are mostly products.

``--mode sequential`` is the earlier comparison: each run trains its first ``--max-updates`` updates (0 = the
whole epoch) through ``Trainer.train_epoch``, the model cached then recomputing BERT, with a baseline run
before the first model and after each one; a model's ratios are against the mean of its two neighbouring
baseline runs, whose speeds are printed beside them. The cache is built (or found) before the cached run
starts; its one-time cost is in that run's setup_s. ``both`` runs the two modes.

  python bench/bert_cache.py --data-dir ../shared/data [--threads 2] [--bert minilm] [--model all]
                             [--mode interleaved|sequential|both] [--block 5] [--rounds 8] [--max-updates N]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

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


def interleaved(base, data, names: list[str], bert: str, block: int, rounds: int) -> list[str]:
    """Each model against the baseline in one process, in alternating blocks of ``block`` updates on the same
    batches (``rounds`` pairs per model, the pair's order flipping each round); returns the RESULT lines."""
    trainers = {"baseline": build_trainer(base, data, device=torch.device("cpu"))}
    for name in names:  # each on its own data: a trainer attaches its BERT stream (and cache) to the splits
        trainers[name] = build_trainer(base.with_overrides({**MODELS[name][1], "model.bert.name": bert}),
                                       prepare_data(base.data), device=torch.device("cpu"))

    def stream(key: str, epoch: int):
        """Trainer ``key``'s batches from the start of ``epoch`` on, one epoch after another (same epoch, same
        shuffle: every arm's batches are the baseline's)."""
        while True:
            yield from trainers[key].train_batches(epoch)
            epoch += 1

    def run(key: str, it, n: int) -> tuple[float, int]:
        """``n`` updates of trainer ``key`` from ``it``, batch collation included as in an epoch: seconds, target
        tokens."""
        tr, tokens, t0 = trainers[key], 0, time.perf_counter()
        for _ in range(n):
            tokens += tr.train_step([next(it)])["n_tokens"]
        return time.perf_counter() - t0, tokens

    for key in trainers:  # untimed: each trainer's one-time costs (kernels, the allocator's first pages)
        run(key, stream(key, 1), 3)
    work = {}  # matrix-multiply FLOPs of an update (forward and backward) per target token, on epoch 1's 1st batch
    for key, tr in trainers.items():
        with FlopCounterMode(display=False) as counter:
            tokens = tr.train_step([next(stream(key, 1))])["n_tokens"]
        work[key] = counter.get_total_flops() / tokens
    results = []
    for name in names:
        its = {"baseline": stream("baseline", 2), name: stream(name, 2)}  # the same batches, in the same order
        sums = {"baseline": [0.0, 0], name: [0.0, 0]}
        ratios = []
        for r in range(rounds):
            per = {}
            for key in (("baseline", name) if r % 2 == 0 else (name, "baseline")):
                secs, tokens = run(key, its[key], block)
                per[key] = secs / tokens
                sums[key][0] += secs
                sums[key][1] += tokens
            ratios.append(per[name] / per["baseline"])
        total = (sums[name][0] / sums[name][1]) / (sums["baseline"][0] / sums["baseline"][1])
        results.append(f"RESULT {name}: cached/baseline={total:.3f} (bar <= 1.3) interleaved, {rounds} "
                       f"block{'s' * (rounds != 1)} of {block} updates each way; per block median "
                       f"{statistics.median(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; baseline "
                       f"{sums['baseline'][1] / sums['baseline'][0]:.0f} tgt tok/s, {name} "
                       f"{sums[name][1] / sums[name][0]:.0f}; matmul work per target token "
                       f"{work[name] / work['baseline']:.2f}x the baseline's ({work[name] / 1e6:.0f} / "
                       f"{work['baseline'] / 1e6:.0f} MFLOP); loadavg={os.getloadavg()[0]:.1f}")
        print(results[-1], flush=True)
    return results


def sequential(base, data, names: list[str], bert_name: str, updates: int, cache: Path) -> list[str]:
    """Each model's epoch (its first ``updates`` updates), cached and recomputed, one run after another with a
    baseline run before the first model and after each; returns the RESULT lines."""
    # Untimed first: the process's first updates pay one-time costs (allocator, oneDNN kernels), which made the
    # baseline, timed first, 31-41 s for the same 30 updates in two runs and every ratio after it too small.
    epoch(base, data, "warm-up, not timed (baseline)", 10)
    before = epoch(base, data, "baseline (no BERT)", updates)
    results = []
    for name in names:
        what, overrides = MODELS[name]
        bert = {**overrides, "model.bert.name": bert_name}
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
    return results


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
    p.add_argument("--mode", choices=("interleaved", "sequential", "both"), default="interleaved",
                   help="interleaved: all trainers in one process, alternating blocks; sequential: one run after "
                        "another with the baseline between models (and the recomputed-BERT epoch)")
    p.add_argument("--block", type=int, default=5, help="interleaved: updates per block")
    p.add_argument("--rounds", type=int, default=8, help="interleaved: blocks of each model and of its baseline")
    args = p.parse_args()
    if args.block < 1 or args.rounds < 1:
        p.error(f"--block and --rounds must be >= 1 (got {args.block}, {args.rounds})")
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
          f"mode={args.mode} updates_per_run={'full epoch' if not updates else updates} (sequential) "
          f"block={args.block} rounds={args.rounds} (interleaved)", flush=True)

    names = list(MODELS) if args.model == "all" else [args.model]
    results = []
    if args.mode != "sequential":
        results += interleaved(base, data, names, args.bert, 1 if args.smoke_test else args.block,
                               2 if args.smoke_test else args.rounds)
    if args.mode != "interleaved":
        results += sequential(base, data, names, args.bert, updates, cache)
    print("\n".join(["summary:", *results]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
