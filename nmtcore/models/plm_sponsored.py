"""PLM-sponsored NMT (seed 001): a source BERT as the encoder, a target BERT as a causal decoder, and a
randomly initialised *coordinator* that combines the two; half-layer KD, MLM and a target-LM loss.

Architecture (Section 2.2-2.3):

- **Encoder** = the source BERT (``model.bert``, fine-tuned: ``model.bert.freeze=false``) over the batch's
  WordPiece stream (``batch.extras["bert_ids"]``, built by :func:`nmtcore.bert.prepare_bert_inputs`), so
  the NMT source subwords are not read: the paper tokenises "languages using embeddings of PLMs" with the
  BERT's own vocabulary (Section 3.1). Eq. 6 gates the top state h_M with the half-layer state h_{M/2}:
  ``g = σ([h_M ; h_{M/2}] W)``, ``h_S = g·h_M + (1 − g)·h_{M/2}``, ``r_S = LN(FFN(h_S) + h_S)``
  (``model.encoder_gate=false``: ``r_S = h_M``, the "top layer only" variant of Section 4.1).
- **Decoder** = the target BERT (``model.tgt_bert``, by default ``e5:L6``, the bottom six
  layers of multilingual-e5-small) run causally, self-attention only, with an incremental cache.
  Design choice (stated, as the issue allows): it is a BERT-architecture stack built from
  :mod:`nmtcore.nn` primitives and *initialised from the target BERT's weights* (layers, position and
  token-type embeddings, embedding LayerNorm), reading **NMT target subwords** whose embedding table is
  the frequency-weighted embedding transformation of the BERT's WordPiece embeddings (FWET, Algorithm 1,
  ``model.fwet``; without it the table starts random). This is the paper's "+FWET" setting (Section 2.4,
  Table 5), needs no second WordPiece stream of the target text (a batch carries one BERT stream, the
  source's), and lets beam search decode the NMT vocabulary directly.
- **Coordinator** (Eq. 2), ``model.decoder_layers`` layers of width ``model.d_model``:
  ``r_all = [r_S ; r_T ; r_{j−1}]``, ``h_j = Attention(r_{j−1}, r_all, r_all) + r_{j−1}``,
  ``r_j = LN(FFN(h_j) + h_j)``, ``r_0 = r_T + positions`` (sinusoidal). One key/value projection for all
  three parts, as ``Attention(r_{j−1}, r_all, r_all)`` reads. The mask (Eq. 3) is
  ``M = [M_S | M_T | M_h]``: all source positions (but padding), target positions ≤ t in both target
  parts (upper-triangular masks, diagonal visible). r_S and r_T are projected to d_model when the BERT
  widths differ (the paper's coordinator is Transformer-base sized, its BERTs 768 wide: it must project
  too but does not say how; a linear map here).
- **Output**: logits through the target embedding (``model.share_embeddings``: tied, via a linear map
  d_model → target BERT width when they differ; else an own output matrix).

Losses (Eq. 4-9) stay in :mod:`nmtcore.engine.losses`; ``forward`` returns their inputs as typed fields of
:class:`~nmtcore.models.base.ModelOutput` while training:

- **Half-layer KD** (Eq. 4-5): a frozen copy of the source BERT taken at construction is the teacher
  (``model.kd_teacher``); ``ModelOutput.kd`` holds the student's layer-M/2 state (``model.kd_layer=full``:
  layer M, Table 3's "+L_fkd"), the teacher's last layer and the WordPiece padding mask (``model.kd_teacher_layer``
  = k: the pretrained BERT's layer k instead, a platform option; the default is the paper's last layer). The
  weight is the platform's ``train.kd_alpha`` = α of ``L = α·L_NMT + (1 − α)·L_KD``, **the weight of the
  NMT term** (paper: α = 0.9). The public code (akibcmi/PLM-NMT, its label-smoothed criterion) puts its
  α on the KD term (default 0.1): the same objective, so its ``0.1`` is our ``train.kd_alpha=0.9``; it
  also scales L_MLM by its (1 − α), where Eq. 9 adds L_MLM outside the KD combination: we follow Eq. 9.
  An idle teacher (``kd_alpha = 1``) is allowed, so the α sweep can include 1.
- **MLM** on the encoder (``model.mlm_loss``, Section 2.5): a masked copy of the WordPiece stream runs
  through the encoder BERT in a separate pass (the NMT pass reads the unmasked sentence, as the paper
  says); BERT's recipe, ``model.mlm_prob`` (15%) of the non-special positions, 80% [MASK] / 10% random /
  10% kept (:func:`nmtcore.bert.mlm.mlm_corrupt`). The prediction head (dense + GELU + LN, decoder tied
  to BERT's word embeddings) starts fresh: :class:`~nmtcore.bert.BertLayer` loads BertModel without its pretraining heads. Returned as
  ``mlm_loss``, a mean over masked positions.
- **Target LM** L_T (Eq. 8, ``model.tgt_lm_loss``): the decoder alone (no source) predicts t_j from
  t_<j through the tied target embedding, on a random ``model.tgt_lm_fraction`` (10%) of the non-pad
  target positions per batch (Bernoulli draws). Returned as ``target_lm_loss``, a mean over those positions.
- Eq. 9, ``L = (α·L_NMT + (1 − α)·L_KD) + L_MLM + L_T``, is :func:`nmtcore.engine.losses.training_loss`: every
  term enters as a per-token mean with weight 1 (the trainer divides the summed NMT loss by its tokens).

Table 3's ablations are these switches: ``model.mlm_loss``, ``model.tgt_lm_loss``, ``train.kd_alpha``
(1 = no L_kd; also ``model.kd_teacher=false`` so no teacher is built) and ``model.kd_layer``
(search_spaces/ablations.py ``plm_sponsored_loss``).

Choices where the paper is silent or ambiguous (each a config field where it plausibly matters):
``model.encoder_layers`` is not read (the encoder is the source BERT); ``model.decoder_layers`` is the
coordinator depth; ``model.pre_norm`` must stay false (Eq. 2 is post-norm; it has no LayerNorm after the
attention residual and we follow it); ``model.bert.kd_layer`` is the baseline's switch and is not read
here (``model.kd_layer`` is, default "half", so a config carried over from a baseline cannot silently
distil the top layer); the gate's W has no bias, as Eq. 6 writes it; the Eq. 6 FFN has ``model.ffn_dim``
units and ``model.activation``; ``model.plm_dropout`` ("the dropout for PLMs", Section 3.2) is read as
the PLMs' hidden dropout (embeddings, attention output, FFN output of both BERTs), their attention-probability
dropout stays their own; target positions past the target BERT's table reuse its last position
embedding; of ``model.tgt_bert`` only the name or size, ``freeze`` (default false: the decoder is
fine-tuned), ``activation_checkpointing``, ``cache_dir`` and ``pretrain_*`` are read.

The paper's configuration is two named presets (:mod:`nmtcore.config.presets`): ``plm_sponsored_iwslt_paper``
(IWSLT'14 De→En, Section 3.2-3.3: coordinator = Transformer-base, 12 layers; PLM dropout 0.5; α = 0.9;
100k updates) and ``plm_sponsored_ablation_paper`` (its WMT'14 En-De ablation, Section 4: 6 coordinator
layers, PLM dropout 0.3, 400k updates). Deliberate departures from the paper, each for a reason:

- **Defaults are not the paper's setting**: ``train.kd_alpha`` defaults to 1 (no KD) because it is the
  platform-wide switch of every model (a Transformer has no teacher); ``model.decoder_layers`` and the
  coordinator's width come from the base preset (``multi30k_small``: 3 layers, d 256) so the CPU studies
  fit their budget; ``model.plm_dropout`` defaults to each BERT's own rate (0.1 for the BERTs used here)
  because 0.5 is the paper's IWSLT regularisation for 110M-parameter BERTs, not a property of the model.
  The paper's values are the presets above; in the PLM studies the loss ablation's reference arm trains
  α = 0.9 (``search_spaces/ablations.py``) and the α sweep's grid includes it (``search_spaces/kd_alpha.py``).
- **BERTs**: the studies use the packaged MiniLM (source) and the bottom 6 layers of multilingual-e5-small
  (``e5:L6``, target: the best German-capable encoder found offline), not bert-base (offline CPU machines);
  the presets name the paper's hub models.
- **The decoder reads NMT subwords through FWET** (above) instead of a second WordPiece stream.

FWET (Algorithm 1) is a preprocessing step: :mod:`nmtcore.models.fwet`, run by :meth:`PlmSponsored.prepare`.

The target BERT is resolved, or made here, by :meth:`PlmSponsored.prepare` before the model is built.

One file for the family, as every model family has one (most of it this docstring and the paper's components):
the coordinator, the gates and the heads are read against the paper's equations together.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtcore.bert import BertError, BertLayer, BertSpec, KDStates, ResolvedBert, ensure_bert, resolve_bert
from nmtcore.bert.mlm import mlm_corrupt
from nmtcore.config import ConfigError, ExperimentConfig, PlmSponsoredConfig
from nmtcore.models.base import MemoryTraits, ModelOutput, NMTModel
from nmtcore.models.fwet import prepare_fwet
from nmtcore.nn import (DecoderState, EncoderOut, FeedForward, LayerCache, Residual, SelfAttention,
                        SinusoidalPositions, attend_parts, causal_mask, dropout, merge_heads, split_heads)
from nmtcore.nn.checkpointing import checkpoint_layers
from nmtcore.nn.probes import PartShares, tapping
from nmtcore.nn.cross_entropy import mean_nll

if TYPE_CHECKING:
    from nmtcore.data import Batch, PreparedData

# ---------------------------------------------------------------------- the target BERT, causal
class CausalBertLayer(nn.Module):
    """One BERT layer (post-norm self-attention + GELU FFN) with a causal mask and an incremental cache."""

    def __init__(self, hidden: int, heads: int, intermediate: int, dropout: float, attention_dropout: float,
                 eps: float) -> None:
        super().__init__()
        self.self_attn = SelfAttention(hidden, heads, attention_dropout)
        self.self_res = Residual(hidden, dropout, pre_norm=False)
        self.ffn = FeedForward(hidden, intermediate, "gelu", 0.0)
        self.ffn_res = Residual(hidden, dropout, pre_norm=False)
        self.self_res.norm.eps = self.ffn_res.norm.eps = eps

    @torch.no_grad()
    def load_hf(self, layer: nn.Module) -> None:
        """Copy a ``transformers`` BertLayer's weights (q, k, v fused into one projection)."""
        att = layer.attention
        self.self_attn.qkv.weight.copy_(torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight]))
        self.self_attn.qkv.bias.copy_(torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias]))
        self.self_attn.out.load_state_dict(att.output.dense.state_dict())
        self.self_res.norm.load_state_dict(att.output.LayerNorm.state_dict())
        self.ffn.fc1.load_state_dict(layer.intermediate.dense.state_dict())
        self.ffn.fc2.load_state_dict(layer.output.dense.state_dict())
        self.ffn_res.norm.load_state_dict(layer.output.LayerNorm.state_dict())

    def forward(self, x: Tensor, cache: LayerCache | None = None) -> Tensor:
        """One BERT layer under a causal mask (the target BERT as a left-to-right decoder), incrementally with
        ``cache``."""
        # Right-padded targets need no key padding mask under the causal mask (as the baseline decoder).
        x = self.self_res.after(x, self.self_attn(x, causal=True, cache=cache))
        return self.ffn_res.after(x, self.ffn(x))


