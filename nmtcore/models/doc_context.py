"""BERT as a document-level context encoder (seed 003): a frozen BERT reads the previous sentence(s) and the
current one, and its last layer C_B enters the Transformer's encoder and decoder through context gates.

Architecture, on top of the Transformer baseline (same embeddings, residuals, layer norms, FFNs):

- **Context encoder** (Sec. 2.2): BERT's input is ``[CLS] context [SEP] current [SEP]`` with segment ids
  0 for ``[CLS] context [SEP]`` and 1 for ``current [SEP]`` (:class:`nmtcore.bert.WordPieceEncoder`); C_B is
  BERT's last layer. The context segment is built by :class:`DocContextSource`, which this model installs
  on its :class:`~nmtcore.bert.BertLayer` (``context_source``), so the stream (and the frozen-feature cache)
  is made once per split by :func:`nmtcore.bert.prepare_bert_inputs`.
- **Encoder layer** (Eq. 2-5): ``B = MultiHead(S, S, S)``, ``D = MultiHead(S, C_B, C_B)`` on the same
  input, ``g = σ(W_g [B; D] + b_g)``, ``A = g ⊙ B + (1 − g) ⊙ D``, then the FFN.
- **Decoder layer** (Eq. 6): ``E`` causal self-attention, ``F = MultiHead(E, C_B, C_B)``,
  ``G = MultiHead(E, S^L, S^L)``, ``d = σ(W_d [F; G] + b_d)``, ``H = d ⊙ F + (1 − d) ⊙ G``, then the FFN.
  Note the gate multiplies the *self* branch in the encoder but the *BERT* branch in the decoder, as
  written in the paper.

Parameter names match the baseline's (``self_attn``, ``self_res``, ``cross_attn``, ``cross_res``, ``ffn``,
``ffn_res``, embeddings), so a trained sentence-level checkpoint warm-starts this model
(``train.init_from``, :func:`nmtcore.engine.warm_start`), the paper's procedure (Sec. 3.2); only
``bert_attn`` and ``gate`` start fresh. BERT is frozen (``model.bert.freeze``, the default; Sec. 3.2) and
served from the frozen-feature cache.

What the trained model takes from the context: :meth:`DocContext.inference_switches` decodes with each stack's
context gate passing the sentence's own branch alone (``enc_bert_off``, ``dec_bert_off``, ``bert_off``), and
:meth:`DocContext.usage_probe` gives the gates' mean weight on BERT's branch.

Ablation switches (explicit fields, never model names):

- ``model.context_integration`` (Table 3): ``none`` = no BERT at all, exactly the sentence-level
  Transformer (same parameters, no BertLayer built); ``encoder`` / ``decoder`` = gated context in that stack
  only (the other stack is the baseline's); ``both`` = the full model.
- ``model.context_type`` (Table 4; Li et al. 2020's protocol): ``real`` = the previous sentence(s) of the
  same document; ``random`` = a sentence of words drawn from the source vocabulary; ``fixed`` = one fixed
  sentence for every input. Only the BERT input changes; the current sentence is always segment 1.

Choices where the paper is silent or ambiguous (fields where they plausibly matter):

- Context length: ``model.context_sentences`` previous sentences (the paper uses one, Sec. 3.2), joined
  by spaces into segment 0, never crossing a ``<d>`` document boundary (a document's first sentence gets
  an empty context: ``[CLS] [SEP] current [SEP]``). Computed on the unfiltered split, so a previous
  sentence dropped by the length filter still serves as context. Over-long inputs are cut from the
  context's start first (``WordPieceEncoder``), keeping the current sentence.
- ``random`` (not specified beyond "words randomly selected from the source vocabulary"): the
  vocabulary is the set of whitespace word types of the training split's source side, drawn uniformly
  (not by frequency); a random context has as many words as the real context it replaces (so empty at a
  document start: only the words differ from ``real``); drawn once per sentence from
  ``model.random_context_seed`` and the split's name, so it is the same every epoch (and cacheable).
- ``fixed``: the paper does not give the sentence; ``model.fixed_context`` (default
  :data:`nmtcore.config.families.DEFAULT_FIXED_CONTEXT`), used for every sentence, document starts included.
- ``real`` and ``random`` need a document corpus (``data.corpus=docparallel`` or ``maruf2019_*``); on a
  split without documents they fail with a one-line :class:`~nmtcore.data.DataError` rather than invent
  document boundaries. ``fixed`` needs none.
- Gate initialisation: ``W`` Xavier-uniform, ``b = model.gate_bias_init`` (0: g ≈ ½ at the start; a
  positive value starts the encoder close to the warm-started baseline's self-attention).
- Dropout: the paper uses 0.2 for the document-level model (0.1 for the sentence model); set
  ``model.dropout`` accordingly, the field default is the baseline's.
- ``model.bert.context`` must stay ``none``: this model builds its own context segment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import TYPE_CHECKING, Callable, ClassVar, ContextManager, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from nmtcore.bert import BertLayer
from nmtcore.config import DocContextConfig, ExperimentConfig
from nmtcore.data import DataError
from nmtcore.models.base import MemoryTraits
from nmtcore.models.transformer import Transformer
from nmtcore.nn import CrossAttention, DecoderState, EncoderOut, FeedForward, LayerCache, Residual, SelfAttention

if TYPE_CHECKING:
    from nmtcore.data import Batch, EncodedSplit, PreparedData

# ---------------------------------------------------------------------- the context segment
class DocContextSource:
    """What goes before the first ``[SEP]`` of each sentence's BERT input (installed as
    ``BertLayer.context_source``): one context line (``None`` = empty) per sentence of a split."""

    def __init__(self, cfg: DocContextConfig) -> None:
        self.context_type = cfg.context_type
        self.sentences = cfg.context_sentences
        self.fixed = " ".join(cfg.fixed_context.split())
        self.seed = cfg.random_context_seed

    def __call__(self, split: "EncodedSplit", data: "PreparedData | None" = None) -> list[str | None]:
        if self.context_type == "fixed":
            return [self.fixed] * len(split)
        if split.docs is None:
            raise DataError(f"split {split.name!r} has no documents: model.context_type={self.context_type} needs a "
                            "document corpus (data.corpus=docparallel or maruf2019_*, a line <d> before each "
                            "document), or use model.context_type=fixed")
        real = [" ".join(prev) for prev in split.docs.previous(self.sentences)]
        if self.context_type == "real":
            return [c or None for c in real]
        return self.random(real, split, data)

    def random(self, real: Sequence[str], split: "EncodedSplit", data: "PreparedData | None") -> list[str | None]:
        """As many words as each real context, drawn uniformly from the source word types of the training
        split (``data``; without it, of ``split`` itself)."""
        source = data.train.raw_src if data is not None else split.raw_src
        vocab = np.array(sorted({w for line in source for w in line.split()}), dtype=object)  # (V,)
        if len(vocab) == 0:
            raise DataError(f"split {split.name!r}: no source words to draw a random context from")
        rng = np.random.default_rng((self.seed, zlib.crc32(split.name.encode("utf-8"))))
        out: list[str | None] = []
        for ctx in real:
            n = len(ctx.split())
            out.append(" ".join(rng.choice(vocab, size=n).tolist()) if n else None)
        return out


# ---------------------------------------------------------------------- layers
class ContextGate(nn.Module):
    """Eq. 4 / Eq. 6: ``g = σ(W [x; y] + b)``, output ``g ⊙ x + (1 − g) ⊙ y`` (one gate per dimension).

    ``context_first``: which input is the context's (the encoder's Eq. 4 gates the self branch first, the decoder's
    Eq. 6 the BERT branch); ``context_off`` (an inference switch, :meth:`DocContext.inference_switches`) passes the
    other input alone, the gate's weight on it set to 1."""

    def __init__(self, d_model: int, bias_init: float, context_first: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * d_model, d_model)
        nn.init.xavier_uniform_(self.proj.weight)
        nn.init.constant_(self.proj.bias, bias_init)
        self.context_first = context_first
        self.context_off = False

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """g = σ(W[x; y] + b), then g ⊙ x + (1 − g) ⊙ y (Eq. 4 / 6): how much of the sentence's own states to keep
        against the context's."""
        if self.context_off:
            return y if self.context_first else x
        g = torch.sigmoid(self.proj(torch.cat([x, y], dim=-1)))  # (B, T, C)
        return g * x + (1 - g) * y


