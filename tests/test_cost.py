"""What a sweep will cost, said before it starts: the estimate's arithmetic on constructed plans, where its epochs
come from, and the probe and dry run on a tiny task."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmtcore import tracking
from nmtcore.engine import build_trainer
from nmtcore.sweep.baseline import checkpointed_epochs
from nmtcore.sweep.cost import (PrefixCost, RunCost, Speed, duration, epoch_tokens, estimate,
                                expected_epochs, makespan, prefix_cost, probe, run_cost, schedule, shape_key)
from nmtcore.sweep.lifecycle import ROLE_TAG
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.tiny_bert import tiny_bert_dir
from nmtcore.tracking.callback import STOPPED_BY_TAG

ROOT = Path(__file__).resolve().parents[1]


def test_trials_start_in_order_as_slots_free():
    assert makespan([3.0, 1.0, 1.0, 1.0], 2) == (3.0, 2)  # the short ones queue behind each other on one slot
    assert makespan([1.0, 1.0, 1.0, 3.0], 2) == (4.0, 2)  # a long last trial starts late
    assert makespan([5.0, 5.0, 5.0], 1) == (15.0, 3)
    assert makespan([2.0, 2.0], 8) == (2.0, 1)
    assert makespan([], 2) == (0.0, 0)
    with pytest.raises(ValueError, match="slots"):
        makespan([1.0], 0)


def test_a_run_costs_its_epochs_of_training_and_validation_then_its_tests():
    speed = Speed(train_tokens_per_s=100.0, decode_sentences_per_s=10.0, threads=1)
    cost = run_cost("arm", 3, "the budget's fixed epochs", speed, tokens=1000, valid_sentences=50, test_sentences=20)
    assert cost.epoch_s == pytest.approx(1000 / 100 + 50 / 10)
    assert cost.end_s == pytest.approx(2.0)
    assert cost.seconds == pytest.approx(3 * 15 + 2)
    no_bleu = run_cost("arm", 3, "x", speed, 1000, 50, 20, valid_bleu=False)
    assert no_bleu.epoch_s == pytest.approx(10.0)


def test_the_estimate_adds_shared_work_the_baseline_left_and_the_trials_waves():
    arm = RunCost("arm", 2, 60.0, 10.0, "the budget's fixed epochs")  # 130 s each
    base = RunCost("baseline", 20, 100.0, 30.0, "the cap: an upper bound")
    est = estimate([("BERT features x", 40.0)], base, False, [arm] * 3, slots=2, machine="2 cores",
                   baseline_epochs_done=5)
    phases = {p.name: p for p in est.phases}
    assert phases["shared work"].seconds == 40.0
    assert phases["baseline"].seconds == pytest.approx(15 * 100 + 30)  # 5 of its 20 epochs already trained
    assert "5 already trained" in phases["baseline"].detail and "upper bound" in phases["baseline"].detail
    assert phases["trials"].seconds == pytest.approx(260.0)  # 3 trials of 130 s on 2 slots: two waves
    assert "2 waves" in phases["trials"].detail
    assert est.seconds == pytest.approx(40 + 1530 + 260)
    text = "\n".join(est.lines())
    assert "2 cores" in text and "total:" in text and duration(est.seconds) in text

    reused = estimate([], RunCost("baseline", 0, 0.0, 0.0, "in the store"), True, [arm], 2, "m")
    assert [p.seconds for p in reused.phases] == [0.0, 0.0, 130.0]
    assert reused.phases[0].detail == "all cached" and "reused" in reused.phases[1].detail


def test_a_trial_starts_from_the_phases_an_earlier_trial_has_kept_by_then():
    """BERT-JAM's M1 and M2 warm up alike (key "w"): run one after the other, M2 starts from M1's warm-up and trains
    only the rest; run side by side, neither has the other's warm-up when it starts; a warm-up the store already
    holds is taken at once, by its own epochs."""
    speed = Speed(100.0, 10.0, 1, phase_tokens_per_s=(100.0, 50.0, 25.0))
    # an epoch: 1000 tokens + 50 sentences decoded: 15 s in the warm-up, 25 s in the GLU phase, 45 s fine-tuning
    m1 = run_cost("M1", 20, "x", speed, 1000, 50, 0, phase_weights=(10, 5, 5))
    m1 = dataclasses.replace(m1, prefixes=prefix_cost(("w", "w+glu-M1"), (0, 0), 20, speed, 1000, 50,
                                                      phase_weights=(10, 5, 5)))
    assert m1.prefixes.epochs == (10, 15) and m1.prefixes.seconds == pytest.approx((150, 275))
    assert m1.seconds == pytest.approx(150 + 125 + 225)
    m2 = run_cost("M2", 16, "y", Speed(100.0, 10.0, 1, phase_tokens_per_s=(100.0, 25.0)), 1000, 50, 0,
                  phase_weights=(10, 6))
    m2 = dataclasses.replace(m2, prefixes=prefix_cost(("w",), (0,), 16, Speed(100.0, 10.0, 1, phase_tokens_per_s=(
        100.0, 25.0)), 1000, 50, phase_weights=(10, 6)))
    assert m2.seconds == pytest.approx(150 + 6 * 45)

    after, total, waves = schedule([m1, m2], 1)
    assert after[0].saved_s == 0 and after[1].saved_epochs == 10 and after[1].saved_s == pytest.approx(150)
    assert after[1].trained_epochs == 6 and "trained by M1" in after[1].epochs_from
    assert (total, waves) == (pytest.approx(500 + 270), 2)
    side, total, _ = schedule([m1, m2], 2)
    assert [t.saved_s for t in side] == [0, 0] and total == pytest.approx(500)
    # M2 first on a single slot: M1 starts from M2's warm-up; M1's GLU phase is its own
    first, total, _ = schedule([m2, m1], 1)
    assert first[1].saved_epochs == 10 and total == pytest.approx(420 + 350)
    # the store holds the warm-up (12 epochs there): both take it, charged by their own epoch's cost
    held = dataclasses.replace(m2, prefixes=dataclasses.replace(m2.prefixes, stored=(12,)))
    (one,), total, _ = schedule([held], 1)
    assert one.saved_epochs == 12 and one.saved_s == pytest.approx(12 * 15) and "kept in the store" in one.epochs_from
    # phase lengths unknown to the sharer: it is charged as the run that trains them has them
    blind = RunCost("M2", 16, 20.0, 0.0, "z", prefixes=PrefixCost(("w",), (0.0,), (0.0,), (0,)))
    (_, shared), _, _ = schedule([m1, blind], 1)
    assert shared.saved_epochs == 10 and shared.saved_s == pytest.approx(150)
    est = estimate([], None, False, [m1, m2], 1, "m", keys=("a", "b"))
    assert est.runs[1][1] == pytest.approx(270) and "6 epochs" in est.phases[-1].detail


def test_durations_read_in_the_unit_that_fits():
    assert duration(42) == "42 s" and duration(750) == "12.5 min" and duration(4 * 3600) == "4.0 h"
    assert duration(math.nan) == "?"


def test_epochs_come_from_the_budget_the_store_or_the_cap(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    fixed = tiny_experiment(tmp_path, **{"train.max_epochs": 4})
    assert expected_epochs(fixed, "trial", uri) == (4.0, "the budget's fixed epochs")
    converge = tiny_experiment(tmp_path, **{"train.max_epochs": 40, "train.patience": 3, "train.stop_metric": "valid_bleu", "train.valid_bleu": True,
                                            "train.min_delta": 0.1})
    epochs, why = expected_epochs(converge, "trial", uri)
    assert epochs == 40.0 and "upper bound" in why

    def record(cfg, role, stopped, epochs, status="FINISHED"):
        with tracking.Tracker(uri, experiment="e", tags={ROLE_TAG: role, STOPPED_BY_TAG: stopped}) as t:
            t.log_config(cfg)
            for e in range(1, epochs + 1):
                t.log_metrics({"epoch": e}, step=e)
            if status != "FINISHED":
                t.end(status)

    record(converge, "trial", "patience", 9)
    record(converge, "trial", "patience", 13)
    record(converge, "trial", "patience", 11)
    record(converge, "trial", "cap", 40)  # not converged: not counted
    record(converge, "baseline", "patience", 30)  # another role
    record(converge.with_overrides({"train.patience": 5}), "trial", "patience", 25)  # another rule
    record(converge, "trial", "patience", 2, status="FAILED")
    epochs, why = expected_epochs(converge, "trial", uri)
    assert epochs == 11.0 and "median of 3 converged trial runs" in why
    assert expected_epochs(converge, "baseline", uri)[0] == 30.0


def test_an_epoch_trains_on_every_target_token_with_its_eos(tmp_path):
    cfg = tiny_experiment(tmp_path)
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    assert epoch_tokens(trainer.data) == sum(b.n_tgt_tokens for b in trainer.train_batches(epoch=1))


def test_speed_depends_on_the_model_not_on_p_net_or_the_seed(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": tiny_bert_dir()})
    assert shape_key(cfg) == shape_key(cfg.with_overrides({"model.p_net": 0.0, "train.seed": 7}))
    assert shape_key(cfg) != shape_key(cfg.with_overrides({"model.d_model": 32, "model.heads": 2}))
    assert shape_key(cfg) != shape_key(tiny_experiment(tmp_path))


def test_the_probe_measures_this_machine_and_leaves_the_threads_and_cache_alone(tmp_path):
    torch.set_num_threads(2)
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": tiny_bert_dir()})
    from nmtcore.data import prepare_data

    data = prepare_data(cfg.data)
    before = sorted(p.name for p in (cfg.data.resolved_cache_dir() / "bert_features").glob("*")) \
        if (cfg.data.resolved_cache_dir() / "bert_features").is_dir() else []
    speed = probe(cfg, data, threads=1)
    assert torch.get_num_threads() == 2
    assert speed.train_tokens_per_s > 0 and speed.decode_sentences_per_s > 0 and speed.threads == 1
    after = sorted(p.name for p in (cfg.data.resolved_cache_dir() / "bert_features").glob("*")) \
        if (cfg.data.resolved_cache_dir() / "bert_features").is_dir() else []
    assert after == before  # the probe's features went to a temporary cache
    assert probe(tiny_experiment(tmp_path), data, threads=1).train_tokens_per_s > 0  # no BERT


def test_the_probe_trains_on_features_of_their_shape_without_running_bert(tmp_path, monkeypatch):
    """The probe's model reads cached features as a trial's does, but they are random values of the shape BERT's
    have (BERT does not run over the probe's sentences); outside the probe's temporary folder, features are
    BERT's again."""
    from nmtcore.bert.features import FeatureCache
    from nmtcore.bert.layer import BertLayer, bert_layers, synthetic_features
    from nmtcore.data import prepare_data

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": tiny_bert_dir()})
    data = prepare_data(cfg.data)
    built, get_or_build = [], FeatureCache.get_or_build
    monkeypatch.setattr(FeatureCache, "get_or_build", lambda self, key, inputs, compute, **kw: built.append(
        compute.__name__) or get_or_build(self, key, inputs, compute, **kw))
    assert probe(cfg, data, threads=1).train_tokens_per_s > 0
    assert built and set(built) == {"_random_features"}
    built.clear()
    with synthetic_features(tmp_path / "elsewhere"):
        trainer = build_trainer(cfg.with_overrides({"data.cache_dir": str(tmp_path / "real-cache")}))
    assert built and set(built) == {"_compute_features"}
    layer = bert_layers(trainer.model)[0]
    assert isinstance(layer, BertLayer)
    ids = torch.randint(1, 5, (3, 7))
    mask, segments = torch.zeros(3, 7, dtype=torch.bool), torch.zeros(3, 7, dtype=torch.long)
    assert layer._random_features(ids, mask, segments).shape == layer._compute_features(ids, mask, segments).shape


def test_checkpointed_epochs_reads_the_last_saved_epoch(tmp_path):
    assert checkpointed_epochs(tmp_path) == 0
    (tmp_path / "checkpoints").mkdir()
    for name in ("epoch3.pt", "epoch12.pt", "epoch12.pt.sha256", "best.pt"):
        (tmp_path / "checkpoints" / name).write_bytes(b"")
    assert checkpointed_epochs(tmp_path) == 12  # epoch3.pt has no checksum: not a resume point


def test_a_dry_run_prints_every_phase_and_trains_nothing(tmp_path):
    out = subprocess.run([sys.executable, "sweeps/drop_net.py", "--variant", "cause", "--budget", "quick",
                          "--smoke-test", "--dry-run", "--storage", str(tmp_path / "sweeps")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("estimated cost on this machine"))
    names = [line.split(":")[0].strip() for line in lines[head + 1:]]
    assert names == ["shared work", "baseline", "trials", "total"]
    assert "at once" in lines[head + 3] and "epochs" in lines[head + 3]
    assert not (tmp_path / "sweeps").exists()  # no sweep started


def test_the_dry_run_counts_a_truncation_s_features_inside_its_deeper_bert_s_pass(tmp_path, monkeypatch):
    """A grid over a BERT and its bottom-2 truncation: one feature build is timed and costed (the deeper's),
    the truncation's features are said to come from that pass, at no cost of their own."""
    from nmtcore.bert.truncate import truncate
    from nmtcore.sweep.cost import dry_run
    from nmtcore.sweep.settings import SweepSettings
    from nmtcore.sweep.space import SearchSpace, grid
    from nmtcore.testing.tiny_bert import save_tiny_bert

    full = save_tiny_bert(tmp_path / "full", layers=4)
    cut = truncate("tiny", full, 2, tmp_path / "trunc")
    base = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": str(full)})
    space = SearchSpace("t", "t", "bert_fused", params={"model.bert.name": grid([str(cut), str(full)])},
                        metric="valid_loss", mode="min")
    timed: list[int] = []
    import nmtcore.sweep.cost as cost

    real = cost.feature_rate
    monkeypatch.setattr(cost, "feature_rate", lambda layer, *a, **k: timed.append(layer.num_layers) or real(layer, *a, **k))
    est = dry_run(space, base, SweepSettings(name="t", storage=str(tmp_path / "sweeps"),
                                             tracking_uri=f"file://{tmp_path / 'mlruns'}"), progress=lambda _: None)
    shared = next(p for p in est.phases if p.name == "shared work")
    assert timed == [4], timed
    assert f"BERT features {cut} (computed in the pass of {full})" in shared.detail, shared.detail
    assert f"BERT features {full} (" in shared.detail and shared.seconds > 0


def test_a_fresh_store_takes_the_platforms_measured_epochs_not_the_cap(tmp_path):
    """On a fresh machine every converged run was estimated at its epoch cap, several times its real cost: with
    no converged run of the kind in the store, a kind the platform has converged before takes the epochs those
    runs took, under the rule they were measured with; anything else still takes the cap."""
    from nmtcore.sweep.cost import MEASURED_EPOCHS

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rule = {"train.stop_metric": "valid_bleu", "train.patience": 3, "train.min_delta": 0.1, "train.loss_guard": True,
            "train.valid_bleu": True}
    baseline = tiny_experiment(tmp_path, **rule, **{"data.corpus": "multi30k", "train.max_epochs": 60})
    epochs, why = expected_epochs(baseline, "baseline", uri)
    assert (epochs, True) == MEASURED_EPOCHS[("multi30k", "scratch", "transformer")]
    assert "platform's converged transformer runs on multi30k" in why and "at most the cap, 60" in why
    assert "bound" not in why  # measured under this very rule
    arm = baseline.with_overrides({"model.name": "bert_fused", "model.bert.name": "minilm", "train.max_epochs": 40})
    assert expected_epochs(arm, "trial", uri)[0] == MEASURED_EPOCHS[("multi30k", "warm", "bert_fused")][0]
    assert "upper bound" in expected_epochs(arm.with_overrides({"train.patience": 5}), "trial", uri)[1]
    assert "upper bound" in expected_epochs(arm.with_overrides({"data.corpus": "iwslt14"}), "trial", uri)[1]
    assert expected_epochs(arm.with_overrides({"train.max_epochs": 8}), "trial", uri)[0] == 8.0  # the cap binds
    # A trial from scratch converges like a baseline of its model, not like a second stage.
    scratch = baseline.with_overrides({"model.name": "plm_sponsored"})
    measured = MEASURED_EPOCHS[("multi30k", "scratch", "plm_sponsored")][0]
    assert expected_epochs(scratch, "trial", uri, warm=False)[0] == measured
    # The loss guard can only lengthen a run: a figure measured with it bounds a run without it from above, and
    # one measured without it bounds a guarded run from below.
    epochs, why = expected_epochs(baseline.with_overrides({"train.loss_guard": False}), "baseline", uri)
    assert epochs == MEASURED_EPOCHS[("multi30k", "scratch", "transformer")][0]
    assert "measured with train.loss_guard" in why and "an upper bound" in why
    doc = baseline.with_overrides({"data.corpus": "maruf2019_devtest"})
    epochs, why = expected_epochs(doc, "baseline", uri)
    assert (epochs, False) == MEASURED_EPOCHS[("maruf2019_devtest", "scratch", "transformer")]
    assert "measured without train.loss_guard" in why and "a lower bound" in why
    # A converged run of the kind in the store wins over the platform's figure; one without the guard is not a
    # run of a guarded kind.
    unguarded = arm.with_overrides({"train.loss_guard": False})
    with tracking.Tracker(uri, experiment="e", tags={ROLE_TAG: "trial", STOPPED_BY_TAG: "patience"}) as t:
        t.log_config(unguarded)
        for e in range(1, 21):
            t.log_metrics({"epoch": e}, step=e)
    assert expected_epochs(unguarded, "trial", uri) == (
        20.0, "the median of 1 converged trial run of this kind in the store")
    assert expected_epochs(arm, "trial", uri)[0] == MEASURED_EPOCHS[("multi30k", "warm", "bert_fused")][0]


def test_the_dry_run_probes_each_bert_of_a_size_grid_once(tmp_path, monkeypatch):
    """A grid over BERT sizes names each BERT by layers and hidden; made, it is named by what it resolved to
    (the packaged MiniLM's bottom layers). Its probe is found again by the run as planned: one probe per cell and
    the baseline's, not a second one per cell under the resolved name."""
    import nmtcore.sweep.cost as cost
    from nmtcore.sweep.settings import SweepSettings
    from nmtcore.sweep.space import Protocol, SearchSpace, grid

    probed: list[str] = []
    speed = Speed(train_tokens_per_s=1000.0, decode_sentences_per_s=10.0, threads=1)
    monkeypatch.setattr(cost, "probe", lambda cfg, data, threads: probed.append(
        f"{cfg.model.name} L{cfg.model.bert.layers}" if cfg.model.bert.enabled else cfg.model.name) or speed)
    # (no model.bert.pretrain_corpus: made, the BERT names the corpus it would be pretrained on, as the main
    # job's does)
    base = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.hidden": 384,
                                        "model.bert.layers": 1, "train.valid_bleu": True})
    space = SearchSpace("t", "t", "bert_fused", params={"model.bert.layers": grid((1, 2))},
                        protocol=Protocol(), metric="valid_loss", mode="min")
    est = cost.dry_run(space, base, SweepSettings(name="t", storage=str(tmp_path / "sweeps"),
                                                  tracking_uri=f"sqlite:///{tmp_path / 'm.db'}",
                                                  baseline_store=str(tmp_path / "baselines")),
                       progress=lambda _: None, shared_s=0.0)
    assert sorted(probed) == ["bert_fused L1", "bert_fused L2", "transformer", "transformer"], probed  # + baseline
    trials = next(p for p in est.phases if p.name == "trials")
    assert "3 trials" in trials.detail, trials.detail


