"""Corpus-level evaluation: sacreBLEU BLEU and chrF, tokenized BLEU, paired bootstrap resampling.

Every score carries its sacreBLEU signature (``nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|
version:2.6.0``) so a number in a report can always be traced to the exact metric settings.

Two BLEU flavours exist because the literature uses two:

* :func:`corpus_bleu` is the standard, comparable metric: **detokenized** hypotheses against raw
  references, sacreBLEU's default ``13a`` tokenizer, case-sensitive (Post, 2018).
* :func:`tokenized_bleu` reproduces what fairseq-style papers (IWSLT'14 De→En and friends) report:
  ``multi-bleu.perl -lc`` on text that is already tokenized — lowercase both sides, split on
  whitespace, no further tokenization. Its numbers are *not* comparable with :func:`corpus_bleu`.

Only one reference per segment is supported (the setting of every corpus nmtcore trains on).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence

import numpy as np
from sacrebleu.metrics import BLEU, CHRF
from sacrebleu.metrics.base import Metric

MetricName = Literal["bleu", "chrf"]


@dataclass(frozen=True)
class Score:
    """One corpus-level score with the sacreBLEU signature that makes it reproducible.

    ``precisions`` (n-gram precisions in %), ``bp`` (brevity penalty), ``sys_len`` and ``ref_len``
    (token counts after the metric's tokenization) are filled for BLEU and left empty for chrF.
    """

    name: str  # "BLEU" or "chrF2"
    score: float
    signature: str
    precisions: tuple[float, ...] = ()
    bp: float | None = None
    sys_len: int | None = None
    ref_len: int | None = None

    @property
    def len_ratio(self) -> float:
        """The output's length over the references' (BLEU only; NaN where there are no reference tokens)."""
        return self.sys_len / self.ref_len if self.sys_len is not None and self.ref_len else math.nan

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tuples become lists)."""
        d = asdict(self)
        d["precisions"] = list(self.precisions)
        return d

    def __str__(self) -> str:
        if self.precisions:
            prec = "/".join(f"{p:.1f}" for p in self.precisions)
            return (f"{self.name} = {self.score:.2f} {prec} (BP = {self.bp:.3f} hyp_len = {self.sys_len} "
                    f"ref_len = {self.ref_len}) [{self.signature}]")
        return f"{self.name} = {self.score:.2f} [{self.signature}]"


@dataclass(frozen=True)
class BootstrapResult:
    """Paired bootstrap comparison of system A (baseline) and system B (candidate).

    ``score_*`` are the scores on the full test set; ``mean_*``/``ci_*`` the bootstrap mean and
    95% percentile interval ``(low, high)``. ``diff = score_b - score_a``. ``p_value`` is one-sided
    (H1: B is better than A); ``p_value_two_sided`` tests H1: B differs from A.
    """

    metric: str
    signature: str
    n_samples: int
    seed: int
    score_a: float
    score_b: float
    mean_a: float
    mean_b: float
    ci_a: tuple[float, float]
    ci_b: tuple[float, float]
    diff: float
    mean_diff: float
    ci_diff: tuple[float, float]
    p_value: float
    p_value_two_sided: float

    def significant(self, alpha: float = 0.05, two_sided: bool = False) -> bool:
        """Whether B beats A (one-sided) or differs from A (two-sided) at level ``alpha``."""
        return (self.p_value_two_sided if two_sided else self.p_value) < alpha

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (tuples become lists)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


# ---------------------------------------------------------------------------------- corpus scores
def corpus_bleu(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """sacreBLEU corpus BLEU of detokenized ``hyps`` against raw ``refs`` (13a, case-sensitive).

    Raises:
        ValueError: if the two lists differ in length or are empty.
    """
    return _bleu_score(BLEU(), hyps, refs)


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], tokenize: str = "none") -> Score:
    """Lowercased BLEU on already-tokenized text, as reported by fairseq-style papers.

    With the default ``tokenize="none"`` both sides are lowercased and split on whitespace only,
    which equals ``multi-bleu.perl -lc`` on the same files (single reference, closest-length
    brevity penalty) except that sacreBLEU's ``exp`` smoothing gives a small non-zero score where
    multi-bleu.perl returns 0 (an n-gram order with no match at all, i.e. tiny test sets). Feed it
    Moses-tokenized text with BPE/SentencePiece merged back into words. ``tokenize="13a"`` instead
    gives sacreBLEU ``-lc`` on detokenized text. The signature records either choice
    (``case:lc|tok:none``).

    Raises:
        ValueError: if the two lists differ in length or are empty.
    """
    # force=True: tokenized input is the point here, so silence sacreBLEU's "looks tokenized" warning.
    return _bleu_score(BLEU(lowercase=True, tokenize=tokenize, force=True), hyps, refs)


