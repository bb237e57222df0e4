"""A/B in one process, old and new alternated (the order flipping each round), of one of this folder's changes:

- ``step_attention``: ``nmtcore.nn.layers.softmax`` and ``attention_scores`` (new) against ``torch.softmax`` and the
  bf16 product (old);
- ``softmax``: ``nmtcore.nn.layers.softmax`` alone against ``torch.softmax``;
- ``hf_attention``: ``transformers`` encoders on the platform's attention (new) against ``transformers``' sdpa (old).

``decode``: beam 5 over the first 500 test_2016 sentences, every hypothesis 15 tokens (as bench/decode_speed.py),
one untimed round, then ROUNDS timed; hypotheses of the last round compared. ``train``: blocks of 5 updates on
the same batches, ROUNDS blocks each way, time per target token. From the repository root:

  python results/bench/2026-11-29-short-softmax/ab.py step_attention decode baseline,plm_sponsored
  python results/bench/2026-11-29-short-softmax/ab.py hf_attention train plm_sponsored
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import torch  # noqa: E402

from nmtcore.allocator import reexec_with_allocator  # noqa: E402

switch, mode, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
rounds = int(os.environ.get("ROUNDS", 3 if mode == "decode" else 6))
if mode == "train":
    reexec_with_allocator()  # as a sweep's trial trains

from decode_speed import MODELS  # noqa: E402
from finetune_memory import CASES  # noqa: E402
from transformers import PreTrainedModel  # noqa: E402

from nmtcore.allocator import tune_allocator  # noqa: E402
from nmtcore.bert import ensure_bert  # noqa: E402
from nmtcore.config import DecodeConfig, preset  # noqa: E402
from nmtcore.data import prepare_data  # noqa: E402
from nmtcore.decoding import translate_split  # noqa: E402
from nmtcore.engine import build_trainer, setup_torch  # noqa: E402
from nmtcore.nn import layers as L  # noqa: E402

base = preset("multi30k_small").with_overrides({
    "data.data_dir": os.environ.get("NMTCORE_DATA", "../shared/data"), "data.download": False,
    "train.num_threads": 2, "train.valid_bleu": False, "output_dir": "bench/out/ab"})
setup_torch(base)
trainers = {}
for name in names:
    cfg = ensure_bert(base.with_overrides({**MODELS, **CASES}[name]))
    data = prepare_data(cfg.data)
    trainers[name] = (build_trainer(cfg, data, device=torch.device("cpu")), data)

NEW = (L.softmax, L.attention_scores)


def use(tag: str) -> None:
    new = tag == "new"
    if switch in ("step_attention", "softmax"):
        L.softmax = NEW[0] if new else (lambda x: torch.softmax(x, dim=-1))
    if switch == "step_attention":
        L.attention_scores = NEW[1] if new else (lambda q, k: (q @ k.transpose(-1, -2)).float())
    if switch == "hf_attention":
        for tr, _ in trainers.values():
            for m in tr.model.modules():
                if isinstance(m, PreTrainedModel):
                    m.config._attn_implementation_internal = "nmtcore" if new else "sdpa"


res: dict = {}
if mode == "decode":
    tune_allocator()  # as a decoding process
    dcfg = DecodeConfig(beam=5, max_len_a=0.0, max_len_b=15, min_len=15, max_sentences=128)
    hyps = {}
    for r in range(rounds + 1):
        for name, (tr, data) in trainers.items():
            split = data.splits["test_2016_flickr"].select(range(500))
            for tag in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                use(tag)
                t0 = time.perf_counter()
                hyps[name, tag] = translate_split(tr.model, split, data.vocab, dcfg, tr.device)
                dt = time.perf_counter() - t0
                if r:
                    res.setdefault((name, tag), []).append(dt)
                print(r, name, tag, f"{dt:.3f} s", flush=True)
    for name in trainers:
        same = sum(a == b for a, b in zip(hyps[name, "old"], hyps[name, "new"]))
        print(f"RESULT {switch} decode {name}: old/new time {sum(res[name, 'old']) / sum(res[name, 'new']):.3f} "
              f"(old {[round(x, 3) for x in res[name, 'old']]}, new {[round(x, 3) for x in res[name, 'new']]}); "
              f"same hypotheses {same}/{len(hyps[name, 'old'])}")
    if "baseline" in trainers and len(trainers) > 1:
        for name in trainers:
            if name != "baseline":
                print(f"RESULT {name} speed vs baseline: old "
                      f"{sum(res['baseline', 'old']) / sum(res[name, 'old']):.3f}, new "
                      f"{sum(res['baseline', 'new']) / sum(res[name, 'new']):.3f}")
else:
    for name, (tr, _) in trainers.items():
        batches = list(tr.train_batches(2))
        for tag in ("old", "new"):  # warm-up
            use(tag)
            for b in batches[:2]:
                tr.train_step([b])
        i = 2
        for r in range(rounds):
            for tag in (["old", "new"] if r % 2 == 0 else ["new", "old"]):
                use(tag)
                t0, tokens = time.perf_counter(), 0
                for b in batches[i:i + 5]:
                    tokens += tr.train_step([b])["n_tokens"]
                res.setdefault((name, tag), []).append((time.perf_counter() - t0) / tokens * 1e3)
                print(r, name, tag, f"{res[name, tag][-1]:.3f} ms/token", flush=True)
            i += 5
        print(f"RESULT {switch} train {name}: old/new time per target token "
              f"{sum(res[name, 'old']) / sum(res[name, 'new']):.3f} (old {[round(x, 3) for x in res[name, 'old']]}, "
              f"new {[round(x, 3) for x in res[name, 'new']]})")
