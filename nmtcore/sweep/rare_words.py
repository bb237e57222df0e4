"""Where an arm's Δ comes from: the test sentences with a source word rare in training against the rest.

A pretrained encoder has seen far more text than the translation model's training set, so the first place to look
for what it adds is the words the training set barely has. Each test set is split in two: the sentences with at
least one source word seen at most :data:`RARE_MAX` times in the training split's source side (words: whitespace
tokens, lower-cased, surrounding punctuation removed) and the rest. Every arm is compared with the reference on
each part as the report compares them on the whole set (seeds pooled, paired bootstrap). The split needs the
sweep's data on this machine (the trial's ``data.*`` params name it); a report built where the data is not gets no
such table and says why.
"""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from nmtcore import bleu

RARE_MAX = 2  # a word seen at most this many times in the training source is rare
_PUNCT = string.punctuation + "“”„‘’«»…–—"


def words(line: str) -> list[str]:
    """``line``'s words as counted here: whitespace tokens, lower-cased, surrounding punctuation removed."""
    return [w for w in (t.strip(_PUNCT).lower() for t in line.split()) if w]


def word_counts(lines: Iterable[str]) -> Counter[str]:
    """How often each word occurs in ``lines``."""
    return Counter(w for line in lines for w in words(line))


def rare_mask(counts: Mapping[str, int], lines: Sequence[str], rare_max: int = RARE_MAX) -> list[bool]:
    """For each line: whether it has a word seen at most ``rare_max`` times in ``counts`` (unseen included)."""
    return [any(counts.get(w, 0) <= rare_max for w in words(line)) for line in lines]


def masks_from_data(params: Mapping[str, str], splits: Sequence[str]) -> tuple[dict[str, list[bool]], str]:
    """Each test split's rare-word mask, from the data a trial's ``params`` name (its ``data.*`` keys), and ""; or
    ({}, why not) when that data is not readable here."""
    from nmtcore.config import ConfigError, ExperimentConfig
    from nmtcore.data import DataError, load_split

    data = {k: v for k, v in params.items() if k.startswith("data.")}
    if not data:
        return {}, "the trials' runs do not name their data"
    try:  # files on this machine only: a report never downloads a corpus
        cfg = ExperimentConfig().with_overrides({**data, "data.download": False}).data
        counts = word_counts(load_split(cfg, cfg.train_split).src)
        return {split: rare_mask(counts, load_split(cfg, split).src) for split in splits}, ""
    except (ConfigError, DataError, OSError, ValueError) as e:
        return {}, f"the sweep's data is not readable here ({' '.join(str(e).split())[:200]})"


@dataclass
class PartComparison:
    """One arm against the reference on one part of a test set (seeds pooled)."""

    sentences: int  # in the part, per seed
    reference_bleu: float
    arm_bleu: float
    delta: float
    ci_low: float
    ci_high: float
    p: float


def compare_parts(ref_hyps: Sequence[str], arm_hyps: Sequence[str], refs: Sequence[str], mask: Sequence[bool],
                  n_bootstrap: int, seed: int) -> dict[str, PartComparison]:
    """``arm_hyps`` against ``ref_hyps`` on the sentences ``mask`` marks (``rare``) and on the others (``rest``);
    the three lists are seeds one after another, ``mask`` one seed's (repeated to their length). A part with no
    sentence is left out."""
    if len(refs) % max(len(mask), 1):
        raise ValueError(f"{len(refs)} pooled references are not a whole number of {len(mask)}-sentence seeds")
    full = list(mask) * (len(refs) // max(len(mask), 1))
    out = {}
    for part, keep in (("rare", True), ("rest", False)):
        idx = [i for i, m in enumerate(full) if m is keep]
        if not idx:
            continue
        a, b, r = [ref_hyps[i] for i in idx], [arm_hyps[i] for i in idx], [refs[i] for i in idx]
        res = bleu.paired_bootstrap(a, b, r, n_samples=n_bootstrap, seed=seed)
        sa, sb = bleu.corpus_bleu(a, r).score, bleu.corpus_bleu(b, r).score
        out[part] = PartComparison(sentences=sum(1 for m in mask if m is keep), reference_bleu=sa, arm_bleu=sb,
                                   delta=sb - sa, ci_low=res.ci_diff[0], ci_high=res.ci_diff[1],
                                   p=res.p_value_two_sided)
    return out