class TargetBertDecoder(nn.Module):
    """The target BERT run causally over NMT target subwords (Section 2.2's decoder): BERT's embedding
    layer with the NMT word table (FWET or random), then its layers, initialised from its weights."""

    def __init__(self, resolved: ResolvedBert, vocab_size: int, pad_id: int, freeze: bool,
                 fwet: str = "", dropout: float | None = None, activation_checkpointing: bool = False) -> None:
        super().__init__()
        config = resolved.hf_config()
        if config.model_type != "bert":  # its layers are rebuilt causally from BERT's (no relative position bias)
            raise BertError(f"target BERT {resolved.spec} is a {config.model_type!r} model; the decoder needs a BERT "
                            "(e.g. e5:L6, a Google BERT, or a pretrained-here one)")
        if config.hidden_act != "gelu":
            raise BertError(f"target BERT {resolved.spec}: hidden_act {config.hidden_act!r} is not supported (gelu)")
        hf = resolved.load_model()
        h = config.hidden_size
        self.hidden_size = h
        self.dropout = config.hidden_dropout_prob if dropout is None else dropout  # hidden dropout
        self.word = nn.Embedding(vocab_size, h, padding_idx=pad_id)
        nn.init.normal_(self.word.weight, std=config.initializer_range)
        if fwet:
            if not Path(fwet).is_file():
                raise ConfigError(f"model.fwet: {fwet} does not exist; build it with "
                                  "nmtcore.models.fwet.prepare_fwet (or set model.fwet='')")
            table = torch.load(fwet, map_location="cpu", weights_only=True)["embeddings"]
            if tuple(table.shape) != (vocab_size, h):
                raise ConfigError(f"model.fwet: {fwet} holds a {tuple(table.shape)} table, the model needs "
                                  f"({vocab_size}, {h}) (vocabulary × target BERT width); rebuild it (build_fwet)")
            with torch.no_grad():
                self.word.weight.copy_(table)
        emb = hf.embeddings
        self.positions = nn.Embedding.from_pretrained(emb.position_embeddings.weight.detach().clone(), freeze=False)
        self.token_type = nn.Parameter(emb.token_type_embeddings.weight[0].detach().clone())  # segment 0
        self.norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.norm.load_state_dict(emb.LayerNorm.state_dict())
        self.layers = nn.ModuleList(
            CausalBertLayer(h, config.num_attention_heads, config.intermediate_size, self.dropout,
                            config.attention_probs_dropout_prob, config.layer_norm_eps)
            for _ in range(config.num_hidden_layers))
        for mine, theirs in zip(self.layers, hf.encoder.layer):
            mine.load_hf(theirs)
        if activation_checkpointing:  # while fine-tuned (nmtcore.nn.checkpointing)
            checkpoint_layers(self.layers)
        if freeze:
            for m in (self.positions, self.norm, self.layers):
                m.requires_grad_(False)
            self.token_type.requires_grad_(False)

    @property
    def max_positions(self) -> int:
        """The longest target the BERT's position table holds."""
        return self.positions.num_embeddings

    def forward(self, tokens: Tensor, state: DecoderState | None = None, offset: int = 0) -> Tensor:
        """tokens (B, T) at positions ``offset``…; incremental with ``state`` (layer i uses
        ``state.layers[i]``). Returns r_T (B, T, H)."""
        t = tokens.size(1)
        # Positions past the BERT's table (a platform-made BERT has 128) reuse its last one: long
        # training targets and beam search's max length never crash, they only lose position resolution.
        pos = torch.arange(offset, offset + t, device=tokens.device).clamp(max=self.max_positions - 1)
        x = self.word(tokens) + self.positions(pos) + self.token_type  # (B, T, H)
        x = dropout(self.norm(x), self.dropout, self.training)
        for i, layer in enumerate(self.layers):
            x = layer(x, cache=state.layers[i] if state is not None else None)
        return x