class DocContextEncoderLayer(nn.Module):
    """Eq. 2-5: self-attention B and context attention D on the same input, gated, then FFN."""

    def __init__(self, cfg: DocContextConfig, bert_dim: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = SelfAttention(d, cfg.heads, cfg.attention_dropout)
        self.bert_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout, kdim=bert_dim)
        self.gate = ContextGate(d, cfg.gate_bias_init, context_first=False)  # Eq. 4: g on B, the self branch
        self.self_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, mask: Tensor, bert: Tensor, bert_mask: Tensor) -> Tensor:
        """One encoder layer with document context (Eqs. 2-5): self-attention and attention over C_B, gated, then the
        FFN."""
        h = self.self_res.before(x)  # S^(l-1) (B, S, C)
        b = self.self_attn(h, key_padding_mask=mask)  # Eq. 2: B (B, S, C)
        d = self.bert_attn(h, bert, bert_mask)  # Eq. 3: D = MultiHead(S, C_B, C_B) (B, S, C)
        x = self.self_res.after(x, self.gate(b, d))  # Eq. 4: A = g ⊙ B + (1 − g) ⊙ D
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))  # Eq. 5: S = FFN(A)


class DocContextDecoderLayer(nn.Module):
    """Eq. 6: causal self-attention E, then BERT attention F and encoder attention G gated, then FFN."""

    def __init__(self, cfg: DocContextConfig, bert_dim: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = SelfAttention(d, cfg.heads, cfg.attention_dropout)
        self.self_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.bert_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout, kdim=bert_dim)
        self.cross_attn = CrossAttention(d, cfg.heads, cfg.attention_dropout)
        self.gate = ContextGate(d, cfg.gate_bias_init, context_first=True)  # Eq. 6: d on F, the BERT branch
        self.cross_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, enc: Tensor, enc_mask: Tensor, bert: Tensor, bert_mask: Tensor,
                cache: LayerCache | None = None) -> Tensor:
        """One decoder layer with document context: causal self-attention, encoder-decoder attention gated against
        attention over C_B (Eq. 6), then the FFN."""
        x = self.self_res.after(x, self.self_attn(self.self_res.before(x), causal=True, cache=cache))  # Eq. 6: E
        h = self.cross_res.before(x)  # (B, T, C)
        f = self.bert_attn(h, bert, bert_mask, cache=cache, name="bert")  # F = MultiHead(E, C_B, C_B)
        g = self.cross_attn(h, enc, enc_mask, cache=cache, name="enc")  # G = MultiHead(E, S^L, S^L)
        x = self.cross_res.after(x, self.gate(f, g))  # H = d ⊙ F + (1 − d) ⊙ G
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))  # T = FFN(H)


