"""Shared building blocks: positions, attention with incremental caches, FFN, Transformer layers.

Every model family builds from these; nothing here knows about BERT or about a particular model.
Attention goes through :func:`attend`: ``torch.nn.functional.scaled_dot_product_attention`` (flash /
memory-efficient kernels) on GPUs and for long fp32 sequences on the CPU, two matmuls and a softmax for
the short sequences the CPU trains on (see there why).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtcore.devices import shape_free_cuda_attention
from nmtcore.nn.cache import LayerCache


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """The dtype matmuls run in on ``device`` here: autocast's where it is on, else fp32. For inputs that would
    otherwise be cast again by every op that reads them (a model casts them once, to this)."""
    kind = torch.device(device).type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else torch.float32


def causal_mask(t_q: int, t_k: int, device: torch.device | str) -> Tensor:
    """(Tq, Tk) bool, True = may attend: query i sees keys 0 … Tk − Tq + i (the last query the last key, so an
    incremental step's queries see the whole prefix)."""
    return torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril(t_k - t_q)


def key_padding_to_attn_mask(key_padding_mask: Tensor | None) -> Tensor | None:
    """(B, S) True = padding → (B, 1, 1, S) SDPA boolean mask, True = may attend."""
    if key_padding_mask is None:
        return None
    return ~key_padding_mask[:, None, None, :]


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """``F.dropout`` with the same semantics (zero with probability ``p``, scale the rest by 1/(1 − p)),
    drawing its mask faster on the CPU: one 64-bit draw of torch's generator gives four 16-bit uniforms,
    so ``p`` is realised to within 2^-17. ``F.dropout``'s per-element Bernoulli draws took ~10% of a CPU
    training step at d 256; this takes about half of that. Seeded and checkpointed like any other draw of
    the default generator. Elsewhere (CUDA) it is ``F.dropout``, which is fused there."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu" or p >= 1.0 or not x.is_floating_point():
        return F.dropout(x, p, training)
    n = x.numel()
    bits = torch.empty((n + 3) // 4, dtype=torch.int64).random_(-(2**63), None)  # full 64-bit range
    r = bits.view(torch.int16)[:n].view(x.shape)  # uniform on [-32768, 32767]
    keep = r >= round(p * 65536) - 32768  # P(keep) = 1 − p (to 2^-17)
    return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))


class FastDropout(nn.Dropout):
    """``nn.Dropout`` drawing its mask as :func:`dropout` does (the same semantics, faster on the CPU). It is an
    ``nn.Dropout``, so code that finds or sets a model's dropout modules (their ``p``) treats it as one."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


def use_fast_dropout(module: nn.Module) -> int:
    """Replace every plain ``nn.Dropout`` inside ``module`` (a ``transformers`` model's) by a
    :class:`FastDropout` of the same rate; returns how many: a fine-tuned BERT's dropouts then skip ``F.dropout``'s
    per-element Bernoulli draws on the CPU (docs/performance.md)."""
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Dropout:
                setattr(parent, name, FastDropout(child.p, child.inplace))
                swapped += 1
    return swapped


@functools.lru_cache(maxsize=None)
def cpu_softmax_vector_width() -> int:
    """Float32 lanes of the vector unit ATen's CPU kernels were dispatched for (16 on AVX512, 8 on AVX2 and
    elsewhere): its last-dimension softmax is vectorised only for rows at least that long."""
    return 16 if torch.backends.cpu.get_cpu_capability().upper().startswith("AVX512") else 8


class _ShortRowSoftmax(torch.autograd.Function):
    """Softmax over the last dimension from elementwise ops, forward and backward (``p·(g − Σ g·p)``)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        p = (x - x.amax(-1, keepdim=True)).exp_()
        p = p.div_(p.sum(-1, keepdim=True))
        ctx.save_for_backward(p)
        return p

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        (p,) = ctx.saved_tensors
        return p * (grad - (grad * p).sum(-1, keepdim=True))


def softmax(x: Tensor) -> Tensor:
    """``torch.softmax(x, dim=-1)``, the same values (a row of only −inf gives NaN, as there), faster for the
    short rows of this project's attention on the CPU: ATen's CPU kernel vectorises the last dimension only for
    rows of at least one vector (:func:`cpu_softmax_vector_width`) and is ~14x slower per element below it
    (2 cores, AVX512, fp32, 123k rows of 15 against rows of 16: 2.83 against 0.21 ms). Attention over at most 15
    keys (self-attention of Multi30k's short sentences in training, every decoding step up to the 15th) takes
    elementwise ops instead: forward 0.13 against 0.65 ms, forward + backward 0.27 against 0.97 ms for
    (200, 4, 12, 12). Under ``torch.compile`` the graph keeps ``torch.softmax`` (inductor fuses it)."""
    if (torch.compiler.is_compiling() or x.device.type != "cpu" or x.dtype != torch.float32
            or not 0 < x.size(-1) < cpu_softmax_vector_width()):  # compiling first: dynamo would trace the lru_cache
        return torch.softmax(x, dim=-1)
    return _ShortRowSoftmax.apply(x)


class SinusoidalPositions(nn.Module):
    """Fixed sinusoidal position encodings (Vaswani et al.), fairseq layout: [sin | cos] halves."""

    def __init__(self, max_positions: int, dim: int) -> None:
        super().__init__()
        half = dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
        pos = torch.arange(max_positions, dtype=torch.float32)[:, None] * freq[None, :]  # (P, C/2)
        self.register_buffer("table", torch.cat([pos.sin(), pos.cos()], dim=1), persistent=False)  # (P, C)

    def forward(self, length: int, offset: int = 0) -> Tensor:
        """The position encodings of positions offset .. offset + T − 1: (T, C)."""
        if offset + length > self.table.size(0):
            raise ValueError(f"sequence of length {offset + length} exceeds max_positions={self.table.size(0)}")
        return self.table[offset : offset + length]  # (T, C)


def _explicit_path(q: Tensor, t_k: int) -> bool:
    """Whether attention of ``q`` (B, H, Tq, Dh) over ``t_k`` keys takes the explicit CPU path (see :func:`attend`)."""
    return q.device.type == "cpu" and (q.size(2) == 1 or q.dtype != torch.float32 or t_k <= 64)


def queries_per_memory_row(q: Tensor, k: Tensor) -> int:
    """How many consecutive rows of ``q`` (R, H, Tq, Dh) share each row of ``k`` (n, H, Tk, Dh): 1 when they
    match; g = R / n when beam search keeps a fixed memory's keys/values once per sentence for its g beams."""
    r, n = q.size(0), k.size(0)
    if r == n:
        return 1
    if n == 0 or r % n:
        raise ValueError(f"attention: {r} query rows cannot share {n} key/value rows (need a multiple)")
    return r // n


def group_rows(x: Tensor, g: int) -> Tensor:
    """(n·g, H, T, X) → (n, H, g·T, X): each group of g consecutive rows as one row of g·T queries."""
    r, h, t, d = x.shape
    return x.reshape(r // g, g, h, t, d).transpose(1, 2).reshape(r // g, h, g * t, d)


def ungroup_rows(x: Tensor, g: int) -> Tensor:
    """The inverse of :func:`group_rows`: (n, H, g·T, X) → (n·g, H, T, X)."""
    n, h, gt, d = x.shape
    return x.reshape(n, h, g, gt // g, d).transpose(1, 2).reshape(n * g, h, gt // g, d)


FEW_QUERIES = 8  # see attention_scores


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """``q·kᵀ`` in fp32, (B, H, Tq, Dh) × (B, H, Tk, Dh) → (B, H, Tq, Tk), unscaled.

    Low-precision operands of at most :data:`FEW_QUERIES` query rows (a decoding step: one query, or a
    sentence's beams over a shared memory) on the CPU outside autograd are widened to fp32 first: a batch
    of such thin bf16 products costs per product (2 cores, 640 rows × 12 heads of 32, one query over 3-25
    keys: 0.70-1.93 ms in bf16 against 0.15-0.67 ms widening both and multiplying in fp32; 4 heads of 64
    0.46-1.05 against 0.11-0.32; 5 grouped queries 0.12-0.43 against 0.05-0.28), where a sequence of queries
    multiplies faster in bf16 (15 queries: 0.14-0.28 against 0.52-3.9 ms). The scores are then the exact
    fp32 products of the bf16-rounded operands instead of bf16-rounded products."""
    if (q.size(2) <= FEW_QUERIES and q.device.type == "cpu" and q.dtype != torch.float32
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))):
        return q.float() @ k.float().transpose(-1, -2)
    return (q @ k.transpose(-1, -2)).float()


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, dropout_p: float) -> Tensor:
    """Multi-head attention (B, H, Tq, Dh) × (B, H, Tk, Dh) → (B, H, Tq, Dh); ``mask`` True = may attend,
    ``causal`` aligns the last query with the last key (an incremental step's queries see the prefix).

    On the CPU, short sequences take an explicit path (two matmuls, the softmax in fp32 as inside the fused
    kernels) instead of ``scaled_dot_product_attention``: its CPU flash kernel is tiled for long sequences,
    and at this project's lengths it costs, forward and backward (1 thread, 4 heads of 64, ~3k tokens per
    batch): 4-7x the explicit path in bf16 for 12-50 tokens and ~2x up to 200 (the backward was 24% of a
    bf16 training step at d 256), 1.1-1.3x in fp32 up to 50 tokens, less than it beyond ~64; for single-query
    decoding steps 2-4x. CUDA always takes SDPA (flash / memory-efficient kernels; not cuDNN's, see
    :func:`nmtcore.devices.shape_free_cuda_attention`).

    Keys/values with fewer rows than ``q`` are a memory shared by groups of consecutive query rows (beam
    search keeps one row of encoder/BERT keys per sentence, its beams' queries are ``g`` consecutive rows;
    :func:`queries_per_memory_row`): each group attends as one row of g·Tq queries, ``mask`` then has one row
    per memory row (or broadcasts) and no query dimension.
    """
    g = queries_per_memory_row(q, k)
    if g > 1:  # beams over one shared memory row: attend as one sentence's g·Tq queries
        if causal:
            raise ValueError("attend: grouped queries (a memory shared by several rows) take no causal mask")
        return ungroup_rows(attend(group_rows(q, g), k, v, mask, False, dropout_p), g)
    t_q, t_k = q.size(2), k.size(2)
    if q.is_cuda:
        shape_free_cuda_attention()
    explicit = _explicit_path(q, t_k)
    if causal and (explicit or mask is not None or t_q != t_k):  # SDPA's is_causal: no mask, top-left aligned
        allowed = causal_mask(t_q, t_k, q.device)  # (Tq, Tk)
        mask, causal = (allowed if mask is None else mask & allowed), False
    if explicit:
        s = attention_scores(q, k) * (q.size(-1) ** -0.5)  # (B, H, Tq, Tk)
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        probs = dropout(softmax(s), dropout_p, True)
        return probs.to(v.dtype) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout_p)


