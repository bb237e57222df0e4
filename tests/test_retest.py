"""Test sets added after a sweep (``nmtcore retest``): each complete trial decoded as it decoded its own test sets,
its scores in its run, the report comparing every arm on the new split, and what the command refuses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.sweep import driver, lifecycle, report, results, retest, timing
from nmtcore.tracking import schema
from tests.test_report import LANG, REFS, SPLIT, add_trial, hyps

NEW = "test2"  # the split added after the sweep


def _sweep_with_checkpoints(tmp_path: Path, uri: str) -> tracking.Tracker:
    """A control and an arm, one seed, complete, each with its tested weights on disk, plus a failed retry."""
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.study": "ablations",
        "nmtcore.varied_keys": "arm", "nmtcore.test_splits": SPLIT,
        "nmtcore.space_json": json.dumps({"metric": "valid_bleu"}), "nmtcore.protocol": "control arm: yes"})
    add_trial(parent, tmp_path, 1, 0, "control", 0.3, control=True)
    add_trial(parent, tmp_path, 1, 1, "fused", 0.8, {"arm": "fused"})
    add_trial(parent, tmp_path, 2, 2, "fused", 0.8, {"arm": "fused"}, state="failed")
    for run in results.sweep_children(parent.run_id, uri):
        _weights(tmp_path, uri, run)
    return parent


def _weights(tmp_path: Path, uri: str, run: tracking.RunRecord) -> None:
    """``run``'s tested weights on disk, where its params and ``summary.json`` say they are."""
    out = tmp_path / run.run_id
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "epoch2.pt").write_bytes(b"weights")
    tracking.log_run_artifacts(run.run_id, [_file(tmp_path / "summary.json", '{"final_model": "epoch2.pt"}')],
                               None, uri)
    again = tracking.Tracker(uri, run_id=run.run_id)
    again.log_params({"output_dir": str(out), "data.valid_split": "val", "train.num_threads": 1})
    again.end(run.status)


