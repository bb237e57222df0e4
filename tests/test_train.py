"""Trainer behaviour: learning, bit-identical resume, averaging, failure on non-finite loss."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

from nmtcore.checkpoint import epoch_checkpoints, load_checkpoint
from nmtcore.config import TrainConfig
from nmtcore.engine import (
    Callback,
    NonFiniteLossError,
    build_trainer,
    run_experiment,
)
from nmtcore.engine.optim import InverseSqrtSchedule
from nmtcore.testing.synthetic import tiny_experiment


class Recorder(Callback):
    def __init__(self):
        self.logs, self.epochs = [], []

    def on_log(self, trainer, metrics):
        self.logs.append((trainer.state.num_updates, metrics["train_loss"]))

    def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
        self.epochs.append((epoch, metrics, checkpoint))


def make_trainer(cfg, callbacks=()):
    return build_trainer(cfg, callbacks=callbacks, device=torch.device("cpu"))


def test_compiled_training_gives_the_eager_losses_and_weights(tmp_path):
    """``train.compile``: the same three bf16 updates (dropout off, so both sides compute the same thing) give
    the eager run's losses and weights within bf16 tolerance, through the compiled forward."""
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        cfg = tiny_experiment(tmp_path / str(compiled), **{"train.precision": "bf16", "train.compile": compiled})
        assert cfg.model.dropout == cfg.model.attention_dropout == cfg.model.activation_dropout == 0.0
        trainer = make_trainer(cfg)
        assert isinstance(trainer.ddp_model, torch._dynamo.eval_frame.OptimizedModule) == compiled
        batches = list(itertools.islice(trainer.train_batches(1), 3))
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        losses = [trainer.train_step([b])["loss_sum"] / b.n_tgt_tokens for b in batches]
        if compiled:
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before  # the forward was compiled
        runs[compiled] = losses, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    (eager, w_eager), (comp, w_comp) = runs[False], runs[True]
    assert comp == pytest.approx(eager, rel=2e-2)
    for name, value in w_eager.items():
        torch.testing.assert_close(w_comp[name], value, atol=2e-3, rtol=2e-2, msg=name)
    # The weights moved: the comparison is not between two untouched initialisations.
    untouched = make_trainer(cfg).model.state_dict()
    assert not torch.equal(untouched["tgt_embed.weight"], w_eager["tgt_embed.weight"])


def test_inverse_sqrt_schedule_matches_fairseq():
    s = InverseSqrtSchedule(TrainConfig(lr=1e-3, warmup_updates=100, warmup_init_lr=1e-7))
    assert s.lr_at(0) == pytest.approx(1e-7)
    assert s.lr_at(50) == pytest.approx(1e-7 + 50 * (1e-3 - 1e-7) / 100)
    assert s.lr_at(100) == pytest.approx(1e-3)
    assert s.lr_at(400) == pytest.approx(1e-3 * math.sqrt(100 / 400))


def test_learning_synthetic_translation(tmp_path, capsys):
    """A tiny model learns mapping + reordering on one CPU thread within 30 epochs: test BLEU >= 85. Over seeds 1-7,
    each with torch's softmax and with nmtcore.nn.layers.softmax (same gradients to 4e-7 relative on a batch), the
    30-epoch BLEU ranged 87.4-96.5: training this small is chaotic at rounding level, and the bar of 90 this test had
    sat inside that spread (seed 1 gave 94.1 with one softmax, 87.4 with the other).
    Its CPU time is printed, not asserted: the bound it had (90 s) failed in CI at 108 s, and the same machine took
    108 s one hour and 72 s the next; training speed is measured side by side with fairseq in bench/vs_fairseq.py."""
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 30, "train.num_threads": 1, "train.lr": 5e-3,
                                       "train.warmup_updates": 100, "data.max_tokens": 300})
    t0 = time.process_time()
    summary = run_experiment(cfg)
    cpu = time.process_time() - t0
    torch.set_num_threads(2)
    test = summary.test["test"]
    bleu = test.bleu
    assert bleu >= 85, summary
    from pathlib import Path

    from nmtcore.bleu import corpus_bleu
    from nmtcore.data import prepare_data

    # The length figures the report shows are sacreBLEU's, on the hypotheses written.
    b = corpus_bleu(Path(test.hyp_path).read_text(encoding="utf-8").splitlines(),
                    prepare_data(cfg.data).splits["test"].raw_tgt)
    assert (test.bp, test.len_ratio) == (b.bp, b.sys_len / b.ref_len) and 0 < test.len_ratio < 2
    assert test.precisions == tuple(b.precisions) and len(test.precisions) == 4
    with capsys.disabled():
        print(f"\nsynthetic translation: test BLEU {bleu:.1f} in {cpu:.0f} CPU seconds on one thread")