def test_a_trial_from_scratch_converges_like_a_baseline_not_like_a_second_stage(tmp_path):
    """A study without a shared baseline (PLM-sponsored's loss ablation) trains its control from scratch: it
    converges like a baseline, not like a trial warm-started from one, whose figure the estimate took. The start
    decides which measured figure, and which stored runs, a trial's estimate takes."""
    from nmtcore.sweep.cost import MEASURED_EPOCHS

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rule = {"train.stop_metric": "valid_bleu", "train.patience": 3, "train.min_delta": 0.1, "train.valid_bleu": True,
            "data.corpus": "multi30k", "train.max_epochs": 60}
    control = tiny_experiment(tmp_path, **rule)
    warm, scratch = (MEASURED_EPOCHS[("multi30k", start, "transformer")][0] for start in ("warm", "scratch"))
    assert warm != scratch
    assert expected_epochs(control, "trial", uri)[0] == warm  # a trial is warm-started unless told otherwise
    epochs, why = expected_epochs(control, "trial", uri, warm=False)
    assert epochs == scratch and "from-scratch transformer" in why, why
    assert expected_epochs(control, "trial", uri, warm=True)[0] == warm
    assert expected_epochs(control, "baseline", uri)[0] == scratch

    def record(cfg, epochs):
        with tracking.Tracker(uri, experiment="e", tags={ROLE_TAG: "trial", STOPPED_BY_TAG: "patience"}) as t:
            t.log_config(cfg)
            for e in range(1, epochs + 1):
                t.log_metrics({"epoch": e}, step=e)

    record(control, 23)  # from scratch
    record(control.with_overrides({"train.init_from": str(tmp_path / "baseline.pt")}), 5)  # a second stage
    assert expected_epochs(control, "trial", uri, warm=False) == (
        23.0, "the median of 1 converged from-scratch trial run of this kind in the store")
    assert expected_epochs(control, "trial", uri, warm=True) == (
        5.0, "the median of 1 converged warm-started trial run of this kind in the store")


