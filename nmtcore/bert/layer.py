"""BERT's hidden states for a batch, from the frozen-feature cache or by running it, and KD from it.

:class:`BertLayer` gives all L+1 hidden states or a requested subset. A frozen BERT runs in eval mode (no
dropout; ``model.bert.dropout_when_frozen`` turns the original code's behaviour back on, logged) and, with
``model.bert.use_cache``, is served from the frozen-feature cache (:mod:`nmtcore.bert.features`): computed
once per (weights, split, layers, max length), read memory-mapped every epoch, phase and trial. A BERT being
fine-tuned bypasses the cache automatically, and features computed from weights that have since changed are
never used. :class:`BertKD` is a frozen BERT teacher plus the projection of one student state to its width
(the loss itself is :func:`nmtcore.engine.losses.kd_mse`). :func:`prepare_bert_inputs` attaches the stream
(and cached features) of the one BertLayer a model owns to every split.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from nmtcore.bert.features import FeatureCache, FeatureKey, SharedEntry, inputs_checksum, weights_fingerprint
from nmtcore.bert.resolve import BertError, BertSpec, ResolvedBert, resolve_bert
from nmtcore.bert.wordpiece import WordPieceEncoder, nmt_word_index, word_start_table
from nmtcore.config import BertConfig
from nmtcore.data import BertInputs, EncodedSplit, PreparedData
from nmtcore.devices import shape_free_cuda_attention
from nmtcore.nn.checkpointing import checkpoint_layers
from nmtcore.nn.layers import use_fast_dropout

if TYPE_CHECKING:
    from nmtcore.data import Batch

log = logging.getLogger("nmtcore.bert")


class BertOut:
    """BERT hidden states of a batch: ``states[j]`` (B, Tb, H) is BERT layer ``layers[j]`` (0 = the
    embeddings, L = the last layer); ``mask`` (B, Tb) True = padding.

    From the feature cache the states arrive ``packed``, one (B, Tb, K, H) float16 tensor: ``states`` converts
    them to fp32 when first read, and :meth:`stack` takes the layers a model mixes straight from it, in one
    conversion to the dtype the model computes in (no fp32 copy per layer, no second copy to stack them).
    """

    def __init__(self, layers: tuple[int, ...], mask: Tensor, states: tuple[Tensor, ...] | None = None,
                 packed: Tensor | None = None) -> None:
        if (states is None) == (packed is None):
            raise ValueError("BertOut takes the states either one per layer or packed, not both")
        self.layers, self.mask, self._states, self.packed = layers, mask, states, packed

    @property
    def states(self) -> tuple[Tensor, ...]:
        if self._states is None:
            self._states = tuple(f.float() for f in self.packed.unbind(2))  # fp16 on disk, fp32 to the model
        return self._states

    def layer(self, index: int) -> Tensor:
        """Hidden state of BERT layer ``index`` (must have been requested)."""
        try:
            return self.states[self.layers.index(index)]
        except ValueError:
            raise KeyError(f"BERT layer {index} was not requested (have {self.layers})") from None

    @property
    def last(self) -> Tensor:
        if self._states is None:
            return self.packed[:, :, -1].float()
        return self.states[-1]

    def stack(self, first: int = 0, dtype: torch.dtype = torch.float32, dim: int = 2) -> Tensor:
        """States ``first:`` (Python slicing: ``-1`` is the last alone) stacked on a layer axis, in ``dtype``:
        (B, Tb, K', H) with ``dim=2``; (B, K', Tb, H) with ``dim=1``, where each layer's states of a sentence are
        one contiguous block, so that a weighted sum over layers is one matrix product that reads them in place."""
        if dim not in (1, 2):
            raise ValueError(f"BertOut.stack: the layer axis is 1 or 2, got {dim}")
        if self._states is not None:
            return torch.stack(self._states[first:], dim=dim).to(dtype)
        src = self.packed[:, :, first:]  # (B, Tb, K', H) float16
        if dim == 2:
            return src.to(dtype)
        out = torch.empty(src.size(0), src.size(2), src.size(1), src.size(3), dtype=dtype, device=src.device)
        return out.copy_(src.transpose(1, 2))  # converted and transposed in one pass


def encoder_layers(hf_model: nn.Module) -> nn.ModuleList:
    """The transformer layers of a ``transformers`` encoder (BERT, MPNet, XLM-R: ``encoder.layer``)."""
    layers = getattr(getattr(hf_model, "encoder", None), "layer", None)
    if not isinstance(layers, nn.ModuleList):
        raise BertError(f"{type(hf_model).__name__} has no encoder.layer stack to checkpoint; set "
                        "model.bert.activation_checkpointing=false")
    return layers


def pool_to_tokens(states: Tensor, align: Tensor) -> tuple[Tensor, Tensor]:
    """Mean of the WordPieces aligned to each NMT source position.

    states: (B, Tb, H); align: (B, S, 2) ``[start, end)`` spans. Returns (B, S, H) and ``has`` (B, S) bool,
    False where a position has no WordPiece (eos, padding, truncated words): its row is zeros.
    """
    Tb = states.size(1)
    pos = torch.arange(Tb, device=states.device)  # (Tb,)
    start, end = align[..., :1], align[..., 1:]  # (B, S, 1)
    with torch.autocast(states.device.type, enabled=False):  # averages of fp32 states stay fp32
        states = states.float()
        weights = ((pos >= start) & (pos < end)).float()  # (B, S, Tb)
        n = weights.sum(-1, keepdim=True)  # (B, S, 1)
        pooled = torch.bmm(weights / n.clamp(min=1), states)  # (B, S, H)
    return pooled, n.squeeze(-1) > 0


class BertLayer(nn.Module):
    """A BERT producing hidden states for a batch: from the frozen-feature cache when it may, else by
    running the model on ``batch.extras["bert_ids"]``.

    ``layers``: the hidden states the consuming model needs (indices into 0..L, negatives from the end;
    None = all L+1); the cache stores exactly these. ``resolved``: an already resolved BERT (default:
    resolve ``cfg``). Freezing follows ``cfg.freeze`` at construction; flip ``requires_grad`` later (a
    phase schedule) and the layer follows: trainable → dropout per the model's mode, no cache; frozen →
    eval mode (unless ``cfg.dropout_when_frozen``).
    """

    def __init__(self, cfg: BertConfig, layers: Sequence[int] | None = None,
                 resolved: ResolvedBert | None = None) -> None:
        super().__init__()
        if not cfg.enabled:
            raise BertError("model.bert: no BERT configured (set model.bert.name or model.bert.layers/hidden)")
        self.cfg = cfg
        self.resolved = resolved or resolve_bert(BertSpec.from_config(cfg), cache_dir=cfg.cache_dir or None,
                                                 pretrain_corpus=cfg.pretrain_corpus, pretrain_steps=cfg.pretrain_steps)
        config = self.resolved.hf_config()
        self.bert = self.resolved.load_model()
        use_fast_dropout(self.bert)  # its hidden dropouts, while it is fine-tuned (nmtcore.nn.layers.dropout)
        self.num_layers: int = config.num_hidden_layers
        self.hidden_size: int = config.hidden_size
        wanted = range(self.num_layers + 1) if layers is None else layers
        norm = sorted({i + self.num_layers + 1 if i < 0 else i for i in wanted})
        if not norm or norm[0] < 0 or norm[-1] > self.num_layers:
            raise BertError(f"BERT layers {tuple(wanted)} out of range for a {self.num_layers}-layer BERT (0..{self.num_layers})")
        self.layers: tuple[int, ...] = tuple(norm)
        self.model_type: str = config.model_type
        # RoBERTa-style position ids start after the padding id: two rows of the table are never used.
        offset = config.pad_token_id + 1 if self.model_type in ("mpnet", "roberta", "xlm-roberta") else 0
        positions = config.max_position_embeddings - offset
        # Segment (token-type) embeddings: BERT's, which the document context ([CLS] ctx [SEP] sent [SEP]) needs.
        self.segments: bool = self.model_type == "bert" and getattr(config, "type_vocab_size", 0) >= 2
        if cfg.max_length > positions:
            raise BertError(f"model.bert.max_length={cfg.max_length} exceeds the {positions} positions of BERT {self.resolved.spec}")
        self.max_length: int = cfg.max_length or positions
        self.encoder = WordPieceEncoder(self.resolved.load_tokenizer(), self.max_length)
        if cfg.freeze:
            self.bert.requires_grad_(False)
        # Active only while the BERT trains (a phase schedule may unfreeze it later).
        self.checkpointed_layers = checkpoint_layers(encoder_layers(self.bert)) if cfg.activation_checkpointing else 0
        # What the owning model puts before [SEP] (document-level models, e.g. nmtcore.models.doc_context):
        # (split, data or None) → one context line (or None) per sentence; None = model.bert.context decides.
        self.context_source: Callable[[EncodedSplit, PreparedData | None], Sequence[str | None]] | None = None
        self._features_key: str | None = None  # weights fingerprint the attached features were computed from
        self._prepared: weakref.ref | None = None  # the PreparedData prepare_bert_inputs last served
        self._weights_changed = False
        self.register_load_state_dict_post_hook(BertLayer._after_load)
        self.train(self.training)
        log.info("BERT %s: L%d/H%d, %s, layers %s, max_length %d, feature cache %s", self.resolved.describe(),
                 self.num_layers, self.hidden_size,
                 ("trainable, activation checkpointing " + ("on" if self.checkpointed_layers else "off"))
                 if not self.frozen else
                 ("frozen, dropout ON (model.bert.dropout_when_frozen)" if cfg.dropout_when_frozen
                  else "frozen, eval mode (no dropout)"),
                 list(self.layers), self.max_length, "on" if self.cache_wanted else "off")

    # ------------------------------------------------------------------ state
    @property
    def frozen(self) -> bool:
        return not any(p.requires_grad for p in self.bert.parameters())

    @property
    def cache_wanted(self) -> bool:
        """Features may come from the cache: frozen, deterministic (no dropout), cache on."""
        return self.frozen and self.cfg.use_cache and not self.cfg.dropout_when_frozen

    @property
    def features_usable(self) -> bool:
        """Attached cached features match the current weights and may be used now."""
        return self.cache_wanted and self._features_key is not None and not self._weights_changed

    def train(self, mode: bool = True) -> "BertLayer":
        super().train(mode)
        if self.frozen and not self.cfg.dropout_when_frozen:
            self.bert.eval()  # a frozen BERT is a fixed feature extractor: no dropout
        return self

    def fingerprint(self) -> str:
        """SHA-256 of the BERT's current weights (what cached features are keyed by)."""
        return weights_fingerprint(self.bert)

    def truncates(self, other: "BertLayer") -> bool:
        """Whether this BERT is ``other``'s bottom layers (a truncation, or the same BERT): the same
        architecture but for its depth, the same tokenization and maximum length, and every tensor of its state
        equal to ``other``'s. Its hidden states 0..L are then ``other``'s, so one pass of ``other`` computes
        both (:func:`attach_shared_features`)."""
        mine, theirs = self.resolved.hf_config().to_dict(), other.resolved.hf_config().to_dict()
        ignored = {"num_hidden_layers", "_name_or_path"}
        if (self.num_layers > other.num_layers or self.max_length != other.max_length
                or {k: v for k, v in mine.items() if k not in ignored}
                != {k: v for k, v in theirs.items() if k not in ignored}):
            return False
        own, full = self.bert.state_dict(), other.bert.state_dict()
        return all(name in full and full[name].dtype == t.dtype and torch.equal(full[name], t)
                   for name, t in own.items())

    @staticmethod
    def _after_load(module: "BertLayer", incompatible: Any) -> None:
        # Weights loaded from a checkpoint: cached features stay valid only for identical weights.
        if module._features_key is not None:
            module._weights_changed = module.fingerprint() != module._features_key

    # ------------------------------------------------------------------ inputs
    def encode_split(self, split: EncodedSplit, word_start: np.ndarray,
                     data: PreparedData | None = None) -> BertInputs:
        """The BERT stream of ``split``'s raw source lines, aligned to its NMT subwords. The context segment
        comes from :attr:`context_source` when the model set one (``data``: the run's data, for sources that
        need the training split), else from ``model.bert.context``."""
        contexts = None
        if (self.context_source is not None or self.cfg.context == "previous") and not self.segments:
            raise BertError(f"BERT {self.resolved.spec} ({self.model_type}) has no segment embeddings, which a "
                            "document context ([CLS] context [SEP] sentence [SEP]) needs: use a BERT-type encoder")
        if self.context_source is not None:
            contexts = list(self.context_source(split, data))
        elif self.cfg.context == "previous" and split.docs is not None:
            # The previous sentence of the same document: never across a <d> boundary.
            contexts = [" ".join(prev) or None for prev in split.docs.previous(1)]
        elif self.cfg.context == "previous":
            # The previous line of the split (a sentence-level corpus carries no document boundaries).
            contexts = [None] + list(split.raw_src[:-1])
        words = [nmt_word_index(s, word_start) for s in split.src]
        return self.encoder.encode(split.raw_src, words, contexts)

    def features_key(self, inputs: BertInputs) -> FeatureKey:
        """The cache key of ``inputs``' features under this BERT's current weights."""
        if self._features_key is None or self._weights_changed:
            self._features_key, self._weights_changed = self.fingerprint(), False
        return FeatureKey(bert=self._features_key, inputs=inputs_checksum(inputs), layers=self.layers,
                          max_length=self.max_length)

    def attach_features(self, cache: "FeatureCache", split_name: str, inputs: BertInputs) -> None:
        """Load (or compute once) the cached features of ``inputs`` and attach them to it (random ones where
        ``cache`` is under the folder of an active :func:`synthetic_features`)."""
        key = self.features_key(inputs)
        root = _SYNTHETIC_ROOT.get()
        compute = (self._random_features if root is not None and cache.root.resolve().is_relative_to(root)
                   else self._compute_features)
        inputs.features = cache.get_or_build(key, inputs, compute,
                                             describe={"bert": str(self.resolved.spec), "path": str(self.resolved.path),
                                                       "split": split_name})

    def _compute_features(self, ids: Tensor, mask: Tensor, segments: Tensor) -> Tensor:
        return self._compute_states(ids, mask, segments, self.layers)

    def _random_features(self, ids: Tensor, mask: Tensor, segments: Tensor) -> Tensor:
        """What :meth:`_compute_features` returns, in shape only: (B, Tb, K, H) standard normal values."""
        return torch.randn(*ids.shape, len(self.layers), self.hidden_size)

    @torch.no_grad()
    def _compute_states(self, ids: Tensor, mask: Tensor, segments: Tensor, layers: Sequence[int]) -> Tensor:
        """Hidden states ``layers`` of a batch in eval mode, stacked (B, Tb, K, H) on the CPU."""
        was_training = self.bert.training
        self.bert.eval()
        try:
            device = next(self.bert.parameters()).device
            states = self.run(ids.to(device), mask.to(device), segments.to(device), layers)
        finally:
            self.bert.train(was_training)
        return torch.stack(states, dim=2).cpu()  # (B, Tb, K, H)

    # ------------------------------------------------------------------ forward
    def run(self, ids: Tensor, mask: Tensor, segments: Tensor | None = None,
            layers: Sequence[int] | None = None) -> tuple[Tensor, ...]:
        """Run BERT: ids/mask/segments (B, Tb), mask True = padding → the states ``layers`` (default: the
        requested ones), each (B, Tb, H)."""
        types = {"token_type_ids": segments} if self.segments else {}
        if ids.is_cuda:
            shape_free_cuda_attention()
        out = self.bert(input_ids=ids, attention_mask=(~mask).long(), output_hidden_states=True, return_dict=True,
                        **types)
        return tuple(out.hidden_states[i] for i in (self.layers if layers is None else layers))

    def forward(self, batch: "Batch") -> BertOut:
        x = batch.extras
        if "bert_ids" not in x:
            raise BertError("batch has no BERT stream: call nmtcore.bert.prepare_bert_inputs(model, data) first")
        mask = x["bert_mask"]
        feats = x.get("bert_features")
        if feats is not None and self.features_usable:
            return BertOut(layers=self.layers, mask=mask, packed=feats)  # fp16 on disk
        if self.frozen:
            with torch.no_grad():
                states = self.run(x["bert_ids"], mask, x["bert_segments"])
        else:
            if self.training and torch.is_grad_enabled():
                self._weights_changed = True  # fine-tuning: cached features go stale at the next step
            states = self.run(x["bert_ids"], mask, x["bert_segments"])
        return BertOut(layers=self.layers, mask=mask, states=states)


