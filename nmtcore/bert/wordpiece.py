"""The BERT token stream of raw source lines, aligned to the NMT subwords by whitespace word.

The raw source line in the BERT's own WordPiece, ``[CLS] … [SEP]`` (or ``[CLS] context [SEP] sentence [SEP]``
with segment ids 0/1), truncated to the BERT's positions keeping the final ``[SEP]``, right-padded later by
:func:`nmtcore.data.collate_bert` (left padding shifts BERT's absolute positions, a bug of the original
BERT-fused code). NMT subwords and WordPieces both split the same whitespace words, which gives each NMT
source position the span of WordPieces of its word (``bert_align``), so token-level fusions can pool BERT
per NMT token (:func:`nmtcore.bert.layer.pool_to_tokens`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from nmtcore.bert.resolve import BertError
from nmtcore.data import BertInputs

if TYPE_CHECKING:
    from nmtcore.data import SubwordVocab


def word_start_table(vocab: "SubwordVocab") -> np.ndarray:
    """(V,) bool: does subword id v begin a whitespace word (SentencePiece's "▁" prefix)?"""
    return np.array([vocab.sp.id_to_piece(i).startswith("\u2581") for i in range(len(vocab))], dtype=bool)


def nmt_word_index(ids: np.ndarray, word_start: np.ndarray) -> np.ndarray:
    """(n,) int64 whitespace-word index of each NMT subword (no bos/eos)."""
    return np.cumsum(word_start[ids], dtype=np.int64) - 1 if len(ids) else np.zeros(0, dtype=np.int64)


_WORD_RE = re.compile(r"\S+")


class WordPieceEncoder:
    """The BERT token stream of raw source lines, aligned to NMT subwords by whitespace word.

    Uses the BERT's own tokenizer (its ``tokenizers`` backend, with any truncation/padding a packaged
    tokenizer.json carries switched off: we truncate and pad ourselves).
    """

    def __init__(self, tokenizer: Any, max_length: int) -> None:
        from tokenizers import Tokenizer

        if max_length < 4:
            raise BertError(f"BERT max_length must be >= 4 ([CLS], a token, [SEP]s), got {max_length}")
        backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        backend.no_truncation()
        backend.no_padding()
        self.backend = backend
        self.max_length = max_length
        self.cls_id, self.sep_id, self.pad_id = tokenizer.cls_token_id, tokenizer.sep_token_id, tokenizer.pad_token_id
        if None in (self.cls_id, self.sep_id, self.pad_id):
            raise BertError("the BERT tokenizer has no [CLS], [SEP] or [PAD] token")

    def _pieces(self, lines: Sequence[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int32, whitespace-word index int64) of each line's WordPieces, no specials."""
        out = []
        for line, enc in zip(lines, self.backend.encode_batch(list(lines), add_special_tokens=False)):
            ids = np.asarray(enc.ids, dtype=np.int32)
            starts = np.fromiter((s for s, _ in enc.offsets), dtype=np.int64, count=len(ids))
            word_starts = np.fromiter((m.start() for m in _WORD_RE.finditer(line)), dtype=np.int64)
            out.append((ids, np.searchsorted(word_starts, starts, side="right") - 1))
        return out

    def encode(self, lines: Sequence[str], nmt_words: Sequence[np.ndarray] | None = None,
               contexts: Sequence[str | None] | None = None) -> BertInputs:
        """The stream of ``lines``; ``nmt_words[i]`` (:func:`nmt_word_index`) gives the alignment
        (without it, every NMT position is unaligned); ``contexts[i]`` (or None) makes the input
        document-level: ``[CLS] context [SEP] sentence [SEP]``, context truncated from its start first."""
        if contexts is not None and len(contexts) != len(lines):
            raise ValueError(f"{len(contexts)} contexts for {len(lines)} lines")
        cur = self._pieces(lines)
        ctx = self._pieces([c or "" for c in contexts]) if contexts is not None else None
        L = self.max_length
        ids_out, seg_out, align_out = [], [], []
        for i, (line, (w_ids, w_words)) in enumerate(zip(lines, cur)):
            if ctx is None:
                keep = min(len(w_ids), L - 2)
                ids = np.concatenate([[self.cls_id], w_ids[:keep], [self.sep_id]]).astype(np.int32)
                segments = np.zeros(len(ids), dtype=np.int8)
                offset = 1
            else:
                keep = min(len(w_ids), L - 3)
                c_all = ctx[i][0]
                c_ids = c_all[len(c_all) - min(len(c_all), L - 3 - keep):]  # keep the context's end
                ids = np.concatenate([[self.cls_id], c_ids, [self.sep_id], w_ids[:keep], [self.sep_id]]).astype(np.int32)
                segments = np.concatenate([np.zeros(len(c_ids) + 2, np.int8), np.ones(keep + 1, np.int8)])
                offset = len(c_ids) + 2
            n_words = sum(1 for _ in _WORD_RE.finditer(line))
            spans = _word_spans(w_words[:keep], offset, n_words)  # (n_words, 2)
            if nmt_words is None:
                align = np.zeros((1, 2), dtype=np.int32)
            else:
                nw = nmt_words[i]
                if len(nw) and (nw.min() < 0 or nw.max() >= n_words):
                    raise BertError(f"line {i}: NMT subwords span {int(nw.max()) + 1} words, the line has {n_words} "
                                    f"({line[:60]!r}); the NMT vocabulary must keep whitespace (identity normalisation)")
                align = np.zeros((len(nw) + 1, 2), dtype=np.int32)  # last row: eos, unaligned
                align[: len(nw)] = spans[nw]
            ids_out.append(ids)
            seg_out.append(segments)
            align_out.append(align)
        return BertInputs(ids=ids_out, segments=seg_out, align=align_out, pad_id=int(self.pad_id))


def _word_spans(words: np.ndarray, offset: int, n_words: int) -> np.ndarray:
    """``[start, end)`` stream positions of each whitespace word's WordPieces (empty if it has none)."""
    spans = np.zeros((n_words, 2), dtype=np.int32)
    if len(words) == 0:
        return spans
    pos = np.arange(len(words)) + offset
    first = np.ones(len(words), dtype=bool)
    first[1:] = words[1:] != words[:-1]  # WordPieces of one word are contiguous
    starts = pos[first]
    ends = np.append(starts[1:], pos[-1] + 1)
    spans[words[first], 0] = starts
    spans[words[first], 1] = ends
    return spans
