"""Does a BERT know language? One figure per encoder, measured frozen on held-out text.

Many of the platform's encoders have no masked-LM head (all-MiniLM-L6-v2 and its truncations, students
distilled here, multilingual-e5-small), so MLM accuracy cannot be read off them. Two probes train only a
small head on the frozen last-layer states of probe-training text (a fixed sample of Multi30k
``train.{lang}``) and are scored on held-out text (Multi30k ``val.{lang}``, which nothing made here trains
on, :mod:`nmtcore.bert.text`). Each encoder uses its own tokenizer; corruptions and masks depend only on
fixed seeds and the token ids, so encoders sharing a tokenizer see identical inputs.

**The quality figure: replaced-token-detection AUC** (``rtd_auc``, reported as ``bert_quality``). In each
sentence 15 % of the non-special tokens (at least one) are replaced by a draw from the unigram
distribution of the probe-training text; a logistic regression on the frozen state of every token learns
to flag replaced tokens; the figure is the ROC AUC on the held-out sentences. Chance is 0.5, and a
randomly initialised encoder of the same size stays near it (its states carry each token's identity but
not what fits where, and a linear head cannot build that); an encoder that knows which words fit their
context scores well above. It feeds ordinary tokens only, so it is fair to encoders whose ``[MASK]`` was
never trained (all-MiniLM-L6-v2's ``[MASK]`` embedding has norm 0.25, below never-used rows).

**Second figure: masked-token probe accuracy** (``mlm_accuracy``): 15 % of the non-special tokens become the
mask token; BERT's MLM head (dense, GELU, LayerNorm, decoder tied to the frozen input embeddings plus a
bias) is trained on the masked positions' states; top-1 accuracy on held-out masked tokens, with the
softmax over the ids seen in the probe-training text. On Multi30k a random encoder already reaches ~0.18
from frequency and position (``mlm_majority`` is the always-the-most-frequent-token figure), so read it
against those. Figures are comparable between encoders sharing a tokenizer.

Measured once per (weights, language, probe version) and cached under
``<cache_dir>/bert/quality/<weights sha256[:16]>.<lang>.v<version>.json``; ``nmtcore bert-quality NAME``
prints it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from nmtcore.bert.attention import use_platform_attention
from nmtcore.bert.resolve import BertError, ResolvedBert
from nmtcore.bert.text import heldout_text
from nmtcore.config import DataConfig
from nmtcore.data import corpus_file, read_lines
from nmtcore.files import atomic_write_text, file_lock, sha256_file

log = logging.getLogger("nmtcore.bert")

QUALITY_VERSION = 1  # bump when ProbeConfig's defaults or the probes change


@dataclass(frozen=True)
class ProbeConfig:
    """Everything that changes the figures (stored with them)."""

    train_sentences: int = 2000  # sampled from Multi30k train.{lang} with sample_seed (both probes)
    sample_seed: int = 0
    max_length: int = 64
    encode_batch: int = 64
    corrupt_fraction: float = 0.15
    rtd_seed: int = 4321
    rtd_steps: int = 600
    rtd_batch_size: int = 512
    rtd_lr: float = 1e-3
    mask_seed: int = 1234
    mlm_steps: int = 600
    mlm_batch_size: int = 256
    mlm_lr: float = 2e-3
    head_seed: int = 0


@dataclass
class Quality:
    """The probe figures of one encoder on one language's held-out text."""

    rtd_auc: float  # the quality figure: held-out ROC AUC of replaced-token detection (chance 0.5)
    mlm_accuracy: float  # top-1 on held-out masked tokens
    mlm_top5: float
    mlm_majority: float  # always guessing the most frequent training target
    lang: str
    heldout: str
    n_heldout_tokens: int
    layers: int
    hidden: int
    weights_sha256: str
    random_init: bool = False
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    config: dict[str, Any] = field(default_factory=dict)
    version: int = QUALITY_VERSION

    @property
    def figure(self) -> float:
        """The one number a report shows: the replaced-token detection AUC."""
        return self.rtd_auc

    def describe(self) -> str:
        """Both figures against their chance levels, and the text they were measured on."""
        return (f"replaced-token detection AUC {self.rtd_auc:.3f} (chance 0.5), masked-token top-1 "
                f"{self.mlm_accuracy:.3f} (most-frequent-token {self.mlm_majority:.3f}) on {self.heldout}")


def _weights_file(path: Path) -> Path:
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return path / name
    raise BertError(f"{path}: no model.safetensors or pytorch_model.bin to fingerprint")


