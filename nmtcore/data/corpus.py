"""Where parallel text comes from: the corpus registry, finding / downloading / verifying files, reading them.

1. **Find** the ``{split}.{lang}`` files of a registered corpus (:data:`CORPORA`): in the data
   directory, in the download cache, or (Multi30k only) downloaded and SHA-256-verified into the cache.
2. **Read** them (:func:`load_split`): UTF-8, plain or gzip; each line is whitespace-normalised (runs of
   any whitespace, tabs and CRs included, become one space; leading/trailing whitespace is removed), the
   form on which :class:`~nmtcore.data.vocab.SubwordVocab` round-trips exactly. A document corpus
   (``Corpus.documents``) drops its ``<d>`` marker lines and numbers the documents.

Every failure is a one-line :class:`DataError` that names the file(s) and says how to fix it; downloads go
to a temporary name first and are renamed into place only once verified.
"""

from __future__ import annotations

import gzip
import hashlib
import logging
import os
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Mapping

import numpy as np

from nmtcore.config import DataConfig
from nmtcore.files import atomic_file, sha256_file

log = logging.getLogger("nmtcore.data")


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
    drops the marker lines and numbers the documents). ``parts``: a corpus made of other corpora's splits:
    split → ``(corpus, split)`` pairs, read one after another (documents stay apart; no files of its own).
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
    parts: Mapping[str, tuple[tuple[str, str], ...]] = field(default_factory=dict)

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
# The document-level training set that exists offline: only the dev and test sets of Maruf et al. (2019) are in
# the team copy, so their three dev sets joined train, News test validates, TED test tests (sizes: docs/data.md).
CORPORA["maruf2019_devtest"] = Corpus(
    name="maruf2019_devtest", description="Maruf et al. (2019) En-De documents, dev and test only: train = the "
    "TED, News Commentary and Europarl dev sets joined, valid = News Commentary test, test = TED test",
    languages=("en", "de"), splits=("train", "valid", "test"), documents=True,
    parts={"train": (("maruf2019_ted", "dev"), ("maruf2019_news", "dev"), ("maruf2019_europarl", "dev")),
           "valid": (("maruf2019_news", "test"),), "test": (("maruf2019_ted", "test"),)})


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
    if corpus.parts:
        raise DataError(f"corpus {corpus.name!r} has no file of its own: its split {split!r} joins "
                        + ", ".join(f"{c} {s}" for c, s in corpus.parts[split]) + "; read it with load_split")
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


def _verify(path: Path, expected: str | None) -> None:
    if expected is None:
        return
    actual = sha256_file(path)
    if actual != expected:
        raise DataError(f"checksum mismatch for {path}: expected sha256 {expected}, got {actual} "
                        "(corrupt or not the published file)")


def _download(url: str, dest: Path, expected: str | None) -> Path:
    """Fetch ``url`` to a temporary file next to ``dest``, verify it, then rename it into place."""
    log.info("downloading %s -> %s", url, dest)
    with atomic_file(dest, suffix=".part") as tmp:
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
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
    sources: tuple[tuple[Path, Path], ...] = ()  # every (src, tgt) file read, in order; () = (src_path, tgt_path)

    @property
    def files(self) -> tuple[tuple[Path, Path], ...]:
        """The (source, target) files this split was read from, in order."""
        return self.sources or ((self.src_path, self.tgt_path),)

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
    if corpus.parts:
        return _join([load_split(replace(cfg, corpus=name), part) for name, part in corpus.parts[split]], split)
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


def _join(pieces: list[ParallelText], split: str) -> ParallelText:
    """One split from several read one after another; document ids are renumbered so no two pieces share one."""
    doc_ids, offset = [], 0
    for p in pieces:
        ids = p.doc_ids if p.doc_ids is not None else np.zeros(len(p), dtype=np.int64)  # (N_p,)
        doc_ids.append(ids + offset)
        offset += int(ids.max()) + 1 if len(ids) else 0
    return ParallelText(src=[x for p in pieces for x in p.src], tgt=[y for p in pieces for y in p.tgt],
                        src_path=pieces[0].src_path, tgt_path=pieces[0].tgt_path, split=split,
                        doc_ids=np.concatenate(doc_ids), sources=tuple(f for p in pieces for f in p.files))


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
