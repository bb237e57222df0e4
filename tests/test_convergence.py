"""Convergence as a budget: the patience rule, which rule stopped a run, the papers' second stage after a warm
start, and the diagnostics of how much a fused model used BERT."""

from __future__ import annotations

import math

import pytest
import torch

from nmtcore import bleu
from nmtcore.config import ConfigError, DecodeConfig, TrainConfig
from nmtcore.diagnostics import measure
from nmtcore.engine import Callback, build_trainer, run_experiment
from nmtcore.engine.stopping import StopRule, stopped_by
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.tiny_bert import tiny_bert_dir


# ---------------------------------------------------------------------- the rule itself
def test_the_rule_counts_epochs_without_a_gain_above_the_minimum():
    bleu_rule = StopRule("valid_bleu", patience=2, min_delta=0.1)
    assert bleu_rule.improves(30.0, bleu_rule.worst)
    assert bleu_rule.improves(30.2, 30.0) and not bleu_rule.improves(30.05, 30.0) and not bleu_rule.improves(29.0, 30.0)
    loss_rule = StopRule("valid_loss", patience=2, min_delta=0.01)
    assert loss_rule.improves(4.0, 4.02) and not loss_rule.improves(4.0, 4.005) and not loss_rule.improves(4.1, 4.0)
    assert not bleu_rule.fired(1) and bleu_rule.fired(2)
    assert not StopRule("valid_bleu", patience=0, min_delta=0.0).fired(100)  # 0 = off


def test_stopped_by_names_the_rule():
    assert stopped_by("early_stopping(patience=3)", rule_on=True) == "patience"
    assert stopped_by("max_epochs", rule_on=True) == "cap"
    assert stopped_by("max_updates", rule_on=True) == "cap"
    assert stopped_by("max_epochs", rule_on=False) == "schedule"
    assert stopped_by("end_of_schedule", rule_on=True) == "schedule"


def test_bad_stopping_settings_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="train.stop_metric"):
        TrainConfig(stop_metric="bleu")
    with pytest.raises(ConfigError, match="train.min_delta"):
        TrainConfig(min_delta=-0.1)
    with pytest.raises(ConfigError, match="train.min_delta"):
        TrainConfig(min_delta=math.inf)
    with pytest.raises(ConfigError, match="valid_bleu needs train.valid_bleu"):
        TrainConfig(stop_metric="valid_bleu", valid_bleu=False)


# ---------------------------------------------------------------------- the rule in the trainer's loop
def scripted_trainer(tmp_path, bleus, updates_per_epoch=100, losses=None, **train):
    """A real trainer whose epochs cost nothing: training is skipped (the update counter advances by
    ``updates_per_epoch``; the tiny experiment warms up over 50) and validation reads ``bleus`` (and ``losses``;
    without them the loss stays 1.0)."""
    cfg = tiny_experiment(tmp_path, **{"train.valid_bleu": True, "train.stop_metric": "valid_bleu",
                                       "train.max_epochs": len(bleus), **train})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    values, loss_values = iter(bleus), iter(losses or [1.0] * len(bleus))

    def epoch_of_updates(epoch):
        trainer.state.num_updates += updates_per_epoch
        return {"train_loss": 1.0, "num_updates": float(trainer.state.num_updates)}

    trainer.train_epoch = epoch_of_updates
    trainer.validate = lambda: {"valid_loss": next(loss_values), "valid_bleu": next(values)}
    return trainer


def test_a_plateau_stops_the_run_by_patience(tmp_path):
    plateau = [10.0, 20.0, 25.0, 25.05, 24.8, 25.09, 30.0, 31.0]  # no gain > 0.1 after epoch 3 for 3 epochs
    fit = scripted_trainer(tmp_path, plateau, **{"train.patience": 3, "train.min_delta": 0.1}).fit()
    assert (fit.epochs, fit.stopped_by, fit.converged, fit.best_epoch, fit.best_score) == (6, "patience", True, 3, 25.0)


def test_epochs_inside_the_warm_up_do_not_count_against_patience(tmp_path):
    """A restarted schedule (the papers' second stage) makes a trained model worse while its rate rises: with a
    warm-up of 350 updates (epochs 1-3 end inside it) the dip of epochs 2-3 is not counted, and the run goes on
    to its real best; counting it, patience 2 would stop at epoch 3 with epoch 1's weights."""
    dip = [30.0, 25.0, 24.0, 31.0, 30.5, 30.6, 32.0]
    fit = scripted_trainer(tmp_path, dip, **{"train.patience": 2, "train.min_delta": 0.1,
                                             "train.warmup_updates": 350}).fit()
    assert (fit.epochs, fit.stopped_by, fit.best_epoch, fit.best_score) == (6, "patience", 4, 31.0)
    short = scripted_trainer(tmp_path / "short", dip, **{"train.patience": 2, "train.min_delta": 0.1,
                                                         "train.warmup_updates": 50}).fit()
    assert (short.epochs, short.best_epoch, short.best_score) == (3, 1, 30.0)


