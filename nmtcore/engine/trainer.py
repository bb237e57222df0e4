"""The model-agnostic training loop.

The trainer sees a model only through the interface of :class:`~nmtcore.models.NMTModel`:
``forward(batch) -> ModelOutput`` (and ``encode``/``decode_step`` via beam search for validation BLEU),
plus its declared hooks for phases. The loss lives in :mod:`nmtcore.engine.losses`. It reports every
epoch through :class:`Callback` objects, which is how MLflow tracking and a Ray worker drive the very same
loop unchanged.

fairseq semantics throughout: the summed loss of an update is divided by its number of target tokens,
Adam + inverse-sqrt schedule with the rate set per update, token-budget batches reshuffled per epoch
from ``(seed, epoch)``. Checkpoints hold everything needed to continue bit-identically: model,
optimizer, update counter, early-stopping state and the torch RNG state (dropout). Phases are data
(:mod:`nmtcore.engine.phases`).

One module, on purpose: the update, validation, checkpointing, resume and the stopping rule share
the trainer's state and are read together when a run misbehaves; what stands alone lives beside it (losses,
optim, phases, stopping, summary, warm_start).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from nmtcore import bleu
from nmtcore.bert import prepare_bert_inputs, release_unusable_features
from nmtcore.checkpoint import (
    CheckpointError,
    average_checkpoints,
    epoch_checkpoints,
    load_checkpoint,
    load_model_weights,
    remove_checkpoint,
    save_checkpoint,
)
from nmtcore.config import DecodeConfig, ExperimentConfig, PhaseConfig
from nmtcore.config.sections import describe_phases
from nmtcore.data import Batch, EncodedSplit, PreparedData, batch_indices, collate, prefetch
from nmtcore.decoding import translate_split
from nmtcore.devices import autocast, autocast_dtype, default_device, env_flag
from nmtcore.engine.graphs import StepGraphs, pad_to_bucket, why_not
from nmtcore.engine.losses import check_kd, label_smoothed_nll, training_loss
from nmtcore.engine.optim import InverseSqrtSchedule, build_optimizer
from nmtcore.engine.phases import (
    apply_phase,
    check_update_budget,
    saved_phase,
    schedule_length,
    start_schedule,
)
from nmtcore.engine.shared_phases import PhaseShare, SharedStart, keep_phase_end, start_from_shared
from nmtcore.engine.stopping import StopRule, stopped_by
from nmtcore.engine.summary import FitResult, RunSummary
from nmtcore.models import NMTModel

log = logging.getLogger("nmtcore.engine")


# A loss (bits per token) past which its perplexity 2**loss is no float64 (2**1024 overflows): a run this far
# gone has diverged, finite or not. Not a tuned threshold: the figure the run reports stops existing.
DIVERGED_BITS = 1023.0
# A run's first console line comes after this many seconds of training if train.log_interval updates take longer
# (a slow first run shows it is training well before the interval's first line); later lines keep the interval.
FIRST_LINE_S = 20.0


class NonFiniteLossError(FloatingPointError):
    """Training diverged: a training or validation loss became NaN, infinite, or too large for its perplexity
    (:data:`DIVERGED_BITS`). Raised before the optimizer step, so the weights and every checkpoint written
    before it are as they were. Its message is one line: where, which figure, and what to try."""

    def __init__(self, message: str, *, update: int = 0, epoch: int = 0, figure: str = "", value: float = math.nan):
        super().__init__(message)
        self.update, self.epoch, self.figure, self.value = update, epoch, figure, value


def diverged(value: float) -> bool:
    """Whether a per-token loss in bits says the run diverged: not finite, or past :data:`DIVERGED_BITS`."""
    return not math.isfinite(value) or value > DIVERGED_BITS


class Callback:
    """Hooks the trainer calls; override what you need. ``metrics`` are plain floats."""

    def on_train_start(self, trainer: "Trainer") -> None:
        """Before the first epoch (after a resume: with the restored state)."""

    def on_log(self, trainer: "Trainer", metrics: dict[str, float]) -> None:
        """Every ``train.log_interval`` updates: running training figures."""

    def on_epoch_end(self, trainer: "Trainer", epoch: int, metrics: dict[str, float],
                     checkpoint: Path | None) -> None:
        """After each epoch's validation and checkpoint (``None`` on ranks that do not write)."""

    def on_train_end(self, trainer: "Trainer", summary: RunSummary) -> None:
        """After testing, with the run's summary."""