def corpus_chrf(hyps: Sequence[str], refs: Sequence[str]) -> Score:
    """sacreBLEU corpus chrF (chrF2: character 6-grams, beta 2, case-sensitive) of ``hyps``.

    Raises:
        ValueError: if the two lists differ in length or are empty.
    """
    _check_lengths(hyps, refs)
    metric = CHRF()
    s = metric.corpus_score(list(hyps), [list(refs)])
    return Score(name=s.name, score=float(s.score), signature=str(metric.get_signature()))


def evaluate_files(hyp_path: str | os.PathLike, ref_path: str | os.PathLike) -> dict[str, Any]:
    """Score a detokenized hypothesis file against a reference file, one segment per line.

    Returns a JSON-serialisable dict: ``bleu``, ``chrf``, their ``*_signature``, the BLEU details
    (``precisions``, ``bp``, ``sys_len``, ``ref_len``), ``n_segments`` and both paths (absolute).

    Raises:
        ValueError: if the files have different numbers of lines (both counts and paths named).
    """
    hyps, refs = _read_lines(hyp_path), _read_lines(ref_path)
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses in {hyp_path} but {len(refs)} references in {ref_path}")
    bleu, chrf = corpus_bleu(hyps, refs), corpus_chrf(hyps, refs)
    return {
        "bleu": bleu.score,
        "bleu_signature": bleu.signature,
        "chrf": chrf.score,
        "chrf_signature": chrf.signature,
        "precisions": list(bleu.precisions),
        "bp": bleu.bp,
        "sys_len": bleu.sys_len,
        "ref_len": bleu.ref_len,
        "n_segments": len(hyps),
        "hyp_path": str(os.path.abspath(hyp_path)),
        "ref_path": str(os.path.abspath(ref_path)),
    }


def compare_files(hyp_path: str | os.PathLike, against_path: str | os.PathLike, ref_path: str | os.PathLike,
                  n_samples: int = 1000) -> dict[str, Any]:
    """``hyp_path``'s hypotheses against another system's (``against_path``) on the same references: that system's
    BLEU and brevity penalty, ΔBLEU (``hyp_path`` minus it), the 95% interval of the difference and the two-sided
    p of a paired bootstrap (:func:`paired_bootstrap`, ``n_samples`` resamples; one-sided too).

    Raises:
        ValueError: if a file's line count differs from the references' (named).
    """
    hyps, against, refs = _read_lines(hyp_path), _read_lines(against_path), _read_lines(ref_path)
    for path, lines in ((hyp_path, hyps), (against_path, against)):
        if len(lines) != len(refs):
            raise ValueError(f"{len(lines)} hypotheses in {path} but {len(refs)} references in {ref_path}")
    test = paired_bootstrap(against, hyps, refs, n_samples=n_samples)
    other = corpus_bleu(against, refs)
    return {"hyp_path": str(os.path.abspath(against_path)), "bleu": other.score, "bp": other.bp,
            "delta": test.diff, "ci95": list(test.ci_diff), "p": test.p_value_two_sided,
            "p_one_sided": test.p_value, "n_samples": test.n_samples}


