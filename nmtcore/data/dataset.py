"""From raw lines to encoded, filtered splits: the joint vocabulary, document indices, the BERT stream's
container, and :func:`prepare_data`, everything a run needs from the data side.

The joint subword vocabulary is learned on the training split of both languages, every split is encoded,
and the training pairs are filtered by length, Moses ``clean-corpus-n.perl`` style. A BERT-consuming model
adds a second token stream per split (:class:`BertInputs`, built by :mod:`nmtcore.bert`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
from torch import Tensor

from nmtcore.config import DataConfig
from nmtcore.data.corpus import DataError, get_corpus, load_split
from nmtcore.data.vocab import SubwordVocab, VocabError
from nmtcore.files import atomic_directory, sha256_file

log = logging.getLogger("nmtcore.data")


# ------------------------------------------------------------------------------------ encoding, filtering
class FeatureSource(Protocol):
    """Precomputed BERT hidden states of a split's sentences (:class:`nmtcore.bert.features.FeatureStore`)."""

    def gather(self, indices: np.ndarray, length: int) -> Tensor:
        """(B, length, K, H) float16 states of sentences ``indices``, right-padded with zeros."""
        ...

    def select(self, indices: np.ndarray) -> "FeatureSource":
        """The same features re-indexed like :meth:`EncodedSplit.select`."""
        ...


@dataclass
class BertInputs:
    """A split's second token stream: the raw source line in the BERT's own WordPiece (built by
    :func:`nmtcore.bert.encode_bert_inputs`; see that module for the layout).

    ``ids[i]``: int32 ``[CLS] … [SEP]`` (or ``[CLS] context [SEP] sentence [SEP]``) ids, never padded here;
    ``segments[i]``: int8 token type ids, same length; ``align[i]``: (src_len + 1, 2) int32, for each NMT
    source position (eos included) the ``[start, end)`` span of the WordPieces of the same whitespace word
    (empty for eos and for words BERT dropped or truncation cut); ``features``: the frozen-feature cache of
    this split, if attached.
    """

    ids: list[np.ndarray]
    segments: list[np.ndarray]
    align: list[np.ndarray]
    pad_id: int
    features: FeatureSource | None = None

    def __post_init__(self) -> None:
        if not (len(self.ids) == len(self.segments) == len(self.align)):
            raise ValueError("BertInputs: ids, segments and align must have the same length")

    def __len__(self) -> int:
        return len(self.ids)

    @cached_property
    def lens(self) -> np.ndarray:
        """(N,) int64 WordPiece counts, [CLS] and [SEP]s included."""
        return np.fromiter((len(s) for s in self.ids), dtype=np.int64, count=len(self.ids))

    def select(self, indices: Sequence[int] | np.ndarray) -> "BertInputs":
        """The stream of sentences ``indices`` (their cached features follow)."""
        idx = [int(i) for i in indices]
        return BertInputs([self.ids[i] for i in idx], [self.segments[i] for i in idx], [self.align[i] for i in idx],
                          self.pad_id, self.features.select(np.asarray(idx, dtype=np.int64)) if self.features else None)


@dataclass
class DocumentIndex:
    """Where the sentences of a split sit in their documents (document corpora only).

    ``lines``: every source sentence of the split in file order, markers removed, *before* any length
    filter (so a filtered-out sentence still serves as its successor's context); ``line_docs`` (L,) int64:
    the document of each line; ``rows`` (N,) int64: the line each sentence of the split is
    (:meth:`select` re-indexes ``rows`` and shares ``lines``).
    """

    lines: list[str]
    line_docs: np.ndarray
    rows: np.ndarray

    def __post_init__(self) -> None:
        if len(self.line_docs) != len(self.lines):
            raise ValueError(f"DocumentIndex: {len(self.line_docs)} document ids for {len(self.lines)} lines")
        if len(self.rows) and (self.rows.min() < 0 or self.rows.max() >= len(self.lines)):
            raise ValueError("DocumentIndex: rows out of range")

    @classmethod
    def from_doc_ids(cls, lines: Sequence[str], doc_ids: Sequence[int] | np.ndarray) -> "DocumentIndex":
        """The index of a split read in file order: sentence i is line i, in document ``doc_ids[i]``."""
        docs = np.asarray(doc_ids, dtype=np.int64)
        return cls(list(lines), docs, np.arange(len(docs), dtype=np.int64))

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def doc_ids(self) -> np.ndarray:
        """(N,) int64 document of each sentence of the split."""
        return self.line_docs[self.rows]

    def select(self, indices: Sequence[int] | np.ndarray) -> "DocumentIndex":
        """The document index of sentences ``indices`` (their documents stay whole for context)."""
        return DocumentIndex(self.lines, self.line_docs, self.rows[np.asarray(indices, dtype=np.int64)])

    def previous(self, n: int) -> list[list[str]]:
        """For each sentence, the up to ``n`` sentences before it in its own document, oldest first: never
        across a document boundary (the first sentence of a document gets ``[]``)."""
        if n < 0:
            raise ValueError(f"need n >= 0 previous sentences, got {n}")
        L = len(self.line_docs)
        first = np.ones(L, dtype=bool)  # (L,) line opens a document
        first[1:] = self.line_docs[1:] != self.line_docs[:-1]
        doc_start = np.maximum.accumulate(np.where(first, np.arange(L), 0))  # (L,) first line of its document
        starts = np.maximum(self.rows - n, doc_start[self.rows])  # (N,)
        return [self.lines[a:r] for a, r in zip(starts.tolist(), self.rows.tolist())]


