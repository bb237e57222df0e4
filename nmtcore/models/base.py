"""The interface every nmtcore model implements: what the trainer, the losses and beam search may call.

A model is a ``torch.nn.Module`` with four required methods:

- ``encode(batch) -> EncoderOut``: everything on the source side, once.
- ``init_state(enc_out) -> DecoderState``: an empty incremental state for beam search.
- ``decode_step(prev_tokens, enc_out, state) -> logits``: one incremental decoder step for ``prev_tokens``
  (B, 1), reading and growing ``state`` in place; returns (B, V) logits. Under beam search ``enc_out`` has
  one row per sentence and B = sentences × beams (:attr:`NMTModel.beams_share_memory`).
- ``forward(batch) -> ModelOutput``: teacher-forced logits plus the typed extras a loss needs.

and optional hooks, declared here with their defaults so the trainer never probes a model with
``hasattr``: :meth:`NMTModel.prepare` (preprocessing before the model is built), :meth:`parameter_groups`,
:meth:`default_phases`, :meth:`set_phase` and :meth:`prefix_signature` (phases are data the trainer reads), and
:attr:`has_kd_teacher` / :attr:`idle_kd_teacher_allowed` (knowledge distillation), and the diagnostics of
how much a model uses BERT (:meth:`inference_switches`, :meth:`bert_usage`, :meth:`usage_probe`; read by
:mod:`nmtcore.diagnostics` after training). Losses live outside the model (:mod:`nmtcore.engine.losses`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterable, Iterator

from torch import Tensor, nn

from nmtcore.bert import KDStates
from nmtcore.config import ExperimentConfig, PhaseConfig
from nmtcore.nn import DecoderState, EncoderOut

if TYPE_CHECKING:
    import torch

    from nmtcore.nn.drop_net import PlannedDraws
    from nmtcore.data import Batch, PreparedData


@dataclass
class ModelOutput:
    """Teacher-forced output of :meth:`NMTModel.forward`.

    ``logits`` (B, T, V). The rest is optional and typed, so a loss term cannot be dropped by a misspelt
    key: ``enc_out`` (B, S, C) and ``dec_hidden`` (B, T, C) the top encoder/decoder states; ``kd`` the
    states a KD loss compares (training only); ``mlm_loss`` and ``target_lm_loss`` per-token mean
    auxiliary losses (PLM-sponsored NMT Eq. 8-9, training only); ``knowledge_mask`` (B, S) True = source
    embedding masked (mask fusion Eq. 4).
    """

    logits: Tensor
    enc_out: Tensor | None = None
    dec_hidden: Tensor | None = None
    kd: KDStates | None = None
    mlm_loss: Tensor | None = None
    target_lm_loss: Tensor | None = None
    knowledge_mask: Tensor | None = None

    def aux_losses(self) -> list[Tensor]:
        """The auxiliary per-token-mean losses present (added with weight 1, Eq. 9)."""
        return [t for t in (self.mlm_loss, self.target_lm_loss) if t is not None]


@dataclass(frozen=True)
class MemoryTraits:
    """What a sweep's memory estimate (:func:`nmtcore.sweep.memory.trial_memory`) needs to know of a model
    beyond the Transformer's shape, declared by the model class (:meth:`NMTModel.memory_traits`) rather than
    guessed from its config's fields."""

    berts: int = 0  # BERT encoders the model holds (PLM-sponsored: the source's and the target's)
    context_sentences: int = 0  # sentences in a batch's BERT stream besides the source sentence itself
    bert_fine_tuned: bool = False  # BERT's weights train (their gradients and Adam state count)


