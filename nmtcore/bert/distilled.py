"""Students distilled here from a real encoder, and where they live on disk.

``distilled:L2-H128`` is a ``BertModel`` of 2 layers and hidden size 128 distilled by
:mod:`nmtcore.bert.distill` from a pretrained teacher (default ``minilm:L4``, the bottom four layers of
all-MiniLM-L6-v2, whose token states carry more than its sentence-tuned top: see
:mod:`nmtcore.bert.quality`) on all the English text the platform can reach (:mod:`nmtcore.bert.text`).
The full name spells the recipe's free parameters when they differ from the defaults:
``distilled:L2-H128:steps=2400:seed=2:from=mpnet:L4`` (``from=`` comes last: a teacher name may contain
colons). Its directory is keyed by everything that changes it::

    <cache_dir>/bert/distilled/L{L}-H{H}.from-<teacher>.steps{S}.seed{seed}/<teacher sha256[:12]>-<text sha256[:12]>/

with config.json, model.safetensors, the teacher's tokenizer files and ``meta.json`` (teacher, its weights
checksum, the text's checksum and sources, steps, the held-out loss curve, the quality figure).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from nmtcore.bert.errors import BertError
from nmtcore.bert.truncate import slug
from nmtcore.files import finished_directories

log = logging.getLogger("nmtcore.bert")

PREFIX = "distilled:"
DEFAULT_TEACHER = "minilm:L4"
DEFAULT_STEPS = 1200
DEFAULT_SEED = 1
_SIZE_RE = re.compile(r"^L(\d+)-H(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class DistillSpec:
    """A student: its size, its teacher and the recipe's free parameters."""

    layers: int
    hidden: int
    teacher: str = DEFAULT_TEACHER
    steps: int = DEFAULT_STEPS
    seed: int = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.layers < 1 or self.hidden < 64 or self.hidden % 64:
            raise BertError(f"distilled BERT L{self.layers}/H{self.hidden}: need L >= 1 and H a positive multiple of 64")
        if self.steps < 1 or not self.teacher:
            raise BertError("a distilled BERT needs steps >= 1 and a teacher")

    @classmethod
    def parse(cls, name: str) -> "DistillSpec":
        """``distilled:L2-H128[:steps=N][:seed=S][:from=<teacher>]``."""
        if not name.startswith(PREFIX):
            raise BertError(f"{name!r} is not a distilled name")
        rest, _, teacher = name[len(PREFIX):].partition(":from=")
        size, *opts = rest.split(":")
        m = _SIZE_RE.match(size)
        kw: dict[str, int] = {"steps": DEFAULT_STEPS, "seed": DEFAULT_SEED}
        try:
            if not m:
                raise ValueError(size)
            for opt in opts:
                key, value = opt.split("=")
                if key not in kw:
                    raise ValueError(key)
                kw[key] = int(value)
        except ValueError:
            raise BertError(f"bad BERT name {name!r}: expected distilled:L2-H128[:steps=N][:seed=S][:from=<teacher>]") from None
        return cls(int(m[1]), int(m[2]), teacher or DEFAULT_TEACHER, kw["steps"], kw["seed"])

    @property
    def name(self) -> str:
        """The model.bert.name that resolves to this student (defaults omitted)."""
        opts = "".join(f":{k}={v}" for k, v, d in (("steps", self.steps, DEFAULT_STEPS), ("seed", self.seed, DEFAULT_SEED))
                       if v != d)
        teacher = f":from={self.teacher}" if self.teacher != DEFAULT_TEACHER else ""
        return f"{PREFIX}L{self.layers}-H{self.hidden}{opts}{teacher}"

    @property
    def dirname(self) -> str:
        """The folder of this distillation under :func:`root_dir`: every setting that changes its weights."""
        return f"L{self.layers}-H{self.hidden}.from-{slug(self.teacher)}.steps{self.steps}.seed{self.seed}"


def root_dir(cache_dir: Path) -> Path:
    """Where distilled students are kept in the data cache."""
    return Path(cache_dir) / "bert" / "distilled"


def find_distilled(spec: DistillSpec, cache_dir: Path, fail: Callable[[str], None] | None = None) -> Path | None:
    """The directory of a finished distillation of ``spec``, or None (``fail`` hears why). If several exist
    (a different teacher copy or text), the newest wins, with a warning."""
    base = root_dir(cache_dir) / spec.dirname
    found = finished_directories(base)
    if not found:
        if fail:
            fail(f"distilled here {base}: none yet (make it with `nmtcore bert-build {spec.name}`)")
        return None
    if len(found) > 1:
        log.warning("%d distillations of %s (different teacher weights or text); using the newest", len(found), spec.name)
    return max(found, key=lambda d: (d / "meta.json").stat().st_mtime)