def set_hidden_dropout(hf_bert: nn.Module, p: float) -> None:
    """Set the hidden dropout of a ``transformers`` BERT (embeddings, attention output, FFN output) to ``p``;
    its attention-probability dropout (``attention.self.dropout``) keeps its rate."""
    for name, module in hf_bert.named_modules():
        if isinstance(module, nn.Dropout) and not name.endswith("attention.self.dropout"):
            module.p = p


# ---------------------------------------------------------------------- the frozen KD teacher
class FrozenTeacher(nn.Module):
    """A frozen copy of the source BERT as built (Section 2.3: "BERT to generate r_plm is frozen as the
    teacher"); always in eval mode, never trained, not used for decoding. ``layers`` (``model.kd_teacher_layer``)
    below the BERT's depth keeps only its bottom ``layers`` layers, so r_plm is that layer's state; 0: all."""

    def __init__(self, hf_bert: nn.Module, layers: int = 0) -> None:
        super().__init__()
        self.bert = copy.deepcopy(hf_bert)
        stack = self.bert.encoder.layer
        self.layers = layers or len(stack)
        if not 1 <= self.layers <= len(stack):
            raise ConfigError(f"model.kd_teacher_layer: the source BERT has {len(stack)} layers, got {layers}")
        if self.layers < len(stack):
            self.bert.encoder.layer = nn.ModuleList(list(stack)[: self.layers])
            self.bert.config.num_hidden_layers = self.layers
        self.bert.requires_grad_(False)
        self.bert.eval()

    def train(self, mode: bool = True) -> "FrozenTeacher":
        """Set the mode; the teacher BERT itself stays in eval mode (frozen, no dropout) whatever the mode."""
        super().train(mode)
        self.bert.eval()
        return self

    @torch.no_grad()
    def forward(self, ids: Tensor, mask: Tensor, segments: Tensor) -> Tensor:
        """ids/mask/segments (B, Tb), mask True = padding → r_plm, the teacher's last layer (B, Tb, H)."""
        out = self.bert(input_ids=ids, attention_mask=(~mask).long(), token_type_ids=segments, return_dict=True)
        return out.last_hidden_state


