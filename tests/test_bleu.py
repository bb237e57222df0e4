"""nmtcore.bleu: known values, sacreBLEU agreement, paired bootstrap invariants."""

from __future__ import annotations

import math
import random
import time

import numpy as np
import pytest
import sacrebleu

from nmtcore.bleu import (
    BootstrapResult,
    Score,
    corpus_bleu,
    corpus_chrf,
    evaluate_files,
    paired_bootstrap,
    tokenized_bleu,
)

VOCAB = [f"w{i}" for i in range(60)]


def _corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCAB, k=rng.randint(6, 20))) for _ in range(n)]


def _corrupt(refs: list[str], p: float, seed: int) -> list[str]:
    """A synthetic system: each reference word replaced by a random word with probability p."""
    rng = random.Random(seed)
    return [" ".join(w if rng.random() > p else rng.choice(VOCAB) for w in r.split()) for r in refs]


@pytest.fixture(scope="module")
def systems() -> tuple[list[str], list[str], list[str]]:
    refs = _corpus(300)
    return _corrupt(refs, 0.5, seed=1), _corrupt(refs, 0.2, seed=2), refs  # A worse, B better


# -------------------------------------------------------------------------------- corpus scores
def test_identical_is_100() -> None:
    refs = ["The cat sat on the mat.", "A dog barked loudly at the mailman."]
    s = corpus_bleu(refs, refs)
    assert isinstance(s, Score)
    assert s.score == pytest.approx(100.0)
    assert s.bp == 1.0 and s.sys_len == s.ref_len
    assert s.precisions == pytest.approx((100.0, 100.0, 100.0, 100.0))
    assert corpus_chrf(refs, refs).score == pytest.approx(100.0)


