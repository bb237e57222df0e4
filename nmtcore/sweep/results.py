"""A sweep's results, read back from MLflow alone and compared: one :class:`Group` per configuration, the
reference (the control arm, or the space's reference), and per test set each arm's :class:`Comparison` with
it (Δ, 95% interval and p from a paired bootstrap over the pooled seeds; a paired t-test across seeds).
:mod:`nmtcore.sweep.report` renders them."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, NamedTuple, Sequence

import yaml

from nmtcore import bleu, tracking
from nmtcore.diagnostics import PREFIX as DIAGNOSTICS_PREFIX
from nmtcore.diagnostics import TESTED
from nmtcore.engine.stopping import PATIENCE, loss_still_falling
from nmtcore.engine.trainer import AVERAGED, tested_file
from nmtcore.sweep import timing
from nmtcore.sweep.lifecycle import ARM_TAG, CONTROL_TAG, TrialState, find_sweep_run, sweep_children, trial_state
from nmtcore.sweep.space import CONTROL, FIT_MEASURES, Prediction
from nmtcore.tracking import schema
from nmtcore.tracking.callback import STOPPED_BY_TAG

CONFIG_KEY_TAG = schema.CONFIG_KEY
IMPROVING = "patience, still improving"  # a run the patience rule stopped while its loss still fell or BLEU still rose
_STOPPED_BY_WORDS = {"cap": "by the epoch or update cap", "schedule": "by a fixed schedule",
                     "unrecorded": "with no stopping rule recorded",
                     IMPROVING: "by patience while validation loss still fell or BLEU still rose"}
SEED_TAG = schema.SEED


@dataclass
class Comparison:
    """One arm against the reference (control) on one test set."""

    delta: float | None = None  # mean BLEU over seeds minus the reference's
    ci_low: float | None = None  # 95% bootstrap interval of the pooled-corpus BLEU difference
    ci_high: float | None = None
    p: float | None = None  # two-sided paired bootstrap
    p_seeds: float | None = None  # paired t-test across seeds (>= 2 seeds)
    pooled_seeds: int = 0
    parts: dict[str, Any] = field(default_factory=dict)  # "rare"/"rest" → rare_words.PartComparison

    @property
    def significant(self) -> bool:
        """The interval excludes 0."""
        return self.ci_low is not None and (self.ci_low > 0 or self.ci_high < 0)


@dataclass
class Group:
    """The trials of one configuration (all seeds)."""

    config_key: str
    label: str
    control: bool
    values: dict[str, Any]  # varied key → value
    runs: list[tracking.RunRecord]
    order: int  # first Tune trial index: the grid's order
    bleu: dict[str, dict[str, float]] = field(default_factory=dict)  # test set → seed → BLEU
    chrf: dict[str, dict[str, float]] = field(default_factory=dict)
    bp: dict[str, dict[str, float]] = field(default_factory=dict)  # BLEU's brevity penalty
    len_ratio: dict[str, dict[str, float]] = field(default_factory=dict)  # output length / reference length
    precisions: dict[str, dict[str, tuple[float, ...]]] = field(default_factory=dict)  # BLEU's 1-4-gram precisions
    valid_metric: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    updates: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    parameters: float | None = None
    tokens_per_s: float | None = None
    stopped_by: list[str] = field(default_factory=list)  # per completed run: patience, cap, schedule (or unrecorded)
    # per completed run: its validation loss still falling or its BLEU still rising at its last epoch
    improving_at_stop: list[bool] = field(default_factory=list)
    diagnostics: dict[str, list[float]] = field(default_factory=dict)  # nmtcore.diagnostics figure → per run
    valid_tested: dict[str, float] = field(default_factory=dict)  # seed → the tested model's greedy validation BLEU
    valid_bert_off: dict[str, float] = field(default_factory=dict)  # seed → the same weights' with BERT off
    curves: list[tuple[str, dict[str, list[float]]]] = field(default_factory=list)  # per completed run: seed, curves
    status: dict[str, int] = field(default_factory=dict)
    bert: str = ""  # the BERT as resolved (name, or size -> what answered it)
    bert_layers: int | None = None
    bert_hidden: int | None = None
    bert_quality: float | None = None  # nmtcore.bert.quality figure (replaced-token detection AUC, chance 0.5)
    extra: dict[str, list[float]] = field(default_factory=dict)  # the space's report_metrics: last value per run
    fit: list["Fit"] = field(default_factory=list)  # per completed run that logged both NLLs: training vs validation
    phases: list[str] = field(default_factory=list)  # phased studies: per completed run, phase starts and stop reason
    tested: list[str] = field(default_factory=list)  # phased studies: per completed run, the weights it tested
    comparisons: dict[str, Comparison] = field(default_factory=dict)  # test set → against the reference
    unfinished: list["Progress"] = field(default_factory=list)  # runs still training or stopped with the sweep

    @property
    def by_rarity(self) -> dict[str, dict[str, Any]]:
        """Test set → its comparison with the reference by source-word rarity ("rare"/"rest" → PartComparison)."""
        return {split: c.parts for split, c in self.comparisons.items() if c.parts}

    @property
    def still_improving(self) -> int:
        """How many completed runs were still improving when they stopped."""
        return sum(self.improving_at_stop)

    @property
    def converged(self) -> bool:
        """Every completed run stopped by the patience rule and none was still improving when it did (a patience
        rule on a noisy metric can fire while the loss still falls; such a run has not converged)."""
        return bool(self.stopped_by) and all(rule == PATIENCE and not improving
                                             for rule, improving in zip(self.stopped_by, self.improving_at_stop))


@dataclass(frozen=True)
class Progress:
    """How far a trial that has not finished got (running, or killed when its sweep stopped: a sweep spread over
    sessions): its epochs and its best greedy validation BLEU so far, at which epoch."""

    seed: str
    state: str
    epochs: int
    best_bleu: float  # NaN: no validation BLEU logged
    best_epoch: int

    def describe(self) -> str:
        best = (f"best greedy validation BLEU {self.best_bleu:.2f} at epoch {self.best_epoch}"
                f" ({self.epochs - self.best_epoch} since)" if math.isfinite(self.best_bleu) else "no validation BLEU")
        return f"seed {self.seed or '?'} {self.state}: {self.epochs} epoch{'s' * (self.epochs != 1)}, {best}"


@dataclass
class SweepReport:
    """Everything the files say, computed once."""

    sweep: str
    parent_run_id: str
    tracking_uri: str
    study: str
    space: dict[str, Any]
    varied_keys: list[str]
    metric: str
    test_splits: list[str]
    protocol: str
    groups: list[Group]
    reference: Group | None
    warnings: list[str]
    baseline_converged: bool | None = None  # a warm-started study's shared baseline; None without one
    estimate: dict[str, Any] | None = None  # what the sweep estimated before training (``estimate.json``)
    time_split: list[dict[str, Any]] = field(default_factory=list)  # what each session took (``time_split.json``)
    pooled: list[str] = field(default_factory=list)  # the sweeps whose runs a pooled report joins (empty: one sweep)
    added_test_splits: list[str] = field(default_factory=list)  # of test_splits, those decoded after the sweep
    rarity_missing: str = ""  # why no arm has a comparison by source-word rarity ("": they have)
    predictions: list["PredictionCheck"] = field(default_factory=list)  # written before the runs, checked here
    joined: list[str] = field(default_factory=list)  # rows pooled across studies (``same_arms``): what joined what

    def estimated_s(self, group: "Group") -> float | None:
        """The estimate's seconds for one of ``group``'s trials (mean over its seeds), or None."""
        runs = [r["seconds"] for r in (self.estimate or {}).get("runs", []) if r["config_key"] == group.config_key]
        return sum(runs) / len(runs) if runs else None

    def reused(self) -> list[str]:
        """The trials copied from a run trained before (:mod:`nmtcore.sweep.reuse`): each copy's name, the sweep and
        run it copies."""
        return [f"`{r.run_name}` is `{r.tags.get(schema.REUSED_FROM_SWEEP, '?')}`'s run `{r.tags[schema.REUSED_FROM]}`"
                for g in self.groups for r in g.runs if r.tags.get(schema.REUSED_FROM)]

    def shared_phases(self) -> list[str]:
        """The trials that started where another trial's first phases ended (:mod:`nmtcore.engine.shared_phases`):
        each one's name and what it took from whom."""
        return [f"`{r.run_name}`: {r.tags[schema.SHARED_PHASES]}"
                for g in self.groups for r in g.runs if r.tags.get(schema.SHARED_PHASES)]

    def unconverged_runs(self) -> dict[str, int]:
        """The completed runs (arms and control) that did not converge, counted by what stopped them: a rule other
        than patience, or patience while still improving (:data:`IMPROVING`)."""
        counts: dict[str, int] = {}
        for g in self.groups:
            for rule, improving in zip(g.stopped_by, g.improving_at_stop):
                if rule != PATIENCE or improving:
                    key = IMPROVING if rule == PATIENCE else rule
                    counts[key] = counts.get(key, 0) + 1
        return counts

    def not_an_answer(self) -> str:
        """One plain line when this study's Δs are not an answer (a run, or the baseline the arms started from,
        stopped before convergence), else ""."""
        counts = self.unconverged_runs()
        total = sum(len(g.stopped_by) for g in self.groups)
        parts = []
        if counts:
            how = ", ".join(f"{n} {_STOPPED_BY_WORDS.get(rule, 'by ' + rule)}" for rule, n in sorted(counts.items()))
            parts.append(f"{sum(counts.values())} of {total} runs stopped before convergence ({how})")
        if self.baseline_converged is False:
            parts.append("the baseline they warm-started from was not trained to convergence")
        if not parts:
            return ""
        if set(counts) == {IMPROVING} and self.baseline_converged is not False:  # the rule fired too early
            return ("Not an answer: " + "; ".join(parts) + ". The Δs below compare models stopped while still "
                    "learning, not what BERT does; rerun under a rule that also waits for the validation loss "
                    "(train.loss_guard, the converged budgets' default) for an answer.")
        return ("Not an answer: " + "; ".join(parts) + ". The Δs below compare models the budget cut short, not "
                "what BERT does; run the converged budget (patience rule) for an answer.")


