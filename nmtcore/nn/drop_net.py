"""Drop-net (Zhu et al. 2020, BERT-fused Eq. 3): per layer and training forward, train through only one of
two attention branches or their average; at inference the expectation, the average (Eq. 1).

Deliberate departure from the original code: U is drawn from a ``torch.Generator`` seeded at construction
whose state is a persistent buffer (``drop_net_rng``), not from an unseeded numpy RNG, so checkpoints carry
it and a resumed run draws the same sequence, bit-identically.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn


class DropNet(nn.Module):
    """Eq. 3's branch weights, drawn from a seeded generator whose state is checkpointed.

    ``weights()`` returns ``(w_first, w_second)``: (1, 0), (0, 1) or (½, ½) while training (one U per call;
    the model calls it once per layer per forward); in eval mode :attr:`inference_weights`, (½, ½): the
    expectation (Eq. 1).
    """

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        gen = torch.Generator().manual_seed(seed)
        # The generator's state lives in a buffer so state_dict / checkpoints carry it (resume is exact).
        self.register_buffer("drop_net_rng", gen.get_state())
        # Eval mode's weights: the expectation of Eq. 3 (Eq. 1's average); diagnostics set (1, 0) or (0, 1) to
        # switch a branch off (not state: never saved, never trained with).
        self.inference_weights: tuple[float, float] = (0.5, 0.5)

    def draw(self) -> float:
        """One U ~ Uniform(0, 1) from the module's generator, advancing its saved state."""
        gen = torch.Generator()
        gen.set_state(self.drop_net_rng.cpu())
        u = torch.rand((), generator=gen).item()
        self.drop_net_rng.copy_(gen.get_state())
        return u

    def weights(self) -> tuple[float, float]:
        """This layer's branch weights for one forward: a fresh draw of Eq. 3 in training, the inference weights
        in eval mode."""
        if not self.training:
            return self.inference_weights  # E_U[Eq. 3] = Eq. 1 unless a diagnostic switched a branch off
        u = self.draw()
        if u < self.p / 2:
            return 1.0, 0.0
        if u > 1 - self.p / 2:
            return 0.0, 1.0
        return 0.5, 0.5


def combine(first: Callable[[], Tensor], second: Callable[[], Tensor], w: tuple[float, float]) -> Tensor:
    """w_1·first() + w_2·second(), running only the branches with a non-zero weight (drop-net)."""
    if w[1] == 0.0:
        return first()
    if w[0] == 0.0:
        return second()
    a, b = first(), second()
    if w[0] == w[1]:  # Eq. 1's average, in two passes over the outputs (the weighted sum's three)
        return (a + b).mul_(w[0])
    return torch.add(a * w[0], b, alpha=w[1])
