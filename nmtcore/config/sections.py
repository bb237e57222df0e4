"""The typed, frozen, validated sections of an experiment: data, BERT, model, phases, training, decoding.

Every knob lives in a frozen dataclass whose ``__post_init__`` checks ranges and raises a one-line
:class:`ConfigError` naming the key, so a bad value never trains. The model families extend
:class:`ModelConfig` in :mod:`nmtcore.config.families`; :mod:`nmtcore.config.experiment` assembles the
sections and owns the one override engine.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar
from pathlib import Path

if TYPE_CHECKING:
    import torch


class ConfigError(ValueError):
    """A configuration key is unknown, mistyped or out of range (message names the key)."""


def check(cond: bool, key: str, msg: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` unless ``cond`` holds."""
    if not cond:
        raise ConfigError(f"{key}: {msg}")


def check_unit_interval(value: float, key: str) -> None:
    """Raise unless ``value`` is in [0, 1] (one line naming ``key``)."""
    check(0.0 <= value <= 1.0, key, f"must be in [0, 1], got {value}")


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text comes from and how it is cut into batches.

    A corpus is a directory of ``{split}.{lang}`` files (plain or ``.gz``). ``multi30k`` is found under
    ``data_dir/multi30k`` or downloaded (checksum-verified) into the cache; ``parallel`` reads
    ``data_dir`` as given. ``data_dir`` falls back to ``$NMTCORE_DATA``.
    """

    corpus: str = "multi30k"
    data_dir: str = ""
    src_lang: str = "en"
    tgt_lang: str = "de"
    train_split: str = "train"
    valid_split: str = "val"
    test_splits: tuple[str, ...] = ("test_2016_flickr",)
    vocab_size: int = 8000
    # Moses clean-corpus-n semantics, applied to the training split only (counted in subwords):
    # drop pairs with a side shorter than min_len or longer than max_len, or with a length ratio
    # above max_len_ratio.
    min_len: int = 1
    max_len: int = 250
    max_len_ratio: float = 9.0
    max_tokens: int = 4096  # per batch, counting the longer side x sentences (padding included)
    max_sentences: int = 0  # 0 = no cap
    cache_dir: str = ""  # "" = $NMTCORE_CACHE or ~/.cache/nmtcore
    download: bool = True
    # training batches collated this many ahead in a background thread (nmtcore.data.prefetch); 0 = in the loop
    prefetch_batches: int = 1

    def __post_init__(self) -> None:
        check(bool(self.corpus), "data.corpus", "must not be empty")
        check(self.src_lang != self.tgt_lang, "data.tgt_lang", "must differ from data.src_lang")
        check(self.vocab_size >= 16, "data.vocab_size", f"must be >= 16, got {self.vocab_size}")
        check(self.min_len >= 0, "data.min_len", "must be >= 0")
        check(self.max_len >= max(1, self.min_len), "data.max_len", "must be >= max(1, data.min_len)")
        check(self.max_len_ratio >= 1.0, "data.max_len_ratio", "must be >= 1")
        check(self.max_tokens > 0, "data.max_tokens", "must be > 0")
        check(self.max_sentences >= 0, "data.max_sentences", "must be >= 0")
        check(self.prefetch_batches >= 0, "data.prefetch_batches", "must be >= 0")

    def resolved_data_dir(self) -> Path | None:
        """``data_dir`` or ``$NMTCORE_DATA``, absolute; None if neither is set."""
        d = self.data_dir or os.environ.get("NMTCORE_DATA", "")
        return Path(d).expanduser().resolve() if d else None

    def resolved_cache_dir(self) -> Path:
        """``cache_dir`` or ``$NMTCORE_CACHE`` or ``~/.cache/nmtcore``, absolute."""
        d = self.cache_dir or os.environ.get("NMTCORE_CACHE", "") or "~/.cache/nmtcore"
        return Path(d).expanduser().resolve()


@dataclass(frozen=True)
class BertConfig:
    """Which BERT a model consumes and how. Give ``name`` *or* a size ``layers`` × ``hidden``, never both.

    ``name``: a local directory, a hub id (``bert-base-uncased``), ``minilm`` (the packaged
    all-MiniLM-L6-v2) or ``pretrained-here:L4-H256:<corpus>:<lang>`` (made by ``nmtcore bert-pretrain``).
    ``layers``/``hidden``: a size preset, resolved to Google's ``bert_uncased_L-{L}_H-{H}_A-{H/64}`` when
    reachable, else to the platform's own pretrained BERT of that size. Empty = the model uses no BERT.
    """

    name: str = ""
    layers: int = 0
    hidden: int = 0
    freeze: bool = True
    dropout_when_frozen: bool = False  # the original BERT-fused code left it on; off = eval-mode BERT
    use_cache: bool = True  # frozen-feature cache (bypassed automatically while BERT is fine-tuned)
    # While the BERT is fine-tuned, keep only each BERT layer's input for the backward pass and recompute the
    # layer there (nmtcore.nn.checkpointing): the same numbers, less memory, more time (docs/performance.md). On by
    # default so fine-tuned trials stay within the memory bars; turn it off where memory allows (a speed-only
    # setting, SPEED_ONLY_KEYS: a resumed sweep takes it from its command). No effect on a frozen BERT.
    activation_checkpointing: bool = True
    max_length: int = 0  # 0 = the BERT's max positions
    # BERT input: "none" = [CLS] sentence [SEP]; "previous" = [CLS] previous line [SEP] sentence [SEP] with
    # segment ids 0/1 (document-level context, Eq. 2 of the context-encoder paper).
    # On a document corpus (<d> markers) "previous" is the previous sentence of the same document (empty at a
    # document start). The doc_context model builds its own context (model.context_type) and needs "none" here.
    context: str = "none"
    # Student state distilled from this BERT when train.kd_alpha < 1: the top encoder layer (CTNMT) or
    # layer M/2 (PLM-sponsored NMT, Eq. 4).
    kd_layer: str = "encoder_top"
    # A size no published BERT answers is made here (nmtcore.bert.resolve.offline_for_size): a truncation
    # of a packaged encoder, else a student distilled here (English) or a BERT pretrained with MLM on
    # "<corpus>:<lang>" (other languages). pretrain_corpus "" = the experiment's source side; its language
    # picks the rule. pretrain_steps: the distillation / MLM updates of what is made; 0 = the recipe's default.
    pretrain_corpus: str = ""
    pretrain_steps: int = 0
    cache_dir: str = ""  # where platform-made BERTs live; "" = data.cache_dir's default ($NMTCORE_CACHE)

    def __post_init__(self) -> None:
        check(not (self.name and (self.layers or self.hidden)), "model.bert.name",
              "give a BERT name or a size (model.bert.layers/hidden), never both")
        check(self.layers >= 0 and self.hidden >= 0, "model.bert.layers", "must be >= 0")
        check((self.layers > 0) == (self.hidden > 0), "model.bert.hidden",
              "model.bert.layers and model.bert.hidden go together")
        check(self.hidden % 64 == 0, "model.bert.hidden", f"must be a multiple of 64 (heads of 64), got {self.hidden}")
        check(self.max_length == 0 or self.max_length >= 4, "model.bert.max_length",
              f"must be 0 (the BERT's max positions) or >= 4, got {self.max_length}")
        check(self.context in ("none", "previous"), "model.bert.context",
              f"must be 'none' or 'previous', got {self.context!r}")
        check(self.kd_layer in ("encoder_top", "encoder_half"), "model.bert.kd_layer",
              f"must be 'encoder_top' or 'encoder_half', got {self.kd_layer!r}")
        check(self.pretrain_corpus == "" or (self.pretrain_corpus.count(":") == 1
                                             and all(self.pretrain_corpus.split(":"))),
              "model.bert.pretrain_corpus", f"must be '<corpus>:<lang>' or empty, got {self.pretrain_corpus!r}")
        check(self.pretrain_steps >= 0, "model.bert.pretrain_steps",
              f"must be >= 0 (0 = the recipe's default), got {self.pretrain_steps}")

    @property
    def enabled(self) -> bool:
        return bool(self.name or self.layers)


@dataclass(frozen=True)
class ModelConfig:
    """Transformer hyper-parameters; every model family's config extends this one."""

    # Whether a trained baseline Transformer's checkpoint initialises this family (its parameters extend the
    # baseline's under the same names): the warm start of BERT-fused, document-context and mask fusion.
    warm_starts_from_baseline: ClassVar[bool] = True

    name: str = "transformer"
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_model: int = 512
    ffn_dim: int = 2048
    heads: int = 8
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    activation: str = "relu"
    pre_norm: bool = False
    share_embeddings: bool = True
    max_positions: int = 1024
    bert: BertConfig = field(default_factory=BertConfig)

    def __post_init__(self) -> None:
        for key in ("encoder_layers", "decoder_layers", "d_model", "ffn_dim", "heads", "max_positions"):
            check(getattr(self, key) > 0, f"model.{key}", f"must be > 0, got {getattr(self, key)}")
        check(self.d_model % self.heads == 0, "model.heads",
              f"must divide model.d_model ({self.d_model} % {self.heads} != 0)")
        check(self.d_model % 2 == 0, "model.d_model", "must be even (sinusoidal positions)")
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            check_unit_interval(getattr(self, key), f"model.{key}")
            check(getattr(self, key) < 1.0, f"model.{key}", "must be < 1")
        check(self.activation in ("relu", "gelu"), "model.activation",
              f"must be 'relu' or 'gelu', got {self.activation!r}")