def attend_parts(q: Tensor, parts: list[tuple[Tensor, Tensor, Tensor | None]], dropout_p: float,
                 tap: Callable[[list[Tensor]], None] | None = None) -> Tensor:
    """Attention of ``q`` (B, H, Tq, Dh) over the concatenation of several key/value sequences, each given as
    ``(k, v, mask)`` with k, v (B, H, Tk_i, Dh) and ``mask`` broadcastable to (B, 1, Tq, Tk_i) (True = may
    attend; None = every key): one softmax over all of them, as :func:`attend` over the concatenated keys,
    values and masks (BERT-JAM's joint attention, the PLM-sponsored coordinator's r_all).

    A decoding step (Tq = 1) on the CPU never concatenates the parts: each is scored against the query, only
    the scores (B, H, 1, ΣTk) are joined for the softmax, and the output is the sum of each part's
    probabilities times its values, where concatenating copied every part's whole cache at every step and
    layer. Everywhere else the parts are concatenated and attended as one sequence (:func:`attend`: SDPA's
    fused kernels on CUDA, one product per side on the CPU): over a sequence of queries, as in training,
    the copy costs less than a second product per part and the scores' join (BERT-JAM phase 1 on 2 cores,
    bf16, blocks of 5 updates on the same batches alternated 12 times: 0.945 of the per-part path's time
    per target token).

    ``tap`` (the diagnostics' probes, :class:`nmtcore.nn.probes.PartShares`): takes the per-part path and is
    handed, before dropout, the probability mass each part received, one (B, H, Tq) fp32 tensor per part."""
    t_q, t_k = q.size(2), sum(k.size(2) for k, _, _ in parts)
    groups = [queries_per_memory_row(q, k) for k, _, _ in parts]  # > 1: a memory shared by beams (see attend)
    if tap is None and (t_q > 1 or not _explicit_path(q, t_k)):
        b = q.size(0)
        masks = [torch.ones(1, 1, 1, 1, dtype=torch.bool, device=q.device) if m is None else m for _, _, m in parts]
        masks = [m.repeat_interleave(g, 0) if g > 1 and m.size(0) > 1 else m for m, g in zip(masks, groups)]
        mask = torch.cat([m.expand(b, 1, t_q, k.size(2)) for m, (k, _, _) in zip(masks, parts)], dim=-1)
        keys = torch.cat([k.repeat_interleave(g, 0) if g > 1 else k for (k, _, _), g in zip(parts, groups)], dim=2)
        values = torch.cat([v.repeat_interleave(g, 0) if g > 1 else v for (_, v, _), g in zip(parts, groups)], dim=2)
        return attend(q, keys, values, mask, False, dropout_p)
    scale = q.size(-1) ** -0.5
    joined = []
    for (k, _, mask), g in zip(parts, groups):  # a shared memory is scored once per sentence for all its beams
        s = attention_scores(q if g == 1 else group_rows(q, g), k) * scale  # (B, H, Tq, Tk_i)
        s = s if mask is None else s.masked_fill(~mask, float("-inf"))
        joined.append(s if g == 1 else ungroup_rows(s, g))
    probs = softmax(torch.cat(joined, dim=-1))  # (B, H, Tq, ΣTk)
    if tap is not None:
        tap([p.float().sum(-1) for p in probs.split([k.size(2) for k, _, _ in parts], dim=-1)])
    probs = dropout(probs, dropout_p, True)
    # split, not slices: its backward joins the parts' gradients in one cat, where each slice's filled a
    # zeroed copy of the whole probabilities and summed them.
    out = None
    for p, (_, v, _), g in zip(probs.split([k.size(2) for k, _, _ in parts], dim=-1), parts, groups):
        y = p.to(v.dtype) @ v if g == 1 else ungroup_rows(group_rows(p.to(v.dtype), g) @ v, g)  # (B, H, Tq, Dh)
        out = y if out is None else out + y
    return out


