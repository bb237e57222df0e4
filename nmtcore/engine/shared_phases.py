"""Phases that runs share, trained once.

BERT-JAM's M0, M1 and M2 (Table 7) begin with the same phase: the warm-up trains the NMT layers with BERT frozen and
the GLU untouched at Eq. 11's initialisation, where each variant's BERT memory is B_L (M0's gated GLU: 2 · σ(0) · B_L;
M1's weighted sum: B_L; M2: B_L itself), and the GLU's weights draw nothing from the RNG, so the three start from the
same weights too. Trained three times, that phase gives one result at three times its cost.

So a run given a :class:`PhaseShare` keeps the end of each of its phases but the last in the share's store, under
a *prefix key* (:func:`prefix_key`), and a run that starts from scratch first looks there for the longest prefix of
its own schedule with its key (:func:`start_from_shared`). Found, it starts where that run's phases ended: the
weights of the parameter groups those phases trained (every other group is still at its initialisation in both runs,
frozen) and the buffers both models have (a drop-net's generator state), the update counter, the epoch history and
the RNG state; its next phase then begins as it would have, with a new optimizer (the trainer resets it at every
phase change). The key is the share's ``context`` (a digest of
everything outside the model's config and the schedule that decides results: data, code, libraries, precision and
the rest of the config, made by the caller) and the model's
:meth:`~nmtcore.models.NMTModel.prefix_signature` of those phases, whose lengths count unless the phases run until
convergence (``train.phases_converge``: each ends where the patience rule fires, the same epoch for the same
computation).

Equal keys promise the same computation, not the same bits: as for a copied trial (:mod:`nmtcore.sweep.reuse`), a
float sum split over other threads or on another machine can differ in its last bits, as two runs of one config do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nmtcore.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from nmtcore.files import atomic_write_text

log = logging.getLogger("nmtcore.engine")
# The functions below take the trainer (nmtcore.engine.trainer.Trainer, which calls them: typed Any, no import cycle).

FORMAT = 1  # bump when the key's meaning changes
# Config keys a prefix key leaves to the model's signature (model.*) or that decide nothing before the prefix ends:
# the schedule (the signature holds the prefix's phases), its scale (already in their epochs), the budget's caps
# (a source whose prefix ended under them is used only by a run whose caps it also ends under) and the averaging of
# the last phase.
NOT_IN_PREFIX = ("model.", "train.phases", "train.phase_scale", "train.max_epochs", "train.max_updates",
                 "train.average_last")


@dataclass(frozen=True)
class PhaseShare:
    """Where a run keeps the ends of its phases and looks for another run's. ``context``: the digest of what
    besides the model and its schedule decides the results (the caller's: :func:`nmtcore.sweep.reuse.phase_context`);
    ``owner``: who is training, recorded beside what it keeps (a run's name and id)."""

    store: Path
    context: str
    owner: str = ""
    ignore: tuple[str, ...] = ()  # flat config keys that decide no result (paths, speed-only switches): not in a key


@dataclass(frozen=True)
class SharedStart:
    """Where a run started: the first ``phases`` of its schedule, trained by ``owner`` up to ``epoch``."""

    path: Path
    key: str
    phases: tuple[str, ...]
    epoch: int
    owner: str

    def describe(self) -> str:
        """``phase 'warmup' (epochs 1-23) from <owner>``"""
        names = ", ".join(repr(p) for p in self.phases)
        return (f"phase{'s' if len(self.phases) > 1 else ''} {names} (epochs 1-{self.epoch}) from "
                f"{self.owner or 'another run'}")


def prefix_key(trainer: Any, share: PhaseShare, k: int) -> str:
    """The key of ``trainer``'s schedule's first ``k + 1`` phases."""
    return schedule_key(trainer.model, trainer.phases, trainer.cfg.train.phases_converge, share, k)


def prefix_keys(model: Any, phases: tuple[Any, ...], converge: bool, share: PhaseShare) -> tuple[str, ...]:
    """The key of every prefix a run of ``model`` on ``phases`` keeps (all but the whole schedule), shortest first:
    what a sweep's cost estimate matches trials on before any of them trains."""
    return tuple(schedule_key(model, phases, converge, share, k) for k in range(len(phases) - 1))


def schedule_key(model: Any, phases: tuple[Any, ...], converge: bool, share: PhaseShare, k: int) -> str:
    """The key of the first ``k + 1`` of ``phases`` trained by ``model`` (``converge``: the phases run until
    convergence, ``train.phases_converge``)."""
    signature = model.prefix_signature(phases[:k + 1])
    signature = {**signature, "model": _without(signature["model"], "model.", share.ignore)}
    if converge:  # each phase ends where the rule fires: its nominal length decides nothing
        signature = {**signature, "phases": [{**p, "epochs": "until convergence"} for p in signature["phases"]]}
    blob = json.dumps({"format": FORMAT, "context": share.context, "signature": signature}, sort_keys=True,
                      default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _without(tree: dict[str, Any], prefix: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """``tree`` (a config section as nested dicts, at flat prefix ``prefix``) without the flat ``keys``."""
    out = {}
    for name, value in tree.items():
        flat = prefix + name
        if flat in keys:
            continue
        out[name] = _without(value, flat + ".", keys) if isinstance(value, dict) else value
    return out


def context_config(flat: dict[str, Any]) -> dict[str, Any]:
    """The part of a flat config (:meth:`~nmtcore.config.ExperimentConfig.flat`) a prefix key's context holds."""
    return {k: v for k, v in flat.items() if not any(k == n or (n.endswith(".") and k.startswith(n))
                                                     for n in NOT_IN_PREFIX)}


def keep_phase_end(trainer: Any, share: PhaseShare, k: int) -> Path | None:
    """Keep the run's newest checkpoint, the end of its phase ``k``, in the store under the key of phases 0..k (its
    optimizer left out: the next phase starts a new one). Nothing when the store already holds that key or the
    checkpoint is no longer there (a run resumed past its phase's end). Rank 0 only."""
    if trainer.rank != 0:
        return None
    key = prefix_key(trainer, share, k)
    path = share.store / f"{key}.pt"
    newest = trainer.save_dir / f"epoch{trainer.state.epoch}.pt"
    if path.is_file() or not newest.is_file():
        return None
    payload = load_checkpoint(newest)
    payload.pop("optimizer", None)
    share.store.mkdir(parents=True, exist_ok=True)
    save_checkpoint(path, payload)
    names = [p.name for p in trainer.phases[:k + 1]]
    atomic_write_text(path.with_suffix(".json"), json.dumps(
        {"key": key, "phases": names, "epoch": trainer.state.epoch, "num_updates": trainer.state.num_updates,
         "owner": share.owner, "model": trainer.cfg.model.name,
         "kept": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=1) + "\n")
    log.info("kept the end of phase(s) %s (epoch %d) for runs that share them: %s", names, trainer.state.epoch, path)
    return path


def start_from_shared(trainer: Any, share: PhaseShare) -> SharedStart | None:
    """Start ``trainer`` (from scratch so far) where another run's phases ended: the longest prefix of its schedule
    whose key the store holds, short of its last phase and of its budget's caps. None: nothing to share."""
    tc = trainer.cfg.train
    for k in reversed(range(len(trainer.phases) - 1)):
        key = prefix_key(trainer, share, k)
        path = share.store / f"{key}.pt"
        if not path.is_file():
            continue
        try:
            ckpt = load_checkpoint(path)
        except CheckpointError as e:
            log.warning("not starting from a shared phase end: %s", e)
            continue
        ts = ckpt["train_state"]
        if ts["epoch"] >= tc.max_epochs or (tc.max_updates and ts["num_updates"] >= tc.max_updates):
            continue  # this run's budget would have stopped inside those phases
        if ckpt["vocab"]["checksum"] != trainer.data.vocab.checksum:
            continue
        state, own = ckpt["model"], trainer.model.state_dict()
        trained = _trained_names(trainer, k)
        bad = [n for n in trained if n not in state or state[n].shape != own[n].shape]
        if bad:
            log.warning("not starting from %s: its weights lack or reshape %s", path, bad[:3])
            continue
        # The trained weights and the buffers both models have (a drop-net's generator state): what the phases left;
        # the phase's own buffers (the GLU scale) are set again as the phase is entered.
        buffers = [n for n, b in trainer.model.named_buffers() if n in state and state[n].shape == b.shape]
        trainer.model.load_state_dict({n: state[n] for n in (*trained, *buffers)}, strict=False)
        trainer.enter_phase(k)
        trainer.adopt_state(ts)
        torch.set_rng_state(ckpt["rng"]["torch"])
        if not trainer.phase_ended():
            raise CheckpointError(f"{path}: kept as the end of phase {trainer.phases[k].name!r}, but that phase has "
                                  "not ended by this run's rule")
        meta = _sidecar(path)
        start = SharedStart(path=path, key=key, phases=tuple(p.name for p in trainer.phases[:k + 1]),
                            epoch=int(ts["epoch"]), owner=str(meta.get("owner", "")))
        log.info("starting from %s: %s", start.describe(), path)
        return start
    return None


def _trained_names(trainer: Any, k: int) -> list[str]:
    """The state-dict names of the parameters phases 0..k train."""
    groups = trainer.model.parameter_groups()
    ids = {id(p) for phase in trainer.phases[:k + 1] for g in phase.trainable for p in groups.get(g, [])}
    return [n for n, p in trainer.model.named_parameters() if id(p) in ids]


def _sidecar(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


__all__ = ["NOT_IN_PREFIX", "PhaseShare", "SharedStart", "context_config", "keep_phase_end", "prefix_key",
           "prefix_keys", "schedule_key", "start_from_shared"]
