"""Shared neural building blocks: attention with incremental caches, Transformer layers, drop-net."""

from nmtcore.nn.cache import DecoderState, EncoderOut, LayerCache
from nmtcore.nn.drop_net import DropNet, combine
from nmtcore.nn.layers import (CrossAttention, DecoderLayer, EncoderLayer, FeedForward, Residual, SelfAttention,
                               SinusoidalPositions, attend, attend_parts, causal_mask, compute_dtype, dropout,
                               key_padding_to_attn_mask, merge_heads, split_heads)

__all__ = ["CrossAttention", "DecoderLayer", "DecoderState", "DropNet", "EncoderLayer", "EncoderOut", "FeedForward",
           "LayerCache", "Residual", "SelfAttention", "SinusoidalPositions", "attend", "attend_parts", "causal_mask", "combine",
           "compute_dtype", "dropout", "key_padding_to_attn_mask", "merge_heads", "split_heads"]
