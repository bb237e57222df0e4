"""Sweep reports from MLflow alone: a hand-made sweep (parent + child runs as nmtcore.sweep leaves them) in a
temporary store gives the control-first table, Δ / interval / p-values, the L x H heatmap and the warnings."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest

from nmtcore import tracking
from nmtcore.sweep import lifecycle, report, results, timing
from nmtcore.tracking import schema

SPLIT, LANG = "test", "de"
REFS = [f"der hund {i} sieht die katze {i % 7}" for i in range(60)]


def hyps(quality: float, seed: int) -> list[str]:
    """Hypotheses that get a fraction ``quality`` of the references right."""
    rng = random.Random(seed)
    return [r if rng.random() < quality else "ein haus steht" for r in REFS]


def add_trial(parent, tmp, seed, index, label, quality, values=None, control=False, state="complete", curves=None,
              stopped_by="patience", diagnostics=None, nll=None, params=None, more_tags=None):
    """One child run as a sweep leaves it; ``quality`` a float (hypotheses of that quality) or a list of hypotheses;
    ``curves``: (validation losses, validation BLEUs) per epoch instead of the default three epochs; ``stopped_by``
    the rule that ended it (None: not recorded); ``diagnostics``: nmtcore.diagnostics figures; ``nll``: {epoch:
    (training NLL, validation NLL)}, logged as the trainer does (either may be None: not logged that epoch);
    ``params``: more config parameters to log; ``more_tags``: more tags, or other values of the ones set here."""
    key = label.replace(" ", "_")
    tags = {lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "trial", lifecycle.TRIAL_KEY_TAG: f"{key}-{seed}",
            "nmtcore.config_key": key, "nmtcore.seed": seed, "nmtcore.tune_trial_id": f"abc_{index:05d}",
            lifecycle.ARM_TAG: label, lifecycle.CONTROL_TAG: str(control).lower()}
    tags.update({f"varied.{k}": v for k, v in (values or {}).items()}, **(more_tags or {}))
    run = parent.child(run_name=f"{label} seed {seed}", tags=tags)
    run.log_params({"data.tgt_lang": LANG, "model.bert.name": "" if control else "minilm", **(params or {})})
    h = quality if isinstance(quality, list) else hyps(quality, seed)
    from nmtcore.bleu import corpus_bleu, corpus_chrf

    same_as = {"layers=4, hidden=128": 0.5}.get(label, quality if isinstance(quality, float) else 0.4)
    # By default two epochs of gains and a third without (patience 1 fired: converged).
    losses, bleus, *updates = curves or ([5.0 - epoch * same_as + seed for epoch in (1, 2, 2)], [1.0, 2.0, 1.95])
    if updates:  # the update count at each epoch's end, after a warm-up of WARMUP updates
        run.log_params({"train.warmup_updates": WARMUP})
    for epoch, (loss, valid_bleu) in enumerate(zip(losses, bleus), start=1):
        run.log_metrics({"valid_loss": loss, "valid_bleu": valid_bleu,
                         **({"num_updates": updates[0][epoch - 1]} if updates else {})}, step=epoch)
    for epoch, (train_nll, valid_nll) in (nll or {}).items():
        run.log_metrics({**({"train_nll": train_nll} if train_nll is not None else {}),
                         **({"valid_nll": valid_nll} if valid_nll is not None else {})}, step=epoch)
    if state != "complete":
        run.set_tags({lifecycle.TRIAL_STATE_TAG: state, **({tracking.FAILURE_REASON_TAG: "NonFiniteLossError: "
                                                            "non-finite training loss (nan) at update 7"}
                                                           if state == "failed" else {})})
        run.end("FAILED" if state == "failed" else "FINISHED")
        return
    b = corpus_bleu(h, REFS)
    run.log_metrics({f"test/{SPLIT}/bp": b.bp, f"test/{SPLIT}/len_ratio": b.sys_len / b.ref_len,
                     **{f"test/{SPLIT}/prec{n}": p for n, p in enumerate(b.precisions, 1)}}, step=2)
    run.log_metrics({f"test/{SPLIT}/bleu": b.score, f"test/{SPLIT}/chrf": corpus_chrf(h, REFS).score,
                     "cost/parameters": 2e6, "cost/wall_s": 120.0, "cost/cpu_s": 200.0,
                     "cost/train_tokens_per_s": 1000.0, "final/num_updates": 50.0}, step=2)
    hyp_file = tmp / f"{SPLIT}.{LANG}"
    hyp_file.write_text("\n".join(h) + "\n")
    run.log_artifact(hyp_file, "hypotheses")
    run.log_text("\n".join(REFS) + "\n", f"references/{SPLIT}.{LANG}")
    if diagnostics:
        run.log_metrics({f"diag/{k}": v for k, v in diagnostics.items()}, step=2)
    run.set_tags({lifecycle.TRIAL_STATE_TAG: "complete", **({"nmtcore.stopped_by": stopped_by} if stopped_by else {})})
    run.end("FINISHED")


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    """A control plus a 2 x 2 (layers x hidden) grid with 2 seeds, as a sweep leaves it: (4, 256) was stopped
    early by ASHA in seed 2, (4, 128) failed once, (2, 256) and (4, 128) trained identically in seed 1."""
    tmp = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    space = {"metric": "valid_bleu", "reference": None, "description": "toy size grid",
             "plot": {"kind": "heatmap", "rows": "model.bert.layers", "cols": "model.bert.hidden"}}
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.study": "bert_size_grid",
        "nmtcore.varied_keys": "model.bert.layers,model.bert.hidden", "nmtcore.test_splits": SPLIT,
        "nmtcore.space_json": json.dumps(space), "nmtcore.protocol": "arms warm-started; control arm: yes"})
    quality = {(2, 128): 0.3, (2, 256): 0.5, (4, 128): 0.7, (4, 256): 0.9}
    index = 0
    for seed in (1, 2):
        add_trial(parent, tmp, seed, index, "control", 0.3, control=True)
        index += 1
        for (layers, hidden), q in quality.items():
            state = ("stopped_early" if (layers, hidden, seed) == (4, 256, 2) else
                     "failed" if (layers, hidden, seed) == (4, 128, 2) else "complete")
            add_trial(parent, tmp, seed, index, f"layers={layers}, hidden={hidden}", q,
                      {"model.bert.layers": layers, "model.bert.hidden": hidden}, state=state)
            index += 1
    parent.end()
    return uri, parent.run_id


def test_control_first_then_deltas_intervals_p_values_and_statuses(sweep_store):
    uri, parent_id = sweep_store
    rep = results.build_report("toy", uri, n_bootstrap=300)
    assert rep.parent_run_id == parent_id and rep.study == "bert_size_grid"
    assert [g.label for g in rep.groups] == ["control", "layers=2, hidden=128", "layers=2, hidden=256",
                                             "layers=4, hidden=128", "layers=4, hidden=256"]
    control, same, _, failed, stopped = rep.groups
    assert rep.reference is control and control.control and len(control.bleu[SPLIT]) == 2
    assert failed.status == {"complete": 1, "failed": 1} and len(failed.bleu[SPLIT]) == 1
    assert stopped.status == {"complete": 1, "stopped_early": 1}
    c = stopped.comparisons[SPLIT]  # much better hypotheses than the control: a clear, significant gain
    c_stopped = c.delta
    assert c.delta > 10 and c.p < 0.05 and c.pooled_seeds == 1 and c.significant and c.ci_low > 0
    c = same.comparisons[SPLIT]  # the control's own hypothesis quality, the same seeds: no difference at all
    assert c.delta == 0 and c.p == 1.0 and (c.ci_low, c.ci_high) == (0.0, 0.0) and not c.significant
    assert c.p_seeds == 1.0  # two seeds: the test across seeds
    rows = report.table_rows(rep)
    assert rows[0]["arm"] == "control" and rows[0]["p"] == "ref" and " ± " in rows[0]["BLEU"]
    assert rows[4]["trials"] == "1 complete, 1 stopped_early"
    # Two control seeds, one of this arm's: Δ pairs one, and says so; an arm with the control's seeds does not.
    assert rows[4]["ΔBLEU"] == f"{c_stopped:+.2f} (1 paired seed)" and rows[1]["ΔBLEU"] == "+0.00"
    assert rows[3]["params (M)"] == "2.00" and rows[1]["BERT"] == "minilm" and rows[0]["BERT"] == "—"
    assert any("NonFiniteLossError" in w for w in rep.warnings)
    js = report.json_rows(rep)
    assert {"arm", "n_seeds", "bleu_mean", "bleu_sd", "delta", "ci_low", "ci_high", "p", "test_set"} <= set(js[0])
    assert js[0]["arm"] == "control" and js[0]["delta"] == 0.0 and js[0]["n_seeds"] == 2


def known_pair(tmp_path, name: str) -> tuple[str, list[str], list[str]]:
    """A sweep ``name`` of three arms, 1 seed: the control writes A, ``fixed`` writes B (A with exactly 15 of 60
    segments corrected), ``same`` writes A again. Returns the store, A and B."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name=name, tags={
        lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    a = ["ein haus steht"] * 45 + REFS[45:]
    b = list(REFS[:15]) + ["ein haus steht"] * 30 + REFS[45:]
    add_trial(parent, tmp_path, 1, 0, "control", a, control=True)
    add_trial(parent, tmp_path, 1, 1, "fixed", b, {"arm": "fixed"})
    add_trial(parent, tmp_path, 1, 2, "same", list(a), {"arm": "same"})
    parent.end()
    return uri, a, b