def test_a_resumed_sweep_is_estimated_by_what_is_left_of_it(tmp_path, monkeypatch):
    """A sweep spread over sessions: resumed, it estimates its unfinished trials only, each less the epochs it
    has trained, read from its trials' MLflow runs (a finished trial's run is FINISHED; a stopped one's KILLED,
    with the epochs it reported)."""
    import nmtcore.sweep.cost as cost
    from nmtcore.sweep.settings import SweepSettings
    from nmtcore.sweep.space import SearchSpace, grid
    from nmtcore.tracking import schema

    speed = Speed(train_tokens_per_s=1000.0, decode_sentences_per_s=10.0, threads=1)
    monkeypatch.setattr(cost, "probe", lambda cfg, data, threads: speed)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    base = tiny_experiment(tmp_path, **{"train.max_epochs": 4})
    space = SearchSpace("t", "t", "transformer", params={"train.lr": grid((1e-3, 2e-3, 3e-3))},
                        metric="valid_loss", mode="min")
    settings = SweepSettings(name="t", storage=str(tmp_path / "sweeps"), tracking_uri=uri)
    fresh = cost.dry_run(space, base, settings, progress=lambda _: None, shared_s=0.0)
    (k1, whole), (k2, _), (k3, _) = fresh.runs

    with tracking.Tracker(uri, experiment="e") as parent:
        pass
    for key, epochs, status in ((k1, 4, "FINISHED"), (k2, 3, "KILLED")):
        with tracking.Tracker(uri, experiment="e", tags={tracking.PARENT_RUN_TAG: parent.run_id,
                                                          schema.CONFIG_KEY: key}) as t:
            for e in range(1, epochs + 1):
                t.log_metrics({"epoch": e}, step=e)
            if status != "FINISHED":
                t.end(status)
    done = cost.sweep_progress(parent.run_id, uri)
    assert done == {k1: cost.TrialProgress(4, True), k2: cost.TrialProgress(3, False)}
    # A run ended FINISHED whose trial state still says running (a trial Tune stopped, ended by an older
    # version) is not finished: it trains on when resumed.
    with tracking.Tracker(uri, experiment="e", tags={tracking.PARENT_RUN_TAG: parent.run_id, schema.CONFIG_KEY: k3,
                                                      schema.TRIAL_STATE: "running"}) as t:
        t.log_metrics({"epoch": 1}, step=1)
    assert cost.sweep_progress(parent.run_id, uri)[k3] == cost.TrialProgress(1, False)
    with tracking.Tracker(uri, run_id=t.run_id) as again:
        again.set_tags({schema.TRIAL_STATE: "complete"})
    assert cost.sweep_progress(parent.run_id, uri)[k3] == cost.TrialProgress(1, True)
    done.pop(k3, None)

    left = cost.dry_run(space, base, settings, progress=lambda _: None, shared_s=0.0, done=done)
    assert [k for k, _ in left.runs] == [k2, k3]  # the finished trial is not estimated again
    seconds = dict(left.runs)
    assert seconds[k3] == pytest.approx(whole)  # not started: all of it (the fixed budget: 4 epochs a trial)
    assert seconds[k2] < whole / 2  # one epoch of the four left, and its test decoding
    trials = next(p for p in left.phases if p.name == "trials")
    assert "2 trials (and 1 finished in earlier sessions)" in trials.detail, trials.detail
    assert "less the 3 it has trained" in trials.detail, trials.detail
    assert left.seconds < fresh.seconds
    # a new sweep's store, or another sweep's, knows no trial of this one
    assert cost.sweep_progress("0" * 32, uri) == {}


