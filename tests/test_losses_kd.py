"""KD from BERT: hand-computed loss values, α validation, which student state is distilled, gradients,
and the baseline + KD end to end through the trainer and the CLI (tiny BERT, cached features)."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from nmtcore.bert import BertKD
from nmtcore.bleu import corpus_bleu
from nmtcore.config import ConfigError, TrainConfig
from nmtcore.engine import build_trainer, run_experiment
from nmtcore.engine.losses import (
    LossOut,
    check_kd,
    kd_mse,
    label_smoothed_nll,
    training_loss,
    with_kd,
)
from nmtcore.models import KDStates, ModelOutput, build_model
from nmtcore.testing.synthetic import tiny_experiment
from nmtcore.testing.tiny_bert import save_tiny_bert


def test_kd_mse_by_hand() -> None:
    student = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [9.0, 9.0]]])  # (1, 3, 2)
    teacher = torch.tensor([[[0.0, 0.0], [1.0, 1.0], [0.0, 0.0]]])
    # Positions 0 and 1 kept: ((1 + 4) + (4 + 9)) / (2 positions * 2 units) = 4.5
    assert kd_mse(student, teacher, torch.tensor([[False, False, True]])).item() == pytest.approx(4.5)
    assert kd_mse(student, teacher, torch.tensor([[False, True, True]])).item() == pytest.approx(2.5)
    none = kd_mse(student.requires_grad_(), teacher, torch.ones(1, 3, dtype=torch.bool))
    assert none.item() == 0.0 and none.requires_grad
    with pytest.raises(ValueError, match="do not match"):
        kd_mse(student, teacher[:, :2], torch.zeros(1, 3, dtype=torch.bool))


def test_eq5_combination_by_hand() -> None:
    nmt = LossOut(loss=torch.tensor(10.0), nll=torch.tensor(8.0), n_tokens=5)  # mean L_NMT = 2
    out = with_kd(nmt, torch.tensor(2.5), alpha=0.9)
    # The trainer divides by n_tokens: 0.9 * 2 + 0.1 * 2.5 = 2.05
    assert (out.loss / out.n_tokens).item() == pytest.approx(2.05)
    assert out.nll.item() == 8.0 and out.kd.item() == 2.5
    assert with_kd(nmt, torch.tensor(2.5), alpha=1.0).loss.item() == pytest.approx(10.0)
    assert with_kd(nmt, torch.tensor(2.5), alpha=0.0).loss.item() == pytest.approx(12.5)
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match="train.kd_alpha"):
            with_kd(nmt, torch.tensor(1.0), alpha=bad)
        with pytest.raises(ConfigError, match="train.kd_alpha: must be in \\[0, 1\\]"):
            TrainConfig(kd_alpha=bad)


def test_training_loss_selects_kd_by_alpha() -> None:
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(2, 4, 11, generator=g), torch.randint(4, 11, (2, 4), generator=g)
    out = ModelOutput(logits=logits, kd=KDStates(student=torch.ones(2, 3, 5), teacher=torch.zeros(2, 3, 5),
                                                 mask=torch.tensor([[False, False, True], [False, True, True]])))
    plain = label_smoothed_nll(logits, target, 0.1, 0)
    same = training_loss(out, target, TrainConfig(label_smoothing=0.1), 0)
    assert same.loss.item() == plain.loss.item() and same.kd is None
    kd = training_loss(out, target, TrainConfig(label_smoothing=0.1, kd_alpha=0.75), 0)
    assert kd.kd.item() == pytest.approx(1.0)
    assert kd.loss.item() == pytest.approx(0.75 * plain.loss.item() + 0.25 * 1.0 * plain.n_tokens)
    with pytest.raises(ConfigError, match="train.kd_alpha: 0.5 < 1 needs a BERT teacher"):
        training_loss(ModelOutput(logits=logits), target, TrainConfig(kd_alpha=0.5), 0)


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory: pytest.TempPathFactory):
    return save_tiny_bert(tmp_path_factory.mktemp("kd") / "bert")


def test_check_kd_needs_teacher_and_alpha(tmp_path, bert_dir) -> None:
    plain = build_model(tiny_experiment(tmp_path).model, 96, 0, 2, 3)
    check_kd(TrainConfig(), plain)
    with pytest.raises(ConfigError, match="train.kd_alpha: 0.9 < 1 needs a BERT teacher"):
        check_kd(TrainConfig(kd_alpha=0.9), plain)
    teacher = build_model(tiny_experiment(tmp_path, **{"model.bert.name": str(bert_dir)}).model, 96, 0, 2, 3)
    check_kd(TrainConfig(kd_alpha=0.9), teacher)
    with pytest.raises(ConfigError, match="serves only as a KD teacher"):
        check_kd(TrainConfig(), teacher)


@pytest.mark.parametrize("kd_layer, index", [("encoder_top", 2), ("encoder_half", 1)])
def test_student_state_and_gradients(tmp_path, bert_dir, kd_layer: str, index: int) -> None:
    cfg = tiny_experiment(tmp_path, **{"model.bert.name": str(bert_dir), "model.bert.kd_layer": kd_layer,
                                       "model.encoder_layers": 2, "train.kd_alpha": 0.9})
    trainer = build_trainer(cfg, device=torch.device("cpu"))
    model = trainer.model
    assert isinstance(model.kd, BertKD) and model.kd.student_layer == index
    batch = next(trainer.train_batches(1))
    model.train()
    out = model(batch)
    states = model.run_encoder(batch)
    torch.testing.assert_close(out.kd.student, model.kd.proj(states[index]))
    assert out.kd.student.shape[-1] == model.kd.teacher.hidden_size == 64
    assert out.kd.mask[batch.src_mask].all()  # padding never distilled
    lo = training_loss(out, batch.tgt_out, cfg.train, 0)
    lo.loss.backward()
    assert model.kd.proj.weight.grad is not None and model.encoder_layers[0].ffn.fc1.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.kd.teacher.parameters())  # the teacher stays frozen
    model.eval()
    assert model(batch).kd is None  # validation loss is pure L_NMT


def test_baseline_kd_trains_end_to_end_with_cache(tmp_path, bert_dir, caplog) -> None:
    cfg = tiny_experiment(tmp_path, **{"model.bert.name": str(bert_dir), "train.kd_alpha": 0.9,
                                       "train.max_epochs": 1, "train.num_threads": 1})
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        summary = run_experiment(cfg)
    torch.set_num_threads(2)
    test = summary.test["test"]
    assert summary.epochs == 1 and math.isfinite(summary.fit.best_valid_loss)
    # the test BLEU reported is sacreBLEU's for the hypotheses the run wrote against the test references
    hyps = Path(test.hyp_path).read_text(encoding="utf-8").splitlines()
    refs = (Path(cfg.data.data_dir) / "test.yy").read_text(encoding="utf-8").splitlines()
    assert test.bleu == pytest.approx(corpus_bleu(hyps, refs).score, abs=1e-6)
    assert sum("computed" in r.message for r in caplog.records) == 3  # train, valid, test: once each
    # Resuming (a new process would do the same) reuses every cached feature file.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="nmtcore.bert"):
        run_experiment(cfg.with_overrides({"train.max_epochs": 2}))
    assert sum("cache hit" in r.message for r in caplog.records) == 3
    assert not any("computed" in r.message for r in caplog.records)


def test_cli_train_with_kd(tmp_path, bert_dir, capsys) -> None:
    from nmtcore.cli import main

    cfg = tiny_experiment(tmp_path, **{"train.max_epochs": 1})
    (tmp_path / "exp.yaml").write_text(cfg.to_yaml())
    rc = main(["train", "--config", str(tmp_path / "exp.yaml"), "--no-track", "--set", "train.kd_alpha=0.9",
               f"model.bert.name={bert_dir}", "model.bert.kd_layer=encoder_half"])
    assert rc == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["epochs"] == 1
    rc = main(["train", "--config", str(tmp_path / "exp.yaml"), "--no-track", "--no-resume", "--set",
               "train.kd_alpha=0.9"])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "train.kd_alpha: 0.9 < 1 needs a BERT teacher" in err


def _reference_smoothed_nll(logits: torch.Tensor, target: torch.Tensor, eps: float, pad: int):
    """fairseq's label_smoothed_nll_loss, written out with generic ops (the fused loss must equal it)."""
    keep = target.ne(pad)
    lprobs = torch.log_softmax(logits[keep].double(), dim=-1)
    nll = -lprobs.gather(1, target[keep][:, None]).squeeze(1)
    eps_i = eps / (lprobs.size(-1) - 1)
    loss = (1.0 - eps - eps_i) * nll + eps_i * -lprobs.sum(-1)
    return loss.sum(), nll.sum()


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_fused_smoothed_loss_matches_fairseqs_formula_in_value_and_gradient(eps: float) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 7, 50) * 4).requires_grad_()
    target = torch.randint(1, 50, (3, 7))
    target[0, 5:] = 0  # padding rows: no loss, no gradient
    target[2, 2:] = 0
    lo = label_smoothed_nll(logits, target, eps, pad_id=0)
    ref_loss, ref_nll = _reference_smoothed_nll(logits, target, eps, 0)
    assert lo.n_tokens == int(target.ne(0).sum()) == 14
    assert lo.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert lo.nll.item() == pytest.approx(ref_nll.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(lo.loss * 0.37, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss * 0.37, logits)
    torch.testing.assert_close(grad, ref_grad.float(), rtol=1e-5, atol=1e-6)
    assert grad[0, 5:].abs().sum() == 0 and grad[2, 2:].abs().sum() == 0


def test_fused_smoothed_loss_takes_bf16_logits_and_returns_a_bf16_gradient() -> None:
    torch.manual_seed(1)
    logits32 = torch.randn(2, 4, 30)
    target = torch.randint(1, 30, (2, 4))
    logits = logits32.to(torch.bfloat16).requires_grad_()
    lo = label_smoothed_nll(logits, target, 0.1, pad_id=0)
    ref, _ = _reference_smoothed_nll(logits.detach().float(), target, 0.1, 0)
    assert lo.loss.dtype == torch.float32 and lo.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    lo.loss.backward()
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_bf16_loss_in_blocks_of_rows_equals_the_formula_across_block_boundaries(device, monkeypatch) -> None:
    # 150 rows of an 8192 vocabulary: on the CPU three blocks of 64 rows (the last one partial), padding in each;
    # with a GPU's block size (computed here on the CPU) the whole batch is one block.
    from nmtcore.nn import cross_entropy

    rows = cross_entropy._block_rows(8192, torch.device(device))
    assert rows == (64 if device == "cpu" else 8192)
    monkeypatch.setattr(cross_entropy, "_block_rows", lambda vocab, _device: rows)
    torch.manual_seed(2)
    logits = (torch.randn(5, 30, 8192) * 3).to(torch.bfloat16).requires_grad_()
    target = torch.randint(1, 8192, (5, 30))
    target[1, 20:] = 0
    target[4, 3:] = 0
    lo = label_smoothed_nll(logits, target, 0.1, pad_id=0)
    exact = logits.detach().double().requires_grad_()
    ref_loss, ref_nll = _reference_smoothed_nll(exact, target, 0.1, 0)
    assert lo.n_tokens == 150 - 10 - 27
    assert lo.loss.item() == pytest.approx(ref_loss.item(), rel=1e-5)
    assert lo.nll.item() == pytest.approx(ref_nll.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(lo.loss * 0.37, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss * 0.37, exact)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-6)
    assert grad[1, 20:].abs().sum() == 0 and grad[4, 3:].abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_nll_is_pytorchs_cross_entropy_without_an_fp32_copy_of_bf16_logits(dtype) -> None:
    """PLM-sponsored's L_MLM and L_T: the mean NLL of every row, value and gradient as ``F.cross_entropy`` on
    fp32 logits; for bf16 logits nothing of (rows × vocabulary) size is kept in fp32 for the backward pass."""
    from nmtcore.nn.cross_entropy import mean_nll

    torch.manual_seed(3)
    logits = (torch.randn(70, 3000) * 2).to(dtype).requires_grad_()
    target = torch.randint(0, 3000, (70,))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = mean_nll(logits, target)
    exact = logits.detach().double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(exact, target)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(ref.item(), rel=1e-5)
    (grad,) = torch.autograd.grad(loss * 1.7, logits)
    (ref_grad,) = torch.autograd.grad(ref * 1.7, exact)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-7)
    if dtype == torch.bfloat16:
        assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= logits.numel()]
