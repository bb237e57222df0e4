"""BERT-JAM (Zhang et al.; seed 000): joint attention over NMT and BERT states, a per-layer GLU over all
BERT layers, and a three-phase optimisation schedule.

- **Joint attention** (Eq. 5-7, :class:`JointAttention`): queries from the primary sequence R; keys/values
  are the concatenation of R's projections and the secondary sequence S's projections (separate
  projections, S of width ``kdim``), one softmax over both; the padding masks of both apply and, in the
  decoder, the causal mask covers only the primary part. Multi-head, scaled by √d_head as every
  multi-head attention here (the paper writes √d_model for its single-head description).
- **GLU** (Eq. 8, :class:`LayerGLU`), one per encoder and decoder layer: ``B = g ⊙ Σ α_i B_i``,
  ``g = σ(Σ β_i B_i)`` over BERT layers 1..L_B, initialised ``α_L = 1``, others 0, ``β = 0`` (Eq. 11) so
  ``B = B_L / 2`` at init; the model scales the GLU output by ``glu_scale`` (2 in phase 1, told by
  the trainer through :meth:`BertJam.set_phase`; a persistent buffer, so checkpoints carry it), folded into α.
- **Encoder layer** (Eq. 9): ``E^{i+1} = Attn_joint(E^i, B^{E,i})`` then FFN. **Decoder layer** (Eq. 10):
  ``D' = ½ (Attn_joint(D, B^{D,i}) + Attn_joint(D, E^L))`` (drop-net over the two optional,
  ``model.decoder_p_net``, as in the original code), then FFN. Residuals and layer norms as the baseline.
- **Three phases** (Section 2.4) are data: :meth:`BertJam.default_phases` returns the schedule the
  trainer runs unless ``train.phases`` is given — phase 1 (``warmup``) trains ``nmt`` only with the ×2
  compensation, phase 2 (``glu``) adds the GLU weights, phase 3 (``finetune``) adds BERT with early stopping
  on validation loss; BERT's frozen-feature cache serves phases 1-2 and is bypassed in phase 3.

Ablations (Table 7) are explicit fields, each a registered variant (:mod:`nmtcore.models`):
M1 ``glu="weighted_sum"`` (B = Σ α_i B_i, no gate, no ×2); M2 ``bert_layers="last"`` (B = B_L, no GLU,
no phase 2: phase 1 takes its epochs); M3 ``schedule`` without ``warmup`` (phase 2 takes its epochs). M0, M1 and M2
warm up alike (:meth:`BertJam.prefix_signature`), so a sweep trains that phase once
(:mod:`nmtcore.engine.shared_phases`).

What a trained model draws from BERT (:mod:`nmtcore.diagnostics`): inference switches that mask BERT out of the
encoder's joint attentions, the decoder's or both (:meth:`BertJam.inference_switches`), the GLU's weight per BERT
layer (:meth:`BertJam.bert_usage`) and each joint attention's share on BERT (:meth:`BertJam.usage_probe`).

The schedule is honoured or refused (:mod:`nmtcore.engine.phases`): a ``train.max_epochs`` shorter than
the phases is an error before training, never a silent cut. Deliberate departures from the paper, each for
a reason:

- **Phase lengths.** The paper trains "until convergence" in phases 1-2 (Table 7: 40/10/10 epochs on
  IWSLT'14). ``train.phases_converge`` does that (the study's default budget): each phase ends when the
  platform's patience rule fires in it, counted from its start, whatever the phase's epochs say. The rule is the
  platform's (greedy validation BLEU with the loss guard, ``docs/convergence.md``), not a criterion the paper
  names. The earlier CPU budget (``--budget scaled``) instead scales the fixed 40/10/10 by ``train.phase_scale``
  (0.2 → 8/2/2), logged per run, with the paper's proportions and every phase kept: not converged.
- **Checkpoint averaging** (Section 3: the last ten epochs) is ``train.average_last`` (off by default, a
  platform-wide switch; 2 in the scaled study) and averages within the last phase only, where the paper's
  window may reach back into phase 2: averaging across phase 1's end would average the ×2 GLU scale buffer.
- **Phase 3's stop.** The paper stops "when the lowest point of the validation loss falls in the middle of
  the averaging interval"; here phase 3 stops after ``train.patience`` epochs without a gain
  (``PhaseConfig.early_stop``), which for a window of 2k epochs and patience k on the validation loss is the
  same rule. The converged budget watches greedy BLEU under the loss guard (a new lowest validation loss also
  counts as a gain), as every other converged study here, so its phase 3 can run on while BLEU still climbs
  after the loss has turned; it averages the last 2k = 6 epochs.
- **Decoder drop-net.** Eq. 10 averages the two joint attentions, and so does ``model.decoder_p_net=0`` (the
  default). The authors' runs pass ``--encoder-bert-dropout --encoder-bert-dropout-ratio 0.5``, which in training
  keeps one of the two at random per layer (drop-net at p_net 1.0) and averages them only at inference; set
  ``model.decoder_p_net=1.0`` for that. The paper's equation is the spec here.
- **A frozen BERT runs in eval mode** (phases 1-2: no dropout, so its states can come from the feature cache). The
  authors' fairseq puts the frozen BERT in train mode with the rest of the model, so their BERT states carry its
  dropout in every phase; the paper says nothing of it. ``model.bert.dropout_when_frozen=true`` does the same here
  (the cache is then off).
- **Learning rate and warm-up.** The paper's are 5e-4 after 4k warm-up updates (Eq. 12); the studies run the
  platform's Multi30k setting, 1e-3 after 400, model and control alike: 4k warm-up updates would be most of a
  Multi30k run. Phase 3 therefore fine-tunes BERT at a higher rate than the authors' schedule gives. The dropout,
  the paper's 0.3, is the study's (``search_spaces/protocols.py``), not the preset's 0.1. The authors' runs also
  pass ``--weight-decay 0.0001`` (fairseq's decoupled decay, a factor 1 − 10⁻⁴·lr an update: negligible over a
  Multi30k run); the studies train without (``train.weight_decay`` is torch Adam's L2 term, not that decay).
- **Initial scale of the joint attention.** The primary projections are one fused matrix initialised as the
  platform's self-attention (Xavier, gain 2^-½), the BERT projections with gain 1 (2^-½ when BERT's width is the
  model's); the authors initialise every input projection with gain 1, so here BERT's keys and values start larger
  beside the layer's own than theirs do (the figures: ``docs/reproduction.md``, row 4). The output projection is
  Xavier with gain 1 and a zero bias, as the platform's self-attention; the authors' joint attention leaves theirs
  at ``nn.Linear``'s default (a weight √3 smaller at d 256, a small random bias), and zeroes the input projections'
  biases, which here keep ``nn.Linear``'s default. The paper does not specify an initialisation; the control and
  the arms share the platform's, so they start alike.
- **Dropout in Eq. 10.** The two joint attentions are averaged, then one dropout mask falls on the average before
  the residual; the authors drop each out with its own mask before averaging. The expectation and inference are
  the same, and so is training at ``model.decoder_p_net=1.0`` (one branch a layer); at the default 0 the
  residual's noise here is up to twice theirs where the two attentions agree. One mask keeps the layer the
  residual block of every other layer; the paper does not place dropout.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterator

import torch
from torch import Tensor, nn

from nmtcore.bert import BertLayer
from nmtcore.config import BertJamConfig, ExperimentConfig, PhaseConfig
from nmtcore.models.base import MemoryTraits
from nmtcore.models.transformer import Transformer
from nmtcore.nn.checkpointing import checkpoint_layers
from nmtcore.nn.probes import PartShares, tapping
from nmtcore.nn import (DecoderState, DropNet, EncoderOut, FeedForward, LayerCache, Residual, attend_parts,
                        causal_mask, combine, compute_dtype, merge_heads, split_heads)

if TYPE_CHECKING:
    from nmtcore.data import Batch

# ---------------------------------------------------------------------- joint attention (Eq. 5-7)
class JointAttention(nn.Module):
    """Attn_joint(R, S): queries from R, keys/values = [R's ; S's] (Eq. 5), one softmax (Eq. 6-7).

    ``qkv`` projects the primary sequence (width d_model) to Q, K^R, V^R; ``kv_memory`` the secondary one
    (width ``kdim``) to K^S, V^S. With a cache, R's keys/values grow per step (``self_k``/``self_v``) and
    S's are projected once and kept under ``static[name]``.
    """

    def __init__(self, d_model: int, heads: int, attention_dropout: float, kdim: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_dropout = attention_dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.kv_memory = nn.Linear(kdim, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.tap: PartShares | None = None  # the diagnostics' probe (BertJam.usage_probe)
        nn.init.xavier_uniform_(self.qkv.weight, gain=2**-0.5)
        nn.init.xavier_uniform_(self.kv_memory.weight, gain=2**-0.5 if kdim == d_model else 1.0)
        nn.init.xavier_uniform_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x: Tensor, x_mask: Tensor | None, memory: Tensor | None, memory_mask: Tensor,
                causal: bool = False, cache: LayerCache | None = None, name: str = "memory") -> Tensor:
        """x (B, T, C) primary, ``x_mask`` (B, T) True = padding (None: no padding to mask); memory
        (B, M, kdim) secondary (None when already cached), ``memory_mask`` (B, M). Returns (B, T, C)."""
        q, k, v = (split_heads(t, self.heads) for t in self.qkv(x).chunk(3, dim=-1))  # 3 × (B, H, T, Dh)
        if cache is not None:
            k, v = cache.grow(k, v)  # (B, H, t+1, Dh)
            k_s, v_s = cache.memory(name, lambda: self.project_memory(memory))
        else:
            k_s, v_s = self.project_memory(memory)  # 2 × (B, H, M, Dh)
        t_q, t_r = q.size(2), k.size(2)
        # Allowed positions of the primary part: causal (decoder; a single new position sees the whole
        # prefix) and/or not padding; None = all.
        allowed_r = causal_mask(t_q, t_r, x.device) if causal and t_q > 1 else None  # (T, t)
        if x_mask is not None:
            pad_r = ~x_mask[:, None, None, :]  # (B, 1, 1, t)
            allowed_r = pad_r if allowed_r is None else allowed_r & pad_r  # (B, 1, T, t)
        allowed_s = ~memory_mask[:, None, None, :]  # (B, 1, 1, M)
        # Eq. 5: K = (k^R_1..k^R_n, k^S_1..k^S_m), one softmax over both (Eq. 6-7), by attend_parts.
        y = attend_parts(q, [(k, v, allowed_r), (k_s, v_s, allowed_s)],
                         self.attention_dropout if self.training else 0.0, tap=self.tap)
        return self.out(merge_heads(y))  # (B, T, C)

    def project_memory(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """The secondary keys and values (BERT's composed states), split into heads: (k, v), each (B, heads, M,
        C/heads)."""
        k, v = self.kv_memory(memory).chunk(2, dim=-1)  # 2 × (B, M, C)
        return split_heads(k, self.heads), split_heads(v, self.heads)


# ---------------------------------------------------------------------- GLU over BERT layers (Eq. 8)
class LayerGLU(nn.Module):
    """Eq. 8: ``B = g ⊙ Σ α_i B_i``, ``g = σ(Σ β_i B_i)``; ``gated=False`` is M1's ``B = Σ α_i B_i``.

    Init (Eq. 11): α_L = 1, α_i = 0 otherwise, β = 0, so ``B = B_L / 2`` (gated) or ``B_L`` (M1).
    """

    def __init__(self, num_bert_layers: int, gated: bool) -> None:
        super().__init__()
        alpha = torch.zeros(num_bert_layers)
        alpha[-1] = 1.0  # Eq. 11
        self.alpha = nn.Parameter(alpha)
        self.beta = nn.Parameter(torch.zeros(num_bert_layers)) if gated else None
        checkpoint_layers([self])

    def forward(self, states: Tensor, scale: Tensor | float = 1.0) -> Tensor:
        """states (B, L_B, M, H), layer-major per sentence (:meth:`BertOut.stack` with ``dim=1``) → (B, M, H),
        times ``scale`` (the phase's GLU factor, folded into α). Σ α_i B_i and Σ β_i B_i are one matrix product,
        (2, L_B) × (L_B, M·H) per sentence, over the states in place: no permuted copy of them per GLU.

        Recomputed in the backward pass while its weights train (:func:`~nmtcore.nn.checkpointing.checkpoint_layers`,
        set in ``__init__``): only ``states``, shared by every layer's GLU, is kept, not each GLU's mix and gate.
        """
        return mix_layers([self], states, scale)[0]

    def weights(self, scale: Tensor | float = 1.0) -> Tensor:
        """The rows this GLU takes of the states: ``[α·scale, β]`` (gated) or ``[α·scale]``. (1 or 2, L_B)"""
        alpha = self.alpha * scale
        return alpha[None] if self.beta is None else torch.stack([alpha, self.beta])


def mix_layers(glus: list[LayerGLU], states: Tensor, scale: Tensor | float = 1.0) -> list[Tensor]:
    """Each of ``glus`` over the same states (B, L_B, M, H) → one (B, M, H) per GLU, from one matrix product of
    all their rows: the states, read once, not once per layer. ``scale`` multiplies α, never the (B, M, H)
    outputs."""
    b, n_layers, m, h = states.shape
    w = torch.cat([g.weights(scale) for g in glus])  # (R, L_B)
    # One batched product per sentence, (R, L_B) × (L_B, M·H), the stacked states as a view. ``torch.matmul`` of
    # a 2-D by a 3-D tensor folds the batch instead: a transposed (B·M·H, L_B) copy of the states, a product of
    # inner size L_B and, in the backward pass, one of inner size R, all memory-bound on the CPU.
    rows = torch.bmm(w.expand(b, *w.shape), states.reshape(b, n_layers, m * h))  # (B, R, M·H)
    out, i = [], 0
    for g in glus:
        if g.beta is None:  # M1: B = Σ α_i B_i
            out.append(rows[:, i].view(b, m, h))
            i += 1
        else:  # Eq. 8: g = σ(Σ β_i B_i), B = g ⊙ Σ α_i B_i
            out.append((torch.sigmoid(rows[:, i + 1]) * rows[:, i]).view(b, m, h))
            i += 2
    return out


# ---------------------------------------------------------------------- layers
class BertJamEncoderLayer(nn.Module):
    """Eq. 9: joint attention over (E^i, B^{E,i}), then FFN."""

    def __init__(self, cfg: BertJamConfig, bert_dim: int, num_bert_layers: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.glu = LayerGLU(num_bert_layers, cfg.glu == "glu") if cfg.bert_layers == "all" else None
        self.self_attn = JointAttention(d, cfg.heads, cfg.attention_dropout, bert_dim)
        self.self_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, mask: Tensor, bert: Tensor, bert_mask: Tensor) -> Tensor:
        """bert: the BERT memory of this layer (B, M, H), already composed by :meth:`BertJam.compose`."""
        y = self.self_attn(self.self_res.before(x), mask, bert, bert_mask)  # Attn_joint(E^i, B^{E,i})
        x = self.self_res.after(x, y)
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))


class BertJamDecoderLayer(nn.Module):
    """Eq. 10: ½ (Attn_joint(D, B^{D,i}) + Attn_joint(D, E^L)), then FFN. Uses two LayerCaches."""

    def __init__(self, cfg: BertJamConfig, bert_dim: int, num_bert_layers: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.glu = LayerGLU(num_bert_layers, cfg.glu == "glu") if cfg.bert_layers == "all" else None
        self.bert_attn = JointAttention(d, cfg.heads, cfg.attention_dropout, bert_dim)
        self.enc_attn = JointAttention(d, cfg.heads, cfg.attention_dropout, d)
        self.attn_res = Residual(d, cfg.dropout, cfg.pre_norm)
        self.ffn = FeedForward(d, cfg.ffn_dim, cfg.activation, cfg.activation_dropout)
        self.ffn_res = Residual(d, cfg.dropout, cfg.pre_norm)

    def forward(self, x: Tensor, enc: Tensor, enc_mask: Tensor, bert: Tensor | None, bert_mask: Tensor,
                w: tuple[float, float], caches: tuple[LayerCache, LayerCache] | None = None) -> Tensor:
        """bert: this layer's composed BERT memory (B, M, H), None once cached; w: drop-net weights."""
        # Right-padded targets need no key padding mask under the causal mask (as the baseline).
        h = self.attn_res.before(x)  # (B, T, C)
        c_bert, c_enc = caches if caches is not None else (None, None)
        y = combine(lambda: self.bert_attn(h, None, bert, bert_mask, causal=True, cache=c_bert, name="bert"),
                    lambda: self.enc_attn(h, None, enc, enc_mask, causal=True, cache=c_enc, name="enc"), w)
        x = self.attn_res.after(x, y)  # Eq. 10
        return self.ffn_res.after(x, self.ffn(self.ffn_res.before(x)))


# ---------------------------------------------------------------------- the model
# The config fields that tell M0-M3 apart (and the registered name each set of them has): a warm-up that leaves the
# GLU at its initialisation computes the same whatever they say (BertJam.prefix_signature).
VARIANT_FIELDS = ("name", "glu", "bert_layers", "schedule", "phase_epochs")


class BertJam(Transformer):
    """BERT-JAM: the baseline's embeddings and output layer, joint-attention layer stacks, one BERT."""

    bert_role: ClassVar[str] = "input"  # owns its BertLayer (the baseline's KD teacher is not built)

    def __init__(self, cfg: BertJamConfig, vocab_size: int, pad_id: int, bos_id: int, eos_id: int) -> None:
        super().__init__(cfg, vocab_size, pad_id, bos_id, eos_id)
        # All hidden states 0..L (the cache stores these) of which the GLU reads 1..L; M2 reads L only.
        self.bert = BertLayer(cfg.bert, layers=None if cfg.bert_layers == "all" else (-1,))
        n_bert = self.bert.num_layers if cfg.bert_layers == "all" else 1
        bert_dim = self.bert.hidden_size
        self.encoder_layers = nn.ModuleList(BertJamEncoderLayer(cfg, bert_dim, n_bert)
                                            for _ in range(cfg.encoder_layers))
        self.decoder_layers = nn.ModuleList(BertJamDecoderLayer(cfg, bert_dim, n_bert)
                                            for _ in range(cfg.decoder_layers))
        self.dec_drop_net = DropNet(cfg.decoder_p_net, torch.initial_seed() + 1)
        # Factor on the GLU output: 2 in phase 1 (Section 2.4), 1 otherwise; set by set_phase.
        self.register_buffer("glu_scale", torch.tensor(1.0))
        self.bert_off: frozenset[str] = frozenset()  # inference switches: stacks ("enc", "dec") that ignore BERT

    def inference_switches(self) -> dict[str, Callable[[], ContextManager[None]]]:
        """Decoding as tested, and with BERT's part of the joint attentions masked out (every key of it, so each
        softmax spreads over the layer's own part alone) in the encoder's layers (``enc_bert_off``), the decoder's
        (``dec_bert_off``: its BERT joint attention attends to its own prefix only, Eq. 10 still averaging it with
        the encoder attention) or both (``bert_off``): ``tested`` minus each is what that side's BERT adds."""
        stacks = {"tested": (), "enc_bert_off": ("enc",), "dec_bert_off": ("dec",), "bert_off": ("enc", "dec")}
        return {name: (lambda off=off: self.bert_switched_off(*off)) for name, off in stacks.items()}

    @contextlib.contextmanager
    def bert_switched_off(self, *stacks: str) -> Iterator[None]:
        """Inference with BERT masked out of these stacks' joint attentions ("enc", "dec"); restored after."""
        unknown = set(stacks) - {"enc", "dec"}
        if unknown:
            raise ValueError(f"unknown BERT-JAM stack {sorted(unknown)}: enc, dec")
        saved, self.bert_off = self.bert_off, frozenset(stacks)
        try:
            yield
        finally:
            self.bert_off = saved

    def bert_usage(self) -> dict[str, float]:
        """The GLU's weight on each BERT layer (Eq. 8), averaged over the layers of each stack: ``glu_alpha/enc/L3``
        is the mean over encoder layers of α_3 × the GLU scale (at init 1 on the last BERT layer, 0 elsewhere),
        ``glu_beta/...`` the gate's β (gated GLU only). None for M2 (BERT's last layer only, no GLU)."""
        out: dict[str, float] = {}
        for stack, layers in (("enc", self.encoder_layers), ("dec", self.decoder_layers)):
            glus = [layer.glu for layer in layers if layer.glu is not None]
            if not glus:
                continue
            alpha = torch.stack([g.alpha.detach().float() for g in glus]).mean(0) * float(self.glu_scale)
            out.update({f"glu_alpha/{stack}/L{i + 1}": float(a) for i, a in enumerate(alpha)})
            if glus[0].beta is not None:
                beta = torch.stack([g.beta.detach().float() for g in glus]).mean(0)
                out.update({f"glu_beta/{stack}/L{i + 1}": float(b) for i, b in enumerate(beta)})
        return out

    @contextlib.contextmanager
    def usage_probe(self) -> Iterator[dict[str, float]]:
        """The share of each joint attention's mass (Eq. 5-7: one softmax over both parts) on its second part,
        mean over layers, heads and real query positions of the forwards in the block: ``attention/enc/bert``
        (the encoder's self-attention on BERT, against the source tokens), ``attention/dec/bert`` (the decoder's
        BERT attention on BERT, against its own prefix) and ``attention/dec/encoder`` (its encoder attention on
        the encoder's output, against its own prefix)."""
        out: dict[str, float] = {}
        probes = {"enc/bert": (PartShares(("self", "bert")), [layer.self_attn for layer in self.encoder_layers]),
                  "dec/bert": (PartShares(("self", "bert")), [layer.bert_attn for layer in self.decoder_layers]),
                  "dec/encoder": (PartShares(("self", "encoder")), [layer.enc_attn for layer in self.decoder_layers])}

        def queries(module: nn.Module, args: tuple) -> None:
            batch = args[0]
            for name, (shares, _) in probes.items():
                shares.set_queries(~batch.src_mask if name.startswith("enc") else batch.tgt_in.ne(self.pad_id))

        handle = self.register_forward_pre_hook(queries)
        try:
            with contextlib.ExitStack() as taps:
                for shares, modules in probes.values():
                    taps.enter_context(tapping(modules, shares))
                yield out
        finally:
            handle.remove()
        for name, (shares, _) in probes.items():
            out.update({f"attention/{name}": v for k, v in shares.shares("attention").items()
                        if not k.endswith("/self")})

    # ------------------------------------------------------------------ phases (data the trainer reads)
    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """``bert`` (the BERT), ``glu`` (α, β of every layer's GLU), ``nmt`` (everything else)."""
        glu = [p for layer in [*self.encoder_layers, *self.decoder_layers] if layer.glu is not None
               for p in layer.glu.parameters()]
        return self.groups(bert=self.bert.parameters(), glu=glu)

    @classmethod
    def memory_traits(cls, cfg: ExperimentConfig) -> MemoryTraits:
        """The default, with BERT fine-tuned when the schedule runs phase 3 (``finetune``)."""
        traits = super().memory_traits(cfg)
        if "finetune" in cfg.model.schedule:  # type: ignore[attr-defined]
            traits = dataclasses.replace(traits, bert_fine_tuned=True)
        return traits

    def default_phases(self) -> tuple[PhaseConfig, ...]:
        """Section 2.4's schedule for this config; a skipped phase's epochs go to its neighbour (M2: to
        the warmup, M3: to the GLU phase), as the paper's ablations do."""
        cfg: BertJamConfig = self.cfg  # type: ignore[assignment]
        e_warm, e_glu, e_ft = cfg.phase_epochs
        if "warmup" not in cfg.schedule:
            e_glu += e_warm
        if "glu" not in cfg.schedule:
            e_warm += e_glu
        gated = cfg.bert_layers == "all" and cfg.glu == "glu"
        spec = {
            "warmup": PhaseConfig("warmup", e_warm, ("nmt",), glu_scale=2.0 if gated else 1.0),
            "glu": PhaseConfig("glu", e_glu, ("nmt", "glu")),
            "finetune": PhaseConfig("finetune", e_ft, ("nmt", "glu", "bert"), early_stop=True),
        }
        return tuple(spec[name] for name in cfg.schedule)

    def set_phase(self, phase: PhaseConfig) -> None:
        """The trainer's phase hook: the GLU scale of this phase."""
        self.glu_scale.fill_(phase.glu_scale)

    def prefix_signature(self, phases: tuple[PhaseConfig, ...]) -> dict[str, Any]:
        """The default, but where no phase of ``phases`` trains the GLU: it stays at Eq. 11's initialisation, where
        each variant's BERT memory is B_L times a factor (gated: the phase's scale × σ(0); M1: the scale; M2: 1) and
        its weights drew nothing from the RNG, so M0, M1 and M2 train their warm-up alike. The signature then holds
        that factor instead of the variant's fields and the phases' GLU scales."""
        sig = super().prefix_signature(phases)
        if any("glu" in p.trainable for p in phases):
            return sig
        cfg: BertJamConfig = self.cfg  # type: ignore[assignment]
        gate = 0.5 if cfg.glu == "glu" else 1.0  # σ(β · B) at β = 0
        factors = [p.glu_scale * gate if cfg.bert_layers == "all" else 1.0 for p in phases]
        model = {k: v for k, v in sig["model"].items() if k not in VARIANT_FIELDS}
        return {"model": {**model, "bert_memory": "B_L"},
                "phases": [{**{k: v for k, v in p.items() if k != "glu_scale"}, "bert_memory_factor": f}
                           for p, f in zip(sig["phases"], factors)]}

    # ------------------------------------------------------------------ pieces
    def compose(self, layers: list[nn.Module], states: Tensor) -> list[Tensor]:
        """The BERT memory of each of ``layers``: its GLU over B_1..B_L (× glu_scale), or B_L (M2). (B, M, H) each.

        While a GLU trains, each layer's is its own (checkpointed) product; otherwise (phase 1, validation,
        decoding) one product serves them all (:func:`mix_layers`)."""
        if self.cfg.bert_layers != "all":
            return [states[:, -1]] * len(layers)
        glus = [layer.glu for layer in layers]
        if torch.is_grad_enabled() and any(p.requires_grad for g in glus for p in g.parameters()):
            return [g(states, self.glu_scale) for g in glus]
        return mix_layers(glus, states, self.glu_scale)

    def run_decoder(self, tgt_in: Tensor, enc_out: EncoderOut, state: DecoderState | None = None) -> Tensor:
        """The decoder stack with joint attention over encoder output and each layer's GLU-composed BERT states
        (composed once per sentence: a cached step reuses them)."""
        offset = state.step if state is not None else 0
        x = self.embed(tgt_in, self.tgt_embed, offset)  # (B, T, C)
        states, bert_mask = enc_out.extras["bert_states"], enc_out.extras["bert_mask"]  # (B, L, M, H), (B, M)
        if "dec" in self.bert_off:
            bert_mask = torch.ones_like(bert_mask)  # switched off: every BERT key masked
        cached = state is not None and "bert" in state.layers[0].static
        berts = [None] * len(self.decoder_layers) if cached else self.compose(self.decoder_layers, states)
        for i, (layer, bert) in enumerate(zip(self.decoder_layers, berts)):  # B^{D,i}: composed once per sentence
            caches = (state.layers[2 * i], state.layers[2 * i + 1]) if state is not None else None
            x = layer(x, enc_out.out, enc_out.mask, bert, bert_mask, self.dec_drop_net.weights(), caches)
        return self.decoder_norm(x)

    # ------------------------------------------------------------------ interface
    def encode(self, batch: "Batch") -> EncoderOut:
        """BERT's layer states stacked once, then the encoder stack with joint attention over each layer's GLU
        composition of them (Eq. 9); the stack rides along in ``extras`` for the decoder."""
        bert_out = self.bert(batch)
        # BERT(X) = (B_1, ..., B_L): the embeddings (hidden state 0) are not a layer. Stacked once, layer-major
        # per sentence (each GLU reads them in place) and in the autocast dtype where there is one: autocast
        # would otherwise cast the states for each layer's GLU (6 layers × 2, 9M values each at Multi30k's
        # batch size: a quarter of a bf16 training step). Batch first, as beam search reorders extras.
        first = 1 if self.cfg.bert_layers == "all" else -1
        states = bert_out.stack(first, compute_dtype(batch.src.device), dim=1)  # (B, L, M, H)
        x = self.embed(batch.src, self.src_embed)  # (B, S, C)
        enc_bert_mask = torch.ones_like(bert_out.mask) if "enc" in self.bert_off else bert_out.mask  # (B, M)
        for layer, bert in zip(self.encoder_layers, self.compose(self.encoder_layers, states)):
            x = layer(x, batch.src_mask, bert, enc_bert_mask)  # Eq. 9
        return EncoderOut(out=self.encoder_norm(x), mask=batch.src_mask,
                          extras={"bert_states": states, "bert_mask": bert_out.mask})

    def init_state(self, enc_out: EncoderOut) -> DecoderState:
        """Two caches per decoder layer: its self-attention's and its joint attention's."""
        return DecoderState.empty(2 * len(self.decoder_layers))  # two joint attentions per layer
