"""``transformers`` encoders attend through the platform's attention (:func:`nmtcore.nn.layers.attend`).

A BERT loaded here (:meth:`nmtcore.bert.ResolvedBert.load_model`) is switched to the attention implementation
:data:`ATTENTION`, registered with ``transformers``' ``AttentionInterface`` (and its boolean padding masks,
``sdpa_mask``, with ``AttentionMaskInterface``): the model's own projections, then :func:`~nmtcore.nn.layers.attend`,
which takes ``scaled_dot_product_attention`` on CUDA, as ``transformers``' ``sdpa`` does, and on the CPU the
explicit path the NMT models use for short sequences. ``sdpa`` on the CPU runs the flash kernel, tiled for long
sequences (see :func:`~nmtcore.nn.layers.attend`). Fine-tuned BERTs train faster on the CPU this way (2 cores, bf16,
blocks of 5 updates on the same batches alternated 6 times each way: PLM-sponsored 1.07-1.09x, BERT-JAM phase 3
1.06x per target token), and a beam search's source-BERT encode runs 1.10-1.14x faster (500 test_2016 sentences in
batches of 128, bf16; ~1% of the PLM-sponsored decode). Same values within the kernels' rounding; the
attention-probability dropout is :func:`~nmtcore.nn.layers.dropout`'s draw.

Where the call is one ``attend`` cannot reproduce (a scaling other than 1/√d, a position bias, a causal flag,
an additive float mask), it goes to ``transformers``' own ``sdpa`` function unchanged. Models that do not
dispatch through ``AttentionInterface`` (``_supports_attention_backend`` false, e.g. MPNet with its relative
position bias) keep their own attention.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor, nn

from nmtcore.nn.layers import attend

ATTENTION = "nmtcore"


def _attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                       dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                       **kwargs: Any) -> tuple[Tensor, None]:
    """``transformers``' attention-function signature: query/key/value (B, H, T, Dh), a boolean mask (True = may
    attend) or None → ((B, T, H, Dh), None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
    plain = ((scaling is None or math.isclose(scaling, query.size(-1) ** -0.5, rel_tol=1e-6))
             and kwargs.get("position_bias") is None and not causal
             and (attention_mask is None or attention_mask.dtype == torch.bool)
             and key.size(1) == query.size(1))  # as many key/value heads as query heads
    if not plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    y = attend(query, key, value, attention_mask, False, dropout)  # (B, H, T, Dh)
    return y.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def register_attention() -> str:
    """Register :data:`ATTENTION` with ``transformers`` (once per process); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention_forward)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    return ATTENTION


def use_platform_attention(model: nn.Module) -> nn.Module:
    """Switch a ``transformers`` model to :data:`ATTENTION` where it dispatches through ``AttentionInterface``, and
    cast each attention's input once under autocast (:func:`cast_projections_once`); returns the model."""
    if getattr(model, "_supports_attention_backend", False):
        model.set_attn_implementation(register_attention())
    cast_projections_once(model)
    return model


def _cast_once(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook: an fp32 ``hidden_states`` in autocast's precision, once for the three projections."""
    x = args[0] if args else kwargs.get("hidden_states")
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or not torch.is_autocast_enabled(x.device.type):
        return None
    low = x.to(torch.get_autocast_dtype(x.device.type))
    return ((low, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": low})


def cast_projections_once(model: nn.Module) -> int:
    """Give every self-attention of ``model`` with ``query``/``key``/``value`` projections (BERT's) a pre-hook that
    casts its fp32 input to autocast's precision once: autocast casts a linear layer's input on each call, three
    copies of the same activations forward, three conversions back. The values are autocast's own cast; the
    gradient of the shared copy sums the three in that precision, as one fused projection's would (the platform's
    own attention projects q, k and v in one product). Returns how many attentions it hooked."""
    hooked = 0
    for m in model.modules():
        if all(isinstance(getattr(m, name, None), nn.Linear) for name in ("query", "key", "value")):
            m.register_forward_pre_hook(_cast_once, with_kwargs=True)
            hooked += 1
    return hooked


__all__ = ["ATTENTION", "cast_projections_once", "register_attention", "use_platform_attention"]
