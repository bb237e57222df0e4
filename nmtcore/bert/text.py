"""Monolingual text for making and judging BERTs offline, with one held-out rule.

:func:`training_text` is all the text of one language the platform can reach without a hub: the training
split of Multi30k, plus, when present under the data directory, the *non-test* sets of the IWSLT'14
evaluation data (``iwslt14-de-en-eval/tok_lc/valid``) and of the document-level En-De sets
(``docnmt-en-de-maruf2019-devtest/*/…_dev_…``). Test sets are never read for training, whatever the corpus:
they are the NMT studies' test sets. Lines are de-duplicated on a case- and punctuation-insensitive key
and any line equal (by that key) to a sentence of Multi30k's val or test sets is dropped.

:func:`heldout_text` is Multi30k ``val``: text nothing made here was trained on, on which every offline
BERT's quality figure (:mod:`nmtcore.bert.quality`) and a distillation's held-out loss are measured.
"""

from __future__ import annotations

import hashlib
import html
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from nmtcore.config import DataConfig
from nmtcore.data import DataError, corpus_file, read_lines

HELDOUT_SPLIT = "val"
MULTI30K_EVAL_SPLITS = ("val", "test_2016_flickr", "test_2017_flickr")
IWSLT14_DIR = "iwslt14-de-en-eval/tok_lc"
DOCNMT_DIR = "docnmt-en-de-maruf2019-devtest"
DOCNMT_SETS = ("IWSLT2017", "NC-2016", "Europarl7")
_KEY_RE = re.compile(r"[\W_]+", re.UNICODE)


def dedup_key(line: str) -> str:
    """Case-, punctuation- and tokenisation-insensitive key of a line (de-duplication, held-out checks)."""
    return _KEY_RE.sub("", html.unescape(line).lower())


def text_sha256(lines: Iterable[str]) -> str:
    """SHA-256 of the lines joined by newlines (UTF-8): names a corpus exactly."""
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


@dataclass
class Text:
    """Lines of one language, where they came from and their checksum."""

    lines: list[str]
    lang: str
    sources: dict[str, int] = field(default_factory=dict)  # source → lines read
    dropped_duplicates: int = 0
    dropped_heldout: int = 0

    @property
    def sha256(self) -> str:
        return text_sha256(self.lines)

    def describe(self) -> dict:
        return {"lang": self.lang, "sentences": len(self.lines), "sha256": self.sha256, "sources": dict(self.sources),
                "dropped_duplicates": self.dropped_duplicates, "dropped_heldout": self.dropped_heldout}


def _multi30k(data: DataConfig, split: str, lang: str) -> list[str]:
    return read_lines(corpus_file(replace(data, corpus="multi30k"), split, lang))


def heldout_text(data: DataConfig, lang: str) -> list[str]:
    """Multi30k ``val`` of ``lang``: evaluation only."""
    return [x for x in _multi30k(data, HELDOUT_SPLIT, lang) if x]


def _optional_sources(data: DataConfig, lang: str) -> dict[str, list[str]]:
    root = data.resolved_data_dir()
    out: dict[str, list[str]] = {}
    if root is None:
        return out
    for path in sorted((root / IWSLT14_DIR).glob(f"valid.{lang}*")):
        out[f"iwslt14 {path.name}"] = [html.unescape(x) for x in read_lines(path) if x]
    for sub in DOCNMT_SETS:
        for path in sorted((root / DOCNMT_DIR / sub).glob(f"concatenated_en2de_dev_{lang}.txt*")):
            out[f"{sub} {path.name}"] = [x for x in read_lines(path) if x and x != "<d>"]
    return out


def training_text(data: DataConfig, lang: str, extra: bool = True) -> Text:
    """Multi30k train of ``lang`` (required) plus, with ``extra``, the non-test sets found under the data
    directory; de-duplicated, Multi30k val/test sentences removed (see the module docstring)."""
    sources = {"multi30k train": _multi30k(data, "train", lang)}
    if extra:
        sources.update(_optional_sources(data, lang))
    forbidden: set[str] = set()
    for split in MULTI30K_EVAL_SPLITS:
        try:
            forbidden.update(dedup_key(x) for x in _multi30k(data, split, lang))
        except DataError:
            if split == HELDOUT_SPLIT:
                raise
    text = Text([], lang, {k: len(v) for k, v in sources.items()})
    seen: set[str] = set()
    for lines in sources.values():
        for line in lines:
            key = dedup_key(line)
            if not key or key in seen:
                text.dropped_duplicates += 1
                continue
            seen.add(key)
            if key in forbidden:
                text.dropped_heldout += 1
                continue
            text.lines.append(line)
    return text