class NMTModel(nn.Module):
    """Base class: the interface the trainer and beam search rely on, with the optional hooks' defaults."""

    pad_id: int
    bos_id: int
    eos_id: int
    # A model that distils from a frozen copy of its own PLM may build the teacher and leave it idle at
    # train.kd_alpha = 1 (PLM-sponsored Table 3's "-L_kd", the α sweep's α = 1); a teacher-only BERT may not.
    idle_kd_teacher_allowed: ClassVar[bool] = False
    # A model whose encoder reads the BERT stream *instead of* the NMT source (PLM-sponsored) has the WordPieces
    # as its source tokens, so the token budget counts them; for every other model the BERT stream is an extra
    # input and the budget counts NMT tokens only (a BERT arm trains on its control's batches).
    source_is_bert_stream: ClassVar[bool] = False
    # Beam search keeps the encoder output and the caches' static keys/values (encoder, BERT: ``LayerCache.static``)
    # once per sentence, not once per beam: ``decode_step`` then gets ``enc_out`` with one row per sentence and
    # ``prev_tokens``/``state`` rows grouped by sentence (its beams consecutive), and attention shares each static
    # row with its sentence's beams (:func:`nmtcore.nn.layers.attend`). True for a model that reads ``enc_out``
    # in ``decode_step`` only through attention over cached static keys/values (every registered model); a model
    # that combines it row by row with the decoder's states sets False and gets ``enc_out`` expanded to its rows.
    beams_share_memory: ClassVar[bool] = True
    # Whether a training forward can be captured in a CUDA graph (train.cuda_graphs, nmtcore.engine.graphs): no
    # host sync, no host-side draw or branch on data, every shape from the batch's. Read from the class's own
    # body only (not inherited): a family that subclasses the baseline changes its forward and says so itself.
    cuda_graph_safe: ClassVar[bool] = False
    # The longest sequence the model can position (source tokens with EOS; BOS and the target tokens), from
    # ``model.max_positions``; decoding truncates a longer source and caps the target there. None = no limit.
    max_positions: int | None = None

    # ------------------------------------------------------------------ required
    def encode(self, batch: "Batch") -> EncoderOut:  # pragma: no cover - interface
        """Source side of ``batch``, computed once per sentence."""
        raise NotImplementedError

    def init_state(self, enc_out: EncoderOut) -> DecoderState:  # pragma: no cover - interface
        """An empty incremental decoder state for the sentences of ``enc_out``."""
        raise NotImplementedError

    def decode_step(self, prev_tokens: Tensor, enc_out: EncoderOut, state: DecoderState) -> Tensor:
        """(B, 1) previous tokens → (B, V) logits of the next; grows ``state`` in place."""
        raise NotImplementedError  # pragma: no cover - interface

    def forward(self, batch: "Batch") -> ModelOutput:  # pragma: no cover - interface
        """Teacher-forced logits of ``batch`` and the extras its losses need."""
        raise NotImplementedError

    # ------------------------------------------------------------------ optional hooks
    @classmethod
    def prepare(cls, cfg: ExperimentConfig, data: "PreparedData") -> ExperimentConfig:
        """Preprocessing the model class needs before it is built (e.g. PLM-sponsored's target BERT and
        FWET table); returns the config to build with. Idempotent and cached. Default: nothing to do."""
        return cfg

    def parameter_groups(self) -> dict[str, list[nn.Parameter]]:
        """Named parameter sets a phase schedule freezes or trains; every parameter in exactly one. Default:
        one group, ``nmt``."""
        return self.groups()

    @classmethod
    def memory_traits(cls, cfg: ExperimentConfig) -> MemoryTraits:
        """What the memory estimate needs of this model for ``cfg``: by default one BERT when ``model.bert`` is
        on, a context sentence when ``model.bert.context`` asks for one, fine-tuned when it is not frozen or a
        phase trains it."""
        bert = cfg.model.bert
        if not bert.enabled:
            return MemoryTraits()
        return MemoryTraits(berts=1, context_sentences=0 if bert.context == "none" else 1,
                            bert_fine_tuned=not bert.freeze or any("bert" in p.trainable for p in cfg.train.phases))

    def default_phases(self) -> tuple[PhaseConfig, ...]:
        """The model's own phase schedule (BERT-JAM's three phases); () = one implicit phase."""
        return ()

    def set_phase(self, phase: PhaseConfig) -> None:
        """Told by the trainer when a phase begins (e.g. BERT-JAM's GLU scale). Default: nothing."""

    def prefix_signature(self, phases: tuple[PhaseConfig, ...]) -> dict[str, Any]:
        """What training through ``phases``, the first phases of this model's schedule, computes, as plain data: two
        models with equal signatures train those phases alike from the same seed and data, so one run may start
        where the other's ended (:mod:`nmtcore.engine.shared_phases`). Default: the whole model config and the
        phases as they are (only the same model shares)."""
        return {"model": dataclasses.asdict(self.cfg), "phases": [dataclasses.asdict(p) for p in phases]}

    @property
    def has_kd_teacher(self) -> bool:
        """Whether the model built a BERT teacher for knowledge distillation."""
        return False

    def graph_draws(self, device: "torch.device") -> "PlannedDraws | None":
        """For CUDA graphs: the host-side draws a training forward makes (drop-net's branches), planned on the host
        before each forward and read from the device by it (:class:`~nmtcore.nn.drop_net.PlannedDraws`); None: the
        forward draws nothing."""
        return None

    def inference_switches(self) -> dict[str, Callable[[], ContextManager[None]]]:
        """Named ways of switching parts of the model on or off at inference, each a context manager factory;
        the diagnostics decode the validation set under each (BERT-fused: the NMT branches alone, the BERT
        branches alone, Eq. 1's mix). Default: none."""
        return {}

    def bert_usage(self) -> dict[str, float]:
        """Figures of how much the trained model uses BERT, read off its weights (BERT-JAM: the GLU's weight
        per BERT layer). Default: none."""
        return {}

    @contextlib.contextmanager
    def usage_probe(self) -> Iterator[dict[str, float]]:
        """Figures gathered over the forwards run inside the block (document context: its gates' means),
        filled into the yielded dict when the block ends. Default: none."""
        yield {}

    # ------------------------------------------------------------------ helpers for subclasses
    def groups(self, **named: Iterable[nn.Parameter]) -> dict[str, list[nn.Parameter]]:
        """The ``named`` groups plus ``nmt`` = every parameter not in one of them."""
        out = {name: list(params) for name, params in named.items()}
        taken = {id(p) for params in out.values() for p in params}
        out["nmt"] = [p for p in self.parameters() if id(p) not in taken]
        return out

    def num_parameters(self, trainable: bool = False) -> int:
        """Parameter count (only those with ``requires_grad`` if ``trainable``)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad or not trainable)


__all__ = ["MemoryTraits", "DecoderState", "EncoderOut", "KDStates", "ModelOutput", "NMTModel"]
