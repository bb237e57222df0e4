"""Training losses, kept outside the models (a model returns logits plus typed extras: ModelOutput).

- :func:`label_smoothed_nll`: fairseq's label-smoothed cross-entropy, summed over target tokens.
- :func:`kd_mse` / :func:`with_kd`: knowledge distillation from BERT (CTNMT; PLM-sponsored NMT Eq. 4-5),
  ``L = α·L_NMT + (1 − α)·L_KD`` with ``L_KD`` the MSE between a student hidden state projected to BERT's
  width and BERT's last layer, padding masked. The model supplies both states as ``ModelOutput.kd``
  (:class:`nmtcore.bert.KDStates`); any model that returns them can be distilled.
- :func:`training_loss`: what the trainer calls; picks KD when ``train.kd_alpha < 1``.
- :func:`with_aux`: the auxiliary losses a model returns (``ModelOutput.mlm_loss`` / ``target_lm_loss``,
  PLM-sponsored NMT's L_MLM and L_T), added with weight 1 as per-token means (Eq. 9:
  ``L = (α·L_NMT + (1 − α)·L_KD) + L_MLM + L_T``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from nmtcore.config import ConfigError, TrainConfig, check_unit_interval
from nmtcore.models import ModelOutput, NMTModel


@dataclass
class LossOut:
    """Summed (not averaged) losses over ``n_tokens`` non-pad target tokens; the trainer normalises.

    ``kd``: the batch's mean KD MSE (detached, for logging) when the loss includes KD, else None.
    """

    loss: Tensor
    nll: Tensor
    n_tokens: int
    kd: Tensor | None = None


class _SmoothedCrossEntropy(torch.autograd.Function):
    """fairseq's label-smoothed cross-entropy over rows of logits, fused by hand; backward gives
    ``w·(softmax − (1 − ε − ε_i)·onehot − ε_i)`` (``w`` = the upstream gradient, 0 on padding rows). With
    the generic ops (select the non-pad rows, log_softmax, gather, and their backwards) the loss of a
    3+3 / d 256 model over an 8k vocabulary took ~40% of a CPU training step: each op allocated,
    zero-filled or copied another (N, V) fp32 tensor.

    fp32 (or fp64) logits: forward keeps one (M, V) fp32 buffer, the log-probabilities, which backward turns in place
    into the gradient (a second backward through the same graph is refused: the buffer is spent, which
    training never does). bf16 / fp16 logits: forward keeps only each row's log-sum-exp and reads the
    logits in blocks of rows (~2 MB in fp32, so each block's fp32 copy stays in cache); backward recomputes
    the softmax block by block and writes the gradient in the logits' dtype. No (M, V) fp32 tensor is
    made: the fp32 way, which converts the logits, keeps the log-probabilities and converts the gradient
    back, took 1.5x as long in bf16 (4000 × 8000 logits, forward and backward, 1 thread) and twice the
    memory."""

    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, keep: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        m, v = logits.shape
        eps_i = epsilon / (v - 1)
        ctx.epsilon, ctx.eps_i, ctx.dtype = epsilon, eps_i, logits.dtype
        ctx.blocked = logits.dtype in (torch.bfloat16, torch.float16)
        if ctx.blocked:
            lse = torch.empty(m, dtype=torch.float32, device=logits.device)  # log Σ_v exp(x_v), (M,)
            total = torch.empty(m, dtype=torch.float32, device=logits.device)  # Σ_v x_v, (M,)
            rows = _block_rows(v)
            for s in range(0, m, rows):
                x = logits[s : s + rows].float()  # (rows, V)
                torch.logsumexp(x, dim=-1, out=lse[s : s + rows])
                torch.sum(x, dim=-1, out=total[s : s + rows])
            nll = (lse - logits.gather(1, target[:, None]).squeeze(1).float()).masked_fill_(~keep, 0.0)  # (M,)
            smooth = (lse * v - total).masked_fill_(~keep, 0.0)  # Σ_v −log p_v = Σ_v (lse − x_v), (M,)
            ctx.save_for_backward(logits, target, keep, lse)
        else:
            lprobs = torch.log_softmax(logits.float(), dim=-1)  # (M, V)
            nll = lprobs.gather(1, target[:, None]).squeeze(1).neg_().masked_fill_(~keep, 0.0)  # (M,)
            smooth = lprobs.sum(dim=-1).neg_().masked_fill_(~keep, 0.0)  # Σ_v −log p_v, (M,)
            ctx.save_for_backward(lprobs, target, keep)
        loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
        ctx.mark_non_differentiable(nll)
        return loss.sum(), nll.sum()

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, None, None, None]:
        if ctx.blocked:
            logits, target, keep, lse = ctx.saved_tensors
        else:
            lprobs, target, keep = ctx.saved_tensors
        w = keep.to(torch.float32) * grad_loss  # (M,)
        onehot = (-(1.0 - ctx.epsilon - ctx.eps_i) * w)[:, None]  # (M, 1)
        if not ctx.blocked:
            grad = lprobs.exp_().sub_(ctx.eps_i).mul_(w[:, None])  # in place: softmax − ε_i, weighted
            return grad.scatter_add_(1, target[:, None], onehot).to(ctx.dtype), None, None, None
        grad = torch.empty_like(logits)  # (M, V), the logits' dtype
        rows = _block_rows(logits.size(1))
        for s in range(0, logits.size(0), rows):
            e = s + rows
            g = logits[s:e].float().sub_(lse[s:e, None]).exp_().sub_(ctx.eps_i).mul_(w[s:e, None])
            grad[s:e] = g.scatter_add_(1, target[s:e, None], onehot[s:e])
        return grad, None, None, None


def _block_rows(vocab: int) -> int:
    """Rows per block of the bf16 loss: ~2 MB of fp32 logits (64 rows of an 8k vocabulary)."""
    return max(8, (1 << 19) // vocab)


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> LossOut:
    """Label-smoothed cross-entropy with fairseq's semantics.

    ``loss = (1 - ε - ε_i)·nll + ε_i·Σ_v −log p_v`` with ``ε_i = ε / (V − 1)``, summed over non-pad
    positions (padding rows contribute nothing, forward or backward). logits: (B, T, V) any float dtype,
    computed in fp32 (the gradient comes back in the logits' dtype); target: (B, T).
    """
    keep = target.ne(pad_id)  # (B, T)
    v = logits.size(-1)
    loss, nll = _SmoothedCrossEntropy.apply(logits.reshape(-1, v), target.reshape(-1), keep.reshape(-1), epsilon)
    return LossOut(loss=loss, nll=nll, n_tokens=int(keep.sum()))


def kd_mse(student: Tensor, teacher: Tensor, mask: Tensor) -> Tensor:
    """Eq. 4 (PLM-sponsored NMT): ``L_KD = ||r_plm − h||²`` as a mean over kept positions and hidden units.

    student, teacher: (B, S, H) (the student already projected to BERT's width); mask: (B, S) True =
    excluded (padding, eos, positions with no BERT WordPiece). Computed in fp32; no kept position → 0
    (still connected to the graph).
    """
    if student.shape != teacher.shape or mask.shape != student.shape[:-1]:
        raise ValueError(f"kd_mse: student {tuple(student.shape)}, teacher {tuple(teacher.shape)} and mask "
                         f"{tuple(mask.shape)} do not match")
    keep = ~mask  # (B, S)
    diff = student[keep].float() - teacher[keep].float()  # (N, H)
    if diff.numel() == 0:
        return student.float().sum() * 0.0
    return diff.pow(2).mean()


def with_kd(nmt: LossOut, kd: Tensor, alpha: float) -> LossOut:
    """Eq. 5: ``L = α·L_NMT + (1 − α)·L_KD``, on per-token means.

    ``nmt.loss`` is a sum the trainer divides by ``n_tokens``, so the KD mean enters as
    ``(1 − α)·kd·n_tokens``: after the trainer's division the update follows exactly
    ``α·mean(L_NMT) + (1 − α)·L_KD``. ``nll`` stays the pure translation NLL (for perplexity).
    """
    check_unit_interval(alpha, "train.kd_alpha")
    loss = alpha * nmt.loss + (1.0 - alpha) * kd * nmt.n_tokens
    return LossOut(loss=loss, nll=nmt.nll, n_tokens=nmt.n_tokens, kd=kd.detach())


def with_aux(lo: LossOut, aux: list[Tensor]) -> LossOut:
    """Eq. 9 (PLM-sponsored NMT): add each auxiliary per-token-mean loss with weight 1.

    They are per-token means, so they enter as ``mean·n_tokens``: after the trainer's division by
    ``n_tokens`` each adds exactly its mean. ``nll`` and ``kd`` are unchanged.
    """
    if not aux:
        return lo
    return LossOut(loss=lo.loss + sum(t.float() for t in aux) * lo.n_tokens, nll=lo.nll, n_tokens=lo.n_tokens,
                   kd=lo.kd)


def training_loss(out: ModelOutput, target: Tensor, cfg: TrainConfig, pad_id: int) -> LossOut:
    """The training objective ``cfg`` selects: label-smoothed NLL, plus KD from BERT when
    ``cfg.kd_alpha < 1`` (then ``out.kd`` must hold the KD states), plus the model's auxiliary losses."""
    lo = label_smoothed_nll(out.logits, target, cfg.label_smoothing, pad_id)
    if cfg.kd_alpha < 1.0:
        if out.kd is None:
            raise ConfigError(f"train.kd_alpha: {cfg.kd_alpha} < 1 needs a BERT teacher, but the model returned no "
                              "KD states; set model.bert.name (e.g. minilm) or model.bert.layers/hidden")
        lo = with_kd(lo, kd_mse(out.kd.student, out.kd.teacher, out.kd.mask), cfg.kd_alpha)
    return with_aux(lo, out.aux_losses())


def check_kd(cfg: TrainConfig, model: NMTModel) -> None:
    """Fail before training when KD is asked for without a teacher, or a teacher is built but unused."""
    if cfg.kd_alpha < 1.0 and not model.has_kd_teacher:
        if model.idle_kd_teacher_allowed:
            raise ConfigError(f"train.kd_alpha: {cfg.kd_alpha} < 1 needs the model's KD teacher: "
                              "set model.kd_teacher=true")
        raise ConfigError(f"train.kd_alpha: {cfg.kd_alpha} < 1 needs a BERT teacher: set model.bert.name "
                          "(e.g. minilm) or model.bert.layers/hidden (the baseline's model.bert is its KD teacher)")
    if cfg.kd_alpha >= 1.0 and model.has_kd_teacher and not model.idle_kd_teacher_allowed:
        raise ConfigError("train.kd_alpha: the model's BERT serves only as a KD teacher, but train.kd_alpha=1 turns "
                          "KD off; set train.kd_alpha < 1 (0.9 in the PLM-sponsored paper) or leave model.bert empty")


__all__ = ["LossOut", "label_smoothed_nll", "kd_mse", "with_kd", "with_aux", "training_loss", "check_kd"]