# ---------------------------------------------------------------------- the model
class DocContext(Transformer):
    """The baseline with BERT's document-level context C_B gated into the encoder and/or decoder layers.

    With ``context_integration=none`` it *is* the baseline: no BertLayer, the baseline's layers.
    """

    bert_role: ClassVar[str] = "input"  # owns its BertLayer (the baseline's KD teacher is not built)

    @classmethod
    def memory_traits(cls, cfg: ExperimentConfig) -> MemoryTraits:
        """The default, with ``model.context_sentences`` previous sentences in the BERT stream."""
        traits = super().memory_traits(cfg)
        return dataclasses.replace(traits, context_sentences=cfg.model.context_sentences)  # type: ignore[attr-defined]

    def __init__(self, cfg: DocContextConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__(cfg, vocab_size, pad_id, bos_id, eos_id)
        self.context_encoder = cfg.context_integration in ("encoder", "both")
        self.context_decoder = cfg.context_integration in ("decoder", "both")
        self.bert: BertLayer | None = None
        if cfg.context_integration == "none":
            return  # Table 3 "none": the sentence-level Transformer
        self.bert = BertLayer(cfg.bert, layers=(-1,))  # C_B: BERT's last layer (Sec. 2.2)
        self.bert.context_source = DocContextSource(cfg)
        bert_dim = self.bert.hidden_size
        if self.context_encoder:
            self.encoder_layers = nn.ModuleList(DocContextEncoderLayer(cfg, bert_dim)
                                                for _ in range(cfg.encoder_layers))
        if self.context_decoder:
            self.decoder_layers = nn.ModuleList(DocContextDecoderLayer(cfg, bert_dim)
                                                for _ in range(cfg.decoder_layers))

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Named parameter sets a phase schedule freezes/unfreezes: ``bert`` (if any) and the rest (``nmt``)."""
        return self.groups(bert=self.bert.parameters()) if self.bert is not None else self.groups()

    def inference_switches(self) -> dict[str, Callable[[], ContextManager[None]]]:
        """Decoding as tested and with the context switched off where this variant reads it: ``enc_bert_off``
        (Eq. 4's g = 1: the encoder's self-attention alone), ``dec_bert_off`` (Eq. 6's d = 0: the decoder's encoder
        attention alone), ``bert_off`` (both: the weights of a sentence-level model). ``tested`` minus each is what
        the context adds to the tested model. None without BERT (``context_integration=none``)."""
        stacks = {"enc_bert_off": (self.encoder_layers,) if self.context_encoder else (),
                  "dec_bert_off": (self.decoder_layers,) if self.context_decoder else ()}
        switches: dict[str, tuple[nn.ModuleList, ...]] = {"tested": (), **{k: v for k, v in stacks.items() if v}}
        if len(switches) == 1:
            return {}
        switches["bert_off"] = tuple(s for v in stacks.values() for s in v)
        return {name: (lambda off=off: self._context_off(off)) for name, off in switches.items()}

    @contextlib.contextmanager
    def _context_off(self, stacks: tuple[nn.ModuleList, ...]) -> Iterator[None]:
        """Inference with every context gate of these layer stacks passing the sentence's own branch alone."""
        gates = [layer.gate for layers in stacks for layer in layers]
        for gate in gates:
            gate.context_off = True
        try:
            yield
        finally:
            for gate in gates:
                gate.context_off = False

    @contextlib.contextmanager
    def usage_probe(self) -> Iterator[dict[str, float]]:
        """``bert_share/enc`` and ``bert_share/dec``: the mean weight the context gates give BERT's branch over the
        real tokens of the forwards in the block (encoder Eq. 4: 1 − g, on the context attention D; decoder
        Eq. 6: d, on the BERT attention F); 0.5 is an even split."""
        out: dict[str, float] = {}
        sums = {"enc": [0.0, 0], "dec": [0.0, 0]}  # Σ share, number of (token, dimension) entries
        real: dict[str, Tensor] = {}

        def batch_masks(module: nn.Module, args: tuple) -> None:
            batch = args[0]
            real["enc"], real["dec"] = ~batch.src_mask, batch.tgt_in != self.pad_id  # (B, S), (B, T)

        def gate_share(stack: str):
            def hook(gate: ContextGate, args: tuple, output: Tensor) -> None:
                g = torch.sigmoid(gate.proj(torch.cat(args, dim=-1))).float()  # (B, L, C): weight on the first input
                share = 1 - g if stack == "enc" else g  # the encoder's first input is the self branch
                keep = real[stack][:, :, None].expand_as(share) if share.size(1) == real[stack].size(1) else None
                if keep is not None:  # teacher-forced forwards only (incremental steps have other lengths)
                    sums[stack][0] += float(share[keep].sum())
                    sums[stack][1] += int(keep.sum())
            return hook

        handles = [self.register_forward_pre_hook(batch_masks)]
        for stack, on, layers in (("enc", self.context_encoder, self.encoder_layers),
                                  ("dec", self.context_decoder, self.decoder_layers)):
            if on:
                handles += [layer.gate.register_forward_hook(gate_share(stack)) for layer in layers]
        try:
            yield out
        finally:
            for h in handles:
                h.remove()
        out.update({f"bert_share/{k}": total / n for k, (total, n) in sums.items() if n})

    def encode(self, batch: "Batch") -> EncoderOut:
        """C_B = BERT(context + sentence); the encoder reads it where the integration says (encoder/both), and it rides
        along for the decoder (decoder/both). Without BERT: the baseline's encoder."""
        if self.bert is None:
            return super().encode(batch)
        bert_out = self.bert(batch)
        bert, bert_mask = bert_out.last, bert_out.mask  # C_B (B, Tb, H), (B, Tb)
        if not self.context_encoder:
            enc = super().encode(batch)
        else:
            x = self.embed(batch.src, self.src_embed)  # S^(0) (B, S, C)
            for layer in self.encoder_layers:
                x = layer(x, batch.src_mask, bert, bert_mask)
            enc = EncoderOut(out=self.encoder_norm(x), mask=batch.src_mask)
        if self.context_decoder:  # the decoder attends to C_B: keep it (beam search reorders extras)
            enc.extras.update({"bert": bert, "bert_mask": bert_mask})
        return enc

    def run_decoder(self, tgt_in: Tensor, enc_out: EncoderOut, state: DecoderState | None = None) -> Tensor:
        """The baseline's decoder, or with ``decoder``/``both`` integration the gated context decoder over C_B from
        ``extras``."""
        if not self.context_decoder:
            return super().run_decoder(tgt_in, enc_out, state)
        offset = state.step if state is not None else 0
        x = self.embed(tgt_in, self.tgt_embed, offset)  # T^(0) (B, T, C)
        bert, bert_mask = enc_out.extras["bert"], enc_out.extras["bert_mask"]  # (B, Tb, H), (B, Tb)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, enc_out.out, enc_out.mask, bert, bert_mask,
                      cache=state.layers[i] if state is not None else None)
        return self.decoder_norm(x)