def test_resume_continues_bit_identically(tmp_path):
    """Stop after epoch 1, resume from its checkpoint: the next update's loss equals the uninterrupted run's."""
    straight = Recorder()
    cfg = tiny_experiment(tmp_path / "a", **{"train.max_epochs": 2, "train.log_interval": 1, "model.dropout": 0.2})
    make_trainer(cfg, [straight]).fit()
    n_epoch1 = straight.epochs[0][1]["num_updates"]

    first = Recorder()
    cfg_b = cfg.with_overrides({"output_dir": str(tmp_path / "b" / "run"), "train.max_epochs": 1})
    make_trainer(cfg_b, [first]).fit()
    resumed = Recorder()
    trainer = make_trainer(cfg_b.with_overrides({"train.max_epochs": 2}), [resumed])
    torch.manual_seed(999)  # resume must restore the RNG itself, not rely on a fresh seed
    assert trainer.resume()
    trainer.fit()
    assert first.logs == straight.logs[: len(first.logs)]
    assert resumed.logs[0][0] == n_epoch1 + 1
    assert resumed.logs == straight.logs[len(first.logs):]  # exact float equality, every update of epoch 2


def test_checkpoints_pruned_and_averaged(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 4, "train.keep_last": 2, "train.average_last": 2})
    trainer = make_trainer(cfg)
    trainer.fit()
    names = [p.name for p in epoch_checkpoints(trainer.save_dir)]
    assert names[-2:] == ["epoch3.pt", "epoch4.pt"] and len(names) <= 3  # + the best epoch if older
    desc = trainer.finalize_model()
    assert "epoch3.pt" in desc and "epoch4.pt" in desc
    a = load_checkpoint(trainer.save_dir / "epoch3.pt")["model"]
    b = load_checkpoint(trainer.save_dir / "epoch4.pt")["model"]
    avg = load_checkpoint(trainer.save_dir / "averaged.pt")["model"]
    key = "encoder_layers.0.ffn.fc1.weight"
    torch.testing.assert_close(avg[key], (a[key] + b[key]) / 2)
    torch.testing.assert_close(trainer.model.state_dict()[key], avg[key])


def test_update_counts_the_batches_tokens_and_sums_their_losses(tmp_path):
    """train_step takes each batch's token count from the batch (known on the host, so no wait for the device)
    and sums the losses on the device: both must equal what the loss counts and returns batch by batch."""
    from nmtcore.engine.losses import training_loss

    trainer = make_trainer(tiny_experiment(tmp_path, **{"model.dropout": 0.0}))
    batches = list(itertools.islice(trainer.train_batches(1), 3))
    pad = trainer.data.vocab.pad_id
    assert all(b.n_tgt_tokens == int(b.tgt_out.ne(pad).sum()) for b in batches)
    trainer.model.train()
    with torch.no_grad():
        expect = [training_loss(trainer.model(b), b.tgt_out, trainer.cfg.train, pad) for b in batches]
    stats = trainer.train_step(batches)  # one update, gradients accumulated over the three
    assert stats["n_tokens"] == sum(lo.n_tokens for lo in expect) == sum(b.n_tgt_tokens for b in batches)
    assert stats["loss_sum"] == pytest.approx(sum(lo.loss.item() for lo in expect), rel=1e-5)
    assert stats["nll_sum"] == pytest.approx(sum(lo.nll.item() for lo in expect), rel=1e-5)


def test_non_finite_loss_stops_training(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    trainer = make_trainer(cfg)
    with torch.no_grad():
        trainer.model.src_embed.weight.fill_(float("nan"))
    with pytest.raises(NonFiniteLossError, match=r"diverged at update 1 \(epoch 1\): the training loss is not finite"):
        trainer.fit()


def test_a_finite_loss_past_what_its_perplexity_holds_is_divergence(tmp_path):
    """A learning rate of 50 blows the loss up to ~1e4-1e5 bits/token within a few updates: finite, but its
    perplexity overflows (the validation perplexity crashed with OverflowError before). Training stops there."""
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1, "train.lr": 50.0, "train.warmup_updates": 1})
    trainer = make_trainer(cfg)
    with pytest.raises(NonFiniteLossError, match=r"training loss \S+ bits/token: its perplexity overflows; no "
                                                 r"checkpoint had been written; try a lower train.lr \(now 50\)") as e:
        trainer.fit()
    assert e.value.figure == "training loss" and e.value.value > 1023 and math.isfinite(e.value.value)
    assert trainer.state.num_updates == e.value.update - 1  # the diverged update was not applied


