"""The model-agnostic training loop.

The trainer sees a model only through ``forward(batch) -> ModelOutput`` (and ``encode``/``decode_step``
via beam search for validation BLEU); the loss lives in :mod:`nmtcore.losses`. It reports every
epoch through :class:`Callback` objects, which is how MLflow tracking and, later, a Ray worker drive
the very same loop unchanged.

fairseq semantics throughout: the summed loss of an update is divided by its number of target tokens,
Adam + inverse-sqrt schedule with the rate set per update, token-budget batches reshuffled per epoch
from ``(seed, epoch)``. Checkpoints hold everything needed to continue bit-identically: model,
optimizer, update counter, early-stopping state and the torch RNG state (dropout).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from nmtcore import beam_search, bleu
from nmtcore.checkpoint import (average_checkpoints, epoch_checkpoints, load_checkpoint, load_model_weights,
                                remove_checkpoint, save_checkpoint)
from nmtcore.config import DecodeConfig, ExperimentConfig
from nmtcore.devices import autocast, autocast_dtype, default_device
from nmtcore.data import Batch, EncodedSplit, PreparedData, batch_indices, collate, inference_batches, prepare_data
from nmtcore.losses import label_smoothed_nll
from nmtcore.models import NMTModel, build_model
from nmtcore.optim import InverseSqrtSchedule, build_optimizer

log = logging.getLogger("nmtcore.train")


class NonFiniteLossError(FloatingPointError):
    """The training loss became NaN or infinite; training stops rather than corrupting weights."""


class Callback:
    """Hooks the trainer calls; override what you need. ``metrics`` are plain floats."""

    def on_train_start(self, trainer: "Trainer") -> None: ...

    def on_log(self, trainer: "Trainer", metrics: dict[str, float]) -> None: ...

    def on_epoch_end(self, trainer: "Trainer", epoch: int, metrics: dict[str, float],
                     checkpoint: Path | None) -> None: ...

    def on_train_end(self, trainer: "Trainer", summary: dict[str, Any]) -> None: ...


# ---------------------------------------------------------------------- the trainer
@dataclass
class TrainState:
    """Counters that a checkpoint carries across a resume."""

    epoch: int = 0  # last completed epoch
    num_updates: int = 0
    best_valid_loss: float = math.inf
    best_epoch: int = 0
    bad_epochs: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    def __init__(self, cfg: ExperimentConfig, model: NMTModel, data: PreparedData,
                 callbacks: list[Callback] | tuple[Callback, ...] = (), device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.data = data
        self.device = device or default_device()
        self.model = model.to(self.device)
        self.callbacks = list(callbacks)
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.ddp_model: torch.nn.Module = self.model
        if self.world_size > 1:
            self.ddp_model = torch.nn.parallel.DistributedDataParallel(
                self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self.amp_dtype = autocast_dtype(cfg.train.precision, self.device)
        self.optimizer = build_optimizer(self.model.parameters(), cfg.train)
        self.schedule = InverseSqrtSchedule(cfg.train)
        self.state = TrainState()
        self.save_dir = Path(cfg.train.save_dir or Path(cfg.output_dir) / "checkpoints").resolve()
        self.train_tokens_per_s = 0.0

    # ------------------------------------------------------------------ batches
    def train_batches(self, epoch: int) -> Iterator[Batch]:
        split = self.data.splits[self.cfg.data.train_split]
        dc = self.cfg.data
        for idx in batch_indices(split.src_lens, split.tgt_lens, dc.max_tokens, dc.max_sentences, shuffle=True,
                                 seed=self.cfg.train.seed, epoch=epoch, rank=self.rank, world_size=self.world_size):
            yield self.collate(split, idx)

    def eval_batches(self, split: EncodedSplit) -> Iterator[Batch]:
        dc = self.cfg.data
        for idx in batch_indices(split.src_lens, split.tgt_lens, dc.max_tokens, dc.max_sentences, shuffle=False):
            yield self.collate(split, idx)

    def collate(self, split: EncodedSplit, idx: np.ndarray) -> Batch:
        v = self.data.vocab
        return collate(split, idx, v.pad_id, v.bos_id, v.eos_id).to(self.device)

    # ------------------------------------------------------------------ one update
    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def train_step(self, batches: list[Batch]) -> dict[str, float]:
        """One optimizer update over ``batches`` (gradient accumulation); returns summed statistics."""
        self.ddp_model.train()
        loss_sum = nll_sum = 0.0
        n_tokens = 0
        for i, batch in enumerate(batches):
            sync = self.world_size == 1 or i == len(batches) - 1
            ctx = contextlib.nullcontext() if sync else self.ddp_model.no_sync()
            with ctx:
                with autocast(self.amp_dtype, self.device):
                    out = self.ddp_model(batch)
                lo = label_smoothed_nll(out.logits, batch.tgt_out, self.cfg.train.label_smoothing,
                                        self.data.vocab.pad_id)
                lo.loss.backward()
            loss_sum += lo.loss.item()
            nll_sum += lo.nll.item()
            n_tokens += lo.n_tokens
        if not math.isfinite(loss_sum):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(f"non-finite training loss ({loss_sum}) at update {self.state.num_updates + 1}")
        total = torch.tensor([n_tokens], dtype=torch.float64, device=self.device)
        if self.world_size > 1:
            # DDP averages gradients over ranks; rescale so the update is (Σ loss) / (Σ tokens).
            dist.all_reduce(total)
            scale = self.world_size / total.item()
        else:
            scale = 1.0 / max(total.item(), 1.0)
        torch._foreach_mul_(self._grads(), scale)
        if self.cfg.train.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.train.clip_norm)
        lr = self.schedule.apply(self.optimizer, self.state.num_updates)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.state.num_updates += 1
        return {"loss_sum": loss_sum, "nll_sum": nll_sum, "n_tokens": n_tokens, "lr": lr}

    # ------------------------------------------------------------------ epochs
    def train_epoch(self, epoch: int) -> dict[str, float]:
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
            if self.state.num_updates % tc.log_interval == 0:
                metrics = {"train_loss": loss_sum / n_tokens / math.log(2), "lr": stats["lr"],
                           "train_tokens_per_s": n_tokens / elapsed, "num_updates": self.state.num_updates}
                if bar is None and time.perf_counter() - last_log > 0:
                    log.info("epoch %d update %d loss %.3f lr %.2e %.0f tok/s", epoch, self.state.num_updates,
                             metrics["train_loss"], stats["lr"], metrics["train_tokens_per_s"])
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
        wall = time.perf_counter() - t0
        self.train_tokens_per_s = n_tokens / wall if wall > 0 else 0.0
        # Losses in base 2, as fairseq reports them.
        return {"train_loss": loss_sum / max(n_tokens, 1) / math.log(2),
                "train_nll": nll_sum / max(n_tokens, 1) / math.log(2),
                "train_tokens": float(n_tokens), "train_wall_s": wall,
                "train_tokens_per_s": self.train_tokens_per_s, "num_updates": float(self.state.num_updates)}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Teacher-forced validation loss (base 2, label-smoothed and plain NLL) and greedy BLEU."""
        self.model.eval()
        split = self.data.splits[self.cfg.data.valid_split]
        loss_sum = nll_sum = 0.0
        n_tokens = 0
        t0 = time.perf_counter()
        for batch in self.eval_batches(split):
            with autocast(self.amp_dtype, self.device):
                out = self.model(batch)
            lo = label_smoothed_nll(out.logits, batch.tgt_out, self.cfg.train.label_smoothing, self.data.vocab.pad_id)
            loss_sum += lo.loss.item()
            nll_sum += lo.nll.item()
            n_tokens += lo.n_tokens
        nll = nll_sum / max(n_tokens, 1) / math.log(2)
        metrics = {"valid_loss": loss_sum / max(n_tokens, 1) / math.log(2), "valid_nll": nll, "valid_ppl": 2**nll}
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
        s = self.state
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "config": self.cfg.to_dict(),
            "vocab": self.data.vocab.to_tensor_payload(),
            "train_state": {"epoch": s.epoch, "num_updates": s.num_updates, "best_valid_loss": s.best_valid_loss,
                            "best_epoch": s.best_epoch, "bad_epochs": s.bad_epochs, "history": s.history},
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

    def restore(self, ckpt: dict[str, Any], source: str) -> None:
        if ckpt["vocab"]["checksum"] != self.data.vocab.checksum:
            raise RuntimeError(f"{source}: vocabulary {ckpt['vocab']['checksum'][:12]} differs from this run's "
                               f"{self.data.vocab.checksum[:12]}")
        load_model_weights(self.model, ckpt["model"], source)
        self.optimizer.load_state_dict(ckpt["optimizer"])
        ts = ckpt["train_state"]
        self.state = TrainState(epoch=ts["epoch"], num_updates=ts["num_updates"],
                                best_valid_loss=ts["best_valid_loss"], best_epoch=ts["best_epoch"],
                                bad_epochs=ts["bad_epochs"], history=list(ts["history"]))
        torch.set_rng_state(ckpt["rng"]["torch"])

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train until max_epochs / max_updates / early stopping; returns a summary."""
        tc = self.cfg.train
        for cb in self.callbacks:
            cb.on_train_start(self)
        t0 = time.perf_counter()
        stop_reason = "max_epochs"
        while self.state.epoch < tc.max_epochs:
            if tc.max_updates and self.state.num_updates >= tc.max_updates:
                stop_reason = "max_updates"
                break
            epoch = self.state.epoch + 1
            metrics = self.train_epoch(epoch)
            metrics.update(self.validate())
            metrics["epoch"] = float(epoch)
            self.state.epoch = epoch
            if metrics["valid_loss"] < self.state.best_valid_loss:
                self.state.best_valid_loss, self.state.best_epoch, self.state.bad_epochs = metrics["valid_loss"], epoch, 0
            else:
                self.state.bad_epochs += 1
            self.state.history.append(metrics)
            path = self.save()
            log.info("epoch %d: %s", epoch, " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
            for cb in self.callbacks:
                cb.on_epoch_end(self, epoch, metrics, path)
            if tc.patience and self.state.bad_epochs >= tc.patience:
                stop_reason = f"early_stopping(patience={tc.patience})"
                break
        else:
            stop_reason = "max_epochs"
        if tc.max_updates and self.state.num_updates >= tc.max_updates:
            stop_reason = "max_updates"
        summary = {"epochs": self.state.epoch, "num_updates": self.state.num_updates, "stop_reason": stop_reason,
                   "best_epoch": self.state.best_epoch, "best_valid_loss": self.state.best_valid_loss,
                   "fit_wall_s": time.perf_counter() - t0}
        return summary

    def finalize_model(self) -> str:
        """Load the weights used for testing: the average of the last ``average_last`` epoch checkpoints
        if set, else the best epoch (lowest validation loss). Returns a description."""
        ckpts = epoch_checkpoints(self.save_dir)
        if self.cfg.train.average_last > 1 and len(ckpts) >= 2:
            chosen = ckpts[-self.cfg.train.average_last:]
            self.model.load_state_dict(average_checkpoints(chosen))
            if self.rank == 0:
                payload = self.checkpoint_payload()
                payload.pop("optimizer")
                save_checkpoint(self.save_dir / "averaged.pt", payload)
            return f"average of {', '.join(p.name for p in chosen)}"
        best = self.save_dir / f"epoch{self.state.best_epoch}.pt"
        if best.is_file() and self.state.best_epoch != self.state.epoch:
            load_model_weights(self.model, load_checkpoint(best)["model"], str(best))
            return best.name
        return f"epoch{self.state.epoch}.pt (last)"


def _progress(epoch: int, rank: int):
    if rank != 0 or not sys.stderr.isatty() or os.environ.get("NMTCORE_NO_PROGRESS"):
        return None
    from tqdm import tqdm

    return tqdm(desc=f"epoch {epoch}", unit="upd", leave=False, dynamic_ncols=True)


# ---------------------------------------------------------------------- decoding a split
def translate_split(model: NMTModel, split: EncodedSplit, vocab: Any, dcfg: DecodeConfig,
                    device: torch.device) -> list[str]:
    """Beam (or greedy, beam 1) decode every sentence of ``split``; detokenized, in corpus order."""
    model.eval()
    batches = (b.to(device) for b in inference_batches(split, vocab, dcfg.max_sentences))
    results = beam_search.translate(model, batches, dcfg)
    return [vocab.decode(results[i][0].tokens) for i in range(len(split.src))]


# ---------------------------------------------------------------------- one experiment end to end
def setup_torch(cfg: ExperimentConfig) -> None:
    if cfg.train.num_threads:
        torch.set_num_threads(cfg.train.num_threads)
    torch.manual_seed(cfg.train.seed)


def run_experiment(cfg: ExperimentConfig, callbacks: list[Callback] | tuple[Callback, ...] = (),
                   resume: bool = True, device: torch.device | None = None,
                   data: PreparedData | None = None) -> dict[str, Any]:
    """Prepare data, build the registered model, train (resuming if checkpoints exist), then decode
    every test split with ``cfg.decode`` and score it. Returns a summary with test BLEU/chrF."""
    setup_torch(cfg)
    data = data or prepare_data(cfg.data)
    model = build_model(cfg.model, len(data.vocab), data.vocab.pad_id, data.vocab.bos_id, data.vocab.eos_id)
    trainer = Trainer(cfg, model, data, callbacks, device)
    resumed = trainer.resume() if resume else False
    summary = trainer.fit()
    summary["resumed"] = resumed
    summary["final_model"] = trainer.finalize_model()
    summary["parameters"] = sum(p.numel() for p in model.parameters())
    summary["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    summary["train_tokens_per_s"] = trainer.train_tokens_per_s
    hyp_dir = Path(cfg.output_dir).resolve() / "hyps"
    hyp_dir.mkdir(parents=True, exist_ok=True)
    summary["test"] = {}
    for name in cfg.data.test_splits:
        split = data.splits[name]
        t0 = time.perf_counter()
        hyps = trainer.translate(split)
        wall = time.perf_counter() - t0
        path = hyp_dir / f"{name}.{cfg.data.tgt_lang}"
        path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        b = bleu.corpus_bleu(hyps, split.raw_tgt)
        summary["test"][name] = {"bleu": b.score, "chrf": bleu.corpus_chrf(hyps, split.raw_tgt).score,
                                 "signature": b.signature, "hyp_path": str(path), "decode_wall_s": wall,
                                 "sentences_per_s": len(hyps) / wall if wall > 0 else 0.0}
    for cb in callbacks:
        cb.on_train_end(trainer, summary)
    return summary
