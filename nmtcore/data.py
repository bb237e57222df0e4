"""Parallel text, from files on disk to padded batches.

The stages, in the order data moves through them:

1. **Find** the ``{split}.{lang}`` files of a registered corpus (:data:`CORPORA`): in the data
   directory, in the download cache, or (Multi30k only) downloaded and SHA-256-verified into the cache.
2. **Read** them (:func:`load_split`): UTF-8, plain or gzip; each line is whitespace-normalised (runs of
   any whitespace, tabs and CRs included, become one space; leading/trailing whitespace is removed), the
   form on which :class:`~nmtcore.tokenization.SubwordVocab` round-trips exactly. A document corpus
   (``Corpus.documents``) drops its ``<d>`` marker lines and numbers the documents; each split then
   carries a :class:`DocumentIndex` (the preceding sentences of each sentence in its own document).
3. **Learn** the joint subword vocabulary on the training split of both languages, **encode** every
   split, and **filter** the training pairs by length, Moses ``clean-corpus-n.perl`` style
   (:func:`prepare_data`).
4. **Batch** them under a token budget, fairseq style (:func:`batch_indices`, :func:`collate`). A
   BERT-consuming model adds a second token stream per split (:class:`BertInputs`, built by
   :mod:`nmtcore.bert`), which the budget counts and :func:`collate_bert` pads into ``Batch.extras``.

Every failure is a one-line :class:`DataError` that names the file(s) and says how to fix it, and every
cache write (downloads, cleaned text, vocabularies) goes to a temporary name first and is renamed into
place, so an interrupted or failed run never leaves a half-written file that a later run would trust.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Iterable, Iterator, Mapping, Protocol, Sequence, TypeVar

import numpy as np
import torch
from torch import Tensor

from nmtcore.config import DataConfig
from nmtcore.tokenization import SubwordVocab, VocabError

log = logging.getLogger(__name__)


class DataError(ValueError):
    """A corpus cannot be found, downloaded, verified or read (one-line message naming the file)."""


# ---------------------------------------------------------------------------------------------- corpora
@dataclass(frozen=True)
class Corpus:
    """Where the ``{split}.{lang}`` files of one named corpus live and how they are checked.

    ``subdir``: folder under ``data_dir`` holding the files ("" = ``data_dir`` itself).
    ``languages`` / ``splits``: the valid values (empty = anything the directory has).
    ``gzip_only``: files are ``{split}.{lang}.gz``; otherwise plain ``{split}.{lang}`` or ``.gz``.
    ``url``: base URL to download ``{split}.{lang}.gz`` from ("" = never downloaded), overridable by
    the environment variable ``url_env``. ``sha256``: expected digest per file name; downloads and
    files found on disk must match it. ``missing_hint``: how to fix a missing file (``{split}`` is
    filled in). ``file_template``: the file name of one side when it is not ``{split}.{lang}``
    (``{split}`` and ``{lang}`` are filled in; ``.gz`` is tried as well). ``documents``: the files are
    document-level: a line holding only :data:`DOC_MARKER` starts each document (:func:`load_split`
    drops the marker lines and numbers the documents).
    """

    name: str
    description: str
    subdir: str = ""
    languages: tuple[str, ...] = ()
    splits: tuple[str, ...] = ()
    gzip_only: bool = False
    url: str = ""
    url_env: str = ""
    sha256: Mapping[str, str] = field(default_factory=dict)
    missing_hint: str = ""
    file_template: str = ""
    documents: bool = False

    def file_names(self, split: str, lang: str) -> list[str]:
        """Candidate file names of one side of a split, in lookup order."""
        base = self.file_template.format(split=split, lang=lang) if self.file_template else f"{split}.{lang}"
        return [f"{base}.gz"] if self.gzip_only else [base, f"{base}.gz"]

    def base_url(self) -> str:
        """Download base URL: ``$url_env`` if set (tests serve files locally), else ``url``."""
        return (os.environ.get(self.url_env, "") if self.url_env else "") or self.url

    def check(self, split: str, lang: str) -> None:
        """Raise a :class:`DataError` listing the valid values if ``split`` or ``lang`` is unknown."""
        if self.languages and lang not in self.languages:
            raise DataError(f"corpus {self.name!r} has no language {lang!r} (valid: {', '.join(self.languages)})")
        if self.splits and split not in self.splits:
            raise DataError(f"corpus {self.name!r} has no split {split!r} (valid: {', '.join(self.splits)})")


# SHA-256 of the public files (github.com/multi30k/dataset, data/task1/raw), byte-identical to our copy.
MULTI30K_SHA256: dict[str, str] = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.fr.gz": "622e75069e9f4c577425c4f277116ce66e63a2401c0a2312d90073cb12379a3c",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.fr.gz": "ca3106f1a72390591d25f6c45cb4cd39dec4cd3f123e099748a3ce5256c160e9",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.fr.gz": "6d326e188d259fb1d04ac19eae3af956559b3a0b93d7635e56c90987c40c8b90",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.fr.gz": "3ba671ceb2299f3304ffafefea7a833d08632fbaf0ba18546f8a2ec2391af496",
}

CORPORA: dict[str, Corpus] = {
    "multi30k": Corpus(
        name="multi30k",
        description="Multi30k task 1 (Elliott et al., 2016), raw text",
        subdir="multi30k",
        languages=("en", "de", "fr"),
        splits=("train", "val", "test_2016_flickr", "test_2017_flickr"),
        gzip_only=True,
        url="https://github.com/multi30k/dataset/raw/master/data/task1/raw",
        url_env="NMTCORE_MULTI30K_URL",
        sha256=MULTI30K_SHA256,
        missing_hint="pass --data-dir (or set NMTCORE_DATA) to a directory holding multi30k/{split}.<lang>.gz, "
        "or set data.download=true to fetch it",
    ),
    "parallel": Corpus(
        name="parallel",
        description="any directory of {split}.{lang} files (plain or .gz)",
        missing_hint="put the {split}.<lang> files (plain or .gz) there, or point --data-dir / NMTCORE_DATA at the "
        "directory that has them",
    ),
    "iwslt14": Corpus(
        name="iwslt14",
        description="IWSLT'14 De-En as prepared by fairseq's prepare-iwslt14.sh (user-provided)",
        languages=("de", "en"),
        missing_hint="nmtcore ships no IWSLT'14 training data: run fairseq's "
        "examples/translation/prepare-iwslt14.sh and pass its output directory "
        "(train/valid/test.{de,en}) with --data-dir or NMTCORE_DATA",
    ),
}


# Document-level corpora (a line "<d>" starts each document). Maruf et al. (2019)'s En-De sets, as the BERT
# context-encoder paper (seed 003) uses them; their files are concatenated_en2de_{split}_{lang}.txt[.gz].
DOC_MARKER = "<d>"
_MARUF_FILES = "concatenated_en2de_{split}_{lang}.txt"
_MARUF_HINT = ("pass --data-dir (or set NMTCORE_DATA) to a directory holding docnmt-en-de-maruf2019-devtest/{sub}/ "
               "(the team copy ../shared/data has dev and test only); the train split is "
               "concatenated_en2de_train_{{en,de}}.txt from github.com/sameenmaruf/selective-attn ({train})")
for _name, _sub, _what, _train in (
        ("maruf2019_ted", "IWSLT2017", "TED talks (IWSLT'17)", "data/IWSLT2017"),
        ("maruf2019_news", "NC-2016", "News Commentary v11", "the Dropbox link of its readme"),
        ("maruf2019_europarl", "Europarl7", "Europarl v7", "the Dropbox link of its readme")):
    CORPORA[_name] = Corpus(
        name=_name, description=f"{_what} En-De documents of Maruf et al. (2019), raw text, <d> document markers",
        subdir=f"docnmt-en-de-maruf2019-devtest/{_sub}", languages=("en", "de"), splits=("train", "dev", "test"),
        file_template=_MARUF_FILES, documents=True, missing_hint=_MARUF_HINT.format(sub=_sub, train=_train))
CORPORA["docparallel"] = Corpus(
    name="docparallel", description="any directory of document-level {split}.{lang} files: a line <d> starts "
    "each document", documents=True,
    missing_hint="put the {split}.<lang> files (plain or .gz, a line <d> before each document) there, or point "
    "--data-dir / NMTCORE_DATA at the directory that has them")


def get_corpus(name: str) -> Corpus:
    """The registered corpus ``name``; :class:`DataError` listing the registered ones otherwise."""
    if name not in CORPORA:
        raise DataError(f"unknown corpus {name!r} (registered: {', '.join(sorted(CORPORA))})")
    return CORPORA[name]


class _MissingFile(DataError):
    def __init__(self, searched: list[Path], hint: str) -> None:
        self.searched, self.hint = searched, hint
        super().__init__(f"missing file (looked for {', '.join(map(str, searched))}); {hint}")


def corpus_file(cfg: DataConfig, split: str, lang: str) -> Path:
    """Path of one side of a split: data dir, then download cache, then download (if allowed).

    Files with a known SHA-256 (Multi30k) are verified wherever they are found; a corrupt cached copy
    is deleted and downloaded again (if ``cfg.download``), a corrupt copy in the data dir is an error.
    """
    corpus = get_corpus(cfg.corpus)
    corpus.check(split, lang)
    names = corpus.file_names(split, lang)
    hint = corpus.missing_hint.replace("{split}", split)
    searched: list[Path] = []

    data_dir = cfg.resolved_data_dir()
    if data_dir is not None:
        base = data_dir / corpus.subdir if corpus.subdir else data_dir
        found = [base / n for n in names if (base / n).is_file()]
        if len(found) > 1:
            raise DataError(f"both {found[0]} and {found[1]} exist; remove one so it is clear which is read")
        if found:
            _verify(found[0], corpus.sha256.get(found[0].name))
            return found[0]
        searched.append(base / names[0])
        if not base.is_dir():
            hint = f"{base} does not exist; {hint}"
    elif not corpus.url:
        raise DataError(f"corpus {corpus.name!r} reads its files from data.data_dir, which is not set: "
                        "pass --data-dir or set NMTCORE_DATA")

    if corpus.url:
        cached = cfg.resolved_cache_dir() / "data" / corpus.name / names[0]
        if cached.is_file():
            try:
                _verify(cached, corpus.sha256.get(cached.name))
                return cached
            except DataError:
                if not cfg.download:
                    raise
                log.warning("deleting corrupt cached %s to download it again", cached)
                cached.unlink(missing_ok=True)
        if cfg.download:
            return _download(f"{corpus.base_url().rstrip('/')}/{names[0]}", cached, corpus.sha256.get(names[0]))
        searched.append(cached)
    raise _MissingFile(searched, hint)


_SHA256_MEMO: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, memoised on (path, size, mtime) so re-verifying an unchanged file is free."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA256_MEMO:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _SHA256_MEMO[key] = h.hexdigest()
    return _SHA256_MEMO[key]


def _verify(path: Path, expected: str | None) -> None:
    if expected is None:
        return
    actual = file_sha256(path)
    if actual != expected:
        raise DataError(f"checksum mismatch for {path}: expected sha256 {expected}, got {actual} "
                        "(corrupt or not the published file)")


def _download(url: str, dest: Path, expected: str | None) -> Path:
    """Fetch ``url`` to a temporary file next to ``dest``, verify it, then rename it into place."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.info("downloading %s -> %s", url, dest)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=60) as resp:
                    for chunk in iter(lambda: resp.read(1 << 16), b""):
                        h.update(chunk)
                        out.write(chunk)
            except urllib.error.HTTPError as e:
                raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from None
            except (urllib.error.URLError, OSError) as e:
                reason = getattr(e, "reason", e)
                raise DataError(f"download of {url} failed: {reason}; use --data-dir with a local copy "
                                "if this machine is offline") from None
        if expected is not None and h.hexdigest() != expected:
            raise DataError(f"checksum mismatch for {url}: expected sha256 {expected}, got {h.hexdigest()}; "
                            "the download was discarded")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)  # no-op once renamed
    return dest


