"""Training tokens/s of the nmtcore baseline vs a bare ``torch.nn.Transformer`` of the same size on the
same batches, measured side by side in one run and printed as ratios; then decoding sentences/s.

Both sides do forward + label-smoothed CE + backward + Adam step on identical padded Multi30k batches
(the trainer's own token-budget batches), at the same precision. The bare model is the ceiling that
plain PyTorch reaches with no data pipeline, masks-free fused encoder fast paths aside.

  python bench/train_throughput.py --data-dir ../shared/data [--checkpoint ckpt.pt] [--steps 20]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from nmtcore.checkpoint import load_checkpoint, load_model_weights
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.decoding import translate_split
from nmtcore.devices import autocast, autocast_dtype
from nmtcore.engine import build_trainer, setup_torch
from nmtcore.models import build_model


class BareTransformer(torch.nn.Module):
    """torch.nn.Transformer + tied embeddings + output projection: the plain-PyTorch ceiling."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, ffn: int, dropout: float) -> None:
        super().__init__()
        self.d = d
        self.emb = torch.nn.Embedding(vocab, d)
        self.tf = torch.nn.Transformer(d_model=d, nhead=heads, num_encoder_layers=layers, num_decoder_layers=layers,
                                       dim_feedforward=ffn, dropout=dropout, batch_first=True)

    def forward(self, src, tgt_in, src_mask):
        x = self.emb(src) * math.sqrt(self.d)
        y = self.emb(tgt_in) * math.sqrt(self.d)
        # On the inputs' device: a CPU mask cost the bare side ~3 ms of host time a step on a GPU, plus copies.
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tgt_in.size(1), device=tgt_in.device)
        h = self.tf(x, y, tgt_mask=causal, tgt_is_causal=True, src_key_padding_mask=src_mask,
                    memory_key_padding_mask=src_mask)
        return F.linear(h, self.emb.weight)


def make_bare_step(cfg, vocab: int, pad_id: int, precision: str, device: torch.device):
    """A training step of a :class:`BareTransformer` of ``cfg.model``'s size, seeded as the trainer is
    (``torch.manual_seed(1)``): forward under ``precision``'s autocast, label-smoothed CE summed, backward,
    Adam (fused on a GPU)."""
    m = cfg.model
    torch.manual_seed(1)
    bare = BareTransformer(vocab, m.d_model, m.heads, m.encoder_layers, m.ffn_dim, m.dropout).to(device).train()
    opt = torch.optim.Adam(bare.parameters(), lr=1e-4, betas=(0.9, 0.98), fused=device.type == "cuda")
    dtype = autocast_dtype(precision, device)

    def bare_step(b):
        opt.zero_grad(set_to_none=True)
        with autocast(dtype, device):
            logits = bare(b.src, b.tgt_in, b.src_mask)
        F.cross_entropy(logits.float().view(-1, vocab), b.tgt_out.view(-1), ignore_index=pad_id,
                        label_smoothing=0.1, reduction="sum").backward()
        opt.step()

    return bare_step


def time_steps(step, batches, warmup: int) -> tuple[float, int]:
    for b in batches[:warmup]:
        step(b)
    tokens = 0
    t0 = time.perf_counter()
    for b in batches[warmup:]:
        step(b)
        tokens += b.n_tgt_tokens
    return time.perf_counter() - t0, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--checkpoint", help="a trained multi30k_small checkpoint for realistic decoding speed")
    p.add_argument("--skip-decode", action="store_true")
    args = p.parse_args()
    cfg = preset("multi30k_small").with_overrides({"data.data_dir": args.data_dir, "train.num_threads": args.threads,
                                                   "output_dir": "bench/out/throughput"})
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    m = cfg.model
    print(f"threads={torch.get_num_threads()} model={m.encoder_layers}+{m.decoder_layers} d={m.d_model} "
          f"ffn={m.ffn_dim} heads={m.heads} vocab={len(data.vocab)} max_tokens={cfg.data.max_tokens}")
    device = torch.device("cpu")
    for precision in args.precisions.split(","):
        c = cfg.with_overrides({"train.precision": precision})
        trainer = build_trainer(c, data, device=device)  # seeds torch with train.seed = 1
        it = trainer.train_batches(epoch=1)
        batches = [next(it) for _ in range(args.warmup + args.steps)]
        ours_s, tokens = time_steps(lambda b: trainer.train_step([b]), batches, args.warmup)

        bare_step = make_bare_step(c, len(data.vocab), data.vocab.pad_id, precision, device)
        bare_s, _ = time_steps(bare_step, batches, args.warmup)
        print(f"train[{precision}]: nmtcore_tgt_tok_per_s={tokens / ours_s:.0f} bare_torch_tgt_tok_per_s={tokens / bare_s:.0f} "
              f"ratio_nmtcore_over_bare={bare_s / ours_s:.3f} steps={args.steps} tokens={tokens}", flush=True)

    if args.skip_decode:
        return 0
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
    note = "untrained model (pass --checkpoint for realistic output lengths)"
    if args.checkpoint:
        load_model_weights(model, load_checkpoint(args.checkpoint)["model"], args.checkpoint)
        note = args.checkpoint
    split = data.splits["test_2016_flickr"]
    for precision in args.precisions.split(","):
        for beam in (1, 5):
            d = cfg.decode.__class__(**{**cfg.decode.__dict__, "beam": beam, "nbest": 1, "precision": precision})
            translate_split(model, split.select(range(64)), data.vocab, d, device)
            t0 = time.perf_counter()
            hyps = translate_split(model, split, data.vocab, d, device)
            dt = time.perf_counter() - t0
            print(f"decode[{precision}] beam={beam}: sentences={len(hyps)} sent_per_s={len(hyps) / dt:.1f} "
                  f"avg_hyp_words={sum(len(h.split()) for h in hyps) / len(hyps):.1f} ({note})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
