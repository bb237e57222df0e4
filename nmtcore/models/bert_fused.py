"""BERT-fused NMT (Zhu et al., ICLR 2020; seed 002): BERT's last layer attended from every encoder and
decoder layer, the two attentions averaged, with drop-net.

Architecture (Eq. 1-2), on top of the Transformer baseline (same embeddings, residuals, layer norms):

- encoder layer l: ``h̃ = ½ (attn_S(h, H_E, H_E) + attn_B(h, H_B, H_B))`` then FFN;
- decoder layer l: ``ŝ = attn_S(s, S_<t+1, S_<t+1)``, ``s̃ = ½ (attn_B(ŝ, H_B, H_B) + attn_E(ŝ, H_E^L, H_E^L))``
  then FFN.

``attn_B`` is a :class:`~nmtcore.nn.CrossAttention` whose keys/values come from BERT's last layer
(``kdim = vdim = BERT width``). Parameter names match the baseline's (``self_attn``, ``cross_attn``,
``*_res``, ``ffn``, embeddings), so a trained baseline checkpoint warm-starts this model
(``train.init_from``, :func:`nmtcore.engine.warm_start.warm_start`) and only ``bert_attn`` starts fresh, the papers'
procedure.

Drop-net (Eq. 3, :class:`~nmtcore.nn.DropNet`), probability ``model.p_net``: per layer and per training
forward, draw U ~ U(0, 1); ``U < p/2`` → the first branch only, ``U > 1 − p/2`` → the second only, else the
average; at inference the expectation, i.e. the average (Eq. 1). Deliberate departures from the
original code:

- with drop-net off (``p_net = 0``) the original code *summed* the two branches; we average, as Eq. 1;
- the original drew U from an unseeded numpy RNG; ours comes from a ``torch.Generator`` seeded at
  construction from ``torch.initial_seed()`` (= ``train.seed``: the trainer seeds torch before building
  the model) whose state is a persistent buffer (``drop_net_rng``), so checkpoints carry it and a resume
  draws the same U sequence, bit-identically;
- the branch drop-net switches off is not run at all, so its weights get no gradient and torch's Adam skips
  them (no momentum step, no step count). The original computes both branches and weights one by 0: a zero
  gradient, on which Adam still moves the weights by their momentum. At p_net = 1 each branch is off about
  half the time, so the new BERT attention moves less per update than in the original.
  ``model.drop_net_zero_grads=true`` gives a skipped branch a zero gradient (at the cost of one scalar per
  weight, not the branch), as the original; off by default until the drop-net study has measured it. Under
  CUDA graphs (``train.cuda_graphs``) both branches run, weighed by the draw, and the switched-off one still
  gets no Adam step (:class:`~nmtcore.nn.drop_net.PlannedDraws`).
- a frozen BERT runs in eval mode, without its dropout, so its states come from the frozen-feature cache; the
  authors' fairseq only stops BERT's gradients and puts it in train mode with the rest of the model, so in their
  training H_B carries BERT's dropout (0.1) afresh every forward. ``model.bert.dropout_when_frozen=true`` does the
  same here (the cache is then off). The paper says only that BERT is not trained further;
- ``bert_attn`` starts as every cross-attention here: keys and values from one fused (2d × kdim) projection under
  Xavier (a bound 0.85-0.89 of the authors' separate projections' at the studies' widths) and ``nn.Linear``'s
  default biases on q, k and v, where the authors zero them; the output projection as theirs;
- dropout falls once on the combined branches before the residual; the authors drop each branch out with its own
  mask, then add them. At p_net 1.0 (the studies' and the authors' setting) one branch runs a layer and the two are
  the same; below it the expectation is, the noise is not;
- the authors' runs train at 5e-4 after 4k warm-up updates with ``--weight-decay 0.0001``; the studies run the
  platform's Multi30k schedule (1e-3 after 400, ``search_spaces/protocols.py``) and no weight decay. Their
  fairseq Adam decays decoupled, a factor 1 − 10⁻⁴·lr an update, negligible over a Multi30k run;
  ``train.weight_decay`` is torch Adam's L2 term, which would not reproduce it.

BERT is frozen unless ``model.bert.freeze=false`` (fine-tuning); a frozen BERT's features come from the
frozen-feature cache (:mod:`nmtcore.bert`).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Iterator

import torch
from torch import Tensor, nn

from nmtcore.bert import BertLayer
from nmtcore.config import BertFusedConfig
from nmtcore.models.transformer import Transformer
from nmtcore.nn import (CrossAttention, DecoderState, DropNet, EncoderOut, FeedForward, LayerCache, Residual,
                        SelfAttention, combine)
from nmtcore.nn.drop_net import PlannedDraws

if TYPE_CHECKING:
    from nmtcore.data import Batch


# ---------------------------------------------------------------------- layers
class BertFusedEncoderLayer(nn.Module):
    """Eq. 1: self-attention and BERT-encoder attention on the same input, combined, then FFN."""

    def __init__(self, cfg: BertFusedConfig, bert_dim: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = SelfAttention(d, cfg.heads, cfg.attention_dropout)
        self.bert_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout, kdim=bert_dim)
        self.self_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.zero_grads = cfg.drop_net_zero_grads

    def forward(self, x: Tensor, mask: Tensor, bert: Tensor, bert_mask: Tensor, w: tuple[float, float]) -> Tensor:
        """``w``: drop-net weights of (attn_S, attn_B) for this layer and forward."""
        h = self.self_res.before(x)  # (B, S, C)
        y = combine(lambda: self.self_attn(h, key_padding_mask=mask),  # attn_S (B, S, C)
                    lambda: self.bert_attn(h, bert, bert_mask), w)  # attn_B (B, S, C)
        if self.zero_grads and self.training and not isinstance(w[0], Tensor):  # planned: both ran, zeros already
            y = with_zero_grads(y, (self.self_attn, self.bert_attn), w)
        x = self.self_res.after(x, y)  # Eq. 1 / Eq. 3
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))


class BertFusedDecoderLayer(nn.Module):
    """Eq. 2: causal self-attention, then BERT-decoder and encoder-decoder attention combined, then FFN."""

    def __init__(self, cfg: BertFusedConfig, bert_dim: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = SelfAttention(d, cfg.heads, cfg.attention_dropout)
        self.self_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.bert_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout, kdim=bert_dim)
        self.cross_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout)
        self.cross_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.zero_grads = cfg.drop_net_zero_grads

    def forward(self, x: Tensor, enc: Tensor, enc_mask: Tensor, bert: Tensor, bert_mask: Tensor,
                w: tuple[float, float], cache: LayerCache | None = None) -> Tensor:
        """``w``: drop-net weights of (attn_B, attn_E); always (½, ½) when decoding incrementally (eval)."""
        x = self.self_res.after(x, self.self_attn(self.self_res.before(x), causal=True, cache=cache))  # ŝ
        h = self.cross_res.before(x)  # (B, T, C)
        y = combine(lambda: self.bert_attn(h, bert, bert_mask, cache=cache, name="bert"),  # attn_B (B, T, C)
                    lambda: self.cross_attn(h, enc, enc_mask, cache=cache, name="enc"), w)  # attn_E (B, T, C)
        if self.zero_grads and self.training and not isinstance(w[0], Tensor):
            y = with_zero_grads(y, (self.bert_attn, self.cross_attn), w)
        x = self.cross_res.after(x, y)  # Eq. 2 / Eq. 3 (decoder)
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))


def with_zero_grads(y: Tensor, branches: tuple[nn.Module, nn.Module], w: tuple[float, float]) -> Tensor:
    """``y`` unchanged in value, but joined to the weights of the branch ``w`` switched off (weight 0) by a term
    that is 0: backward gives each of them a zero gradient (``model.drop_net_zero_grads``)."""
    off = [m for m, weight in zip(branches, w) if weight == 0.0]
    params = [p for m in off for p in m.parameters() if p.requires_grad]
    if not params:
        return y
    return y + torch.stack([p.reshape(-1)[0] for p in params]).sum().mul(0.0).to(y.dtype)


# ---------------------------------------------------------------------- the model
class BertFused(Transformer):
    """The baseline with every layer fused with BERT's last layer (Eq. 1-3).

    Embeddings, positions, output projection and final norms are the baseline's (inherited); the layer
    stacks are replaced by the fused layers, keeping the baseline's parameter names.
    """

    bert_role: ClassVar[str] = "input"  # owns its BertLayer (the baseline's KD teacher is not built)
    cuda_graph_safe: ClassVar[bool] = True  # drop-net planned on the host before each replay (graph_draws)

    def __init__(self, cfg: BertFusedConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__(cfg, vocab_size, pad_id, bos_id, eos_id)
        self.bert = BertLayer(cfg.bert, layers=(-1,))  # H_B: BERT's last layer only
        bert_dim = self.bert.hidden_size
        # One generator per stack, so encoder and decoder draws do not depend on each other's count.
        seed = torch.initial_seed()
        self.enc_drop_net = DropNet(cfg.p_net, seed)
        self.dec_drop_net = DropNet(cfg.p_net, seed + 1)
        self.encoder_layers = nn.ModuleList(BertFusedEncoderLayer(cfg, bert_dim)
                                            for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(BertFusedDecoderLayer(cfg, bert_dim)
                                            for _ in range(cfg.decoder_layers))

    def graph_draws(self, device: torch.device) -> PlannedDraws:
        """Drop-net's draws, planned on the host: per layer, encoder (attn_S, attn_B) then decoder (attn_B,
        attn_E), in the order a forward draws them."""
        return PlannedDraws([(self.enc_drop_net, [(l.self_attn, l.bert_attn) for l in self.encoder_layers]),
                             (self.dec_drop_net, [(l.bert_attn, l.cross_attn) for l in self.decoder_layers])],
                            device)

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """``bert`` and everything else (``nmt``)."""
        return self.groups(bert=self.bert.parameters())

    # Inference weights per stack: encoder (attn_S, attn_B), decoder (attn_B, attn_E).
    BRANCHES: ClassVar[dict[str, tuple[tuple[float, float], tuple[float, float]]]] = {
        "mix": ((0.5, 0.5), (0.5, 0.5)),  # Eq. 1-2: what the model is tested with
        "nmt_only": ((1.0, 0.0), (0.0, 1.0)),  # BERT switched off: self- and encoder-decoder attention alone
        "bert_only": ((0.0, 1.0), (1.0, 0.0)),  # the BERT-attention branches alone
        "enc_bert_off": ((1.0, 0.0), (0.5, 0.5)),  # BERT reaches the model through the decoder's attn_B only
        "dec_bert_off": ((0.5, 0.5), (0.0, 1.0)),  # ... through the encoder's only
    }

    def inference_switches(self) -> dict[str, Callable[[], ContextManager[None]]]:
        """Decoding with Eq. 1's mix, the NMT branches alone and the BERT branches alone (every layer), and with
        BERT switched off in one stack (the encoder's or the decoder's layers), the other mixing as Eq. 1-2:
        what each side's BERT attention adds to the tested model."""
        return {name: (lambda w=w: self.branch_weights(*w)) for name, w in self.BRANCHES.items()}

    @contextlib.contextmanager
    def branch_weights(self, enc: tuple[float, float], dec: tuple[float, float]) -> Iterator[None]:
        """Inference with these drop-net weights in every encoder / decoder layer; restored after the block."""
        saved = self.enc_drop_net.inference_weights, self.dec_drop_net.inference_weights
        self.enc_drop_net.inference_weights, self.dec_drop_net.inference_weights = enc, dec
        try:
            yield
        finally:
            self.enc_drop_net.inference_weights, self.dec_drop_net.inference_weights = saved

    def run_decoder(self, tgt_in: Tensor, enc_out: EncoderOut, state: DecoderState | None = None) -> Tensor:
        """The decoder stack: each layer averages its encoder-decoder attention with attention over BERT's states (Eq.
        2, drop-net mixing the two), the BERT states taken from ``enc_out.extras``."""
        offset = state.step if state is not None else 0
        x = self.embed(tgt_in, self.tgt_embed, offset)  # (B, T, C)
        bert, bert_mask = enc_out.extras["bert"], enc_out.extras["bert_mask"]  # (B, Tb, H), (B, Tb)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, enc_out.out, enc_out.mask, bert, bert_mask, self.dec_drop_net.weights(),
                      cache=state.layers[i] if state is not None else None)
        return self.decoder_norm(x)

    def encode(self, batch: "Batch") -> EncoderOut:
        """H_B = BERT(x), then the encoder stack: each layer averages self-attention with attention over H_B (Eq. 1,
        drop-net mixing the two); H_B rides along in ``extras`` for the decoder."""
        bert_out = self.bert(batch)
        bert, bert_mask = bert_out.last, bert_out.mask  # H_B (B, Tb, H), (B, Tb)
        x = self.embed(batch.src, self.src_embed)  # (B, S, C)
        for layer in self.encoder_layers:
            x = layer(x, batch.src_mask, bert, bert_mask, self.enc_drop_net.weights())
        return EncoderOut(out=self.encoder_norm(x), mask=batch.src_mask,
                          extras={"bert": bert, "bert_mask": bert_mask})
