"""Sweep reports from MLflow alone: a hand-made sweep (parent + child runs as nmtcore.sweep leaves them)
in a temporary store gives the paper-style table, p-values, the L x H heatmap and the warnings."""

from __future__ import annotations

import json
import random

import pytest

from nmtcore import report, tracking

SPLIT, LANG = "test", "de"
REFS = [f"der hund {i} sieht die katze {i % 7}" for i in range(60)]


def hyps(quality: float, seed: int) -> list[str]:
    """Hypotheses that get a fraction ``quality`` of the references right."""
    rng = random.Random(seed)
    return [r if rng.random() < quality else "ein haus steht" for r in REFS]


@pytest.fixture(scope="module")
def sweep_store(tmp_path_factory):
    """A 2 x 2 (layers x hidden) grid with 2 seeds, as a sweep leaves it; (4, 256) was stopped early by
    ASHA in seed 2, (4, 128) failed once, (2, 256) and (4, 128) trained identically in seed 1."""
    tmp = tmp_path_factory.mktemp("report")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    space = {"metric": "valid_bleu", "baseline": None, "description": "toy size grid",
             "plot": {"kind": "heatmap", "rows": "model.bert.layers", "cols": "model.bert.hidden"}}
    parent = tracking.Tracker(uri, experiment="sweeps", run_name="toy", tags={
        tracking.SWEEP_TAG: "toy", tracking.ROLE_TAG: "sweep", "nmtcore.study": "bert_size_grid",
        "nmtcore.varied_keys": "model.bert.layers,model.bert.hidden", "nmtcore.test_split": SPLIT,
        "nmtcore.space_json": json.dumps(space)})
    quality = {(2, 128): 0.3, (2, 256): 0.5, (4, 128): 0.7, (4, 256): 0.9}
    index = 0
    hyp_file = tmp / f"{SPLIT}.{LANG}"
    for seed in (1, 2):
        for (layers, hidden), q in quality.items():
            key = f"{layers}-{hidden}"
            run = parent.child(run_name=f"layers={layers} hidden={hidden} seed={seed}", tags={
                tracking.SWEEP_TAG: "toy", tracking.ROLE_TAG: "trial", tracking.TRIAL_KEY_TAG: f"{key}-{seed}",
                "nmtcore.config_key": key, "nmtcore.seed": seed, "nmtcore.tune_trial_id": f"abc_{index:05d}",
                "varied.model.bert.layers": layers, "varied.model.bert.hidden": hidden})
            index += 1
            run.log_params({"data.tgt_lang": LANG})
            same = (2, 256) if (layers, hidden) == (4, 128) else (layers, hidden)
            for epoch in (1, 2):
                run.log_metrics({"valid_loss": 5.0 - epoch * quality[same] + seed, "valid_bleu": 10 * q + epoch},
                                step=epoch)
            if (layers, hidden) == (4, 256) and seed == 2:
                run.set_tags({tracking.TRIAL_STATE_TAG: "stopped_early"})
                run.end("FINISHED")
                continue
            if (layers, hidden) == (4, 128) and seed == 2:
                run.set_tags({tracking.TRIAL_STATE_TAG: "failed", tracking.FAILURE_REASON_TAG:
                              "NonFiniteLossError: non-finite training loss (nan) at update 7"})
                run.end("FAILED")
                continue
            h = hyps(q, seed)
            from nmtcore.bleu import corpus_bleu, corpus_chrf

            run.log_metrics({f"test/{SPLIT}/bleu": corpus_bleu(h, REFS).score,
                             f"test/{SPLIT}/chrf": corpus_chrf(h, REFS).score,
                             "cost/parameters": 1e6 * layers * hidden / 128, "cost/wall_s": 60.0 * layers,
                             "cost/cpu_s": 100.0 * layers, "cost/train_tokens_per_s": 1000.0 / layers}, step=2)
            hyp_file.write_text("\n".join(h) + "\n")
            run.log_artifact(hyp_file, "hypotheses")
            run.log_text("\n".join(REFS) + "\n", f"references/{SPLIT}.{LANG}")
            run.set_tags({tracking.TRIAL_STATE_TAG: "complete"})
            run.end("FINISHED")
    parent.end()
    return uri, parent.run_id


def test_table_means_stds_p_values_and_statuses(sweep_store):
    uri, parent_id = sweep_store
    rep = report.build_report("toy", uri, n_bootstrap=300)
    assert rep.parent_run_id == parent_id and rep.study == "bert_size_grid"
    assert [g.label for g in rep.groups] == ["layers=2, hidden=128", "layers=2, hidden=256",
                                             "layers=4, hidden=128", "layers=4, hidden=256"]
    base, _, failed, stopped = rep.groups
    assert rep.baseline is base and len(base.test_bleu) == 2 and base.p_value is None
    assert failed.status == {"complete": 1, "failed": 1} and len(failed.test_bleu) == 1
    assert stopped.status == {"complete": 1, "stopped_early": 1}
    # Much better hypotheses than the baseline: a clear, significant gain.
    assert stopped.delta_bleu > 10 and stopped.p_value < 0.05 and stopped.pooled_seeds == 1
    rows = report.table_rows(rep)
    assert rows[0]["p"] == "base" and " ± " in rows[0]["test BLEU"]
    assert rows[3]["trials"] == "1 complete, 1 stopped_early"
    assert rows[2]["params (M)"] == "4.00"
    assert any("NonFiniteLossError" in w for w in rep.warnings)


def test_identical_training_is_flagged(sweep_store):
    uri, _ = sweep_store
    rep = report.build_report("toy", uri, n_bootstrap=0)
    assert any("layers=2, hidden=256 and layers=4, hidden=128 trained identically" in w for w in rep.warnings)


def test_report_files_heatmap_and_mlflow_artifacts(sweep_store, tmp_path):
    uri, parent_id = sweep_store
    files = report.make_report(parent_id, uri, tmp_path / "out", log=True, n_bootstrap=100)
    names = {f.name for f in files}
    assert {"table.md", "table.csv", "report.json", "heatmap.png", "bleu_vs_cost.png"} <= names
    assert (tmp_path / "out" / "heatmap.png").stat().st_size > 5000
    md = (tmp_path / "out" / "table.md").read_text()
    assert md.startswith("### toy: toy size grid") and "| layers | hidden | test BLEU |" in md
    assert {"report/table.md", "report/heatmap.png"} <= set(tracking.list_artifacts(parent_id, uri))
    assert tracking.get_run(parent_id, uri).status == "FINISHED"  # logging a report does not reopen the run


def test_unknown_sweep_is_a_one_line_error(sweep_store):
    uri, _ = sweep_store
    with pytest.raises(tracking.TrackingError, match="no sweep named 'nope'"):
        report.build_report("nope", uri)


def test_report_command_line(sweep_store, tmp_path):
    import subprocess
    import sys

    uri, parent_id = sweep_store
    r = subprocess.run([sys.executable, "-m", "nmtcore.cli", "report", "--sweep", "toy", "--tracking-uri", uri,
                        "--out", str(tmp_path / "cli"), "--bootstrap", "50", "--no-log"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| layers | hidden | test BLEU |" in r.stdout and (tmp_path / "cli" / "heatmap.png").is_file()
    r = subprocess.run([sys.executable, "-m", "nmtcore.cli", "report", "--sweep", "nope", "--tracking-uri", uri],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.strip() == f"nmtcore: error: no sweep named 'nope' in {uri}"