def test_the_loss_guard_stops_only_when_bleu_and_the_loss_have_both_stalled(tmp_path):
    """Greedy BLEU that wobbles while the validation loss still falls (the run docs/convergence.md shows): BLEU's
    rule alone stops at epoch 5; with the guard, epochs 3 and 5 set new lowest losses, so the run goes on until three epochs in a row
    gain neither (6-8), and its best stays the best by BLEU."""
    bleus = [30.0, 32.0, 31.5, 31.9, 31.0, 31.8, 31.7, 31.2, 33.0]
    losses = [4.40, 4.30, 4.25, 4.26, 4.20, 4.21, 4.205, 4.199, 4.10]  # 4.199: 0.02% below 4.20, under the gain
    rule = {"train.patience": 3, "train.min_delta": 0.1}
    plain = scripted_trainer(tmp_path / "plain", bleus, losses=losses, **rule).fit()
    assert (plain.epochs, plain.stopped_by, plain.best_epoch) == (5, "patience", 2)
    guarded = scripted_trainer(tmp_path / "guarded", bleus, losses=losses, **rule, **{"train.loss_guard": True}).fit()
    assert (guarded.epochs, guarded.stopped_by, guarded.best_epoch, guarded.best_score) == (8, "patience", 2, 32.0)
    assert guarded.best_valid_loss == 4.199


def test_the_loss_guard_counts_a_recovery_from_the_restarted_warm_up_as_learning(tmp_path):
    """A control in the papers' second stage on the converged baseline (docs/convergence.md): the restarted
    warm-up (epochs 1-3 end inside it here) pushes the loss up, then it falls back while BLEU stays under epoch
    1's. Plain BLEU patience stops at epoch 6 with epoch 1's weights; the guard
    measures the fall from the warm-up's end, not from the loss of the model the stage started with, and goes on
    until the loss stalls too."""
    bleus = [35.46, 35.12, 32.98, 33.72, 34.24, 34.42, 34.9, 35.0, 34.8, 34.95, 35.1]
    losses = [4.263, 4.300, 4.432, 4.398, 4.359, 4.319, 4.300, 4.301, 4.299, 4.305, 4.310]
    rule = {"train.patience": 3, "train.min_delta": 0.1, "train.warmup_updates": 350}
    plain = scripted_trainer(tmp_path / "plain", bleus, losses=losses, **rule).fit()
    assert (plain.epochs, plain.best_epoch) == (6, 1)
    guarded = scripted_trainer(tmp_path / "guarded", bleus, losses=losses, **rule, **{"train.loss_guard": True}).fit()
    assert (guarded.epochs, guarded.stopped_by, guarded.best_epoch) == (10, "patience", 1)


def test_a_replay_of_recorded_epochs_stops_where_the_trainer_stops(tmp_path):
    """The rule replayed on a recorded history (:func:`replay`) is the trainer's: same stop, same best epoch, with
    and without the guard (the recovery curve above)."""
    from nmtcore.engine.stopping import replay

    bleus = [35.46, 35.12, 32.98, 33.72, 34.24, 34.42, 34.9, 35.0, 34.8, 34.95, 35.1]
    losses = [4.263, 4.300, 4.432, 4.398, 4.359, 4.319, 4.300, 4.301, 4.299, 4.305, 4.310]
    history = [{"valid_bleu": b, "valid_loss": loss, "num_updates": 100.0 * e}
               for e, (b, loss) in enumerate(zip(bleus, losses), start=1)]
    for guard in (False, True):
        rule = {"train.patience": 3, "train.min_delta": 0.1, "train.warmup_updates": 350, "train.loss_guard": guard}
        fit = scripted_trainer(tmp_path / str(guard), bleus, losses=losses, **rule).fit()
        replayed = replay(StopRule("valid_bleu", 3, 0.1, guard), history, warmup_updates=350)
        assert (replayed.stopped_at, replayed.best_epoch, replayed.best_score) == (fit.epochs, fit.best_epoch,
                                                                                   fit.best_score)
    assert replay(StopRule("valid_bleu", 3, 0.1), history[:5], 350).stopped_at is None  # not fired yet


