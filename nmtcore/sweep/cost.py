"""What a sweep will cost on this machine, said before it starts (``--dry-run``).

The estimate multiplies measured speeds by counted work:

- **speeds**, measured here and now by a probe (:func:`probe`): a few training updates of every distinct trial
  model (and of the baseline) on real batches, at the threads a trial gets; a greedy decode of validation
  sentences (every epoch's validation BLEU); the frozen BERT's feature extraction (sentences per second,
  :func:`feature_rate`, for the features the cache lacks);
- **work**, counted from the plan: target tokens per epoch, validation and test sentences, the sentences whose
  BERT features are not cached yet, the epochs each run trains.

Epochs: a fixed budget trains its epochs. A budget that trains to convergence (``train.patience``) stops
somewhere between ``patience + 1`` epochs and its cap, so the estimate takes the median number of epochs of the
converged runs of the same kind already in this MLflow store (same model, role, start, stopping rule and cap)
and says how many it found. With none (a fresh machine) it takes what the platform's own converged runs of that
kind took (:data:`MEASURED_EPOCHS`, or :data:`MEASURED_EPOCHS_AT` at another dropout: the corpus, the start (from
scratch, or warm from the shared baseline) and the model, under the studies' default rule), and with no such
figure the cap, saying that it is an upper bound.

Trials run in grid order, each starting as soon as one of the ``slots`` (trials at once) frees, as Tune runs
them; the trials' phase is that schedule's makespan. A trial from scratch whose first phases another trial of the
plan has trained by the time it starts, or the sweep's phase store already holds, is charged only for the rest of
its schedule (:func:`schedule`, :mod:`nmtcore.engine.shared_phases`). A model variant with no converged run of its
own in the store takes its family's runs (BERT-JAM's M0 for its M1), and says it is a guess. Speeds are measured
with nothing else running: trials that share a machine's memory bandwidth run somewhat slower, which the estimate
does not model.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch

from nmtcore.config import DecodeConfig, ExperimentConfig
from nmtcore.data import PreparedData, batch_indices

if TYPE_CHECKING:
    from nmtcore import tracking

# Updates timed. The probe runs them twice and times the second pass: an update on a batch shape the process has
# not run yet pays for its first kernels and allocations, which a real epoch pays once per shape, not per update.
PROBE_STEPS = 4
PROBE_DECODE = 48  # validation sentences decoded greedily (after PROBE_DECODE_WARMUP untimed)
PROBE_DECODE_WARMUP = 8
# Below this share of its cores (process CPU time over wall time x threads), a probe shared the machine with other
# work: its speeds read low and the estimate's times high, and the estimate says so.
BUSY_SHARE = 0.8
PROBE_OTHER_SENTENCES = 48  # every split but train is cut to this for the probe's BERT features
FEATURE_PROBE_SENTENCES = 1024  # training sentences whose BERT features time a feature build
# Epochs at which the patience rule stopped the platform's committed converged runs (median per kind; the runs
# and their dates: docs/convergence.md, "Epochs to convergence"): (corpus, start, model) -> (epochs, whether the runs
# had train.loss_guard). Used only when the store has no converged run of the kind, and only under the rule they
# were measured with; the guard can only lengthen a run, so a figure from the other side of it is a bound.
MEASURED_EPOCHS = {
    # from scratch: the shared baselines, and a study's trials that start from no baseline
    ("multi30k", "scratch", "transformer"): (19, True),
    ("multi30k", "scratch", "plm_sponsored"): (22, True),
    ("multi30k", "scratch", "bert_jam"): (29, True),  # the three phases together
    ("maruf2019_devtest", "scratch", "transformer"): (16, False),
    # second stages, warm-started from the shared baseline
    ("multi30k", "warm", "transformer"): (12, True),
    ("multi30k", "warm", "bert_fused"): (15, True),
    ("multi30k", "warm", "mask_fusion"): (12, True),
    ("maruf2019_devtest", "warm", "transformer"): (8, True),
    ("maruf2019_devtest", "warm", "doc_context"): (7, True),
}
# What else decides how long a run takes to converge: a stored run that differs in one of these is of another kind
# (so BERT-JAM at dropout 0.3 does not take its epochs from runs at 0.1 as its own), used only when none matches.
TRAINING_SETTINGS = ("model.dropout", "train.lr", "train.warmup_updates", "train.label_smoothing")
# The TRAINING_SETTINGS of every MEASURED_EPOCHS run (multi30k_small's); a run set otherwise takes them as a guess.
MEASURED_SETTINGS = {"model.dropout": 0.1, "train.lr": 1e-3, "train.warmup_updates": 400, "train.label_smoothing": 0.1}
MEASURED_RULE = ("valid_bleu", 3, 0.1)  # the rule of MEASURED_EPOCHS' runs: metric, patience, gain
# The same figures measured at other TRAINING_SETTINGS (those that differ from MEASURED_SETTINGS, sorted) -> {kind:
# (epochs, guarded)}: a run at exactly those settings takes them instead of MEASURED_EPOCHS' guess.
MEASURED_EPOCHS_AT = {
    (("model.dropout", 0.3),): {  # the papers' dropout (BERT-JAM's study, docs/reproduction.md row 4)
        ("multi30k", "scratch", "transformer"): (34, True),
        ("multi30k", "scratch", "bert_jam"): (39, True),  # the three phases together
        ("multi30k", "warm", "transformer"): (16.5, True),  # the controls of rows 5 (seeds 1-2) and 1 (seeds 1, 3)
        ("multi30k", "warm", "bert_fused"): (20, True),  # their arms (row 5's four cells, seeds 1-2; row 1, seeds 1-3)
    },
}


@dataclass(frozen=True)
class Speed:
    """What one model does per second on this machine at ``threads`` threads."""

    train_tokens_per_s: float  # target tokens (with EOS) through forward, backward and the optimizer step
    decode_sentences_per_s: float  # greedy decoding, as every epoch's validation BLEU
    threads: int
    # With a phase schedule: each phase's training speed (a phase that trains what an earlier one trains has that
    # one's figure; the first's is train_tokens_per_s) and each phase's epochs as the schedule fixes them (0: until
    # convergence or open-ended). Empty without one.
    phase_tokens_per_s: tuple[float, ...] = ()
    phase_epochs: tuple[int, ...] = ()
    # The share of its ``threads`` cores the timed training updates had (process CPU time / (wall x threads)).
    cpu_share: float = 1.0


@dataclass(frozen=True)
class PrefixCost:
    """The phases a trial can start from instead of training them (:mod:`nmtcore.engine.shared_phases`): per
    prefix of its schedule (phases 0..k, every k short of the last), its key, its estimated epochs and seconds
    (0 where the trial's phase lengths are not known here: a trial that shares it is then charged what the run
    that trains it takes) and the epochs of the phase end the store already holds under that key (0: none)."""

    keys: tuple[str, ...]
    epochs: tuple[float, ...]
    seconds: tuple[float, ...]
    stored: tuple[int, ...]


@dataclass(frozen=True)
class RunCost:
    """One training run (a trial or the baseline): how many epochs, and what one epoch and the end cost."""

    label: str
    epochs: float
    epoch_s: float  # one epoch's training plus its validation
    end_s: float  # decoding the test splits
    epochs_from: str  # "the budget" / "the cap (an upper bound: ...)" / "the median of N converged runs ..."
    prefixes: PrefixCost | None = None  # its phases another run may train for it (None: it shares none)
    saved_epochs: float = 0.0  # epochs of phases it starts from instead of training (set by the schedule)
    saved_s: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.epochs * self.epoch_s + self.end_s - self.saved_s, self.end_s)

    @property
    def trained_epochs(self) -> float:
        return max(self.epochs - self.saved_epochs, 0.0)


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    detail: str


@dataclass(frozen=True)
class Estimate:
    """Every phase of a sweep, in the order they run."""

    phases: tuple[Phase, ...]
    machine: str
    runs: tuple[tuple[str, float], ...] = ()  # (the trial's config key, its estimated seconds), in grid order
    epochs_s: tuple[tuple[str, float], ...] = ()  # (the trial's config key, one epoch's estimated seconds)
    cpu_share: float = 1.0  # the lowest share of its cores a probe had (:attr:`Speed.cpu_share`)
    load: float | None = None  # the machine's 1-minute load average before the probes

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases)

    def to_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "seconds": self.seconds, "cpu_share": self.cpu_share, "load": self.load,
                "phases": [dataclasses.asdict(p) for p in self.phases],
                "runs": [{"config_key": k, "seconds": v} for k, v in self.runs]}

    def lines(self) -> list[str]:
        load = f", load {self.load:.2f}" if self.load is not None else ""
        busy = (f"; other work shared the machine while it was measured (a probe had {self.cpu_share:.0%} of its "
                f"cores), so these times read high" if self.cpu_share < BUSY_SHARE else "")
        out = [f"estimated cost on this machine ({self.machine}{load}{busy}):"]
        out += [f"  {p.name + ':':<14} {duration(p.seconds):>9}  {p.detail}" for p in self.phases]
        out.append(f"  {'total:':<14} {duration(self.seconds):>9}")
        return out


def duration(seconds: float) -> str:
    """``42 s``, ``12.5 min``, ``3.2 h``."""
    if not math.isfinite(seconds):
        return "?"
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


# ---------------------------------------------------------------------------------------------- arithmetic
def epoch_tokens(data: PreparedData) -> int:
    """Target tokens one epoch trains on: every training target with its EOS (what a batch's
    ``n_tgt_tokens`` counts)."""
    return int((data.train.tgt_lens + 1).sum())


def run_cost(label: str, epochs: float, epochs_from: str, speed: Speed, tokens: int, valid_sentences: int,
             test_sentences: int, valid_bleu: bool = True, phase_weights: Sequence[float] = ()) -> RunCost:
    """A run's cost at ``speed``: per epoch ``tokens`` trained and (with validation BLEU) ``valid_sentences``
    decoded; at the end ``test_sentences`` decoded. (The teacher-forced validation loss is a few percent of an
    epoch and is not counted.) ``phase_weights``: the share of the epochs each phase of the schedule takes, whose
    epochs train at that phase's speed (``speed.phase_tokens_per_s``); without them every epoch is the first
    phase's."""
    train_s = tokens / speed.train_tokens_per_s
    if _weighs_every_phase(phase_weights, speed):
        train_s = sum(w * tokens / tps for w, tps in zip(phase_weights, speed.phase_tokens_per_s)) / sum(phase_weights)
    epoch_s = train_s + valid_s(speed, valid_sentences, valid_bleu)
    return RunCost(label, epochs, epoch_s, test_sentences / speed.decode_sentences_per_s, epochs_from)