def test_p_value_and_interval_on_a_known_difference(tmp_path):
    """A constructed pair: B is A with exactly 15 of 60 segments corrected. The report's Δ is the corpus BLEU
    difference sacreBLEU gives directly; the interval contains it and excludes 0; p < 0.05. An identical B
    gives p = 1 and the interval [0, 0]."""
    from nmtcore.bleu import corpus_bleu

    uri, a, b = known_pair(tmp_path, "known")
    rep = results.build_report("known", uri, n_bootstrap=1000)
    fixed, same = rep.groups[1].comparisons[SPLIT], rep.groups[2].comparisons[SPLIT]
    want = corpus_bleu(b, REFS).score - corpus_bleu(a, REFS).score
    assert fixed.delta == pytest.approx(want) and want > 5
    assert fixed.ci_low < want < fixed.ci_high and fixed.ci_low > 0 and fixed.p < 0.05
    assert same.delta == 0 and same.p == 1.0 and (same.ci_low, same.ci_high) == (0.0, 0.0)


def test_a_report_against_another_arm_compares_every_configuration_with_it(tmp_path, capsys):
    """``--against fixed``: the reference row is that arm, the control is compared with it like any arm (Δ the
    negative of the report against the control), an unknown arm is a one-line error listing the arms, and the
    command line writes it beside the sweep's report without attaching it to the sweep's run."""
    from nmtcore.bleu import corpus_bleu
    from nmtcore.cli.main import main

    uri, a, b = known_pair(tmp_path, "vs")
    rep = results.build_report("vs", uri, n_bootstrap=500, against="fixed")
    control, fixed, same = rep.groups
    assert rep.reference is fixed and control.control and not fixed.comparisons
    want = corpus_bleu(a, REFS).score - corpus_bleu(b, REFS).score
    assert control.comparisons[SPLIT].delta == pytest.approx(want) and want < -5
    assert control.comparisons[SPLIT].ci_high < 0 and control.comparisons[SPLIT].p < 0.05
    assert same.comparisons[SPLIT].delta == pytest.approx(want)
    rows = report.json_rows(rep)
    assert [(r["arm"], r["control"], r["reference"]) for r in rows] == [
        ("control", True, False), ("fixed", False, True), ("same", False, False)]
    assert "Reference row: `fixed`" in report.render_markdown(rep)
    with pytest.raises(tracking.TrackingError, match=r"--against 'nope': no such arm in vs \(its arms: control, "
                                                     r"fixed, same\)"):
        results.build_report("vs", uri, n_bootstrap=0, against="nope")
    out = tmp_path / "reports"
    assert main(["report", "--sweep", "vs", "--tracking-uri", uri, "--bootstrap", "50", "--against", "fixed",
                 "--out", str(out)]) == 0
    assert json.loads((out / "table.json").read_text())[1]["reference"] is True
    assert "is not logged to MLflow" in capsys.readouterr().out
    parent_id = results.build_report("vs", uri, n_bootstrap=0).parent_run_id
    assert not [f for f in tracking.list_artifacts(parent_id, uri) if f.startswith("report/")]


def test_identical_training_is_flagged(sweep_store):
    uri, _ = sweep_store
    rep = results.build_report("toy", uri, n_bootstrap=0)
    assert any("layers=2, hidden=256 and layers=4, hidden=128 trained identically" in w for w in rep.warnings)


def test_report_files_heatmap_and_mlflow_artifacts(sweep_store, tmp_path):
    uri, parent_id = sweep_store
    files = report.make_report(parent_id, uri, tmp_path / "out", log=True, n_bootstrap=100)
    names = {f.name for f in files}
    assert {"table.md", "table.csv", "table.json", "report.json", "heatmap.png", "bleu_vs_cost.png"} <= names
    assert (tmp_path / "out" / "heatmap.png").stat().st_size > 5000
    md = (tmp_path / "out" / "table.md").read_text()
    assert md.startswith("### toy: toy size grid") and "| arm | layers | hidden | seeds | BLEU |" in md
    assert json.loads((tmp_path / "out" / "table.json").read_text())[0]["arm"] == "control"
    assert {"report/table.md", "report/heatmap.png"} <= set(tracking.list_artifacts(parent_id, uri))
    assert tracking.get_run(parent_id, uri).status == "FINISHED"  # logging a report does not reopen the run


def test_unknown_sweep_is_a_one_line_error(sweep_store):
    uri, _ = sweep_store
    with pytest.raises(tracking.TrackingError, match="no sweep named 'nope'"):
        results.build_report("nope", uri)