def test_runs_trained_with_another_dropout_are_a_guess_not_a_run_of_this_kind(tmp_path):
    """BERT-JAM at dropout 0.3 was estimated from its runs at 0.1 as if they were its own kind: a stored run that
    differs in a training setting that decides how long it takes to converge (dropout, learning rate, warm-up,
    label smoothing) counts only when no run of the kind is there, and the estimate says it is a guess."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rule = {"train.stop_metric": "valid_bleu", "train.patience": 3, "train.min_delta": 0.1, "train.loss_guard": True,
            "train.valid_bleu": True, "data.corpus": "iwslt14", "train.max_epochs": 60, "model.dropout": 0.1}
    at_01 = tiny_experiment(tmp_path, **rule)
    with tracking.Tracker(uri, experiment="e", tags={ROLE_TAG: "trial", STOPPED_BY_TAG: "patience"}) as t:
        t.log_config(at_01)
        for e in range(1, 30):
            t.log_metrics({"epoch": e}, step=e)
    assert expected_epochs(at_01, "trial", uri, warm=False) == (
        29.0, "the median of 1 converged from-scratch trial run of this kind in the store")
    for other in ({"model.dropout": 0.3}, {"train.lr": 3e-4}, {"train.warmup_updates": 4000}):
        epochs, why = expected_epochs(at_01.with_overrides(other), "trial", uri, warm=False)
        assert epochs == 29.0 and "trained with other settings" in why and "a guess" in why, (other, why)
    # another model, or another rule, is no guess at all: the cap
    assert "upper bound" in expected_epochs(at_01.with_overrides({"train.patience": 5}), "trial", uri, warm=False)[1]


def test_a_variant_with_no_runs_of_its_own_takes_its_family_s_as_a_guess(tmp_path):
    """BERT-JAM's M1 and M2 were estimated at the 60-epoch cap beside a converged M0 in the store: a variant with no
    converged run of its own takes its family's (the runs of the other variants), saying so; only phase lengths of
    its own number of phases stand for its phases (M2 has no GLU phase)."""
    import nmtcore.sweep.cost as cost

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    rule = {"train.stop_metric": "valid_bleu", "train.patience": 3, "train.min_delta": 0.1, "train.loss_guard": True,
            "train.valid_bleu": True, "data.corpus": "iwslt14", "train.max_epochs": 60, "model.dropout": 0.3,
            "model.name": "bert_jam", "model.bert.name": "minilm", "train.phases_converge": True}
    m0 = tiny_experiment(tmp_path, **rule)
    assert cost.family("bert_jam_m1") == ("bert_jam", "bert_jam_m1", "bert_jam_m2", "bert_jam_m3")
    assert cost.family("transformer") == ("transformer",)
    m1, m2 = m0.with_overrides({"model.name": "bert_jam_m1"}), m0.with_overrides({"model.name": "bert_jam_m2"})
    assert "upper bound" in expected_epochs(m1, "trial", uri, warm=False)[1]  # nothing in the store, nothing measured
    with tracking.Tracker(uri, experiment="e", tags={ROLE_TAG: "trial", STOPPED_BY_TAG: "patience"}) as t:
        t.log_config(m0)
        for e, phase in enumerate([1] * 23 + [2] * 6 + [3] * 10, start=1):
            t.log_metrics({"epoch": e, "phase": phase}, step=e)
    assert expected_epochs(m0, "trial", uri, warm=False)[0] == 39.0
    epochs, why = expected_epochs(m1, "trial", uri, warm=False)
    assert epochs == 39.0 and "run of bert_jam, another variant of bert_jam_m1's family" in why and "a guess" in why, why
    epochs, why = expected_epochs(m1.with_overrides({"model.dropout": 0.1}), "trial", uri, warm=False)
    assert epochs == 39.0 and "trained with other settings: a guess" in why, why
    assert cost.converged_phase_lengths(m1, "trial", uri, warm=False, phases=3) == [(23, 6, 10)]
    assert cost.converged_phase_lengths(m2, "trial", uri, warm=False, phases=2) == []
    # a fresh store: the platform's measured figure of the family's root, a guess for the variant
    fresh = f"sqlite:///{tmp_path / 'fresh.db'}"
    on = m1.with_overrides({"data.corpus": "multi30k", "model.dropout": 0.1})
    epochs, why = expected_epochs(on, "trial", fresh, warm=False)
    assert epochs == cost.MEASURED_EPOCHS[("multi30k", "scratch", "bert_jam")][0]
    assert "converged from-scratch bert_jam runs" in why and "another variant of bert_jam_m1's family" in why, why


def test_the_platforms_measured_epochs_at_other_settings_are_a_guess(tmp_path):
    """The platform's measured epochs come from runs at multi30k_small's dropout, learning rate, warm-up and label
    smoothing: a run set otherwise still takes them on a fresh store, and the estimate says they are a guess."""
    from nmtcore.config import preset
    from nmtcore.sweep.cost import MEASURED_EPOCHS, MEASURED_SETTINGS

    flat = preset("multi30k_small").flat()
    assert {k: flat[k] for k in MEASURED_SETTINGS} == MEASURED_SETTINGS  # the preset the figures were measured at
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = preset("multi30k_small").with_overrides({
        "model.name": "bert_jam", "model.bert.name": "minilm", "train.stop_metric": "valid_bleu", "train.patience": 3,
        "train.min_delta": 0.1, "train.loss_guard": True, "train.valid_bleu": True, "train.max_epochs": 60})
    epochs, why = expected_epochs(cfg, "trial", uri, warm=False)
    assert epochs == MEASURED_EPOCHS[("multi30k", "scratch", "bert_jam")][0] and "guess" not in why, why
    epochs, why = expected_epochs(cfg.with_overrides({"model.dropout": 0.2}), "trial", uri, warm=False)
    assert epochs == MEASURED_EPOCHS[("multi30k", "scratch", "bert_jam")][0]
    assert "they trained with model.dropout=0.1: a guess" in why, why
    # A kind measured at these very settings takes that figure as its own.
    from nmtcore.sweep.cost import MEASURED_EPOCHS_AT

    at_03 = MEASURED_EPOCHS_AT[(("model.dropout", 0.3),)][("multi30k", "scratch", "transformer")]
    control = cfg.with_overrides({"model.name": "transformer", "model.dropout": 0.3})
    epochs, why = expected_epochs(control, "trial", uri, warm=False)
    assert (epochs, True) == at_03 and at_03[0] != MEASURED_EPOCHS[("multi30k", "scratch", "transformer")][0]
    assert "on multi30k at model.dropout=0.3 took" in why and "guess" not in why, why
    # A second stage at 0.3 (the main job's arms) takes its own figure, not the guess from the runs at 0.1.
    fused = cfg.with_overrides({"model.name": "bert_fused", "model.dropout": 0.3, "train.max_epochs": 40})
    epochs, why = expected_epochs(fused, "trial", uri, warm=True)
    assert (epochs, True) == MEASURED_EPOCHS_AT[(("model.dropout", 0.3),)][("multi30k", "warm", "bert_fused")]
    assert "warm-started bert_fused runs on multi30k at model.dropout=0.3 took" in why and "guess" not in why, why
    # Another of the settings besides: no figure at exactly those, so the guess from the default settings' runs.
    epochs, why = expected_epochs(control.with_overrides({"train.lr": 5e-4}), "trial", uri, warm=False)
    assert epochs == MEASURED_EPOCHS[("multi30k", "scratch", "transformer")][0] and "a guess" in why, why


def test_a_resumed_phased_trial_is_estimated_by_what_is_left_of_its_phases(tmp_path):
    """Phases until convergence: a resumed trial has left what converged runs of its kind took in the rest of its
    current phase (at least one epoch) and in each later phase (at least patience + 1), from their ``phase``
    metric; the runs' total alone would floor a trial past it at one epoch however many phases it has left."""
    import nmtcore.sweep.cost as cost
    from nmtcore.sweep.lifecycle import ROLE_TAG
    from nmtcore.tracking.callback import STOPPED_BY_TAG

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": "minilm",
                                       "train.phases_converge": True, "train.patience": 3, "train.max_epochs": 60})

    def record(phases: list[int], finished: bool) -> str:
        tags = {ROLE_TAG: "trial", **({STOPPED_BY_TAG: "patience"} if finished else {})}
        with tracking.Tracker(uri, experiment="e", tags=tags) as t:
            t.log_params(cfg.flat())
            for e, phase in enumerate(phases, start=1):
                t.log_metrics({"epoch": e, "phase": phase}, step=e)
            t.log_metrics({"phase": phases[-1]}, step=len(phases))  # a resume logs an epoch again: counted once
        return t.run_id

    for lengths in ((23, 5, 11), (25, 7, 9), (21, 5, 13)):
        record([q + 1 for q, n in enumerate(lengths) for _ in range(n)], finished=True)
    assert cost.converged_phase_lengths(cfg, "trial", uri) == [(23, 5, 11), (25, 7, 9), (21, 5, 13)]
    running = record([1] * 29 + [2] * 11, finished=False)  # in phase 2, already past its median length
    assert cost.phase_epochs(running, uri) == (29, 11)
    assert cost.phases_left(cost.converged_phase_lengths(cfg, "trial", uri), (29, 11), 3) == 1 + 11
    assert cost.phases_left([(23, 5, 11)], (10,), 3) == 13 + 5 + 11
    assert cost.phases_left([(23, 2, 11)], (23, 1), 3) == 1 + 11  # the later phases' medians, each >= patience + 1
    assert cost.phases_left([(23, 5, 2)], (10,), 3) == 13 + 5 + 4
    # fixed phase lengths: the total decides, as before
    assert cost.converged_phase_lengths(cfg.with_overrides({"train.phases_converge": False}), "trial", uri) == []
    # a variant that skips a phase (M2: warm-up, fine-tuning) splits its epochs otherwise: three-phase runs are not its
    assert cost.converged_phase_lengths(cfg, "trial", uri, phases=2) == []
    record([1] * 30 + [2] * 12, finished=True)
    assert cost.converged_phase_lengths(cfg, "trial", uri, phases=2) == [(30, 12)]
    assert cost.converged_phase_lengths(cfg, "trial", uri, phases=3)[0] == (23, 5, 11)


