"""Where a beam-5 decode of test_2016 spends its CPU time (torch profiler), on a checkpoint of bench/vs_fairseq.py.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-decode/profile_decode.py CHECKPOINT
  (PREC=auto|bf16 decodes in that precision instead of fp32; SHAPES=1 groups by input shapes; ROWS=N table rows)"""
import os, sys, time, torch
from pathlib import Path
from torch.profiler import profile, ProfilerActivity
from nmtcore.allocator import tune_allocator
from nmtcore.data import inference_batches, prepare_data
from nmtcore.decoding import beam_search
from nmtcore.decoding.translator import load_translator
from nmtcore.engine import setup_torch
tr = load_translator(Path(sys.argv[1]), {"data.data_dir": os.environ["NMTCORE_DATA"], "train.num_threads": 2})
setup_torch(tr.cfg); tune_allocator()
data = prepare_data(tr.cfg.data); split = data.splits["test_2016_flickr"]
dcfg = tr.cfg.decode.__class__(**{**tr.cfg.decode.__dict__, "beam": 5, "nbest": 1, "max_sentences": 128, "max_len_a": 1.2, "max_len_b": 10, "precision": os.environ.get("PREC", "fp32")})
batches = list(inference_batches(split, data.vocab, 128))
m = tr.model.eval()
beam_search.translate(m, batches[:2], dcfg)
t0 = time.perf_counter(); beam_search.translate(m, batches, dcfg); print("wall", time.perf_counter() - t0)
with profile(activities=[ProfilerActivity.CPU], record_shapes=bool(os.environ.get("SHAPES"))) as prof:
    beam_search.translate(m, batches, dcfg)
print(prof.key_averages(group_by_input_shape=bool(os.environ.get("SHAPES"))).table(sort_by="self_cpu_time_total", row_limit=int(os.environ.get("ROWS", 25))))