# ================================================================================== building
_FINISHED = (TrialState.COMPLETE.value, TrialState.STOPPED_EARLY.value)  # a trial's states that end it


def build_report(sweep: str | Sequence[str], tracking_uri: str | os.PathLike | None = None, n_bootstrap: int = 1000,
                 bootstrap_seed: int = 12345, against: str | None = None,
                 same_arms: Sequence[tuple[str, str]] = ()) -> SweepReport:
    """Collect a sweep's runs from MLflow and compute the tables' numbers (``n_bootstrap`` = 0: no tests).

    Every configuration is compared with the control (else the space's reference); ``against`` names another
    arm to compare with instead (an arm's name as the table prints it, e.g. a paper's own reference row: the
    full model of an ablation), :class:`TrackingError` if no arm has that name.

    Several sweeps (a list) give one report over their runs pooled: sweeps of one study, varying the same keys,
    tested on the same sets under the same protocol (else :class:`TrackingError`), e.g. the same study run
    again with other seeds (``--arms-set train.seed=2``). Runs group by their config key, as within a sweep;
    a (config, seed) found in more than one sweep counts once, the first sweep's, with a warning.

    ``same_arms``, pairs of arm names (A, B), pools sweeps of different studies where one configuration is an arm
    of each under two names (a size grid's cell ``L4-H384`` is BERT-fused's ``bert_fused`` on the BERT that size
    resolved to): B's runs join A's row, and the studies' controls join one row. Each joined pair must be one
    configuration but for its seed and how it names its BERT (:func:`configuration_differs`), else
    :class:`TrackingError`; the test sets and protocol must still match; a seed both have counts once, A's.

    The predictions each sweep recorded (its space, tagged when it started or last resumed) are checked
    (:func:`check_predictions`)."""
    uri = tracking.resolve_tracking_uri(tracking_uri)
    names = [sweep] if isinstance(sweep, str) else list(sweep)
    if not names:
        raise tracking.TrackingError("build_report: no sweep named")
    parents = [find_sweep_run(name, uri) for name in names]
    records = [schema.SweepTags.from_tags(p.tags, default_name=name) for p, name in zip(parents, names)]
    parent, recorded = parents[0], records[0]
    for other in records[1:]:
        for what in ("study", "varied_keys", "all_test_splits", "protocol"):
            if what == "protocol" and same_protocol(other.protocol, recorded.protocol):
                continue
            if same_arms and what in ("study", "varied_keys"):  # arms named alike across studies
                continue
            if getattr(other, what) != getattr(recorded, what):
                words = "test splits" if what == "all_test_splits" else what.replace("_", " ")
                hint = ("; where an arm of one is an arm of the other under another name, say which with "
                        "--same-arm A B" if what == "study" else "")
                raise tracking.TrackingError(
                    f"cannot pool sweeps {recorded.name!r} and {other.name!r}: their {words} differ "
                    f"({getattr(recorded, what)!r} against {getattr(other, what)!r}){hint}")
    space = recorded.space_description
    varied = list(dict.fromkeys(k for r in records for k in r.varied_keys))
    splits = list(recorded.all_test_splits)
    metric = space.get("metric", "valid_bleu")
    warnings: list[str] = []
    by_key: dict[str, list[tracking.RunRecord]] = {}
    children = [(rec.name, sweep_children(p.run_id, uri)) for p, rec in zip(parents, records)]

    def trial_of(run: tracking.RunRecord) -> tuple[str, str]:  # (config key, seed)
        return run.tags.get(CONFIG_KEY_TAG, run.run_id), run.tags.get(SEED_TAG, "")

    # A (config, seed) in several sweeps counts once: the first sweep's where it finished there (a study continued
    # on another machine: the first machine's trial was cut short, the second's finished), else the first sweep's.
    used: dict[tuple[str, str], str] = {}
    for finished_only in (True, False):
        for name, runs in children:
            for run in runs:
                if not finished_only or trial_state(run) in _FINISHED:
                    used.setdefault(trial_of(run), name)
    # each sweep's run of a trial, a finished one where it has one
    kept: dict[tuple[tuple[str, str], str], tracking.RunRecord] = {}
    for name, runs in children:
        for run in sorted(runs, key=lambda r: trial_state(r) in _FINISHED):
            kept[trial_of(run), name] = run
    for name, runs in children:
        for run in runs:
            key, seed = trial_of(run)
            chosen = used[key, seed]
            if chosen != name:  # in another sweep (a sweep's own retries stay)
                first, second = [n for n, _ in children if n in (chosen, name)]
                why = "" if first == chosen else f" (it finished there, not in {name})"
                warnings.append(f"{run.run_name or key} (seed {seed}) is in {first} and in {second}: "
                                f"{chosen}'s run is used{why}"
                                f"{_both_tested(kept[(key, seed), chosen], run, chosen, name, splits)}")
                continue
            by_key.setdefault(key, []).append(run)
    joined = _join_same_arms(by_key, same_arms, varied, warnings) if same_arms else []
    curves = {r.run_id: _valid_curves(r, uri) for runs in by_key.values() for r in runs}
    histories = {run_id: list(c["valid_loss"].values()) for run_id, c in curves.items()}
    phased = any("phase" in r.metrics for runs in by_key.values() for r in runs)
    groups = [_group(key, runs, varied, splits, metric, curves, space.get("report_metrics") or [], phased, uri)
              for key, runs in by_key.items()]
    groups.sort(key=lambda g: (not g.control, g.order, g.config_key))
    if against is not None:
        reference = next((g for g in groups if g.label == against), None)
        if reference is None:
            raise tracking.TrackingError(f"--against {against!r}: no such arm in {' + '.join(names)} (its arms: "
                                         f"{', '.join(g.label for g in groups) or 'none'})")
    else:
        reference = next((g for g in groups if g.control), None) or _find_reference(groups, space.get("reference"))
    if reference is not None and n_bootstrap > 0:
        masks, rarity_missing = _rarity_masks(reference, splits)
        for g in groups:
            if g is not reference:
                for split in splits:
                    g.comparisons[split] = _compare(reference, g, split, uri, n_bootstrap, bootstrap_seed, warnings,
                                                    masks.get(split))
    else:
        rarity_missing = "no bootstrap asked for" if reference is not None else "no reference arm"
    warnings += _identical_trajectories(groups, histories)
    if reference is not None:
        warnings += _averaging_mismatch(reference, groups)
    for g in groups:
        if g.status.get("failed"):
            reasons = {r.tags.get(tracking.FAILURE_REASON_TAG, "") for r in g.runs if r.status == "FAILED"}
            warnings.append(f"{g.label}: {g.status['failed']} trial(s) failed: {'; '.join(sorted(reasons))}")
        if g.still_improving:
            warnings.append(f"{g.label}: validation loss still falling or validation BLEU still rising at the last "
                            f"epoch in {g.still_improving} run(s): it stopped before it converged")
    added = list(dict.fromkeys(s for r in records for s in r.added_test_splits))
    for split in added:  # trials that completed after ``nmtcore retest`` ran have no score on its sets
        missing = [r.run_name or r.run_id for g in groups for r in g.runs
                   if trial_state(r) == "complete" and f"test/{split}/bleu" not in r.metrics]
        if missing:
            warnings.append(f"{split} (added by nmtcore retest): {len(missing)} complete trial(s) not decoded on it "
                            f"({', '.join(missing)}); run `nmtcore retest --splits {split}` again")
    flags = [r.baseline_converged for r in records]  # pooled: any sweep's False, else any unknown, else True
    converged = False if False in flags else (None if None in flags else True)
    if converged is False:
        warnings.append("the shared baseline was not trained to convergence (no patience rule stopped it): arms "
                        "start from a model that had not converged")
    starts = {r.name: r.baseline_run_id for r in records if r.baseline_run_id}
    if len(set(starts.values())) > 1:  # sweeps on other machines: each trained the shared baseline again
        warnings.append("the pooled sweeps warm-started from different trainings of the shared baseline ("
                        + ", ".join(f"{name}: run {run}" for name, run in starts.items()) + "): each sweep's arms "
                        "pair with its own control, and the spread across its seeds includes the baseline's own")
    checks = check_predictions(_sweep_predictions(records), groups, reference, splits)
    estimate = None
    if len(parents) == 1:  # a pooled report has no one estimate nor time split: each sweep's report has its own
        with contextlib.suppress(tracking.TrackingError, OSError, ValueError):  # sweeps from before estimates: none
            estimate = json.loads(tracking.read_artifact_text(parent.run_id, "estimate.json", uri))
    return SweepReport(sweep=" + ".join(r.name for r in records), parent_run_id=parent.run_id, tracking_uri=uri,
                       study=" + ".join(dict.fromkeys(r.study for r in records)), joined=joined, space=space,
                       varied_keys=varied, metric=metric,
                       test_splits=splits, added_test_splits=added, rarity_missing=rarity_missing,
                       # pooled: a line naming the shared baseline's key over one that does not (a resumed sweep's)
                       protocol=next((r.protocol for r in records if UNKEYED_START not in r.protocol),
                                     recorded.protocol), groups=groups,
                       reference=reference, warnings=warnings,
                       baseline_converged=converged, estimate=estimate,
                       time_split=timing.read(parent.run_id, uri) if len(parents) == 1 else [],
                       pooled=[r.name for r in records] if len(parents) > 1 else [], predictions=checks)


