"""PLM-sponsored's encode (its source BERT over the WordPiece stream) of the first 500 test_2016 sentences in decoding
batches of 128, bf16 autocast, no grad: transformers' sdpa against the platform's attention, alternated 11 times
after one untimed round. From the repository root: python results/bench/2026-11-29-short-softmax/encode_ab.py"""
import sys, time, os
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import torch
from transformers import PreTrainedModel
from decode_speed import MODELS
from nmtcore.bert import ensure_bert
from nmtcore.config import preset
from nmtcore.data import prepare_data, inference_batches
from nmtcore.engine import build_trainer, setup_torch
from nmtcore.allocator import tune_allocator
from nmtcore.devices import autocast
base = preset("multi30k_small").with_overrides({"data.data_dir": os.environ.get("NMTCORE_DATA", "../shared/data"), "data.download": False, "train.num_threads": 2, "output_dir": "bench/out/decode_speed"})
setup_torch(base); tune_allocator()
cfg = ensure_bert(base.with_overrides(MODELS["plm_sponsored"]))
data = prepare_data(cfg.data)
tr = build_trainer(cfg, data, device=torch.device("cpu"))
m = tr.model.eval()
hf = [x for x in m.modules() if isinstance(x, PreTrainedModel)]
split = data.splits["test_2016_flickr"].select(range(500))
from nmtcore.devices import autocast_dtype
batches = list(inference_batches(split, data.vocab, 128))
dt = autocast_dtype("auto", torch.device("cpu"))
def enc():
    t0 = time.perf_counter()
    with torch.no_grad(), autocast(dt, "cpu"):
        for b in batches: m.encode(b)
    return time.perf_counter() - t0
res = {"sdpa": [], "nmtcore": []}
for r in range(12):
    for impl in (["sdpa", "nmtcore"] if r % 2 == 0 else ["nmtcore", "sdpa"]):
        for x in hf: x.config._attn_implementation_internal = impl
        t = enc()
        if r: res[impl].append(t)
print({k: [round(x * 1e3, 1) for x in v] for k, v in res.items()})
print("sdpa/nmtcore encode time", sum(res["sdpa"]) / sum(res["nmtcore"]))
