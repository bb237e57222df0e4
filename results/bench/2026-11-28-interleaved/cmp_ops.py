"""The baseline against a BERT model (default BERT-JAM phase 1, cached minilm): self CPU time per op and step, six
steps of each under torch.profiler, in one process.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-interleaved/cmp_ops.py [bert_jam|doc_context|...]"""
import os, sys, time, torch
sys.path.insert(0, "bench")
from bert_cache import MODELS
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer, setup_torch
from torch.profiler import profile, ProfilerActivity
base = preset("multi30k_small").with_overrides({"data.data_dir": os.environ["NMTCORE_DATA"], "data.download": False,
    "train.num_threads": 2, "train.precision": "auto", "train.valid_bleu": False, "output_dir": "bench/out/cmp"})
setup_torch(base)
data = prepare_data(base.data)
res = {}
M = sys.argv[1] if len(sys.argv) > 1 else "bert_jam"
for name, over in (("baseline", {}), (M, {**MODELS[M][1], "model.bert.name": "minilm"})):
    tr = build_trainer(base.with_overrides(over), data, device=torch.device("cpu"))
    batches = [b for _, b in zip(range(12), tr.train_batches(epoch=1))]
    for b in batches[:4]:
        tr.train_step([b])
    ntok = sum(b.n_tgt_tokens for b in batches[4:10])
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as p:
        t0 = time.perf_counter()
        for b in batches[4:10]:
            tr.train_step([b])
        wall = time.perf_counter() - t0
    ops = {e.key: (e.self_cpu_time_total / 6e6, e.count / 6) for e in p.key_averages()}
    res[name] = ops
    print(name, "wall s/step", round(wall / 6, 3), "CPU s/step", round(sum(v[0] for v in ops.values()), 3), "tgt tokens", ntok, flush=True)
    del tr
keys = sorted(set(res["baseline"]) | set(res[M]), key=lambda k: -(res[M].get(k, (0, 0))[0] - res["baseline"].get(k, (0, 0))[0]))
print(f"{'op':40s} {'base s':>8s} {'jam s':>8s} {'diff':>8s} {'base n':>7s} {'jam n':>7s}")
for k in keys[:30]:
    b, j = res["baseline"].get(k, (0, 0)), res[M].get(k, (0, 0))
    print(f"{k[:40]:40s} {b[0]:8.3f} {j[0]:8.3f} {j[0]-b[0]:8.3f} {b[1]:7.1f} {j[1]:7.1f}")
