"""The typed incremental-decoding state beam search drives (fairseq's ``reorder_incremental_state`` with
typed containers instead of an untyped dict).

A model family adds its own cached tensors (BERT keys/values, gates...) by storing them in these
containers, never by changing the search: beam search only calls ``EncoderOut.reorder`` and
``DecoderState.reorder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass
class EncoderOut:
    """Source-side results shared by all decoding steps.

    ``out``: (B, S, C) top encoder states; ``mask``: (B, S) True = padding. ``extras`` holds any other
    per-sentence tensors a model family needs (batch dimension first), e.g. BERT states.
    """

    out: Tensor
    mask: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)

    def reorder(self, index: Tensor) -> "EncoderOut":
        """Select sentences along the batch dimension (used to expand to beams)."""
        return EncoderOut(
            out=self.out.index_select(0, index),
            mask=self.mask.index_select(0, index),
            extras={k: v.index_select(0, index) for k, v in self.extras.items()},
        )


@dataclass
class LayerCache:
    """One attention layer's incremental cache.

    ``self_k``/``self_v``: (B, H, t, Dh) keys/values of the decoder prefix, grown by one step at a time.
    ``static``: keys/values over fixed memories (encoder, BERT), computed at the first step and reused,
    keyed by memory name: ``{"enc": (k, v)}``.
    """

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    static: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def grow(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys/values (B, H, n, Dh) to the prefix's; returns the whole prefix's."""
        if self.self_k is not None:
            k, v = torch.cat([self.self_k, k], dim=2), torch.cat([self.self_v, v], dim=2)  # (B, H, t+n, Dh)
        self.self_k, self.self_v = k, v
        return k, v


@dataclass
class DecoderState:
    """Typed incremental decoder state: one :class:`LayerCache` per decoder layer, the current step,
    and any model-specific tensors (batch dimension first) in ``extras``."""

    layers: list[LayerCache]
    step: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls, num_layers: int) -> "DecoderState":
        """A state with one empty :class:`LayerCache` per decoder layer."""
        return cls(layers=[LayerCache() for _ in range(num_layers)])

    def reorder(self, beam_idx: Tensor, static: bool = True) -> None:
        """Keep the rows ``beam_idx`` (B',) of every cached tensor, in place.

        ``static=False`` leaves the keys/values over fixed memories (encoder, BERT) as they are: valid
        when ``beam_idx`` only permutes rows *within* each sentence's block of beams, whose static rows
        are identical copies (beam search knows when that holds and saves the copies).
        """
        for cache in self.layers:
            if cache.self_k is not None:
                cache.self_k = cache.self_k.index_select(0, beam_idx)
                cache.self_v = cache.self_v.index_select(0, beam_idx)
            if static:
                cache.static = {
                    name: (k.index_select(0, beam_idx), v.index_select(0, beam_idx))
                    for name, (k, v) in cache.static.items()
                }
        self.extras = {
            k: v.index_select(0, beam_idx) if isinstance(v, Tensor) else v for k, v in self.extras.items()
        }