# ---------------------------------------------------------------------- the trainer
@dataclass
class TrainState:
    """Counters that a checkpoint carries across a resume."""

    epoch: int = 0  # last completed epoch
    num_updates: int = 0
    best_valid_loss: float = math.inf  # the lowest validation loss so far (reported)
    best_epoch: int = 0  # the best epoch by train.stop_metric (its weights are tested without averaging)
    bad_epochs: int = 0  # epochs in a row without a gain of more than train.min_delta in train.stop_metric
    best_score: float = math.nan  # the best train.stop_metric so far (NaN: none yet)
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Trains one model on one prepared dataset as ``cfg.train`` says; :meth:`fit` runs the loop,
    :meth:`finalize_model` loads the weights to test with."""

    def __init__(self, cfg: ExperimentConfig, model: NMTModel, data: PreparedData,
                 callbacks: list[Callback] | tuple[Callback, ...] = (), device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.data = data
        self.device = device or default_device()
        self.model = model.to(self.device)
        # The phase schedule first: one that the budget cannot run is refused before any BERT work.
        self.phases: tuple[PhaseConfig, ...] = start_schedule(cfg, self.model)  # phase 1's trainable set applied
        # BERT hook (nmtcore.bert): a model owning a BertLayer gets its BERT stream (and, frozen, the cached
        # features) on every split; a BERT the first phase fine-tunes gets no cache (it would never be read).
        # KD without a teacher (or a teacher without KD) fails here.
        prepare_bert_inputs(self.model, data)
        check_kd(cfg.train, self.model)
        self.callbacks = list(callbacks)
        self._said_training = False  # whether this process's training has printed a line (FIRST_LINE_S)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.ddp_model: torch.nn.Module = self.model
        self.graphs: StepGraphs | None = None
        self.amp_dtype = autocast_dtype(cfg.train.precision, self.device)
        self._wrap_ddp()
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train)
        self.schedule = InverseSqrtSchedule(cfg.train)
        self.state = TrainState()
        self.stop_rule = StopRule.from_config(cfg.train)
        self.phase_index = -1  # -1: the single implicit phase (no schedule)
        if self.phases:
            if cfg.train.max_updates:
                check_update_budget(self.phases, cfg.train.max_updates, self.updates_per_epoch())
            self.log_schedule()
            self.enter_phase(0)
        self.save_dir = Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints").resolve()
        self.train_tokens_per_s = 0.0
        self.share: PhaseShare | None = None  # where phase ends are kept and found (nmtcore.engine.shared_phases)
        self.shared_start: SharedStart | None = None  # set when this run started from another's phases

    def _wrap_ddp(self) -> None:
        """The module the training forward goes through: the model, in DDP over ranks, compiled with
        ``train.compile``; or, with ``train.cuda_graphs`` where it applies, the model's forward and backward
        replayed from CUDA graphs (:attr:`graphs`). (Re)built after a phase change (DDP registers the trainable
        set once; a graph, the gradients it writes)."""
        self.ddp_model = self.model
        if self.world_size > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        if self.cfg.train.compile:
            # Training forward only: validation, decoding (incremental steps) and checkpoints use self.model.
            self.ddp_model = torch.compile(self.ddp_model, dynamic=True)
        self.graphs = None
        if self.cfg.train.cuda_graphs:
            reason = why_not(self.cfg, self.model, self.device, self.world_size)
            if reason:
                log.info("train.cuda_graphs: trains eagerly: %s", reason)
            else:
                self.model.zero_grad(set_to_none=True)  # the graphs allocate the gradients they write
                self.graphs = StepGraphs(functools.partial(self._forward_backward, self.model, cache=False),
                                         list(self.model.parameters()), self.cfg.train.cuda_graph_max,
                                         draws=self.model.graph_draws(self.device))

    # ------------------------------------------------------------------ phases
    def log_schedule(self) -> None:
        """Log the schedule this run follows (scaled by ``train.phase_scale`` when it is not 1)."""
        tc = self.cfg.train
        unscaled = tc.phases or tuple(self.model.default_phases())
        scaled = (f"scaled x{tc.phase_scale:g} (train.phase_scale) from {describe_phases(unscaled)} to "
                  if tc.phase_scale != 1.0 else "")
        log.info("phase schedule %s%s epochs (train.max_epochs=%d); checkpoint averaging: %s", scaled,
                 describe_phases(self.phases), tc.max_epochs,
                 f"last {tc.average_last} epochs of the last phase" if tc.average_last > 1 else "off")

    def updates_per_epoch(self) -> int:
        """Optimizer updates in one epoch of this rank (its batches / ``train.update_freq``, rounded up)."""
        split = self.data.splits[self.cfg.data.train_split]
        dc = self.cfg.data
        n = sum(1 for _ in batch_indices(split.src_lens, split.tgt_lens, dc.max_tokens, dc.max_sentences, shuffle=True,
                                         seed=self.cfg.train.seed, epoch=1, rank=self.rank, world_size=self.world_size,
                                         bert_lens=self.budgeted_bert_lens(split)))
        return math.ceil(n / self.cfg.train.update_freq)

    def enter_phase(self, index: int) -> None:
        """Switch to phase ``index``: set requires_grad per parameter group, tell the model
        (``set_phase``), and rebuild the optimizer — its state is reset at a phase change, as the original
        BERT-JAM code; the LR schedule's update counter carries over."""
        phase = self.phases[index]
        counts = apply_phase(self.model, phase)
        release_unusable_features(self.model, self.data)  # a BERT fine-tuned from here on: its cache is stale
        self.optimizer = build_optimizer(self.model.parameters(), self.cfg.train)
        self._wrap_ddp()
        self.phase_index = index
        log.info("phase %d/%d %r: trainable %s (%s parameters per group), glu_scale %g", index + 1,
                 len(self.phases), phase.name, list(phase.trainable), counts, phase.glu_scale)

    # ------------------------------------------------------------------ batches
    def train_batches(self, epoch: int) -> Iterator[Batch]:
        """The epoch's shuffled token-budget batches of the training split (this rank's share).

        The budget counts the tokens of the model's own source and target, never an extra BERT stream's
        WordPieces, as fairseq and the papers' code do: a BERT arm then trains on exactly its control's batches
        (same sentences, same order, same number of updates an epoch), so the study compares models, not
        batchings. The BERT stream of a batch may then hold more than ``data.max_tokens`` padded WordPieces (on
        Multi30k up to 1.47x the budget for a sentence, 2.11x with the previous sentence as context);
        :mod:`nmtcore.sweep.memory` counts that. A model whose source *is* the BERT stream (PLM-sponsored,
        ``source_is_bert_stream``) has it counted (:meth:`budgeted_bert_lens`)."""
        split = self.data.splits[self.cfg.data.train_split]
        dc = self.cfg.data
        indices = batch_indices(split.src_lens, split.tgt_lens, dc.max_tokens, dc.max_sentences, shuffle=True,
                                seed=self.cfg.train.seed, epoch=epoch, rank=self.rank, world_size=self.world_size,
                                bert_lens=self.budgeted_bert_lens(split))
        host = (self.host_batch(split, idx) for idx in indices)
        if self.graphs is not None:  # bucket shapes, padded here in the prefetch thread
            host = (pad_to_bucket(b, self.data.vocab.pad_id) for b in host)
        for batch in prefetch(host, dc.prefetch_batches):  # the next batch collates while this one trains
            yield batch.to(self.device)

    def eval_batches(self, split: EncodedSplit) -> Iterator[Batch]:
        """Batches of ``split`` in length order, unshuffled, under the budget :meth:`train_batches` counts."""
        dc = self.cfg.data
        for idx in batch_indices(split.src_lens, split.tgt_lens, dc.max_tokens, dc.max_sentences, shuffle=False,
                                 bert_lens=self.budgeted_bert_lens(split)):
            yield self.collate(split, idx)

    def budgeted_bert_lens(self, split: EncodedSplit) -> np.ndarray | None:
        """The BERT stream's lengths when the token budget counts them (the model's source is that stream), else
        None: an extra BERT input does not change a batch."""
        return split.bert_lens if self.model.source_is_bert_stream else None

    def host_batch(self, split: EncodedSplit, idx: np.ndarray) -> Batch:
        """The sentences ``idx`` of ``split`` as a padded batch in host memory."""
        v = self.data.vocab
        return collate(split, idx, v.pad_id, v.bos_id, v.eos_id)

    def collate(self, split: EncodedSplit, idx: np.ndarray) -> Batch:
        """The sentences ``idx`` of ``split`` as a padded batch on the trainer's device."""
        return self.host_batch(split, idx).to(self.device)

    # ------------------------------------------------------------------ one update
    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _forward_backward(self, module: torch.nn.Module, batch: Batch, cache: bool = True) -> tuple[Tensor, Tensor]:
        """One batch's forward and backward passes through ``module`` (the training module, or under
        :attr:`graphs` the model itself, with autocast's weight cache off: a capture cannot keep it): the summed
        loss and NLL, detached."""
        with autocast(self.amp_dtype, self.device, cache=cache):
            out = module(batch)
        lo = training_loss(out, batch.tgt_out, self.cfg.train, self.data.vocab.pad_id, batch.n_tgt_tokens)
        lo.loss.backward()
        return lo.loss.detach(), lo.nll.detach()

    def train_step(self, batches: list[Batch]) -> dict[str, float]:
        """One optimizer update over ``batches`` (gradient accumulation); returns summed statistics.

        The host waits for the device once per update (the losses, to refuse a non-finite one before the
        optimizer step); token counts come from the batches, which know them on the host.
        """
        self.ddp_model.train()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # Σ loss, Σ nll, kept on the device
        n_tokens = 0
        for i, batch in enumerate(batches):
            if self.graphs is not None:
                loss, nll = self.graphs.run(batch)
            else:
                sync = self.world_size == 1 or i == len(batches) - 1
                with contextlib.nullcontext() if sync else self.ddp_model.no_sync():
                    loss, nll = self._forward_backward(self.ddp_model, batch)
            sums += torch.stack([loss, nll]).double()
            n_tokens += batch.n_tgt_tokens
        loss_sum, nll_sum = sums.tolist()
        bits = loss_sum / max(n_tokens, 1) / math.log(2)
        if diverged(bits):
            self.optimizer.zero_grad(set_to_none=self.graphs is None)
            raise self.divergence("training loss", bits, self.state.num_updates + 1)
        if self.world_size > 1:
            # DDP averages gradients over ranks; rescale so the update is (Σ loss) / (Σ tokens).
            total = torch.tensor([n_tokens], dtype=torch.float64, device=self.device)
            dist.all_reduce(total)
            scale = self.world_size / total.item()
        else:
            scale = 1.0 / max(n_tokens, 1)
        torch._foreach_mul_(self._grads(), scale)
        if self.cfg.train.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_norm)
        lr = self.schedule.apply(self.optimizer, self.state.num_updates)
        # Graphed drop-net: the branches no batch used have zero gradients; eager training gives them none, so
        # Adam skips them (no momentum step). None for this step, the graphs' buffers back after it.
        draws = self.graphs.draws if self.graphs is not None else None
        unused = draws.unused() if draws is not None else []
        keep_zeros = getattr(self.cfg.model, "drop_net_zero_grads", False)  # the original code's zero gradients
        skipped = [] if keep_zeros else [(p, p.grad) for p in unused]
        for p, _ in skipped:
            p.grad = None
        self.optimizer.step()
        for p, g in skipped:
            p.grad = g
        self.optimizer.zero_grad(set_to_none=self.graphs is None)  # graphs write into the same gradients
        self.state.num_updates += 1
        return {"loss_sum": loss_sum, "nll_sum": nll_sum, "n_tokens": n_tokens, "lr": lr}

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> dict[str, float]:
        """One pass over the training batches; returns the epoch's training figures."""
        tc = self.cfg.train
        loss_sum = nll_sum = 0.0
        n_tokens = 0
        t0 = time.perf_counter()
        pending: list[Batch] = []
        bar = _progress(epoch, self.rank)
        last_log = t0
        for batch in self.train_batches(epoch):
            pending.append(batch)
            if len(pending) < tc.update_freq:
                continue
            stats = self.train_step(pending)
            pending = []
            loss_sum += stats["loss_sum"]
            nll_sum += stats["nll_sum"]
            n_tokens += stats["n_tokens"]
            elapsed = time.perf_counter() - t0
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{stats['loss_sum'] / max(stats['n_tokens'], 1) / math.log(2):.3f}",
                                tok_s=f"{n_tokens / elapsed:.0f}", lr=f"{stats['lr']:.2e}", refresh=False)
            interval = self.state.num_updates % tc.log_interval == 0
            if interval or (bar is None and not self._said_training and elapsed >= FIRST_LINE_S):
                metrics = {"train_loss": loss_sum / n_tokens / math.log(2), "lr": stats["lr"],
                           "train_tokens_per_s": n_tokens / elapsed, "num_updates": self.state.num_updates}
                if bar is None and time.perf_counter() - last_log > 0:
                    log.info("epoch %d update %d loss %.3f lr %.2e %.0f tok/s", epoch, self.state.num_updates,
                             metrics["train_loss"], stats["lr"], metrics["train_tokens_per_s"])
                self._said_training = True
                if interval:  # an early first line is the console's only: the logged metrics keep the interval
                    last_log = time.perf_counter()
                    for cb in self.callbacks:
                        cb.on_log(self, metrics)
            if tc.max_updates and self.state.num_updates >= tc.max_updates:
                break
        if pending and not (tc.max_updates and self.state.num_updates >= tc.max_updates):
            stats = self.train_step(pending)  # the epoch's remainder is one smaller update
            loss_sum += stats["loss_sum"]
            nll_sum += stats["nll_sum"]
            n_tokens += stats["n_tokens"]
        if bar is not None:
            bar.close()
        if self.graphs is not None:
            st = self.graphs.stats
            log.info("epoch %d: CUDA graphs: %d buckets captured so far (%.1f s), %d batches replayed, %d eager%s",
                     epoch, st.captures, st.capture_s, st.replays, st.eager, f" ({st.failed})" if st.failed else "")
        wall = time.perf_counter() - t0
        self.train_tokens_per_s = n_tokens / wall if wall > 0 else 0.0
        # Losses in base 2, as fairseq reports them.
        return {"train_loss": loss_sum / max(n_tokens, 1) / math.log(2),
                "train_nll": nll_sum / max(n_tokens, 1) / math.log(2),
                "train_tokens": float(n_tokens), "train_wall_s": wall,
                "train_tokens_per_s": self.train_tokens_per_s, "num_updates": float(self.state.num_updates)}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Teacher-forced validation loss (base 2, label-smoothed and plain NLL) and greedy BLEU; for a model
        that returns ``ModelOutput.knowledge_mask``, ``valid_masked_fraction``: masked / real source tokens."""
        self.model.eval()
        split = self.data.splits[self.cfg.data.valid_split]
        loss_sum = nll_sum = 0.0
        n_tokens = 0
        masked = real = 0
        has_mask = False
        t0 = time.perf_counter()
        for batch in self.eval_batches(split):
            with autocast(self.amp_dtype, self.device):
                out = self.model(batch)
            lo = label_smoothed_nll(out.logits, batch.tgt_out, self.cfg.train.label_smoothing, self.data.vocab.pad_id)
            loss_sum += lo.loss.item()
            nll_sum += lo.nll.item()
            n_tokens += lo.n_tokens
            if out.knowledge_mask is not None:  # (B, S) True = masked; padding is never marked
                has_mask = True
                masked += int(out.knowledge_mask.sum().item())
                real += int((~batch.src_mask).sum().item())
        nll = nll_sum / max(n_tokens, 1) / math.log(2)
        valid_loss = loss_sum / max(n_tokens, 1) / math.log(2)
        for figure, value in (("validation loss", valid_loss), ("validation NLL", nll)):
            if diverged(value):
                raise self.divergence(figure, value, self.state.num_updates)
        metrics = {"valid_loss": valid_loss, "valid_nll": nll, "valid_ppl": 2**nll}
        if has_mask:
            metrics["valid_masked_fraction"] = masked / max(real, 1)
        if self.cfg.train.valid_bleu:
            greedy = DecodeConfig(**{**self.cfg.decode.__dict__, "beam": 1, "nbest": 1})
            hyps = self.translate(split, greedy)
            metrics["valid_bleu"] = bleu.corpus_bleu(hyps, split.raw_tgt).score
        metrics["valid_wall_s"] = time.perf_counter() - t0
        return metrics

    def translate(self, split: EncodedSplit, dcfg: DecodeConfig | None = None) -> list[str]:
        """Decode ``split`` with the current model; detokenized hypotheses in corpus order."""
        return translate_split(self.model, split, self.data.vocab, dcfg or self.cfg.decode, self.device)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_payload(self) -> dict[str, Any]:
        """Everything a resume needs: weights, optimizer, config, vocabulary, counters, RNG state."""
        s = self.state
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.cfg.to_dict(),
            "vocab": self.data.vocab.to_tensor_payload(),
            "train_state": {"epoch": s.epoch, "num_updates": s.num_updates, "best_valid_loss": s.best_valid_loss,
                            "best_epoch": s.best_epoch, "bad_epochs": s.bad_epochs, "best_score": s.best_score,
                            "history": s.history},
            "rng": {"torch": torch.get_rng_state()},
        }

    def save(self) -> Path | None:
        """Write ``epoch{N}.pt`` (rank 0 only), then prune to ``keep_last``."""
        if self.rank != 0:
            return None
        path = save_checkpoint(self.save_dir / f"epoch{self.state.epoch}.pt", self.checkpoint_payload())
        for old in epoch_checkpoints(self.save_dir)[: -self.cfg.train.keep_last]:
            if old.name != f"epoch{self.state.best_epoch}.pt":
                remove_checkpoint(old)
        return path

    def resume(self) -> bool:
        """Continue from the newest verifiable epoch checkpoint in ``save_dir``; False if none."""
        for path in reversed(epoch_checkpoints(self.save_dir)):
            ckpt = load_checkpoint(path)
            self.restore(ckpt, str(path))
            log.info("resumed from %s (epoch %d, %d updates)", path, self.state.epoch, self.state.num_updates)
            return True
        return False

    def start_shared(self, share: PhaseShare) -> bool:
        """Keep this run's phase ends in ``share`` and, unless it has trained already, start it where another run's
        first phases ended when those are this schedule's (:mod:`nmtcore.engine.shared_phases`). True: it did."""
        self.share = share
        if self.state.epoch == 0 and self.phases:
            self.shared_start = start_from_shared(self, share)
        return self.shared_start is not None

    def restore(self, ckpt: dict[str, Any], source: str) -> None:
        """Load a checkpoint's state (weights, optimizer, counters, RNG), entering its phase first."""
        if ckpt["vocab"]["checksum"] != self.data.vocab.checksum:
            raise CheckpointError(f"{source}: vocabulary {ckpt['vocab']['checksum'][:12]} differs from this "
                                  f"run's {self.data.vocab.checksum[:12]} (resume with the data settings that "
                                  "wrote it, or --no-resume / a new output dir)")
        ts = ckpt["train_state"]
        if self.phases:  # the optimizer state saved belongs to the phase of the saved epoch
            self.enter_phase(saved_phase(self.phases, ts["history"], ts["epoch"]))
        load_model_weights(self.model, ckpt["model"], source)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.adopt_state(ts)
        torch.set_rng_state(ckpt["rng"]["torch"])

    def adopt_state(self, ts: dict[str, Any]) -> None:
        """Take a checkpoint's counters, stopping state and epoch history (``train_state``)."""
        self.state = TrainState(epoch=ts["epoch"], num_updates=ts["num_updates"],
                                best_valid_loss=ts["best_valid_loss"], best_epoch=ts["best_epoch"],
                                bad_epochs=ts["bad_epochs"], history=list(ts["history"]),
                                # a checkpoint from before the stopping rule ranked epochs by validation loss
                                best_score=ts.get("best_score", ts["best_valid_loss"]
                                                  if self.stop_rule.metric == "valid_loss" else math.nan))

    def divergence(self, figure: str, value: float, update: int) -> NonFiniteLossError:
        """The one-line error for a diverged run: which update, which figure and value, what is kept, what to
        try (the settings that most often cause it, with their values in this run)."""
        tc = self.cfg.train
        how = "is not finite" if not math.isfinite(value) else f"{value:.4g} bits/token: its perplexity overflows"
        kept = (f"the checkpoints up to epoch {self.state.epoch} are kept" if self.state.epoch
                else "no checkpoint had been written")
        message = (f"training diverged at update {update} (epoch {self.state.epoch + 1}): the {figure} {how}; "
                   f"{kept}; try a lower train.lr (now {tc.lr:g}), a longer train.warmup_updates (now "
                   f"{tc.warmup_updates}) or train.clip_norm (now {tc.clip_norm:g})")
        return NonFiniteLossError(message, update=update, epoch=self.state.epoch + 1, figure=figure, value=value)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> "FitResult":
        """Train until max_epochs / max_updates / early stopping / the schedule's end."""
        tc = self.cfg.train
        for cb in self.callbacks:
            cb.on_train_start(self)
        t0 = time.perf_counter()
        stop_reason = "max_epochs"
        last_epoch = min(tc.max_epochs, schedule_length(self.phases))
        while self.state.epoch < last_epoch:
            if tc.max_updates and self.state.num_updates >= tc.max_updates:
                stop_reason = "max_updates"
                break
            epoch = self.state.epoch + 1
            if self.phases and self.phase_index < len(self.phases) - 1 and self.phase_ended():
                if self.share is not None:  # another run whose schedule begins as this one's may start here
                    keep_phase_end(self, self.share, self.phase_index)
                self.enter_phase(self.phase_index + 1)
                # Early stopping and "best" restart with each phase: the final model comes from the last.
                self.state.best_valid_loss, self.state.best_score, self.state.bad_epochs = math.inf, math.nan, 0
            metrics = self.train_epoch(epoch)
            metrics.update(self.validate())
            metrics["epoch"] = float(epoch)
            if self.phases:
                metrics["phase"] = float(self.phase_index + 1)
            self.state.epoch = epoch
            self.record_stop_metric(epoch, metrics)
            self.state.history.append(metrics)
            path = self.save()
            log.info("epoch %d: %s", epoch, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            for cb in self.callbacks:
                cb.on_epoch_end(self, epoch, metrics, path)
            if self.rule_on() and self.stop_rule.fired(self.state.bad_epochs) and not self.converging_on():
                stop_reason = f"early_stopping(patience={tc.patience})"
                break
        else:
            stop_reason = "end_of_schedule" if last_epoch == schedule_length(self.phases) else "max_epochs"
        if tc.max_updates and self.state.num_updates >= tc.max_updates:
            stop_reason = "max_updates"
        if self.phases:
            log.info("phases began at epochs %s; the last phase (%s) stopped: %s", self.phase_starts(),
                     self.phases[self.phase_index].name, stop_reason)
        return FitResult(epochs=self.state.epoch, num_updates=self.state.num_updates, stop_reason=stop_reason,
                         stopped_by=stopped_by(stop_reason, self.rule_on()), stop_metric=tc.stop_metric,
                         best_score=self.state.best_score,
                         phase=self.phases[self.phase_index].name if self.phases else None,
                         best_epoch=self.state.best_epoch, best_valid_loss=self.state.best_valid_loss,
                         fit_wall_s=time.perf_counter() - t0, schedule={p.name: p.epochs for p in self.phases},
                         phase_scale=tc.phase_scale, phase_starts=self.phase_starts())

    def rule_on(self) -> bool:
        """Whether the patience rule applies now: ``train.patience`` set and, with a schedule, the current phase
        allows early stopping or runs until convergence (``train.phases_converge``)."""
        return bool(self.cfg.train.patience) and (not self.phases or self.phases[self.phase_index].early_stop
                                                  or self.cfg.train.phases_converge)

    def converging_on(self) -> bool:
        """Whether the rule firing now ends the phase and not the run: phases until convergence, not the last."""
        return bool(self.phases) and self.cfg.train.phases_converge and self.phase_index < len(self.phases) - 1

    def epochs_in_phase(self) -> int:
        """Epochs the current phase has trained (the epoch history, which a resume restores)."""
        return sum(1 for h in self.state.history if h.get("phase") == self.phase_index + 1)

    def phase_ended(self) -> bool:
        """Whether the current phase has run its course: its epochs, or (``train.phases_converge``) until the
        patience rule fired in it."""
        done = self.epochs_in_phase()
        if self.cfg.train.phases_converge:
            return done > 0 and self.stop_rule.fired(self.state.bad_epochs)
        epochs = self.phases[self.phase_index].epochs
        return 0 < epochs <= done

    def record_stop_metric(self, epoch: int, metrics: dict[str, float]) -> None:
        """Update the best epoch and the count of epochs without a gain from this epoch's ``metrics`` (epochs that
        end inside the warm-up are not counted)."""
        s = self.state
        s.best_valid_loss = min(s.best_valid_loss, metrics["valid_loss"])
        # This phase's epochs so far, this one last (it is not in the history yet), with its update count.
        epochs = [e for e in s.history if e.get("phase") == metrics.get("phase")]
        epochs.append({**metrics, "num_updates": float(s.num_updates)})
        improved, s.bad_epochs = self.stop_rule.judge(epochs, s.best_score, s.bad_epochs, self.cfg.train.warmup_updates)
        if improved:
            s.best_score, s.best_epoch = metrics[self.stop_rule.metric], epoch

    def phase_starts(self) -> dict[str, int]:
        """The epoch each phase of the schedule began in this run (from the epoch history, which a resume
        restores): ``{"warmup": 1, "glu": 9, "finetune": 11}``; phases not reached are absent."""
        starts: dict[str, int] = {}
        for h in self.state.history:
            if "phase" in h:
                starts.setdefault(self.phases[int(h["phase"]) - 1].name, int(h["epoch"]))
        return starts

    def finalize_model(self) -> str:  # the description tested_file() reads back
        """Load the weights used for testing: the average of the last ``average_last`` epoch checkpoints
        if set, else the best epoch (lowest validation loss). Returns a description."""
        ckpts = epoch_checkpoints(self.save_dir)
        if self.phases:  # average within the last phase only (BERT-JAM: the last epochs of phase 3)
            first = self.phase_starts().get(self.phases[self.phase_index].name, 1)
            ckpts = [p for p in ckpts if int(p.stem.removeprefix("epoch")) >= first]
        if self.cfg.train.average_last > 1 and len(ckpts) >= 2:
            chosen = ckpts[-self.cfg.train.average_last:]
            self.model.load_state_dict(average_checkpoints(chosen))
            if self.rank == 0:
                payload = self.checkpoint_payload()
                payload.pop("optimizer")
                save_checkpoint(self.save_dir / AVERAGED, payload)
            log.info("checkpoint averaging (train.average_last=%d): the tested model is the average of %s",
                     self.cfg.train.average_last, ", ".join(p.name for p in chosen))
            return f"{AVERAGE_OF}{', '.join(p.name for p in chosen)}"
        if self.cfg.train.average_last > 1:
            log.warning("checkpoint averaging (train.average_last=%d) skipped: only %d epoch checkpoint(s)%s",
                        self.cfg.train.average_last, len(ckpts), " in the last phase" if self.phases else "")
        best = self.save_dir / f"epoch{self.state.best_epoch}.pt"
        if best.is_file() and self.state.best_epoch != self.state.epoch:
            load_model_weights(self.model, load_checkpoint(best)["model"], str(best))
            return best.name
        return f"epoch{self.state.epoch}.pt (last)"




AVERAGED = "averaged.pt"  # the averaged weights finalize_model tests, in save_dir
AVERAGE_OF = "average of "


def tested_file(final_model: str) -> str:
    """The file in ``save_dir`` holding the weights :meth:`Trainer.finalize_model` described as ``final_model``
    (``epoch9.pt``, ``epoch12.pt (last)`` or ``average of epoch11.pt, epoch12.pt``); "" for an empty one."""
    return AVERAGED if final_model.startswith(AVERAGE_OF) else (final_model.split(" ") or [""])[0]


def _progress(epoch: int, rank: int):
    if rank != 0 or not sys.stderr.isatty() or env_flag("NMTCORE_NO_PROGRESS"):
        return None
    from tqdm import tqdm

    return tqdm(desc=f"epoch {epoch}", unit="upd", leave=False, dynamic_ncols=True)