@dataclass
class EncodedSplit:
    """One split as subword ids (no bos/eos; int32 arrays) plus the raw lines they came from, and, for
    BERT-consuming models, the BERT token stream of the source side (``bert``). A split of a document
    corpus also knows its documents (``docs``: each sentence's document and preceding sentences)."""

    name: str
    src: list[np.ndarray]
    tgt: list[np.ndarray]
    raw_src: list[str]
    raw_tgt: list[str]
    bert: BertInputs | None = None
    docs: DocumentIndex | None = None

    def __post_init__(self) -> None:
        if not (len(self.src) == len(self.tgt) == len(self.raw_src) == len(self.raw_tgt)):
            raise ValueError(f"split {self.name!r}: src, tgt, raw_src and raw_tgt must have the same length")
        if self.bert is not None and len(self.bert) != len(self.src):
            raise ValueError(f"split {self.name!r}: {len(self.bert)} BERT inputs for {len(self.src)} sentences")
        if self.docs is not None and len(self.docs) != len(self.src):
            raise ValueError(f"split {self.name!r}: {len(self.docs)} document rows for {len(self.src)} sentences")

    def __len__(self) -> int:
        return len(self.src)

    @cached_property
    def src_lens(self) -> np.ndarray:
        """(N,) int64 subword counts, eos not included."""
        return np.fromiter((len(s) for s in self.src), dtype=np.int64, count=len(self.src))

    @cached_property
    def tgt_lens(self) -> np.ndarray:
        """(N,) int64 subword counts, bos/eos not included."""
        return np.fromiter((len(t) for t in self.tgt), dtype=np.int64, count=len(self.tgt))

    @property
    def bert_lens(self) -> np.ndarray | None:
        """(N,) int64 BERT WordPiece counts ([CLS]/[SEP] included), or None without a BERT stream."""
        return self.bert.lens if self.bert is not None else None

    def select(self, indices: Sequence[int] | np.ndarray) -> "EncodedSplit":
        """A new split with the pairs ``indices``, in that order."""
        idx = [int(i) for i in indices]
        return EncodedSplit(self.name, [self.src[i] for i in idx], [self.tgt[i] for i in idx],
                            [self.raw_src[i] for i in idx], [self.raw_tgt[i] for i in idx],
                            self.bert.select(idx) if self.bert is not None else None,
                            self.docs.select(idx) if self.docs is not None else None)


def encode_split(vocab: SubwordVocab, name: str, src: Sequence[str],
                 tgt: Sequence[str] | None = None, doc_ids: Sequence[int] | np.ndarray | None = None) -> EncodedSplit:
    """Encode raw lines; ``tgt=None`` (translating new input) gives empty targets. ``doc_ids`` (the
    document of each line, in file order) makes it a document-level split (``docs``)."""
    tgt_lines = list(tgt) if tgt is not None else [""] * len(src)
    docs = DocumentIndex.from_doc_ids(src, doc_ids) if doc_ids is not None else None
    return EncodedSplit(name, vocab.encode_many(src), vocab.encode_many(tgt_lines), list(src), tgt_lines, docs=docs)


def length_filter(src_lens: np.ndarray, tgt_lens: np.ndarray, min_len: int, max_len: int,
                  max_len_ratio: float) -> tuple[np.ndarray, int]:
    """Moses ``clean-corpus-n.perl`` on subword counts: which pairs to keep.

    A pair is dropped if either side has fewer than ``min_len`` or more than ``max_len`` tokens, or if
    ``len(longer) / len(shorter) > max_len_ratio``. With ``min_len=0`` an empty side against a
    non-empty one counts as an infinite ratio (dropped); two empty sides have ratio 1 (kept).
    Returns (kept indices in increasing order, number dropped).
    """
    s = np.asarray(src_lens, dtype=np.int64)
    t = np.asarray(tgt_lens, dtype=np.int64)
    lo, hi = np.minimum(s, t), np.maximum(s, t)
    # hi > ratio * lo is the division-free form of hi / lo > ratio, and handles lo == 0.
    ok = (lo >= min_len) & (hi <= max_len) & ~(hi > max_len_ratio * lo)
    kept = np.flatnonzero(ok)
    return kept, int(len(s) - len(kept))