def cache_path(resolved: ResolvedBert, lang: str, cache_dir: Path, cfg: ProbeConfig = ProbeConfig()) -> Path:
    """Where the quality figure of these weights on ``lang`` text is cached: keyed by the weights' checksum,
    the language, the figure's version and any non-default probe setting."""
    sha = sha256_file(_weights_file(resolved.path))
    custom = "" if cfg == ProbeConfig() else "." + hashlib.sha256(repr(asdict(cfg)).encode()).hexdigest()[:8]
    return Path(cache_dir) / "bert" / "quality" / f"{sha[:16]}.{lang}.v{QUALITY_VERSION}{custom}.json"


def cached_quality(resolved: ResolvedBert, lang: str, cache_dir: Path, cfg: ProbeConfig = ProbeConfig()) -> Quality | None:
    """The stored figures of this encoder on ``lang`` (with probe settings ``cfg``), or None."""
    path = cache_path(resolved, lang, cache_dir, cfg)
    if not path.is_file():
        return None
    return Quality(**json.loads(path.read_text(encoding="utf-8")))


def quality_of(resolved: ResolvedBert, lang: str, data: DataConfig, cache_dir: Path,
               cfg: ProbeConfig = ProbeConfig()) -> Quality:
    """The figures of this encoder on ``lang``: from the cache, else measured once (under a lock) and stored."""
    path = cache_path(resolved, lang, cache_dir, cfg)
    with file_lock(path.with_suffix(".lock")):
        hit = cached_quality(resolved, lang, cache_dir, cfg)
        if hit is not None:
            return hit
        log.info("BERT %s: measuring its quality figure on held-out %s text (once; about a minute)", resolved.name, lang)
        q = measure(resolved, lang, data, cfg)
        atomic_write_text(path, json.dumps(asdict(q), indent=2) + "\n")
        log.debug("BERT %s quality on %s measured in %.0f s", resolved.spec, lang, q.seconds)
        return q


def probe_text(data: DataConfig, lang: str, n: int, seed: int) -> list[str]:
    """The probe-training sample: ``n`` lines of Multi30k ``train.{lang}`` drawn with ``seed``."""
    from dataclasses import replace

    pool = [x for x in read_lines(corpus_file(replace(data, corpus="multi30k"), "train", lang)) if x]
    pick = np.random.default_rng(seed).choice(len(pool), size=min(n, len(pool)), replace=False)
    return [pool[i] for i in sorted(pick.tolist())]


