"""The Transformer baseline (Vaswani et al. 2017), fairseq-equivalent.

Post-norm by default (``model.pre_norm`` switches), embeddings scaled by sqrt(d) plus sinusoidal
positions, one embedding matrix shared by source, target and the output projection (joint vocabulary),
dropout / attention dropout / activation dropout as fairseq. Every BERT-enhanced model in the zoo is
measured against this one, and warm-starts from its checkpoints.

With ``model.bert`` set, the baseline distils from that BERT when ``train.kd_alpha < 1`` (CTNMT;
PLM-sponsored NMT Eq. 4-5): :class:`~nmtcore.bert.BertKD` projects the top (or M/2) encoder state to
BERT's width and ``forward`` returns it with the teacher's states as extras for
:func:`nmtcore.engine.losses.training_loss`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from nmtcore.bert import BertKD
from nmtcore.config import ModelConfig
from nmtcore.models.base import ModelOutput, NMTModel
from nmtcore.nn import DecoderLayer, DecoderState, EncoderLayer, EncoderOut, SinusoidalPositions, dropout

if TYPE_CHECKING:
    from nmtcore.data import Batch


class Transformer(NMTModel):
    """The baseline; the BERT families subclass it and replace ``encode`` / ``run_decoder`` (and the layer
    stacks), keeping its embeddings, output layer and parameter names, and its ``forward``."""

    # What ``model.bert`` is to this class: "teacher" = a KD teacher only (the baseline: CTNMT-style
    # distillation, nmtcore.bert.BertKD; it never enters encode(), so decoding is unchanged); "input" = a
    # family that fuses BERT and owns its BertLayer itself.
    bert_role: ClassVar[str] = "teacher"
    # Its training forward is shape-only and syncs nothing (its KD path is excluded by nmtcore.engine.graphs).
    cuda_graph_safe: ClassVar[bool] = True

    def __init__(self, cfg: ModelConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        d = cfg.d_model
        self.embed_scale = math.sqrt(d)
        self.src_embed = nn.Embedding(vocab_size, d, padding_idx=pad_id)
        self.tgt_embed = self.src_embed if cfg.share_embeddings else nn.Embedding(vocab_size, d, padding_idx=pad_id)
        for emb in {id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values():
            nn.init.normal_(emb.weight, mean=0.0, std=d**-0.5)
            nn.init.zeros_(emb.weight[pad_id])
        self.positions = SinusoidalPositions(cfg.max_positions, d)
        self.max_positions = cfg.max_positions
        layer_args = (d, cfg.heads, cfg.ffn_dim, cfg.dropout, cfg.attention_dropout,
                      cfg.activation_dropout, cfg.activation, cfg.pre_norm)
        self.encoder_layers = nn.ModuleList(EncoderLayer(*layer_args) for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(*layer_args) for _ in range(cfg.decoder_layers))
        # Pre-norm stacks end with a LayerNorm (their residual stream is never normalised otherwise).
        self.encoder_norm = nn.LayerNorm(d) if cfg.pre_norm else nn.Identity()
        self.decoder_norm = nn.LayerNorm(d) if cfg.pre_norm else nn.Identity()
        self.kd = BertKD(cfg.bert, d, cfg.encoder_layers) if cfg.bert.enabled and self.bert_role == "teacher" else None

    # ------------------------------------------------------------------ pieces
    def embed(self, tokens: Tensor, table: nn.Embedding, offset: int = 0) -> Tensor:
        """Scaled token embeddings plus sinusoidal positions from ``offset`` (incremental decoding), with dropout."""
        x = table(tokens) * self.embed_scale + self.positions(tokens.size(1), offset)  # (B, T, C)
        return dropout(x, self.cfg.dropout, self.training)

    def output_logits(self, h: Tensor) -> Tensor:
        """Decoder states (..., C) → logits (..., V) through the tied target embedding."""
        return F.linear(h, self.tgt_embed.weight)

    def run_decoder(self, tgt_in: Tensor, enc_out: EncoderOut, state: DecoderState | None = None) -> Tensor:
        """Decoder stack over ``tgt_in`` (B, T); incremental when ``state`` is given. Returns (B, T, C)."""
        offset = state.step if state is not None else 0
        x = self.embed(tgt_in, self.tgt_embed, offset)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, enc_out.out, enc_out.mask, cache=state.layers[i] if state is not None else None)
        return self.decoder_norm(x)

    def run_encoder(self, batch: "Batch") -> list[Tensor]:
        """Encoder states [embeddings, layer 1, …, layer M], each (B, S, C); the top one normalised."""
        states = [self.embed(batch.src, self.src_embed)]  # (B, S, C)
        for layer in self.encoder_layers:
            states.append(layer(states[-1], batch.src_mask))
        states[-1] = self.encoder_norm(states[-1])
        return states

    # ------------------------------------------------------------------ interface
    def encode(self, batch: "Batch") -> EncoderOut:
        """The last encoder layer's output and the source padding mask."""
        return EncoderOut(out=self.run_encoder(batch)[-1], mask=batch.src_mask)

    def init_state(self, enc_out: EncoderOut) -> DecoderState:
        """An empty incremental state: one layer cache per decoder layer, at step 0."""
        return DecoderState.empty(len(self.decoder_layers))

    def decode_step(self, prev_tokens: Tensor, enc_out: EncoderOut, state: DecoderState) -> Tensor:
        """Logits (B, V) of the next token after the previous ones (B, 1); the layer caches grow in place."""
        h = self.run_decoder(prev_tokens, enc_out, state)  # (B, 1, C)
        state.step += prev_tokens.size(1)
        return self.output_logits(h[:, -1])  # (B, V)

    @property
    def has_kd_teacher(self) -> bool:
        """Whether the model carries a BERT teacher for knowledge distillation (``train.kd_alpha < 1``)."""
        return self.kd is not None

    def forward(self, batch: "Batch") -> ModelOutput:
        """Teacher-forced logits; while training with a KD teacher also the KD states (validation loss stays
        L_NMT). Shared by every family that keeps the baseline's decoder interface."""
        kd = None
        if self.kd is not None and self.training:
            states = self.run_encoder(batch)
            enc_out = EncoderOut(out=states[-1], mask=batch.src_mask)
            kd = self.kd(batch, states[self.kd.student_layer])
        else:
            enc_out = self.encode(batch)
        h = self.run_decoder(batch.tgt_in, enc_out)  # (B, T, C)
        return ModelOutput(logits=self.output_logits(h), enc_out=enc_out.out, dec_hidden=h, kd=kd)