@dataclass(frozen=True)
class PhaseConfig:
    """One phase of a training schedule (BERT-JAM Section 2.4): which parameter groups train, for how long.

    ``trainable``: names of the model's parameter groups (``model.parameter_groups()``, e.g. ``nmt``,
    ``glu``, ``bert``) that receive gradients; every other group is frozen. ``epochs``: the phase's length;
    0 = open-ended (until ``train.max_epochs`` or early stopping; last phase only). ``glu_scale``: the
    factor the model multiplies its GLU output by (2 in BERT-JAM's phase 1, Eq. 11). ``early_stop``:
    ``train.patience`` applies in this phase (counted from the phase's start). A frozen BERT is served
    from the frozen-feature cache; a phase that trains ``bert`` bypasses it (the BERT layer follows
    ``requires_grad``).
    """

    name: str = "main"
    epochs: int = 0
    trainable: tuple[str, ...] = ("nmt",)
    glu_scale: float = 1.0
    early_stop: bool = False

    def __post_init__(self) -> None:
        check(bool(self.name), "train.phases.name", "must not be empty")
        check(self.epochs >= 0, f"train.phases[{self.name}].epochs", f"must be >= 0, got {self.epochs}")
        check(len(self.trainable) > 0 and len(set(self.trainable)) == len(self.trainable),
              f"train.phases[{self.name}].trainable", f"must be non-empty without repeats, got {self.trainable}")
        check(self.glu_scale > 0, f"train.phases[{self.name}].glu_scale", f"must be > 0, got {self.glu_scale}")


