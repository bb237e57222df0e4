"""Phases are data (BERT-JAM Section 2.4): the trainer reads a schedule, honours it or refuses it (a budget
shorter than the schedule is an error; ``train.phase_scale`` scales it explicitly), freezes exactly the
documented parameter groups, resets the optimizer at a phase change while the LR counter carries over, stops
early only in a phase that asks for it, records where each phase began and why the last one stopped,
averages checkpoints within the last phase, and resumes across a phase boundary."""

from __future__ import annotations

import pytest
import torch

from nmtcore.config import ConfigError, ExperimentConfig, PhaseConfig, TrainConfig
from nmtcore.config.sections import scale_phases
from nmtcore.engine import Callback, build_trainer
from nmtcore.engine.phases import apply_phase, phase_index, phase_start, schedule_length, schedule_of
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


# ---------------------------------------------------------------------- honoured or refused
def test_a_budget_shorter_than_the_schedule_is_refused_naming_both_numbers():
    phases = (PhaseConfig("a", 2), PhaseConfig("b", 1), PhaseConfig("c", 3))
    with pytest.raises(ConfigError) as e:
        TrainConfig(phases=phases, max_epochs=4)
    msg = str(e.value)
    assert msg.startswith("train.max_epochs: 4 epochs cannot run the 6-epoch phase schedule of train.phases")
    assert "set train.max_epochs >= 6" in msg and "train.phase_scale=" in msg and "\n" not in msg
    TrainConfig(phases=phases, max_epochs=6)  # fits exactly
    TrainConfig(phases=phases, max_epochs=9)  # longer: the run ends with the schedule
    # An open-ended last phase needs at least one epoch after the closed ones.
    with pytest.raises(ConfigError, match=r"^train.max_epochs: 3 epochs cannot run the 4-epoch"):
        TrainConfig(phases=phases[:2] + (PhaseConfig("c", 0),), max_epochs=3)
    # More phases than epochs: no scale helps (every phase keeps >= 1 epoch), so none is suggested.
    with pytest.raises(ConfigError) as e:
        TrainConfig(phases=phases, max_epochs=2)
    assert "phase_scale" not in str(e.value)


def test_the_suggested_scale_fits():
    phases = (PhaseConfig("warmup", 40), PhaseConfig("glu", 10), PhaseConfig("finetune", 10))
    for budget in (3, 7, 10, 12, 25):
        with pytest.raises(ConfigError) as e:
            TrainConfig(phases=phases, max_epochs=budget)
        scale = float(str(e.value).split("train.phase_scale=")[1].split()[0])
        cfg = TrainConfig(phases=phases, max_epochs=budget, phase_scale=scale)  # accepted
        assert sum(p.epochs for p in scale_phases(cfg.phases, scale)) <= budget


def test_phase_scale_multiplies_every_phase_rounded_at_least_one():
    phases = (PhaseConfig("warmup", 40), PhaseConfig("glu", 10), PhaseConfig("finetune", 10))
    assert [p.epochs for p in scale_phases(phases, 0.2)] == [8, 2, 2]
    assert [p.epochs for p in scale_phases(phases, 0.25)] == [10, 3, 3]  # half up, not banker's rounding
    assert [p.epochs for p in scale_phases(phases, 0.01)] == [1, 1, 1]  # never below one epoch
    assert scale_phases(phases, 1.0) is phases
    assert [p.epochs for p in scale_phases(phases[:2] + (PhaseConfig("c", 0),), 0.5)] == [20, 5, 0]  # open stays
    assert [(p.trainable, p.glu_scale, p.early_stop) for p in scale_phases(phases, 0.2)] == [
        (p.trainable, p.glu_scale, p.early_stop) for p in phases]
    with pytest.raises(ConfigError, match=r"^train.phase_scale: must be > 0"):
        TrainConfig(phase_scale=0.0)
    # The scaled schedule must fit the budget; the unscaled one need not.
    TrainConfig(phases=phases, max_epochs=12, phase_scale=0.2)
    with pytest.raises(ConfigError, match=r"scaled by train.phase_scale=0.25 to warmup 10 \+ glu 3 \+ finetune 3"):
        TrainConfig(phases=phases, max_epochs=12, phase_scale=0.25)