# ================================================================================== predictions
@dataclass(frozen=True)
class PredictionCheck:
    """A prediction (:class:`~nmtcore.sweep.space.Prediction`) against the runs: the measured value (None: not
    measured yet), whether the prediction held (None: not checkable: a run it needs has not finished or not
    converged; ``why`` says which), the bootstrap's CI and p where the report's reference is what the arm is
    against (``bleu:`` measures), the seeds it pools, and where the prediction came from."""

    prediction: Prediction
    source: str  # "recorded with <sweep>"
    value: float | None = None
    held: bool | None = None
    why: str = ""
    ci: tuple[float, float] | None = None
    p: float | None = None
    seeds: int = 0

    def verdict(self) -> str:
        """``held``, ``did not hold`` or ``not checkable yet``."""
        return "not checkable yet" if self.held is None else ("held" if self.held else "did not hold")


def _sweep_predictions(records: Sequence[schema.SweepTags]) -> list[tuple[Prediction, str]]:
    """The predictions the pooled sweeps recorded, each once, with the sweep that recorded it."""
    out: dict[Prediction, str] = {}
    for rec in records:
        for d in rec.space_description.get("predictions") or []:
            out.setdefault(Prediction.from_description(d), f"recorded with {rec.name}")
    return list(out.items())


def check_predictions(predictions: Sequence[tuple[Prediction, str]], groups: Sequence[Group],
                      reference: Group | None, splits: Sequence[str]) -> list[PredictionCheck]:
    """Each prediction, with its source, checked on ``groups``: its arm against the control or the arm it names
    (mean over seeds), held or not only where both have finished and converged (a Δ between runs cut short answers
    nothing)."""
    out: list[PredictionCheck] = []
    for pred, source in predictions:
        base = next((g for g in groups if (g.control if pred.against == CONTROL else g.label == pred.against)), None)
        arm = next((g for g in groups if g.label == pred.arm and not g.control), None)
        missing = (f"no run of {pred.against} in these runs" if base is None
                   else f"no run of {pred.arm} in these runs" if arm is None else "")
        if missing:
            out.append(PredictionCheck(pred, source, why=missing))
            continue
        ci, p = None, None
        split = pred.test_split
        if split:
            if split not in splits:
                out.append(PredictionCheck(pred, source, why=f"{split} is not a test set of these runs"))
                continue
            values = {g.label: list(g.bleu.get(split, {}).values()) for g in (arm, base)}
            comparison = arm.comparisons.get(split) if reference is base else None
            if comparison is not None and comparison.ci_low is not None:
                ci, p = (comparison.ci_low, comparison.ci_high), comparison.p
        else:
            values = {g.label: [getattr(f, FIT_MEASURES[pred.measure]) for f in g.fit] for g in (arm, base)}
        a, b = mean(values[arm.label]), mean(values[base.label])
        value, seeds = (None if a is None or b is None else a - b), len(values[arm.label])
        unconverged = [g.label for g in (arm, base) if not g.converged]
        if value is None:
            why = "no finished run of " + " and ".join(label for label, xs in values.items() if mean(xs) is None)
            out.append(PredictionCheck(pred, source, why=why))
        elif unconverged:
            out.append(PredictionCheck(pred, source, value=value, ci=ci, p=p, seeds=seeds,
                                       why=f"{' and '.join(unconverged)} not converged"))
        else:
            out.append(PredictionCheck(pred, source, value=value, held=pred.holds(value), ci=ci, p=p, seeds=seeds))
    return out