def test_report_command_line(sweep_store, tmp_path):
    import subprocess
    import sys

    uri, parent_id = sweep_store
    r = subprocess.run([sys.executable, "-m", "nmtcore.cli", "report", "--sweep", "toy", "--tracking-uri", uri,
                        "--out", str(tmp_path / "cli"), "--bootstrap", "50", "--no-log"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| arm | layers | hidden | seeds | BLEU |" in r.stdout and (tmp_path / "cli" / "heatmap.png").is_file()
    r = subprocess.run([sys.executable, "-m", "nmtcore.cli", "report", "--sweep", "nope", "--tracking-uri", uri],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == f"nmtcore: error: no sweep named 'nope' in {uri}"


def test_an_arm_whose_bleu_still_rises_is_not_called_converged(tmp_path):
    """Validation loss levelled off but validation BLEU still climbing (a warm-started fused model) is flagged,
    like a falling loss; flat curves are converged."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "model.p_net",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.5, control=True, curves=([4.00, 3.90, 3.90], [33.7, 34.9, 34.6]))
    add_trial(parent, tmp_path, 1, 1, "p_net=1", 0.5, {"model.p_net": 1.0},
              curves=([4.10, 4.00, 4.00], [30.7, 32.9, 33.4]))
    parent.end()
    rep = results.build_report("toy", uri, n_bootstrap=0)
    flagged = {g.label: g.still_improving for g in rep.groups}
    assert flagged == {"control": 0, "p_net=1": 1}, flagged
    assert [w for w in rep.warnings if "still rising" in w] == [
        "p_net=1: validation loss still falling or validation BLEU still rising at the last epoch in 1 run(s): "
        "it stopped before it converged"]
    assert results.bleu_still_rising([30.7, 32.9, 33.4]) and not results.bleu_still_rising([33.7, 34.9, 34.6])
    assert not results.bleu_still_rising([34.0, 34.05])  # within the tolerance: noise, not progress


def test_a_space_s_report_metrics_get_a_column_per_arm(tmp_path):
    """The θ study's table shows what each θ masked: the space's report metric, last epoch, mean over seeds."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    space = {"metric": "valid_bleu", "report_metrics": ["valid_masked_fraction"]}
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "model.mask_threshold",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps(space)})
    add_trial(parent, tmp_path, 1, 0, "control", 0.5, control=True)
    for index, (seed, theta, fractions) in enumerate([(1, 0.01, [0.3, 0.02]), (2, 0.01, [0.2, 0.04]),
                                                      (1, 0.05, [0.1, 0.24])], start=1):
        add_trial(parent, tmp_path, seed, index, f"mask_threshold={theta}", 0.5, {"model.mask_threshold": theta})
        run = next(r for r in lifecycle.sweep_children(parent.run_id, uri)
                   if r.tags.get(lifecycle.ARM_TAG) == f"mask_threshold={theta}" and r.tags.get("nmtcore.seed") == str(seed))
        for epoch, fraction in enumerate(fractions, start=1):
            tracking.Tracker(uri, run_id=run.run_id).log_metrics({"valid_masked_fraction": fraction}, step=epoch)
    parent.end()
    rep = results.build_report("toy", uri, n_bootstrap=0)
    rows = {r["arm"]: r for r in report.json_rows(rep)}
    assert rows["mask_threshold=0.01"]["valid_masked_fraction"] == pytest.approx(0.03)  # (0.02 + 0.04) / 2
    assert rows["mask_threshold=0.05"]["valid_masked_fraction"] == pytest.approx(0.24)
    assert rows["control"]["valid_masked_fraction"] is None
    table = report.render_markdown(rep)
    assert "valid_masked_fraction (last epoch)" in table and "| 0.0300 |" in table and "| 0.2400 |" in table


def test_a_phased_study_shows_where_each_arm_s_phases_began_and_why_it_stopped(tmp_path):
    """BERT-JAM's ablation: each run's phase starts and stop reason (its summary.json) in a column; the control,
    which has no phases, shows its stop reason; a sweep without phases has no such column."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.5, control=True)
    add_trial(parent, tmp_path, 1, 1, "M0_full", 0.5)
    add_trial(parent, tmp_path, 1, 2, "M3_no_warmup", 0.5)
    stories = {"control": ({}, "max_epochs", "average of epoch3.pt, epoch4.pt"),
               "M0_full": ({"finetune": 4, "warmup": 1, "glu": 3}, "early_stopping(patience=1)", "epoch4.pt (last)")}
    for run in lifecycle.sweep_children(parent.run_id, uri):
        arm = run.tags[lifecycle.ARM_TAG]
        tracker = tracking.Tracker(uri, run_id=run.run_id)
        if arm != "control":
            tracker.log_metrics({"phase": 1.0}, step=1)
        if arm in stories:  # M3's summary is missing
            starts, reason, tested = stories[arm]
            tracker.log_dict({"phase_starts": starts, "stop_reason": reason, "final_model": tested}, "summary.json")
    parent.end()
    rep = results.build_report("toy", uri, n_bootstrap=0)
    rows = {r["arm"]: r for r in report.table_rows(rep)}
    column = "phases (first epoch); stop"
    assert rows["M0_full"][column] == "warmup 1, glu 3, finetune 4; early_stopping(patience=1); tested epoch4.pt (last)"
    assert rows["control"][column] == "max_epochs; tested average of epoch3.pt, epoch4.pt"
    assert rows["M3_no_warmup"][column] == "summary.json not found"
    assert column in report.render_markdown(rep)
    # The control tested an average, M0 one epoch's weights: the report says the comparison is not like for like.
    assert [w for w in rep.warnings if "not like for like" in w] == [
        "M0_full tested one epoch's weights, the reference control an average of checkpoints: not like for like "
        "(train.average_last against the length of the arms' last phase); compare the same kind of weights before "
        "reading ΔBLEU"]


def test_a_sweep_without_phases_has_no_phase_column(sweep_store):
    uri, _ = sweep_store
    rep = results.build_report("toy", uri, n_bootstrap=0)
    assert all(not g.phases for g in rep.groups)
    assert "phases (first epoch)" not in report.render_markdown(rep)


FLAT = ([5.0, 4.0, 4.1], [10.0, 20.0, 19.0])  # validation loss and BLEU per epoch of a run that has levelled off
FALLING = ([5.0, 4.0, 3.9], [10.0, 20.0, 19.9])  # the loss still falls at the last epoch, BLEU within min_delta
WARMUP = 250
# A warm-started run recovering from the restarted warm-up (epochs 1-2 end inside it): the loss falls from epoch 3
# on but is still above epoch 1's, BLEU still under epoch 1's. Its last epoch is its lowest loss since the warm-up.
RECOVERING = ([4.26, 4.43, 4.40, 4.36], [35.0, 33.0, 33.5, 34.0], [100.0, 200.0, 300.0, 400.0])


def stage_sweep(tmp_path, name, arm_stopped_by, baseline_converged=None, diagnostics=None, arm_curves=FLAT):
    """A control and one BERT arm; the control stopped by patience, the arm by ``arm_stopped_by``, with
    ``arm_curves``."""
    uri = f"sqlite:///{tmp_path / (name + '.db')}"
    tags = {lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
            "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})}
    if baseline_converged is not None:
        tags["nmtcore.baseline_converged"] = baseline_converged  # as the driver writes it: str(bool), "True"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name=name, tags=tags)
    add_trial(parent, tmp_path, 1, 0, "control", 0.4, control=True, curves=FLAT)
    add_trial(parent, tmp_path, 1, 1, "bert_fused", 0.5, {"arm": "bert_fused"}, stopped_by=arm_stopped_by,
              diagnostics=diagnostics, curves=arm_curves)
    parent.end()
    return uri


@pytest.mark.parametrize("arm_stopped_by, baseline_converged, arm_curves, verdict", [
    ("patience", True, FLAT, None),
    ("patience", None, FLAT, None),  # a study from scratch has no baseline
    ("cap", True, FLAT, "1 of 2 runs stopped before convergence (1 by the epoch or update cap)"),
    ("schedule", True, FLAT, "1 of 2 runs stopped before convergence (1 by a fixed schedule)"),
    (None, True, FLAT, "1 of 2 runs stopped before convergence (1 with no stopping rule recorded)"),
    ("patience", False, FLAT, "the baseline they warm-started from was not trained to convergence"),
    # BLEU's patience rule fired on a run whose loss still fell: stopped by patience, not converged
    ("patience", True, FALLING, "1 of 2 runs stopped before convergence (1 by patience while validation loss still "
                                "fell or BLEU still rose)"),
    ("patience", True, RECOVERING, "1 of 2 runs stopped before convergence (1 by patience while validation loss "
                                   "still fell or BLEU still rose)"),
])
def test_the_not_an_answer_line_and_the_stop_column_appear_exactly_when_they_should(
        tmp_path, arm_stopped_by, baseline_converged, arm_curves, verdict):
    uri = stage_sweep(tmp_path, "stage", arm_stopped_by, baseline_converged, arm_curves=arm_curves)
    rep = results.build_report("stage", uri, n_bootstrap=0)
    md = report.render_markdown(rep)
    rows = {r["arm"]: r for r in report.table_rows(rep) if r["test set"] == SPLIT}
    assert rows["control"]["stopped by"] == "patience" and rows["control"]["converged"] == "yes"
    assert rows["bert_fused"]["stopped by"] == (arm_stopped_by or "unrecorded")
    converged = arm_stopped_by == "patience" and arm_curves is FLAT
    assert rows["bert_fused"]["converged"] == ("yes" if converged else "no")
    js = {r["arm"]: r for r in report.json_rows(rep)}
    assert js["bert_fused"]["stopped_by"] == {arm_stopped_by or "unrecorded": 1}
    if verdict is None:
        assert rep.not_an_answer() == "" and md.startswith("### ") and "Not an answer" not in md
    else:
        first = md.splitlines()[0]
        assert first.startswith("**Not an answer: ") and verdict in first and md.count("Not an answer") == 1
        advice = "train.loss_guard" if arm_curves is not FLAT and arm_stopped_by == "patience" else "budget cut short"
        assert advice in first, first


def test_the_report_says_how_each_arm_used_bert_and_draws_every_runs_validation_curve(tmp_path):
    figures = {"valid_bleu/mix": 30.5, "valid_bleu/nmt_only": 31.2, "valid_bleu/bert_only": 16.0}
    uri = stage_sweep(tmp_path, "diag", "patience", True, diagnostics=figures)
    rep = results.build_report("diag", uri, n_bootstrap=0)
    js = {r["arm"]: r for r in report.json_rows(rep)}
    # Beside the figures, the tested model (Eq. 1's mix) minus each other switch: what the part it turns off adds.
    gains = {"tested_minus/nmt_only": -0.7, "tested_minus/bert_only": 14.5}
    assert js["bert_fused"]["diagnostics"] == pytest.approx({**figures, **gains})
    assert js["control"]["diagnostics"] == {}
    md = report.render_markdown(rep)
    assert "**How each arm used BERT**" in md and "best validation BLEU over its epochs, for comparison: 20.00" in md
    assert "| valid_bleu/nmt_only | 31.200 |" in md and "| valid_bleu/bert_only | 16.000 |" in md
    assert "| tested_minus/nmt_only | -0.700 |" in md and "| tested_minus/bert_only | 14.500 |" in md
    # Within a run: a run as tested alone (another model's "tested"), and one without the tested figure, add none.
    assert results.switch_gains({"diag/valid_bleu/tested": 30.0, "diag/valid_bleu/bert_off": 29.25,
                                 "diag/valid_nll/bert_off": 2.0}) == {"tested_minus/bert_off": 0.75}
    assert results.switch_gains({"diag/valid_bleu/tested": 30.0}) == {}
    assert results.switch_gains({"diag/valid_bleu/bert_off": 29.0}) == {}
    files = report.write_report(rep, tmp_path / "out")
    curves = tmp_path / "out" / "valid_curves.png"
    assert curves in files and curves.stat().st_size > 5000
    assert [len(c["valid_bleu"]) for _, c in rep.groups[0].curves] == [3]


def test_the_validation_delta_of_the_tested_models_stands_beside_each_test_delta(tmp_path):
    """The tested models' greedy validation BLEU, arm minus reference, beside each test set's Δ and CI: a reader
    sees where validation and a test set part; nothing where the reference has no validation figure."""
    uri = f"sqlite:///{tmp_path / 'vt.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="vt", tags={
        lifecycle.SWEEP_TAG: "vt", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.4, control=True, curves=FLAT,
              diagnostics={"valid_bleu/tested": 30.0})
    add_trial(parent, tmp_path, 1, 1, "fused", 0.8, {"arm": "fused"}, curves=FLAT,
              diagnostics={"valid_bleu/tested": 28.75})
    add_trial(parent, tmp_path, 1, 2, "plain", 0.5, {"arm": "plain"}, curves=FLAT)  # no validation figure: no row
    # BERT-fused's switches mix its branches: what it is tested with is Eq. 1's mix.
    add_trial(parent, tmp_path, 1, 3, "mixed", 0.6, {"arm": "mixed"}, curves=FLAT,
              diagnostics={"valid_bleu/mix": 30.5, "valid_bleu/nmt_only": 29.0})
    # A second control seed that no arm ran: validation's Δ pairs seed 1 (the mean over both would be 30.5).
    add_trial(parent, tmp_path, 2, 4, "control", 0.4, control=True, curves=FLAT,
              diagnostics={"valid_bleu/tested": 31.0})
    parent.end()
    rep = results.build_report("vt", uri, n_bootstrap=200)
    c = next(g for g in rep.groups if g.label == "fused").comparisons[SPLIT]
    assert c.delta > 0  # better on the test set, worse on validation: the two parted
    lines = report.valid_beside_test(rep)
    assert lines[0].startswith("**Validation beside test** (Δ against the control")
    assert f"| fused | -1.25 (1 paired seed) | {c.delta:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}] |" in lines
    assert any(line.startswith("| mixed | +0.50 (1 paired seed) | ") for line in lines)
    assert not any(line.startswith("| plain") for line in lines)
    assert "**Validation beside test**" in report.render_markdown(rep)
    rep.groups[0].valid_tested.clear()
    assert report.valid_beside_test(rep) == []


def test_why_each_arm_stands_where_it_does_pairs_its_nmt_path_and_each_part_with_the_control(tmp_path):
    """Per arm, from its switches: the tested model against the control, the same weights with BERT off (its own
    NMT path) against the control, what BERT adds to that path and what each other switch's part adds; seeds pair
    with the control's, an arm without a BERT-off switch has no row."""
    uri = f"sqlite:///{tmp_path / 'why.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="why", tags={
        lifecycle.SWEEP_TAG: "why", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    for seed, control in ((1, 30.0), (2, 31.0)):
        add_trial(parent, tmp_path, seed, seed * 10, "control", 0.4, control=True, curves=FLAT,
                  diagnostics={"valid_bleu/tested": control})
    # mask fusion-like: its NMT path alone 1.0 / 1.5 below the control, BERT making it up and 0.25 / 0.75 more, the
    # mask 0.5 of it
    for seed, (tested, off, mask) in ((1, (30.25, 29.0, 29.75)), (2, (31.75, 29.5, 31.25))):
        add_trial(parent, tmp_path, seed, seed * 10 + 1, "fused", 0.5, {"arm": "fused"}, curves=FLAT,
                  diagnostics={"valid_bleu/tested": tested, "valid_bleu/bert_off": off, "valid_bleu/mask_off": mask})
    # BERT-fused-like, seed 1 only: tested with Eq. 1's mix, BERT off is its NMT branches alone
    add_trial(parent, tmp_path, 1, 12, "mixed", 0.6, {"arm": "mixed"}, curves=FLAT,
              diagnostics={"valid_bleu/mix": 30.5, "valid_bleu/nmt_only": 29.0, "valid_bleu/bert_only": 20.0})
    add_trial(parent, tmp_path, 1, 13, "plain", 0.5, {"arm": "plain"}, curves=FLAT,
              diagnostics={"valid_bleu/tested": 30.0})  # no switch turns BERT off: no row
    parent.end()
    rep = results.build_report("why", uri, n_bootstrap=0)
    lines = report.why_table(rep)
    assert lines[0].startswith("**Why each arm stands where it does**")
    assert lines[2] == ("| arm | Δ vs control | without BERT vs control | BERT adds | `bert_only` part adds | "
                        "`mask_off` part adds |")
    assert "| fused | +0.50 | -1.25 | +1.75 |  | +0.50 |" in lines
    assert "| mixed | +0.50 (1 paired seed) | -1.00 (1 paired seed) | +1.50 | +10.50 |  |" in lines
    assert not any(line.startswith("| plain") or line.startswith("| control") for line in lines)
    assert "**Why each arm stands where it does**" in report.render_markdown(rep)
    next(g for g in rep.groups if g.control).valid_tested.clear()
    assert report.why_table(rep) == []


def test_an_estimate_logged_before_training_stands_beside_what_each_arm_took(tmp_path):
    uri = f"sqlite:///{tmp_path / 'est.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="est", tags={
        lifecycle.SWEEP_TAG: "est", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    parent.log_dict({"machine": "2 cores", "seconds": 900.0, "runs": [
        {"config_key": "control", "seconds": 150.0}, {"config_key": "bert_fused", "seconds": 240.0},
        {"config_key": "bert_fused", "seconds": 300.0}],  # two seeds of one arm: their mean
        "phases": [{"name": "baseline", "seconds": 360.0, "detail": ""}, {"name": "trials", "seconds": 540.0,
                                                                          "detail": ""}]}, "estimate.json")
    add_trial(parent, tmp_path, 1, 0, "control", 0.4, control=True)
    add_trial(parent, tmp_path, 1, 1, "bert_fused", 0.5, {"arm": "bert_fused"})
    parent.end()
    rep = results.build_report("est", uri, n_bootstrap=0)
    rows = {r["arm"]: r for r in report.table_rows(rep)}
    assert rows["control"]["estimated (min)"] == "2.5" and rows["bert_fused"]["estimated (min)"] == "4.5"
    assert rows["control"]["wall (min)"] == "2.0"
    md = report.render_markdown(rep)
    assert "Cost estimated before training (2 cores): baseline 6.0 min; trials 9.0 min" in md

    without = stage_sweep(tmp_path, "plain", "patience")  # a sweep that logged no estimate: no column
    assert "estimated (min)" not in report.table_rows(results.build_report("plain", without, n_bootstrap=0))[0]


def test_the_report_prints_each_sessions_time_split_and_their_total(tmp_path):
    """A sweep spread over two sessions (``--resume``): the report lists both sessions' phases and the wall time
    over both; the phases' seconds come from the clock that timed them."""
    import time

    uri = stage_sweep(tmp_path, "split", "patience")
    parent = tracking.Tracker(uri, run_id=results.build_report("split", uri, n_bootstrap=0).parent_run_id)
    first = timing.PhaseClock(started="2026-12-04T08:49:11+00:00")
    first.seconds = {"data": 3.2, "baseline": 1182.0, "trials": 1800.0}
    sessions = timing.record(parent, first, [])
    second = timing.PhaseClock(started="2026-12-05T09:00:00+00:00")
    with second.phase("trials"):
        time.sleep(0.05)
    with second.phase("trials"):  # a phase timed twice adds up
        time.sleep(0.05)
    assert 0.1 <= second.seconds["trials"] < 1.0
    timing.record(parent, second, sessions)
    rep = results.build_report("split", uri, n_bootstrap=0)
    assert [s["started"] for s in rep.time_split] == [first.started, second.started]
    md = report.render_markdown(rep)
    assert "- session 1 (started 2026-12-04T08:49:11+00:00): data 3 s; baseline 19.7 min; trials 30.0 min; wall" in md
    assert "- session 2 (started 2026-12-05T09:00:00+00:00): trials 0 s; wall" in md
    assert "- all 2 sessions: wall" in md
    report.write_report(rep, tmp_path / "out")
    assert len(json.loads((tmp_path / "out" / "report.json").read_text())["time_split"]) == 2
    # A sweep that recorded no split (older code): no such lines.
    assert "Time split" not in report.render_markdown(results.build_report("plain", stage_sweep(
        tmp_path, "plain", "patience"), n_bootstrap=0))


def test_a_session_killed_outright_keeps_its_time_up_to_its_last_record(tmp_path):
    """While its trials run a session rewrites its entry (``final=False``), a phase under way counted so far; a
    session killed before its last record keeps that entry, marked, and the next session adds its own after it."""
    import time

    uri = stage_sweep(tmp_path, "killed", "patience")
    parent = tracking.Tracker(uri, run_id=results.build_report("killed", uri, n_bootstrap=0).parent_run_id)
    killed = timing.PhaseClock(started="2026-12-07T04:01:00+00:00")
    killed.seconds = {"data": 4.0}
    with killed.phase("trials"):
        time.sleep(0.05)
        timing.record(parent, killed, [], final=False)  # a heartbeat mid-phase
        time.sleep(0.05)
        sessions = timing.record(parent, killed, [], final=False)  # the last one before the kill
    assert 0.1 <= sessions[-1]["phases"]["trials"] < 1.0 and sessions[-1]["phases"]["data"] == 4.0
    assert not killed.running and "recorded" in sessions[-1]
    earlier = timing.read(parent.run_id, uri)  # what the resume reads
    assert earlier == sessions
    resumed = timing.PhaseClock(started="2026-12-07T05:13:00+00:00")
    timing.record(parent, resumed, earlier)
    split = results.build_report("killed", uri, n_bootstrap=0).time_split
    assert [s["started"] for s in split] == [killed.started, resumed.started] and "recorded" not in split[1]
    lines = timing.describe(split)
    assert lines[0].startswith("session 1 (started 2026-12-07T04:01:00+00:00): data 4 s; trials 0 s; wall")
    assert f"ended without its last record: its time up to {split[0]['recorded']}" in lines[0]
    assert "ended without" not in lines[1]


def test_an_arm_that_writes_shorter_output_shows_its_length_and_brevity_penalty(tmp_path):
    """Output cut short at full precision loses BLEU to the brevity penalty: the table says so per arm."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        lifecycle.SWEEP_TAG: "toy", lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", list(REFS), control=True)
    add_trial(parent, tmp_path, 1, 1, "short", [" ".join(r.split()[:-2]) for r in REFS], {"arm": "short"})
    parent.end()
    rep = results.build_report("toy", uri, n_bootstrap=0)
    rows = {r["arm"]: r for r in report.table_rows(rep)}
    assert (rows["control"]["length"], rows["control"]["BP"]) == ("1.000", "1.000")
    js = {r["arm"]: r for r in report.json_rows(rep)}
    assert js["short"]["len_ratio_mean"] == pytest.approx(5 / 7) and js["short"]["bp_mean"] < 0.7
    assert rows["short"]["length"] == "0.714"
    assert float(rows["short"]["BP"]) == pytest.approx(js["short"]["bp_mean"], abs=1e-3)
    assert "`BP` BLEU's brevity penalty" in report.render_markdown(rep)
    # ... at the control's n-gram precisions: the table shows that BLEU was lost on length, not on word choice.
    precision = "1-4-gram precision (%)"
    assert rows["short"][precision] == rows["control"][precision] == "100.0/100.0/100.0/100.0"
    assert js["short"]["precisions_mean"] == pytest.approx([100.0] * 4)
    # ... and the Δ split puts all of it on the length, nothing on the precisions.
    delta = js["short"]["bleu_mean"] - js["control"]["bleu_mean"]
    assert delta < -20 and js["short"]["delta_length"] == pytest.approx(delta) and js["short"]["delta_precision"] == 0
    assert rows["short"]["Δ: length / precision"] == f"{delta:+.2f} / +0.00" and rows["control"]["Δ: length / precision"] == "—"
    assert js["control"]["delta_length"] is None


def test_the_delta_split_sums_to_the_difference_of_the_means():
    """BLEU = BP · G: a longer output at lower precision shows both parts; together they are the whole Δ."""
    ref_bleu, ref_bp, bleu, bp = 36.56, 0.965, 37.58, 0.995  # the MiniLM-L4 study's test_2016 rows
    length, precision = report.length_and_precision(ref_bleu, ref_bp, bleu, bp)
    assert length == pytest.approx((0.995 - 0.965) * 36.56 / 0.965) and length == pytest.approx(1.137, abs=1e-3)
    assert precision == pytest.approx(0.995 * (37.58 / 0.995 - 36.56 / 0.965)) and precision < 0
    assert length + precision == pytest.approx(bleu - ref_bleu)
    assert report.length_and_precision(30.0, 1.0, 33.0, 1.0) == pytest.approx((0.0, 3.0))  # same length: precision
    assert report.length_and_precision(30.0, math.nan, 33.0, 1.0) == (None, None)
    assert report.length_and_precision(30.0, 0.0, 33.0, 1.0) == (None, None)


def _sweep(uri, name, varied="arm", study="bert_benefit", baseline_run="",
           protocol="arms warm-started; control arm: yes"):
    return tracking.Tracker(uri, experiment="sweeps", run_name=name, tags={
        lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "sweep", "nmtcore.study": study, "nmtcore.varied_keys": varied,
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"}),
        "nmtcore.protocol": protocol,
        **({schema.BASELINE_RUN_ID: baseline_run} if baseline_run else {})})


def test_a_report_pools_the_seeds_of_several_sweeps_of_one_study(tmp_path, capsys):
    """The same study run twice with other seeds: ``nmtcore report --sweep A --sweep B`` gives one row per
    configuration over both sweeps' seeds (the bootstrap pooled over them, the t-test across them), counts a
    (config, seed) found in both once, and refuses sweeps of different studies."""
    from nmtcore.cli.main import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = _sweep(uri, "runA", baseline_run="b1")
    add_trial(first, tmp_path, 1, 0, "control", 0.3, control=True)
    add_trial(first, tmp_path, 1, 1, "fused", 0.8, {"arm": "fused"})
    first.end()
    second = _sweep(uri, "runB", baseline_run="b1")
    add_trial(second, tmp_path, 2, 0, "control", 0.35, control=True)
    add_trial(second, tmp_path, 2, 1, "fused", 0.7, {"arm": "fused"})
    add_trial(second, tmp_path, 1, 2, "control", 0.9, control=True)  # seed 1 again: runA's is used
    add_trial(second, tmp_path, 2, 3, "fused", 0.2, {"arm": "fused"}, state="failed")  # a retry within runB stays
    second.end()
    other = _sweep(uri, "grid", varied="model.bert.layers", study="bert_size_grid")
    other.end()

    alone = results.build_report("runA", uri, n_bootstrap=200)
    rep = results.build_report(["runA", "runB"], uri, n_bootstrap=200)
    assert rep.sweep == "runA + runB" and rep.pooled == ["runA", "runB"] and not rep.time_split
    control, fused = rep.groups
    assert set(control.bleu[SPLIT]) == set(fused.bleu[SPLIT]) == {"1", "2"}
    assert fused.status == {"complete": 2, "failed": 1} and control.status == {"complete": 2}
    assert control.bleu[SPLIT]["1"] == alone.groups[0].bleu[SPLIT]["1"]  # the first sweep's seed 1, not runB's
    c = fused.comparisons[SPLIT]
    assert c.pooled_seeds == 2 and c.p_seeds is not None and c.delta > 10 and c.p < 0.05
    assert alone.groups[1].comparisons[SPLIT].pooled_seeds == 1 and alone.groups[1].comparisons[SPLIT].p_seeds is None
    twice = next(w for w in rep.warnings if "control seed 1 (seed 1) is in runA and in runB: runA's run is used" in w)
    again = next(r for r in lifecycle.sweep_children(second.run_id, uri) if r.tags.get(results.SEED_TAG) == "1")
    # both runs tested: the reader sees how far two runs of one config and seed part
    assert (f"; both tested, {SPLIT} {control.bleu[SPLIT]['1']:.2f} in runA and "
            f"{again.metrics[f'test/{SPLIT}/bleu']:.2f} in runB") in twice, twice
    assert control.bleu[SPLIT]["1"] != again.metrics[f"test/{SPLIT}/bleu"]
    copied = _sweep(uri, "runF", baseline_run="b1")  # runA's seed-1 control copied: the same scores
    add_trial(copied, tmp_path, 1, 0, "control", 0.3, control=True)
    copied.end()
    same = results.build_report(["runA", "runF"], uri, n_bootstrap=0)
    assert any(w.endswith("runA's run is used; both test alike: one training, copied into the other sweep")
               for w in same.warnings), same.warnings
    assert "Pooled over the sweeps `runA`, `runB`" in report.render_markdown(rep)
    assert not any("different trainings of the shared baseline" in w for w in rep.warnings)  # one machine's
    # A sweep run on another machine trained the shared baseline again: the pooled report says so.
    moved = _sweep(uri, "runC", baseline_run="b2")
    add_trial(moved, tmp_path, 3, 0, "control", 0.3, control=True)
    add_trial(moved, tmp_path, 3, 1, "fused", 0.8, {"arm": "fused"})
    moved.end()
    across = results.build_report(["runA", "runC"], uri, n_bootstrap=0)
    assert any("different trainings of the shared baseline (runA: run b1, runC: run b2)" in w for w in across.warnings)
    # The first machine's trial cut short, the same trial finished in a later sweep: the finished one counts.
    cut = _sweep(uri, "runD", baseline_run="b2")
    add_trial(cut, tmp_path, 4, 0, "control", 0.3, control=True)
    add_trial(cut, tmp_path, 4, 1, "fused", 0.8, {"arm": "fused"}, state="killed")
    cut.end()
    done = _sweep(uri, "runE", baseline_run="b2")
    add_trial(done, tmp_path, 4, 1, "fused", 0.8, {"arm": "fused"})
    done.end()
    later = results.build_report(["runD", "runE"], uri, n_bootstrap=0)
    assert later.groups[1].status == {"complete": 1}, later.groups[1].status
    assert any(w.endswith("fused seed 4 (seed 4) is in runD and in runE: runE's run is used (it finished there, "
                          "not in runD)") for w in later.warnings), later.warnings  # runD's never tested
    assert results.build_report(["runD"], uri, n_bootstrap=0).groups[1].status == {"killed": 1}
    with pytest.raises(tracking.TrackingError, match="cannot pool sweeps 'runA' and 'grid': their study differ"):
        results.build_report(["runA", "grid"], uri, n_bootstrap=0)

    out = tmp_path / "pooled"
    assert main(["report", "--sweep", "runA", "--sweep", "runB", "--tracking-uri", uri, "--out", str(out),
                 "--bootstrap", "100"]) == 0
    printed = capsys.readouterr().out
    assert "a pooled report is not logged to MLflow" in printed
    assert json.loads((out / "report.json").read_text())["pooled"] == ["runA", "runB"]
    assert [r["n_seeds"] for r in json.loads((out / "table.json").read_text())] == [2, 2]
    assert not [a for a in tracking.list_artifacts(first.run_id, uri) if a.startswith("report")]


def _bert_run(sweep: str, config: str, by_size: bool, cache: str = "/c", resolved: str = "minilm:L4",
              layers: int = 4, **params) -> dict:
    """add_trial's arguments for a BERT-fused run that names its BERT by name or by size (what a registry resolved
    it to in its tags, its files under its machine's BERT cache)."""
    naming = ({"model.bert.name": "", "model.bert.layers": str(layers), "model.bert.hidden": "384"} if by_size else
              {"model.bert.name": resolved, "model.bert.layers": "0", "model.bert.hidden": "0"})
    return {"params": {**naming, "model.bert.cache_dir": cache, "model.dropout": "0.3", **params},
            "more_tags": {lifecycle.SWEEP_TAG: sweep, "nmtcore.config_key": config, schema.BERT_RESOLVED: resolved,
                          schema.BERT_LAYERS: str(layers), schema.BERT_HIDDEN: "384", schema.BERT_TYPE: "bert",
                          schema.BERT_PATH: f"{cache}/bert/truncated/{resolved.replace(':', '/')}/53aa51"}}


def test_one_configuration_two_studies_name_differently_pools_into_one_row(tmp_path, capsys):
    """A size grid's cell and BERT-fused's arm on the BERT that size resolves to are one configuration:
    ``--same-arm L4-H384 bert_fused`` pools them (and the studies' controls) into one row each, over both studies'
    seeds; it refuses a pair that differs in a setting that decides a result, another BERT, or an arm it cannot
    find, and without it sweeps of two studies do not pool."""
    from nmtcore.cli.main import main

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    control = {"params": {"model.dropout": "0.3"}, "control": True}
    grid = _sweep(uri, "grid", varied="model.bert.layers,model.bert.hidden", study="bert_size_grid", baseline_run="b")
    add_trial(grid, tmp_path, 1, 0, "control", 0.3, **control)
    add_trial(grid, tmp_path, 1, 1, "L4-H384", 0.8, {"model.bert.layers": 4, "model.bert.hidden": 384},
              **_bert_run("grid", "L4-H384", by_size=True))
    add_trial(grid, tmp_path, 1, 2, "L2-H384", 0.5, {"model.bert.layers": 2, "model.bert.hidden": 384},
              **_bert_run("grid", "L2-H384", by_size=True, resolved="minilm:L2", layers=2))
    grid.end()
    benefit = _sweep(uri, "benefit", study="bert_benefit", baseline_run="b2")
    add_trial(benefit, tmp_path, 2, 0, "control", 0.35, **control)
    # the same BERT files, under another machine's cache
    add_trial(benefit, tmp_path, 2, 1, "bert_fused", 0.75, {"arm": "bert_fused"},
              **_bert_run("benefit", "fused-key", by_size=False, cache="/d"))
    add_trial(benefit, tmp_path, 1, 2, "bert_fused", 0.1, {"arm": "bert_fused"},  # seed 1 again: the grid's counts
              **_bert_run("benefit", "fused-key", by_size=False, cache="/d"))
    benefit.end()

    with pytest.raises(tracking.TrackingError, match="their study differ .* say which with --same-arm A B"):
        results.build_report(["grid", "benefit"], uri, n_bootstrap=0)
    alone = results.build_report("grid", uri, n_bootstrap=0)
    rep = results.build_report(["grid", "benefit"], uri, n_bootstrap=200, same_arms=[("L4-H384", "bert_fused")])
    assert [g.label for g in rep.groups] == ["control", "L4-H384", "L2-H384"], [g.label for g in rep.groups]
    ctrl, fused, small = rep.groups
    assert set(ctrl.bleu[SPLIT]) == set(fused.bleu[SPLIT]) == {"1", "2"} and set(small.bleu[SPLIT]) == {"1"}
    assert fused.bleu[SPLIT]["1"] == alone.groups[1].bleu[SPLIT]["1"]  # the grid's seed 1, not the duplicate's
    assert fused.comparisons[SPLIT].pooled_seeds == 2 and fused.comparisons[SPLIT].p_seeds is not None
    assert fused.comparisons[SPLIT].delta > 10 and small.comparisons[SPLIT].pooled_seeds == 1
    assert rep.joined == ["`bert_fused` (config fused-key, benefit) joins `L4-H384` (config L4-H384, grid)"]
    assert any(w.startswith("bert_fused seed 1 (benefit) is also L4-H384's seed 1: L4-H384's run is used")
               for w in rep.warnings), rep.warnings
    assert rep.study == "bert_size_grid + bert_benefit"
    assert "Rows joined across studies (`--same-arm`)" in report.render_markdown(rep)

    def refused(name: str, *runs: tuple, same=(("L4-H384", "bert_fused"),)) -> str:
        other = _sweep(uri, name, study="bert_benefit", baseline_run="b3")
        for seed, label, kwargs in runs:
            add_trial(other, tmp_path, seed, 0 if label == "control" else 1, label, 0.6,
                      None if label == "control" else {"arm": label}, **kwargs)
        other.end()
        with pytest.raises(tracking.TrackingError) as e:
            results.build_report(["grid", name], uri, n_bootstrap=0, same_arms=same)
        return str(e.value)

    dropout = {"model.dropout": "0.1"}
    why = refused("other-dropout", (3, "bert_fused", _bert_run("other-dropout", "k1", False, **dropout)))
    assert why == ("--same-arm L4-H384 bert_fused: `L4-H384` (config L4-H384, grid) and `bert_fused` (config k1, "
                   "other-dropout) are not one configuration: model.dropout '0.3' against '0.1'"), why
    why = refused("other-bert", (3, "bert_fused", _bert_run("other-bert", "k2", False, resolved="mpnet:L4")))
    assert "not one configuration: nmtcore.bert_resolved 'minilm:L4' against 'mpnet:L4', BERT files" in why, why
    why = refused("no-arm", (3, "bert_fused", _bert_run("no-arm", "k3", False)), same=(("L4-H384", "fused"),))
    assert why.startswith("--same-arm L4-H384 fused: no arm named 'fused' in these sweeps (their rows: control, "), why
    why = refused("other-control", (3, "control", {"params": {"model.dropout": "0.1"}, "control": True,
                                                     "more_tags": {"nmtcore.config_key": "control-0.1"}}),
                  (3, "bert_fused", _bert_run("other-control", "k4", False)))
    assert why.startswith("the controls: `control` (config control, "), why
    assert why.endswith("are not one configuration: model.dropout '0.3' against '0.1'"), why

    out = tmp_path / "joined"
    assert main(["report", "--sweep", "grid", "--sweep", "benefit", "--same-arm", "L4-H384", "bert_fused",
                 "--tracking-uri", uri, "--out", str(out), "--bootstrap", "100"]) == 0
    capsys.readouterr()
    written = json.loads((out / "report.json").read_text())
    assert written["joined"] == rep.joined and written["pooled"] == ["grid", "benefit"]
    assert [r["n_seeds"] for r in json.loads((out / "table.json").read_text())] == [2, 2, 1]


def test_a_sweep_exported_and_imported_into_another_store_gives_the_same_report(sweep_store, tmp_path, capsys):
    """``nmtcore export`` then ``nmtcore import`` into a fresh store (a wiped machine's successor): the report
    rebuilt there has the same rows, curves and comparisons; a second import into the same store is refused."""
    from nmtcore.cli.main import main
    from nmtcore.sweep import archive

    uri, parent_id = sweep_store
    path = tmp_path / "toy.json.gz"
    assert main(["export", "--sweep", "toy", "--out", str(path), "--tracking-uri", uri]) == 0
    assert "10 trial runs" in capsys.readouterr().out  # the control and 4 cells, 2 seeds (one failed, one stopped)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert main(["import", str(path), "--tracking-uri", other]) == 0
    assert "imported sweep 'toy' (10 trial runs)" in capsys.readouterr().out
    before, after = (results.build_report("toy", u, n_bootstrap=200) for u in (uri, other))
    assert after.parent_run_id != parent_id
    assert report.json_rows(after) == report.json_rows(before)
    assert [g.curves for g in after.groups] == [g.curves for g in before.groups]
    assert [(g.label, g.status, g.stopped_by) for g in after.groups] == [(g.label, g.status, g.stopped_by)
                                                                          for g in before.groups]
    assert sorted(after.warnings) == sorted(before.warnings)
    child = results.sweep_children(after.parent_run_id, other)[0]
    assert child.tags[archive.IMPORTED_FROM_TAG] in {r.run_id for r in results.sweep_children(parent_id, uri)}
    with pytest.raises(tracking.TrackingError, match="a sweep named 'toy' is already in"):
        archive.import_sweep(path, other)
    (tmp_path / "bad.json.gz").write_bytes(b"not gzip")
    with pytest.raises(tracking.TrackingError, match="not a sweep archive"):
        archive.read_archive(tmp_path / "bad.json.gz")


def test_a_sweep_stopped_part_way_says_where_each_unfinished_trial_stands(tmp_path):
    """A sweep spread over sessions, reported between them: a trial stopped with the sweep (killed) or still
    running has no test score, so its row is empty; the report says how many epochs it has trained and its best
    greedy validation BLEU so far (an epoch logged twice, before and after a resume, counted once), beside the
    control's best. A sweep whose trials all finished says nothing of the kind."""
    name = "parted"
    uri = f"sqlite:///{tmp_path / 'parted.db'}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name=name, tags={
        lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.4, control=True, curves=([4.0, 3.0, 3.1], [30.0, 35.5, 35.2]))
    for index, (label, state, bleus) in enumerate([("full", "killed", [(1, 20.0), (2, 33.0), (3, 36.1), (4, 35.9),
                                                                        (4, 35.0), (5, 35.8)]),  # epoch 4 twice
                                                   ("no_mlm", "running", [(1, 25.0)])], start=1):
        run = parent.child(run_name=f"{label} seed 1", tags={
            lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "trial", lifecycle.TRIAL_KEY_TAG: f"{label}-1",
            "nmtcore.config_key": label, "nmtcore.seed": 1, "nmtcore.tune_trial_id": f"abc_{index:05d}",
            lifecycle.ARM_TAG: label, lifecycle.CONTROL_TAG: "false", "varied.arm": label,
            lifecycle.TRIAL_STATE_TAG: state})
        for epoch, bleu in bleus:
            run.log_metrics({"valid_bleu": bleu, "valid_loss": 5.0 - bleu / 10, "epoch": epoch}, step=epoch)
        if state == "killed":
            run.end("KILLED")
    rep = results.build_report(name, uri, n_bootstrap=100)
    full, no_mlm = rep.groups[1:]
    assert full.unfinished == [results.Progress("1", "killed", 5, 36.1, 3)]
    # one read of the run's curves serves the report's curves and this section: an epoch once, its last value
    assert results._valid_curves(full.runs[0], uri)["valid_bleu"] == {1: 20.0, 2: 33.0, 3: 36.1, 4: 35.0, 5: 35.8}
    assert no_mlm.unfinished == [results.Progress("1", "running", 1, 25.0, 1)]
    assert rep.groups[0].unfinished == []
    text = report.render_markdown(rep)
    assert "**Not finished yet**" in text and "the control's best over its finished runs: 35.50" in text
    assert ("- full: seed 1 killed: 5 epochs, best greedy validation BLEU 36.10 at epoch 3 (2 since)" in text)
    assert "- no_mlm: seed 1 running: 1 epoch, best greedy validation BLEU 25.00 at epoch 1 (0 since)" in text
    js = report._to_json(rep)
    assert js["unfinished"]["full"][0] == {"seed": "1", "state": "killed", "epochs": 5, "best_bleu": 36.1,
                                           "best_epoch": 3}
    finished = stage_sweep(tmp_path, "done", "patience")
    assert "Not finished yet" not in report.render_markdown(results.build_report("done", finished, n_bootstrap=100))


