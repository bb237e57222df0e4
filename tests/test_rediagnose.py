"""Diagnostics measured again after a sweep (``nmtcore rediagnose``): the figures a trial's run lacks logged into it
beside its own, the ones it has kept, the report showing them; and a checkpoint measured as its trial measured it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from nmtcore import tracking
from nmtcore.sweep import lifecycle, report, results
from nmtcore.sweep.rediagnose import RediagnoseError, rediagnose_sweep
from nmtcore.tracking import schema
from tests.test_report import add_trial
from tests.test_retest import _weights

OLD = {"valid_bleu/mix": 39.0, "valid_bleu/nmt_only": 37.0}  # what the arm's trial measured when it ran


def _sweep(tmp_path: Path, uri: str) -> tracking.Tracker:
    """A control and a BERT-fused arm, complete, with their tested weights on disk, plus a failed retry."""
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": "test", "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.3, control=True, diagnostics={"valid_bleu/tested": 38.5})
    add_trial(parent, tmp_path, 1, 1, "fused", 0.8, {"arm": "fused"}, diagnostics=OLD)
    add_trial(parent, tmp_path, 2, 2, "fused", 0.8, {"arm": "fused"}, state="failed")
    for run in results.sweep_children(parent.run_id, uri):
        _weights(tmp_path, uri, run)
    return parent


def _measure(calls: list, uri: str):
    """Today's figures per checkpoint: the arm's with the two new switches (and a NaN, never logged)."""
    arms = {r.run_id: r.tags.get(lifecycle.ARM_TAG) for r in
            results.sweep_children(results.find_sweep_run("toy", uri).run_id, uri)}

    def measure(checkpoint: Path, threads: int) -> dict[str, float]:
        calls.append((checkpoint.parent.parent.name, threads))
        if arms[checkpoint.parent.parent.name] == "control":
            return {"valid_bleu/tested": 38.5}
        return {"valid_bleu/mix": 39.4, "valid_bleu/nmt_only": 37.1, "valid_bleu/enc_bert_off": 38.2,
                "valid_bleu/dec_bert_off": 37.6, "valid_nll/dec_bert_off": math.nan}
    return measure


def test_the_figures_a_run_lacks_are_logged_beside_its_own_and_the_report_shows_them(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = _sweep(tmp_path, uri)
    calls: list = []
    said: list[str] = []
    logged = rediagnose_sweep("toy", uri, measure=_measure(calls, uri), say=said.append)
    runs = {r.tags[lifecycle.ARM_TAG]: r for r in results.sweep_children(parent.run_id, uri)
            if results.trial_state(r) == "complete"}
    assert sorted(c[0] for c in calls) == sorted(r.run_id for r in runs.values())  # not the failed retry
    assert all(threads == 1 for _, threads in calls)  # each on the threads its trial decoded with
    fused, control = runs["fused"], runs["control"]
    assert logged == {fused.run_id: ["valid_bleu/dec_bert_off", "valid_bleu/enc_bert_off"], control.run_id: []}
    metrics = tracking.get_run_metrics(fused.run_id, uri)
    assert metrics["diag/valid_bleu/enc_bert_off"] == [(2, 38.2)]  # at the trial's final step, beside its own
    assert metrics["diag/valid_bleu/mix"] == [(2, 39.0)]  # what the trial measured stays
    assert "diag/valid_nll/dec_bert_off" not in metrics
    assert json.loads(tracking.read_artifact_text(fused.run_id, "diagnostics.json", uri)) == {
        **OLD, "valid_bleu/enc_bert_off": 38.2, "valid_bleu/dec_bert_off": 37.6}
    assert "epoch2.pt" in tracking.get_run(fused.run_id, uri).tags[schema.REDIAGNOSED]
    assert schema.REDIAGNOSED not in tracking.get_run(control.run_id, uri).tags
    assert any("control seed 1: every figure recorded already (1), kept; the 1 it had re-measured within 0" in line
               for line in said)
    assert any("fused seed 1: 2 figure(s) logged" in line and "the 2 it had re-measured within 0.4" in line
               for line in said)

    md = report.render_markdown(results.build_report("toy", uri, n_bootstrap=0))
    assert "| valid_bleu/enc_bert_off |  | 38.200 |" in md and "| valid_bleu/mix |  | 39.000 |" in md

    calls.clear()  # again: nothing new; with again, every figure replaced
    assert rediagnose_sweep("toy", uri, measure=_measure(calls, uri), say=said.append)[fused.run_id] == []
    rediagnose_sweep("toy", uri, measure=_measure(calls, uri), say=said.append, again=True)
    assert tracking.get_run(fused.run_id, uri).metrics["diag/valid_bleu/mix"] == 39.4

    # Another seed of the arm that has only the figures of its time: the new ones are the mean of the run that has them.
    add_trial(tracking.Tracker(uri, run_id=parent.run_id), tmp_path, 3, 3, "fused", 0.8, {"arm": "fused"},
              diagnostics=OLD)
    md = report.render_markdown(results.build_report("toy", uri, n_bootstrap=0))
    assert "| valid_bleu/enc_bert_off |  | 38.200 (1 of 2) |" in md and "| valid_bleu/mix |  | 39.200 |" in md


def test_a_sweep_without_a_complete_trial_or_its_weights_is_refused(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="empty", tags={
        lifecycle.SWEEP_TAG: "empty", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": "test", "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.3, control=True, state="failed")
    with pytest.raises(RediagnoseError, match="no complete trial"):
        rediagnose_sweep("empty", uri, measure=lambda c, t: {})
    add_trial(parent, tmp_path, 1, 1, "control", 0.3, control=True)  # complete, its weights not on this machine
    with pytest.raises(RediagnoseError, match="no complete trial's weights on this machine"):
        rediagnose_sweep("empty", uri, measure=lambda c, t: {})


def test_trials_whose_weights_are_elsewhere_are_named_and_skipped(tmp_path):
    """A sweep whose finished trials were copied from an imported store has their runs but not their weights: the
    trials trained here are measured, the others named and left as they are."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = _sweep(tmp_path, uri)
    add_trial(tracking.Tracker(uri, run_id=parent.run_id), tmp_path, 4, 4, "fused", 0.8, {"arm": "fused"},
              diagnostics=OLD)  # complete, its weights not here
    calls: list = []
    said: list[str] = []
    logged = rediagnose_sweep("toy", uri, measure=_measure(calls, uri), say=said.append)
    assert len(calls) == 2 and len(logged) == 2  # the control and the first arm, measured
    assert sum(line.startswith("rediagnose: skipped, run ") for line in said) == 1
    skipped = [r for r in results.sweep_children(parent.run_id, uri) if r.run_id not in logged
               and results.trial_state(r) == "complete"]
    assert len(skipped) == 1 and schema.REDIAGNOSED not in skipped[0].tags


def test_a_checkpoint_is_measured_as_its_trial_measured_it(tmp_path):
    """A tiny BERT-fused model trained two epochs: its tested weights measured from the checkpoint, in a trainer its
    own config builds, give the figures the trained trainer gives, switch by switch."""
    import torch

    from nmtcore.diagnostics import measure
    from nmtcore.engine import build_trainer
    from nmtcore.engine.trainer import tested_file
    from nmtcore.sweep.rediagnose import measure_tested
    from nmtcore.testing.synthetic import tiny_experiment
    from nmtcore.testing.tiny_bert import tiny_bert_dir

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": tiny_bert_dir(),
                                       "train.max_epochs": 2, "model.p_net": 1.0})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    trainer.fit()
    final = trainer.finalize_model()
    live = measure(trainer)
    checkpoint = Path(trainer.save_dir) / tested_file(final)
    again = measure_tested(checkpoint, threads=cfg.train.num_threads)
    assert {"valid_bleu/enc_bert_off", "valid_bleu/dec_bert_off"} <= set(again)
    assert again == pytest.approx(live, abs=1e-9)