@pytest.mark.parametrize("name, scaled", [("bert_jam", [8, 2, 2]), ("bert_jam_m2", [10, 2]), ("bert_jam_m3", [10, 2])])
def test_the_models_own_schedule_is_scaled_or_refused(name, scaled):
    """BERT-JAM's default 40/10/10 (M2: 50/10, M3: 50/10) cannot run in 12 epochs: refused, naming the model and
    both numbers; with train.phase_scale=0.2 every phase runs, scaled."""
    model = jam(name)
    cfg = ExperimentConfig.from_dict({"model": {"name": name, **TINY, "bert": TINY_BERT}, "train": {"max_epochs": 12}})
    with pytest.raises(ConfigError, match=rf"^train.max_epochs: 12 epochs cannot run the 60-epoch phase schedule "
                                          rf"of model {name}'s default schedule"):
        schedule_of(cfg, model)
    phases = schedule_of(cfg.with_overrides({"train.phase_scale": 0.2}), model)
    assert [p.epochs for p in phases] == scaled
    assert [p.name for p in phases] == [p.name for p in model.default_phases()]


def test_the_trainer_refuses_before_training_and_max_updates_cannot_cut_either(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "train.max_epochs": 5,
                                       "train.num_threads": 1})
    with pytest.raises(ConfigError, match=r"^train.max_epochs: 5 epochs cannot run the 60-epoch"):
        make_trainer(cfg)  # model bert_jam's own 40/10/10
    ok = cfg.with_overrides({"model.phase_epochs": [1, 1, 1]})
    per_epoch = make_trainer(ok).updates_per_epoch()
    with pytest.raises(ConfigError, match=rf"^train.max_updates: 5 updates cannot run the 3-epoch phase schedule "
                                          rf".*{per_epoch} updates per epoch = {3 * per_epoch} updates"):
        make_trainer(ok.with_overrides({"train.max_updates": 5}))
    make_trainer(ok.with_overrides({"train.max_updates": 3 * per_epoch}))


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
    cfg = tiny_experiment(tmp_path, **{"train.phases": PHASES, "train.max_epochs": 5, "train.average_last": 3,
                                       "train.num_threads": 1, "data.max_tokens": 2000})
    trainer = make_trainer(cfg)
    seen = []
    trainer.model.set_phase = lambda phase: seen.append(phase.name)  # the generic hook
    trainer.enter_phase(0)
    opt_before = trainer.optimizer
    summary = trainer.fit()
    assert summary.epochs == 3 and summary.stop_reason == "end_of_schedule"  # schedule < max_epochs
    assert summary.schedule == {"one": 1, "two": 2} and summary.phase_starts == {"one": 1, "two": 2}
    assert seen == ["one", "two"]
    assert trainer.optimizer is not opt_before  # rebuilt at the phase change (state reset)
    ups = [h["num_updates"] for h in trainer.state.history]
    assert ups[0] < ups[1] < ups[2]  # the update counter (LR schedule) carries over
    assert [h["phase"] for h in trainer.state.history] == [1.0, 2.0, 2.0]
    # averaging asks for the last 3 epochs but stays inside the last phase (epochs 2-3): phase one is left out
    assert "epoch2.pt" in trainer.finalize_model() and "epoch1.pt" not in trainer.finalize_model()


def test_a_scaled_schedule_runs_every_phase_and_is_recorded(tmp_path):
    phases = [{**PHASES[0], "epochs": 4}, {**PHASES[1], "epochs": 4}]  # 8 epochs, run at phase_scale 0.25: 1 + 1
    cfg = tiny_experiment(tmp_path, **{"train.phases": phases, "train.max_epochs": 2, "train.phase_scale": 0.25,
                                       "train.num_threads": 1, "data.max_tokens": 2000})
    summary = make_trainer(cfg).fit()
    assert summary.epochs == 2 and summary.stop_reason == "end_of_schedule"
    assert summary.schedule == {"one": 1, "two": 1} and summary.phase_scale == 0.25
    assert summary.phase_starts == {"one": 1, "two": 2}