def nll_sweep(tmp_path, name: str, arm: str, arm_nll: dict, params=(None, None)) -> tuple[str, tracking.Tracker]:
    """A control and one arm, both with training and validation NLLs per epoch (the control's fixed, the arm's
    ``arm_nll``), with ``params`` (the control's, the arm's) logged besides; returns the store and the parent run,
    still open."""
    uri = f"sqlite:///{tmp_path / (name + '.db')}"
    parent = tracking.Tracker(uri, experiment="sweeps", run_name=name, tags={
        lifecycle.SWEEP_TAG: name, lifecycle.ROLE_TAG: "sweep", "nmtcore.varied_keys": "arm",
        "nmtcore.test_splits": SPLIT, "nmtcore.space_json": json.dumps({"metric": "valid_bleu"})})
    add_trial(parent, tmp_path, 1, 0, "control", 0.4, control=True, curves=FLAT,
              nll={1: (3.0, 2.9), 2: (2.0, 2.7), 3: (1.8, 2.75)}, params=params[0])
    add_trial(parent, tmp_path, 1, 1, arm, 0.5, {"arm": arm}, curves=FLAT, nll=arm_nll, params=params[1])
    return uri, parent


def test_the_report_says_how_each_arm_fit_its_training_data_against_validation(tmp_path):
    """An arm that learns the training set better (lower training NLL) and validates worse than the control
    overfits: the fit table shows both NLLs at each run's lowest validation NLL and at its last epoch, and the
    arm's difference from the control, so a reader tells that from an arm that learnt less."""
    # The arm's lowest validation NLL is at epoch 2 (its epoch 3 logged no validation NLL: left out, not
    # misaligned).
    uri, parent = nll_sweep(tmp_path, "fit", "bert_jam", {1: (2.8, 2.95), 2: (1.5, 2.8), 3: (1.2, None)})
    parent.end()
    rep = results.build_report("fit", uri, n_bootstrap=0)
    fits = {g.label: g.fit for g in rep.groups}
    assert [dataclasses.replace(f, path=()) for f in fits["control"]] == [results.Fit(2, 2.0, 2.7, 3, 1.8, 2.75)]
    assert [dataclasses.replace(f, path=()) for f in fits["bert_jam"]] == [results.Fit(2, 1.5, 2.8, 2, 1.5, 2.8)]
    assert fits["bert_jam"][0].path == ((1, 2.8, 2.95, 10.0, 0), (2, 1.5, 2.8, 20.0, 0))  # epoch 3: no valid NLL
    md = report.render_markdown(rep)
    assert "**How each arm fit the training data**" in md
    # At equal fit: the arm's training NLL came down to the control's 2.0 between its epochs 1 (2.8) and 2 (1.5),
    # 0.8 / 1.3 of the way, where its validation NLL was 2.95 - 0.615 * 0.15 = 2.858: 0.158 above the control's.
    assert "| control | 3.0 | 2.0 | 2.000 | 2.700 | 0.700 | — | — | 1.800 | 2.750 | — | — |" in md
    assert ("| bert_jam | 2.0 | 2.0 | 1.500 | 2.800 | 1.300 | -0.500 | +0.100 | 1.500 | 2.800 | 2.858 (epoch 1.6) "
            "| +0.158 |") in md
    assert json.loads(json.dumps(report._to_json(rep)))["fit"]["bert_jam"][0]["train_at_best"] == 1.5
    assert "Phase by phase" not in md  # no run trained in phases
    assert "†" not in md  # trained under the same dropout (none logged here: nothing to tell apart)


