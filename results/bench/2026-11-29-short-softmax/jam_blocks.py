"""Per-block BERT-JAM phase-1 / baseline ratios with each block's page faults (minor, and major for the arm), as
bench/bert_cache.py --mode interleaved times them (3 untimed updates each, then epoch 2 on, 5-update blocks, order
flipping). POPULATE=22 (MADV_POPULATE_READ) or 3 (MADV_WILLNEED) advises each feature cache's mapping when opened.
From the repository root: [POPULATE=22] python results/bench/2026-11-29-short-softmax/jam_blocks.py bert_jam"""
import os, sys, time, resource
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import torch
from nmtcore.allocator import reexec_with_allocator
reexec_with_allocator()
from bert_cache import MODELS
if os.environ.get("POPULATE"):
    import nmtcore.bert.features as Fe
    orig_init = Fe.FeatureStore.__init__
    def init(self, features, *a, **k):
        orig_init(self, features, *a, **k)
        m = getattr(features, "_mmap", None)
        if m is not None:
            t0 = time.perf_counter(); m.madvise(int(os.environ["POPULATE"])); print("populated", features.shape, f"{time.perf_counter() - t0:.2f}s", flush=True)
    Fe.FeatureStore.__init__ = init
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer, setup_torch
base = preset("multi30k_small").with_overrides({"data.data_dir": os.environ.get("NMTCORE_DATA", "../shared/data"), "data.download": False,
    "train.num_threads": 2, "train.precision": "auto", "train.valid_bleu": False, "output_dir": "bench/out/bert_cache"})
setup_torch(base)
data = prepare_data(base.data)
name = sys.argv[1] if len(sys.argv) > 1 else "bert_jam"
tr = {"baseline": build_trainer(base, data, device=torch.device("cpu")),
      name: build_trainer(base.with_overrides({**MODELS[name][1], "model.bert.name": "minilm"}), prepare_data(base.data), device=torch.device("cpu"))}
def stream(key, epoch):
    while True:
        yield from tr[key].train_batches(epoch); epoch += 1
def run(key, it, n):
    t, tok, t0 = tr[key], 0, time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(n): tok += t.train_step([next(it)])["n_tokens"]
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    return time.perf_counter() - t0, tok, r1.ru_minflt - r0.ru_minflt, r1.ru_majflt - r0.ru_majflt
for k in tr: run(k, stream(k, 1), 3)
its = {"baseline": stream("baseline", 2), name: stream(name, 2)}
rounds = int(os.environ.get("ROUNDS", 8))
for r in range(rounds):
    per = {}
    for key in (("baseline", name) if r % 2 == 0 else (name, "baseline")):
        s, tok, mn, mj = run(key, its[key], 5)
        per[key] = (s / tok, tok, mn, mj)
    print(r, f"ratio {per[name][0] / per['baseline'][0]:.3f} tokens {per['baseline'][1]} minflt base {per['baseline'][2]} {name} {per[name][2]} majflt {per[name][3]}", flush=True)
