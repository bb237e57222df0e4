"""Batches: token-budget batching (fairseq style), padding and collation of one or two token streams.

:func:`batch_indices` groups sentences under a padded-token budget (the BERT stream counted too when a
model reads one), :func:`collate` pads them into a :class:`Batch`, :func:`collate_bert` adds the BERT
extras, :func:`inference_batches` orders decoding batches by length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

from nmtcore.data.dataset import BertInputs, EncodedSplit
from nmtcore.data.vocab import SubwordVocab


# ---------------------------------------------------------------------------------------------- batching
@dataclass
class Batch:
    """A padded batch. Rows are sentences; ``ids`` are their indices in the split they came from."""

    src: Tensor  # (B, S) int64: subwords + [eos], right-padded with pad_id
    src_mask: Tensor  # (B, S) bool, True = padding
    tgt_in: Tensor  # (B, T) int64: [bos] + subwords, right-padded
    tgt_out: Tensor  # (B, T) int64: subwords + [eos], right-padded
    tgt_mask: Tensor  # (B, T) bool, True = padding (same for tgt_in and tgt_out)
    ids: Tensor  # (B,) int64
    extras: dict[str, Tensor] = field(default_factory=dict)  # model-family inputs (BERT: collate_bert), batch first
    # Counted on the CPU at collate time so reading it after .to("cuda") does not sync the device.
    _n_tgt_tokens: int | None = field(default=None, repr=False, compare=False)

    @property
    def n_tgt_tokens(self) -> int:
        """Non-pad target tokens (what the loss is normalised by)."""
        if self._n_tgt_tokens is None:
            self._n_tgt_tokens = int((~self.tgt_mask).sum())
        return self._n_tgt_tokens

    @property
    def size(self) -> int:
        """Number of sentences B."""
        return self.src.shape[0]

    def map(self, fn: Callable[[Tensor], Tensor]) -> "Batch":
        """A copy with ``fn`` applied to every tensor (extras included); ``n_tgt_tokens`` carried over."""
        return Batch(src=fn(self.src), src_mask=fn(self.src_mask), tgt_in=fn(self.tgt_in), tgt_out=fn(self.tgt_out),
                     tgt_mask=fn(self.tgt_mask), ids=fn(self.ids), extras={k: fn(v) for k, v in self.extras.items()},
                     _n_tgt_tokens=self.n_tgt_tokens)

    def tensors(self) -> list[Tensor]:
        """Every tensor of the batch in a fixed order (the fields, then the extras by name)."""
        return [self.src, self.src_mask, self.tgt_in, self.tgt_out, self.tgt_mask, self.ids,
                *(self.extras[k] for k in sorted(self.extras))]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor (extras included) on ``device``."""
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "Batch":
        """A copy in pinned host memory, so ``to(cuda, non_blocking=True)`` is truly asynchronous."""
        return self.map(Tensor.pin_memory)