def scale_phases(phases: tuple[PhaseConfig, ...], scale: float) -> tuple[PhaseConfig, ...]:
    """``train.phase_scale`` applied: every closed phase's epochs × ``scale``, rounded half up, at least 1
    (an open-ended phase, 0 epochs, stays open). ``scale`` 1 returns ``phases`` unchanged."""
    if scale == 1.0:
        return phases
    return tuple(replace(p, epochs=max(1, math.floor(p.epochs * scale + 0.5))) if p.epochs else p for p in phases)


def describe_phases(phases: tuple[PhaseConfig, ...]) -> str:
    """``warmup 40 + glu 10 + finetune 10`` (an open-ended phase reads ``name open``)."""
    return " + ".join(f"{p.name} {p.epochs or 'open'}" for p in phases)


def check_schedule_budget(phases: tuple[PhaseConfig, ...], max_epochs: int, scale: float, source: str) -> None:
    """A phase schedule is honoured or refused: raise a one-line :class:`ConfigError` when
    ``train.max_epochs`` cannot run every phase of ``phases`` scaled by ``scale`` (an open-ended last phase
    needs at least one epoch), naming both numbers and the two ways out. ``source`` says where the schedule
    comes from (``train.phases``, or the model's default schedule)."""
    if not phases:
        return
    run = scale_phases(phases, scale)
    need = sum(p.epochs for p in run) + (1 if run[-1].epochs == 0 else 0)
    if max_epochs >= need:
        return
    scaled = f" scaled by train.phase_scale={scale:g} to {describe_phases(run)}" if scale != 1.0 else ""
    hint = ""
    if len(phases) <= max_epochs:  # every phase keeps >= 1 epoch: some scale fits
        s = suggest_phase_scale(phases, max_epochs)
        hint = f", or scale the schedule: train.phase_scale={s:g} gives {describe_phases(scale_phases(phases, s))}"
    raise ConfigError(f"train.max_epochs: {max_epochs} epochs cannot run the {need}-epoch phase schedule of "
                      f"{source} ({describe_phases(phases)}{scaled}); set train.max_epochs >= {need}{hint}")