WIDE_CACHE_MIN_HEAD_DIM = 64  # see wide_decoding_cache


def wide_decoding_cache(q: Tensor) -> bool:
    """Whether a decoder's self-attention keeps its incremental keys/values in fp32 and attends a single new
    position in fp32, for queries ``q`` (B, H, T, Dh): on the CPU, outside autograd, under a low-precision
    autocast (decoding in bf16), for heads of at least :data:`WIDE_CACHE_MIN_HEAD_DIM` dimensions.

    The attention of one query over a cached prefix is a batch of (1 × Dh) · (Dh × t) products, one per row
    and head, too small for the matmul kernels to pay off, so their cost is per product. Measured on 2 cores
    (bf16 against fp32, one step and layer, 640 rows, t = 4-16): 4 heads of 64, 0.84-1.13 ms against
    0.33-0.44 ms; 12 heads of 32, 1.5-2.3 ms against 0.9-2.2 ms. Keeping the prefix in fp32 doubles its
    memory and the bytes of its reorder copies, so it pays only for the wider heads. Decoding test_2016 with
    the 3+3 d 256 model (4 heads of 64), alternated with the bf16 cache in one process: beam 5 in 1/1.04 of
    the time (medians of 10 pairs, 3.38 against 3.53 s), greedy in 1/1.18 (8 pairs, 1.29 against 1.53 s);
    the PLM-sponsored model's decoder (12 heads of 32) widened too took 1/0.94 of it (beam 5, 3 pairs).
    Computing the scores in fp32, where autocast rounded q and k to bf16, changes a few beams (74 of 1000
    sentences there; BLEU 26.32 against 26.39 on test_2016, 26.29 against 26.24 on val).

    Since :func:`attention_scores` scores every decoding step's few bf16 query rows in fp32 anyway, the wider
    prefix pays only where the rows are not copied at every step: a cache marked
    :attr:`~nmtcore.nn.cache.LayerCache.reordered_each_step` (beam search) stays in bf16. The trained 500-update
    baseline of ``bench/vs_fairseq.py`` on the full test_2016, 4 alternated pairs in one process
    (2026-11-29, ``results/bench/2026-11-29-beam-cache/``): beam 5 with the fp32 prefix took 1.054x and 1.079x
    the bf16 prefix's time (BLEU 26.81 against 26.75), greedy with a bf16 prefix 1.12x and 1.16x the fp32
    prefix's (24.28 against 24.36)."""
    kind = q.device.type
    return (kind == "cpu" and q.size(-1) >= WIDE_CACHE_MIN_HEAD_DIM and not torch.is_grad_enabled()
            and torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) != torch.float32)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, T, C) → (B, H, T, C/H)."""
    b, t, c = x.shape
    return x.view(b, t, heads, c // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, T, Dh) → (B, T, H·Dh)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class SelfAttention(nn.Module):
    """Multi-head self-attention with a fused QKV projection and a growing incremental cache."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        # Xavier with gain 1/sqrt(2) over the fused (3d x d) matrix: a bound 1/sqrt(2) of fairseq's, whose gain
        # 1/sqrt(2) falls on each (d x d) projection alone (a smaller post-norm start; the biases keep nn.Linear's
        # default where fairseq zeroes them).
        nn.init.xavier_uniform_(self.qkv.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        causal: bool = False,
        cache: LayerCache | None = None,
    ) -> Tensor:
        """Multi-head self-attention of ``x`` (B, T, C), causal or with a key padding mask, incrementally with
        ``cache``."""
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 × (B, T, C)
        q, k, v = split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads)
        mask = key_padding_to_attn_mask(key_padding_mask)
        dropout_p = self.attention_dropout if self.training else 0.0
        if cache is not None:
            # Incremental decoding: x holds only the new position(s); attend to the whole prefix.
            wide = wide_decoding_cache(q) and not cache.reordered_each_step  # fp32 prefix and query: see there
            k, v = cache.grow(k.float(), v.float()) if wide else cache.grow(k, v)  # (B, H, t+1, Dh)
            if wide and q.size(2) == 1:
                with torch.autocast(x.device.type, enabled=False):
                    y = attend(q.float(), k, v, mask, False, dropout_p)  # (B, H, 1, Dh) fp32
                return self.out(merge_heads(y))
            causal = causal and q.size(2) > 1
        y = attend(q, k, v, mask, causal, dropout_p)  # (B, H, T, Dh)
        return self.out(merge_heads(y))