class BlowUpAfterEpoch(Callback):
    """After epoch 1 (its checkpoint written), scale the output projection so every later loss overflows."""

    def on_epoch_end(self, trainer, epoch, metrics, checkpoint):
        if epoch == 1:
            with torch.no_grad():
                for p in trainer.model.parameters():
                    p.mul_(1e4)


def test_divergence_in_a_later_epoch_keeps_the_checkpoints_before_it(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 3})
    trainer = make_trainer(cfg, callbacks=[BlowUpAfterEpoch()])
    with pytest.raises(NonFiniteLossError, match=r"\(epoch 2\).*the checkpoints up to epoch 1 are kept") as e:
        trainer.fit()
    assert e.value.epoch == 2
    saved = epoch_checkpoints(trainer.save_dir)
    assert [c.name for c in saved] == ["epoch1.pt"]
    state = load_checkpoint(saved[0])["model"]
    assert all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in state.values() if v.is_floating_point())


def test_early_stopping_on_validation_loss(tmp_path):
    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 6, "train.patience": 1, "train.lr": 1.0,
                                       "train.warmup_updates": 0, "train.warmup_init_lr": 0.0})
    trainer = make_trainer(cfg)
    summary = trainer.fit()  # lr 1.0 diverges: validation loss stops improving quickly
    assert summary.stop_reason == "early_stopping(patience=1)"
    assert summary.epochs < 6


@pytest.mark.parametrize("value, shown", [("1", False), ("yes", False), ("0", True), ("off", True), ("", True)])
def test_progress_bar_follows_no_progress_as_a_flag(monkeypatch, value, shown):
    # NMTCORE_NO_PROGRESS=0 shows the bar (it read any non-empty value as "off" before).
    from nmtcore.engine import trainer as trainer_module

    monkeypatch.setenv("NMTCORE_NO_PROGRESS", value)
    monkeypatch.setattr(trainer_module.sys.stderr, "isatty", lambda: True, raising=False)
    bar = trainer_module._progress(1, rank=0)
    assert (bar is not None) is shown
    if bar is not None:
        bar.close()
    assert trainer_module._progress(1, rank=1) is None  # only rank 0 draws one


def test_prefetched_training_batches_are_the_loops_own(tmp_path):
    """``data.prefetch_batches``: batches collated ahead in a thread are those collated in the loop, in order,
    for each epoch's shuffle."""
    runs = {}
    for depth in (0, 1, 3):
        trainer = make_trainer(tiny_experiment(tmp_path / str(depth), **{"data.prefetch_batches": depth}))
        runs[depth] = [b for epoch in (1, 2) for b in trainer.train_batches(epoch)]
    assert len(runs[0]) > 2
    for depth in (1, 3):
        assert len(runs[depth]) == len(runs[0])
        for a, b in zip(runs[0], runs[depth]):
            assert torch.equal(a.ids, b.ids) and torch.equal(a.src, b.src) and torch.equal(a.tgt_out, b.tgt_out)


def test_a_slow_first_run_prints_its_first_line_before_the_log_interval(tmp_path, monkeypatch, caplog):
    """Where ``train.log_interval`` updates take longer than FIRST_LINE_S, the run's first console line comes
    after FIRST_LINE_S of training (one line, once per process); the logged metrics keep the interval."""
    import logging

    from nmtcore.engine import trainer as trainer_module

    monkeypatch.setattr(trainer_module, "FIRST_LINE_S", 0.0)
    rec = Recorder()
    trainer = make_trainer(tiny_experiment(tmp_path, **{"train.log_interval": 10_000, "train.max_epochs": 2}),
                           callbacks=[rec])
    monkeypatch.setattr(trainer_module, "_progress", lambda *a: None)  # as in a sweep: no progress bar
    with caplog.at_level(logging.INFO, logger="nmtcore"):
        trainer.train_epoch(1)
        trainer.train_epoch(2)
    lines = [r.getMessage() for r in caplog.records if " tok/s" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("epoch 1 update 1 loss "), lines
    assert rec.logs == []  # no metrics logged outside the interval
