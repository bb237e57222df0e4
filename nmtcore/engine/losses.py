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

from torch import Tensor

from nmtcore.config import ConfigError, TrainConfig, check_unit_interval
from nmtcore.models import ModelOutput, NMTModel
from nmtcore.nn.cross_entropy import smoothed_cross_entropy


@dataclass
class LossOut:
    """Summed (not averaged) losses over ``n_tokens`` non-pad target tokens; the trainer normalises.

    ``kd``: the batch's mean KD MSE (detached, for logging) when the loss includes KD, else None.
    """

    loss: Tensor
    nll: Tensor
    n_tokens: int
    kd: Tensor | None = None


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int,
                       n_tokens: int | None = None) -> LossOut:
    """Label-smoothed cross-entropy with fairseq's semantics.

    ``loss = (1 - ε - ε_i)·nll + ε_i·Σ_v −log p_v`` with ``ε_i = ε / (V − 1)``, summed over non-pad
    positions (padding rows contribute nothing, forward or backward). logits: (B, T, V) any float dtype,
    computed in fp32 (the gradient comes back in the logits' dtype); target: (B, T). ``n_tokens``: the
    non-pad count when the caller knows it (a batch does, on the host); counted here otherwise, which on a
    GPU waits for the device.
    """
    keep = target.ne(pad_id)  # (B, T)
    v = logits.size(-1)
    loss, nll = smoothed_cross_entropy(logits.reshape(-1, v), target.reshape(-1), keep.reshape(-1), epsilon)
    return LossOut(loss=loss, nll=nll, n_tokens=int(keep.sum()) if n_tokens is None else n_tokens)


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


def training_loss(out: ModelOutput, target: Tensor, cfg: TrainConfig, pad_id: int,
                  n_tokens: int | None = None) -> LossOut:
    """The training objective ``cfg`` selects: label-smoothed NLL, plus KD from BERT when
    ``cfg.kd_alpha < 1`` (then ``out.kd`` must hold the KD states), plus the model's auxiliary losses.
    ``n_tokens``: as in :func:`label_smoothed_nll`."""
    lo = label_smoothed_nll(out.logits, target, cfg.label_smoothing, pad_id, n_tokens)
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