def test_hand_checked_bleu() -> None:
    # 13a splits the final period: 7 tokens each side; one substitution ("the" → "a").
    # Matches per order: 6/7, 4/6, 2/5, 1/4; equal lengths → BP = 1.
    s = corpus_bleu(["the cat sat on the mat."], ["the cat sat on a mat."])
    expected = 100 * (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25
    assert s.score == pytest.approx(expected)
    assert s.precisions == pytest.approx((600 / 7, 400 / 6, 40.0, 25.0))
    assert (s.sys_len, s.ref_len, s.bp) == (7, 7, 1.0)
    assert s.signature == f"nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:{sacrebleu.__version__}"


def test_brevity_penalty() -> None:
    s = corpus_bleu(["a b c d e"], ["a b c d e f g h i j"])
    assert s.bp == pytest.approx(math.exp(1 - 10 / 5))
    assert s.score == pytest.approx(100 * math.exp(1 - 10 / 5))


def test_matches_sacrebleu_directly(systems) -> None:
    a, _, refs = systems
    assert corpus_bleu(a, refs).score == pytest.approx(sacrebleu.corpus_bleu(a, [refs]).score)
    chrf = corpus_chrf(a, refs)
    assert chrf.score == pytest.approx(sacrebleu.corpus_chrf(a, [refs]).score)
    assert chrf.name == "chrF2" and "nc:6" in chrf.signature and chrf.precisions == ()


def test_tokenized_bleu_lowercases_and_splits_on_whitespace() -> None:
    hyps = ["The Cat , sat ."]
    refs = ["the cat , sat ."]
    s = tokenized_bleu(hyps, refs)
    assert s.score == pytest.approx(100.0)
    assert "case:lc" in s.signature and "tok:none" in s.signature
    # tok:none really does not tokenize: "mat." is one token, so it cannot match "mat".
    t = tokenized_bleu(["on the mat."], ["on the mat ."])
    assert t.sys_len == 3 and t.ref_len == 4
    # ...whereas 13a splits the period, and case still does not matter.
    assert tokenized_bleu(["On the mat."], ["on the mat ."], tokenize="13a").score == pytest.approx(100.0)
    # The detokenized metric is case-sensitive.
    assert corpus_bleu(hyps, refs).score < 100.0


@pytest.mark.parametrize("fn", [corpus_bleu, corpus_chrf, tokenized_bleu])
def test_length_mismatch_names_both_counts(fn) -> None:
    with pytest.raises(ValueError, match=r"3 hypotheses but 2 references"):
        fn(["a", "b", "c"], ["a", "b"])


def test_empty_and_none_rejected() -> None:
    with pytest.raises(ValueError, match="empty"):
        corpus_bleu([], [])
    with pytest.raises(ValueError, match=r"hypotheses\[1\] is NoneType"):
        corpus_bleu(["a", None], ["a", "b"])  # type: ignore[list-item]


def test_evaluate_files(tmp_path, systems) -> None:
    a, _, refs = systems
    hyp_file, ref_file = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyp_file.write_text("\n".join(a) + "\n", encoding="utf-8")
    ref_file.write_text("\n".join(refs) + "\n", encoding="utf-8")
    out = evaluate_files(hyp_file, ref_file)
    assert out["n_segments"] == len(refs)
    assert out["bleu"] == pytest.approx(corpus_bleu(a, refs).score)
    assert out["chrf"] == pytest.approx(corpus_chrf(a, refs).score)
    assert out["bleu_signature"].startswith("nrefs:1|case:mixed")
    ref_file.write_text("\n".join(refs[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{len(a)} hypotheses in .*hyp.txt but {len(refs) - 1} references"):
        evaluate_files(hyp_file, ref_file)


def test_compare_files_is_the_paired_bootstrap_of_the_two_files(tmp_path, systems) -> None:
    from nmtcore.bleu import compare_files

    a, b, refs = systems
    for name, lines in (("a", a), ("b", b), ("ref", refs)):
        (tmp_path / name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = compare_files(tmp_path / "b", tmp_path / "a", tmp_path / "ref", n_samples=300)
    test = paired_bootstrap(a, b, refs, n_samples=300)
    assert out["bleu"] == pytest.approx(corpus_bleu(a, refs).score) and out["delta"] == pytest.approx(test.diff)
    assert out["ci95"] == pytest.approx(list(test.ci_diff)) and out["p"] == test.p_value_two_sided
    (tmp_path / "a").write_text("\n".join(a[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=rf"{len(a) - 1} hypotheses in .*a but {len(refs)} references"):
        compare_files(tmp_path / "b", tmp_path / "a", tmp_path / "ref")


# ------------------------------------------------------------------------------ paired bootstrap
def test_bootstrap_deterministic(systems) -> None:
    a, b, refs = systems
    r1 = paired_bootstrap(a, b, refs, n_samples=200, seed=7)
    r2 = paired_bootstrap(a, b, refs, n_samples=200, seed=7)
    r3 = paired_bootstrap(a, b, refs, n_samples=200, seed=8)
    assert isinstance(r1, BootstrapResult)
    assert r1 == r2
    assert r1.mean_a != r3.mean_a


def test_bootstrap_identical_systems_not_significant(systems) -> None:
    a, _, refs = systems
    r = paired_bootstrap(a, list(a), refs, n_samples=300)
    assert r.p_value == 1.0 and r.p_value_two_sided == 1.0
    assert r.diff == 0.0 and r.ci_diff == (0.0, 0.0)
    assert not r.significant() and not r.significant(two_sided=True)


def test_bootstrap_better_system_significant(systems) -> None:
    a, b, refs = systems
    r = paired_bootstrap(a, b, refs, n_samples=500)
    assert r.score_a == pytest.approx(corpus_bleu(a, refs).score)
    assert r.score_b == pytest.approx(corpus_bleu(b, refs).score)
    assert r.diff == pytest.approx(r.score_b - r.score_a) and r.diff > 5
    assert r.p_value < 0.05 and r.significant()
    assert r.ci_a[0] <= r.mean_a <= r.ci_a[1] and r.ci_b[0] <= r.mean_b <= r.ci_b[1]
    assert r.ci_diff[0] > 0
    # Swapping the systems: B is now worse, so "B better" is not supported but "differ" still is.
    swapped = paired_bootstrap(b, a, refs, n_samples=500)
    assert swapped.p_value > 0.95 and swapped.p_value_two_sided < 0.05
    assert paired_bootstrap(a, b, refs, n_samples=200, metric="chrf").p_value < 0.05


def test_bootstrap_sample_scores_are_exact_sacrebleu(systems) -> None:
    # With one sample, the bootstrap mean is that sample's score: rebuild the same resample
    # (same RNG call as the implementation) and score it with sacreBLEU from scratch.
    a, b, refs = systems
    r = paired_bootstrap(a, b, refs, n_samples=1, seed=3)
    idx = np.random.default_rng(3).integers(0, len(refs), size=(1, len(refs)))[0]
    resampled_refs = [refs[i] for i in idx]
    assert r.mean_a == pytest.approx(sacrebleu.corpus_bleu([a[i] for i in idx], [resampled_refs]).score)
    assert r.mean_b == pytest.approx(sacrebleu.corpus_bleu([b[i] for i in idx], [resampled_refs]).score)


def test_bootstrap_errors(systems) -> None:
    a, b, refs = systems
    with pytest.raises(ValueError, match=rf"{len(a) - 1} hyps_b but {len(refs)} references"):
        paired_bootstrap(a, b[:-1], refs)
    with pytest.raises(ValueError, match="metric"):
        paired_bootstrap(a, b, refs, metric="ter")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_samples"):
        paired_bootstrap(a, b, refs, n_samples=0)


def test_bootstrap_speed() -> None:
    # The brief: 1000 samples of 1000 segments in < 2 s (measured ~0.2 s on 2 shared cores).
    refs = _corpus(1000, seed=5)
    a, b = _corrupt(refs, 0.4, seed=6), _corrupt(refs, 0.35, seed=7)
    start = time.perf_counter()
    paired_bootstrap(a, b, refs, n_samples=1000)
    assert time.perf_counter() - start < 2.0