def test_loss_still_falling_is_measured_from_the_warm_up_s_end():
    from nmtcore.engine.stopping import loss_still_falling

    updates = [100.0, 200.0, 300.0, 400.0, 500.0]
    assert loss_still_falling([4.2, 4.5, 4.4, 4.35, 4.3], updates, warmup_updates=250)  # below 4.35 (after 300)
    assert not loss_still_falling([4.2, 4.5, 4.4, 4.35, 4.3], updates, warmup_updates=0)  # above 4.2: all count
    assert not loss_still_falling([4.2, 4.5, 4.4, 4.3, 4.299], updates, warmup_updates=250)  # 0.02%: not a gain
    assert loss_still_falling([4.2, 4.5, 4.4, 4.35, 4.3], [math.nan] * 5, warmup_updates=250) is False  # all count
    assert loss_still_falling([4.5, 4.4], [100.0, 300.0], warmup_updates=250)  # the first epoch after it
    assert not loss_still_falling([], [], 0) and not loss_still_falling([4.0, math.nan], [1.0, 2.0], 0)


def test_the_loss_guard_survives_a_resume(tmp_path):
    """The lowest loss so far is checkpointed: a guarded run resumed after epoch 3 stops where an uninterrupted
    one does."""
    bleus, losses = [30.0, 32.0, 31.5, 31.9, 31.0, 31.8, 31.7, 31.2], [4.40, 4.30, 4.25, 4.26, 4.20, 4.21, 4.205, 4.2]
    rule = {"train.patience": 3, "train.min_delta": 0.1, "train.loss_guard": True}
    scripted_trainer(tmp_path, bleus[:3], losses=losses[:3], **rule).fit()
    again = scripted_trainer(tmp_path, bleus[3:], losses=losses[3:], **{**rule, "train.max_epochs": 8})
    assert again.resume()
    fit = again.fit()
    assert (fit.epochs, fit.stopped_by, fit.best_epoch) == (8, "patience", 2)


def test_the_loss_guard_is_refused_without_the_bleu_rule():
    with pytest.raises(ConfigError, match="train.loss_guard"):
        TrainConfig(loss_guard=True, stop_metric="valid_loss")


def test_a_run_still_rising_is_stopped_by_its_cap_not_called_converged(tmp_path):
    rising = [10.0, 12.0, 13.0, 13.5, 14.0, 14.4]
    fit = scripted_trainer(tmp_path, rising, **{"train.patience": 3, "train.min_delta": 0.1}).fit()
    assert (fit.epochs, fit.stopped_by, fit.converged, fit.best_epoch) == (6, "cap", False, 6)


def test_without_the_rule_a_run_ends_by_its_schedule(tmp_path):
    fit = scripted_trainer(tmp_path, [10.0, 10.0, 10.0, 10.0]).fit()
    assert (fit.epochs, fit.stopped_by, fit.converged) == (4, "schedule", False)


def test_the_rule_survives_a_resume(tmp_path):
    """The best score and the epochs without a gain are checkpointed: a resumed run stops where one that was
    never interrupted stops."""
    bleus = [10.0, 20.0, 20.05, 19.0, 18.0, 30.0]
    first = scripted_trainer(tmp_path, bleus[:3], **{"train.patience": 3, "train.min_delta": 0.1})
    first.fit()  # 3 epochs, one without a gain
    again = scripted_trainer(tmp_path, bleus[3:], **{"train.patience": 3, "train.min_delta": 0.1,
                                                      "train.max_epochs": 6})
    assert again.resume()
    fit = again.fit()
    assert (fit.epochs, fit.stopped_by, fit.best_epoch, fit.best_score) == (5, "patience", 2, 20.0)


# ---------------------------------------------------------------------- the papers' second stage
class LearningRates(Callback):
    def __init__(self):
        self.lrs, self.start = [], None

    def on_train_start(self, trainer):
        self.start = (trainer.state.num_updates, len(trainer.optimizer.state))

    def on_log(self, trainer, metrics):
        self.lrs.append(metrics["lr"])


def test_a_warm_started_stage_starts_at_update_zero_with_a_fresh_optimizer_and_its_warm_up(tmp_path):
    """The baseline's weights, a new optimizer and the schedule restarted: the stage's first updates take the
    configured warm-up's rates (fairseq's ``--reset-lr-scheduler``), not the baseline's last rate."""
    base = tiny_experiment(tmp_path / "base", **{"train.max_epochs": 1})
    run_experiment(base)
    checkpoint = tmp_path / "base" / "run" / "checkpoints" / "epoch1.pt"
    lrs = LearningRates()
    stage = tiny_experiment(tmp_path / "stage", **{
        "model.name": "bert_fused", "model.bert.name": tiny_bert_dir(), "train.init_from": str(checkpoint),
        "train.max_epochs": 1, "train.log_interval": 1, "train.lr": 2e-3, "train.warmup_updates": 20,
        "train.warmup_init_lr": 1e-7})
    summary = run_experiment(stage, callbacks=[lrs])
    assert summary.warm_start.fresh > 0 and summary.warm_start.loaded > 0
    assert lrs.start == (0, 0)  # update counter 0, no optimizer state carried over
    expected = [1e-7 + n * (2e-3 - 1e-7) / 20 for n in range(5)]
    assert lrs.lrs[:5] == pytest.approx(expected, rel=1e-9)


