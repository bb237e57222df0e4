"""The equal-length check (``nmtcore lengths``): which penalty each model keeps, what the comparison says when one
system is short only because of its decoding, and where a trial's tested weights are found."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.sweep import lengths
from nmtcore.sweep.lifecycle import ARM_TAG

REFS = [f"a man number {i} rides a red bike down the long hill today" for i in range(40)]
SRC = [f"source {i}" for i in range(40)]


def _writer(cut_at: dict[float, int], default: int = 0):
    """A fake model: each reference with its last ``cut_at[lenpen]`` words dropped (shorter at lower penalties),
    ``default`` for a penalty not listed."""
    def translate(checkpoint: Path, split: str, lines: list[str], lenpen: float) -> list[str]:
        cut = cut_at.get(lenpen, default)
        return [" ".join(r.split()[: len(r.split()) - cut]) for r in REFS[: len(lines)]]
    return translate


def test_the_penalty_with_the_best_validation_bleu_is_kept_and_ties_go_to_the_one_nearest_1():
    assert lengths.pick_lenpen({0.6: {"bleu": 30.0}, 1.0: {"bleu": 31.0}, 1.8: {"bleu": 32.5}}) == 1.8
    assert lengths.pick_lenpen({0.6: {"bleu": 31.0}, 1.0: {"bleu": 31.0}, 1.8: {"bleu": 31.0}}) == 1.0
    assert lengths.pick_lenpen({1.4: {"bleu": 31.0}, 2.4: {"bleu": 31.0}}) == 1.4


def test_a_control_short_only_at_the_default_penalty_is_level_with_the_arm_at_equal_length():
    """The control drops 3 words at lenpen 1.0 (BLEU loses to the brevity penalty) and none at 1.8; the arm writes
    full sentences at every penalty. Kept penalties: 1.8 and the arm's tie-break 1.0; the comparison is then level,
    at BP 1.000 on both sides."""
    tests = {"test": (SRC, REFS)}
    trials = []
    for seed in ("1", "2"):
        ctl = lengths.TrialDecodes("control", seed, Path(f"/c{seed}.pt"))
        trials.append(lengths.decode_trial(ctl, ("valid", SRC, REFS), tests, (1.0, 1.8), _writer({1.0: 3, 1.8: 0})))
        arm = lengths.TrialDecodes("bert_fused", seed, Path(f"/a{seed}.pt"))
        trials.append(lengths.decode_trial(arm, ("valid", SRC, REFS), tests, (1.0, 1.8), _writer({}, default=0)))
    ctl = trials[0]
    assert ctl.valid[1.0]["len_ratio"] < 0.8 and ctl.valid[1.0]["bleu"] < ctl.valid[1.8]["bleu"] == pytest.approx(100.0)
    assert [t.lenpen for t in trials] == [1.8, 1.0, 1.8, 1.0]
    assert ctl.test["test"]["bp"] == pytest.approx(1.0) and ctl.test["test"]["bleu"] == pytest.approx(100.0)
    rows = lengths.compare(trials, "control", {"test": REFS}, n_bootstrap=200)
    assert len(rows) == 1
    row = rows[0]
    assert row["arm"] == "bert_fused" and row["seeds"] == ["1", "2"] and row["delta"] == pytest.approx(0.0)
    assert row["reference_bp"] == pytest.approx(1.0) and row["arm_bp"] == pytest.approx(1.0) and row["p"] == 1.0
    assert row["lenpens"] == {"reference": [1.8, 1.8], "arm": [1.0, 1.0]}
    md = lengths.render("toy", (1.0, 1.8), trials, rows)
    assert "| test | bert_fused | 100.00 (1.000) | 100.00 (1.000) | +0.00 |" in md
    assert "| control | 1 | 1.8 | 1: " in md


def test_an_arm_that_stays_short_at_every_penalty_loses_at_equal_length():
    tests = {"test": (SRC, REFS)}
    ctl = lengths.decode_trial(lengths.TrialDecodes("control", "1", Path("/c.pt")), ("valid", SRC, REFS), tests, (1.0, 1.8),
                               _writer({}, default=0))
    arm = lengths.decode_trial(lengths.TrialDecodes("short", "1", Path("/a.pt")), ("valid", SRC, REFS), tests, (1.0, 1.8),
                               _writer({}, default=2))
    (row,) = lengths.compare([ctl, arm], "control", {"test": REFS}, n_bootstrap=200)
    assert row["delta"] < -5 and row["arm_bp"] < 1.0 and row["ci_high"] < 0 and row["p"] < 0.05
    with pytest.raises(lengths.LengthCheckError, match="reference arm 'base'"):
        lengths.compare([ctl, arm], "base", {"test": REFS})


@pytest.mark.parametrize("final, name", [("epoch9.pt", "epoch9.pt"), ("epoch12.pt (last)", "epoch12.pt"),
                                         ("average of epoch11.pt, epoch12.pt", "averaged.pt")])
def test_the_tested_weights_are_found_from_the_trial_s_run(tmp_path: Path, final: str, name: str):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    out = tmp_path / "trial"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / name).write_bytes(b"weights")
    with tracking.Tracker(uri, experiment="sweeps", run_name="t", tags={ARM_TAG: "bert_fused"}) as t:
        t.log_params({"output_dir": str(out)})
        t.log_dict({"final_model": final}, "summary.json")
        run_id = t.run_id
    run = tracking.get_run(run_id, uri)
    assert lengths.tested_checkpoint(run, uri) == out / "checkpoints" / name
    (out / "checkpoints" / name).unlink()
    with pytest.raises(lengths.LengthCheckError, match=r"bert_fused\): its tested weights .* are not on this machine"):
        lengths.tested_checkpoint(run, uri)


def test_the_command_refuses_bad_penalties_and_an_unknown_sweep_in_one_line(tmp_path: Path, capsys):
    from nmtcore.cli.main import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert main(["lengths", "--sweep", "s", "--tracking-uri", uri, "--lenpens", "1.0,long"]) == 2
    assert "--lenpens: a comma list of numbers, got '1.0,long'" in capsys.readouterr().err
    assert main(["lengths", "--sweep", "s", "--tracking-uri", uri, "--lenpens", "-1"]) == 2
    assert "--lenpens: non-negative numbers" in capsys.readouterr().err
    assert main(["lengths", "--sweep", "nowhere", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tracking store at" in err[0]
    with tracking.Tracker(uri, experiment="sweeps", run_name="another"):
        pass
    capsys.readouterr()  # MLflow's own lines on creating the store
    assert main(["lengths", "--sweep", "nowhere", "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0]


def test_a_document_model_is_decoded_with_its_context_as_its_trial_decoded_it(tmp_path: Path):
    """A tiny document model (warm-started from a sentence-level baseline, frozen BERT reading the previous sentence):
    at the study's own penalty the check's decode of its test split is the trial's test output, each sentence with its
    document's context; the baseline (no context) still translates lines."""
    from nmtcore.data import load_split
    from nmtcore.engine import run_experiment
    from nmtcore.engine.trainer import tested_file
    from tests.test_doc_context import baseline_then_doc_model

    cfg = baseline_then_doc_model(tmp_path, epochs=2)
    summary = run_experiment(cfg)
    checkpoint = tmp_path / "doc" / "checkpoints" / tested_file(summary.final_model)
    trial = Path(summary.test["test"].hyp_path).read_text(encoding="utf-8").splitlines()
    src = load_split(cfg.data, "test").src
    assert lengths.reads_documents(lengths._translator(checkpoint).model)
    assert lengths._translate(checkpoint, "test", src, cfg.decode.lenpen) == trial
    with pytest.raises(lengths.LengthCheckError, match="no split 'test' with these 3 sources"):
        lengths._translate(checkpoint, "test", src[:3], cfg.decode.lenpen)
    baseline = tmp_path / "base" / "checkpoints" / "epoch2.pt"
    assert not lengths.reads_documents(lengths._translator(baseline).model)
    assert len(lengths._translate(baseline, "test", src, 1.0)) == len(src)