def _file(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def _decoder(calls: list[tuple[str, str, int]], uri: str):
    """A model per checkpoint: the control's output right 30% of the time on the new split, the arm's 80%."""
    quality = {}
    for run in results.sweep_children(results.find_sweep_run("toy", uri).run_id, uri):
        quality[run.run_id] = 0.8 if run.tags.get(lifecycle.ARM_TAG) == "fused" else 0.3

    def decode(checkpoint: Path, split: str, threads: int) -> retest.Decoded:
        calls.append((checkpoint.parent.parent.name, split, threads))
        return retest.Decoded(hyps(quality[checkpoint.parent.parent.name], seed=7), list(REFS), 2.0)
    return decode


def test_every_complete_trial_is_scored_on_the_new_split_and_the_report_compares_the_arms_on_it(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = _sweep_with_checkpoints(tmp_path, uri)
    calls: list[tuple[str, str, int]] = []
    said: list[str] = []
    assert retest.retest_sweep("toy", [NEW], uri, decode=_decoder(calls, uri), say=said.append) == {NEW: 2}
    complete = [r for r in results.sweep_children(parent.run_id, uri) if results.trial_state(r) == "complete"]
    # The failed retry is not decoded; each trial decodes on its own thread count.
    assert sorted(calls) == sorted((r.run_id, NEW, 1) for r in complete)
    for run in complete:
        steps = tracking.get_run_metrics(run.run_id, uri)
        assert steps[f"test/{NEW}/bleu"][0][0] == steps[f"test/{SPLIT}/bleu"][0][0] == 2  # beside its own tests
        assert run.status == "FINISHED"
        assert tracking.read_artifact_text(run.run_id, f"references/{NEW}.{LANG}", uri).splitlines() == REFS
        assert len(tracking.read_artifact_text(run.run_id, f"hypotheses/{NEW}.{LANG}", uri).splitlines()) == len(REFS)
        tags = tracking.get_run(run.run_id, uri).tags
        assert "epoch2.pt" in tags[schema.RETESTED_PREFIX + NEW] and schema.bleu_signature(NEW) in tags
    assert tracking.get_run(parent.run_id, uri).tags[schema.TEST_SPLITS_ADDED] == NEW

    rep = results.build_report("toy", uri, n_bootstrap=200)
    assert rep.test_splits == [SPLIT, NEW] and rep.added_test_splits == [NEW]
    control, fused = rep.groups
    c = fused.comparisons[NEW]
    assert c.delta == pytest.approx(fused.bleu[NEW]["1"] - control.bleu[NEW]["1"]) and c.delta > 10 and c.p < 0.05
    text = report.render_markdown(rep)
    assert f"**{NEW}**" in text and f"Decoded after the sweep by `nmtcore retest`: {NEW}" in text
    assert not [w for w in rep.warnings if "nmtcore retest" in w]

    # Again: nothing decoded twice. A resumed sweep sets its parent's tags again: the added split stays.
    calls.clear()
    assert retest.retest_sweep("toy", [NEW], uri, decode=_decoder(calls, uri), say=said.append) == {NEW: 0}
    assert not calls and sum("scored already" in line for line in said) == 2
    assert retest.retest_sweep("toy", [NEW], uri, decode=_decoder(calls, uri), say=said.append, again=True) == {NEW: 2}
    assert len(calls) == 2
    assert results.build_report("toy", uri, n_bootstrap=0).groups[1].bleu[NEW]["1"] == fused.bleu[NEW]["1"]
    recorded = schema.SweepTags.from_tags(tracking.get_run(parent.run_id, uri).tags)
    tracking.Tracker(uri, run_id=parent.run_id, tags=recorded.to_tags()).end()
    assert results.build_report("toy", uri, n_bootstrap=0).test_splits == [SPLIT, NEW]

    # A trial that completes after the retest has no score on the split: the report says so and how to get it.
    add_trial(tracking.Tracker(uri, run_id=parent.run_id), tmp_path, 2, 3, "control", 0.3, control=True)
    late = results.build_report("toy", uri, n_bootstrap=0)
    assert any(w.startswith(f"{NEW} (added by nmtcore retest): 1 complete trial(s) not decoded on it (control seed 2)")
               for w in late.warnings)
    # A sweep that finishes decodes the added splits with the trials that completed since, before its report.
    late_run = next(r for r in results.sweep_children(parent.run_id, uri) if r.run_name == "control seed 2")
    _weights(tmp_path, uri, late_run)
    calls.clear()
    clock = timing.PhaseClock()
    assert driver.retest_added(parent.run_id, uri, decode=_decoder(calls, uri), clock=clock) == {NEW: 1}
    assert len(calls) == 1 and "retest" in clock.session()["phases"]
    assert not [w for w in results.build_report("toy", uri, n_bootstrap=0).warnings if "nmtcore retest" in w]


def test_the_command_refuses_a_tested_validation_or_training_split_and_a_sweep_without_weights(tmp_path, capsys):
    from nmtcore.cli.main import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _sweep_with_checkpoints(tmp_path, uri)
    capsys.readouterr()  # MLflow's own lines on creating the store
    for splits, why in ((SPLIT, "the sweep tested it already"), ("val", "validation split chose each trial's"),
                        ("train", "the training split is no test set"), (",", "name at least one test split")):
        assert main(["retest", "--sweep", "toy", "--splits", splits, "--tracking-uri", uri]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
    assert main(["retest", "--sweep", "nowhere", "--splits", NEW, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nowhere" in err[0]
    for ckpt in tmp_path.glob("*/checkpoints/epoch2.pt"):
        ckpt.unlink()  # another machine: the store came along, the weights did not
    assert main(["retest", "--sweep", "toy", "--splits", NEW, "--tracking-uri", uri]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "are not on this machine" in err[0]
    parent_id = results.find_sweep_run("toy", uri).run_id
    assert schema.TEST_SPLITS_ADDED not in tracking.get_run(parent_id, uri).tags
    clock = timing.PhaseClock()  # a sweep with no split added: nothing decoded at its end, no phase in its time split
    assert driver.retest_added(parent_id, uri, clock=clock) == {} and not clock.session()["phases"]


def test_a_new_split_is_decoded_as_the_trial_decoded_its_own_test_set(tmp_path: Path):
    """A tiny document model (frozen BERT with cached features, each sentence with its document's context): the test
    set copied under another name and decoded by ``retest`` gives the trial's own test output, line for line."""
    from nmtcore.engine import run_experiment
    from nmtcore.engine.trainer import tested_file
    from tests.test_doc_context import baseline_then_doc_model

    cfg = baseline_then_doc_model(tmp_path, epochs=2)
    summary = run_experiment(cfg)
    trial = Path(summary.test["test"].hyp_path).read_text(encoding="utf-8").splitlines()
    for lang in ("en", "de"):
        shutil.copy(tmp_path / "data" / f"test.{lang}", tmp_path / "data" / f"{NEW}.{lang}")
    checkpoint = tmp_path / "doc" / "checkpoints" / tested_file(summary.final_model)
    decoded = retest.decode_as_tested(checkpoint, NEW, threads=cfg.train.num_threads)
    assert decoded.hyps == trial and len(decoded.refs) == len(trial)
    with pytest.raises(Exception, match="nosuch"):
        retest.decode_as_tested(checkpoint, "nosuch")
