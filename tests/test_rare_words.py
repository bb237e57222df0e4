"""Where an arm's Δ comes from (``nmtcore.sweep.rare_words``): which test sentences have a source word rare in
training, each arm against the reference on those and on the rest, and the report's table of it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.sweep import lifecycle, rare_words, report, results
from tests.test_report import LANG, REFS, SPLIT, add_trial


def test_words_are_lower_cased_without_surrounding_punctuation():
    assert rare_words.words('A "Boston" Terrier, running... on grass.') == ["a", "boston", "terrier", "running", "on",
                                                                           "grass"]
    assert rare_words.words("— ...") == []


def test_a_sentence_is_rare_when_one_of_its_words_is_seen_at_most_twice_in_training():
    counts = rare_words.word_counts(["a dog runs", "a dog sits", "a cat sits", "a cat runs", "an owl"])
    assert counts["a"] == 4 and counts["owl"] == 1
    assert rare_words.rare_mask(counts, ["a dog runs.", "A cat sits", "an owl flies", "a dog"], rare_max=1) == [
        False, False, True, False]  # "an" and "owl" once, "flies" never; "dog" twice
    assert rare_words.rare_mask(counts, ["a dog runs."], rare_max=2) == [True]  # "dog", "runs" twice


def test_the_parts_split_the_delta_where_the_arm_differs():
    """An arm that gets exactly the marked sentences right where the reference gets them wrong: all of its gain is
    on the marked part, none on the rest; seeds pooled (the mask repeated per seed)."""
    rng = random.Random(0)
    mask = [rng.random() < 0.3 for _ in REFS]
    ref_hyps = ["ein haus steht" if m else r for r, m in zip(REFS, mask)]
    parts = rare_words.compare_parts(ref_hyps * 2, list(REFS) * 2, list(REFS) * 2, mask, n_bootstrap=200, seed=1)
    assert parts["rare"].sentences == sum(mask) and parts["rest"].sentences == len(mask) - sum(mask)
    assert parts["rare"].delta > 50 and parts["rare"].p < 0.05 and parts["rare"].ci_low > 0
    assert parts["rest"].delta == 0 and parts["rest"].arm_bleu == pytest.approx(100)
    with pytest.raises(ValueError, match="not a whole number"):
        rare_words.compare_parts(ref_hyps, REFS, REFS[:-1], mask, n_bootstrap=10, seed=1)


def test_the_report_says_where_each_arm_gained_when_the_sweep_s_data_is_here(tmp_path: Path):
    """A toy sweep whose runs name a corpus on disk: the arm fixes exactly the test sentences with a word the training
    source lacks, so the report's table puts its whole Δ on `rare`. Without the data, one line says why."""
    data = tmp_path / "data"
    data.mkdir()
    train = ["the dog sees the cat", "a dog sees a cat", "the cat sees the dog"] * 10
    src = [f"the dog sees the {'zebra' if i % 4 == 0 else 'cat'}" for i in range(len(REFS))]  # zebra: unseen
    for split, (en, de) in (("train", (train, ["der hund sieht die katze"] * len(train))), (SPLIT, (src, REFS))):
        (data / f"{split}.en").write_text("\n".join(en) + "\n", encoding="utf-8")
        (data / f"{split}.{LANG}").write_text("\n".join(de) + "\n", encoding="utf-8")
    rare = [i % 4 == 0 for i in range(len(REFS))]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.study": "ablations",
        "nmtcore.varied_keys": "arm", "nmtcore.test_splits": SPLIT,
        "nmtcore.space_json": json.dumps({"metric": "valid_bleu"}), "nmtcore.protocol": "control arm: yes"})
    control_hyps = ["ein haus steht" if r else ref for ref, r in zip(REFS, rare)]
    add_trial(parent, tmp_path, 1, 0, "control", control_hyps, control=True)
    add_trial(parent, tmp_path, 1, 1, "fused", list(REFS), {"arm": "fused"})
    for run in results.sweep_children(parent.run_id, uri):
        again = tracking.Tracker(uri, run_id=run.run_id)
        again.log_params({"data.corpus": "parallel", "data.data_dir": str(data), "data.src_lang": "en",
                          "data.tgt_lang": LANG, "data.test_splits": f"[{SPLIT}]", "data.download": "False"})
        again.end()
    rep = results.build_report("toy", uri, n_bootstrap=200)
    parts = rep.groups[1].by_rarity[SPLIT]
    assert parts["rare"].sentences == sum(rare) and parts["rare"].delta > 50 and parts["rare"].p < 0.05
    assert parts["rest"].delta == 0
    text = report.render_markdown(rep)
    assert f"*{SPLIT}* (rare: {sum(rare)} sentences, rest: {len(rare) - sum(rare)})" in text
    assert "| fused | " in text and "**Where the Δ comes from**" in text
    out = report.write_report(rep, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "report.json").read_text())["by_source_rarity"]["fused"][SPLIT]["rest"][
        "delta"] == 0 and out

    (data / "train.en").unlink()  # another machine: the store came along, the data did not
    missing = results.build_report("toy", uri, n_bootstrap=200)
    assert not missing.groups[1].by_rarity and "not readable here" in missing.rarity_missing
    assert "No comparison by source-word rarity: the sweep's data is not readable here" in report.render_markdown(
        missing)