def test_equal_fit_is_flagged_where_an_arm_trained_under_other_dropout(tmp_path):
    """The training NLL is measured in train mode: an arm trained under other dropout than the control (the frozen
    BERT's dropout on, say) is not at equal fit where the two training NLLs meet, and the table says so beside the
    Δ and names the setting. A dropout only the arm's model has (mask fusion's fusion attention) is part of the
    model, not a setting: not flagged; the same value logged in another form (0.3, 0.30) is the same."""
    nll = {1: (2.8, 2.95), 2: (1.5, 2.8)}
    control = {"model.dropout": "0.3", "model.bert.dropout_when_frozen": "False"}
    same = {"model.dropout": "0.30", "model.bert.dropout_when_frozen": "False", "model.fusion_attention_dropout": "0.2"}
    uri, parent = nll_sweep(tmp_path, "alike", "mask_fusion", nll, params=(control, same))
    parent.end()
    assert "†" not in report.render_markdown(results.build_report("alike", uri, n_bootstrap=0))
    other = {**same, "model.bert.dropout_when_frozen": "True"}
    uri, parent = nll_sweep(tmp_path, "other", "bert_dropout", nll, params=(control, other))
    parent.end()
    md = report.render_markdown(results.build_report("other", uri, n_bootstrap=0))
    assert "| 2.858 (epoch 1.6) | +0.158 † |" in md
    assert ("† Trained under other dropout than the control (bert_dropout: model.bert.dropout_when_frozen True "
            "against False)") in md