CURVE_KEYS = ("valid_loss", "valid_bleu", "num_updates", "train_nll", "valid_nll", "phase")


def _valid_curves(run: tracking.RunRecord, uri: str) -> dict[str, dict[int, float]]:
    """The run's validation loss, validation BLEU, update count, training and validation NLL and phase (phased
    studies) by epoch (the step they are logged at; empty where not logged). An epoch logged twice, by an attempt
    before a resume and by the resumed one, counts once: its last value."""
    try:
        metrics = tracking.get_run_metrics(run.run_id, uri, keys=CURVE_KEYS)
    except tracking.TrackingError:
        metrics = {}
    return {k: dict(metrics.get(k, [])) for k in CURVE_KEYS}  # sorted by step, then by time: the last one wins


class PhaseEnd(NamedTuple):
    """One phase of a run: its epochs, and the training and validation NLL and greedy validation BLEU at its last
    epoch."""

    phase: int
    first: int
    last: int
    train: float
    valid: float
    bleu: float


@dataclass(frozen=True)
class Fit:
    """How a run fit its training data against how it did on validation, in bits per target token: the training
    NLL (the epoch's mean as it trained, dropout on) and the validation NLL (at the epoch's end, dropout off), at the
    epoch of the lowest validation NLL and at the last epoch. Of two runs trained alike, the one with the lower
    training NLL and the higher validation NLL fits the training set more and generalises less."""

    best_epoch: int  # 1-based: the epoch of the lowest validation NLL
    train_at_best: float
    valid_at_best: float
    last_epoch: int
    train_last: float
    valid_last: float
    # every epoch that logged both NLLs: (epoch, training NLL, validation NLL, validation BLEU or nan, phase or 0)
    path: tuple[tuple[int, float, float, float, int], ...] = ()

    @property
    def gap_at_best(self) -> float:
        return self.valid_at_best - self.train_at_best

    @classmethod
    def of(cls, curves: Mapping[str, Mapping[int, float]]) -> "Fit | None":
        """From a run's curves by epoch (:func:`_valid_curves`); None unless some epoch logged both NLLs."""
        train, valid = curves.get("train_nll", {}), curves.get("valid_nll", {})
        bleu, phase = curves.get("valid_bleu", {}), curves.get("phase", {})
        both = sorted(e for e in valid if e in train and not (math.isnan(train[e]) or math.isnan(valid[e])))
        if not both:
            return None
        best = min(both, key=lambda e: (valid[e], e))
        last = both[-1]
        path = tuple((int(e), train[e], valid[e], bleu.get(e, math.nan), int(phase.get(e, 0) or 0)) for e in both)
        return cls(int(best), train[best], valid[best], int(last), train[last], valid[last], path)

    def at_train_nll(self, level: float) -> tuple[float, float] | None:
        """Where the run's training NLL first came down to ``level``: (epoch, validation NLL), both interpolated
        linearly between the epoch before and the one that reached it; None if it never did. Beside another run's
        validation NLL at that run's own training NLL ``level``, it compares the two at equal fit: the one that
        validates higher there generalises less from what it has learnt, whatever either went on to."""
        before = None
        for epoch, train, valid, _, _ in self.path:
            if train <= level:
                if before is None:
                    return float(epoch), valid
                e0, t0, v0 = before
                w = (t0 - level) / (t0 - train)
                return e0 + w * (epoch - e0), v0 + w * (valid - v0)
            before = (epoch, train, valid)
        return None

    def phase_ends(self) -> list["PhaseEnd"]:
        """Each phase's end (:class:`PhaseEnd`); [] for a run without phases."""
        ends: list[PhaseEnd] = []
        for epoch, train, valid, bleu, phase in self.path:
            if not phase:
                return []
            first = ends.pop().first if ends and ends[-1].phase == phase else epoch
            ends.append(PhaseEnd(phase, first, epoch, train, valid, bleu))
        return ends

    def at_epoch(self, epoch: int) -> tuple[float, float, float] | None:
        """(training NLL, validation NLL, validation BLEU) at ``epoch``; None if the run did not log it."""
        return next(((t, v, b) for e, t, v, b, _ in self.path if e == epoch), None)


