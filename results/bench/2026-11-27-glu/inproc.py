"""BERT-JAM phase 1 (cached minilm) train steps, as committed (states stacked layer-major (B, L, M, H), each GLU a
matmul over them) against the code it replaced (stacked (B, M, L, H), each GLU an einsum), interleaved in one
process on the same batches so that the machine's drift hits both alike.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-27-glu/inproc.py [ROUNDS]"""
import os, sys, time, statistics, torch
sys.path.insert(0, "bench")  # run from the checkout's root
from bert_cache import MODELS
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer, setup_torch
from nmtcore.models import bert_jam
base = preset("multi30k_small").with_overrides({"data.data_dir": os.environ["NMTCORE_DATA"], "data.download": False,
    "train.num_threads": 2, "train.precision": "auto", "train.valid_bleu": False, "output_dir": "bench/out/glu"})
setup_torch(base)
cfg = base.with_overrides({**MODELS["bert_jam"][1], "model.bert.name": "minilm"})
data = prepare_data(cfg.data)
tr = build_trainer(cfg, data, device=torch.device("cpu"))
assert tr.phase_index == 0
from nmtcore.nn import EncoderOut, compute_dtype
NEW = {"glu": bert_jam.LayerGLU.forward, "encode": bert_jam.BertJam.encode}  # as committed


def einsum_forward(self, states):  # the replaced GLU: states (B, M, L, H)
    mix, pre_gate = torch.einsum("bmlh,lk->kbmh", states, torch.stack([self.alpha, self.beta], dim=1))
    return torch.sigmoid(pre_gate) * mix


def old_encode(self, batch):  # the replaced encode: states stacked (B, M, L, H)
    bert_out = self.bert(batch)
    states = bert_out.stack(1, compute_dtype(batch.src.device))  # (B, M, L, H)
    x = self.embed(batch.src, self.src_embed)
    for layer in self.encoder_layers:
        x = layer(x, batch.src_mask, self.compose(layer, states), bert_out.mask)
    return EncoderOut(out=self.encoder_norm(x), mask=batch.src_mask,
                      extras={"bert_states": states, "bert_mask": bert_out.mask})


batches = [b for _, b in zip(range(24), tr.train_batches(epoch=1))]
for b in batches[:4]:
    tr.train_step([b])
times = {"matmul": [], "einsum": []}
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
for r in range(ROUNDS):
    for name, glu, encode in (("einsum", einsum_forward, old_encode), ("matmul", NEW["glu"], NEW["encode"])):
        bert_jam.LayerGLU.forward, bert_jam.BertJam.encode = glu, encode
        for b in batches[4 + 4 * (r % 5): 8 + 4 * (r % 5)]:
            t0 = time.perf_counter(); tr.train_step([b]); times[name].append(time.perf_counter() - t0)
if ROUNDS:
    for k, v in times.items():
        print(k, "steps", len(v), "mean s/step", round(statistics.mean(v), 3), "median", round(statistics.median(v), 3))
    print("einsum/matmul mean:", round(statistics.mean(times["einsum"]) / statistics.mean(times["matmul"]), 3))