# ---------------------------------------------------------------------------------------------- KD
@dataclass
class KDStates:
    """What knowledge distillation from BERT compares (Eq. 4 of PLM-sponsored NMT; CTNMT):
    ``student`` (B, S, H) the student's state projected to BERT's width, ``teacher`` (B, S, H) the frozen
    BERT's (no gradient), ``mask`` (B, S) True = excluded (padding, positions with no WordPiece)."""

    student: Tensor
    teacher: Tensor
    mask: Tensor


class BertKD(nn.Module):
    """Knowledge distillation from BERT (CTNMT, Yang et al. 2020; PLM-sponsored NMT, Eq. 4-5): a frozen
    BERT teacher and a linear projection of one student state to the BERT's width.

    The student is the top encoder layer (``model.bert.kd_layer=encoder_top``) or layer M/2
    (``encoder_half``). The teacher's last layer is pooled per NMT source token through the word
    alignment, so the two streams compare position by position; the loss is
    :func:`nmtcore.engine.losses.kd_mse` on the :class:`KDStates` :meth:`forward` returns.
    """

    def __init__(self, cfg: BertConfig, student_dim: int, encoder_layers: int) -> None:
        super().__init__()
        if not cfg.freeze:
            raise BertError("model.bert.freeze: a KD teacher is frozen (PLM-sponsored NMT, Sec. 2.3); set it to true")
        self.teacher = BertLayer(cfg, layers=(-1,))
        # Index into the encoder's states (0 = embeddings, M = top): Eq. 4's h_{M/2}, at least layer 1.
        self.student_layer = encoder_layers if cfg.kd_layer == "encoder_top" else max(1, encoder_layers // 2)
        self.proj = nn.Linear(student_dim, self.teacher.hidden_size)

    def forward(self, batch: "Batch", student: Tensor) -> KDStates:
        """student (B, S, C) → the projected student (B, S, H), the teacher pooled per NMT token (B, S, H)
        and the mask (B, S) True = excluded (padding, eos, unaligned)."""
        bert_out = self.teacher(batch)
        target, has = pool_to_tokens(bert_out.last, batch.extras["bert_align"])  # (B, S, H), (B, S)
        return KDStates(student=self.proj(student), teacher=target.detach(), mask=batch.src_mask | ~has)


# ---------------------------------------------------------------------------------------------- wiring
def bert_layers(model: nn.Module) -> list[BertLayer]:
    """The distinct :class:`BertLayer` modules of ``model``."""
    return [m for m in model.modules() if isinstance(m, BertLayer)]


def release_unusable_features(model: nn.Module, data: PreparedData) -> bool:
    """Detach the cached features from every split of ``data`` once the model's BERT may not use them (it is
    trainable: from its first update the cached states are another model's); returns whether any were detached.

    Batches then stop gathering them (a fine-tuned BERT-JAM's batch carried ~35 MB of features it never read,
    and their memory map stayed resident: 0.6 GiB of a phase-3 trial's peak on Multi30k) and the map is closed.
    The BERT stream itself stays. A frozen BERT keeps its features."""
    layers = bert_layers(model)
    if not layers or layers[0].cache_wanted:
        return False
    released = False
    for split in data.splits.values():
        if split.bert is not None and split.bert.features is not None:
            split.bert.features = None
            released = True
    if released:
        log.info("BERT feature cache released: the BERT trains from here on and runs every step")
    return released


def attach_shared_features(cache: FeatureCache, split_name: str, members: Sequence[tuple[BertLayer, BertInputs]]) -> None:
    """:meth:`BertLayer.attach_features` for several BERTs over one split, each with its own stream of it: the
    members that are bottom truncations of the deepest (:meth:`BertLayer.truncates`) and read the same tokens
    have their missing features computed in one pass of the deepest, each stored under its own key, bit for
    bit what a pass of its own computes (same batches, same layers); any other member builds its own."""
    members = [(layer, inp) for layer, inp in members if layer.cache_wanted]
    if not members:
        return
    deepest = max(members, key=lambda m: m[0].num_layers)[0]
    keys = [layer.features_key(inp) for layer, inp in members]  # each hashes its token stream once
    tokens = next(key.inputs for (layer, _), key in zip(members, keys) if layer is deepest)
    shared = [(layer, inp, key) for (layer, inp), key in zip(members, keys)
              if layer is deepest or (key.inputs == tokens and layer.truncates(deepest))]
    for layer, inp in members:
        if all(layer is not s for s, _, _ in shared):
            layer.attach_features(cache, split_name, inp)
    union = tuple(sorted({i for layer, _, _ in shared for i in layer.layers}))
    entries = [SharedEntry(key, tuple(union.index(i) for i in layer.layers),
                           {"bert": str(layer.resolved.spec), "path": str(layer.resolved.path), "split": split_name})
               for layer, _, key in shared]
    stores = cache.get_or_build_shared(
        entries, shared[0][1], lambda ids, mask, seg: deepest._compute_states(ids, mask, seg, union))
    for (_, inp, _), store in zip(shared, stores):
        inp.features = store


def prepare_bert_inputs(model: nn.Module, data: PreparedData, use_cache: bool | None = None,
                        stream_only: bool = False) -> BertLayer | None:
    """Give every split of ``data`` the BERT stream of the model's BertLayer (none: nothing to do) and,
    when its BERT is frozen with the cache on, the cached features (computed once, on disk under
    ``data.cache_dir/bert_features``). ``use_cache=False`` forces recomputing every step. ``stream_only``: the
    stream and nothing else, for a caller that looks up or builds the features itself."""
    layers = bert_layers(model)
    if not layers:
        for split in data.splits.values():
            split.bert = None  # the data may have served another model: no stale stream in the batches
        return None
    if len(layers) > 1:
        raise BertError(f"the model has {len(layers)} BertLayer modules; a batch carries one BERT stream, so "
                        "share one BertLayer between the parts that need BERT")
    bl = layers[0]
    if bl._prepared is not None and bl._prepared() is data and all(s.bert is not None for s in data.splits.values()):
        return bl  # already done for this data (the trainer and run_experiment both call this)
    t0 = time.perf_counter()
    ws = word_start_table(data.vocab)
    for split in data.splits.values():
        split.bert = bl.encode_split(split, ws, data)
    log.info("BERT stream of %d splits built in %.1f s (max_length %d)", len(data.splits),
             time.perf_counter() - t0, bl.max_length)
    if stream_only:
        return bl
    if (bl.cache_wanted if use_cache is None else use_cache and bl.cache_wanted):
        cache = FeatureCache(data.cfg.resolved_cache_dir() / "bert_features")
        for name, split in data.splits.items():
            bl.attach_features(cache, name, split.bert)
    else:
        why = ("trainable (fine-tuned)" if not bl.frozen else "dropout_when_frozen" if bl.cfg.dropout_when_frozen
               else "model.bert.use_cache=false" if not bl.cfg.use_cache else "use_cache=False")
        log.info("BERT feature cache off (%s): BERT runs every step", why)
    bl._prepared = weakref.ref(data)
    return bl


_SYNTHETIC_ROOT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("nmtcore_synthetic_features", default=None)


@contextlib.contextmanager
def synthetic_features(root: str | Path) -> Iterator[None]:
    """Within it, a frozen BERT's features that a feature cache under ``root`` lacks are random values of the
    right shape, not BERT's states: for a speed probe (:func:`nmtcore.sweep.cost.probe`), whose model reads
    cached features the same way whatever their values, and which then spends no time running BERT over the
    sentences it trains on. Only caches under ``root`` (the probe's temporary folder) are filled so, so no run
    that trains can read them."""
    token = _SYNTHETIC_ROOT.set(Path(root).resolve())
    try:
        yield
    finally:
        _SYNTHETIC_ROOT.reset(token)