def test_each_phase_is_probed_at_its_own_speed_and_a_run_s_epochs_weigh_them(tmp_path):
    """A phased model's probe times every phase that trains other parameter groups (BERT-JAM: the warm-up, the GLU
    phase, the fine-tuning that runs BERT's backward pass); a run's epoch is then the mean over its phases, each
    weighted by the epochs it takes."""
    import nmtcore.sweep.cost as cost
    from nmtcore.data import prepare_data
    from nmtcore.sweep.cost import probe
    from nmtcore.testing.zoo import TINY_BERT

    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.phase_epochs": [2, 1, 3],
                                       "train.max_epochs": 6})
    speed = probe(cfg, prepare_data(cfg.data), threads=1)
    assert len(speed.phase_tokens_per_s) == 3 and all(t > 0 for t in speed.phase_tokens_per_s)
    assert speed.phase_tokens_per_s[0] == speed.train_tokens_per_s and speed.phase_epochs == (2, 1, 3)
    # the arithmetic on constructed speeds: 1 epoch at 100 tokens/s and 3 at 25, 1000 tokens an epoch
    two = Speed(100.0, 10.0, 1, phase_tokens_per_s=(100.0, 25.0), phase_epochs=(1, 3))
    weighted = run_cost("arm", 4, "x", two, 1000, 50, 20, phase_weights=(1, 3))
    assert weighted.epoch_s == pytest.approx((1 * 10 + 3 * 40) / 4 + 5)
    assert run_cost("arm", 4, "x", two, 1000, 50, 20).epoch_s == pytest.approx(10 + 5)  # no weights: the first's
    # a resumed run in phase 2: the rest of it, then phase 3 (each later phase at least patience + 1)
    assert cost.phase_weights_left([(23, 5, 11)], (29, 11), 3) == [0.0, 1.0, 11.0]
    assert cost.phase_weights_left([(23, 5, 11)], (29, 11, 12), 3) == [0.0, 0.0, 1.0]
    assert cost.phase_weights_left([(23, 5, 11)], (29, 11, 12, 1), 3) == []


