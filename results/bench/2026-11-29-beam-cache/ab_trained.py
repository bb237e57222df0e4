"""The fp32 self-attention prefix (``nmtcore.nn.layers.wide_decoding_cache``) under beam search (old) against beam
search's bf16 prefix (new: ``DecoderState.reordered_each_step``), and under greedy search (wide, as both old and
new keep it) against a bf16 prefix: the trained 500-update baseline of ``bench/vs_fairseq.py``
(``bench/out/vs_fairseq/qual-auto``, from a ``bench/vs_fairseq.py`` or ``bench/all.py --quality`` run), the full
test_2016, 2 threads, bf16, old and new alternated in one process (the order flipping each round); time and BLEU.

  ROUNDS=4 python results/bench/2026-11-29-beam-cache/ab_trained.py
"""

import os
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import torch  # noqa: E402
import vs_fairseq as V  # noqa: E402

from nmtcore import bleu  # noqa: E402
from nmtcore.allocator import tune_allocator  # noqa: E402
from nmtcore.data import prepare_data  # noqa: E402
from nmtcore.decoding import translate_split  # noqa: E402
from nmtcore.engine import build_trainer, setup_torch  # noqa: E402
from nmtcore.nn import DecoderState  # noqa: E402
from nmtcore.nn import layers as L  # noqa: E402

args = types.SimpleNamespace(out="bench/out/vs_fairseq", data_dir=os.environ.get("NMTCORE_DATA", "../shared/data"),
                             cache_dir="", max_tokens=4096, threads=2)
cfg = V.experiment(args, "qual", 1e-3, 400, 500, "auto")
setup_torch(cfg)
tune_allocator()  # as a decoding process
data = prepare_data(cfg.data)
tr = build_trainer(cfg, data, device=torch.device("cpu"))
assert tr.resume() and tr.state.num_updates >= 500, "no trained qual-auto checkpoint: run bench/vs_fairseq.py first"
split = data.splits["test_2016_flickr"]
rounds = int(os.environ.get("ROUNDS", 3))
marked = DecoderState.reordered_each_step


def use(beam: int, tag: str) -> None:
    if beam > 1:  # old: beam search's caches not marked, so they widen as greedy's do
        DecoderState.reordered_each_step = marked if tag == "new" else (lambda self: self)
        L.WIDE_CACHE_MIN_HEAD_DIM = 64
    else:  # greedy: old = new = the fp32 prefix; compared with a bf16 prefix ("bf16")
        L.WIDE_CACHE_MIN_HEAD_DIM = 64 if tag == "new" else 10**6


for beam in (5, 1):
    dcfg = cfg.decode.__class__(**{**cfg.decode.__dict__, "beam": beam, "nbest": 1, "precision": "auto"})
    translate_split(tr.model, split.select(range(64)), data.vocab, dcfg, tr.device)  # warm-up
    res, hyps = {}, {}
    for r in range(rounds):
        for tag in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
            use(beam, tag)
            t0 = time.perf_counter()
            hyps[tag] = translate_split(tr.model, split, data.vocab, dcfg, tr.device)
            res.setdefault(tag, []).append(time.perf_counter() - t0)
    b = {t: bleu.corpus_bleu(h, split.raw_tgt).score for t, h in hyps.items()}
    same = sum(x == y for x, y in zip(hyps["old"], hyps["new"]))
    what = "fp32 prefix (old) / bf16 prefix (new)" if beam > 1 else "bf16 prefix / fp32 prefix (kept)"
    print(f"RESULT beam {beam}: time {what} {sum(res['old']) / sum(res['new']):.3f}; old "
          f"{[round(x, 2) for x in res['old']]} s, new {[round(x, 2) for x in res['new']]} s; BLEU old "
          f"{b['old']:.2f}, new {b['new']:.2f}; same hypotheses {same}/{len(hyps['old'])}", flush=True)
