"""Beam-search decoding speed of the BERT-consuming models against the baseline Transformer, measured side by
side in one run (same sentences, same beam, same output length), every model built and decoded once untimed
first, then ``--rounds`` rounds of one timed decode per model, the order reversing each round (baseline, PLM-sponsored, PLM-sponsored,
baseline, ...): a drift of the machine's speed over the run hits both sides of a round alike. Decoded once each,
one after the other, the same code's PLM-sponsored ratio read 0.32 and 0.38 on one morning as the baseline's
reading alone moved from 390 to 307 sentences/s.

The models are built as their studies train them (``multi30k_small`` preset; the PLM-sponsored model with the
kd_alpha study's BERTs, fine-tuned, so it runs its source BERT at every batch and its target BERT as the
decoder), with their NMT weights untrained: what decoding costs does not depend on what the weights say,
except through the output lengths, and those are fixed here. Every hypothesis runs exactly ``--length`` steps
(``decode.min_len = decode.max_len_b = length``, ``max_len_a = 0``: EOS is barred before that step and forced
at it), so each model does the same number of decoding steps on the same sentences; the default length is the
split's mean reference length in subwords (+1 for EOS), i.e. about what a model that translates produces.

Bar (the issue): PLM-sponsored decoding >= 0.5 x the baseline's sentences/s, read as the median over rounds of
each round's ratio (its range beside it). The baseline's speed against
fairseq on a model that translates is ``bench/vs_fairseq.py``'s.

Besides the speed, each model's matrix-multiply work per sentence is counted (``torch.utils.flop_counter`` over
one decode of the first 128 sentences: every mm/addmm/bmm/attention product) and the machine's peak matmul rate
measured in the same run (a 2048² product in the decoding dtype), which bounds what overhead removal can give:
no model decodes faster than its matmul work at the peak rate. ``bound vs baseline`` is that best case against
the baseline's measured speed.

  python bench/decode_speed.py --data-dir ../shared/data [--threads 2] [--beam 5] [--models all] [--rounds 3]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

from nmtcore.allocator import tune_allocator
from nmtcore.bert import ensure_bert
from nmtcore.config import DecodeConfig, preset
from nmtcore.data import prepare_data
from nmtcore.decoding import translate_split
from nmtcore.devices import autocast_dtype
from nmtcore.engine import build_trainer, setup_torch

from finetune_memory import CASES  # bench/: the PLM-sponsored trial as the kd_alpha study trains it

# name -> overrides on multi30k_small. BERT models read minilm as their studies do; PLM-sponsored as kd_alpha.
MODELS = {
    "baseline": {},
    "bert_fused": {"model.name": "bert_fused", "model.bert.name": "minilm"},
    "bert_jam": {"model.name": "bert_jam", "model.bert.name": "minilm", "train.max_epochs": 60},
    "mask_fusion": {"model.name": "mask_fusion", "model.bert.name": "minilm"},
    "doc_context": {"model.name": "doc_context", "model.bert.name": "minilm", "model.context_type": "fixed"},
    "plm_sponsored": CASES["plm_sponsored"],
}


@dataclass
class Arm:
    """One model built for decoding: its trainer (model on the CPU), vocabulary and the sentences to decode."""

    name: str
    trainer: object
    vocab: object
    split: object

    def decode(self, dcfg: DecodeConfig, split=None) -> list[str]:
        return translate_split(self.trainer.model, self.split if split is None else split, self.vocab, dcfg,
                               self.trainer.device)


def build(cfg, name: str, split_name: str, n: int) -> Arm:
    """The model as its study builds it (BERT streams attached to every split) and the first ``n`` sentences."""
    cfg = ensure_bert(cfg)
    data = prepare_data(cfg.data)
    trainer = build_trainer(cfg, data, device=torch.device("cpu"))
    split = data.splits[split_name]
    return Arm(name, trainer, data.vocab, split.select(range(min(n, len(split.src)))))


def timed(arm: Arm, dcfg: DecodeConfig) -> float:
    """Sentences/s of one decode of all of ``arm``'s sentences."""
    t0 = time.perf_counter()
    hyps = arm.decode(dcfg)
    return len(hyps) / (time.perf_counter() - t0)