TESTED_SWITCHES = (TESTED, "mix")  # the switch a model is tested with: BERT-fused's is Eq. 1's mix
GAIN = "tested_minus/"  # the derived figure's prefix: tested − switch, greedy validation BLEU
# The switch that turns BERT off everywhere, leaving the model's own NMT path: BERT-fused's NMT branches alone, and
# every other family's bert_off
BERT_OFF_SWITCHES = ("bert_off", "nmt_only")


def _valid_bleu_under(metrics: Mapping[str, float], switches: tuple[str, ...]) -> float | None:
    """One run's greedy validation BLEU under the first of ``switches`` it logged; None where it logged none."""
    return next((metrics[f"{DIAGNOSTICS_PREFIX}valid_bleu/{s}"] for s in switches
                 if f"{DIAGNOSTICS_PREFIX}valid_bleu/{s}" in metrics), None)


def tested_valid_bleu(metrics: Mapping[str, float]) -> float | None:
    """One run's greedy validation BLEU of the weights it tested (its diagnostics); None where it logged none."""
    return _valid_bleu_under(metrics, TESTED_SWITCHES)


def bert_off_valid_bleu(metrics: Mapping[str, float]) -> float | None:
    """One run's greedy validation BLEU with BERT switched off everywhere: the NMT path the fused model trained,
    alone; None where the run has no such switch."""
    return _valid_bleu_under(metrics, BERT_OFF_SWITCHES)


def switch_gains(metrics: Mapping[str, float]) -> dict[str, float]:
    """One run's greedy validation BLEU as tested minus under each other inference switch
    (``tested_minus/<switch>``): what the part that switch turns off adds to the tested model, paired within the
    run. Nothing for a run without switches."""
    bleu = f"{DIAGNOSTICS_PREFIX}valid_bleu/"
    tested = tested_valid_bleu(metrics)
    if tested is None:
        return {}
    return {f"{GAIN}{name[len(bleu):]}": tested - value for name, value in metrics.items()
            if name.startswith(bleu) and name[len(bleu):] not in TESTED_SWITCHES}


def _progress(run: tracking.RunRecord, state: str, by_epoch: Mapping[int, float]) -> Progress:
    """An unfinished run's :class:`Progress`, from its validation BLEU by epoch (:func:`_valid_curves`)."""
    epochs = int(run.metrics.get("epoch", max(by_epoch, default=0)))
    if not by_epoch:
        return Progress(run.tags.get(SEED_TAG, ""), state, epochs, math.nan, 0)
    best_epoch = max(sorted(by_epoch), key=lambda e: (by_epoch[e], -e))  # the first epoch of the best value
    return Progress(run.tags.get(SEED_TAG, ""), state, epochs, by_epoch[best_epoch], int(best_epoch))


# How a protocol line (driver.describe_protocol) says where the arms started: with the shared baseline's key, or
# without one (the line a resume wrote before it kept the first session's).
_KEYED_START = re.compile(r"warm-started from baseline \S+ \(stopped by [^)]*\)")
UNKEYED_START = "warm-started from the sweep's baseline"


def same_protocol(a: str, b: str) -> bool:
    """Whether two sweeps' recorded protocols are one: equal, or equal but for one naming its shared baseline's key
    where the other says only "the sweep's baseline"."""
    if a == b:
        return True
    if UNKEYED_START not in (a + b):
        return False
    return _KEYED_START.sub(UNKEYED_START, a) == _KEYED_START.sub(UNKEYED_START, b)


def bleu_still_rising(valid_bleus: list[float], tolerance: float = 0.1) -> bool:
    """Whether a run's validation BLEU was still rising at its last epoch: the last epoch is the best by more
    than ``tolerance`` BLEU. Validation loss alone misses it: after a warm start a fused model's loss can level
    off while its BLEU still climbs (the main job's BERT arms: loss flat, BLEU 30.7 → 32.9 → 33.4)."""
    return len(valid_bleus) >= 2 and valid_bleus[-1] > max(valid_bleus[:-1]) + tolerance


def _values(run: tracking.RunRecord, varied: list[str]) -> dict[str, Any]:
    """A trial run's values of the varied keys ({} for the control)."""
    if run.tags.get(CONTROL_TAG) == "true":
        return {}
    return {k: _parse(run.tags[f"varied.{k}"]) for k in varied if f"varied.{k}" in run.tags}


