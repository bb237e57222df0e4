"""Training losses, kept outside the models (a model returns logits plus named extras)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class LossOut:
    """Summed (not averaged) losses over ``n_tokens`` non-pad target tokens; the trainer normalises."""

    loss: Tensor
    nll: Tensor
    n_tokens: int


def label_smoothed_nll(logits: Tensor, target: Tensor, epsilon: float, pad_id: int) -> LossOut:
    """Label-smoothed cross-entropy with fairseq's semantics.

    ``loss = (1 - ε - ε_i)·nll + ε_i·Σ_v −log p_v`` with ``ε_i = ε / (V − 1)``, summed over non-pad
    positions. Only non-pad positions go through the log-softmax (padding costs nothing here).
    logits: (B, T, V) any float dtype; target: (B, T).
    """
    keep = target.ne(pad_id)  # (B, T)
    lprobs = F.log_softmax(logits[keep].float(), dim=-1)  # (N, V)
    gold = target[keep]  # (N,)
    nll = -lprobs.gather(1, gold[:, None]).squeeze(1)  # (N,)
    smooth = -lprobs.sum(dim=-1)  # (N,)
    eps_i = epsilon / (lprobs.size(-1) - 1)
    loss = (1.0 - epsilon - eps_i) * nll + eps_i * smooth
    return LossOut(loss=loss.sum(), nll=nll.sum(), n_tokens=int(gold.numel()))