# ---------------------------------------------------------------------------------------------- reading
@dataclass
class ParallelText:
    """One split as whitespace-normalised lines; ``src[i]`` translates to ``tgt[i]``."""

    src: list[str]
    tgt: list[str]
    src_path: Path
    tgt_path: Path
    split: str = ""
    doc_ids: np.ndarray | None = None  # (N,) int64 document of each pair (document corpora), else None

    def __len__(self) -> int:
        return len(self.src)


def read_lines(path: Path) -> list[str]:
    """Lines of a UTF-8 text file (plain or ``.gz``), whitespace-normalised.

    A UTF-8 byte order mark is dropped; a final newline does not make an extra line. Lines are split on
    ``\\n`` only (not on the exotic separators ``str.splitlines`` knows), so counts agree with ``wc -l``.
    Each line becomes ``" ".join(line.split())``: CRs, tabs, no-break spaces and runs of spaces turn into
    single spaces and surrounding whitespace goes.
    """
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}") from None
    if path.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path} is not a valid gzip file ({e})") from None
    return decode_lines(raw, str(path))


def decode_lines(raw: bytes, source: str) -> list[str]:
    """:func:`read_lines` on bytes already read (``source`` names them in errors, e.g. ``<stdin>``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{source}: line {line_no} is not valid UTF-8 (byte 0x{raw[e.start]:02x}); "
                        "re-encode the file as UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [" ".join(line.split()) for line in lines]


def load_split(cfg: DataConfig, split: str) -> ParallelText:
    """Read split ``split`` of ``cfg.corpus`` for ``cfg.src_lang`` → ``cfg.tgt_lang``.

    Raises :class:`DataError` for an unknown corpus, split or language, missing files (both sides
    named), an empty file, undecodable bytes (file and line number) or different line counts on the
    two sides (both files and both counts).
    """
    corpus = get_corpus(cfg.corpus)
    for lang in (cfg.src_lang, cfg.tgt_lang):
        corpus.check(split, lang)
    paths: dict[str, Path] = {}
    missing: list[_MissingFile] = []
    for lang in (cfg.src_lang, cfg.tgt_lang):
        try:
            paths[lang] = corpus_file(cfg, split, lang)
        except _MissingFile as e:
            missing.append(e)
    if missing:
        searched = [p for e in missing for p in e.searched]
        raise DataError(f"corpus {corpus.name!r}, split {split!r}: missing files (looked for "
                        f"{', '.join(map(str, searched))}); {missing[0].hint}")
    src_path, tgt_path = paths[cfg.src_lang], paths[cfg.tgt_lang]
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    for path, lines in ((src_path, src), (tgt_path, tgt)):
        if not lines:
            raise DataError(f"{path} is empty (corpus {corpus.name!r}, split {split!r})")
    if len(src) != len(tgt):
        raise DataError(f"line counts differ: {src_path} has {len(src)} lines, {tgt_path} has {len(tgt)}; "
                        "the two sides of a split must be line-aligned")
    if corpus.documents:
        src, tgt, doc_ids = split_documents(src, tgt, src_path, tgt_path)
        return ParallelText(src=src, tgt=tgt, src_path=src_path, tgt_path=tgt_path, split=split, doc_ids=doc_ids)
    if src[0] == DOC_MARKER and tgt[0] == DOC_MARKER:
        log.warning("%s starts with a %s document marker but corpus %r is sentence-level: the markers are read "
                    "as sentences (use a document corpus, e.g. data.corpus=docparallel)", src_path, DOC_MARKER,
                    corpus.name)
    return ParallelText(src=src, tgt=tgt, src_path=src_path, tgt_path=tgt_path, split=split)


def split_documents(src: list[str], tgt: list[str], src_path: Path,
                    tgt_path: Path) -> tuple[list[str], list[str], np.ndarray]:
    """Drop the :data:`DOC_MARKER` lines of a line-aligned document-level split and number its documents.

    Returns (src sentences, tgt sentences, (N,) int64 document id of each pair). Documents are numbered
    0, 1, ... in file order, one per marker (an empty document keeps its number); sentences before the
    first marker form a document of their own. The markers must sit on the same lines of both sides, and
    the split must hold at least one sentence; either failure is a one-line :class:`DataError`.
    """
    src_marks = np.fromiter((line == DOC_MARKER for line in src), dtype=bool, count=len(src))  # (L,)
    tgt_marks = np.fromiter((line == DOC_MARKER for line in tgt), dtype=bool, count=len(tgt))  # (L,)
    differ = np.flatnonzero(src_marks != tgt_marks)
    if len(differ):
        i = int(differ[0])
        has, lacks = (src_path, tgt_path) if src_marks[i] else (tgt_path, src_path)
        raise DataError(f"document markers differ: line {i + 1} is {DOC_MARKER} in {has} but not in {lacks}; "
                        "both sides must start each document on the same line")
    docs = np.cumsum(src_marks, dtype=np.int64) - (1 if src_marks[:1].any() else 0)  # (L,) doc of each line
    keep = np.flatnonzero(~src_marks)
    if len(keep) == 0:
        raise DataError(f"{src_path} holds only {DOC_MARKER} document markers, no sentences")
    return [src[i] for i in keep], [tgt[i] for i in keep], docs[keep]


# ------------------------------------------------------------------------------------ encoding, filtering
class FeatureSource(Protocol):
    """Precomputed BERT hidden states of a split's sentences (:class:`nmtcore.bert_cache.FeatureStore`)."""

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
    ``checksums`` records provenance: ``"{split}.{lang}"`` → SHA-256 of the file read, and
    ``"vocab"`` → the vocabulary's checksum. ``train_dropped`` counts pairs removed by the filter.
    """

    cfg: DataConfig
    vocab: SubwordVocab
    splits: dict[str, EncodedSplit]
    checksums: dict[str, str]
    train_dropped: int

    @property
    def train(self) -> EncodedSplit:
        return self.splits[self.cfg.train_split]

    @property
    def valid(self) -> EncodedSplit:
        return self.splits[self.cfg.valid_split]

    @property
    def tests(self) -> dict[str, EncodedSplit]:
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
        checksums[f"{split}.{cfg.src_lang}"] = file_sha256(pt.src_path)
        checksums[f"{split}.{cfg.tgt_lang}"] = file_sha256(pt.tgt_path)

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
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
    try:
        for lang, blob in contents.items():
            (tmp / f"train.{lang}").write_bytes(blob)
        try:
            os.replace(tmp, final)
        except OSError:  # a concurrent run wrote the same content first
            if not all(f.is_file() for f in files):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return files


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

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """A copy with every tensor (extras included) on ``device``."""
        n = self.n_tgt_tokens

        def mv(t: Tensor) -> Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(src=mv(self.src), src_mask=mv(self.src_mask), tgt_in=mv(self.tgt_in),
                     tgt_out=mv(self.tgt_out), tgt_mask=mv(self.tgt_mask), ids=mv(self.ids),
                     extras={k: mv(v) for k, v in self.extras.items()}, _n_tgt_tokens=n)

    def pin_memory(self) -> "Batch":
        """A copy in pinned host memory, so ``to(cuda, non_blocking=True)`` is truly asynchronous."""
        n = self.n_tgt_tokens
        return Batch(src=self.src.pin_memory(), src_mask=self.src_mask.pin_memory(),
                     tgt_in=self.tgt_in.pin_memory(), tgt_out=self.tgt_out.pin_memory(),
                     tgt_mask=self.tgt_mask.pin_memory(), ids=self.ids.pin_memory(),
                     extras={k: v.pin_memory() for k, v in self.extras.items()}, _n_tgt_tokens=n)


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
    ``max(L, bert_len)``, so every padded stream of a batch (source, target, BERT) stays in the budget.
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