class _Steps:
    """A trainer whose first update on each batch is slow (a new shape's first kernels), later ones fast; with
    ``spin`` it computes while it waits (its CPU busy), else it sleeps (its CPU idle, as when other work has it)."""

    def __init__(self, spin: bool):
        self.seen: set[int] = set()
        self.spin = spin

    def train_step(self, group):
        import time

        wait = 0.01 if id(group) in self.seen else 0.1
        self.seen.add(id(group))
        end = time.perf_counter() + wait
        if not self.spin:
            time.sleep(wait)
        while time.perf_counter() < end:
            pass


def test_the_probe_times_updates_on_shapes_it_has_run_and_the_cpu_they_had():
    """An update on a batch shape the process has not run pays for its first kernels, which an epoch pays once
    per shape: the probe times a second pass over its batches, not the first. The share of its cores the timed
    pass had says whether other work shared the machine."""
    from types import SimpleNamespace

    from nmtcore.sweep.cost import _train_speed

    groups = [[SimpleNamespace(n_tgt_tokens=10)] for _ in range(4)]
    tps, busy = _train_speed(_Steps(spin=True), groups, threads=1)
    assert tps > 3 * 10 / 0.1  # updates of 10 tokens at 10 ms each, not at the first pass's 100 ms
    _, idle = _train_speed(_Steps(spin=False), groups, threads=1)
    assert idle < 0.2 and busy > 3 * idle  # (how near 1 the busy share comes depends on what else runs here)


