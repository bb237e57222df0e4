"""Phases are data (BERT-JAM Section 2.4): the trainer reads a schedule, freezes exactly the documented
parameter groups, resets the optimizer at a phase change while the LR counter carries over, restricts early
stopping and checkpoint averaging to their phase, and resumes across a phase boundary."""

from __future__ import annotations

import pytest
import torch

from nmtcore.config import ConfigError, ExperimentConfig, PhaseConfig, TrainConfig
from nmtcore.engine import build_trainer
from nmtcore.engine.phases import apply_phase, phase_index, phase_start, schedule_length
from nmtcore.models import build_model
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.zoo import BOS, EOS, PAD, TINY, TINY_BERT, VOCAB


def jam(name: str = "bert_jam"):
    torch.manual_seed(0)
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, "bert": TINY_BERT}})
    return build_model(cfg.model, VOCAB, PAD, BOS, EOS)


def n_trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_phase_config_is_validated():
    with pytest.raises(ConfigError, match=r"^train.phases: only the last phase may be open-ended"):
        TrainConfig(phases=(PhaseConfig("a", 0), PhaseConfig("b", 1)))
    with pytest.raises(ConfigError, match=r"^train.phases: phase names must be unique"):
        TrainConfig(phases=(PhaseConfig("a", 1), PhaseConfig("a", 1)))
    with pytest.raises(ConfigError, match=r"trainable"):
        PhaseConfig("a", 1, ())


def test_schedule_arithmetic():
    phases = (PhaseConfig("a", 2), PhaseConfig("b", 1), PhaseConfig("c", 3))
    assert [phase_index(phases, e) for e in range(1, 8)] == [0, 0, 1, 2, 2, 2, 2]
    assert [phase_start(phases, i) for i in range(3)] == [1, 3, 4]
    assert schedule_length(phases) == 6
    assert schedule_length(phases[:2] + (PhaseConfig("c", 0),)) == float("inf")


@pytest.mark.parametrize("name", ["bert_jam", "bert_jam_m1", "bert_jam_m2", "bert_jam_m3"])
def test_each_phase_trains_exactly_its_parameter_groups(name):
    model = jam(name)
    groups = {k: sum(p.numel() for p in v) for k, v in model.parameter_groups().items()}
    assert groups["bert"] > 0 and groups["nmt"] > 0
    expected = {"warmup": groups["nmt"], "glu": groups["nmt"] + groups["glu"],
                "finetune": groups["nmt"] + groups["glu"] + groups["bert"]}
    for phase in model.default_phases():
        counts = apply_phase(model, phase)
        assert n_trainable(model) == expected[phase.name], phase.name
        assert sum(counts.values()) == expected[phase.name]
        assert model.bert.frozen == ("bert" not in phase.trainable)  # frozen → the feature cache serves it
        assert model.glu_scale.item() == phase.glu_scale


def test_unknown_group_is_a_config_error():
    with pytest.raises(ConfigError, match=r"unknown parameter group\(s\) \['decoder'\]"):
        apply_phase(jam(), PhaseConfig("x", 1, ("decoder",)))


# ---------------------------------------------------------------------- the trainer reads the schedule
PHASES = [{"name": "one", "epochs": 1, "trainable": ["nmt"], "glu_scale": 2.0},
          {"name": "two", "epochs": 2, "trainable": ["nmt"], "early_stop": True}]


def make_trainer(cfg):
    return build_trainer(cfg, device=torch.device("cpu"))


def test_trainer_switches_phases_resets_optimizer_and_keeps_lr_counter(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.phases": PHASES, "train.max_epochs": 5, "train.average_last": 2,
                                       "train.num_threads": 1, "data.max_tokens": 2000})
    trainer = make_trainer(cfg)
    seen = []
    trainer.model.set_phase = lambda phase: seen.append(phase.name)  # the generic hook
    trainer.enter_phase(0)
    opt_before = trainer.optimizer
    summary = trainer.fit()
    assert summary.epochs == 3 and summary.stop_reason == "end_of_schedule"  # schedule < max_epochs
    assert seen == ["one", "two"]
    assert trainer.optimizer is not opt_before  # rebuilt at the phase change (state reset)
    ups = [h["num_updates"] for h in trainer.state.history]
    assert ups[0] < ups[1] < ups[2]  # the update counter (LR schedule) carries over
    assert [h["phase"] for h in trainer.state.history] == [1.0, 2.0, 2.0]
    assert "epoch2.pt" in trainer.finalize_model() and "epoch1.pt" not in trainer.finalize_model()


def test_resume_across_a_phase_boundary_is_bit_identical(tmp_path):
    cfg = tiny_experiment(tmp_path / "a", **{"train.phases": PHASES, "train.max_epochs": 2,
                                             "train.num_threads": 1, "data.max_tokens": 2000})
    full = make_trainer(cfg)
    full.fit()
    cut = make_trainer(cfg.with_overrides({"output_dir": str(tmp_path / "b"), "train.max_epochs": 1}))
    cut.fit()
    resumed = make_trainer(cfg.with_overrides({"output_dir": str(tmp_path / "b")}))
    assert resumed.resume() and resumed.phase_index == 0
    resumed.fit()
    assert resumed.phase_index == 1
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
