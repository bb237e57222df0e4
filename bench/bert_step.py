"""A fine-tuned BERT's training step with and without the platform's changes to ``transformers``' BERT, side by
side in one process: blocks of updates on the same batches, alternated (ABBA order over rounds).

Changes (each toggled alone, the other left on):

- ``dropout``: the BERT's ``nn.Dropout`` modules draw as :func:`nmtcore.nn.layers.dropout` does
  (:class:`~nmtcore.nn.layers.FastDropout`) against ``F.dropout``'s per-element Bernoulli draws;
- ``cast``: each BERT self-attention casts its fp32 input once for q, k and v
  (:func:`nmtcore.bert.attention.cast_projections_once`) against autocast casting it once per projection;
- ``glu_bmm``: BERT-JAM's GLU mix as one batched product per sentence (:func:`nmtcore.models.bert_jam.mix_layers`)
  against ``torch.matmul``'s fold of the 2-D weights by the 3-D states (a transposed copy of the states and
  products of inner size L_B and R). Only BERT-JAM has it: elsewhere it is skipped.

Cases (``multi30k_small`` preset, Multi30k En→De, the trainer's own batches):

- ``plm_sponsored``: the loss ablation's ``full`` arm (source MiniLM and target ``e5:L6`` fine-tuned, half-layer
  KD teacher, α 0.9, MLM and L_T);
- ``bert_jam_ft``: BERT-JAM's phase 3 (MiniLM fine-tuned with the NMT part and the GLUs).

Prints, per case and change, the seconds per update each way in every round and ``RESULT <case> <change>:
step with/without=<median ratio>`` (below 1: the change is faster). It starts on the allocator a sweep's trials
train on (:mod:`nmtcore.allocator`). Run it alone on the machine.

  python bench/bert_step.py --data-dir ../shared/data [--threads 2] [--cases plm_sponsored,bert_jam_ft]
      [--changes dropout,cast,glu_bmm] [--block 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

CASES = {
    "plm_sponsored": {"model.name": "plm_sponsored", "model.bert.name": "minilm", "model.bert.freeze": False,
                      "model.kd_teacher": True, "model.kd_layer": "half", "model.mlm_loss": True,
                      "model.tgt_lm_loss": True, "train.kd_alpha": 0.9},
    "bert_jam_ft": {"model.name": "bert_jam", "model.bert.name": "minilm",
                    "train.phases": [{"name": "finetune", "epochs": 0, "trainable": ["nmt", "glu", "bert"]}]},
}
CHANGES = ("dropout", "cast", "glu_bmm")


def toggles(model) -> dict:
    """For each change, a function that turns it on (True) or off (False) in ``model``."""
    import torch
    from torch import nn

    from nmtcore.bert.attention import _cast_once
    from nmtcore.nn.layers import FastDropout

    drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
    attns = [m for m in model.modules() if all(isinstance(getattr(m, n, None), nn.Linear) for n in ("query", "key", "value"))]

    def dropout(on: bool) -> None:
        for m in drops:
            m.__class__ = FastDropout if on else nn.Dropout

    def cast(on: bool) -> None:
        for m in attns:
            for key in [k for k, h in m._forward_pre_hooks.items() if h is _cast_once]:
                del m._forward_pre_hooks[key]
                m._forward_pre_hooks_with_kwargs.pop(key, None)
            if on:
                m.register_forward_pre_hook(_cast_once, with_kwargs=True)

    import nmtcore.models.bert_jam as bert_jam

    batched = bert_jam.mix_layers

    def folded(glus, states, scale=1.0):  # the mix before the change: torch.matmul(2-D, 3-D)
        b, n_layers, m, h = states.shape
        w = torch.cat([g.weights(scale) for g in glus])
        rows = torch.matmul(w, states.reshape(b, n_layers, m * h))
        out, i = [], 0
        for g in glus:
            if g.beta is None:
                out.append(rows[:, i].view(b, m, h))
                i += 1
            else:
                out.append((torch.sigmoid(rows[:, i + 1]) * rows[:, i]).view(b, m, h))
                i += 2
        return out

    def glu_bmm(on: bool) -> None:
        bert_jam.mix_layers = batched if on else folded

    changes = {"dropout": dropout, "cast": cast}
    if isinstance(model, bert_jam.BertJam):
        changes["glu_bmm"] = glu_bmm
    return changes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--changes", default=",".join(CHANGES))
    p.add_argument("--block", type=int, default=3, help="updates per block")
    p.add_argument("--rounds", type=int, default=4, help="blocks each way")
    p.add_argument("--max-tokens", type=int, default=0, help="batch size in tokens (0: the preset's)")
    args = p.parse_args()
    cases, changes = args.cases.split(","), args.changes.split(",")
    bad = sorted(set(cases) - set(CASES)) + sorted(set(changes) - set(CHANGES))
    if bad:
        p.error(f"unknown {', '.join(bad)}; cases: {', '.join(CASES)}; changes: {', '.join(CHANGES)}")
    if args.block < 1 or args.rounds < 1:
        p.error("--block and --rounds: at least 1")

    from nmtcore.allocator import allocator_in_use, reexec_with_allocator

    reexec_with_allocator()  # the allocator a sweep's trial trains on (nmtcore.allocator)
    import torch

    from nmtcore.bert import ensure_bert
    from nmtcore.config import preset
    from nmtcore.data import prepare_data
    from nmtcore.engine import build_trainer

    print(f"threads={args.threads} allocator={allocator_in_use()} loadavg={os.getloadavg()[0]:.2f}", flush=True)
    for case in cases:
        cfg = preset("multi30k_small").with_overrides({
            "data.data_dir": args.data_dir, "data.download": False, "train.num_threads": args.threads,
            "train.valid_bleu": False, "output_dir": "bench/out/bert_step", **CASES[case],
            **({"data.max_tokens": args.max_tokens} if args.max_tokens else {})})
        cfg = ensure_bert(cfg)
        trainer = build_trainer(cfg, prepare_data(cfg.data), device=torch.device("cpu"))
        switch = toggles(trainer.model)
        batches = trainer.train_batches(1)
        for _ in range(2):  # allocator, optimizer state and autocast caches warm
            trainer.train_step([next(batches)])
        for change in changes:
            if change not in switch:
                print(f"{case} {change}: not in this model, skipped", flush=True)
                continue
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(args.rounds):
                block = [next(batches) for _ in range(args.block)]
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    switch[change](on)
                    t0 = time.perf_counter()
                    for b in block:
                        trainer.train_step([b])
                    times[on].append((time.perf_counter() - t0) / args.block)
            switch[change](True)
            ratios = [b / a for a, b in zip(times[False], times[True])]
            print(f"{case} {change}: s/update without {[round(t, 3) for t in times[False]]} "
                  f"with {[round(t, 3) for t in times[True]]} loadavg={os.getloadavg()[0]:.2f}", flush=True)
            print(f"RESULT {case} {change}: step with/without={statistics.median(ratios):.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