def measure(resolved: ResolvedBert, lang: str, data: DataConfig, cfg: ProbeConfig = ProbeConfig(),
            random_init: bool = False, init_seed: int = 0, train_lines: Sequence[str] | None = None,
            heldout_lines: Sequence[str] | None = None) -> Quality:
    """Run both probes on one encoder (``random_init``: a freshly initialised twin of the same config).
    ``train_lines``/``heldout_lines`` default to the Multi30k sample / ``val`` of ``lang``."""
    from transformers import AutoModel

    t0, c0 = time.perf_counter(), time.process_time()
    if random_init:
        torch.manual_seed(init_seed)
        model = use_platform_attention(AutoModel.from_config(resolved.hf_config(), add_pooling_layer=False))
    else:
        model = resolved.load_model()
    tok = resolved.load_tokenizer()
    model.eval().requires_grad_(False)
    train_lines = list(train_lines) if train_lines is not None else probe_text(data, lang, cfg.train_sentences,
                                                                                cfg.sample_seed)
    heldout = list(heldout_lines) if heldout_lines is not None else heldout_text(data, lang)
    special = set(tok.all_special_ids)
    mask_id, pad_id = tok.mask_token_id, tok.pad_token_id
    if mask_id is None or pad_id is None:
        raise BertError(f"BERT {resolved.spec}: its tokenizer has no mask or pad token, which the probes need")

    def ids_of(lines: list[str]) -> list[list[int]]:
        return tok(lines, truncation=True, max_length=cfg.max_length, add_special_tokens=True)["input_ids"]

    tr_ids, ho_ids = ids_of(train_lines), ids_of(heldout)
    counts = torch.bincount(torch.tensor([t for s in tr_ids for t in s if t not in special]), minlength=len(tok))
    seen = torch.nonzero(counts).squeeze(1)
    probs = (counts[seen].double() / counts[seen].sum()).numpy()
    rtd_tr, rtd_tr_lab = corrupt_sentences(tr_ids, special, seen.numpy(), probs, cfg.corrupt_fraction, cfg.rtd_seed)
    rtd_ho, rtd_ho_lab = corrupt_sentences(ho_ids, special, seen.numpy(), probs, cfg.corrupt_fraction, cfg.rtd_seed + 1)
    tr_m, tr_pos, tr_tgt = mask_sentences(tr_ids, special, mask_id, cfg.corrupt_fraction, cfg.mask_seed)
    ho_m, ho_pos, ho_tgt = mask_sentences(ho_ids, special, mask_id, cfg.corrupt_fraction, cfg.mask_seed + 1)
    with torch.no_grad():
        xr_tr, yr_tr = token_features(model, rtd_tr, rtd_tr_lab, pad_id, cfg.encode_batch)
        xr_ho, yr_ho = token_features(model, rtd_ho, rtd_ho_lab, pad_id, cfg.encode_batch)
        x_tr = masked_features(model, tr_m, tr_pos, pad_id, cfg.encode_batch)
        x_ho = masked_features(model, ho_m, ho_pos, pad_id, cfg.encode_batch)

    torch.manual_seed(cfg.head_seed)
    rtd_head = nn.Linear(xr_tr.shape[1], 1)
    _train(rtd_head, lambda out, y: F.binary_cross_entropy_with_logits(out.squeeze(-1), y.float()),
           xr_tr, yr_tr, cfg.rtd_steps, cfg.rtd_batch_size, cfg.rtd_lr, cfg.head_seed)
    with torch.no_grad():
        auc = roc_auc(rtd_head(xr_ho).squeeze(-1), yr_ho)

    y_tr_full = torch.tensor([t for ts in tr_tgt for t in ts], dtype=torch.long)
    y_ho_full = torch.tensor([t for ts in ho_tgt for t in ts], dtype=torch.long)
    emb = model.get_input_embeddings().weight.detach()
    remap = torch.full((max(emb.shape[0], len(tok)),), -1, dtype=torch.long)
    remap[seen] = torch.arange(len(seen))
    y_tr, y_ho = remap[y_tr_full], remap[y_ho_full]
    keep = y_tr >= 0
    torch.manual_seed(cfg.head_seed)
    head = MLMHead(x_tr.shape[1], emb[seen], float(getattr(model.config, "layer_norm_eps", 1e-12)))
    _train(head, F.cross_entropy, x_tr[keep], y_tr[keep], cfg.mlm_steps, cfg.mlm_batch_size, cfg.mlm_lr, cfg.head_seed)
    with torch.no_grad():
        logits = torch.cat([head(x_ho[s : s + 1024]) for s in range(0, len(x_ho), 1024)])
        covered = y_ho >= 0
        top5 = logits.topk(min(5, logits.shape[1]), dim=-1).indices
        hit1 = (top5[:, 0] == y_ho) & covered
        hit5 = (top5 == y_ho[:, None]).any(-1) & covered
    majority = int(torch.bincount(y_tr_full).argmax())
    config = model.config
    return Quality(
        rtd_auc=auc, mlm_accuracy=hit1.float().mean().item(), mlm_top5=hit5.float().mean().item(),
        mlm_majority=(y_ho_full == majority).float().mean().item(), lang=lang,
        heldout=f"Multi30k val.{lang} ({len(heldout)} sentences)" if heldout_lines is None else f"{len(heldout)} given sentences",
        n_heldout_tokens=int(len(yr_ho)), layers=int(config.num_hidden_layers), hidden=int(config.hidden_size),
        weights_sha256=sha256_file(_weights_file(resolved.path)), random_init=random_init,
        seconds=round(time.perf_counter() - t0, 1), cpu_seconds=round(time.process_time() - c0, 1), config=asdict(cfg))


def mask_sentences(
    ids: Sequence[Sequence[int]], special_ids: set[int], mask_id: int, fraction: float, seed: int
) -> tuple[list[list[int]], list[list[int]], list[list[int]]]:
    """Replace ``fraction`` of the non-special tokens of each sentence (>= 1) by ``mask_id``.

    Returns (masked ids, masked positions, original ids at those positions). Deterministic in ``seed``
    and the token ids.
    """
    rng = np.random.default_rng(seed)
    masked, positions, targets = [], [], []
    for seq in ids:
        cand = [i for i, t in enumerate(seq) if t not in special_ids]
        if not cand:
            masked.append(list(seq)); positions.append([]); targets.append([])
            continue
        n = max(1, int(round(fraction * len(cand))))
        pos = sorted(rng.choice(cand, size=n, replace=False).tolist())
        new = list(seq)
        for p in pos:
            new[p] = mask_id
        masked.append(new); positions.append(pos); targets.append([seq[p] for p in pos])
    return masked, positions, targets