def test_fit_at_equal_training_nll_and_phase_by_phase():
    """An arm's validation NLL where its training NLL first reached a level (interpolated), None where it never
    did; each phase's last epoch; and the phase table beside the reference's figures at the same epochs."""
    curves = {"train_nll": {1: 3.0, 2: 2.0, 3: 2.4, 4: 1.6}, "valid_nll": {1: 3.1, 2: 2.9, 3: 2.8, 4: 2.7},
              "valid_bleu": {1: 10.0, 2: 20.0, 3: 22.0, 4: 25.0}, "phase": {1: 1, 2: 1, 3: 2, 4: 2}}
    fit = results.Fit.of(curves)
    assert fit.at_train_nll(2.5) == pytest.approx((1.5, 3.0))  # halfway between epochs 1 and 2
    assert fit.at_train_nll(3.0) == (1.0, 3.1)  # reached at the first epoch: no epoch before it
    assert fit.at_train_nll(2.2) == pytest.approx((1.8, 2.94))  # the first crossing, not the one in phase 2
    assert fit.at_train_nll(1.0) is None
    assert fit.phase_ends() == [(1, 1, 2, 2.0, 2.9, 20.0), (2, 3, 4, 1.6, 2.7, 25.0)]
    assert fit.at_epoch(3) == (2.4, 2.8, 22.0) and fit.at_epoch(9) is None
    assert results.Fit.of({k: v for k, v in curves.items() if k != "phase"}).phase_ends() == []
    ref = results.Fit.of({"train_nll": {1: 2.9, 2: 2.5, 3: 2.3}, "valid_nll": {1: 3.0, 2: 2.6, 3: 2.65},
                          "valid_bleu": {1: 12.0, 2: 24.0, 3: 23.0}})
    arm_g = results.Group(config_key="a", label="M0", control=False, values={}, runs=[], order=1, fit=[fit])
    ref_g = results.Group(config_key="c", label="control", control=True, values={}, runs=[], order=0, fit=[ref])
    rep = results.SweepReport(sweep="s", parent_run_id="p", tracking_uri="", study="", space={}, varied_keys=[],
                              metric="valid_bleu", test_splits=[], protocol="", groups=[ref_g, arm_g],
                              reference=ref_g, warnings=[])
    lines = report.phase_fit_table(rep, ref_g)
    assert "| M0 | 1 | 1-2 | 2.000 | 2.900 | 0.900 | 20.00 | 2.500 | 2.600 | 24.00 |" in lines
    assert "| M0 | 2 | 3-4 | 1.600 | 2.700 | 1.100 | 25.00 | — (stopped after epoch 3) | — | — |" in lines
    assert report.phase_fit_table(dataclasses.replace(rep, groups=[ref_g]), ref_g) == []
    # A phased reference (an ablation against its full model): each phase beside the reference's end of it.
    full = results.Fit.of({"train_nll": {1: 2.6, 2: 2.2, 3: 2.1}, "valid_nll": {1: 3.0, 2: 2.8, 3: 2.75},
                           "valid_bleu": {1: 15.0, 2: 21.0, 3: 23.5}, "phase": {1: 1, 2: 1, 3: 3}})
    full_g = results.Group(config_key="f", label="full", control=False, values={}, runs=[], order=2, fit=[full])
    lines = report.phase_fit_table(dataclasses.replace(rep, groups=[arm_g, full_g], reference=full_g), full_g)
    assert "beside the full's at the end of the same phase" in lines[0]
    assert "| M0 | 1 | 1-2 | 2.000 | 2.900 | 0.900 | 20.00 | 2.200 | 2.800 | 21.00 |" in lines
    assert "| M0 | 2 | 3-4 | 1.600 | 2.700 | 1.100 | 25.00 | — (no phase 2) | — | — |" in lines
    assert "| full | 3 | 3-3 | 2.100 | 2.750 | 0.650 | 23.50 | — | — | — |" in lines