class ScriptedValidation:
    """Stand-ins for an epoch's training (nothing trained) and validation (``losses`` in order): the
    trainer's stopping logic on a known validation curve."""

    def __init__(self, trainer, losses, updates_per_epoch=10):
        self.losses = iter(losses)

        def epoch_of_updates(epoch):
            trainer.state.num_updates += updates_per_epoch  # as training would: the warm-up runs out
            return {"num_updates": float(trainer.state.num_updates)}

        trainer.train_epoch = epoch_of_updates
        trainer.validate = lambda: {"valid_loss": next(self.losses)}


def test_phase_three_early_stopping_fires_on_a_plateau_and_only_there(tmp_path):
    """BERT-JAM's own schedule (phase_epochs 2/1/5, patience 1): a plateau in the warm-up (no early stop there)
    does not stop the run; the first epoch of the fine-tuning phase that fails to improve does."""
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.phase_epochs": [2, 1, 5],
                                       "train.max_epochs": 8, "train.patience": 1, "train.num_threads": 1,
                                       # the warm-up ends in epoch 1: epochs inside it never count against patience
                                       "train.warmup_updates": 5})
    trainer = make_trainer(cfg)
    assert [p.early_stop for p in trainer.phases] == [False, False, True]
    ScriptedValidation(trainer, [3.0, 3.0, 2.5, 2.4, 2.4, 2.0, 2.0, 2.0])  # plateau at 2 and at 5
    summary = trainer.fit()
    assert summary.stop_reason == "early_stopping(patience=1)" and summary.epochs == 5
    assert summary.phase == "finetune" and summary.phase_starts == {"warmup": 1, "glu": 3, "finetune": 4}
    assert summary.best_epoch == 4  # "best" restarts with each phase
    # Without a plateau the fine-tuning phase runs to the end of the schedule.
    trainer = make_trainer(cfg.with_overrides({"output_dir": str(tmp_path / "b")}))
    ScriptedValidation(trainer, [3.0, 3.0, 2.5, 2.4, 2.3, 2.2, 2.1, 2.0])
    summary = trainer.fit()
    assert summary.stop_reason == "end_of_schedule" and summary.epochs == 8


