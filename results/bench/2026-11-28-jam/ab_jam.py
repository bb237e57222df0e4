"""BERT-JAM phase 1 (cached minilm) train steps with the code of commit OLD (default 4b999f7: a GLU product per
layer, the ×2 as a multiply of each composed memory, the joint attention's probabilities sliced per part, the
drop-net average as w·a + w·b) against the checkout's, interleaved in one process on the same batches, the order
flipping each round, so that the machine's drift hits both alike. The old functions are taken from ``git show``
and set on the current classes for the old side's steps; one eval forward each way first compares the logits.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-jam/ab_jam.py [ROUNDS] [OLD]   (from the checkout's root)"""
import os, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import torch
from nmtcore.allocator import reexec_with_allocator
reexec_with_allocator()  # what a trial trains on
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 8
OLD_SHA = sys.argv[2] if len(sys.argv) > 2 else "4b999f7"
old_dir = Path(tempfile.mkdtemp())
for src, dst in (("nmtcore/nn/layers.py", "old_layers.py"), ("nmtcore/nn/drop_net.py", "old_drop_net.py"),
                 ("nmtcore/models/bert_jam.py", "old_bert_jam.py")):
    (old_dir / dst).write_text(subprocess.check_output(["git", "show", f"{OLD_SHA}:{src}"], text=True))
with open(old_dir / "old_bert_jam.py", "a") as f:  # the old module's joint attention and drop-net use the old helpers
    f.write("\nfrom old_layers import attend_parts\nfrom old_drop_net import combine\n")
sys.path[:0] = ["bench", str(old_dir)]
from bert_cache import MODELS
from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer, setup_torch
from nmtcore.models import bert_jam as bj
import old_bert_jam as ob

base = preset("multi30k_small").with_overrides({"data.data_dir": os.environ["NMTCORE_DATA"], "data.download": False,
    "train.num_threads": 2, "train.precision": "auto", "train.valid_bleu": False, "output_dir": "bench/out/ab_jam"})
setup_torch(base)
cfg = base.with_overrides({**MODELS["bert_jam"][1], "model.bert.name": "minilm"})
tr = build_trainer(cfg, prepare_data(cfg.data), device=torch.device("cpu"))
assert tr.phase_index == 0  # phase 1: BERT and the GLUs frozen
targets = [(bj.JointAttention, "forward"), (bj.BertJamDecoderLayer, "forward"), (bj.LayerGLU, "forward"),
           (bj.BertJam, "compose"), (bj.BertJam, "run_decoder"), (bj.BertJam, "encode")]
NEW = {t: getattr(*t) for t in targets}
OLD = {(c, n): getattr(getattr(ob, c.__name__), n) for c, n in targets}


def use(side):
    for (cls, name), fn in side.items():
        setattr(cls, name, fn)


batches = [b for _, b in zip(range(40), tr.train_batches(epoch=1))]
for b in batches[:4]:  # untimed: one-time costs
    tr.train_step([b])
tr.model.eval()
with torch.no_grad():
    use(OLD); old_out = tr.model(batches[5])
    use(NEW); new_out = tr.model(batches[5])
logits = lambda o: getattr(o, "logits", o)
print("max |new - old| of the logits, eval forward:", (logits(new_out) - logits(old_out)).abs().max().item())
times = {"old": [], "new": []}
for r in range(ROUNDS):
    order = (("old", OLD), ("new", NEW)) if r % 2 == 0 else (("new", NEW), ("old", OLD))
    for name, side in order:
        use(side)
        for b in batches[4 + 4 * (r % 9): 8 + 4 * (r % 9)]:
            t0 = time.perf_counter()
            tr.train_step([b])
            times[name].append(time.perf_counter() - t0)
for k, v in times.items():
    print(k, "steps", len(v), "mean s/step", round(statistics.mean(v), 3), "median", round(statistics.median(v), 3))
print(f"old/new, mean s/step: {statistics.mean(times['old']) / statistics.mean(times['new']):.3f} "
      f"loadavg={os.getloadavg()[0]:.1f}")