def check_converge_budget(phases: tuple[PhaseConfig, ...], max_epochs: int, patience: int, source: str) -> None:
    """Phases run until convergence (``train.phases_converge``) each take at least ``patience + 1`` epochs (the
    first epoch of a phase is its best so far; ``patience`` more without a gain end it): a one-line
    :class:`ConfigError` when ``train.max_epochs`` cannot run that many."""
    need = len(phases) * (patience + 1)
    if phases and max_epochs < need:
        raise ConfigError(f"train.max_epochs: {max_epochs} epochs cannot run the {len(phases)} phases of {source} "
                          f"until convergence ({describe_phases(tuple(replace(p, epochs=0) for p in phases))}: at "
                          f"least train.patience + 1 = {patience + 1} epochs each); set train.max_epochs >= {need}")


def suggest_phase_scale(phases: tuple[PhaseConfig, ...], max_epochs: int) -> float:
    """A ``train.phase_scale`` to suggest: ``max_epochs`` / the schedule's length (floored to 0.01), lowered
    in steps of 0.01 until the rounded schedule fits ``max_epochs``."""
    closed = sum(p.epochs for p in phases)
    open_end = 1 if phases[-1].epochs == 0 else 0
    s = math.floor(100 * (max_epochs - open_end) / max(closed, 1)) / 100
    while s > 0.01 and sum(p.epochs for p in scale_phases(phases, s)) + open_end > max_epochs:
        s = round(s - 0.01, 2)
    return max(s, 0.01)


