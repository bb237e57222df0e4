"""Two-stage interactive fusion of BERT into NMT (seed 004, the mask-knowledge-matrix model): BERT's layers
fused by a GLU, a mask knowledge matrix at the source embeddings, an adaptive fusion after the encoder.

The Transformer baseline is kept whole (embeddings, encoder and decoder stacks, output layer, with the
baseline's parameter names, so a trained baseline warm-starts this model: Section 2.4, ``train.init_from``,
:func:`nmtcore.engine.warm_start`); BERT enters the source side only, in two places:

1. **Multi-layer BERT fusion** (Eq. 1-2, :class:`LayerFusion`): ``B = GLU(Concat(B_1..B_n) W)``,
   ``W ∈ R^{n×2}`` mixes the layer axis into two channels, the GLU gates the first by σ of the second.
   B_1..B_n are BERT's layers 1..L (the embeddings, hidden state 0, are not a layer).
2. **Mask knowledge matrix** at the embedding layer (Eq. 3-6, :class:`MaskKnowledge`):
   ``A = softmax(E (B_CLS w1 + b)ᵀ / √d)`` over the source positions, ``m_i = 1 if a_i < θ``
   (``model.mask_threshold``, the paper's 0.03), masked rows of E filled with ``model.mask_fill``
   (−1e-9) to give Ẽ, gate ``G = λ B + (1 − λ) E``, ``λ = ReLU([B w3 ; E] w2)``, new embedding ``Ẽ + G``.
   The trainer reports the fraction of validation source tokens masked (``valid_masked_fraction``) from
   ``ModelOutput.knowledge_mask``.
3. **Adaptive fusion** after the encoder (Eq. 7-9, :class:`AdaptiveFusion`): single-head attention from the
   encoder output E_N to B, ``η = σ(U E_N + V E_attn)``, ``E_out = (1 − η) E_N + η E_attn`` is what the
   (unchanged) decoder attends to. Decoding therefore needs no BERT state: the decoder is the baseline's.

Where the paper is ambiguous, the choices made here (config fields where they plausibly matter):

- **Two tokenizations.** B lives on BERT's WordPiece stream, E on the NMT subwords. Eq. 5-6 add them
  position by position, so B is pooled per NMT token through the BERT stream's word alignment
  (``batch.extras["bert_align"]``, :func:`nmtcore.bert.pool_to_tokens`: the mean of the WordPieces of the
  token's whitespace word). Positions with no WordPiece (eos, words cut by BERT's max length) get a zero
  row. B_CLS is position 0 of the stream ([CLS]); Eq. 7 attends over the whole stream (its own padding
  masked), where no pooling is needed.
- **E** is the baseline's source embedding (token embedding × √d plus positions) *before* dropout; the
  embedding dropout is applied once, to the new embedding ``Ẽ + G``. Eq. 3's softmax excludes padding.
- **√d in Eq. 3** (``model.mask_scale="sqrt_d"``, the default; ``"d"`` available), d = ``model.d_model``
  (the paper's 512). The extracted equation reads ``E(B_CLS w1 + b)ᵀ / d`` with the radical lost, as in
  Eq. 7, which is scaled dot-product attention and so ``/ √d``. We read both as √d: dividing by d = 512
  flattens the softmax over positions to ≈ 1/length for any content, so ``a_i < θ`` would mask every
  token of a sentence longer than ~1/θ subwords and none of a shorter one — a mask by length, which
  contradicts the paper's Table 5 (BLEU moves at every step of θ by 0.01) and its own account (the mask
  removes the tokens least similar to B_CLS). The model logs the scale it uses.
- **w1, b learn by a straight-through estimator** (``model.mask_estimator="straight_through"``, the
  default): Eq. 4 is a step, so nothing differentiable reaches A. The paper calls w1 trainable but gives
  no estimator; the forward pass uses the hard mask M exactly as written, the backward pass the gradient
  of the soft mask ``σ((θ − a_i) / τ)`` (``model.mask_temperature`` τ, 0.01), so w1, b (and E, through A)
  learn which tokens to mask. ``"frozen"`` keeps w1, b at their seeded initial values (built with
  ``requires_grad=False``, so a multi-GPU DDP run does not fail on parameters without a gradient). Either
  way they form their own parameter group ``mask_query``; checkpoints carry them.
- **Eq. 5's B** is ``B w3`` (B's width is BERT's, E's is d_model; Eq. 6 already projects it by w3);
  **λ is element-wise** (w2 ∈ R^{2d×d}: the paper calls w2 a matrix). w2, w3, U, V have no bias (none is
  written); Eq. 3 has its b. λ is a ReLU as written (unbounded, so 1 − λ may be negative).
- **Eq. 7** goes through the shared :class:`~nmtcore.nn.CrossAttention` with one head: query, key/value
  and output projections (E_N and B differ in width, so Eq. 7 cannot be applied without them) and the
  1/√d scaling (the extracted "/ d" lost its radical, as in Eq. 3). Its dropout is
  ``model.fusion_attention_dropout`` (0.2, Section 3.2).
- **GLU init** (unspecified in the paper): as BERT-JAM's Eq. 11, W's value column selects B_n and its gate
  column is 0, so ``B = B_n / 2`` at the start, a BERT-only-last-layer model (M1) at half scale.
- **θ = 1** masks every position whose a_i < 1, i.e. every non-padding position of any source with two or
  more positions (every sentence has its eos); a source of one position has a_1 = 1 and is never masked.

Ablations (Table 4) are explicit fields, each also a registered variant (:mod:`nmtcore.models`):
M1 ``bert_layers="last"`` (B = B_L, no GLU); M2 ``embedding_fusion="gate"`` (no mask matrix: the new
embedding is ``E + G``; Table 4's M2 and Table 5's θ = 0 report the same 30.52, i.e. the gate stayed;
``"none"`` drops the whole embedding stage); M3 ``adaptive_fusion=false`` (the decoder reads E_N).

What a trained model draws from each of BERT's ways in (:mod:`nmtcore.diagnostics`): inference switches that
turn the mask, the gate's BERT part, the adaptive fusion or all three off in the tested weights
(:meth:`MaskFusion.inference_switches`), the GLU's weight per BERT layer (:meth:`MaskFusion.bert_usage`) and,
over the validation set, the masked fraction and the mean gate weights λ and η (:meth:`MaskFusion.usage_probe`).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Iterator

import torch
from torch import Tensor, nn

from nmtcore.bert import BertLayer, BertOut, pool_to_tokens
from nmtcore.config import MaskFusionConfig
from nmtcore.models.base import ModelOutput
from nmtcore.models.transformer import Transformer
from nmtcore.nn import CrossAttention, EncoderOut, compute_dtype, dropout

if TYPE_CHECKING:
    from nmtcore.data import Batch

log = logging.getLogger("nmtcore.models")

# ---------------------------------------------------------------------- multi-layer BERT fusion (Eq. 1-2)
class LayerFusion(nn.Module):
    """Eq. 1-2: ``B = GLU(Concat(B_1..B_n) W)``, W (n → 2) over the layer axis; GLU(a, g) = a ⊙ σ(g).

    ``proj.weight`` (2, n): row 0 mixes the value channel, row 1 the gate. Init: value = B_n, gate = 0,
    so ``B = B_n / 2`` (the paper gives no init; BERT-JAM's Eq. 11).
    """

    def __init__(self, num_bert_layers: int) -> None:
        super().__init__()
        self.proj = nn.Linear(num_bert_layers, 2, bias=False)  # W ∈ R^{n×2}
        with torch.no_grad():
            self.proj.weight.zero_()
            self.proj.weight[0, -1] = 1.0

    def forward(self, states: Tensor) -> Tensor:
        """states (B, T, n, H) → (B, T, H). One einsum over the layer axis (not ``proj`` on the transposed
        states, which copies them into the (B, T, H, n) layout first)."""
        value, gate = torch.einsum("btnh,kn->kbth", states, self.proj.weight.to(states.dtype))  # Eq. 1-2: B̂ W
        return value * torch.sigmoid(gate)  # Eq. 2: GLU  (B, T, H)


# ---------------------------------------------------------------------- mask knowledge matrix (Eq. 3-6)
class MaskKnowledge(nn.Module):
    """Eq. 3-6 at the source embedding layer; ``use_mask=False`` is M2 (the gate only: E + G).

    ``mask_query`` is (w1, b) of Eq. 3, ``bert_proj`` w3 and ``gate`` w2 of Eq. 6. ``scale`` divides Eq. 3's
    scores (√d or d, see the module docstring). ``estimator``: ``"straight_through"`` (w1, b learn through
    the soft mask's gradient, temperature ``temperature``) or ``"frozen"`` (w1, b fixed).
    """

    def __init__(self, d_model: int, bert_dim: int, threshold: float, fill: float, scale: float, use_mask: bool,
                 estimator: str = "straight_through", temperature: float = 0.01) -> None:
        super().__init__()
        self.threshold, self.fill, self.scale = threshold, fill, scale
        self.estimator, self.temperature = estimator, temperature
        # Inference switches (MaskFusion.switched): False = Eq. 4's M all 0 (Ẽ = E) / λ = 0 in Eq. 5 (G = E).
        self.mask_on = self.bert_gate_on = True
        self.tap: Callable[[Tensor, Tensor], None] | None = None  # usage probe: called with (λ, src_mask)
        self.mask_query = nn.Linear(bert_dim, d_model) if use_mask else None  # w1, b (Eq. 3)
        if self.mask_query is not None and estimator == "frozen":
            self.mask_query.requires_grad_(False)
        self.bert_proj = nn.Linear(bert_dim, d_model, bias=False)  # w3 (Eq. 6)
        self.gate = nn.Linear(2 * d_model, d_model, bias=False)  # w2 (Eq. 6)
        nn.init.xavier_uniform_(self.bert_proj.weight)
        nn.init.xavier_uniform_(self.gate.weight)

    def attention(self, emb: Tensor, cls: Tensor, src_mask: Tensor) -> Tensor:
        """A of Eq. 3 in fp32: emb (B, S, C), cls = B_CLS (B, H), src_mask (B, S) True = padding → (B, S),
        a softmax over each sentence's real positions (0 at padding)."""
        with torch.autocast(emb.device.type, enabled=False):  # A and its threshold in fp32
            q = self.mask_query(cls.float())  # B_CLS w1 + b  (B, C)
            scores = torch.einsum("bsc,bc->bs", emb.float(), q) / self.scale  # (B, S)
            return torch.softmax(scores.masked_fill(src_mask, float("-inf")), dim=-1)  # Eq. 3, over positions

    def knowledge_mask(self, emb: Tensor, cls: Tensor, src_mask: Tensor) -> Tensor:
        """M of Eq. 4: (B, S) bool, True = masked (a_i < θ); padding is never marked."""
        return (self.attention(emb, cls, src_mask) < self.threshold) & ~src_mask  # Eq. 4

    def forward(self, emb: Tensor, cls: Tensor, bert_tok: Tensor, src_mask: Tensor) -> tuple[Tensor, Tensor]:
        """emb = E (B, S, C); cls = B_CLS (B, H); bert_tok = B pooled per NMT token (B, S, H).
        Returns the new embedding Ẽ + G (B, S, C) and M (B, S) bool (all False without the mask)."""
        if self.bert_gate_on:
            b = self.bert_proj(bert_tok.to(emb.dtype))  # B w3  (B, S, C)
            lam = torch.relu(self.gate(torch.cat([b, emb], dim=-1)))  # Eq. 6: λ  (B, S, C)
            if self.tap is not None:
                self.tap(lam, src_mask)
            g = lam * b + (1 - lam) * emb  # Eq. 5: G
        else:
            g = emb  # switched off: λ = 0, G = E
        if self.mask_query is None or not self.mask_on:  # M2 (or switched off): no mask matrix, Ẽ = E
            return emb + g, torch.zeros_like(src_mask)
        a = self.attention(emb, cls, src_mask)  # (B, S)
        m = (a < self.threshold) & ~src_mask  # Eq. 4  (B, S)
        if self.estimator == "frozen" or not torch.is_grad_enabled():
            masked = emb.masked_fill(m.unsqueeze(-1), self.fill)  # Ẽ: M' (B, S, 1) rows filled
        else:
            # Straight-through: forward the hard M exactly (soft − soft.detach() is 0), backward σ's gradient.
            soft = torch.sigmoid((self.threshold - a) / self.temperature) * ~src_mask  # (B, S)
            w = (m.float() + (soft - soft.detach())).unsqueeze(-1).to(emb.dtype)  # (B, S, 1), values exactly M'
            masked = emb * (1 - w) + self.fill * w  # Ẽ: the same values as masked_fill
        return masked + g, m


# ---------------------------------------------------------------------- adaptive fusion (Eq. 7-9)
class AdaptiveFusion(nn.Module):
    """Eq. 7-9: single-head attention from E_N to B, then the sigmoid gate η between the two."""

    def __init__(self, d_model: int, bert_dim: int, attention_dropout: float) -> None:
        super().__init__()
        self.attn = CrossAttention(d_model, 1, attention_dropout, kdim=bert_dim)  # Eq. 7, one head
        self.u = nn.Linear(d_model, d_model, bias=False)  # U (Eq. 8)
        self.v = nn.Linear(d_model, d_model, bias=False)  # V (Eq. 8)
        nn.init.xavier_uniform_(self.u.weight)
        nn.init.xavier_uniform_(self.v.weight)
        self.on = True  # inference switch (MaskFusion.switched): False = η = 0, E_out = E_N
        self.tap: Callable[[Tensor], None] | None = None  # usage probe: called with η

    def forward(self, enc: Tensor, bert: Tensor, bert_mask: Tensor) -> Tensor:
        """enc = E_N (B, S, C); bert = B (B, Tb, H), bert_mask (B, Tb) True = padding → E_out (B, S, C)."""
        if not self.on:
            return enc
        e_attn = self.attn(enc, bert, bert_mask)  # Eq. 7: E^B_attn  (B, S, C)
        eta = torch.sigmoid(self.u(enc) + self.v(e_attn))  # Eq. 8
        if self.tap is not None:
            self.tap(eta)
        return (1 - eta) * enc + eta * e_attn  # Eq. 9


# ---------------------------------------------------------------------- the model
class MaskFusion(Transformer):
    """The baseline with BERT fused at the source embeddings (Eq. 3-6) and after the encoder (Eq. 7-9).

    Embeddings, layer stacks, norms and output projection are the baseline's modules under the baseline's
    names; ``layer_fusion``, ``knowledge`` and ``adaptive`` are new (each absent in the ablation that drops
    it), as is the BERT.
    """

    bert_role: ClassVar[str] = "input"  # owns its BertLayer (the baseline's KD teacher is not built)

    def __init__(self, cfg: MaskFusionConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__(cfg, vocab_size, pad_id, bos_id, eos_id)
        # All hidden states 0..L (the cache stores these, shared with BERT-JAM's) of which Eq. 1 reads
        # 1..L; M1 reads L only.
        self.bert = BertLayer(cfg.bert, layers=None if cfg.bert_layers == "all" else (-1,))
        bert_dim = self.bert.hidden_size
        self.layer_fusion = LayerFusion(self.bert.num_layers) if cfg.bert_layers == "all" else None
        self.knowledge = None
        if cfg.embedding_fusion != "none":
            scale = math.sqrt(cfg.d_model) if cfg.mask_scale == "sqrt_d" else float(cfg.d_model)
            self.knowledge = MaskKnowledge(cfg.d_model, bert_dim, cfg.mask_threshold, cfg.mask_fill, scale,
                                           cfg.embedding_fusion == "mask", cfg.mask_estimator, cfg.mask_temperature)
            if cfg.embedding_fusion == "mask":
                log.info("mask knowledge matrix (Eq. 3-4): scores / %s (d = %d), θ = %g, w1/b %s",
                         "√d" if cfg.mask_scale == "sqrt_d" else "d", cfg.d_model, cfg.mask_threshold,
                         f"straight-through (τ = {cfg.mask_temperature:g})" if cfg.mask_estimator == "straight_through"
                         else "frozen at their initial values")
        self.adaptive = (AdaptiveFusion(cfg.d_model, bert_dim, cfg.fusion_attention_dropout)
                         if cfg.adaptive_fusion else None)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """``bert`` (the BERT), ``mask_query`` (Eq. 3's w1, b; empty without the mask) and ``nmt``
        (everything else, the fusion modules included)."""
        query: list[nn.Parameter] = []
        if self.knowledge is not None and self.knowledge.mask_query is not None:
            query = list(self.knowledge.mask_query.parameters())
        return self.groups(bert=self.bert.parameters(), mask_query=query)

    def inference_switches(self) -> dict[str, Callable[[], ContextManager[None]]]:
        """Decoding as tested and with each of BERT's ways in switched off, those this variant has: ``mask_off``
        (Eq. 4's M = 0: Ẽ = E, the gate as trained), ``gate_bert_off`` (λ = 0 in Eq. 5: G = E, the mask as
        trained), ``adaptive_off`` (η = 0 in Eq. 9: the decoder reads E_N) and ``bert_off`` (all of them: the
        new embedding 2E, no BERT anywhere). ``tested`` minus each is what that way in adds to the tested model.

        A switch keeps the scale the encoder was trained on: with BERT's part removed the embedding stage still
        adds Ẽ and G (E where BERT's part was), rather than dropping the stage (E alone, which the trained
        encoder never saw)."""
        parts = {"mask_off": ("mask",) if self.knowledge is not None and self.knowledge.mask_query is not None
                 else (),
                 "gate_bert_off": ("gate",) if self.knowledge is not None else (),
                 "adaptive_off": ("adaptive",) if self.adaptive is not None else ()}
        switches: dict[str, tuple[str, ...]] = {"tested": (), **{k: v for k, v in parts.items() if v}}
        switches["bert_off"] = tuple(p for v in parts.values() for p in v)
        return {name: (lambda off=off: self.switched_off(*off)) for name, off in switches.items()}

    @contextlib.contextmanager
    def switched_off(self, *parts: str) -> Iterator[None]:
        """Inference with these of BERT's ways in switched off (``mask``, ``gate``, ``adaptive``; see
        :meth:`inference_switches`); restored after the block."""
        unknown = set(parts) - {"mask", "gate", "adaptive"}
        if unknown:
            raise ValueError(f"unknown mask-fusion switch {sorted(unknown)}: mask, gate, adaptive")
        k, a = self.knowledge, self.adaptive
        saved = (k.mask_on, k.bert_gate_on) if k is not None else None, a.on if a is not None else None
        try:
            if k is not None:
                k.mask_on, k.bert_gate_on = "mask" not in parts, "gate" not in parts
            if a is not None:
                a.on = "adaptive" not in parts
            yield
        finally:
            if k is not None:
                k.mask_on, k.bert_gate_on = saved[0]
            if a is not None:
                a.on = saved[1]

    def bert_usage(self) -> dict[str, float]:
        """The GLU's weights on each BERT layer (Eq. 1-2, ``W``): ``glu_value/L3`` BERT layer 3's weight in the
        value channel, ``glu_gate/L3`` in the gate (at init 1 on the last layer's value, 0 elsewhere). None for
        M1 (BERT's last layer only, no GLU)."""
        if self.layer_fusion is None:
            return {}
        w = self.layer_fusion.proj.weight.detach().float()  # (2, n)
        return {f"glu_{channel}/L{i + 1}": float(x) for channel, row in zip(("value", "gate"), w)
                for i, x in enumerate(row)}

    @contextlib.contextmanager
    def usage_probe(self) -> Iterator[dict[str, float]]:
        """Over the forwards in the block, per real source token: ``masked_fraction``, the share whose embedding
        the knowledge matrix masked (Eq. 4); ``gate_lambda``, the mean of Eq. 6's λ (BERT's weight in the gate
        G, Eq. 5; a ReLU, so unbounded); ``adaptive_eta``, the mean of Eq. 8's η (the weight of the attention
        over BERT in E_out, Eq. 9). Each only where the variant has its stage."""
        out: dict[str, float] = {}
        counts = [0, 0]  # masked, real
        sums = {"gate_lambda": [0.0, 0], "adaptive_eta": [0.0, 0]}  # sum over real positions' channel means, count
        real: list[Tensor] = []  # the current forward's real source positions (B, S)

        def add(name: str, values: Tensor, keep: Tensor) -> None:
            per_token = values.float().mean(-1)[keep]  # (real tokens,)
            sums[name][0] += float(per_token.sum())
            sums[name][1] += per_token.numel()

        def batch_in(module: nn.Module, args: tuple) -> None:
            real[:] = [~args[0].src_mask]

        def count(module: nn.Module, args: tuple, output: ModelOutput) -> None:
            if output.knowledge_mask is not None:
                counts[0] += int(output.knowledge_mask.sum())
                counts[1] += int((~args[0].src_mask).sum())

        handles = [self.register_forward_pre_hook(batch_in), self.register_forward_hook(count)]
        if self.knowledge is not None:
            self.knowledge.tap = lambda lam, src_mask: add("gate_lambda", lam, ~src_mask)
        if self.adaptive is not None:
            self.adaptive.tap = lambda eta: add("adaptive_eta", eta, real[0])
        try:
            yield out
        finally:
            for handle in handles:
                handle.remove()
            for module in (self.knowledge, self.adaptive):
                if module is not None:
                    module.tap = None
        if counts[1]:
            out["masked_fraction"] = counts[0] / counts[1]
        out.update({name: total / n for name, (total, n) in sums.items() if n})

    # ------------------------------------------------------------------ pieces
    def bert_memory(self, bert_out: BertOut) -> Tensor:
        """B: the GLU over BERT layers 1..L (Eq. 1-2), or B_L (M1). (B, Tb, H)"""
        if self.layer_fusion is None:
            return bert_out.last
        return self.layer_fusion(bert_out.stack(1, compute_dtype(bert_out.mask.device)))  # (B, Tb, L, H) → (B, Tb, H)

    def embed_source(self, batch: "Batch", bert: Tensor) -> tuple[Tensor, Tensor | None]:
        """The encoder's input: Ẽ + G (Eq. 3-6), E + G (M2) or E, then dropout. Returns (B, S, C) and
        M (B, S) bool (None without the embedding stage)."""
        x = self.src_embed(batch.src) * self.embed_scale + self.positions(batch.src.size(1))  # E (B, S, C)
        m = None
        if self.knowledge is not None:
            bert_tok, _ = pool_to_tokens(bert, batch.extras["bert_align"])  # B per NMT token (B, S, H)
            x, m = self.knowledge(x, bert[:, 0], bert_tok, batch.src_mask)  # B_CLS = [CLS], stream position 0
        return dropout(x, self.cfg.dropout, self.training), m

    def encode_with_mask(self, batch: "Batch") -> tuple[EncoderOut, Tensor | None]:
        """:meth:`encode` plus the knowledge mask M (B, S) (None without the embedding stage)."""
        bert_out = self.bert(batch)
        bert = self.bert_memory(bert_out)  # B (B, Tb, H)
        x, m = self.embed_source(batch, bert)
        for layer in self.encoder_layers:
            x = layer(x, batch.src_mask)
        x = self.encoder_norm(x)  # E_N (B, S, C)
        if self.adaptive is not None:
            x = self.adaptive(x, bert, bert_out.mask)  # E_out (Eq. 9)
        return EncoderOut(out=x, mask=batch.src_mask), m

    # ------------------------------------------------------------------ interface
    def encode(self, batch: "Batch") -> EncoderOut:
        """The encoder output of :meth:`encode_with_mask` (the knowledge mask dropped)."""
        return self.encode_with_mask(batch)[0]

    def forward(self, batch: "Batch") -> ModelOutput:
        """Teacher-forced logits, with the knowledge mask (which source embeddings Eq. 4 masked) returned for the
        validation figure."""
        enc_out, m = self.encode_with_mask(batch)
        h = self.run_decoder(batch.tgt_in, enc_out)  # (B, T, C)
        return ModelOutput(logits=self.output_logits(h), enc_out=enc_out.out, dec_hidden=h,
                           knowledge_mask=m)  # m (B, S) True = embedding masked (Eq. 4), None without the stage