def matmul_work(arm: Arm, dcfg: DecodeConfig) -> float:
    """GFLOP of matrix products per sentence over one decode of the first 128 sentences."""
    with FlopCounterMode(display=False) as counter:
        counted = arm.decode(dcfg, arm.split.select(range(min(128, len(arm.split.src)))))
    return counter.get_total_flops() / 1e9 / len(counted)


@functools.lru_cache(maxsize=None)
def peak_matmul_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 20) -> float:
    """The best of ``reps`` timed n×n products in ``dtype`` (GFLOP/s) at the current thread count; measured once
    per process and dtype (vs_fairseq asks for it at every decode)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--split", default="test_2016_flickr")
    p.add_argument("--sentences", type=int, default=1000)
    p.add_argument("--length", type=int, default=0, help="output length of every hypothesis (0: the split's mean "
                   "reference length in subwords + 1)")
    p.add_argument("--models", default="baseline,plm_sponsored", help=f"comma list of {', '.join(MODELS)}, or all")
    p.add_argument("--rounds", type=int, default=3, help="timed decodes of each model, the order reversing each round")
    args = p.parse_args()
    names = list(MODELS) if args.models == "all" else args.models.split(",")
    unknown = [m for m in names if m not in MODELS]
    if unknown or "baseline" not in names:
        p.error(f"--models: need baseline and names from {', '.join(MODELS)}; got {args.models}")
    base = preset("multi30k_small").with_overrides({
        "data.data_dir": args.data_dir, "data.download": False, "train.num_threads": args.threads,
        "output_dir": "bench/out/decode_speed"})
    setup_torch(base)
    tune_allocator()  # as a decoding process (`nmtcore translate`, the Translator) runs
    length = args.length
    if length <= 0:
        data = prepare_data(base.data)
        tgt = data.splits[args.split].tgt[: args.sentences]
        length = int(round(float(np.mean([len(t) for t in tgt])))) + 1
    dcfg = DecodeConfig(beam=args.beam, max_len_a=0.0, max_len_b=length, min_len=length, max_sentences=128)
    print(f"threads={torch.get_num_threads()} beam={args.beam} split={args.split} sentences<={args.sentences} "
          f"every hypothesis {length} tokens (EOS included) precision={dcfg.precision}", flush=True)
    arms = {name: build(base.with_overrides(MODELS[name]), name, args.split, args.sentences) for name in names}
    gflop = {}
    for name, arm in arms.items():
        arm.decode(dcfg)  # an untimed round: a first whole decode ran 14% slower (2026-11-29)
        gflop[name] = matmul_work(arm, dcfg)
        print(f"{name}: sentences={len(arm.split.src)} matmul_gflop_per_sentence={gflop[name]:.2f} "
              f"parameters={arm.trainer.model.num_parameters() / 1e6:.1f}M", flush=True)
    speeds: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            speeds[name].append(timed(arms[name], dcfg))
        print(f"round {r + 1}: sentences/s " + " ".join(f"{n}={speeds[n][-1]:.1f}" for n in names)
              + f" loadavg={os.getloadavg()[0]:.1f}", flush=True)
    dtype = autocast_dtype(dcfg.precision, torch.device("cpu")) or torch.float32
    peak = peak_matmul_gflops(dtype)
    print(f"peak matmul rate ({str(dtype).replace('torch.', '')}, 2048², {torch.get_num_threads()} threads): "
          f"{peak:.0f} GFLOP/s", flush=True)
    base_speed = statistics.median(speeds["baseline"])
    for name in names:
        ratios = [a / b for a, b in zip(speeds[name], speeds["baseline"])]  # each round's, side by side
        sps = statistics.median(speeds[name])
        bound = peak / gflop[name]  # sentences/s if nothing but the matmuls ran, each at the peak rate
        print(f"RESULT {name}: sentences/s vs baseline={statistics.median(ratios):.2f}"
              + (" (bar >= 0.5)" if name == "plm_sponsored" else "")
              + f" median of {len(ratios)} rounds, range {min(ratios):.2f}-{max(ratios):.2f}; {sps:.1f} sentences/s"
              f" (median); matmul work vs baseline={gflop[name] / gflop['baseline']:.2f} bound={bound:.0f}"
              f" sentences/s (measured {sps / bound:.0%} of it) bound vs baseline={bound / base_speed:.2f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