# ------------------------------------------------------------------------------ paired bootstrap
def paired_bootstrap(hyps_a: Sequence[str], hyps_b: Sequence[str], refs: Sequence[str],
                     n_samples: int = 1000, seed: int = 12345,
                     metric: MetricName = "bleu") -> BootstrapResult:
    """Paired bootstrap resampling (Koehn, 2004) of system B against baseline A.

    Each of ``n_samples`` test sets is drawn from the segment indices with replacement and the same
    draw scores both systems (that pairing is what makes the test sensitive). Per-segment
    sufficient statistics (n-gram matches/totals and lengths for BLEU, character n-gram counts for
    chrF) are extracted once with sacreBLEU; a sample's corpus statistics are then the count-weighted
    sum of segment statistics, one matrix product for all samples, and the score is sacreBLEU's own
    ``_compute_score_from_stats``, so every sample score is exactly what sacreBLEU would report.

    p-values, with ``d_s = score_b - score_a`` on sample ``s``:

    * ``p_value`` (one-sided, Koehn 2004): the fraction of samples where B is *not* better,
      ``#{d_s <= 0} / n``. Identical systems give 1.0.
    * ``p_value_two_sided``: ``min(1, 2 * min(#{d_s <= 0}, #{d_s >= 0}) / n)``, the percentile
      bootstrap test of "the systems differ" in either direction. Identical systems give 1.0.

    Deterministic for a given ``seed`` (numpy ``default_rng``).

    Raises:
        ValueError: on length mismatch, empty input, ``n_samples < 1`` or an unknown metric.
    """
    _check_lengths(hyps_a, refs, "hyps_a")
    _check_lengths(hyps_b, refs, "hyps_b")
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    scorer = _make_metric(metric)
    ref_streams = [list(refs)]
    # Cache the reference n-grams once: both systems are scored against the same references.
    scorer._ref_cache = scorer._cache_references(ref_streams)
    stats_a = np.asarray(scorer._extract_corpus_statistics(list(hyps_a), None), dtype=np.int64)  # (N, K)
    stats_b = np.asarray(scorer._extract_corpus_statistics(list(hyps_b), None), dtype=np.int64)  # (N, K)
    n = len(refs)

    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_samples, n))  # (S, N) resampled segment indices
    # How often each segment occurs in each sample: offset every row into its own block of n bins
    # so one bincount counts all samples at once.
    weights = np.bincount((idx + n * np.arange(n_samples)[:, None]).ravel(),
                          minlength=n_samples * n).reshape(n_samples, n)  # (S, N)
    sample_a = weights @ stats_a  # (S, K) corpus statistics per sample
    sample_b = weights @ stats_b  # (S, K)

    scores_a = _scores_from_stats(scorer, sample_a)  # (S,)
    scores_b = _scores_from_stats(scorer, sample_b)  # (S,)
    deltas = scores_b - scores_a
    not_better = int(np.count_nonzero(deltas <= 0))
    not_worse = int(np.count_nonzero(deltas >= 0))

    score_a = _score_from_stats(scorer, stats_a.sum(axis=0))
    score_b = _score_from_stats(scorer, stats_b.sum(axis=0))
    return BootstrapResult(
        metric=metric,
        signature=str(scorer.get_signature()),
        n_samples=n_samples,
        seed=seed,
        score_a=score_a,
        score_b=score_b,
        mean_a=float(scores_a.mean()),
        mean_b=float(scores_b.mean()),
        ci_a=_ci95(scores_a),
        ci_b=_ci95(scores_b),
        diff=score_b - score_a,
        mean_diff=float(deltas.mean()),
        ci_diff=_ci95(deltas),
        p_value=not_better / n_samples,
        p_value_two_sided=min(1.0, 2.0 * min(not_better, not_worse) / n_samples),
    )


# ------------------------------------------------------------------------------------- internals
def _check_lengths(hyps: Sequence[str], refs: Sequence[str], what: str = "hypotheses") -> None:
    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} {what} but {len(refs)} references: lengths must match")
    if not refs:
        raise ValueError("cannot score an empty corpus (0 hypotheses, 0 references)")
    # sacreBLEU's own checks only look at element 0; a None elsewhere would fail deep inside it.
    for name, seq in ((what, hyps), ("references", refs)):
        bad = next((i for i, s in enumerate(seq) if not isinstance(s, str)), None)
        if bad is not None:
            raise ValueError(f"{name}[{bad}] is {type(seq[bad]).__name__}, expected str")


def _bleu_score(metric: BLEU, hyps: Sequence[str], refs: Sequence[str]) -> Score:
    _check_lengths(hyps, refs)
    s = metric.corpus_score(list(hyps), [list(refs)])
    return Score(name=s.name, score=float(s.score), signature=str(metric.get_signature()),
                 precisions=tuple(float(p) for p in s.precisions), bp=float(s.bp),
                 sys_len=int(s.sys_len), ref_len=int(s.ref_len))


def _make_metric(metric: str) -> Metric:
    if metric == "bleu":
        return BLEU()
    if metric == "chrf":
        return CHRF()
    raise ValueError(f"metric must be 'bleu' or 'chrf', got {metric!r}")


def _score_from_stats(scorer: Metric, stats: np.ndarray) -> float:
    # Plain ints: BLEU.compute_bleu mutates/extends its count lists and expects Python numbers.
    return float(scorer._compute_score_from_stats([int(x) for x in stats]).score)


def _scores_from_stats(scorer: Metric, stats: np.ndarray) -> np.ndarray:
    # O(S) calls on already-summed statistics (~10 µs each); the O(S·N) work is the matrix product.
    return np.array([float(scorer._compute_score_from_stats(row).score) for row in stats.tolist()])


def _ci95(values: np.ndarray) -> tuple[float, float]:
    lo, hi = np.percentile(values, [2.5, 97.5])
    return float(lo), float(hi)


def _read_lines(path: str | os.PathLike) -> list[str]:
    # Only the line terminator is stripped: leading/trailing spaces are part of the output.
    with open(path, encoding="utf-8", newline="") as f:
        return [line.rstrip("\r\n") for line in f]
