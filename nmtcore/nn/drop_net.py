"""Drop-net (Zhu et al. 2020, BERT-fused Eq. 3): per layer and training forward, train through only one of
two attention branches or their average; at inference the expectation, the average (Eq. 1).

Deliberate departure from the original code: U is drawn from a ``torch.Generator`` seeded at construction
whose state is a persistent buffer (``drop_net_rng``), not from an unseeded numpy RNG, so checkpoints carry
it and a resumed run draws the same sequence, bit-identically. The draws come from a host copy of that state
(the buffer follows the model to the GPU, where reading it each layer would make the host wait for the device),
written back to the buffer whenever the module's state is saved.

Under CUDA graphs (``train.cuda_graphs``, :class:`PlannedDraws`) a forward cannot choose its branches on the
host: the graph always computes both and weighs them by a device tensor that the host fills before each replay
with the same draws an eager forward would make. A branch weighted 0 then gets a zero gradient, not none; the
trainer hands the optimizer none for the weights of every branch no batch of the update used, so Adam skips them
as in eager training.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import Tensor, nn

Weights = tuple[float, float] | tuple[Tensor, Tensor]


class DropNet(nn.Module):
    """Eq. 3's branch weights, drawn from a seeded generator whose state is checkpointed.

    ``weights()`` returns ``(w_first, w_second)``: (1, 0), (0, 1) or (½, ½) while training (one U per call;
    the model calls it once per layer per forward); in eval mode :attr:`inference_weights`, (½, ½): the
    expectation (Eq. 1). Planned (:meth:`use_planned`, CUDA graphs): the weights of the forward's i-th call are
    row i of a device tensor that :meth:`plan` fills before each forward.
    """

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p = p
        gen = torch.Generator().manual_seed(seed)
        # The generator's state lives in a buffer so state_dict / checkpoints carry it (resume is exact).
        self.register_buffer("drop_net_rng", gen.get_state())
        self._gen: torch.Generator | None = gen  # the host copy draws come from (from the buffer after a load)
        # Eval mode's weights: the expectation of Eq. 3 (Eq. 1's average); diagnostics set (1, 0) or (0, 1) to
        # switch a branch off (not state: never saved, never trained with).
        self.inference_weights: tuple[float, float] = (0.5, 0.5)
        self.planned: Tensor | None = None  # (calls, 2) on the device: a planned forward's weights
        self._call = 0

    def _host(self) -> torch.Generator:
        if self._gen is None:
            self._gen = torch.Generator()
            self._gen.set_state(self.drop_net_rng.cpu())
        return self._gen

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        if self._gen is not None:
            self.drop_net_rng.copy_(self._gen.get_state())
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        super()._load_from_state_dict(*args, **kwargs)
        self._gen = None  # draws continue from the loaded state

    def draw(self) -> float:
        """One U ~ Uniform(0, 1) from the module's generator, advancing its state."""
        return torch.rand((), generator=self._host()).item()

    def eq3(self) -> tuple[float, float]:
        """One draw of Eq. 3's weights."""
        u = self.draw()
        if u < self.p / 2:
            return 1.0, 0.0
        if u > 1 - self.p / 2:
            return 0.0, 1.0
        return 0.5, 0.5

    def weights(self) -> Weights:
        """This layer's branch weights for one forward: a fresh draw of Eq. 3 in training (planned: this call's
        row of :attr:`planned`), the inference weights in eval mode."""
        if not self.training:
            return self.inference_weights  # E_U[Eq. 3] = Eq. 1 unless a diagnostic switched a branch off
        if self.planned is not None:
            row = self.planned[self._call % self.planned.size(0)]
            self._call += 1
            return row[0], row[1]
        return self.eq3()

    def use_planned(self, calls: int, device: torch.device) -> None:
        """From now on a training forward reads its ``calls`` weights from a device tensor (:meth:`plan`)."""
        self.planned = torch.full((calls, 2), 0.5, device=device)
        self._call = 0

    def plan(self) -> list[tuple[float, float]]:
        """The next forward's weights, one draw per call as an eager forward draws them, copied to the device
        tensor the forward reads; returns them."""
        assert self.planned is not None, "plan() needs use_planned()"
        ws = [self.eq3() for _ in range(self.planned.size(0))]
        self.planned.copy_(torch.tensor(ws, dtype=self.planned.dtype), non_blocking=True)
        self._call = 0
        return ws

    def restart(self) -> None:
        """The next forward reads the planned weights from the first row again (a capture's passes)."""
        self._call = 0


class PlannedDraws:
    """Drop-net under CUDA graphs: each drop-net's weights planned on the host before a forward (:meth:`plan`),
    and which parameters the update left unused (:meth:`unused`).

    ``nets``: each drop-net with its branches, one ``(first, second)`` pair of modules per call a forward makes,
    in call order.
    """

    def __init__(self, nets: Sequence[tuple[DropNet, Sequence[tuple[nn.Module, nn.Module]]]],
                 device: torch.device) -> None:
        self.nets = [(net, list(branches)) for net, branches in nets]
        for net, branches in self.nets:
            net.use_planned(len(branches), device)
        self._used: set[int] = set()

    def plan(self) -> None:
        """Draw the next forward's weights and note the branches it uses."""
        for net, branches in self.nets:
            for (first, second), w in zip(branches, net.plan()):
                for module, weight in ((first, w[0]), (second, w[1])):
                    if weight != 0.0:
                        self._used.update(id(p) for p in module.parameters())

    def restart(self) -> None:
        """The next forward reads the current plan again (a graph's warm-up and capture passes)."""
        for net, _ in self.nets:
            net.restart()

    def unused(self) -> list[nn.Parameter]:
        """The trainable parameters of the branches no forward since the last call used (their gradient is 0 and
        eager training would have none); starts counting again."""
        params = {id(p): p for _, branches in self.nets for pair in branches for m in pair for p in m.parameters()
                  if p.requires_grad}
        unused = [p for i, p in params.items() if i not in self._used]
        self._used.clear()
        return unused


def combine(first: Callable[[], Tensor], second: Callable[[], Tensor], w: Weights) -> Tensor:
    """w_1·first() + w_2·second(), running only the branches with a non-zero weight (drop-net). Device weights
    (a planned forward) run both: ``a·1 + b·0`` is ``a`` and ``a·½ + b·½`` is ``(a + b)·½``, exactly."""
    if isinstance(w[0], Tensor):
        a, b = first(), second()
        return torch.add(a * w[0].to(a.dtype), b * w[1].to(b.dtype))
    if w[1] == 0.0:
        return first()
    if w[0] == 0.0:
        return second()
    a, b = first(), second()
    if w[0] == w[1]:  # Eq. 1's average, in two passes over the outputs (the weighted sum's three)
        return (a + b).mul_(w[0])
    return torch.add(a * w[0], b, alpha=w[1])