def _greedy_bounds(lens: np.ndarray, max_tokens: int, max_sentences: int) -> list[int]:
    """End positions of greedy batches over non-decreasing ``lens`` (each >= 1).

    A batch starting at i holds i..j-1 for the largest j with ``lens[j-1] * (j - i) <= max_tokens``:
    as ``lens`` is sorted, ``lens[j-1]`` is the batch's longest sentence and the cost is monotone in
    j, so one searchsorted per batch finds j. A sentence alone over budget still gets a batch.
    """
    n = len(lens)
    cap = max_sentences if max_sentences > 0 else n
    bounds: list[int] = []
    i = 0
    while i < n:
        # lens[j] >= lens[i], so no batch starting at i can hold more than max_tokens // lens[i].
        w = min(n - i, cap, max(1, max_tokens // int(lens[i])))
        cost = lens[i : i + w] * np.arange(1, w + 1)  # (w,) padded tokens if the batch ended here
        k = max(1, int(np.searchsorted(cost, max_tokens, side="right")))
        i += k
        bounds.append(i)
    return bounds


def batch_indices(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, max_sentences: int = 0,
                  shuffle: bool = True, seed: int = 1, epoch: int = 1, rank: int = 0,
                  world_size: int = 1, bert_lens: np.ndarray | None = None) -> list[np.ndarray]:
    """Token-budget batches of sentence indices for one epoch (fairseq-style), for one DDP rank.

    ``src_lens``/``tgt_lens`` are subword counts without bos/eos. A sentence costs
    ``L = max(src_len, tgt_len) + 1`` (the eos / bos), and a batch of n sentences costs
    ``max(L) * n`` padded tokens, which is kept ``<= max_tokens`` (and ``n <= max_sentences`` if > 0).
    With ``bert_lens`` (the BERT stream's lengths, [CLS]/[SEP] included) a sentence costs
    ``max(L, bert_len)``, so every padded stream of a batch (source, target, BERT) stays in the budget. The
    trainer does not pass it (a BERT arm trains on its control's batches); :func:`iterate_batches` does.
    A sentence with ``L > max_tokens`` on its own gets a batch of one (it is never dropped).

    Sentences are sorted by L, ties broken by target length, then source length, then (if
    ``shuffle``) a random key, so padding is minimal; batches are filled greedily in that order, and
    with ``shuffle`` the batch order is permuted. Both random draws come from
    ``numpy.random.default_rng((seed, epoch))``: the same (seed, epoch) gives the same batches on
    every process, a new epoch gives new ones. Without ``shuffle`` ties keep index order and batches
    run from short to long.

    With ``world_size > 1`` the batch list is padded to a multiple of ``world_size`` by repeating
    its first batches (so a few sentences are seen twice in that epoch), and rank ``r`` gets batches
    ``r, r + world_size, ...``: every rank gets the same number of batches, as DDP needs.
    """
    src = np.asarray(src_lens, dtype=np.int64)
    tgt = np.asarray(tgt_lens, dtype=np.int64)
    if src.shape != tgt.shape or src.ndim != 1:
        raise ValueError(f"src_lens and tgt_lens must be 1-D of equal length, got {src.shape} and {tgt.shape}")
    if max_tokens <= 0 or max_sentences < 0:
        raise ValueError(f"need max_tokens > 0 and max_sentences >= 0, got {max_tokens}, {max_sentences}")
    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    if len(src) == 0:
        return []
    cost = np.maximum(src, tgt) + 1  # (N,)
    if bert_lens is not None:
        cost = np.maximum(cost, np.asarray(bert_lens, dtype=np.int64))  # (N,)
    rng = np.random.default_rng((seed, epoch))
    keys = (src, tgt, cost)  # np.lexsort: last key is the primary one
    if shuffle:
        keys = (rng.random(len(src)),) + keys
    order = np.lexsort(keys)  # (N,)
    batches = np.split(order, _greedy_bounds(cost[order], max_tokens, max_sentences)[:-1])
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    if world_size > 1:
        short = -len(batches) % world_size
        batches = batches + [batches[i % len(batches)] for i in range(short)]
        batches = batches[rank::world_size]
    return batches


def _fill(seqs: list[np.ndarray], lens: np.ndarray, out: np.ndarray, offset: int) -> None:
    """Write row b of ``out`` from column ``offset`` on with ``seqs[b]``, without a Python loop."""
    total = int(lens.sum())
    if total == 0:
        return
    flat = np.concatenate(seqs)  # (total,)
    rows = np.repeat(np.arange(len(seqs)), lens)  # (total,)
    starts = np.cumsum(lens) - lens  # (B,)
    cols = np.arange(total) - np.repeat(starts, lens) + offset  # (total,)
    out[rows, cols] = flat


def collate(split: EncodedSplit, indices: Sequence[int] | np.ndarray, pad_id: int, bos_id: int,
            eos_id: int) -> Batch:
    """Pad the pairs ``indices`` of ``split`` into a :class:`Batch` (see its field comments).

    A split with a BERT stream also fills ``extras`` (:func:`collate_bert`).
    """
    idx = np.asarray(indices, dtype=np.int64)  # (B,)
    if idx.ndim != 1 or len(idx) == 0:
        raise ValueError(f"collate needs a non-empty 1-D list of indices, got shape {idx.shape}")
    B = len(idx)
    rows = np.arange(B)
    src_lens, tgt_lens = split.src_lens[idx], split.tgt_lens[idx]  # (B,)
    S, T = int(src_lens.max()) + 1, int(tgt_lens.max()) + 1

    src = np.full((B, S), pad_id, dtype=np.int64)
    _fill([split.src[i] for i in idx], src_lens, src, 0)
    src[rows, src_lens] = eos_id

    tgt_seqs = [split.tgt[i] for i in idx]
    tgt_out = np.full((B, T), pad_id, dtype=np.int64)
    _fill(tgt_seqs, tgt_lens, tgt_out, 0)
    tgt_in = np.full((B, T), pad_id, dtype=np.int64)
    tgt_in[:, 1:] = tgt_out[:, :-1]  # shift right; the eos is written after, so it never enters tgt_in
    tgt_in[:, 0] = bos_id
    tgt_out[rows, tgt_lens] = eos_id

    src_mask = np.arange(S)[None, :] > src_lens[:, None]  # (B, S)
    tgt_mask = np.arange(T)[None, :] > tgt_lens[:, None]  # (B, T)
    return Batch(src=torch.from_numpy(src), src_mask=torch.from_numpy(src_mask),
                 tgt_in=torch.from_numpy(tgt_in), tgt_out=torch.from_numpy(tgt_out),
                 tgt_mask=torch.from_numpy(tgt_mask), ids=torch.from_numpy(idx.copy()),
                 extras=collate_bert(split.bert, idx, S) if split.bert is not None else {},
                 _n_tgt_tokens=int(tgt_lens.sum()) + B)


def collate_bert(bert: BertInputs, idx: np.ndarray, src_width: int) -> dict[str, Tensor]:
    """The BERT extras of a batch, all right-padded (left padding would shift BERT's absolute positions):

    ``bert_ids`` (B, Tb) int64, ``bert_mask`` (B, Tb) bool True = padding, ``bert_segments`` (B, Tb) int64,
    ``bert_align`` (B, S, 2) int64 ``[start, end)`` WordPiece span per NMT source position (``S`` =
    ``src_width``; padding rows are empty spans), and ``bert_features`` (B, Tb, K, H) float16 when the split
    has cached features.
    """
    B = len(idx)
    lens = bert.lens[idx]  # (B,)
    Tb = int(lens.max())
    ids = np.full((B, Tb), bert.pad_id, dtype=np.int64)
    _fill([bert.ids[i] for i in idx], lens, ids, 0)
    segments = np.zeros((B, Tb), dtype=np.int64)
    _fill([bert.segments[i] for i in idx], lens, segments, 0)
    align = np.zeros((B, src_width, 2), dtype=np.int64)
    for b, i in enumerate(idx):
        a = bert.align[i]  # (src_len + 1, 2)
        align[b, : len(a)] = a
    extras = {"bert_ids": torch.from_numpy(ids),
              "bert_mask": torch.from_numpy(np.arange(Tb)[None, :] >= lens[:, None]),  # (B, Tb)
              "bert_segments": torch.from_numpy(segments), "bert_align": torch.from_numpy(align)}
    if bert.features is not None:
        extras["bert_features"] = bert.features.gather(idx, Tb)  # (B, Tb, K, H) float16
    return extras


def iterate_batches(split: EncodedSplit, vocab: SubwordVocab, max_tokens: int, max_sentences: int = 0,
                    shuffle: bool = True, seed: int = 1, epoch: int = 1, rank: int = 0,
                    world_size: int = 1) -> Iterator[Batch]:
    """Collated :func:`batch_indices` batches of ``split`` for one epoch and one rank."""
    for idx in batch_indices(split.src_lens, split.tgt_lens, max_tokens, max_sentences, shuffle, seed,
                             epoch, rank, world_size, bert_lens=split.bert_lens):
        yield collate(split, idx, vocab.pad_id, vocab.bos_id, vocab.eos_id)


def inference_batches(split: EncodedSplit, vocab: SubwordVocab, max_sentences: int,
                      max_tokens: int = 0) -> Iterator[Batch]:
    """Batches for decoding, grouped by source length (longest batch first) to waste little padding.

    At most ``max_sentences`` per batch and, if ``max_tokens > 0``, ``(max src_len + 1) * B <=
    max_tokens`` (``max(src_len + 1, bert_len)`` with a BERT stream). Sentences come out of order: put
    results back with :func:`restore_order` (or by ``batch.ids``, the positions in ``split``).
    """
    if max_sentences <= 0:
        raise ValueError(f"max_sentences must be > 0, got {max_sentences}")
    cost = split.src_lens + 1  # (N,)
    if split.bert is not None:
        cost = np.maximum(cost, split.bert.lens)  # (N,)
    order = np.argsort(cost, kind="stable")  # (N,)
    budget = max_tokens if max_tokens > 0 else int(cost.max(initial=1)) * max_sentences
    batches = np.split(order, _greedy_bounds(cost[order], budget, max_sentences)[:-1]) if len(order) else []
    for idx in reversed(batches):
        yield collate(split, idx, vocab.pad_id, vocab.bos_id, vocab.eos_id)


T_ = TypeVar("T_")


def restore_order(results: Iterable[tuple[Tensor | Sequence[int], Sequence[T_]]], n: int) -> list[T_]:
    """Put per-batch results back in split order: ``results`` yields ``(batch.ids, outputs)`` pairs."""
    unset = object()  # not None: None may be a legitimate result
    out: list = [unset] * n
    for ids, outputs in results:
        for i, o in zip(ids.tolist() if isinstance(ids, Tensor) else ids, outputs, strict=True):
            out[int(i)] = o
    missing = [i for i, o in enumerate(out) if o is unset]
    if missing:
        raise ValueError(f"restore_order: no result for {len(missing)} of {n} sentences (first: {missing[0]})")
    return out