class InterruptAfter(Callback):
    """Interrupts training (as Ctrl-C or a preempted node would) after epoch ``n``'s checkpoint is written."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
        if epoch == self.n:
            raise KeyboardInterrupt


def test_resume_across_a_phase_boundary_is_bit_identical(tmp_path):
    cfg = tiny_experiment(tmp_path / "a", **{"train.phases": PHASES, "train.max_epochs": 3,
                                             "train.num_threads": 1, "data.max_tokens": 2000})
    full = make_trainer(cfg)
    full.fit()
    cut_cfg = cfg.with_overrides({"output_dir": str(tmp_path / "b")})
    cut = build_trainer(cut_cfg, callbacks=[InterruptAfter(1)], device=torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    resumed = make_trainer(cut_cfg)
    torch.manual_seed(999)  # the resume restores the RNG itself
    assert resumed.resume() and resumed.phase_index == 0 and resumed.state.epoch == 1
    summary = resumed.fit()
    assert resumed.phase_index == 1 and summary.epochs == 3 and summary.phase_starts == {"one": 1, "two": 2}
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k


# ---------------------------------------------------------------------- phases until convergence
def test_phases_until_convergence_need_the_rule_and_room_for_it():
    phases = (PhaseConfig("a", 2), PhaseConfig("b", 1), PhaseConfig("c", 3))
    with pytest.raises(ConfigError, match=r"^train.phases_converge: .*set train.patience > 0"):
        TrainConfig(phases=phases, max_epochs=20, phases_converge=True)
    with pytest.raises(ConfigError, match=r"^train.phase_scale: .*leave it at 1"):
        TrainConfig(phases=phases, max_epochs=20, patience=2, phases_converge=True, phase_scale=0.5)
    with pytest.raises(ConfigError) as e:  # each phase takes at least patience + 1 epochs
        TrainConfig(phases=phases, max_epochs=8, patience=2, phases_converge=True)
    assert str(e.value).startswith("train.max_epochs: 8 epochs cannot run the 3 phases of train.phases until "
                                   "convergence (a open + b open + c open") and "max_epochs >= 9" in str(e.value)
    tc = TrainConfig(phases=phases, max_epochs=9, patience=2, phases_converge=True)
    # the phases' lengths no longer apply: every phase is open, the rule ends it
    assert [p.epochs for p in tc.schedule(tc.phases, "train.phases")] == [0, 0, 0]
    # a schedule too long for the budget at its fixed lengths is fine until convergence
    TrainConfig(phases=(PhaseConfig("a", 40), PhaseConfig("b", 10)), max_epochs=12, patience=1, phases_converge=True)


def test_each_phase_runs_until_the_rule_fires_in_it_then_the_next_begins(tmp_path):
    """BERT-JAM's "until convergence in the first two phases" (Section 3): with train.phases_converge the
    patience rule, counted from each phase's start, ends the warm-up and the GLU phase (the next one begins)
    and ends the run in the fine-tuning phase; each phase trains exactly its groups."""
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_jam", "model.bert.name": TINY_BERT["name"],
                                       "model.d_model": 32, "model.ffn_dim": 64, "model.phase_epochs": [2, 1, 5],
                                       "train.max_epochs": 20, "train.patience": 1, "train.num_threads": 1,
                                       "train.phases_converge": True, "train.warmup_updates": 5})
    trainer = make_trainer(cfg)
    assert [p.epochs for p in trainer.phases] == [0, 0, 0]
    trained: list[tuple[str, bool]] = []

    class Watch(Callback):
        def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
            trained.append((trainer.phases[trainer.phase_index].name, trainer.model.bert.frozen))

    trainer.callbacks.append(Watch())
    # warm-up: better, better, worse (the rule fires); GLU: better, worse; fine-tuning: better, better, worse
    ScriptedValidation(trainer, [3.0, 2.5, 2.6, 2.4, 2.45, 2.3, 2.2, 2.25, 1.0])
    summary = trainer.fit()
    assert summary.stop_reason == "early_stopping(patience=1)" and summary.epochs == 8
    assert summary.stopped_by == "patience"  # converged: every phase ended by the rule
    assert summary.phase_starts == {"warmup": 1, "glu": 4, "finetune": 6}
    assert [name for name, _ in trained] == ["warmup"] * 3 + ["glu"] * 2 + ["finetune"] * 3
    assert [frozen for _, frozen in trained] == [True] * 5 + [False] * 3  # BERT fine-tuned in phase 3 only
    assert summary.best_epoch == 7  # the last phase's best
    # The cap stops a run still converging: stopped by the cap, not converged.
    capped = make_trainer(cfg.with_overrides({"output_dir": str(tmp_path / "b"), "train.max_epochs": 6}))
    ScriptedValidation(capped, [3.0, 2.5, 2.4, 2.3, 2.2, 2.1])
    summary = capped.fit()
    assert summary.epochs == 6 and summary.stopped_by == "cap" and summary.phase == "warmup"


def test_resume_across_a_converged_phase_boundary_is_bit_identical(tmp_path):
    """A run stopped right after the epoch whose rule ended phase one resumes into phase two, as the run that
    was never stopped went on (min_delta so large that each phase's second epoch is its last)."""
    cfg = tiny_experiment(tmp_path / "a", **{"train.phases": PHASES, "train.max_epochs": 6, "train.patience": 1,
                                             "train.min_delta": 100.0, "train.phases_converge": True,
                                             "train.warmup_updates": 1, "train.num_threads": 1,
                                             "data.max_tokens": 2000})
    full = make_trainer(cfg)
    summary = full.fit()
    assert summary.epochs == 4 and summary.phase_starts == {"one": 1, "two": 3}
    cut_cfg = cfg.with_overrides({"output_dir": str(tmp_path / "b")})
    cut = build_trainer(cut_cfg, callbacks=[InterruptAfter(2)], device=torch.device("cpu"))
    with pytest.raises(KeyboardInterrupt):
        cut.fit()
    resumed = make_trainer(cut_cfg)
    torch.manual_seed(999)  # the resume restores the RNG itself
    assert resumed.resume() and resumed.phase_index == 0 and resumed.state.epoch == 2
    summary = resumed.fit()
    assert summary.epochs == 4 and summary.phase_starts == {"one": 1, "two": 3}
    assert summary.stop_reason == "early_stopping(patience=1)"
    for (k, a), b in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), k
