"""Cross-entropy over rows of logits, fused by hand (fairseq's label smoothing; ε = 0 is the plain NLL).

Used by the trainer's translation loss (:func:`nmtcore.engine.losses.label_smoothed_nll`) and by models'
auxiliary vocabulary losses (PLM-sponsored NMT's L_MLM and L_T), so that no loss over a vocabulary keeps an
(N, V) fp32 copy of its logits.
"""

from __future__ import annotations

import torch
from torch import Tensor


class SmoothedCrossEntropy(torch.autograd.Function):
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
        """Per-token label-smoothed loss and NLL from logits in one pass, saving what backward needs."""
        m, v = logits.shape
        eps_i = epsilon / (v - 1)
        ctx.epsilon, ctx.eps_i, ctx.dtype = epsilon, eps_i, logits.dtype
        ctx.blocked = logits.dtype in (torch.bfloat16, torch.float16)
        if ctx.blocked:
            lse = torch.empty(m, dtype=torch.float32, device=logits.device)  # log Σ_v exp(x_v), (M,)
            total = torch.empty(m, dtype=torch.float32, device=logits.device)  # Σ_v x_v, (M,)
            rows = _block_rows(v, logits.device)
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
        """The loss's gradient with respect to the logits, softmax minus the smoothed target: in place over the
        saved log-probabilities, or block by block from the logits (the bf16 path)."""
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
        rows = _block_rows(logits.size(1), logits.device)
        for s in range(0, logits.size(0), rows):
            e = s + rows
            g = logits[s:e].float().sub_(lse[s:e, None]).exp_().sub_(ctx.eps_i).mul_(w[s:e, None])
            grad[s:e] = g.scatter_add_(1, target[s:e, None], onehot[s:e])
        return grad, None, None, None


def _block_rows(vocab: int, device: torch.device) -> int:
    """Rows per block of the bf16 loss. CPU: ~2 MB of fp32 logits (64 rows of an 8k vocabulary), so each block
    stays in cache. GPU: ~256 MB (32k rows of an 8k vocabulary, i.e. a whole 4k- or 16k-token batch in one or a
    few blocks): each block is several kernel launches, and cache-sized blocks made a 16k-token batch thousands
    of them. On an H100 (bench/gpu.py, results/bench/2026-11-27-gpu-h100), nmtcore's bf16 step at 16k tokens went from
    0.44x bare PyTorch's to 1.16x with this and the trainer's single wait per update (not measured apart), for
    ~0.5 GiB more peak memory."""
    budget = 1 << 26 if device.type == "cuda" else 1 << 19  # fp32 elements per block
    return max(8, budget // vocab)


def smoothed_cross_entropy(logits: Tensor, target: Tensor, keep: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """``(Σ loss, Σ nll)`` over the rows of ``logits`` (M, V) where ``keep`` (M,) is True; ``target`` (M,).
    ``loss = (1 − ε − ε_i)·nll + ε_i·Σ_v −log p_v`` with ``ε_i = ε / (V − 1)``; the gradient comes back in
    the logits' dtype (see :class:`SmoothedCrossEntropy` for what is kept for the backward pass)."""
    return SmoothedCrossEntropy.apply(logits, target, keep, epsilon)


def mean_nll(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy of every row of ``logits`` (M, V) against ``target`` (M,), in fp32, as
    ``F.cross_entropy(logits.float(), target)`` gives, without its (M, V) fp32 copy and log-softmax; M > 0."""
    loss, _ = smoothed_cross_entropy(logits, target, torch.ones_like(target, dtype=torch.bool), 0.0)
    return loss / target.numel()


__all__ = ["SmoothedCrossEntropy", "mean_nll", "smoothed_cross_entropy"]