def _label(run: tracking.RunRecord, varied: list[str]) -> str:
    """A trial run's row name: the control, its arm's name, else its varied values."""
    if run.tags.get(CONTROL_TAG) == "true":
        return CONTROL
    return run.tags.get(ARM_TAG) or ", ".join(f"{short(k)}={fmt(v)}" for k, v in _values(run, varied).items()) or "base"


# How a run names its BERT: by name, or by size (which a registry resolves to a name, recorded in its tags).
BERT_NAMING = ("model.bert.name", "model.bert.layers", "model.bert.hidden", "model.bert.pretrain_corpus")
BERT_IDENTITY = (schema.BERT_RESOLVED, schema.BERT_LAYERS, schema.BERT_HIDDEN, schema.BERT_TYPE)


def configuration_differs(a: tracking.RunRecord, b: tracking.RunRecord) -> str:
    """"" where two trial runs are one configuration but for their seed, their arm's name and how they name their
    BERT; else what differs. Compared: every param that decides a result (not where it writes, what only speed
    depends on, nor the path of its starting weights: :data:`~nmtcore.sweep.reuse.NOT_RESULTS`), the data's
    checksums, and the BERT each resolved to: its name, size, type and its files under the BERT cache."""
    from nmtcore.sweep.reuse import NOT_RESULTS

    skip = {*NOT_RESULTS, "arm", "train.seed", *BERT_NAMING}
    diffs = [(k, a.params.get(k), b.params.get(k)) for k in sorted(set(a.params) | set(b.params))
             if k not in skip and a.params.get(k) != b.params.get(k)]
    tags = [t for t in sorted(set(a.tags) | set(b.tags)) if t.startswith(schema.CHECKSUM_PREFIX)]
    diffs += [(t, a.tags.get(t), b.tags.get(t)) for t in (*BERT_IDENTITY, *tags) if a.tags.get(t) != b.tags.get(t)]
    files = _bert_files(a), _bert_files(b)
    if files[0] != files[1]:
        diffs.append(("BERT files", *files))
    shown = ", ".join(f"{k} {x!r} against {y!r}" for k, x, y in diffs[:4])
    return shown + (f" and {len(diffs) - 4} more" if len(diffs) > 4 else "")


def _bert_files(run: tracking.RunRecord) -> str:
    """Where a run's BERT came from, relative to its BERT cache (the same files on two machines), "" without one."""
    path, cache = run.tags.get(schema.BERT_PATH, ""), run.params.get("model.bert.cache_dir", "")
    if path and cache and os.path.normpath(path).startswith(os.path.normpath(cache) + os.sep):
        return os.path.relpath(path, cache)
    return path


def _join_same_arms(by_key: dict[str, list[tracking.RunRecord]], pairs: Sequence[tuple[str, str]],
                    varied: list[str], warnings: list[str]) -> list[str]:
    """Join, in ``by_key``, the rows ``pairs`` name alike (B's runs into A's) and the studies' controls; each join
    checked by :func:`configuration_differs`. Returns a line per join."""
    labels = {key: _label(runs[0], varied) for key, runs in by_key.items()}
    arms = ", ".join(dict.fromkeys(labels.values()))
    sets = [("the controls", [k for k, label in labels.items() if label == CONTROL])]
    for a, b in pairs:
        keys = {name: [k for k, label in labels.items() if label == name] for name in (a, b)}
        missing = [repr(name) for name, ks in keys.items() if not ks]
        if missing:
            raise tracking.TrackingError(f"--same-arm {a} {b}: no arm named {' or '.join(missing)} in these "
                                         f"sweeps (their rows: {arms})")
        sets.append((f"--same-arm {a} {b}", keys[a] + keys[b]))
    into: dict[str, str] = {}  # a joined key -> the key it joined

    def home(key: str) -> str:
        while key in into:
            key = into[key]
        return key

    def where(key: str) -> str:
        sweeps = dict.fromkeys(r.tags.get(schema.SWEEP, "?") for r in by_key[key])
        return f"`{labels[key]}` (config {key}, {', '.join(sweeps)})"

    joined = []
    for what, keys in sets:
        keys = list(dict.fromkeys(home(k) for k in keys))
        for other in keys[1:]:
            target = keys[0]
            why = configuration_differs(by_key[target][0], by_key[other][0])
            if why:
                raise tracking.TrackingError(f"{what}: {where(target)} and {where(other)} are not one "
                                             f"configuration: {why}")
            joined.append(f"{where(other)} joins {where(target)}")
            seeds = {r.tags.get(SEED_TAG, "") for r in by_key[target]}
            for run in by_key.pop(other):
                seed = run.tags.get(SEED_TAG, "")
                if seed in seeds:
                    warnings.append(f"{labels[other]} seed {seed} ({run.tags.get(schema.SWEEP, '?')}) is also "
                                    f"{labels[target]}'s seed {seed}: {labels[target]}'s run is used")
                    continue
                by_key[target].append(run)
            into[other] = target
    return joined


