"""Six BERT-JAM phase-1 steps under torch.profiler with the replaced code, then six with the committed code (inproc.py's
trainer, batches and patches): the ops that take the most CPU time in each.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-27-glu/profile_ops.py (not profile.py: that name would shadow the standard library module here)"""
import runpy, sys, torch
sys.argv = ["inproc", "0"]
g = runpy.run_path("results/bench/2026-11-27-glu/inproc.py")
from torch.profiler import profile, ProfilerActivity
bj, tr, batches = g["bert_jam"], g["tr"], g["batches"]
for name, glu, encode in (("einsum", g["einsum_forward"], g["old_encode"]), ("matmul", g["NEW"]["glu"], g["NEW"]["encode"])):
    bj.LayerGLU.forward, bj.BertJam.encode = glu, encode
    tr.train_step([batches[5]])
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for b in batches[4:10]:
            tr.train_step([b])
    print("==", name)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
    ops = {e.key: e for e in p.key_averages()}
    total = sum(e.self_cpu_time_total for e in ops.values()) / 1e6
    print(f"{name}: CPU s per step {total / 6:.3f}; per step, with their children: " + ", ".join(
        f"{k} {ops[k].cpu_time_total / 6e6:.3f} s" for k in ("aten::einsum", "aten::matmul", "aten::copy_") if k in ops))