# ---------------------------------------------------------------------- diagnostics
def test_bert_fused_branch_diagnostics_equal_switching_each_branch_off_by_hand(tmp_path):
    """``measure``'s five BLEUs are the greedy validation BLEU with drop-net's inference weights forced by hand
    (NMT branches: encoder (1, 0), decoder (0, 1); BERT branches the reverse; the mix (½, ½); BERT off in one stack,
    the other mixing), and the model's own weights are back to the average afterwards."""
    cfg = tiny_experiment(tmp_path, **{"model.name": "bert_fused", "model.bert.name": tiny_bert_dir(),
                                       "train.max_epochs": 2, "model.p_net": 1.0})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    trainer.fit()
    figures = measure(trainer)
    model = trainer.model
    assert model.enc_drop_net.inference_weights == (0.5, 0.5) == model.dec_drop_net.inference_weights
    split = trainer.data.splits[cfg.data.valid_split]
    greedy = DecodeConfig(**{**cfg.decode.__dict__, "beam": 1, "nbest": 1})
    by_hand = {}
    for name, (enc, dec) in {"mix": ((0.5, 0.5), (0.5, 0.5)), "nmt_only": ((1.0, 0.0), (0.0, 1.0)),
                             "bert_only": ((0.0, 1.0), (1.0, 0.0)), "enc_bert_off": ((1.0, 0.0), (0.5, 0.5)),
                             "dec_bert_off": ((0.5, 0.5), (0.0, 1.0))}.items():
        model.enc_drop_net.weights = lambda w=enc: w
        model.dec_drop_net.weights = lambda w=dec: w
        by_hand[f"valid_bleu/{name}"] = bleu.corpus_bleu(trainer.translate(split, greedy), split.raw_tgt).score
    assert {k: v for k, v in figures.items() if k.startswith("valid_bleu/")} == pytest.approx(by_hand, abs=1e-9)
    assert len(set(by_hand.values())) > 1  # the switches change the translations
    assert {k.split("/")[1] for k in figures} == {"mix", "nmt_only", "bert_only", "enc_bert_off", "dec_bert_off"}


def test_every_model_says_how_its_scores_and_its_translations_relate(tmp_path):
    """The control has no BERT figures but the same scoring ones, each equal to a hand count over the
    validation set: top-choice accuracy, entropy and NLL in bits per target token, the greedy output's length
    over the references'."""
    trainer = build_trainer(tiny_experiment(tmp_path, **{"train.max_epochs": 2}), device=torch.device("cpu"))
    trainer.fit()
    figures = measure(trainer)
    assert set(figures) == {f"{k}/tested" for k in ("valid_bleu", "valid_len_ratio", "valid_token_acc",
                                                    "valid_entropy", "valid_nll")}
    model, cfg = trainer.model.eval(), trainer.cfg
    split = trainer.data.splits[cfg.data.valid_split]
    pad = trainer.data.vocab.pad_id
    correct = n = 0
    entropy = nll = 0.0
    with torch.no_grad():
        for batch in trainer.eval_batches(split):
            probs = torch.softmax(model(batch).logits.float(), dim=-1)
            for b in range(batch.tgt_out.size(0)):
                for t in range(batch.tgt_out.size(1)):
                    gold = int(batch.tgt_out[b, t])
                    if gold == pad:
                        continue
                    p = probs[b, t]
                    correct += int(int(p.argmax()) == gold)
                    entropy += float(-(p * p.log()).sum()) / math.log(2)
                    nll += -math.log2(float(p[gold]))
                    n += 1
    assert figures["valid_token_acc/tested"] == pytest.approx(correct / n, abs=1e-9)
    assert figures["valid_entropy/tested"] == pytest.approx(entropy / n, rel=1e-4)
    assert figures["valid_nll/tested"] == pytest.approx(nll / n, rel=1e-4)
    assert figures["valid_nll/tested"] == pytest.approx(trainer.validate()["valid_nll"], rel=1e-4)
    greedy = DecodeConfig(**{**cfg.decode.__dict__, "beam": 1, "nbest": 1})
    score = bleu.corpus_bleu(trainer.translate(split, greedy), split.raw_tgt)
    assert figures["valid_bleu/tested"] == pytest.approx(score.score)
    assert figures["valid_len_ratio/tested"] == pytest.approx(score.sys_len / score.ref_len)
    assert 0 < figures["valid_token_acc/tested"] < 1 and figures["valid_entropy/tested"] > 0