def falling_arm(rep):
    return next(g for g in rep.groups if g.label == "falling")


def test_predictions_written_before_the_runs_are_checked_against_the_control(tmp_path):
    """The predictions a sweep recorded are checked on its runs, each arm against the control (or the arm it names):
    held or not where both converged, "not checkable yet" (with why) where a run it needs is missing or stopped
    while still improving."""
    from nmtcore.sweep.space import Prediction

    when = "2026-12-06 00:05"
    preds = [Prediction("bert_jam", "fit:train_nll", at_least=0.0, written=when, hypothesis="it fits no faster."),
             Prediction("bert_jam", f"bleu:{SPLIT}", at_least=-0.3, written=when),
             Prediction("bert_jam", "bleu:elsewhere", at_least=0.0, written=when),
             Prediction("M9", "fit:valid_nll", at_most=0.0, written=when),
             Prediction("falling", f"bleu:{SPLIT}", at_least=0.0, written=when),
             Prediction("bert_jam", f"bleu:{SPLIT}", at_most=0.0, written=when, against="falling"),
             Prediction("bert_jam", f"bleu:{SPLIT}", at_most=0.0, written=when, against="no_kd")]
    uri, parent = nll_sweep(tmp_path, "pred", "bert_jam", {1: (2.8, 2.95), 2: (1.5, 2.8), 3: (1.2, 2.9)})
    add_trial(parent, tmp_path, 1, 2, "falling", 0.6, {"arm": "falling"}, curves=FALLING,
              nll={1: (3.0, 2.9), 2: (2.0, 2.7), 3: (1.8, 2.6)})
    parent.set_tags({"nmtcore.space_json": json.dumps({"metric": "valid_bleu",
                                                       "predictions": [p.describe() for p in preds]})})
    parent.end()
    rep = results.build_report("pred", uri, n_bootstrap=200)
    checks = {(c.prediction.arm, c.prediction.measure): c for c in rep.predictions if c.prediction.against == "control"}
    fit, bleu = checks["bert_jam", "fit:train_nll"], checks["bert_jam", f"bleu:{SPLIT}"]
    assert fit.value == pytest.approx(-0.5) and fit.held is False and fit.verdict() == "did not hold"
    assert fit.source == "recorded with pred" and fit.seeds == 1
    control, arm = rep.groups[0], next(g for g in rep.groups if g.label == "bert_jam")
    assert bleu.value == pytest.approx(arm.bleu[SPLIT]["1"] - control.bleu[SPLIT]["1"]) and bleu.value > 0
    assert bleu.held is True and bleu.ci == (arm.comparisons[SPLIT].ci_low, arm.comparisons[SPLIT].ci_high)
    assert checks["bert_jam", "bleu:elsewhere"].held is None
    assert checks["bert_jam", "bleu:elsewhere"].why == "elsewhere is not a test set of these runs"
    assert checks["M9", "fit:valid_nll"].why == "no run of M9 in these runs"
    falling = checks["falling", f"bleu:{SPLIT}"]
    assert falling.value > 0 and falling.held is None and falling.why == "falling not converged"
    against = [c for c in rep.predictions if c.prediction.against != "control"]
    assert against[0].value == pytest.approx(arm.bleu[SPLIT]["1"] - falling_arm(rep).bleu[SPLIT]["1"])
    assert against[0].ci is None  # the report's reference is the control, not `falling`
    assert against[0].why == "falling not converged" and against[1].why == "no run of no_kd in these runs"
    md = report.render_markdown(rep)
    assert "**Predictions written before any run**" in md
    assert (f"- `bert_jam`: Δ training NLL ≥ +0.00 (written {when}; recorded with pred): measured -0.500 (1 seed): "
            "**did not hold**. Hypothesis: it fits no faster.") in md
    assert f"- `falling`: ΔBLEU on {SPLIT} ≥ +0.00" in md and "**not checkable yet** (falling not converged)" in md
    verdicts = [(p["arm"], p["verdict"]) for p in json.loads(json.dumps(report._to_json(rep)))["predictions"]]
    assert verdicts == [("bert_jam", "did not hold"), ("bert_jam", "held"), ("bert_jam", "not checkable yet"),
                        ("M9", "not checkable yet"), ("falling", "not checkable yet"),
                        ("bert_jam", "not checkable yet"), ("bert_jam", "not checkable yet")]
    assert f"- `bert_jam`: ΔBLEU on {SPLIT} against `falling` ≤ +0.00" in md

    # A sweep that recorded none: no section.
    uri2, parent2 = nll_sweep(tmp_path, "older", "bert_jam", {1: (2.8, 2.95), 2: (1.5, 2.8), 3: (1.2, 2.9)})
    parent2.end()
    assert "Predictions written" not in report.render_markdown(results.build_report("older", uri2, n_bootstrap=0))