def _group(key: str, runs: list[tracking.RunRecord], varied: list[str], splits: list[str], metric: str,
           curves: dict[str, dict[str, dict[int, float]]], extra: list[str], phased: bool = False, uri: str = "") -> Group:
    first = runs[0]
    control = first.tags.get(CONTROL_TAG) == "true"
    values, label = _values(first, varied), _label(first, varied)
    g = Group(config_key=key, label=label, control=control, values=values, runs=runs,
              order=min(_trial_index(r) for r in runs))
    p = first.params
    g.bert = p.get("model.bert.name") or (f"L{p['model.bert.layers']}-H{p['model.bert.hidden']}"
                                          if p.get("model.bert.layers", "0") not in ("0", "") else "")
    resolved = first.tags.get(schema.BERT_RESOLVED, "")
    if resolved and resolved != g.bert:  # a size: what answered it
        g.bert = f"{g.bert} → {resolved}"
    for attr, tag in (("bert_layers", schema.BERT_LAYERS), ("bert_hidden", schema.BERT_HIDDEN)):
        value = first.tags.get(tag)
        setattr(g, attr, int(value) if value else None)
    quality = first.tags.get(schema.BERT_QUALITY)
    g.bert_quality = float(quality) if quality else None
    for r in runs:
        state = trial_state(r)
        g.status[state] = g.status.get(state, 0) + 1
        if metric in r.metrics:
            g.valid_metric.append(r.metrics[metric])
        if state in (TrialState.RUNNING.value, TrialState.KILLED.value):
            g.unfinished.append(_progress(r, state, curves.get(r.run_id, {}).get("valid_bleu", {})))
        if state != "complete":
            continue
        seed = r.tags.get(SEED_TAG, "")
        for split in splits:
            if f"test/{split}/bleu" in r.metrics:
                g.bleu.setdefault(split, {})[seed] = r.metrics[f"test/{split}/bleu"]
                g.chrf.setdefault(split, {})[seed] = r.metrics.get(f"test/{split}/chrf", math.nan)
                g.bp.setdefault(split, {})[seed] = r.metrics.get(f"test/{split}/bp", math.nan)
                g.len_ratio.setdefault(split, {})[seed] = r.metrics.get(f"test/{split}/len_ratio", math.nan)
                g.precisions.setdefault(split, {})[seed] = tuple(
                    r.metrics.get(f"test/{split}/prec{n}", math.nan) for n in range(1, 5))
        curve = {k: list(by_epoch.values()) for k, by_epoch in curves.get(r.run_id, {}).items()}
        history = curve.get("valid_loss", [])
        g.epochs.append(len(history))
        warmup = int(float(r.params.get("train.warmup_updates", 0) or 0))
        g.improving_at_stop.append(loss_still_falling(history, curve.get("num_updates", []), warmup)
                                   or bleu_still_rising(curve.get("valid_bleu", [])))
        g.stopped_by.append(r.tags.get(STOPPED_BY_TAG, "unrecorded"))
        g.curves.append((seed, curve))
        fit = Fit.of(curves.get(r.run_id, {}))
        if fit is not None:
            g.fit.append(fit)
        for name, value in r.metrics.items():
            if name.startswith(DIAGNOSTICS_PREFIX):
                g.diagnostics.setdefault(name[len(DIAGNOSTICS_PREFIX):], []).append(value)
        for name, value in switch_gains(r.metrics).items():
            g.diagnostics.setdefault(name, []).append(value)
        tested = tested_valid_bleu(r.metrics)
        if tested is not None:
            g.valid_tested[seed] = tested
        off = bert_off_valid_bleu(r.metrics)
        if off is not None:
            g.valid_bert_off[seed] = off
        for name in extra:
            if name in r.metrics:  # the run's last logged value
                g.extra.setdefault(name, []).append(r.metrics[name])
        for attr, metric_key in (("updates", "final/num_updates"), ("wall_s", "cost/wall_s"), ("cpu_s", "cost/cpu_s")):
            if metric_key in r.metrics:
                getattr(g, attr).append(r.metrics[metric_key])
        if phased:
            story, tested = _phase_story(r, uri)
            g.phases.append(story)
            if tested:
                g.tested.append(tested)
    complete = [r for r in runs if trial_state(r) == "complete"]
    g.parameters = mean([r.metrics["cost/parameters"] for r in complete if "cost/parameters" in r.metrics])
    g.tokens_per_s = mean([r.metrics["cost/train_tokens_per_s"] for r in complete
                            if "cost/train_tokens_per_s" in r.metrics])
    return g


def _phase_story(run: tracking.RunRecord, uri: str) -> tuple[str, str]:
    """Where a run's phases began, why it stopped and which weights it tested, from its summary.json:
    (``warmup 1, glu 3, finetune 4; end_of_schedule; tested epoch4.pt (last)``, ``epoch4.pt (last)``) (epochs,
    1-based); a run without phases (the control) gives its stop reason and tested weights only."""
    try:
        summary = json.loads(tracking.read_artifact_text(run.run_id, "summary.json", uri))
    except (tracking.TrackingError, OSError, ValueError):
        return "summary.json not found", ""
    starts = summary.get("phase_starts") or {}
    began = ", ".join(f"{name} {epoch}" for name, epoch in sorted(starts.items(), key=lambda kv: kv[1]))
    tested = str(summary.get("final_model") or "")
    story = "; ".join(x for x in (began, str(summary.get("stop_reason", "?"))) if x)
    return story + (f"; tested {tested}" if tested else ""), tested


def _averaging_mismatch(reference: Group, groups: list[Group]) -> list[str]:
    """Phased studies average checkpoints within the last phase only, the control over its whole run: with a
    last phase shorter than ``train.average_last`` the arms test one epoch's weights and the control an average
    (this happened: BERT-JAM at ``train.phase_scale=0.05``, where averaging cost the control 1.0 BLEU). Say so
    wherever the reference and an arm tested different kinds of weights (``Trainer.finalize_model``'s
    ``average of …`` or one checkpoint)."""
    def kinds(g: Group) -> set[str]:
        return {"an average of checkpoints" if tested_file(t) == AVERAGED else "one epoch's weights" for t in g.tested}
    ref = kinds(reference)
    out = []
    for g in groups:
        if g is not reference and kinds(g) and ref and kinds(g) != ref:
            out.append(f"{g.label} tested {' / '.join(sorted(kinds(g)))}, the reference {reference.label} "
                       f"{' / '.join(sorted(ref))}: not like for like (train.average_last against the length of the "
                       "arms' last phase); compare the same kind of weights before reading ΔBLEU")
    return out


def _both_tested(used: tracking.RunRecord, other: tracking.RunRecord, used_in: str, other_in: str,
                 splits: Sequence[str]) -> str:
    """Where a (config, seed) trained twice and both runs tested: their test BLEU side by side, so that a reader
    sees how far two runs of one config and seed part (other code, other machine, nondeterministic kernels)
    beside the Δs the report draws from one of them; "" otherwise."""
    pairs = [(split, used.metrics.get(f"test/{split}/bleu"), other.metrics.get(f"test/{split}/bleu"))
             for split in splits]
    pairs = [(split, a, b) for split, a, b in pairs if a is not None and b is not None]
    if not pairs:
        return ""
    if all(a == b for _, a, b in pairs):
        return "; both test alike: one training, copied into the other sweep"
    return "; both tested, " + ", ".join(f"{split} {a:.2f} in {used_in} and {b:.2f} in {other_in}"
                                         for split, a, b in pairs)