def _weighs_every_phase(phase_weights: Sequence[float], speed: Speed) -> bool:
    """Whether ``phase_weights`` gives every phase of ``speed``'s schedule a share, some of them above 0."""
    return bool(phase_weights) and len(phase_weights) == len(speed.phase_tokens_per_s) and sum(phase_weights) > 0


def valid_s(speed: Speed, valid_sentences: int, valid_bleu: bool = True) -> float:
    """One epoch's validation at ``speed``: its greedy decode (the validation BLEU), none without it."""
    return valid_sentences / speed.decode_sentences_per_s if valid_bleu else 0.0


def prefix_cost(keys: Sequence[str], stored: Sequence[int], epochs: float, speed: Speed, tokens: int,
                valid_sentences: int, valid_bleu: bool = True, phase_weights: Sequence[float] = ()) -> PrefixCost:
    """What each prefix of a run's phases costs (:class:`PrefixCost`): the run's ``epochs`` split over its phases
    as ``phase_weights`` split them, each phase's epochs at that phase's speed; without weights for every phase,
    the prefixes' costs are not known here (0)."""
    n = len(keys)
    if not _weighs_every_phase(phase_weights, speed):
        return PrefixCost(tuple(keys), (0.0,) * n, (0.0,) * n, tuple(stored))
    scale = epochs / sum(phase_weights)
    per = [w * scale for w in phase_weights]
    per_s = [e * (tokens / tps + valid_s(speed, valid_sentences, valid_bleu))
             for e, tps in zip(per, speed.phase_tokens_per_s)]
    return PrefixCost(tuple(keys), tuple(itertools.accumulate(per[:n])), tuple(itertools.accumulate(per_s[:n])),
                      tuple(stored))