@torch.no_grad()
def masked_features(
    model: nn.Module, masked: list[list[int]], positions: list[list[int]], pad_id: int, batch: int
) -> torch.Tensor:
    """Last hidden states at the masked positions, in sentence order (length-sorted batches)."""
    order = sorted(range(len(masked)), key=lambda i: len(masked[i]))
    per_sent: dict[int, torch.Tensor] = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        x, att = pad_batch([masked[i] for i in idx], pad_id)
        h = model(input_ids=x, attention_mask=att).last_hidden_state
        for r, i in enumerate(idx):
            per_sent[i] = h[r, positions[i]].float()
    return torch.cat([per_sent[i] for i in range(len(masked))], dim=0)


def corrupt_sentences(
    ids: Sequence[Sequence[int]], special_ids: set[int], vocab: np.ndarray, probs: np.ndarray, fraction: float, seed: int
) -> tuple[list[list[int]], list[list[int]]]:
    """Replace ``fraction`` of the non-special tokens (>= 1) by unigram draws from ``vocab``/``probs``.

    Returns (corrupted ids, labels) with label 1 = replaced, 0 = original, -1 = special (ignored).
    A draw equal to the original token leaves it original (label 0).
    """
    rng = np.random.default_rng(seed)
    out, labels = [], []
    for seq in ids:
        new = list(seq)
        lab = [-1 if t in special_ids else 0 for t in seq]
        cand = [i for i, t in enumerate(seq) if t not in special_ids]
        if cand:
            n = max(1, int(round(fraction * len(cand))))
            for p in rng.choice(cand, size=n, replace=False).tolist():
                draw = int(vocab[rng.choice(len(vocab), p=probs)])
                if draw != seq[p]:
                    new[p], lab[p] = draw, 1
        out.append(new); labels.append(lab)
    return out, labels


@torch.no_grad()
def token_features(
    model: nn.Module, ids: list[list[int]], labels: list[list[int]], pad_id: int, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Last hidden states and labels of every token with label >= 0, in sentence order."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    per_sent: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        x, att = pad_batch([ids[i] for i in idx], pad_id)
        h = model(input_ids=x, attention_mask=att).last_hidden_state
        for r, i in enumerate(idx):
            lab = torch.tensor(labels[i])
            keep = lab >= 0
            per_sent[i] = (h[r, : len(ids[i])][keep].float(), lab[keep])
    return (torch.cat([per_sent[i][0] for i in range(len(ids))]), torch.cat([per_sent[i][1] for i in range(len(ids))]))


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """ROC AUC (Mann-Whitney, ties averaged) of ``scores`` for binary ``labels``."""
    s = scores.double().numpy()
    y = labels.numpy().astype(bool)
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):                      # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    n_pos, n_neg = y.sum(), (~y).sum()
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def pad_batch(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists → ``(input_ids, attention_mask)``, right-padded with ``pad_id`` to the longest."""
    width = max(len(s) for s in seqs)
    x = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros((len(seqs), width), dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, : len(s)] = torch.tensor(s)
        att[r, : len(s)] = 1
    return x, att


class MLMHead(nn.Module):
    """BERT's MLM head over a frozen, tied embedding table: dense, GELU, LayerNorm, E^T + bias."""

    def __init__(self, hidden: int, emb: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, emb.shape[1])
        self.norm = nn.LayerNorm(emb.shape[1], eps=eps)
        self.register_buffer("emb", emb.detach().clone().float(), persistent=False)
        self.bias = nn.Parameter(torch.zeros(emb.shape[0]))
        nn.init.normal_(self.dense.weight, std=0.02)
        nn.init.zeros_(self.dense.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(h))) @ self.emb.T + self.bias


def _train(head: nn.Module, loss_fn: Any, x: torch.Tensor, y: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> None:
    """Adam with cosine decay on random minibatches (seeded)."""
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    gen = torch.Generator().manual_seed(seed)
    head.train()
    for _ in range(steps):
        b = torch.randint(0, len(y), (batch,), generator=gen)
        loss = loss_fn(head(x[b]), y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    head.eval()