class CrossAttention(nn.Module):
    """Multi-head attention from a query sequence to a fixed memory (encoder output, BERT states).

    ``kdim`` is the memory width (BERT's hidden size for BERT attention). With a cache, the memory's
    keys/values are projected once at the first step and stored under ``name``.
    """

    def __init__(self, d_model: int, heads: int, attention_dropout: float, kdim: int | None = None) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(kdim or d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        gain = 1 / math.sqrt(2) if (kdim or d_model) == d_model else 1.0
        nn.init.xavier_uniform_(self.q.weight, gain=gain)
        nn.init.xavier_uniform_(self.kv.weight, gain=gain)
        nn.init.xavier_uniform_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of the memory (encoder output or BERT states), split into heads: computed once per sentence
        and cached."""
        k, v = self.kv(memory).chunk(2, dim=-1)  # 2 × (B, S, C)
        return split_heads(k, self.heads), split_heads(v, self.heads)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        memory_mask: Tensor | None,
        cache: LayerCache | None = None,
        name: str = "enc",
    ) -> Tensor:
        """Multi-head attention of ``x`` (B, T, C) over the memory, its keys and values from the cache when it holds
        them."""
        q = split_heads(self.q(x), self.heads)  # (B, H, T, Dh)
        if cache is not None:
            k, v = cache.memory(name, lambda: self.project_memory(memory))
        else:
            k, v = self.project_memory(memory)
        y = attend(q, k, v, key_padding_to_attn_mask(memory_mask), False,
                   self.attention_dropout if self.training else 0.0)  # (B, H, T, Dh)
        return self.out(merge_heads(y))


class FeedForward(nn.Module):
    """Position-wise FFN: fc1, activation, activation dropout, fc2."""

    def __init__(self, d_model: int, ffn_dim: int, activation: str, activation_dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.act = F.relu if activation == "relu" else F.gelu
        self.activation_dropout = activation_dropout
        for lin in (self.fc1, self.fc2):
            nn.init.xavier_uniform_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x: Tensor) -> Tensor:
        """fc2(dropout(act(fc1(x))))."""
        h = dropout(self.act(self.fc1(x)), self.activation_dropout, self.training)
        return self.fc2(h)


class Residual(nn.Module):
    """Dropout + residual + LayerNorm around a sublayer, post-norm (fairseq default) or pre-norm."""

    def __init__(self, d_model: int, dropout: float, pre_norm: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.dropout = dropout
        self.pre_norm = pre_norm

    def before(self, x: Tensor) -> Tensor:
        """The sublayer input: normalised first under pre-norm."""
        return self.norm(x) if self.pre_norm else x

    def after(self, residual: Tensor, y: Tensor) -> Tensor:
        """``residual + dropout(y)``, then the layer norm in post-norm (pre-norm normed before the sublayer)."""
        x = residual + dropout(y, self.dropout, self.training)
        return x if self.pre_norm else self.norm(x)


class EncoderLayer(nn.Module):
    """Self-attention → FFN, each wrapped in :class:`Residual`."""

    def __init__(self, d_model: int, heads: int, ffn_dim: int, dropout: float, attention_dropout: float,
                 activation_dropout: float, activation: str, pre_norm: bool) -> None:
        super().__init__()
        self.self_attn = SelfAttention(d_model, heads, attention_dropout)
        self.self_res = Residual(d_model, dropout, pre_norm)
        self.ffn = FeedForward(d_model, ffn_dim, activation, activation_dropout)
        self.ffn_res = Residual(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        """Self-attention then the FFN, each in a residual block (pre- or post-norm as configured)."""
        x = self.self_res.after(x, self.self_attn(self.self_res.before(x), key_padding_mask=mask))
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))


class DecoderLayer(nn.Module):
    """Causal self-attention → encoder attention → FFN, each wrapped in :class:`Residual`."""

    def __init__(self, d_model: int, heads: int, ffn_dim: int, dropout: float, attention_dropout: float,
                 activation_dropout: float, activation: str, pre_norm: bool) -> None:
        super().__init__()
        self.self_attn = SelfAttention(d_model, heads, attention_dropout)
        self.self_res = Residual(d_model, dropout, pre_norm)
        self.cross_attn = CrossAttention(d_model, heads, attention_dropout)
        self.cross_res = Residual(d_model, dropout, pre_norm)
        self.ffn = FeedForward(d_model, ffn_dim, activation, activation_dropout)
        self.ffn_res = Residual(d_model, dropout, pre_norm)

    def forward(self, x: Tensor, enc: Tensor, enc_mask: Tensor, cache: LayerCache | None = None) -> Tensor:
        # Right-padded targets need no key padding mask under a causal mask: a real position never
        # sees a later (pad) one, and pad positions are excluded from the loss.
        """Causal self-attention, encoder-decoder attention, the FFN, each in a residual block; incremental with
        ``cache``."""
        x = self.self_res.after(x, self.self_attn(self.self_res.before(x), causal=True, cache=cache))
        x = self.cross_res.after(x, self.cross_attn(self.cross_res.before(x), enc, enc_mask, cache=cache))
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))