# ---------------------------------------------------------------------- encoder fusion (Eq. 6)
class HalfLayerGate(nn.Module):
    """Eq. 6: ``g = σ([h_M ; h_{M/2}] W)``, ``h_S = g·h_M + (1 − g)·h_{M/2}``, ``r_S = LN(FFN(h_S) + h_S)``."""

    def __init__(self, hidden: int, ffn_dim: int, activation: str, dropout: float, activation_dropout: float) -> None:
        super().__init__()
        self.gate = nn.Linear(2 * hidden, hidden, bias=False)  # W ∈ R^{2d×d}
        self.ffn = FeedForward(hidden, ffn_dim, activation, activation_dropout)
        self.ffn_res = Residual(hidden, dropout, pre_norm=False)

    def forward(self, top: Tensor, half: Tensor) -> Tensor:
        """The gated mix of BERT's top and half layer, g ⊙ top + (1 − g) ⊙ half, then an FFN."""
        g = torch.sigmoid(self.gate(torch.cat([top, half], dim=-1)))  # (B, S, H)
        h = g * top + (1.0 - g) * half
        return self.ffn_res.after(h, self.ffn(h))


class MLMHead(nn.Module):
    """BERT's MLM head: dense + GELU + LN, then the word embeddings (tied) plus a bias."""

    def __init__(self, word_embeddings: nn.Embedding, eps: float) -> None:
        super().__init__()
        h = word_embeddings.embedding_dim
        self.dense = nn.Linear(h, h)
        self.norm = nn.LayerNorm(h, eps=eps)
        self.word_embeddings = [word_embeddings]  # a list: no second registration of the tied weight
        self.bias = nn.Parameter(torch.zeros(word_embeddings.num_embeddings))

    def forward(self, x: Tensor) -> Tensor:
        """Masked-LM logits over BERT's WordPiece vocabulary (the output projection tied to its word embeddings)."""
        return F.linear(self.norm(F.gelu(self.dense(x))), self.word_embeddings[0].weight, self.bias)


