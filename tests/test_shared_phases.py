"""Phases that runs share, trained once (nmtcore.engine.shared_phases): BERT-JAM's M0, M1 and M2 warm up alike,
so M2 may start where M0's warm-up ended, and that start gives M2 the model it would have trained itself."""

from __future__ import annotations

import json

import pytest
import torch

from nmtcore.config import ExperimentConfig
from nmtcore.engine import Callback, PhaseShare, build_trainer
from nmtcore.engine.shared_phases import context_config
from nmtcore.models import build_model
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.zoo import BOS, CASES, EOS, PAD, TINY, TINY_BERT, VOCAB, tiny_model
from tests.test_phases import InterruptAfter


def jam(name: str, **fields):
    torch.manual_seed(0)
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, "bert": TINY_BERT, **fields}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


def first(model, n: int = 1) -> dict:
    return model.prefix_signature(model.default_phases()[:n])


def open_ended(signature: dict) -> dict:
    return {**signature, "phases": [{**p, "epochs": 0} for p in signature["phases"]]}


def test_m0_m1_m2_warm_ups_sign_alike_and_nothing_else_does():
    m0, m1, m2, m3 = jam("bert_jam"), jam("bert_jam_m1"), jam("bert_jam_m2"), jam("bert_jam_m3")
    assert first(m0) == first(m1)
    # M2's warm-up takes the GLU phase's epochs too (50 against 40): alike only where phases run until convergence,
    # which is where the trainer's key leaves their lengths out
    assert first(m2) != first(m0)
    assert open_ended(first(m2)) == open_ended(first(m0))
    assert first(m0)["phases"][0]["bert_memory_factor"] == 1.0  # 2 · σ(0): the gated GLU passes B_L
    assert first(m3) != first(m0)  # M3 has no warm-up: its first phase trains the GLU
    assert first(m0, 2) != first(m1, 2)  # the GLU phase: a gate against a weighted sum
    # anything else that changes the warm-up's computation keeps the runs apart
    assert first(jam("bert_jam", dropout=0.3)) != first(m0)
    assert first(jam("bert_jam", bert={**TINY_BERT, "dropout_when_frozen": True})) != first(m0)
    # the gated GLU at scale 1 in its first phase passes B_L / 2: not M1's warm-up
    halved = m0.prefix_signature((m0.default_phases()[0].__class__("warmup", 40, ("nmt",), glu_scale=1.0),))
    assert halved != first(m1)
    # another family keeps the default: its whole config, name included
    assert tiny_model("transformer").prefix_signature(())["model"]["name"] == "transformer"


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_registered_model_signs_its_first_phase_as_plain_data(case):
    """The shared contract: every model of the zoo gives a signature of its first phase (none: the empty prefix)
    that the key can hash, the same twice."""
    model = tiny_model(case)
    prefix = tuple(model.default_phases())[:1]
    sig = model.prefix_signature(prefix)
    assert set(sig) == {"model", "phases"} and len(sig["phases"]) == len(prefix)
    assert json.dumps(sig, sort_keys=True, default=repr) == json.dumps(model.prefix_signature(prefix), sort_keys=True,
                                                                       default=repr)


def test_the_context_leaves_the_model_and_the_schedule_to_the_signature():
    flat = {"model.name": "bert_jam", "model.dropout": 0.3, "train.phases": (), "train.max_epochs": 60,
            "train.average_last": 6, "train.seed": 1, "train.lr": 1e-3, "data.max_tokens": 4096}
    assert context_config(flat) == {"train.seed": 1, "train.lr": 1e-3, "data.max_tokens": 4096}