STOP_METRICS = {"valid_loss": False, "valid_bleu": True}  # what the stopping rule may watch: higher is better?


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and stopping. fairseq semantics for the LR schedule."""

    lr: float = 5e-4
    warmup_updates: int = 4000
    warmup_init_lr: float = 1e-7
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    label_smoothing: float = 0.1
    clip_norm: float = 0.0  # 0 = no clipping
    update_freq: int = 1  # gradient accumulation steps per update
    max_epochs: int = 10
    max_updates: int = 0  # 0 = no limit
    # The stopping rule (nmtcore.engine.stopping): stop after ``patience`` epochs in a row that did not beat the
    # best ``stop_metric`` by more than ``min_delta`` (its own units: BLEU points, or bits of loss); 0 = off, the
    # run then ends at its fixed schedule. ``max_epochs`` / ``max_updates`` stay the cap. The best epoch (the
    # tested weights without averaging) is the best by ``stop_metric``.
    patience: int = 0
    stop_metric: str = "valid_loss"  # valid_loss (lower is better) or valid_bleu (greedy, higher is better)
    min_delta: float = 0.0
    # With stop_metric valid_bleu: an epoch that lowers the validation loss below every earlier epoch's (by more
    # than nmtcore.engine.stopping.LOSS_GAIN, relative) is not an epoch without a gain either, so the rule stops a
    # run only when BLEU and the loss have both stalled (greedy BLEU on a small validation set is noisy from epoch
    # to epoch; the loss is the smoother sign that a run still learns). docs/convergence.md.
    loss_guard: bool = False
    seed: int = 1
    precision: str = "auto"  # auto = bf16 autocast where the hardware has it, else fp32
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's default
    # torch.compile (inductor, dynamic shapes) of the training forward; validation and decoding stay eager.
    # Off by default: on the CPUs measured it was slower than eager (docs/performance.md).
    compile: bool = False
    # CUDA graphs over each update's forward and backward passes, one per padded batch shape (at most
    # cuda_graph_max of them; other shapes run eagerly): fewer host launches where a GPU step is bound by the
    # host (docs/performance.md, GPUs). Off by default: dropout masks then differ from eager training, so
    # a resumed run is not bit-identical to an uninterrupted one. Where it cannot apply (CPU, DDP, KD, a model
    # family not declared capture-safe) the run trains eagerly and logs why (nmtcore.engine.graphs).
    cuda_graphs: bool = False
    cuda_graph_max: int = 64
    keep_last: int = 3  # epoch checkpoints kept on disk
    # Average the last K epoch checkpoints (of the last phase, with a schedule) into the tested model; 0 = off.
    # BERT-JAM averages the last 10 epochs (Section 3); its studies scale K with the schedule.
    average_last: int = 0
    valid_bleu: bool = True  # greedy-decode the validation set each epoch for BLEU
    log_interval: int = 50
    save_dir: str = ""  # "" = <experiment.output_dir>/checkpoints
    # Knowledge distillation from BERT: L = kd_alpha·L_NMT + (1 − kd_alpha)·L_KD; 1.0 = no KD.
    kd_alpha: float = 1.0
    # Phase schedule (BERT-JAM's three phases); () = the model's default_phases() if it has one, else a
    # single implicit phase that leaves requires_grad as the model set it. See PhaseConfig.
    phases: tuple[PhaseConfig, ...] = ()
    # Every phase's epochs × phase_scale (rounded half up, each >= 1), for the configured or the model's own
    # schedule: the explicit way to run a long schedule (BERT-JAM's 40/10/10) on a small budget, logged by
    # the trainer. A schedule longer than max_epochs is refused, never cut (check_schedule_budget).
    phase_scale: float = 1.0
    # Every phase of the schedule until convergence (BERT-JAM Section 3: "we train the model until convergence
    # in the first two phases"): a phase ends when the patience rule fires in it, counted from its start, and the
    # next one begins; the last phase's ends the run. The phases' epochs then do not apply (train.max_epochs caps
    # the whole run), nor does phase_scale. Needs train.patience.
    phases_converge: bool = False
    # Warm start: a trained checkpoint (e.g. the baseline's) whose matching weights initialise the model
    # before training; new parameters (BERT attention) stay fresh. Ignored when resuming.
    init_from: str = ""

    def __post_init__(self) -> None:
        for key in ("lr", "warmup_init_lr", "adam_eps", "weight_decay", "label_smoothing", "clip_norm", "kd_alpha"):
            value = getattr(self, key)
            check(isinstance(value, (int, float)) and math.isfinite(value), f"train.{key}",
                  f"must be a finite number, got {value!r}")
        check(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        check(self.warmup_updates >= 0, "train.warmup_updates", "must be >= 0")
        check(0 <= self.warmup_init_lr <= self.lr, "train.warmup_init_lr", "must be in [0, train.lr]")
        check(len(self.adam_betas) == 2 and all(0 <= b < 1 for b in self.adam_betas), "train.adam_betas",
              f"must be two numbers in [0, 1), got {self.adam_betas}")
        check(self.adam_eps > 0, "train.adam_eps", "must be > 0")
        check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        check(0 <= self.label_smoothing < 1, "train.label_smoothing", "must be in [0, 1)")
        check(self.clip_norm >= 0, "train.clip_norm", "must be >= 0")
        check(self.update_freq >= 1, "train.update_freq", "must be >= 1")
        check(self.max_epochs >= 1, "train.max_epochs", "must be >= 1")
        check(self.max_updates >= 0, "train.max_updates", "must be >= 0")
        check(self.patience >= 0, "train.patience", "must be >= 0")
        check(self.stop_metric in STOP_METRICS, "train.stop_metric",
              f"must be one of {', '.join(STOP_METRICS)}, got {self.stop_metric!r}")
        check(math.isfinite(self.min_delta) and self.min_delta >= 0, "train.min_delta",
              f"must be a finite number >= 0, got {self.min_delta}")
        check(not self.loss_guard or self.stop_metric == "valid_bleu", "train.loss_guard",
              "guards the valid_bleu rule with the validation loss; with stop_metric valid_loss it adds nothing")
        check(self.stop_metric != "valid_bleu" or self.valid_bleu, "train.stop_metric",
              "valid_bleu needs train.valid_bleu=true (the validation set decoded every epoch)")
        check(self.precision in ("auto", "fp32", "bf16"), "train.precision",
              f"must be auto, fp32 or bf16, got {self.precision!r}")
        check(self.num_threads >= 0, "train.num_threads", "must be >= 0")
        check(self.keep_last >= 1, "train.keep_last", "must be >= 1")
        check(self.cuda_graph_max >= 1, "train.cuda_graph_max", "must be >= 1")
        check(0 <= self.average_last <= self.keep_last, "train.average_last",
              "must be in [0, train.keep_last]")
        check(self.log_interval >= 1, "train.log_interval", "must be >= 1")
        check_unit_interval(self.kd_alpha, "train.kd_alpha")
        names = [p.name for p in self.phases]
        check(len(set(names)) == len(names), "train.phases", f"phase names must be unique, got {names}")
        check(all(p.epochs > 0 for p in self.phases[:-1]), "train.phases",
              "only the last phase may be open-ended (epochs = 0)")
        check(math.isfinite(self.phase_scale) and self.phase_scale > 0, "train.phase_scale",
              f"must be > 0, got {self.phase_scale}")
        check(not self.phases_converge or self.patience > 0, "train.phases_converge",
              "ends each phase when the patience rule fires: set train.patience > 0")
        check(not self.phases_converge or self.phase_scale == 1.0, "train.phase_scale",
              "scales fixed phase lengths; with train.phases_converge every phase runs until the patience rule "
              "fires: leave it at 1")
        if self.phases_converge:
            check_converge_budget(self.phases, self.max_epochs, self.patience, "train.phases")
        else:
            check_schedule_budget(self.phases, self.max_epochs, self.phase_scale, "train.phases")

    def schedule(self, phases: tuple[PhaseConfig, ...], source: str) -> tuple[PhaseConfig, ...]:
        """``phases`` (``train.phases`` or a model's default schedule) as this config runs them: scaled by
        ``phase_scale`` and checked against ``max_epochs`` (a one-line :class:`ConfigError` if they do not
        fit). Validated as ``train.phases`` are."""
        if not phases:
            return ()
        if self.phases_converge:  # every phase open: the patience rule ends it
            check_converge_budget(phases, self.max_epochs, self.patience, source)
            replace(self, phases=phases)  # the rest of a configured schedule's validation (names, open end)
            return tuple(replace(p, epochs=0) for p in phases)
        check_schedule_budget(phases, self.max_epochs, self.phase_scale, source)
        replace(self, phases=phases)  # the rest of a configured schedule's validation (names, open end)
        return scale_phases(phases, self.phase_scale)


@dataclass(frozen=True)
class DecodeConfig:
    """Beam search (fairseq length-penalty semantics: score / length ** lenpen)."""

    beam: int = 5
    lenpen: float = 1.0
    max_len_a: float = 1.2
    max_len_b: int = 10
    min_len: int = 1
    nbest: int = 1
    # Sentences per batch; 0 = by device (:meth:`sentences_per_batch`).
    max_sentences: int = 0
    precision: str = "auto"

    def __post_init__(self) -> None:
        check(self.beam >= 1, "decode.beam", f"must be >= 1, got {self.beam}")
        check(1 <= self.nbest <= self.beam, "decode.nbest", "must be in [1, decode.beam]")
        check(self.max_len_a >= 0 and self.max_len_b >= 1, "decode.max_len_b",
              "max_len_a must be >= 0 and max_len_b >= 1")
        check(self.min_len >= 0, "decode.min_len", "must be >= 0")
        check(self.max_sentences >= 0, "decode.max_sentences", "must be >= 1, or 0 for the device's default")
        check(self.precision in ("auto", "fp32", "bf16"), "decode.precision",
              f"must be auto, fp32 or bf16, got {self.precision!r}")

    def sentences_per_batch(self, device: torch.device) -> int:
        """``max_sentences``, or by device when 0: 128 on a CPU (the size every CPU decoding figure in docs/performance.md
        was measured at); 1,024 on a GPU, where a beam step is bound by kernel launches, not arithmetic (on an
        H100, beam 5 over Multi30k decoded 1,726 sentences/s at 128 a batch and 8,403 at 1,024, for 1.5 GiB:
        bench/gpu.py's decode section, results/bench/2026-11-27-gpu-h100 run 4)."""
        if self.max_sentences:
            return self.max_sentences
        return 128 if device.type == "cpu" else 1024
