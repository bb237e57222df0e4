"""Beam search with the encoder output and the caches' static keys/values kept once per sentence and shared by its
beams (``beams_share_memory = True``, the default since this change) against the same rows copied to every beam
(``False``: the search as it was before, expanding them at step 0 and copying them again whenever a sentence
finishes), interleaved in one process on the same model and batches, the order flipping each round. Both sides run
the checkout's code; the hypotheses are compared sentence by sentence.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-shared-memory/ab_shared.py CHECKPOINT [ROUNDS] [BEAM]
  (CHECKPOINT: a trained model's checkpoint, e.g. bench/out/vs_fairseq/qual-auto/checkpoints/epoch5.pt, or a
  registered model name of bench/decode_speed.py (baseline, bert_fused, bert_jam, mask_fusion, doc_context,
  plm_sponsored) for that model untrained, every hypothesis then running to decode_speed's fixed length, or with
  LENGTHS=variable to each sentence's own maximum length (1.2 × its source length + 10, the trained models' rule:
  an untrained model seldom ranks EOS first), so that sentences leave the batch at different steps as they do when
  a model translates)"""
import os, statistics, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import numpy as np
import torch
from nmtcore import bleu
from nmtcore.allocator import tune_allocator
from nmtcore.bert import ensure_bert
from nmtcore.config import DecodeConfig, preset
from nmtcore.data import inference_batches, prepare_data
from nmtcore.decoding import beam_search
from nmtcore.decoding.translator import load_translator
from nmtcore.engine import build_trainer, setup_torch

CKPT = sys.argv[1]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 6
BEAM = int(sys.argv[3]) if len(sys.argv) > 3 else 5
data_dir = os.environ["NMTCORE_DATA"]
if Path(CKPT).is_file():
    tr = load_translator(Path(CKPT), {"data.data_dir": data_dir, "train.num_threads": 2})
    cfg, model, vocab = tr.cfg, tr.model, tr.vocab
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    dcfg = cfg.decode.__class__(**{**cfg.decode.__dict__, "beam": BEAM, "nbest": 1, "max_sentences": 128,
                                   "max_len_a": 1.2, "max_len_b": 10, "precision": "fp32"})
else:
    from decode_speed import MODELS  # bench/: the models as their studies build them
    base = preset("multi30k_small").with_overrides({"data.data_dir": data_dir, "data.download": False,
                                                    "train.num_threads": 2, "output_dir": "bench/out/decode_speed"})
    cfg = ensure_bert(base.with_overrides(MODELS[CKPT]))
    setup_torch(cfg)
    data = prepare_data(cfg.data)
    model, vocab = build_trainer(cfg, data, device=torch.device("cpu")).model, data.vocab
    length = int(round(float(np.mean([len(t) for t in data.splits["test_2016_flickr"].tgt])))) + 1
    dcfg = DecodeConfig(beam=BEAM, max_len_a=0.0, max_len_b=length, min_len=length, max_sentences=128)
    if os.environ.get("LENGTHS") == "variable":
        dcfg = DecodeConfig(beam=BEAM, max_len_a=1.2, max_len_b=10, min_len=0, max_sentences=128)
tune_allocator()  # as a decoding process runs
model.eval()
split = data.splits["test_2016_flickr"]
batches = list(inference_batches(split, vocab, 128))
print(f"threads={torch.get_num_threads()} beam={BEAM} sentences={len(split.src)} batches={len(batches)} "
      f"model={CKPT} max_len_a={dcfg.max_len_a} max_len_b={dcfg.max_len_b} min_len={dcfg.min_len}", flush=True)


def decode(shared: bool):
    model.beams_share_memory = shared
    t0 = time.perf_counter()
    res = beam_search.translate(model, batches, dcfg)
    return time.perf_counter() - t0, [vocab.decode(res[i][0].tokens) for i in range(len(split.src))], res


SIDES = {"copied": False, "shared": True}
decode(False), decode(True)  # warm-up
(_, old_hyps, old_res), (_, new_hyps, new_res) = decode(False), decode(True)
same = sum(a == b for a, b in zip(old_hyps, new_hyps))
score_diff = max(abs(old_res[i][0].score - new_res[i][0].score) for i in range(len(split.src))
                 if old_res[i][0].tokens == new_res[i][0].tokens)
print(f"identical hypotheses: {same}/{len(split.src)}; max |score difference| where identical: {score_diff:.2e}; "
      f"BLEU copied {bleu.corpus_bleu(old_hyps, split.raw_tgt).score:.2f} shared "
      f"{bleu.corpus_bleu(new_hyps, split.raw_tgt).score:.2f}", flush=True)
times = {"copied": [], "shared": []}
for r in range(ROUNDS):
    for side in (("copied", "shared") if r % 2 == 0 else ("shared", "copied")):
        wall, _, _ = decode(SIDES[side])
        times[side].append(wall)
        print(f"round {r} {side}: {len(split.src) / wall:.1f} sentences/s ({wall:.2f} s) "
              f"loadavg={os.getloadavg()[0]:.2f}", flush=True)
med = {s: statistics.median(t) for s, t in times.items()}
ratios = [o / n for o, n in zip(times["copied"], times["shared"])]
print(f"RESULT {CKPT}: median sentences/s copied {len(split.src) / med['copied']:.1f} shared "
      f"{len(split.src) / med['shared']:.1f}: shared/copied speed {med['copied'] / med['shared']:.3f} "
      f"(per round {min(ratios):.3f}-{max(ratios):.3f})", flush=True)
