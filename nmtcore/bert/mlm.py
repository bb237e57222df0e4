"""BERT's masked-LM corruption (Devlin et al. 2019), one implementation for every MLM objective here:
small-BERT pretraining (:mod:`nmtcore.bert.pretrain`) and PLM-sponsored NMT's L_MLM."""

from __future__ import annotations

import torch
from torch import Tensor


def mlm_corrupt(ids: Tensor, special: Tensor, mask_id: int, vocab_size: int, prob: float = 0.15,
                generator: torch.Generator | None = None, first_regular_id: int = 0,
                at_least_one: bool = True) -> tuple[Tensor, Tensor]:
    """Choose ``prob`` of the non-special positions; of those 80 % become ``mask_id``, 10 % a random
    WordPiece in ``[first_regular_id, vocab_size)``, 10 % stay. ``at_least_one``: a batch of tiny sentences
    that drew no position still predicts one. ids/special (B, T). Returns (corrupted ids, chosen (B, T) bool).

    Draws come from ``generator`` (on its device) or torch's global generator, in a fixed order, so a
    seeded caller is reproducible.
    """
    device = generator.device if generator is not None else ids.device
    r = torch.rand(ids.shape, generator=generator, device=device).to(ids.device)
    chosen = (r < prob) & ~special  # (B, T)
    if at_least_one and not chosen.any() and (~special).any():
        cand = (~special).nonzero()
        pick = torch.randint(len(cand), (1,), generator=generator, device=device).to(ids.device)
        chosen[tuple(cand[pick].T)] = True
    how = torch.rand(ids.shape, generator=generator, device=device).to(ids.device)
    corrupted = ids.clone()
    corrupted[chosen & (how < 0.8)] = mask_id
    swap = chosen & (how >= 0.8) & (how < 0.9)
    n_swap = int(swap.sum())
    corrupted[swap] = torch.randint(first_regular_id, vocab_size, (n_swap,), generator=generator,
                                    device=device).to(ids.device)
    return corrupted, chosen
