"""Distilling a small BERT from a real encoder: the H axis of an offline size grid.

Recipe (TinyBERT's general distillation with MiniLMv2's relation loss, sized for a CPU):

* **Student**: a ``BertModel`` with the teacher's WordPiece vocabulary (its tokenizer files are copied),
  ``L`` layers, hidden ``H``, ``H/64`` heads of 64 (as Google's small BERTs), FFN ``4H``.
* **Initialisation**: the teacher's word, position and token-type embeddings projected onto the top-``H``
  principal directions ``V`` of its word-embedding table, so the student starts with the teacher's lexical
  geometry; the loss's per-layer projections start at ``V^T``. Transformer layers: transformers' init.
* **Loss** = hidden-state MSE + relation KL. *Hidden MSE*: student state ``i`` (0 = embeddings) through a
  learned map ``H → H_teacher`` against teacher state ``ceil(i * L_teacher / L)``. *Relation KL* (MiniLMv2):
  on the last layer of both, the queries (keys, values) of all heads are re-split into ``R = 8`` relation
  heads and ``softmax(Q_r Q_r^T / sqrt(d_r))`` compared by KL(teacher ‖ student). Relation heads, not
  attention maps, because the student's 2-4 heads cannot be paired with the teacher's 12; they only need R
  to divide both widths.
* **Data**: :func:`nmtcore.bert.text.training_text` (English: Multi30k train plus the non-test IWSLT'14 and
  document-level sets that are present, de-duplicated, Multi30k val/test sentences removed). The first
  256 sentences of Multi30k val give the held-out loss curve; the student's quality figure
  (:mod:`nmtcore.bert.quality`) is measured on all of val after training.
* **Optimisation**: AdamW (lr 1e-3, wd 0.01), 6 % linear warm-up then linear decay, length-bucketed
  batches of 32 sentences (≤ 64 WordPieces) in a seeded order, dropout off while distilling (the saved
  config keeps BERT's 0.1), gradient norm clipped at 1, deterministic algorithms: the same spec, teacher
  and text give bit-identical weights.

Measured on this project's 2-core machines (one thread): 600 steps take 4-7 CPU minutes for L2-4/H128-256,
and students distilled that briefly from all-MiniLM-L6-v2 stayed near chance on the quality probe
(replaced-token detection AUC 0.46-0.55, against 0.84 for ``minilm:L2``; 1,800 steps from ``minilm:L4``:
0.55): an H axis made this way is weak, and the report shows each cell's figure so a reader sees it. The default teacher is therefore
the bottom four MiniLM layers (their token states carry more than its sentence-tuned top) and the default
is 1,200 steps; ``distilled:L2-H128:steps=4800`` buys more.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nmtcore.bert.attention import use_platform_attention
from nmtcore.bert.distilled import DistillSpec, root_dir
from nmtcore.bert.errors import BertError
from nmtcore.bert.quality import pad_batch, quality_of
from nmtcore.bert.resolve import BertSpec, ResolvedBert, resolve_bert
from nmtcore.bert.text import heldout_text, text_sha256, training_text
from nmtcore.bert.truncate import TOKENIZER_FILES
from nmtcore.config import DataConfig
from nmtcore.files import atomic_write_text, build_directory_once, sha256_file

log = logging.getLogger("nmtcore.bert")

FORMAT = 1  # bump when the recipe changes the result for the same spec


@dataclass(frozen=True)
class Recipe:
    """The fixed part of the recipe (stored in meta.json)."""

    batch_size: int = 32
    max_length: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_fraction: float = 0.06
    relation_heads: int = 8
    eval_every: int = 100
    eval_sentences: int = 256
    bucket_batches: int = 50


@dataclass
class DistillResult:
    """Where a student is, its name, its meta.json, and whether it came from the cache."""

    path: Path
    name: str
    meta: dict[str, Any]
    cached: bool


def distill_bert(spec: DistillSpec, data: DataConfig, cache_dir: Path, threads: int | None = None,
                 progress: Callable[[str], None] | None = None, recipe: Recipe = Recipe(),
                 lines: list[str] | None = None, eval_lines: list[str] | None = None) -> DistillResult:
    """Distil ``spec`` (or reuse the cached student) and return where it is. ``lines``/``eval_lines``
    replace the text (tests pass tiny ones; the text checksum keys the cache either way)."""
    teacher = resolve_bert(BertSpec(spec.teacher), cache_dir=cache_dir)
    if teacher.hf_config().model_type != "bert":
        raise BertError(f"distilled BERT {spec.name}: the teacher {spec.teacher} must be a BertModel")
    text = None
    if lines is None:
        text = training_text(data, "en")
        lines = text.lines
    if eval_lines is None:
        eval_lines = heldout_text(data, "en")[: recipe.eval_sentences]
    text_sha = text_sha256(lines)
    teacher_sha = sha256_file(teacher.path / "model.safetensors")
    final = root_dir(cache_dir) / spec.dirname / f"{teacher_sha[:12]}-{text_sha[:12]}"
    made: dict[str, dict] = {}

    def make(tmp: Path) -> None:
        old_threads = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            meta = _distill(spec, recipe, teacher, lines, eval_lines, tmp, progress or log.info)
            meta.update(teacher_weights_sha256=teacher_sha, text_sha256=text_sha, text_sentences=len(lines),
                        text=text.describe() if text is not None else {"sentences": len(lines), "sha256": text_sha})
            (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
            made["meta"] = meta
        finally:
            torch.set_num_threads(old_threads)

    if not build_directory_once(final, make):
        return DistillResult(final, spec.name, json.loads((final / "meta.json").read_text(encoding="utf-8")), True)
    meta = made["meta"]
    # The held-out figure that says whether the student knows language, stored with it.
    student = resolve_bert(BertSpec(spec.name), cache_dir=cache_dir, allow_network=False)
    q = quality_of(student, "en", data, cache_dir)
    meta["quality"] = asdict(q)
    atomic_write_text(final / "meta.json", json.dumps(meta, indent=2) + "\n")
    (progress or log.info)(f"{spec.name}: held-out distillation loss {meta['heldout_loss']:.4f}; {q.describe()}")
    return DistillResult(final, spec.name, meta, False)


def _distill(spec: DistillSpec, recipe: Recipe, teacher_bert: ResolvedBert, lines: list[str], eval_lines: list[str],
             out: Path, progress: Callable[[str], None]) -> dict[str, Any]:
    from transformers import BertConfig as HFBertConfig
    from transformers import BertModel

    t_start, c_start = time.perf_counter(), time.process_time()
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        tok = teacher_bert.load_tokenizer()
        teacher = teacher_bert.load_model().eval().requires_grad_(False)
        t_cap = Capture(teacher.encoder.layer[-1].attention.self)
        tc = teacher.config
        if spec.hidden > tc.hidden_size:
            raise BertError(f"{spec.name}: a student is at most as wide as its teacher ({spec.teacher}: H{tc.hidden_size})")
        if spec.hidden % recipe.relation_heads or tc.hidden_size % recipe.relation_heads:
            raise BertError(f"{spec.name}: {recipe.relation_heads} relation heads must divide both widths")
        ids = tok(lines, truncation=True, max_length=recipe.max_length)["input_ids"]
        eval_ids = tok(eval_lines, truncation=True, max_length=recipe.max_length)["input_ids"]
        mapping = layer_map(spec.layers, tc.num_hidden_layers)
        student_cfg = HFBertConfig(
            vocab_size=tc.vocab_size, hidden_size=spec.hidden, num_hidden_layers=spec.layers,
            num_attention_heads=max(1, spec.hidden // 64), intermediate_size=4 * spec.hidden, hidden_act="gelu",
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=tc.max_position_embeddings,
            type_vocab_size=tc.type_vocab_size, layer_norm_eps=tc.layer_norm_eps, pad_token_id=tc.pad_token_id,
            initializer_range=0.02)
        torch.manual_seed(spec.seed)
        student = use_platform_attention(BertModel(student_cfg, add_pooling_layer=False))  # as it will be loaded
        distiller = Distiller(student, tc.hidden_size, len(mapping), recipe.relation_heads)
        v = pca_projection(teacher.embeddings.word_embeddings.weight, spec.hidden)
        with torch.no_grad():
            for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
                getattr(student.embeddings, name).weight.copy_(getattr(teacher.embeddings, name).weight @ v)
            for p in distiller.proj:
                p.weight.copy_(v)
                p.bias.zero_()

        eval_batches = []
        for s in range(0, len(eval_ids), 64):
            e_ids, e_att = pad_batch(eval_ids[s : s + 64], tok.pad_token_id)
            eval_batches.append((e_ids, e_att, *_teacher_outputs(teacher, t_cap, e_ids, e_att, mapping)))

        def heldout() -> float:
            distiller.eval()
            total, n = 0.0, 0
            with torch.no_grad():
                for e_ids, e_att, th, tq in eval_batches:
                    mse, rel = distiller.loss(e_ids, e_att, th, tq)
                    total += (mse.item() + rel.item()) * e_ids.shape[0]
                    n += e_ids.shape[0]
            distiller.train()
            return total / max(1, n)

        params = [p for p in distiller.parameters() if p.requires_grad]
        opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": recipe.weight_decay},
                                 {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=recipe.lr)
        warm = max(1, int(recipe.warmup_fraction * spec.steps))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warm, max(0.0, (spec.steps - s) / max(1, spec.steps - warm))))
        batches = batch_schedule([len(x) for x in ids], recipe.batch_size, spec.steps, recipe.bucket_batches, spec.seed)
        curve = [{"step": 0, "heldout": heldout()}]
        progress(f"distilling {spec.name} from {spec.teacher}: {spec.steps} steps on {len(lines)} sentences "
                 f"(held-out loss at step 0: {curve[0]['heldout']:.4f})")
        distiller.train()
        t_train = time.perf_counter()
        for step, batch in enumerate(batches, start=1):
            b_ids, b_att = pad_batch([ids[i] for i in batch], tok.pad_token_id)
            th, tq = _teacher_outputs(teacher, t_cap, b_ids, b_att, mapping)
            mse, rel = distiller.loss(b_ids, b_att, th, tq)
            opt.zero_grad(set_to_none=True)
            (mse + rel).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            if step % recipe.eval_every == 0 or step == spec.steps:
                curve.append({"step": step, "heldout": heldout(), "seconds": round(time.perf_counter() - t_train, 1)})
                progress(f"distilling {spec.name}: step {step}/{spec.steps}, held-out loss {curve[-1]['heldout']:.4f}, "
                         f"{curve[-1]['seconds']:.0f} s")
        t_cap.remove()
        distiller.capture.remove()
    finally:
        torch.use_deterministic_algorithms(deterministic)

    from safetensors.torch import save_file

    student.config.hidden_dropout_prob = student.config.attention_probs_dropout_prob = 0.1
    student.config.architectures = ["BertModel"]
    student.config.save_pretrained(str(out))
    save_file({k: v.detach().contiguous() for k, v in student.state_dict().items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        if (teacher_bert.path / name).is_file():
            shutil.copyfile(teacher_bert.path / name, out / name)
    return {"kind": "distilled", "format": FORMAT, "name": spec.name, "teacher": spec.teacher,
            "teacher_resolved": teacher_bert.describe(), "steps": spec.steps, "seed": spec.seed,
            "layer_map": mapping, "recipe": asdict(recipe),
            "student": {"layers": spec.layers, "hidden": spec.hidden, "heads": student_cfg.num_attention_heads,
                        "params": int(sum(p.numel() for p in student.parameters()))},
            "sentences_seen": spec.steps * recipe.batch_size,
            "epochs_seen": round(spec.steps * recipe.batch_size / max(1, len(lines)), 3),
            "heldout": f"Multi30k val.en, first {len(eval_lines)} sentences", "heldout_loss": curve[-1]["heldout"],
            "heldout_curve": curve, "weights_sha256": sha256_file(out / "model.safetensors", memo=False),
            "seconds": round(time.perf_counter() - t_start, 1), "cpu_seconds": round(time.process_time() - c_start, 1),
            "threads": torch.get_num_threads()}


def layer_map(student_layers: int, teacher_layers: int) -> list[int]:
    """Teacher hidden-state index for each student hidden-state index 0..L (uniform, ceil)."""
    return [0] + [math.ceil(i * teacher_layers / student_layers) for i in range(1, student_layers + 1)]


def pca_projection(table: torch.Tensor, dim: int) -> torch.Tensor:
    """The top-``dim`` principal directions (columns, D x dim) of the rows of ``table``; sign-fixed."""
    x = table.double() - table.double().mean(0, keepdim=True)
    _, _, vh = torch.linalg.svd(x, full_matrices=False)
    v = vh[:dim].T                                   # D x min(dim, rank)
    signs = torch.sign(v[v.abs().argmax(0), torch.arange(v.shape[1])])
    v = v * signs
    if v.shape[1] < dim:  # fewer embedding rows than dimensions (tiny vocabularies): zero columns
        v = torch.cat([v, v.new_zeros(v.shape[0], dim - v.shape[1])], dim=1)
    return v.float()


class Capture:
    """Forward hooks recording the outputs of the Q, K, V projections of one BertSelfAttention."""

    def __init__(self, self_attention: nn.Module) -> None:
        self.out: dict[str, torch.Tensor] = {}
        self.handles = [
            getattr(self_attention, name).register_forward_hook(self._hook(name)) for name in ("query", "key", "value")
        ]

    def _hook(self, name: str) -> Callable:
        def hook(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
            self.out[name] = out
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def relation_kl(t: torch.Tensor, s: torch.Tensor, mask: torch.Tensor, heads: int) -> torch.Tensor:
    """MiniLMv2 relation KL(teacher || student) for one of Q/K/V.

    ``t``: (B, T, Dt), ``s``: (B, T, Ds), ``mask``: (B, T) 1 for real tokens. Returns a scalar: the KL
    of the T x T scaled-dot-product relation distributions, averaged over real query tokens and heads.
    """
    def rel(x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        xh = x.view(b, n, heads, d // heads).transpose(1, 2)          # B R T d
        scores = xh @ xh.transpose(-1, -2) / math.sqrt(d // heads)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        return F.log_softmax(scores, dim=-1)

    lt, ls = rel(t), rel(s)
    kl = (lt.exp() * (lt - ls)).masked_fill(mask[:, None, None, :] == 0, 0.0).sum(-1)   # B R T
    w = mask[:, None, :].to(kl.dtype)
    return (kl * w).sum() / (w.sum() * heads)


class Distiller(nn.Module):
    """Student + loss projections; computes the distillation loss against given teacher outputs."""

    def __init__(self, student: nn.Module, teacher_hidden: int, n_pairs: int, relation_heads: int) -> None:
        super().__init__()
        self.student = student
        self.proj = nn.ModuleList(nn.Linear(student.config.hidden_size, teacher_hidden) for _ in range(n_pairs))
        self.relation_heads = relation_heads
        self.capture = Capture(student.encoder.layer[-1].attention.self)

    def loss(
        self, ids: torch.Tensor, att: torch.Tensor, t_hidden: list[torch.Tensor], t_qkv: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, float, float]:
        """Total loss, hidden-MSE part and relation part for one batch."""
        out = self.student(input_ids=ids, attention_mask=att, output_hidden_states=True)
        m = att.unsqueeze(-1).to(torch.float32)
        n_real = m.sum() * t_hidden[0].shape[-1]
        mse = torch.stack(
            [(((p(h) - th) ** 2) * m).sum() / n_real for p, h, th in zip(self.proj, out.hidden_states, t_hidden)]
        ).mean()
        rel = torch.stack(
            [relation_kl(t_qkv[k], self.capture.out[k], att, self.relation_heads) for k in ("query", "key", "value")]
        ).mean()
        return mse, rel


def _teacher_outputs(
    teacher: nn.Module, cap: Capture, ids: torch.Tensor, att: torch.Tensor, mapping: list[int]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    with torch.no_grad():
        out = teacher(input_ids=ids, attention_mask=att, output_hidden_states=True)
    return [out.hidden_states[g] for g in mapping], dict(cap.out)


def batch_schedule(lengths: list[int], batch_size: int, steps: int, bucket_batches: int, seed: int) -> list[list[int]]:
    """``steps`` batches of sentence indices: seeded shuffle, length-sorted buckets, shuffled batches.

    Walks through the corpus epoch by epoch (each epoch a fresh permutation) until ``steps`` batches exist.
    """
    rng = np.random.default_rng(seed)
    batches: list[list[int]] = []
    while len(batches) < steps:
        perm = rng.permutation(len(lengths))
        bucket = batch_size * bucket_batches
        epoch: list[list[int]] = []
        for s in range(0, len(perm), bucket):
            chunk = sorted(perm[s : s + bucket].tolist(), key=lambda i: lengths[i])
            epoch += [chunk[j : j + batch_size] for j in range(0, len(chunk), batch_size) if len(chunk[j : j + batch_size]) == batch_size]
        rng.shuffle(epoch)
        batches += epoch
    return batches[:steps]


