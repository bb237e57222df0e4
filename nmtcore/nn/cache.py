"""The typed incremental-decoding state beam search drives (fairseq's ``reorder_incremental_state`` with
typed containers instead of an untyped dict).

A model family adds its own cached tensors (BERT keys/values, gates...) by storing them in these
containers, never by changing the search: beam search only calls ``EncoderOut.reorder`` and
``DecoderState.reorder``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

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

    Outside autograd the prefix lives in buffers with room for more steps (``self_k`` is a view of the first
    ``t``): a step writes its keys/values in place and :meth:`select_rows` gathers the surviving rows into new
    buffers in one copy, where concatenating at every step copied the whole prefix a second time
    (``torch.cat`` alone was 5% of a beam-5 decode's CPU time on 2 cores, torch profiler).

    ``reordered_each_step``: every step copies the whole prefix into a new row order (beam search, set by
    :meth:`DecoderState.reordered_each_step`), so it is kept in the compute dtype rather than widened
    (:func:`~nmtcore.nn.layers.wide_decoding_cache`).
    """

    self_k: Tensor | None = None
    self_v: Tensor | None = None
    static: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    _k_buf: Tensor | None = field(default=None, repr=False)  # (B, H, capacity, Dh); self_k is its [:, :, :t]
    _v_buf: Tensor | None = field(default=None, repr=False)
    reordered_each_step: bool = False

    def grow(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys/values (B, H, n, Dh) to the prefix's; returns the whole prefix's."""
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):  # a graph: no in-place buffers
            if self.self_k is not None:
                k, v = torch.cat([self.self_k, k], dim=2), torch.cat([self.self_v, v], dim=2)  # (B, H, t+n, Dh)
            self.self_k, self.self_v, self._k_buf, self._v_buf = k, v, None, None
            return k, v
        t = 0 if self.self_k is None else self.self_k.size(2)
        end = t + k.size(2)
        buf = self._k_buf
        if buf is None or end > buf.size(2) or buf.shape[:2] != k.shape[:2] or buf.dtype != k.dtype:
            self._k_buf, self._v_buf = self._room(k, self.self_k, end), self._room(v, self.self_v, end)
        self._k_buf[:, :, t:end] = k
        self._v_buf[:, :, t:end] = v
        self.self_k, self.self_v = self._k_buf[:, :, :end], self._v_buf[:, :, :end]
        return self.self_k, self.self_v

    @staticmethod
    def _room(new: Tensor, prefix: Tensor | None, end: int) -> Tensor:
        """A buffer for at least ``end`` steps (twice that, at least 16) holding ``prefix``."""
        b, h, _, d = new.shape
        buf = new.new_empty(b, h, max(16, 2 * end), d)
        if prefix is not None:
            buf[:, :, : prefix.size(2)] = prefix
        return buf

    @staticmethod
    def _gather(prefix: Tensor, buf: Tensor, index: Tensor) -> Tensor:
        new = buf.new_empty(len(index), *buf.shape[1:])
        got = torch.index_select(prefix, 0, index, out=new[:, :, : prefix.size(2)])
        if got.data_ptr() != new.data_ptr():  # an out= that was reallocated rather than written in place
            new[:, :, : prefix.size(2)] = got
        return new

    def memory(self, name: str, project: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """The static keys/values over memory ``name`` (B, H, S, Dh): ``project()`` at the first step, stored
        contiguous. A projection's heads are a strided view of its output; attention over a strided cache copied
        its keys and values at every step (until a reorder happened to copy them once)."""
        if name not in self.static:
            k, v = project()
            self.static[name] = (k.contiguous(), v.contiguous())
        return self.static[name]

    def select_rows(self, index: Tensor, static: bool | Tensor = True) -> None:
        """Keep the rows ``index`` (B',) of the prefix, and of the static keys/values when ``static`` is True;
        a tensor ``static`` selects the static rows by its own index (one row per sentence, see
        :meth:`DecoderState.reorder`)."""
        if self.self_k is not None:
            if self._k_buf is None:
                self.self_k, self.self_v = self.self_k.index_select(0, index), self.self_v.index_select(0, index)
            else:  # into new buffers of the same capacity, in one copy (the out= view is written in place)
                t = self.self_k.size(2)
                self._k_buf, self._v_buf = (self._gather(self.self_k, self._k_buf, index),
                                            self._gather(self.self_v, self._v_buf, index))
                self.self_k, self.self_v = self._k_buf[:, :, :t], self._v_buf[:, :, :t]
        if static is not False:
            rows = index if static is True else static
            self.static = {name: (k.index_select(0, rows), v.index_select(0, rows))
                           for name, (k, v) in self.static.items()}


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

    def reordered_each_step(self) -> "DecoderState":
        """Mark every layer's cache as reordered at every step (beam search): see :class:`LayerCache`."""
        for layer in self.layers:
            layer.reordered_each_step = True
        return self

    def reorder(self, beam_idx: Tensor, static: bool | Tensor = True) -> None:
        """Keep the rows ``beam_idx`` (B',) of every cached tensor, in place.

        ``static=False`` leaves the keys/values over fixed memories (encoder, BERT) as they are: valid
        when ``beam_idx`` only permutes rows *within* each sentence's block of beams, whose static rows
        are identical copies (beam search knows when that holds and saves the copies). A tensor
        ``static`` selects the static rows by that index instead: beam search keeps them once per sentence
        (attention shares each row with the sentence's beams, :func:`nmtcore.nn.layers.attend`) and passes
        the surviving sentences.
        """
        for cache in self.layers:
            cache.select_rows(beam_idx, static)
        self.extras = {
            k: v.index_select(0, beam_idx) if isinstance(v, Tensor) else v for k, v in self.extras.items()
        }