class Trained(Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
        self.epochs.append(epoch)


def jam_run(tmp_path, name: str, out: str, **over):
    """A tiny BERT-JAM variant whose phases run until convergence, each two epochs long (min_delta so large that no
    epoch after a phase's first gains)."""
    return tiny_experiment(tmp_path, **{"model.name": name, "model.bert.name": TINY_BERT["name"], "model.d_model": 32,
                                        "model.ffn_dim": 64, "model.dropout": 0.1, "train.phases_converge": True,
                                        "train.patience": 1, "train.min_delta": 100.0, "train.max_epochs": 6,
                                        "train.warmup_updates": 1, "train.num_threads": 1, "data.max_tokens": 2000,
                                        "output_dir": str(tmp_path / out), **over})


def test_m2_started_from_m0_s_warm_up_is_the_m2_that_trains_it_itself(tmp_path):
    share = PhaseShare(store=tmp_path / "phase-ends", context="one data set, one code", owner="M0 (run 0)",
                       ignore=("model.bert.activation_checkpointing",))
    # M0 trains its warm-up (two epochs) and keeps its end when its GLU phase begins (stopped in that phase).
    m0 = build_trainer(jam_run(tmp_path, "bert_jam", "m0"), callbacks=[InterruptAfter(3)], device=torch.device("cpu"))
    assert not m0.start_shared(share)  # nothing kept yet
    with pytest.raises(KeyboardInterrupt):
        m0.fit()
    kept = sorted(share.store.glob("*.pt"))
    assert len(kept) == 1
    meta = json.loads(kept[0].with_suffix(".json").read_text())
    assert meta["phases"] == ["warmup"] and meta["epoch"] == 2 and meta["owner"] == "M0 (run 0)"
    assert "optimizer" not in torch.load(kept[0], weights_only=True)

    # M2 from scratch, without a share, and M2 started from M0's warm-up: one model, bit for bit.
    alone = build_trainer(jam_run(tmp_path, "bert_jam_m2", "m2-alone"), device=torch.device("cpu"))
    summary_alone = alone.fit()
    trained = Trained()
    shared = build_trainer(jam_run(tmp_path, "bert_jam_m2", "m2-shared"), callbacks=[trained],
                           device=torch.device("cpu"))
    torch.manual_seed(999)  # the start restores the RNG itself
    assert shared.start_shared(share)
    assert shared.shared_start.phases == ("warmup",) and shared.shared_start.epoch == 2
    assert shared.shared_start.describe() == "phase 'warmup' (epochs 1-2) from M0 (run 0)"
    summary = shared.fit()
    assert trained.epochs == [3, 4]  # only its own phase: the fine-tuning
    assert summary.phase_starts == summary_alone.phase_starts == {"warmup": 1, "finetune": 3}
    assert [h["valid_loss"] for h in shared.state.history] == [h["valid_loss"] for h in alone.state.history]
    for (k, a), b in zip(alone.model.state_dict().items(), shared.model.state_dict().values()):
        assert torch.equal(a, b), k

    # Not shared: another dropout, and M3 (no warm-up); a budget that would stop inside the warm-up.
    for name, over in (("bert_jam_m2", {"model.dropout": 0.2}), ("bert_jam_m3", {})):
        other = build_trainer(jam_run(tmp_path, name, f"other-{name}", **over), device=torch.device("cpu"))
        assert not other.start_shared(share) and other.state.epoch == 0
    m1 = jam_run(tmp_path, "bert_jam_m1", "m1")
    assert build_trainer(m1, device=torch.device("cpu")).start_shared(share)
    # a setting the share ignores (it decides speed, not results) keeps the start
    speed = not m1.model.bert.activation_checkpointing
    assert build_trainer(m1.with_overrides({"model.bert.activation_checkpointing": speed,
                                            "output_dir": str(tmp_path / "m1c")}),
                         device=torch.device("cpu")).start_shared(share)
    capped = build_trainer(m1.with_overrides({"train.max_updates": 1, "output_dir": str(tmp_path / "m1b")}),
                           device=torch.device("cpu"))
    assert not capped.start_shared(share)


@pytest.mark.slow  # a Ray sweep of two trials (the trainer-level test above is in the fast suite)
def test_a_sweep_s_m2_trial_starts_from_its_m0_trial_s_warm_up_and_says_so(ray_cluster, store, tmp_path, capsys):
    from nmtcore.sweep import driver
    from nmtcore.testing.sweeps import runs_of, tiny_base, tiny_settings
    from nmtcore.tracking import schema
    from search_spaces import SearchSpace, grid

    over = {"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"], "model.d_model": 32, "model.ffn_dim": 64,
            "train.phases_converge": True, "train.patience": 1, "train.min_delta": 100.0, "train.max_epochs": 6,
            "train.warmup_updates": 1, "data.max_tokens": 2000}
    space = SearchSpace("shared", "m0-m2", "bert_jam", params={"model.name": grid(("bert_jam", "bert_jam_m2"))})
    settings = tiny_settings(tmp_path, "shared-phases", store, reuse_trials=True, max_concurrent=1)
    assert not driver.run_sweep(space, tiny_base(tmp_path, **over), settings, log_to_driver=False).interrupted
    _, runs = runs_of("shared-phases", store)
    by = {r.params["model.name"]: r for r in runs}
    m0, m2 = by["bert_jam"], by["bert_jam_m2"]
    assert schema.SHARED_PHASES not in m0.tags
    assert m2.tags[schema.SHARED_PHASES] == (f"phase 'warmup' (epochs 1-2) from {m0.run_name} (run "
                                             f"{m0.run_id}) of sweep shared-phases")
    # Its record is whole: the warm-up's epochs are M0's, its own phase follows; its cost leaves M0's epochs out.
    m0_valid = [v for _, v in tracking_metrics(m0, store)["valid_loss"]]
    m2_valid = tracking_metrics(m2, store)["valid_loss"]
    assert [step for step, _ in m2_valid] == [1, 2, 3, 4] and [v for _, v in m2_valid][:2] == m0_valid[:2]
    assert m2.metrics["cost/shared_phases_s"] > 0 and "cost/earlier_attempts_s" not in m2.metrics
    kept = list((tmp_path / "ray_results" / "phase-ends").glob("*.pt"))
    assert len(kept) == 2  # M0's warm-up and its GLU phase (M2's warm-up is M0's: not kept twice)
    out = capsys.readouterr().out
    assert out.count("starts where another trial's phases ended, not trained again: phase 'warmup'") == 1
    table = (tmp_path / "report" / "table.md").read_text()
    assert "Started where another trial's first phases ended" in table and m0.run_id in table