def test_the_estimate_names_the_load_and_says_when_its_probes_shared_the_machine():
    base = RunCost("baseline", 10, 60.0, 5.0, "the budget")
    quiet = dataclasses.replace(estimate([], base, False, [], 1, "CPU, 2 cores"), cpu_share=0.95, load=0.12)
    assert quiet.lines()[0] == "estimated cost on this machine (CPU, 2 cores, load 0.12):"
    busy = dataclasses.replace(quiet, cpu_share=0.45, load=2.9)
    assert "load 2.90" in busy.lines()[0] and "a probe had 45% of its cores" in busy.lines()[0]
    assert len(busy.lines()) == len(quiet.lines())  # the same phases, one line each
    assert busy.to_dict()["cpu_share"] == 0.45


def test_the_probe_decodes_as_long_as_a_translation_runs_not_to_the_length_cap(tmp_path, monkeypatch):
    """A barely trained model rarely emits EOS, so the probe's greedy decode is capped at each source's length
    (about where a trained model stops), not at the length cap that a validation decode never reaches."""
    from nmtcore.data import prepare_data
    from nmtcore.engine.trainer import Trainer

    cfg = tiny_experiment(tmp_path)
    seen, translate = [], Trainer.translate
    monkeypatch.setattr(Trainer, "translate", lambda self, split, dcfg, *a, **kw: seen.append(dcfg) or translate(
        self, split, dcfg, *a, **kw))
    speed = probe(cfg, prepare_data(cfg.data), threads=1)
    assert speed.decode_sentences_per_s > 0 and 0 < speed.cpu_share <= 1
    assert seen and all((d.beam, d.max_len_a, d.max_len_b) == (1, 1.0, 1) for d in seen)