def makespan(durations: Sequence[float], slots: int) -> tuple[float, int]:
    """When the last of ``durations`` ends if they start in order, each as soon as one of ``slots`` is free, and
    how many waves that is (``ceil(n / slots)``)."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free = [0.0] * min(slots, max(len(durations), 1))
    end = 0.0
    for d in durations:
        start = heapq.heappop(free)
        end = max(end, start + d)
        heapq.heappush(free, start + d)
    return end, math.ceil(len(durations) / slots) if durations else 0


def schedule(trials: Sequence[RunCost], slots: int) -> tuple[list[RunCost], float, int]:
    """:func:`makespan` of ``trials``, where a trial that starts from scratch starts where another run's phases ended
    if their end is there when it starts (:mod:`nmtcore.engine.shared_phases`): the longest prefix of its schedule
    that the store holds or that a trial started before it has kept by then (that trial's start plus its prefix's
    time). Returns the trials with what each starts from set (``saved_epochs``, ``saved_s``, said in its
    ``epochs_from``), the makespan and the waves."""
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    free = [0.0] * min(slots, max(len(trials), 1))
    kept: dict[str, tuple[float, str, float, float]] = {}  # key -> (ready at, whose, epochs, seconds)
    out: list[RunCost] = []
    end = 0.0
    for t in trials:
        start = heapq.heappop(free)
        p = t.prefixes
        if p is not None:
            for k in reversed(range(len(p.keys))):
                own_e, own_s = p.epochs[k], p.seconds[k]
                if p.stored[k]:
                    e = float(p.stored[k])
                    s = own_s * e / own_e if own_e else e * t.epoch_s
                    t = dataclasses.replace(t, saved_epochs=e, saved_s=s, epochs_from=(
                        f"{t.epochs_from}; less {_first(k)}, {e:g} epochs, kept in the store by an earlier run"))
                    break
                ready = kept.get(p.keys[k])
                if ready is not None and ready[0] <= start:
                    e, s = (own_e, own_s) if own_e else ready[2:]
                    t = dataclasses.replace(t, saved_epochs=e, saved_s=s, epochs_from=(
                        f"{t.epochs_from}; less {_first(k)}, {e:g} epochs, trained by {ready[1]}"))
                    break
            for k in range(len(p.keys)):  # the prefixes it trains itself, kept as they end
                if p.seconds[k] and p.seconds[k] > t.saved_s:
                    kept.setdefault(p.keys[k], (start + p.seconds[k] - t.saved_s, t.label, p.epochs[k],
                                                p.seconds[k]))
        out.append(t)
        end = max(end, start + t.seconds)
        heapq.heappush(free, start + t.seconds)
    return out, end, math.ceil(len(trials) / slots) if trials else 0


def _first(k: int) -> str:
    return "its first phase" if k == 0 else f"its first {k + 1} phases"


def estimate(shared: Sequence[tuple[str, float]], baseline: RunCost | None, baseline_done: bool,
             trials: Sequence[RunCost], slots: int, machine: str, baseline_epochs_done: int = 0,
             keys: Sequence[str] = (), copied: int = 0, finished: int = 0) -> Estimate:
    """The phases: the shared work (``(what, seconds)`` each, run one after another), the baseline (reused
    when ``baseline_done``; ``baseline_epochs_done`` of a started one are not trained again), the trials in
    waves on ``slots`` (``copied``: more trials, trained before, that the sweep copies: no time; ``finished``:
    more trials that this sweep finished before it was stopped, a resumed sweep's: no time)."""
    phases = [Phase("shared work", sum(s for _, s in shared),
                    "; ".join(f"{what} {duration(s)}" for what, s in shared) or "all cached")]
    if baseline is not None:
        if baseline_done:
            phases.append(Phase("baseline", 0.0, "in the store: reused"))
        else:
            left = max(baseline.epochs - baseline_epochs_done, 0)
            done = f", {baseline_epochs_done} already trained" if baseline_epochs_done else ""
            phases.append(Phase("baseline", left * baseline.epoch_s + baseline.end_s,
                                f"{left:g} epochs x {duration(baseline.epoch_s)}{done} (epochs: {baseline.epochs_from})"))
    trials, total, waves = schedule(trials, slots)
    kinds: dict[tuple[float, str], int] = {}
    for t in trials:
        kinds[(t.trained_epochs, t.epochs_from)] = kinds.get((t.trained_epochs, t.epochs_from), 0) + 1
    epochs = "; ".join(f"{n} trial{'s' * (n > 1)} x {e:g} epochs ({why})" for (e, why), n in kinds.items())
    per = [t.epoch_s for t in trials]
    again = "".join(f" (and {n} {what})" for n, what in ((finished, "finished in earlier sessions"),
                                                         (copied, "trained before: copied, not trained again")) if n)
    phases.append(Phase("trials", total, f"{len(trials)} trial{'s' * (len(trials) != 1)}{again}, {slots} at once "
                                         f"({waves} wave{'s' * (waves != 1)}); an epoch "
                                         f"{duration(min(per, default=0))}-{duration(max(per, default=0))}; {epochs}"))
    return Estimate(tuple(phases), machine, tuple(zip(keys, (t.seconds for t in trials))),
                    tuple(zip(keys, (t.epoch_s for t in trials))))


# ---------------------------------------------------------------------------------------------- epochs
def expected_epochs(cfg: ExperimentConfig, role: str, tracking_uri: str | None,
                    warm: bool | None = None) -> tuple[float, str]:
    """How many epochs a run of ``cfg`` (role ``baseline`` or ``trial``) trains, and where the figure comes from:
    the budget's fixed epochs; for a budget that trains to convergence, the median over the converged runs of
    the same role, start (``warm``: from other weights, the shared baseline's; default: either in the store, and
    a trial's measured figure that of warm-started ones), data, stopping rule and cap in the store at
    ``tracking_uri``, on the nearest of the :func:`rungs` that has any (the same model and settings first), else
    the platform's measured figure of the model or its family, else the cap. A trial from scratch converges like a
    baseline, not like a second stage: the start decides."""
    t = cfg.train
    if not t.patience:
        return float(t.max_epochs), "the budget's fixed epochs"
    def start(warm: bool | None) -> str:  # how a trial's runs started, as the figure's source says it
        return {None: "", True: "warm-started ", False: "from-scratch "}[warm] if role == "trial" else ""

    kin = kindred(cfg.model.name)
    for settings, models in rungs(kin):
        runs = converged_runs(cfg, role, tracking_uri, warm, settings, models)
        if not runs:
            continue
        n, median = len(runs), float(statistics.median(int(r.metrics["epoch"]) for r in runs))
        if models:
            names = ", ".join(sorted({r.params.get("model.name", "?") for r in runs}))
            of = f"of {names}, another variant of {cfg.model.name}'s family,"
        else:
            of = "of this kind" if settings else "of this model"
        otherwise = "" if settings else " trained with other settings" + (
            "" if models else f" ({', '.join(TRAINING_SETTINGS)})")
        guess = "" if settings and not models else ": a guess"
        return median, (f"the median of {n} converged {start(warm)}{role} run{'s' * (n > 1)} {of} in the store"
                        f"{otherwise}{guess}")
    warm = (role == "trial") if warm is None else warm
    flat = cfg.flat()
    other = tuple(sorted((k, flat[k]) for k, v in MEASURED_SETTINGS.items() if flat[k] != v))
    measured, guarded, at, kind = None, False, None, (cfg.data.corpus, "warm" if warm else "scratch", cfg.model.name)
    for name in (cfg.model.name, *kin):  # its own figure, else its family's
        kind = (cfg.data.corpus, "warm" if warm else "scratch", name)
        at = MEASURED_EPOCHS_AT.get(other, {}).get(kind) if other else None  # measured at this run's settings
        measured, guarded = at or MEASURED_EPOCHS.get(kind, (None, False))
        if measured is not None:
            break
    if measured is not None and (t.stop_metric, t.patience, t.min_delta) == MEASURED_RULE \
            and measured <= t.max_epochs:
        guard = ("" if guarded == bool(t.loss_guard) else
                 "; measured without train.loss_guard, which can only lengthen a run: a lower bound" if t.loss_guard
                 else "; measured with train.loss_guard, which can only lengthen a run: an upper bound")
        guess = ("" if at or not other else
                 f"; they trained with {', '.join(f'{k}={MEASURED_SETTINGS[k]}' for k, _ in other)}: a guess")
        if kind[2] != cfg.model.name:
            guess += f"; {kind[2]} is another variant of {cfg.model.name}'s family: a guess"
        where = f" at {', '.join(f'{k}={v}' for k, v in other)}" if at else ""
        return float(measured), (f"what the platform's converged {start(warm)}{kind[2]} runs on "
                                 f"{cfg.data.corpus}{where} took (no such run in this store yet; at most the cap, "
                                 f"{t.max_epochs}{guard}{guess})")
    return float(t.max_epochs), "the cap: an upper bound, no converged run of this kind in the store yet"


def family(name: str) -> tuple[str, ...]:
    """The registered model names that build the model class ``name`` builds: a family and its named variants
    (``bert_jam``, ``bert_jam_m1``, ...), sorted."""
    from nmtcore.config import MODEL_CONFIGS
    from nmtcore.models.registry import MODEL_CLASSES

    def built(config: type) -> type:
        return next(MODEL_CLASSES[c] for c in config.__mro__ if c in MODEL_CLASSES)

    mine = built(MODEL_CONFIGS[name])
    return tuple(sorted(n for n, c in MODEL_CONFIGS.items() if built(c) is mine))


def kindred(name: str) -> tuple[str, ...]:
    """The other variants of ``name``'s :func:`family`."""
    return tuple(n for n in family(name) if n != name)


def rungs(kin: Sequence[str]) -> list[tuple[bool, tuple[str, ...]]]:
    """Where a figure measured on converged runs is looked for, nearest first, as :func:`converged_runs`'
    ``(settings, models)``: runs of the same model and settings, of the same model trained otherwise (another
    dropout, say), then of another variant of its family (``kin``: BERT-JAM's M0 for its M1) alike and otherwise.
    Each is closer than the cap; all but the first are a guess."""
    kin = tuple(kin)
    return [(True, ()), (False, ()), *([(True, kin), (False, kin)] if kin else [])]


def converged_runs(cfg: ExperimentConfig, role: str, tracking_uri: str | None, warm: bool | None = None,
                   settings: bool = True, models: Sequence[str] = ()) -> list["tracking.RunRecord"]:
    """The finished runs in the store that the patience rule stopped and that trained as ``cfg`` would (same
    model, role, train/valid splits, stopping rule and epoch cap, and with ``settings`` the same
    :data:`TRAINING_SETTINGS`; with ``warm`` given, only the runs that started from other weights
    (``train.init_from``), or only those that did not). ``models``: runs of these models instead of ``cfg``'s."""
    from nmtcore import tracking
    from nmtcore.sweep.lifecycle import ROLE_TAG
    from nmtcore.tracking.callback import STOPPED_BY_TAG

    if not models and cfg.model.name:
        models = (cfg.model.name,)
    flat, defaults = cfg.flat(), ExperimentConfig().flat()
    same = ("data.train_split", "data.valid_split", "train.stop_metric", "train.patience",
            "train.min_delta", "train.loss_guard", "train.max_epochs") + (TRAINING_SETTINGS if settings else ())
    query = " and ".join([f"tags.`{ROLE_TAG}` = '{role}'", f"tags.`{STOPPED_BY_TAG}` = 'patience'",
                          "attributes.status = 'FINISHED'"])
    try:
        runs = tracking.search_runs(query, tracking_uri)
    except tracking.TrackingError:
        return []
    return [r for r in runs
            # a setting a run did not log did not exist yet: it ran as the setting's default
            if "epoch" in r.metrics and r.params.get("model.name", str(defaults["model.name"])) in models
            and all(r.params.get(k, str(defaults[k])) == str(flat[k]) for k in same)
            and (warm is None or bool(r.params.get("train.init_from")) == warm)]


# ---------------------------------------------------------------------------------------------- measuring
def probe_data(data: PreparedData, cfg: ExperimentConfig, cache_dir: Path) -> PreparedData:
    """A small copy of ``data`` for a probe: enough training pairs for the probe's updates, a few sentences of
    every other split, and its own feature cache under ``cache_dir`` (the real cache is left alone)."""
    mean = max(float(data.train.tgt_lens.mean()) + 1, 1.0)
    need = math.ceil((PROBE_STEPS + 1) * cfg.data.max_tokens * cfg.train.update_freq / mean * 1.5)
    splits = {name: split.select(range(min(len(split), need if name == cfg.data.train_split
                                           else PROBE_OTHER_SENTENCES)))
              for name, split in data.splits.items()}
    return dataclasses.replace(data, cfg=dataclasses.replace(data.cfg, cache_dir=str(cache_dir)), splits=splits)


def probe(cfg: ExperimentConfig, data: PreparedData, threads: int) -> Speed:
    """Measure ``cfg``'s speeds here (:class:`Speed`): its trainer built on a small copy of ``data``
    (:func:`probe_data`), ``PROBE_STEPS`` updates run once untimed and again timed (:func:`_train_speed`), then
    ``PROBE_DECODE`` validation sentences decoded greedily after a few untimed. The probe's model is barely
    trained: it rarely emits EOS, so its greedy decode would run every sentence to the length cap (``max_len_a`` x
    source + ``max_len_b``) where a trained model stops near the reference's length; the probe caps each sentence
    at its source's length instead, as long as a translation of it runs. A frozen BERT's cached features are
    random values of their shape there (:func:`~nmtcore.bert.layer.synthetic_features`: the model reads them as it
    reads real ones, and the probe does not run BERT over its sentences; what building the real ones costs,
    :func:`feature_rate` times). The training speeds are those of the real epoch's batches: the probe's few
    batches, cut from a small pool of the training split, hold more padding than an epoch's over the whole split
    (docs/performance.md), and an update's time follows its padded positions, so the measured tokens/s are scaled
    by the two fills (:func:`token_fill`).
    ``cfg``'s BERT must exist (:func:`nmtcore.bert.ensure_bert`). Restores torch's thread count."""
    from nmtcore.bert.layer import synthetic_features
    from nmtcore.engine import build_trainer

    before = torch.get_num_threads()
    try:
        with tempfile.TemporaryDirectory(prefix="nmtcore-probe-") as tmp:
            small = probe_data(data, cfg, Path(tmp))
            pc = cfg.with_overrides({"train.num_threads": threads, "output_dir": tmp, "train.save_dir": "",
                                     "train.init_from": "", "train.max_updates": 0})
            with synthetic_features(tmp):
                trainer = build_trainer(pc, small)
            step = max(1, pc.train.update_freq)
            batches: list[Any] = []
            for epoch in range(1, 100):
                batches += list(trainer.train_batches(epoch=epoch))
                if len(batches) >= PROBE_STEPS * step:
                    break
            groups = [batches[i:i + step] for i in range(0, len(batches), step)][:PROBE_STEPS]
            first, share = _train_speed(trainer, groups, threads)
            train = data.splits[pc.data.train_split]
            full = batch_indices(train.src_lens, train.tgt_lens, pc.data.max_tokens, pc.data.max_sentences,
                                 seed=pc.train.seed, bert_lens=trainer.budgeted_bert_lens(train))
            fuller = token_fill(train, full) / token_fill(train, [b.ids.numpy() for g in groups for b in g])
            valid = small.splits[pc.data.valid_split]
            greedy = DecodeConfig(**{**pc.decode.__dict__, "beam": 1, "nbest": 1, "max_len_a": 1.0, "max_len_b": 1})
            trainer.translate(valid.select(range(min(len(valid), PROBE_DECODE_WARMUP))), greedy)
            t0 = time.perf_counter()
            n = len(trainer.translate(valid.select(range(min(len(valid), PROBE_DECODE))), greedy))
            decode_s = time.perf_counter() - t0
            phases, shares = _phase_speeds(trainer, groups, first, threads)
    finally:
        torch.set_num_threads(before)
    return Speed(first * fuller, n / decode_s, threads, phase_tokens_per_s=tuple(p * fuller for p in phases),
                 phase_epochs=tuple(p.epochs for p in trainer.phases), cpu_share=min([share, *shares]))


def token_fill(split: Any, batches: Iterable[Any]) -> float:
    """The share of ``batches``' padded source and target positions (``split``'s sentences by index, each side with
    its EOS) that hold tokens."""
    tokens = padded = 0
    for idx in batches:
        src, tgt = split.src_lens[idx] + 1, split.tgt_lens[idx] + 1
        tokens += int(src.sum() + tgt.sum())
        padded += len(idx) * int(src.max() + tgt.max())
    return tokens / max(padded, 1)


def _phase_speeds(trainer: Any, groups: list[list[Any]], first: float,
                  threads: int) -> tuple[tuple[float, ...], list[float]]:
    """Each phase's training speed on the probe's batches, and the CPU share of each phase timed here: the first
    phase's speed is ``first``; a phase that trains the parameter groups an earlier one trains has that one's;
    any other is timed as the first was (entered, then :func:`_train_speed`): BERT-JAM's fine-tuning phase runs
    BERT's backward pass and reads no cached features, so the first phase's speed does not stand for it."""
    speeds: dict[frozenset[str], float] = {}
    out: list[float] = []
    shares: list[float] = []
    for i, phase in enumerate(trainer.phases):
        groups_trained = frozenset(phase.trainable)
        if i == 0:
            speeds[groups_trained] = first
        elif groups_trained not in speeds:
            trainer.enter_phase(i)
            speeds[groups_trained], share = _train_speed(trainer, groups, threads)
            shares.append(share)
        out.append(speeds[groups_trained])
    return tuple(out), shares


def _train_speed(trainer: Any, groups: list[list[Any]], threads: int) -> tuple[float, float]:
    """Target tokens per second of ``trainer``'s updates over ``groups`` (one update each), timed on a second pass
    after an untimed first (see :data:`PROBE_STEPS`), and the share of ``threads`` cores the timed pass had."""
    for g in groups:
        trainer.train_step(g)
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    for g in groups:
        trainer.train_step(g)
        tokens += sum(b.n_tgt_tokens for b in g)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return tokens / wall, min(cpu / (wall * threads), 1.0)


def machine_line() -> str:
    """The machine in a few words: its CPU, cores and whether bf16 kernels exist (the precision that trains)."""
    import os

    from nmtcore.host import cpu_info, isa_class

    model, flags = cpu_info()
    isa = isa_class(flags)
    return f"{model}, {os.cpu_count()} cores, {isa}" + ("" if isa.endswith("-BF16") else " (no bf16 kernels: fp32)")


def distinct(configs: Iterable[tuple[str, ExperimentConfig]]) -> dict[str, tuple[str, ExperimentConfig]]:
    """One config per distinct trained shape (model, sizes, BERT): the probe runs once per shape; knobs such as
    p_net or a seed change no speed."""
    shapes: dict[str, tuple[str, ExperimentConfig]] = {}
    for label, cfg in configs:
        shapes.setdefault(shape_key(cfg), (label, cfg))
    return shapes


SPEED_KEYS = ("model.", "data.max_tokens", "train.precision", "train.update_freq")
NOT_SPEED = ("model.p_net", "model.bert.cache_dir", "model.dropout", "model.attention_dropout",
             "model.activation_dropout")


def shape_key(cfg: ExperimentConfig) -> str:
    """What decides a run's speed (:data:`SPEED_KEYS` but :data:`NOT_SPEED`)."""
    flat: Mapping[str, Any] = cfg.flat()
    return repr(sorted((k, str(v)) for k, v in flat.items()
                       if k.startswith(SPEED_KEYS) and not k.startswith(NOT_SPEED)))


def missing_features(cfg: ExperimentConfig, data: PreparedData) -> tuple[int, Any]:
    """Sentences (over every split) whose frozen BERT features a run of ``cfg`` reads but the cache does not
    hold yet (0 for a model that reads none), and the BertLayer that reads them (None: no cached features),
    its stream attached to ``data``. ``cfg``'s BERT must exist."""
    from nmtcore.bert.features import FeatureCache
    from nmtcore.sweep.pre_sweep import bert_stream_layer

    layer = bert_stream_layer(cfg, data, use_cache=False)
    if layer is None or not layer.cache_wanted:
        return 0, None
    cache = FeatureCache(data.cfg.resolved_cache_dir() / "bert_features")
    missing = sum(len(split) for split in data.splits.values()
                  if split.bert is not None and cache.load(layer.features_key(split.bert), len(split.bert)) is None)
    return missing, layer


def feature_rate(layer: Any, inputs: Any, threads: int, sentences: int = FEATURE_PROBE_SENTENCES) -> float:
    """Sentences per second at which ``layer`` (a frozen BertLayer) computes features at ``threads`` torch
    threads, as the pre-sweep task that builds them runs: the first ``sentences`` of ``inputs`` (a split's
    BERT stream) written to a temporary cache, only the computing timed, after one untimed batch. Restores
    torch's thread count."""
    from nmtcore.bert.features import FeatureCache

    n = min(len(inputs), sentences)
    part = inputs.select(range(n))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        with tempfile.TemporaryDirectory(prefix="nmtcore-feature-probe-") as tmp:
            cache = FeatureCache(tmp)
            warm = part.select(range(min(n, 8)))
            cache.get_or_build(layer.features_key(warm), warm, layer._compute_features)  # untimed first batch
            store = cache.get_or_build(layer.features_key(part), part, layer._compute_features)
    finally:
        torch.set_num_threads(before)
    return n / max(store.build_s or 0.0, 1e-9)


def dry_run(space: Any, base: ExperimentConfig, settings: Any, baseline: ExperimentConfig | None = None,
            progress: Any = print, shared_s: float | None = None,
            done: Mapping[str, TrialProgress] | None = None) -> Estimate:
    """What a fresh run of ``space`` (``run_sweep``'s arguments) would cost here: the BERTs are made if missing
    (the real run reuses them), every distinct trial model and the baseline are probed (:func:`probe`), and
    nothing else is trained or written outside temporary directories. Sampled spaces are estimated at
    ``num_samples`` trials of their first example point. ``shared_s``: the shared work is done and took that
    long (a sweep printing its estimate once it has made its BERTs and their features). ``done``: a resumed
    sweep's trials by config key (:func:`sweep_progress`): what is left of them is estimated, not their whole."""
    import os

    from nmtcore.bert import ensure_bert
    from nmtcore.data import prepare_data
    from nmtcore.sweep.baseline import baseline_key, checkpointed_epochs, default_root, find_baseline
    from nmtcore.sweep.plan import (SEED_KEY, baseline_config, config_key, distinct_berts, stream_label,
                                    trial_overrides, validate_space)
    from nmtcore.sweep.space import CELL_KEY
    from nmtcore.sweep.settings import phase_store, resolve_settings

    settings = resolve_settings(settings)
    validate_space(space, base, settings.seeds)
    warm = space.protocol is not None and space.protocol.warm_start  # the trials start from the shared baseline
    data = prepare_data(base.data)
    cpus = settings.num_cpus or os.cpu_count() or 1
    load = os.getloadavg()[0]  # before the probes, whose own threads would count in it
    threads = max(1, int(settings.cpus_per_trial // settings.workers_per_trial))
    slots = max(1, int(cpus // settings.cpus_per_trial))
    if settings.max_concurrent:
        slots = min(slots, settings.max_concurrent)

    runs: list[tuple[str, ExperimentConfig]] = []
    keys: list[str] = []  # each trial's config key, as its MLflow run is tagged (the report matches on it)
    for i, cell in enumerate(space.cells()):
        for s in range(settings.seeds):
            overrides = trial_overrides(space, {CELL_KEY: i, SEED_KEY: base.train.seed + s}, base.train.seed)
            runs.append((cell.label, base.with_overrides(overrides)))
            keys.append(config_key(overrides))
    if space.sampled:
        point = space.example_points()[0]
        n = (settings.num_samples or space.num_samples) * settings.seeds
        runs += [(f"sample {i + 1}", base.with_overrides(space.overrides(point))) for i in range(n)]

    shared: list[tuple[str, float]] = []
    # by the shape of the run as planned (its BERT as the space names it, e.g. layers/hidden, not as resolved: a
    # run of the grid then finds the probe of its BERT's cell instead of probing it again)
    speeds: dict[str, Speed] = {}
    to_build: list[tuple[str, int, Any, Any]] = []  # features missing: (what, sentences, layer, train stream)
    streams = distinct_berts(space, base, streams=True)  # a document model's contexts: streams of their own
    for cfg in streams:
        what = (cfg.model.bert.name or f"L{cfg.model.bert.layers}-H{cfg.model.bert.hidden}") + stream_label(cfg, streams)
        progress(f"dry run: BERT {what}: made if missing, then its features looked up in the cache")
        ready = ensure_bert(cfg)
        missing, layer = missing_features(ready, data) if shared_s is None else (0, None)
        stream = data.train.bert  # this BERT's: the next one's missing_features replaces it
        if shape_key(cfg) not in speeds:
            progress(f"dry run: probing {what} at {threads} thread(s)")
            speeds[shape_key(cfg)] = probe(ready, data, threads)
        if missing:
            to_build.append((what, missing, layer, stream))
    # As prepare_shared builds them: deepest first, its bottom truncations computed in the same pass.
    to_build.sort(key=lambda b: -b[2].num_layers)
    for i, (what, missing, layer, stream) in enumerate(to_build):
        # Computed in a deeper BERT's pass only where it reads the same tokens (another document context does not).
        deeper = next((w for w, _, d, s in to_build[:i]
                       if layer.truncates(d) and layer.features_key(stream).inputs == d.features_key(s).inputs), None)
        if deeper is not None:
            shared.append((f"BERT features {what} (computed in the pass of {deeper})", 0.0))
            continue
        progress(f"dry run: timing {what}'s features at {int(cpus)} thread(s)")
        rate = feature_rate(layer, stream, int(cpus))
        shared.append((f"BERT features {what} ({missing} sentences at {rate:.0f}/s)", missing / rate))

    # A resumed sweep's base config carries its baseline (train.init_from): nothing left to train there.
    bcfg = (baseline or baseline_config(space, base)) if warm and done is None else None
    if bcfg is not None:
        root = Path(settings.baseline_store) if settings.baseline_store else default_root(bcfg)
        bkey = baseline_key(bcfg, data.checksums)
        stored = find_baseline(root, bkey)
    # The weights the trials start from; None: the baseline is still to train, so no trial can be a copy yet.
    start = base.train.init_from if bcfg is None else (str(stored.path) if stored is not None else None)
    copied = set() if start is None or not settings.reuse_trials else {
        i for i, (_, cfg) in enumerate(runs[:len(keys)])  # the grid's cells (a sampled space's points are unknown)
        if not (done and keys[i] in done)  # this sweep's own: trained here, not copied
        and _trained_before(cfg.with_overrides({"train.init_from": start}), data.checksums, settings)}
    if copied:
        progress(f"dry run: {len(copied)} trial(s) trained before in this store: copied, not trained again")
    done = done or {}
    finished = {i for i, k in enumerate(keys) if i not in copied and k in done and done[k].finished}
    runs = [r for i, r in enumerate(runs) if i not in copied | finished]
    keys = [k for i, k in enumerate(keys) if i not in copied | finished]
    tokens, valid_n = epoch_tokens(data), len(data.valid)
    test_n = sum(len(data.splits[name]) for name in base.data.test_splits)
    costs: list[RunCost] = []
    store = phase_store(settings)
    known: dict[tuple[str, str, bool], list[tuple[int, ...]]] = {}  # converged phase lengths by kind and start
    for (label, cfg), ckey in itertools.zip_longest(runs, keys):  # a sampled space's points have no key
        key = shape_key(cfg)
        if key not in speeds:
            ready = ensure_bert(cfg)
            progress(f"dry run: probing {label} at {threads} thread(s)")
            speeds[key] = probe(ready, data, threads)
        started = warm or bool(cfg.train.init_from)
        epochs, why = expected_epochs(cfg, "trial", settings.tracking_uri, warm=started)
        trained = done[ckey].epochs if ckey in done else 0
        kind = (key, repr([cfg.flat()[k] for k in TRAINING_SETTINGS]), started)
        if kind not in known:
            known[kind] = converged_phase_lengths(cfg, "trial", settings.tracking_uri, started,
                                                  len(speeds[key].phase_epochs))
        lengths = known[kind]
        # how its epochs split over the phases (each phase at its own speed): as converged runs split theirs, else
        # as the schedule fixes them
        weights = ([statistics.median(p) for p in zip(*lengths)] if lengths
                   else [float(e) for e in speeds[key].phase_epochs] if all(speeds[key].phase_epochs) else [])
        lengths = lengths if trained and done[ckey].phase_epochs else []
        if lengths:
            # phases until convergence: what is left of its phase and every later one, as converged runs had them
            epochs = phases_left(lengths, done[ckey].phase_epochs, cfg.train.patience)
            weights = phase_weights_left(lengths, done[ckey].phase_epochs, cfg.train.patience)
            why = (f"the median phase lengths of {len(lengths)} converged run{'s' * (len(lengths) > 1)} of this kind "
                   f"in the store ({'/'.join(f'{statistics.median(p):g}' for p in zip(*lengths))}), less the "
                   f"{done[ckey].phase_epochs[-1]} it has trained in phase {len(done[ckey].phase_epochs)}")
        elif trained:
            # at least one more epoch: a run the patience rule has not stopped yet trains another to find out
            epochs, why = max(epochs - trained, 1.0), f"{why}; less the {trained} it has trained"
        cost = run_cost(label, epochs, why, speeds[key], tokens, valid_n, test_n, cfg.train.valid_bleu, weights)
        if store and not trained and len(speeds[key].phase_epochs) > 1:
            # a trial from scratch may start where another's phases ended (its own cfg as the trial gets it)
            own = cfg.with_overrides({"train.init_from": start}) if warm and start else cfg
            found = phase_keys(own, data, store, "cuda" if settings.gpus_per_trial > 0 else "cpu")
            if found:
                cost = dataclasses.replace(cost, prefixes=prefix_cost(
                    *found, epochs, speeds[key], tokens, valid_n, cfg.train.valid_bleu, weights))
        costs.append(cost)

    base_cost, base_done, done_epochs, base_speed = None, False, 0, None
    if bcfg is not None:
        base_done = stored is not None
        done_epochs = checkpointed_epochs(root / bkey / "run")
        if not base_done:
            progress(f"dry run: probing the baseline at {int(cpus)} thread(s)")
            base_speed = probe(ensure_bert(bcfg), data, int(cpus))
            epochs, why = expected_epochs(bcfg, "baseline", settings.tracking_uri)
            base_cost = run_cost("baseline", epochs, why, base_speed, tokens, valid_n, test_n, bcfg.train.valid_bleu)
        else:
            base_cost = RunCost("baseline", 0, 0.0, 0.0, "in the store")
    if shared_s is not None:
        shared = [("done in", shared_s)]
    est = estimate(shared, base_cost, base_done, costs, slots, machine_line(), done_epochs, keys,
                   copied=len(copied), finished=len(finished))
    probed = [*speeds.values(), *([base_speed] if base_speed else [])]
    return dataclasses.replace(est, cpu_share=min((s.cpu_share for s in probed), default=1.0), load=load)


@dataclass(frozen=True)
class TrialProgress:
    """How far a trial of a stopped sweep got: epochs trained (its last reported epoch, each one checkpointed)
    and whether it finished; with a phase schedule, the epochs of each phase it has reached."""

    epochs: int
    finished: bool
    phase_epochs: tuple[int, ...] = ()


def phase_epochs(run_id: str, tracking_uri: str | None) -> tuple[int, ...]:
    """Epochs a run trained in each phase it reached (its ``phase`` metric per epoch); () without phases."""
    from nmtcore import tracking

    phases = {step: int(v) for step, v in tracking.get_run_metrics(run_id, tracking_uri, keys=("phase",))
              .get("phase", [])}  # a step logged twice (a resume) counts once
    if not phases:
        return ()
    return tuple(sum(1 for p in phases.values() if p == q) for q in range(1, max(phases.values()) + 1))


def converged_phase_lengths(cfg: ExperimentConfig, role: str, tracking_uri: str | None,
                            warm: bool | None = None, phases: int = 0) -> list[tuple[int, ...]]:
    """The phase lengths of the converged runs on the nearest of the :func:`rungs` that has any, for a schedule
    whose phases run until convergence (``train.phases_converge``); [] otherwise. Only whole schedules of
    ``phases`` phases (0: of the longest schedule found): a variant that skips a phase (BERT-JAM's M2, M3) splits
    its epochs otherwise."""
    if not cfg.train.phases_converge:
        return []
    for settings, models in rungs(kindred(cfg.model.name)):
        runs = converged_runs(cfg, role, tracking_uri, warm, settings, models)
        lengths = [p for p in (phase_epochs(r.run_id, tracking_uri) for r in runs) if p]
        n = phases or max((len(p) for p in lengths), default=0)
        lengths = [p for p in lengths if len(p) == n]
        if lengths:
            return lengths
    return []


def phase_keys(cfg: ExperimentConfig, data: PreparedData, store: str,
               device: str = "cpu") -> tuple[tuple[str, ...], tuple[int, ...]] | None:
    """The prefix keys a trial of ``cfg`` would keep and look for in the phase store ``store``
    (:func:`nmtcore.engine.shared_phases.prefix_keys`, its model built as the trial builds it, weights untrained)
    and the epochs of the phase end the store holds under each (0: none); None where it shares none."""
    import json

    from nmtcore.bert import ensure_bert
    from nmtcore.engine.phases import schedule_of
    from nmtcore.engine.shared_phases import PhaseShare, prefix_keys
    from nmtcore.models.registry import build_model, prepare_model_resources
    from nmtcore.sweep import reuse

    ready = prepare_model_resources(ensure_bert(cfg), data)
    vocab = data.vocab
    model = build_model(ready.model, len(vocab), vocab.pad_id, vocab.bos_id, vocab.eos_id)
    phases = schedule_of(ready, model)
    if len(phases) < 2:
        return None
    share = PhaseShare(Path(store), reuse.phase_context(ready, data.checksums, device), ignore=reuse.NOT_RESULTS)
    keys = prefix_keys(model, phases, ready.train.phases_converge, share)
    stored = []
    for key in keys:
        try:
            note = json.loads((Path(store) / f"{key}.json").read_text(encoding="utf-8"))
            stored.append(int(note["epoch"]) if (Path(store) / f"{key}.pt").is_file() else 0)
        except (OSError, ValueError, KeyError, TypeError):
            stored.append(0)
    return keys, tuple(stored)


def phase_weights_left(lengths: list[tuple[int, ...]], done: tuple[int, ...], patience: int) -> list[float]:
    """The epochs :func:`phases_left` counts, per phase of the schedule (0 for the phases already done; [] past
    the schedule)."""
    current = len(done) - 1
    medians = [statistics.median(p) for p in zip(*lengths)]
    if current >= len(medians):
        return []
    return ([0.0] * current + [max(medians[current] - done[current], 1.0)]
            + [float(max(m, patience + 1)) for m in medians[current + 1:]])


def phases_left(lengths: list[tuple[int, ...]], done: tuple[int, ...], patience: int) -> float:
    """Epochs a phased run has left: in its current phase (the last of ``done``, the epochs it trained in each
    phase it reached) the median length of that phase in ``lengths`` less what it has trained there, at least one
    (a phase the rule has not ended trains another epoch to find out), then the median of every later phase, each
    at least ``patience`` + 1 (the fewest a phase the rule ends can take)."""
    return float(sum(phase_weights_left(lengths, done, patience))) or 1.0


def sweep_progress(parent_run_id: str, tracking_uri: str | None) -> dict[str, TrialProgress]:
    """The trials of the sweep whose MLflow parent run is ``parent_run_id``, by config key: what a resumed
    sweep has done before (its trials' child runs; a killed trial's run is re-attached when it resumes)."""
    from nmtcore.sweep.lifecycle import TrialState, sweep_children, trial_state
    from nmtcore.tracking import schema

    ended = {TrialState.COMPLETE.value, TrialState.STOPPED_EARLY.value, "finished"}  # "finished": no state tag
    out: dict[str, TrialProgress] = {}
    for r in sweep_children(parent_run_id, tracking_uri):
        key = r.tags.get(schema.CONFIG_KEY)
        if not key:
            continue
        # by its trial state, not its MLflow status alone: a run ended FINISHED while its state still says
        # "running" (a trial Tune stopped, before it tagged such runs KILLED) has more to train
        finished = trial_state(r) in ended
        mine = TrialProgress(int(r.metrics.get("epoch", 0)), finished,
                             phase_epochs(r.run_id, tracking_uri) if "phase" in r.metrics and not finished else ())
        seen = out.get(key)
        out[key] = mine if seen is None else TrialProgress(
            max(seen.epochs, mine.epochs), seen.finished or mine.finished,
            max(seen.phase_epochs, mine.phase_epochs, key=sum))
    return out


def _trained_before(cfg: ExperimentConfig, checksums: Mapping[str, str], settings: Any) -> bool:
    """Whether a finished trial in the store has the reuse key of the trial that trains ``cfg``
    (:mod:`nmtcore.sweep.reuse`): the sweep will copy it."""
    from nmtcore import tracking
    from nmtcore.sweep import reuse

    try:
        key = reuse.reuse_key(cfg, checksums, "cuda" if settings.gpus_per_trial > 0 else "cpu")
        return reuse.find_trained(key, tracking.resolve_tracking_uri(settings.tracking_uri)) is not None
    except (OSError, tracking.TrackingError):
        return False