# ---------------------------------------------------------------------- the coordinator (Eq. 2-3)
class CoordinatorAttention(nn.Module):
    """``Attention(r_{j−1}, r_all, r_all)`` with ``r_all = [r_S ; r_T ; r_{j−1}]`` (Eq. 2) under the mask
    of Eq. 3. One key/value projection serves all three parts. With caches (two per layer), r_S's
    keys/values are projected once (``static["src"]``), r_T's and r_{j−1}'s grow per step."""

    def __init__(self, d_model: int, heads: int, attention_dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.tap: PartShares | None = None  # the diagnostics' probe (usage_probe)
        nn.init.xavier_uniform_(self.q.weight, gain=2**-0.5)
        nn.init.xavier_uniform_(self.kv.weight, gain=2**-0.5)
        nn.init.xavier_uniform_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of ``x``, split into heads: (k, v), each (B, heads, T, C/heads)."""
        k, v = self.kv(x).chunk(2, dim=-1)  # 2 × (B, T, C)
        return split_heads(k, self.heads), split_heads(v, self.heads)

    @staticmethod
    def grow(cache: LayerCache | None, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The keys and values so far: these alone, or appended to an incremental cache."""
        return (k, v) if cache is None else cache.grow(k, v)  # (B, H, t, Dh)

    def forward(self, x: Tensor, r_src: Tensor, src_mask: Tensor, r_tgt: Tensor,
                caches: tuple[LayerCache, LayerCache] | None = None) -> Tensor:
        """x = r_{j−1} (B, T, C), r_src = r_S (B, S, C), src_mask (B, S) True = padding, r_tgt = r_T (B, T, C)
        at the same (new) positions as x. Returns (B, T, C)."""
        q = split_heads(self.q(x), self.heads)  # (B, H, T, Dh)
        c_t, c_h = caches if caches is not None else (None, None)
        if c_t is not None:
            k_s, v_s = c_t.memory("src", lambda: self.project(r_src))
        else:
            k_s, v_s = self.project(r_src)  # (B, H, S, Dh)
        k_t, v_t = self.grow(c_t, *self.project(r_tgt))  # (B, H, t, Dh)
        k_h, v_h = self.grow(c_h, *self.project(x))
        t_q, t_k = q.size(2), k_t.size(2)
        # Eq. 3: M = [M_S | M_T | M_h]; M_S lets every (non-pad) source position through, M_T and M_h hide
        # the future (strictly upper triangular: position t sees targets ≤ t). A single new position (a
        # decoding step) sees every target so far: no mask.
        allowed_s = (~src_mask)[:, None, None, :]  # (B, 1, 1, S)
        causal = causal_mask(t_q, t_k, x.device) if t_q > 1 else None  # (T, t)
        parts = [(k_s, v_s, allowed_s), (k_t, v_t, causal), (k_h, v_h, causal)]  # r_all
        y = attend_parts(q, parts, self.attention_dropout if self.training else 0.0, tap=self.tap)
        return self.out(merge_heads(y))  # (B, T, C)


class CoordinatorLayer(nn.Module):
    """Eq. 2: ``h_j = Attention(r_{j−1}, r_all, r_all) + r_{j−1}``, ``r_j = LN(FFN(h_j) + h_j)``."""

    def __init__(self, cfg: PlmSponsoredConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.attn = CoordinatorAttention(d, cfg.heads, cfg.attention_dropout)
        self.dropout = cfg.dropout
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, pre_norm=False)

    def forward(self, x: Tensor, r_src: Tensor, src_mask: Tensor, r_tgt: Tensor,
                caches: tuple[LayerCache, LayerCache] | None = None) -> Tensor:
        """One coordinator layer (Eq. 2): attention over the source and target representations, then the FFN."""
        h = x + dropout(self.attn(x, r_src, src_mask, r_tgt, caches), self.dropout, self.training)  # h_j
        return self.ffn_res.after(h, self.ffn(h))  # r_j


# ---------------------------------------------------------------------- the model
class PlmSponsored(NMTModel):
    """Source BERT encoder (+ Eq. 6), causal target-BERT decoder, coordinator (Eq. 2-3); see the module
    docstring for the losses it returns while training."""

    idle_kd_teacher_allowed: ClassVar[bool] = True  # Table 3's "-L_kd" and the α sweep's α = 1
    source_is_bert_stream: ClassVar[bool] = True  # the source BERT's WordPieces are the source: the budget counts them

    @classmethod
    def memory_traits(cls, cfg: ExperimentConfig) -> MemoryTraits:
        """Two BERTs (the source's, and the fine-tuned target BERT counted at the source's size); the stream is
        the source itself (no context)."""
        traits = super().memory_traits(cfg)
        if cfg.model.tgt_bert.enabled:  # type: ignore[attr-defined]
            traits = dataclasses.replace(traits, berts=traits.berts + 1, bert_fine_tuned=True)
        return traits

    def __init__(self, cfg: PlmSponsoredConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        d = cfg.d_model
        # Encoder: the source BERT; the states Eq. 6 reads (h_{M/2} at least layer 1, h_M).
        resolved_src = resolve_bert(BertSpec.from_config(cfg.bert), cache_dir=cfg.bert.cache_dir or None,
                                    pretrain_corpus=cfg.bert.pretrain_corpus, pretrain_steps=cfg.bert.pretrain_steps)
        m = resolved_src.hf_config().num_hidden_layers
        self.half_layer, self.top_layer = max(1, m // 2), m
        self.bert = BertLayer(cfg.bert, layers=(self.half_layer, self.top_layer), resolved=resolved_src)
        plm_dropout = cfg.plm_dropout if cfg.plm_dropout >= 0 else None  # None: each BERT's own rate
        if plm_dropout is not None:
            set_hidden_dropout(self.bert.bert, plm_dropout)
        h_src = self.bert.hidden_size
        eps = resolved_src.hf_config().layer_norm_eps
        self.encoder_gate = (HalfLayerGate(h_src, cfg.ffn_dim, cfg.activation, cfg.dropout, cfg.activation_dropout)
                             if cfg.encoder_gate else None)
        if self.encoder_gate is not None:
            self.encoder_gate.ffn_res.norm.eps = eps
        self.src_proj = nn.Linear(h_src, d) if h_src != d else nn.Identity()
        self.teacher = FrozenTeacher(self.bert.bert, cfg.kd_teacher_layer) if cfg.kd_teacher else None
        self.mlm_head = MLMHead(self.bert.bert.get_input_embeddings(), eps) if cfg.mlm_loss else None
        tok = self.bert.resolved.load_tokenizer() if cfg.mlm_loss else None
        self.mask_token_id = int(tok.mask_token_id) if tok is not None else -1
        # Decoder: the target BERT, causal, over NMT subwords.
        tb = cfg.tgt_bert
        resolved_tgt = resolve_bert(BertSpec.from_config(tb), cache_dir=tb.cache_dir or None,
                                    pretrain_corpus=tb.pretrain_corpus, pretrain_steps=tb.pretrain_steps)
        self.decoder = TargetBertDecoder(resolved_tgt, vocab_size, pad_id, tb.freeze, cfg.fwet, plm_dropout,
                                         tb.activation_checkpointing)
        h_tgt = self.decoder.hidden_size
        self.tgt_proj = nn.Linear(h_tgt, d) if h_tgt != d else nn.Identity()
        # Coordinator.
        self.positions = SinusoidalPositions(cfg.max_positions, d)
        self.max_positions = cfg.max_positions
        self.coordinator = nn.ModuleList(CoordinatorLayer(cfg) for _ in range(cfg.decoder_layers))
        if cfg.share_embeddings:
            self.out_proj = nn.Linear(d, h_tgt, bias=False) if h_tgt != d else nn.Identity()
            self.out_embed = None
        else:
            self.out_proj = nn.Identity()
            self.out_embed = nn.Parameter(torch.randn(vocab_size, d) * d**-0.5)

    @classmethod
    def prepare(cls, cfg: ExperimentConfig, data: "PreparedData") -> ExperimentConfig:
        """Before the model is built (:func:`nmtcore.models.prepare_model_resources`): the target BERT
        resolved, or pretrained here when nothing answers (as ``ensure_bert`` does for the source BERT),
        then the FWET table of the training split's target side (:func:`~nmtcore.models.fwet.prepare_fwet`).
        Cached."""
        tb = cfg.model.tgt_bert
        if tb.layers > 0 and not tb.pretrain_corpus:  # a size made here learns the *target* side
            tb = replace(tb, pretrain_corpus=f"{cfg.data.corpus}:{cfg.data.tgt_lang}")
        as_source = replace(cfg, model=replace(cfg.model, bert=tb))
        tgt = ensure_bert(as_source).model.bert  # cache_dir / pretrain corpus defaulted as for model.bert
        return prepare_fwet(replace(cfg, model=replace(cfg.model, tgt_bert=tgt)), data)

    # ------------------------------------------------------------------ groups (phases are data)
    @property
    def has_kd_teacher(self) -> bool:
        """Whether the frozen KD teacher was built (read by :func:`nmtcore.engine.losses.check_kd`)."""
        return self.teacher is not None

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """``bert`` (source BERT), ``tgt_bert`` (the target BERT's layers and embeddings but the NMT word
        table), ``kd_teacher`` (frozen), ``nmt`` (everything else)."""
        tgt = [p for n, p in self.decoder.named_parameters() if not n.startswith("word.")]
        teacher = list(self.teacher.parameters()) if self.teacher is not None else []
        return self.groups(bert=self.bert.parameters(), tgt_bert=tgt, kd_teacher=teacher)

    # ------------------------------------------------------------------ diagnostics
    @contextlib.contextmanager
    def usage_probe(self) -> Iterator[dict[str, float]]:
        """What each branch and each term of Eq. 9 left in the trained model, over the (teacher-forced, eval)
        forwards in the block; every arm of the loss ablation gets the figures its modules allow:

        - ``attention/source``, ``attention/target_bert``, ``attention/history``: the share of the coordinator's
          attention (Eq. 2's r_all) on r_S (the source BERT), r_T (the target BERT) and r_{j−1} (its own states),
          mean over layers, heads and real target positions;
        - ``source_gate/top``: Eq. 6's g, the weight of h_M against h_{M/2}, mean over real WordPieces and units
          (with the gate);
        - ``pretrained_mse/half``, ``pretrained_mse/top``: Eq. 4's ||r_plm − h||² (per unit, real WordPieces) of
          the fine-tuned BERT's half layer (what L_kd pulls on) and top layer (L_fkd), r_plm the pretrained BERT's
          top layer (the teacher; loaded for the probe in arms without one); ``pretrained_mse/own_half``: the
          pretrained BERT's own half layer against its top, where L_kd starts from. How far fine-tuning moved the
          source BERT from what it was pretrained to be, with and without KD;
        - ``mlm/acc``: the MLM head's masked-WordPiece top-1 on the validation source, BERT's masking recipe with
          fixed draws (arms with L_MLM);
        - ``target_lm/acc``, ``target_lm/nll``: the target BERT alone (no source) predicting the next target
          subword through the tied table, as Eq. 8 trains it (L_T), over every real target position (nll in
          bits per token): every arm, so the arms without L_T show what the decoder learnt of it anyway.
        """
        out: dict[str, float] = {}
        shares = PartShares(("source", "target_bert", "history"))
        sums: dict[str, list[float]] = {}  # figure → [Σ, n]
        pretrained: list[nn.Module] = []  # the pretrained source BERT of an arm without a teacher, loaded once
        batches = [0]

        def add(name: str, total: float, n: int) -> None:
            acc = sums.setdefault(name, [0.0, 0])
            acc[0] += total
            acc[1] += n

        def queries(module: nn.Module, args: tuple) -> None:
            shares.set_queries(args[0].tgt_in.ne(self.pad_id))  # (B, T)

        def extras(module: nn.Module, args: tuple, output: ModelOutput) -> None:
            batch = args[0]
            x = batch.extras
            half, top, mask = self.encoder_states(batch)
            real = ~mask  # (B, Tb)
            if self.encoder_gate is not None:
                g = torch.sigmoid(self.encoder_gate.gate(torch.cat([top, half], dim=-1)))  # (B, Tb, H)
                add("source_gate/top", float(g[real].float().sum()), int(real.sum()) * g.size(-1))
            if not pretrained:  # the whole pretrained BERT: the teacher unless it stops below the top layer
                whole = self.teacher is not None and self.teacher.layers == self.top_layer
                pretrained.append(self.teacher.bert if whole
                                  else self.bert.resolved.load_model().to(mask.device).eval())
            ref = pretrained[0](input_ids=x["bert_ids"], attention_mask=real.long(), token_type_ids=x["bert_segments"],
                                output_hidden_states=True, return_dict=True).hidden_states
            r_plm = ref[self.top_layer]
            for name, h in (("half", half), ("top", top), ("own_half", ref[self.half_layer])):
                diff = h[real].float() - r_plm[real].float()
                add(f"pretrained_mse/{name}", float(diff.pow(2).sum()), diff.numel())
            if self.mlm_head is not None:
                ids = x["bert_ids"]
                enc = self.bert.encoder
                gen = torch.Generator(device=ids.device).manual_seed(batches[0])
                corrupted, selected = mlm_corrupt(ids, mask | ids.eq(enc.cls_id) | ids.eq(enc.sep_id),
                                                  self.mask_token_id, self.mlm_head.bias.numel(), prob=self.cfg.mlm_prob,
                                                  generator=gen, at_least_one=False)
                states = self.bert.run(corrupted, mask, x["bert_segments"])[-1]
                hits = self.mlm_head(states[selected]).argmax(-1).eq(ids[selected])
                add("mlm/acc", float(hits.sum()), hits.numel())
            keep = batch.tgt_out.ne(self.pad_id)  # (B, T)
            logits = F.linear(self.decoder(batch.tgt_in)[keep], self.decoder.word.weight).float()  # (N, V)
            target = batch.tgt_out[keep]
            add("target_lm/acc", float(logits.argmax(-1).eq(target).sum()), target.numel())
            add("target_lm/nll", float(F.cross_entropy(logits, target, reduction="sum")) / math.log(2), target.numel())
            batches[0] += 1

        handles = [self.register_forward_pre_hook(queries), self.register_forward_hook(extras)]
        try:
            with tapping([layer.attn for layer in self.coordinator], shares):
                yield out
        finally:
            for h in handles:
                h.remove()
        out.update(shares.shares("attention"))
        out.update({name: total / n for name, (total, n) in sums.items() if n})

    # ------------------------------------------------------------------ pieces
    def fuse_source(self, top: Tensor, half: Tensor) -> Tensor:
        """r_S (B, S, H_src): Eq. 6, or h_M without the gate."""
        return self.encoder_gate(top, half) if self.encoder_gate is not None else top

    def output_logits(self, h: Tensor) -> Tensor:
        """Coordinator states (..., d) → logits (..., V)."""
        if self.out_embed is not None:
            return F.linear(h, self.out_embed)
        return F.linear(self.out_proj(h), self.decoder.word.weight)

    def run_coordinator(self, r_tgt: Tensor, enc_out: EncoderOut, state: DecoderState | None = None) -> Tensor:
        """r_T (B, T, H_tgt) of new positions → r_N (B, T, d). Caches: after the target BERT's layers,
        two per coordinator layer."""
        offset = state.step if state is not None else 0
        r_t = self.tgt_proj(r_tgt)  # (B, T, d)
        x = dropout(r_t + self.positions(r_t.size(1), offset), self.cfg.dropout, self.training)  # r_0
        base = len(self.decoder.layers)
        for j, layer in enumerate(self.coordinator):
            caches = (state.layers[base + 2 * j], state.layers[base + 2 * j + 1]) if state is not None else None
            x = layer(x, enc_out.out, enc_out.mask, r_t, caches)
        return x

    def encoder_states(self, batch: "Batch") -> tuple[Tensor, Tensor, Tensor]:
        """(h_{M/2}, h_M, mask) of the source BERT over the batch's WordPiece stream."""
        out = self.bert(batch)
        return out.layer(self.half_layer), out.layer(self.top_layer), out.mask

    # ------------------------------------------------------------------ interface
    def encode(self, batch: "Batch") -> EncoderOut:
        """The source BERT's top and half layers, gated (the half-layer fusion) and projected to the coordinator's
        width."""
        half, top, mask = self.encoder_states(batch)
        return EncoderOut(out=self.src_proj(self.fuse_source(top, half)), mask=mask)

    def init_state(self, enc_out: EncoderOut) -> DecoderState:
        """A cache per target-BERT layer, and two per coordinator layer."""
        return DecoderState.empty(len(self.decoder.layers) + 2 * len(self.coordinator))

    def decode_step(self, prev_tokens: Tensor, enc_out: EncoderOut, state: DecoderState) -> Tensor:
        """One target token: the target BERT's next state, the coordinator over it and the source, the next token's
        logits."""
        r_t = self.decoder(prev_tokens, state, offset=state.step)  # (B, 1, H_tgt)
        h = self.run_coordinator(r_t, enc_out, state)
        state.step += prev_tokens.size(1)
        return self.output_logits(h[:, -1])  # (B, V)

    def forward(self, batch: "Batch") -> ModelOutput:
        """Teacher-forced logits; in training also the extra losses (KD, MLM, L_T) the config turns on."""
        half, top, mask = self.encoder_states(batch)
        enc_out = EncoderOut(out=self.src_proj(self.fuse_source(top, half)), mask=mask)
        r_t = self.decoder(batch.tgt_in)  # (B, T, H_tgt)
        h = self.run_coordinator(r_t, enc_out)  # (B, T, d)
        out = ModelOutput(logits=self.output_logits(h), enc_out=enc_out.out, dec_hidden=h)
        if self.training:  # the extra losses shape training only; validation loss stays L_NMT
            self.add_training_losses(out, batch, half, top, mask, r_t)
        return out

    def add_training_losses(self, out: ModelOutput, batch: "Batch", half: Tensor, top: Tensor, mask: Tensor,
                            r_t: Tensor) -> None:
        """KD states (Eq. 4), L_MLM and L_T (Eq. 8) into ``out`` for :func:`nmtcore.engine.losses.training_loss`."""
        cfg = self.cfg
        x = batch.extras
        if self.teacher is not None:
            out.kd = KDStates(student=half if cfg.kd_layer == "half" else top,  # h_{M/2} (Eq. 4) or h_M (L_fkd)
                              teacher=self.teacher(x["bert_ids"], mask, x["bert_segments"]).detach(),  # r_plm
                              mask=mask)
        if self.mlm_head is not None:
            ids = x["bert_ids"]
            enc = self.bert.encoder
            special = mask | ids.eq(enc.cls_id) | ids.eq(enc.sep_id)
            corrupted, selected = mlm_corrupt(ids, special, self.mask_token_id, self.mlm_head.bias.numel(),
                                              prob=cfg.mlm_prob, at_least_one=False)
            states = self.bert.run(corrupted, mask, x["bert_segments"])[-1]  # separate pass, h_M (B, Tb, H)
            logits = self.mlm_head(states[selected])  # (N, V_bert)
            out.mlm_loss = _mean_nll(logits, ids[selected], states)
        if cfg.tgt_lm_loss:
            keep = batch.tgt_out.ne(self.pad_id) & (torch.rand(batch.tgt_out.shape, device=r_t.device)
                                                   < cfg.tgt_lm_fraction)  # (B, T)
            logits = F.linear(r_t[keep], self.decoder.word.weight)  # Eq. 8: p(t_j | t_<j), no source
            out.target_lm_loss = _mean_nll(logits, batch.tgt_out[keep], r_t)


def _mean_nll(logits: Tensor, target: Tensor, anchor: Tensor) -> Tensor:
    """Mean cross-entropy in fp32 (:func:`~nmtcore.nn.cross_entropy.mean_nll`: no (N, V) fp32 copy of the
    logits); 0 (still in the graph through ``anchor``) when nothing is selected."""
    if target.numel() == 0:
        return anchor.float().sum() * 0.0
    return mean_nll(logits, target)


__all__ = ["PlmSponsored", "TargetBertDecoder", "CoordinatorAttention"]