def test_a_sweep_whose_runs_logged_no_nll_has_no_fit_table(sweep_store):
    uri, _ = sweep_store
    rep = results.build_report("toy", uri, n_bootstrap=0)
    assert all(not g.fit for g in rep.groups)
    assert "How each arm fit" not in report.render_markdown(rep)


def test_the_curves_figure_draws_training_against_validation_nll_and_marks_where_phases_begin(tmp_path):
    """With both NLLs logged the figure gets a third panel, training (dashed) against validation (solid) per run;
    a phased run's BLEU curve carries a bar at each epoch where a new phase began, and only there."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as real_plt

    from nmtcore.sweep import figures

    uri, parent = nll_sweep(tmp_path, "curves", "M0_full", {1: (2.8, 2.95), 2: (1.5, 2.8), 3: (1.2, 2.9)})
    m0 = next(r for r in lifecycle.sweep_children(parent.run_id, uri) if r.tags[lifecycle.ARM_TAG] == "M0_full")
    tracker = tracking.Tracker(uri, run_id=m0.run_id)
    for epoch, phase in ((1, 1.0), (2, 1.0), (3, 2.0)):  # phase 2 begins at epoch 3
        tracker.log_metrics({"phase": phase}, step=epoch)
    parent.end()
    rep = results.build_report("curves", uri, n_bootstrap=0)

    drawn: dict = {}

    class Recording:  # pyplot, recording the panels and the phase bars
        def __getattr__(self, name):
            return getattr(real_plt, name)

        def subplots(self, *args, **kwargs):
            fig, axes = real_plt.subplots(*args, **kwargs)
            drawn["panels"] = len(axes)
            for ax in axes:
                plot = ax.plot

                def recorded(*a, _plot=plot, _ax=ax, **k):
                    drawn.setdefault("calls", []).append((list(axes).index(_ax), list(a[0]), k.get("marker"),
                                                          k.get("linestyle")))
                    return _plot(*a, **k)
                ax.plot = recorded
            return fig, axes

    path = figures._valid_curves(rep, tmp_path / "curves.png", Recording())
    assert path.stat().st_size > 5000 and drawn["panels"] == 3
    bars = [(panel, xs) for panel, xs, marker, _ in drawn["calls"] if marker == "|"]
    assert bars == [(0, [3])]  # M0's phase 2, on the BLEU panel; the control has no phases
    nll_lines = sorted(style for panel, _, _, style in drawn["calls"] if panel == 2)
    assert nll_lines == ["-", "-", "--", "--"]  # each run's validation and training NLL


def test_a_resumed_sweeps_unkeyed_protocol_pools_with_the_keyed_one_and_nothing_else_does():
    """A sweep resumed by older code recorded "the sweep's baseline" instead of its baseline's key: the main job at
    dropout 0.3, seed 1 (resumed), and seed 2 (one session) were refused as protocols that differ."""
    from nmtcore.sweep.results import same_protocol

    rest = ("; control arm: yes; second stage, arms and control alike: train.loss_guard=True, train.max_epochs=40, "
            "train.min_delta=0.1, train.patience=3, train.stop_metric=valid_bleu")
    unkeyed = "arms warm-started from the sweep's baseline" + rest
    keyed = "arms warm-started from baseline 51d5510657c7a842371bfd00 (stopped by patience: converged)" + rest
    assert same_protocol(unkeyed, keyed) and same_protocol(keyed, unkeyed) and same_protocol(keyed, keyed)
    other_key = keyed.replace("51d5510657c7a842371bfd00", "0123456789abcdef01234567")
    assert not same_protocol(keyed, other_key)  # two named baselines must be the same one
    assert not same_protocol(unkeyed, keyed.replace("max_epochs=40", "max_epochs=20"))  # the stage must match
    assert not same_protocol(unkeyed, "arms from scratch" + rest)


def test_a_pooled_report_states_the_protocol_line_that_names_the_baseline(tmp_path):
    """Seed 1's sweep resumed by older code (its line says only "the sweep's baseline"), seed 2's names the key:
    pooled in either order, the report states the keyed line."""
    from nmtcore.sweep.results import UNKEYED_START

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    keyed = "arms warm-started from baseline 51d5510657c7a842371bfd00 (stopped by patience: converged); control arm: yes"
    for name, protocol, seed in (("old", f"arms {UNKEYED_START}; control arm: yes", 1), ("new", keyed, 2)):
        run = _sweep(uri, name, protocol=protocol)
        add_trial(run, tmp_path, seed, 0, "control", 0.3, control=True)
        add_trial(run, tmp_path, seed, 1, "fused", 0.8, {"arm": "fused"})
        run.end()
    assert results.build_report(["old", "new"], uri, n_bootstrap=0).protocol == keyed
    assert results.build_report(["new", "old"], uri, n_bootstrap=0).protocol == keyed
    assert UNKEYED_START in results.build_report("old", uri, n_bootstrap=0).protocol  # alone: its own line