@dataclass
class PreparedData:
    """Everything a run needs from the data side.

    ``splits`` maps split name → :class:`EncodedSplit` (train already length-filtered);
    ``checksums`` records provenance: ``"{split}.{lang}"`` → SHA-256 of the file read (of the files' digests for a
    split joined from several), and
    ``"vocab"`` → the vocabulary's checksum. ``train_dropped`` counts pairs removed by the filter.
    """

    cfg: DataConfig
    vocab: SubwordVocab
    splits: dict[str, EncodedSplit]
    checksums: dict[str, str]
    train_dropped: int

    @property
    def train(self) -> EncodedSplit:
        """The training split (``data.train_split``)."""
        return self.splits[self.cfg.train_split]

    @property
    def valid(self) -> EncodedSplit:
        """The validation split (``data.valid_split``)."""
        return self.splits[self.cfg.valid_split]

    @property
    def tests(self) -> dict[str, EncodedSplit]:
        """The test splits by name (``data.test_splits``)."""
        return {name: self.splits[name] for name in self.cfg.test_splits}


def prepare_data(cfg: DataConfig) -> PreparedData:
    """Load every split, learn (or reuse) the joint vocabulary on the training split, encode, filter.

    Every split is read and checked before anything but verified downloads is written, so a bad file
    leaves the cache untouched.
    The cleaned training text is written to ``<cache>/text/<sha256>/train.{lang}`` (atomically) for
    SentencePiece; the vocabulary is cached by :meth:`SubwordVocab.train_or_load`. The training split
    is then filtered with :func:`length_filter` using ``cfg.min_len/max_len/max_len_ratio``; other
    splits are never filtered (their sentence counts must stay comparable across papers).
    """
    corpus = get_corpus(cfg.corpus)
    names = list(dict.fromkeys([cfg.train_split, cfg.valid_split, *cfg.test_splits]))
    for split in names:  # fail on a typo before reading anything
        for lang in (cfg.src_lang, cfg.tgt_lang):
            corpus.check(split, lang)

    texts = {split: load_split(cfg, split) for split in names}
    checksums: dict[str, str] = {}
    for split, pt in texts.items():
        for side, lang in enumerate((cfg.src_lang, cfg.tgt_lang)):
            sums = [sha256_file(f[side]) for f in pt.files]  # a split joined from several files: a digest of theirs
            checksums[f"{split}.{lang}"] = (sums[0] if len(sums) == 1 else
                                            hashlib.sha256(" ".join(sums).encode()).hexdigest())

    cache = cfg.resolved_cache_dir()
    train = texts[cfg.train_split]
    text_files = _write_train_text(cache, {cfg.src_lang: train.src, cfg.tgt_lang: train.tgt})
    try:
        vocab = SubwordVocab.train_or_load(text_files, cfg.vocab_size, cache)
    except VocabError as e:  # callers (the CLI) report DataError as a one-line user error
        raise DataError(str(e)) from None
    checksums["vocab"] = vocab.checksum

    splits = {split: encode_split(vocab, split, pt.src, pt.tgt, doc_ids=pt.doc_ids) for split, pt in texts.items()}
    kept, dropped = length_filter(splits[cfg.train_split].src_lens, splits[cfg.train_split].tgt_lens,
                                  cfg.min_len, cfg.max_len, cfg.max_len_ratio)
    if len(kept) == 0:
        raise DataError(f"the length filter removed all {len(train)} training pairs (data.min_len={cfg.min_len}, "
                        f"data.max_len={cfg.max_len}, data.max_len_ratio={cfg.max_len_ratio})")
    if dropped:
        splits[cfg.train_split] = splits[cfg.train_split].select(kept)
        log.info("length filter dropped %d of %d training pairs", dropped, len(train))
    return PreparedData(cfg=cfg, vocab=vocab, splits=splits, checksums=checksums, train_dropped=dropped)


def _write_train_text(cache: Path, sides: dict[str, list[str]]) -> list[Path]:
    """Write each side to ``<cache>/text/<key>/train.<lang>`` (key = SHA-256 of the content)."""
    contents = {lang: "".join(line + "\n" for line in lines).encode("utf-8") for lang, lines in sides.items()}
    h = hashlib.sha256()
    for lang, blob in contents.items():
        h.update(lang.encode() + b"\0" + hashlib.sha256(blob).digest())
    final = cache / "text" / h.hexdigest()[:32]
    files = [final / f"train.{lang}" for lang in contents]
    if all(f.is_file() for f in files):
        return files
    with atomic_directory(final) as tmp:
        for lang, blob in contents.items():
            (tmp / f"train.{lang}").write_bytes(blob)
    return files