def _find_reference(groups: list[Group], reference: Any) -> Group | None:
    if not groups:
        return None
    if reference is None:
        return groups[0]
    want = {"arm": reference} if isinstance(reference, str) else dict(reference)
    for g in groups:
        if all(k in g.values and _same(g.values[k], v) for k, v in want.items()):
            return g
    return groups[0]


def _compare(ref: Group, g: Group, split: str, uri: str, n: int, seed: int, warnings: list[str],
             rare_mask: Sequence[bool] | None = None) -> Comparison:
    """Paired bootstrap of ``g`` against ``ref`` on the pooled hypotheses of the seeds both completed, and a
    paired t-test across those seeds; with ``rare_mask`` (one seed's sentences with a rare source word), the same
    on those sentences and on the rest (:func:`~nmtcore.sweep.rare_words.compare_parts`)."""
    a, b = ref.bleu.get(split, {}), g.bleu.get(split, {})
    seeds = sorted(set(a) & set(b))
    out = Comparison(pooled_seeds=len(seeds))
    if not seeds:
        return out
    out.delta = statistics.mean(b[s] for s in seeds) - statistics.mean(a[s] for s in seeds)
    if len(seeds) >= 2:
        from scipy import stats

        diffs = [b[s] - a[s] for s in seeds]
        out.p_seeds = 1.0 if all(d == 0 for d in diffs) else float(stats.ttest_1samp(diffs, 0.0).pvalue)
    try:
        hyps_a, hyps_b, refs = pooled_hypotheses(ref, g, split, seeds, uri)
        result = bleu.paired_bootstrap(hyps_a, hyps_b, refs, n_samples=n, seed=seed)
    except (tracking.TrackingError, OSError, ValueError) as e:
        warnings.append(f"{g.label} ({split}): no paired bootstrap ({e})")
        return out
    out.ci_low, out.ci_high = result.ci_diff
    out.p = result.p_value_two_sided
    if rare_mask is not None:
        from nmtcore.sweep import rare_words

        try:
            out.parts = rare_words.compare_parts(hyps_a, hyps_b, refs, rare_mask, n, seed)
        except ValueError as e:
            warnings.append(f"{g.label} ({split}): no comparison by source-word rarity ({e})")
    return out


def pooled_hypotheses(ref: Group, g: Group, split: str, seeds: Sequence[str],
                      uri: str) -> tuple[list[str], list[str], list[str]]:
    """The reference's and ``g``'s hypotheses on ``split`` and the references, ``seeds`` one after another."""
    runs_a = {r.tags.get(SEED_TAG, ""): r for r in ref.runs if trial_state(r) == "complete"}
    runs_b = {r.tags.get(SEED_TAG, ""): r for r in g.runs if trial_state(r) == "complete"}
    hyps_a: list[str] = []
    hyps_b: list[str] = []
    refs: list[str] = []
    for s in seeds:
        name = f"{split}.{runs_a[s].params.get('data.tgt_lang', '')}"
        hyps_a += _lines(tracking.read_artifact_text(runs_a[s].run_id, f"hypotheses/{name}", uri))
        hyps_b += _lines(tracking.read_artifact_text(runs_b[s].run_id, f"hypotheses/{name}", uri))
        refs += _lines(tracking.read_artifact_text(runs_a[s].run_id, f"references/{name}", uri))
    return hyps_a, hyps_b, refs


def _rarity_masks(reference: Group, splits: list[str]) -> tuple[dict[str, list[bool]], str]:
    """Each test split's sentences with a rare source word (:mod:`~nmtcore.sweep.rare_words`), from the data the
    reference's runs name, and ""; or ({}, why there are none)."""
    from nmtcore.sweep import rare_words

    first = next((r for r in reference.runs if trial_state(r) == "complete"), None)
    if first is None:
        return {}, "the reference has no complete trial"
    return rare_words.masks_from_data(first.params, splits)


def _identical_trajectories(groups: list[Group], histories: dict[str, list[float]]) -> list[str]:
    """Different configurations with the same seed and bit-identical validation losses: the varied keys
    never reached the model, the failure mode a sweep platform must not hide."""
    seen: dict[tuple[str, tuple[float, ...]], Group] = {}
    out: list[str] = []
    for g in groups:
        for r in g.runs:
            history = histories.get(r.run_id, [])
            if trial_state(r) != "complete" or not history:
                continue
            other = seen.setdefault((r.tags.get(SEED_TAG, ""), tuple(history)), g)
            if other is not g:
                out.append(f"{other.label} and {g.label} trained identically (same validation loss at every "
                           "epoch): the varied keys did not reach the model")
    return out


# ================================================================================== utilities
def _trial_index(run: tracking.RunRecord) -> int:
    tid = run.tags.get(schema.TUNE_TRIAL_ID, "")
    try:
        return int(tid.rsplit("_", 1)[-1])
    except ValueError:
        return 10**9


def other_dropout(g: Group, ref: Group) -> list[str]:
    """The dropout settings (config keys naming dropout, in both runs' parameters) in which ``g``'s first run
    differs from ``ref``'s, as ``key arm-value against ref-value``: the training NLL is measured in train mode, so
    two runs compare at equal training NLL only under the same dropout. A key only one model has (mask fusion's
    fusion attention) is that model's own part, not a setting of the run."""
    if g is ref or not g.runs or not ref.runs:
        return []
    mine, theirs = g.runs[0].params, ref.runs[0].params
    return [f"{key} {mine[key]} against {theirs[key]}" for key in sorted(set(mine) & set(theirs))
            if "dropout" in key and not _same(_parse(mine[key]), _parse(theirs[key]))]


def _parse(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


def sort_key(v: Any) -> tuple[int, Any]:
    """Numbers in order, then anything else by its text."""
    return (0, float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, str(v))


def mean(xs: list[float]) -> float | None:
    """The mean of the finite values, None if there is none."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def short(key: str) -> str:
    """A config key without its section: ``model.bert.layers`` → ``layers``."""
    return key.rsplit(".", 1)[-1] if key.startswith(("model.", "train.", "data.", "decode.")) else key


def fmt(v: Any) -> str:
    """A value as a table shows it (floats to 4 significant digits)."""
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _lines(text: str) -> list[str]:
    return text.splitlines()