def tracking_metrics(run, store):
    from nmtcore import tracking

    return tracking.get_run_metrics(run.run_id, store)


def test_the_cost_estimate_keys_a_trial_s_phases_as_the_trainer_keeps_them(tmp_path):
    """The dry run matches trials on the keys their trainers will keep, computed from their configs before any
    of them trains (a model built, never trained): M0's and M2's warm-ups one key, M3 none of theirs."""
    from nmtcore.data import prepare_data
    from nmtcore.sweep import reuse
    from nmtcore.sweep.cost import phase_keys
    from nmtcore.sweep.plan import trial_config

    store = tmp_path / "phase-ends"
    m0 = jam_run(tmp_path, "bert_jam", "m0")
    data = prepare_data(m0.data)
    keys = {name: phase_keys(m0.with_overrides({"model.name": name}), data, str(store))
            for name in ("bert_jam", "bert_jam_m2", "bert_jam_m3")}
    assert len(keys["bert_jam"][0]) == 2 and keys["bert_jam"][1] == (0, 0)  # warm-up, warm-up + GLU; none stored
    assert keys["bert_jam_m2"][0] == keys["bert_jam"][0][:1]
    assert not set(keys["bert_jam_m3"][0]) & set(keys["bert_jam"][0])
    assert phase_keys(m0.with_overrides({"model.name": "transformer"}), data, str(store)) is None  # one phase
    # what a trial's trainer keys, with the config the sweep gives it (its own output directory and threads)
    trial = trial_config(m0, {}, tmp_path / "scratch" / "t", threads=2)
    share = PhaseShare(store=store, context=reuse.phase_context(trial, data.checksums), ignore=reuse.NOT_RESULTS)
    trainer = build_trainer(trial, data, device=torch.device("cpu"))
    from nmtcore.engine.shared_phases import prefix_key
    assert tuple(prefix_key(trainer, share, k) for k in range(2)) == keys["bert_jam"][0]
    # a kept phase end is found by its key, with its epochs
    store.mkdir()
    (store / f"{keys['bert_jam'][0][0]}.pt").write_bytes(b"")
    (store / f"{keys['bert_jam'][0][0]}.json").write_text(json.dumps({"epoch": 23}))
    assert phase_keys(m0, data, str(store))[1] == (23, 0)