def test_a_batch_s_token_fill_counts_both_sides_with_their_eos():
    from types import SimpleNamespace

    import numpy as np

    from nmtcore.sweep.cost import token_fill

    split = SimpleNamespace(src_lens=np.array([1, 3, 5]), tgt_lens=np.array([2, 2, 4]))
    assert token_fill(split, [np.array([0, 1])]) == pytest.approx(12 / 14)  # (2 + 4) + (3 + 3) of 2 x (4 + 3)
    assert token_fill(split, [np.array([0, 1]), np.array([2])]) == pytest.approx((12 + 11) / (14 + 11))


def test_the_probe_s_speed_is_the_full_epoch_s_batches_speed(tmp_path, monkeypatch):
    """The probe's few batches come from a small pool of the training split, with more padding than an epoch's
    batches over all of it: the tokens/s it measures are scaled by the two fills."""
    from nmtcore.data import batch_indices, prepare_data
    from nmtcore.sweep import cost

    seen = []

    def fake_speed(trainer, groups, threads):
        seen.append([b.ids.numpy() for g in groups for b in g])
        return 1000.0, 1.0

    monkeypatch.setattr(cost, "_train_speed", fake_speed)
    monkeypatch.setattr(cost, "PROBE_STEPS", 2)
    cfg = tiny_experiment(tmp_path, **{"data.max_tokens": 64})
    data = prepare_data(cfg.data)
    train = data.splits[cfg.data.train_split]
    speed = cost.probe(cfg, data, threads=1)
    epoch = batch_indices(train.src_lens, train.tgt_lens, 64, seed=cfg.train.seed)
    fuller = cost.token_fill(train, epoch) / cost.token_fill(train, seen[0])
    assert speed.train_tokens_per_s == pytest.approx(1000.0 * fuller)
    assert fuller != pytest.approx(1.0)  # the tiny task's pool is a prefix of ~ (PROBE_STEPS + 1) batches
