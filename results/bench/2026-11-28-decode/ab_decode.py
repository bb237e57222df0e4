"""Beam search with the code of commit OLD (default c9de304: the step's full (rows × vocabulary) log-probs cleaned of
NaN and ranked by one topk; the decoder's keys/values concatenated at every step) against the checkout's,
interleaved in one process on the same model and batches, the order flipping each round, so that the machine's
drift hits both alike. The old search is that commit's ``beam_search.py`` (from ``git show``), the old cache its
``LayerCache.grow`` / ``DecoderState.reorder``, set on the current classes for the old side's runs. The hypotheses
of both sides are compared sentence by sentence.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-decode/ab_decode.py CHECKPOINT [ROUNDS] [BEAM] [OLD]
  (from the checkout's root; CHECKPOINT e.g. bench/out/vs_fairseq/qual-auto/checkpoints/epoch5.pt, or "untrained" for
  the multi30k_small baseline with random weights, whose every hypothesis runs to the maximum length)"""
import importlib.util, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import torch
from nmtcore import bleu
from nmtcore.allocator import tune_allocator
from nmtcore.config import preset
from nmtcore.data import inference_batches, prepare_data
from nmtcore.decoding import beam_search as new_search
from nmtcore.decoding.translator import load_translator
from nmtcore.engine import build_trainer, setup_torch
from nmtcore.nn.cache import DecoderState, LayerCache

CKPT = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
BEAM = int(sys.argv[3]) if len(sys.argv) > 3 else 5
OLD_SHA = sys.argv[4] if len(sys.argv) > 4 else "c9de304"
old_file = Path(tempfile.mkdtemp()) / "old_beam_search.py"
old_file.write_text(subprocess.check_output(["git", "show", f"{OLD_SHA}:nmtcore/decoding/beam_search.py"], text=True))
spec = importlib.util.spec_from_file_location("old_beam_search", old_file)
old_search = importlib.util.module_from_spec(spec)
sys.modules["old_beam_search"] = old_search  # its dataclasses look their module up
spec.loader.exec_module(old_search)


def old_grow(self, k, v):
    if self.self_k is not None:
        k, v = torch.cat([self.self_k, k], dim=2), torch.cat([self.self_v, v], dim=2)
    self.self_k, self.self_v = k, v
    return k, v


def old_reorder(self, beam_idx, static=True):
    for cache in self.layers:
        if cache.self_k is not None:
            cache.self_k = cache.self_k.index_select(0, beam_idx)
            cache.self_v = cache.self_v.index_select(0, beam_idx)
        if static:
            cache.static = {n: (k.index_select(0, beam_idx), v.index_select(0, beam_idx)) for n, (k, v) in cache.static.items()}
    self.extras = {k: v.index_select(0, beam_idx) if isinstance(v, torch.Tensor) else v for k, v in self.extras.items()}


NEW_CACHE = (LayerCache.grow, DecoderState.reorder)
SIDES = {"old": (old_search, (old_grow, old_reorder)), "new": (new_search, NEW_CACHE)}

data_dir = os.environ["NMTCORE_DATA"]
if CKPT == "untrained":
    cfg = preset("multi30k_small").with_overrides({"data.data_dir": data_dir, "data.download": False,
                                                   "train.num_threads": 2, "output_dir": "bench/out/ab_decode"})
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    model, vocab = build_trainer(cfg, data, device=torch.device("cpu")).model, data.vocab
else:
    tr = load_translator(Path(CKPT), {"data.data_dir": data_dir, "train.num_threads": 2})
    cfg, model, vocab = tr.cfg, tr.model, tr.vocab
    setup_torch(cfg)
    data = prepare_data(cfg.data)
tune_allocator()  # as a decoding process runs
model.eval()
split = data.splits["test_2016_flickr"]
dcfg = cfg.decode.__class__(**{**cfg.decode.__dict__, "beam": BEAM, "nbest": 1, "max_sentences": 128,
                               "max_len_a": 1.2, "max_len_b": 10, "precision": "fp32"})
batches = list(inference_batches(split, vocab, 128))
print(f"threads={torch.get_num_threads()} beam={BEAM} sentences={len(split.src)} batches={len(batches)} "
      f"checkpoint={CKPT} old={OLD_SHA}", flush=True)


def decode(side):
    search, (grow, reorder) = SIDES[side]
    LayerCache.grow, DecoderState.reorder = grow, reorder
    try:
        t0 = time.perf_counter()
        res = search.translate(model, batches, dcfg)
        return time.perf_counter() - t0, [vocab.decode(res[i][0].tokens) for i in range(len(split.src))], res
    finally:
        LayerCache.grow, DecoderState.reorder = NEW_CACHE


decode("old"), decode("new")  # warm-up
(_, old_hyps, old_res), (_, new_hyps, new_res) = decode("old"), decode("new")
same = sum(a == b for a, b in zip(old_hyps, new_hyps))
score_diff = max(abs(old_res[i][0].score - new_res[i][0].score) for i in range(len(split.src))
                 if old_res[i][0].tokens == new_res[i][0].tokens)
print(f"identical hypotheses: {same}/{len(split.src)}; max |score difference| where identical: {score_diff:.2e}; "
      f"BLEU old {bleu.corpus_bleu(old_hyps, split.raw_tgt).score:.2f} new {bleu.corpus_bleu(new_hyps, split.raw_tgt).score:.2f}",
      flush=True)
times = {"old": [], "new": []}
for r in range(ROUNDS):
    for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
        wall, _, _ = decode(side)
        times[side].append(wall)
        print(f"round {r} {side}: {len(split.src) / wall:.1f} sentences/s ({wall:.2f} s) loadavg={os.getloadavg()[0]:.2f}",
              flush=True)
med = {s: statistics.median(t) for s, t in times.items()}
ratios = [o / n for o, n in zip(times["old"], times["new"])]
print(f"RESULT median sentences/s old {len(split.src) / med['old']:.1f} new {len(split.src) / med['new']:.1f}: "
      f"new/old speed {med['old'] / med['new']:.3f} (per round {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
