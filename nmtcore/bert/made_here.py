"""BERTs this platform made itself, and where they live on disk.

A made-here BERT has a name that says what it is (``pretrained-here:L4-H256:multi30k:en`` for a small BERT
pretrained with masked-LM by :mod:`nmtcore.bert.pretrain`) and a directory under the cache that
``transformers`` loads like any other BERT (config.json, model.safetensors, tokenizer files, plus meta.json
with the recipe and its quality figures), keyed by everything that changes it:

    <cache_dir>/bert/pretrained-here/<corpus>.<lang>/L{L}-H{H}.steps{S}.seed{seed}.v{vocab}.len{max_len}/<corpus sha256[:16]>/

:mod:`nmtcore.bert.resolve` finds them here; the builders write them here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nmtcore.bert.errors import BertError, PretrainError
from nmtcore.config import DataConfig
from nmtcore.data import DataError, corpus_file
from nmtcore.files import finished_directories, sha256_file

log = logging.getLogger("nmtcore.bert")

PREFIX = "pretrained-here:"
DEFAULT_STEPS = 1500  # model.bert.pretrain_steps=0 means this; L2/H128 on Multi30k En: < 5 min on 2 cores
DEFAULT_SEED = 1
DEFAULT_VOCAB = 8000
DEFAULT_MAX_LENGTH = 128

@dataclass(frozen=True)
class PretrainSpec:
    """A platform-made BERT: size, corpus side, and the recipe's free parameters."""

    layers: int
    hidden: int
    corpus: str
    lang: str
    steps: int = DEFAULT_STEPS
    seed: int = DEFAULT_SEED
    vocab_size: int = DEFAULT_VOCAB
    max_length: int = DEFAULT_MAX_LENGTH

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 64 or self.hidden % 64:
            raise PretrainError(f"BERT size L{self.layers}/H{self.hidden}: need L >= 1 and H a positive multiple of 64")
        if not self.corpus or not self.lang or ":" in self.corpus + self.lang:
            raise PretrainError(f"pretraining corpus {self.corpus!r}:{self.lang!r}: need a corpus and a language")
        if self.steps < 1 or self.vocab_size < 64 or self.max_length < 8:
            raise PretrainError("pretraining needs steps >= 1, vocab_size >= 64 and max_length >= 8")

    @classmethod
    def for_size(cls, layers: int, hidden: int, corpus_lang: str, steps: int | None = None) -> "PretrainSpec":
        corpus, _, lang = corpus_lang.partition(":")
        return cls(layers, hidden, corpus, lang, steps or DEFAULT_STEPS)  # 0 or None: the default

    @classmethod
    def parse(cls, name: str) -> "PretrainSpec":
        """``pretrained-here:L4-H256:<corpus>:<lang>[:steps=N][:seed=S][:vocab=V][:maxlen=M]``."""
        if not name.startswith(PREFIX):
            raise BertError(f"{name!r} is not a pretrained-here name")
        parts = name[len(PREFIX):].split(":")
        try:
            size, corpus, lang, *opts = parts
            L, H = size.upper().split("-")
            assert L[0] == "L" and H[0] == "H"
            kw = {"steps": DEFAULT_STEPS, "seed": DEFAULT_SEED, "vocab": DEFAULT_VOCAB, "maxlen": DEFAULT_MAX_LENGTH}
            for o in opts:
                k, v = o.split("=")
                if k not in kw:
                    raise ValueError(k)
                kw[k] = int(v)
            return cls(int(L[1:]), int(H[1:]), corpus, lang, kw["steps"], kw["seed"], kw["vocab"], kw["maxlen"])
        except (ValueError, AssertionError, PretrainError):
            raise BertError(f"bad BERT name {name!r}: expected pretrained-here:L4-H256:<corpus>:<lang>"
                            "[:steps=N][:seed=S][:vocab=V][:maxlen=M]") from None

    @property
    def name(self) -> str:
        """The model.bert.name that resolves to this BERT (defaults omitted)."""
        opts = "".join(f":{k}={v}" for k, v, d in (("steps", self.steps, DEFAULT_STEPS), ("seed", self.seed, DEFAULT_SEED),
                                                    ("vocab", self.vocab_size, DEFAULT_VOCAB),
                                                    ("maxlen", self.max_length, DEFAULT_MAX_LENGTH)) if v != d)
        return f"{PREFIX}L{self.layers}-H{self.hidden}:{self.corpus}:{self.lang}{opts}"

    @property
    def dirname(self) -> str:
        """The folder of this pretraining under :func:`root_dir`: every setting that changes its weights."""
        return (f"{self.corpus}.{self.lang}/L{self.layers}-H{self.hidden}.steps{self.steps}.seed{self.seed}"
                f".v{self.vocab_size}.len{self.max_length}")

    def command(self) -> str:
        """The ``nmtcore bert-pretrain`` command line that makes this BERT (printed where it is missing)."""
        return (f"nmtcore bert-pretrain --layers {self.layers} --hidden {self.hidden} --corpus {self.corpus} "
                f"--lang {self.lang} --steps {self.steps} --seed {self.seed}")


def root_dir(cache_dir: Path) -> Path:
    """Where BERTs pretrained here are kept in the data cache."""
    return Path(cache_dir) / "bert" / "pretrained-here"


def find_pretrained(spec: PretrainSpec, cache_dir: Path, fail: Callable[[str], None] | None = None) -> Path | None:
    """The directory of a finished pretraining of ``spec`` under ``cache_dir``, or None (``fail`` hears why).

    Entries are per corpus checksum; if several exist (the corpus changed) the one matching the corpus
    file as it is now wins, when that file can be found, else the newest (with a warning).
    """
    base = root_dir(cache_dir) / spec.dirname
    found = finished_directories(base)
    if not found:
        if fail:
            fail(f"pretrained here {base}: none yet (make it with `{spec.command()}`)")
        return None
    if len(found) == 1:
        return found[0]
    try:
        path = corpus_file(DataConfig(corpus=spec.corpus, cache_dir=str(cache_dir), download=False), "train", spec.lang)
        want = sha256_file(path)[:16]
        for d in found:
            if d.name == want:
                return d
    except DataError:
        pass
    newest = max(found, key=lambda d: (d / "meta.json").stat().st_mtime)
    log.warning("%d pretrainings of %s on different corpus versions; using the newest, %s", len(found), spec.name, newest)
    return newest
