"""The search-space language: a few domain types keyed by flat dotted config keys.

A study is data, not code: ``{"model.bert.layers": grid([2, 4, 6]), "train.lr": loguniform(1e-4, 1e-3)}``
plus the model it is about, fixed overrides, named *arms* (ablation variants: bundles of overrides)
and a plot hint for the report. :mod:`nmtcore.sweep.ray_backend` is the one adapter that turns a
:class:`SearchSpace` into a Ray Tune search; nothing here imports Ray, torch or the model registry, so
a space can be read and checked anywhere. The studies themselves are data in the top-level
``search_spaces`` package.

Which search algorithm runs follows from the domains: a space made only of :func:`grid` (and
:func:`choice`) dimensions is enumerated exactly; one with any continuous or integer range is sampled
by Optuna's TPE. Mixing :func:`grid` with a range is refused: TPE cannot enumerate a grid (use
:func:`choice` for a categorical dimension of a sampled space).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence, Union

ARM_KEY = "arm"  # the pseudo-key under which named arms are searched


class SpaceError(ValueError):
    """A search space is malformed, names an unregistered model or an unknown config key."""


# ---------------------------------------------------------------------------------- domains
@dataclass(frozen=True)
class Grid:
    """Every value is tried (a Cartesian product with the other grid dimensions)."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class Choice:
    """One value drawn per trial (categorical for Optuna; uniform random for grid searches)."""

    values: tuple[Any, ...]


@dataclass(frozen=True)
class Uniform:
    """A float drawn uniformly from ``[low, high]``."""

    low: float
    high: float


@dataclass(frozen=True)
class LogUniform:
    """A float drawn log-uniformly from ``[low, high]`` (learning rates)."""

    low: float
    high: float


@dataclass(frozen=True)
class IntRange:
    """An integer in ``[low, high]``, both ends included."""

    low: int
    high: int


Domain = Union[Grid, Choice, Uniform, LogUniform, IntRange]
CONTINUOUS = (Uniform, LogUniform, IntRange)


def grid(values: Any) -> Grid:
    """A :class:`Grid` of ``values`` (non-empty, no repeats)."""
    values = tuple(values)
    if not values:
        raise SpaceError("grid() needs at least one value")
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"grid() values must be distinct, got {list(values)}")
    return Grid(values)


def choice(values: Any) -> Choice:
    """A :class:`Choice` among ``values``."""
    values = tuple(values)
    if not values:
        raise SpaceError("choice() needs at least one value")
    return Choice(values)


def uniform(low: float, high: float) -> Uniform:
    """A :class:`Uniform` range (``low < high``)."""
    if not low < high:
        raise SpaceError(f"uniform() needs low < high, got [{low}, {high}]")
    return Uniform(float(low), float(high))


def loguniform(low: float, high: float) -> LogUniform:
    """A :class:`LogUniform` range (``0 < low < high``)."""
    if not 0 < low < high:
        raise SpaceError(f"loguniform() needs 0 < low < high, got [{low}, {high}]")
    return LogUniform(float(low), float(high))


def integer(low: int, high: int) -> IntRange:
    """An :class:`IntRange` ``[low, high]``, both ends included."""
    if not (isinstance(low, int) and isinstance(high, int) and low < high):
        raise SpaceError(f"integer() needs integers low < high, got [{low}, {high}]")
    return IntRange(low, high)


def steps(start: float, stop: float, step: float) -> tuple[float, ...]:
    """``start, start+step, ..., stop`` (inclusive), rounded to kill float noise: ``steps(0, 0.05, 0.01)``."""
    n = int(round((stop - start) / step))
    digits = max(0, -int(math.floor(math.log10(step)))) + 2
    return tuple(round(start + i * step, digits) for i in range(n + 1))


# ---------------------------------------------------------------------------------- plots
@dataclass(frozen=True)
class Heatmap:
    """A rows × cols grid of mean test BLEU (BERT-JAM Table 6 / Fig. 3 for L × H)."""

    rows: str
    cols: str


@dataclass(frozen=True)
class Curve:
    """Test BLEU (mean ± std over seeds) against one numeric key (θ, p_net, α sweeps)."""

    x: str


Plot = Union[Heatmap, Curve, None]


# ---------------------------------------------------------------------------------- the protocol
CONTROL = "control"  # the control arm's label, everywhere (MLflow tags, reports, results/)
CELL_KEY = "cell"  # the pseudo-key under which a grid's cells (control included) are searched


@dataclass(frozen=True)
class Protocol:
    """How a study's arms are trained and what they are compared with (the papers' procedure).

    Args:
        control: add a ``control`` arm: the baseline model (no BERT) trained with exactly the arms'
            budget, schedule and seeds, so that extra training is not mistaken for BERT's effect. The
            report's Δ, confidence interval and p-value are against it.
        warm_start: arms and control start from one converged baseline, trained once per
            (config, data, seed, code) and reused (:mod:`nmtcore.sweep.baseline`), as BERT-fused, the
            document-context and the mask-fusion papers do; ``False`` = every arm from scratch (BERT-JAM
            and PLM-sponsored train from scratch in their papers), said in the report.
        baseline_model: the registered model of the baseline and the control.
        baseline_budget: the baseline's own training overrides (``train.max_epochs``, ``train.patience``...)
            on top of the base experiment; the arms' budget is the space's ``budget``.
    """

    control: bool = True
    warm_start: bool = True
    baseline_model: str = "transformer"
    baseline_budget: Mapping[str, Any] = field(default_factory=dict)

    def control_overrides(self) -> dict[str, Any]:
        """What turns a study's base experiment into the control: the baseline model, no BERT."""
        return {"model.name": self.baseline_model, "model.bert.name": "", "model.bert.layers": 0,
                "model.bert.hidden": 0}


@dataclass(frozen=True)
class Cell:
    """One configuration of a grid study: a label, the varied values (empty for the control) and the
    flat overrides that make it."""

    label: str
    point: Mapping[str, Any]
    overrides: Mapping[str, Any]
    control: bool = False


def point_label(point: Mapping[str, Any]) -> str:
    """A readable name of a point: ``layers=2 hidden=128``; an arm is its own name."""
    parts = [str(v) if k == ARM_KEY else f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in point.items()]
    return " ".join(parts) or "base"


def _fmt(v: Any) -> str:
    item = getattr(v, "item", None)
    v = item() if callable(item) and not isinstance(v, (list, tuple, dict, str)) else v
    return f"{v:.4g}" if isinstance(v, float) else str(v)


# ---------------------------------------------------------------------------------- predictions
# What a prediction may bound: the arm's ΔBLEU against the control on a test set (``bleu:<test set>``, mean over
# seeds), or its NLL at each run's lowest validation NLL against the control's (``fit:train_nll``,
# ``fit:valid_nll``; bits per target token, nmtcore.sweep.results.Fit).
BLEU_MEASURE = "bleu:"  # + a test set
FIT_MEASURES = {"fit:train_nll": "train_at_best", "fit:valid_nll": "valid_at_best"}  # measure -> Fit's field


@dataclass(frozen=True)
class Prediction:
    """What one arm will do against the control (or another arm), written down before any run of its study: the
    study's report checks it on the runs and says whether it held (``nmtcore.sweep.results.check_predictions``).

    Args:
        arm: the arm it is about.
        measure: ``bleu:<test set>`` (the arm's ΔBLEU against ``against``), ``fit:train_nll`` or
            ``fit:valid_nll`` (the arm's NLL minus ``against``'s, each at its lowest validation NLL).
        at_least / at_most: the bound(s) the measure is predicted to keep (one or both).
        written: when it was written (``YYYY-MM-DD HH:MM``), before any run of the study: the time of the commit
            that first recorded it, which ``git log`` can confirm.
        hypothesis: what it tests, in a sentence.
        against: what the arm is compared with: the control, or an arm by name, of this study or of a sweep its
            report pools (a follow-up's arm against the original study's).
    """

    arm: str
    measure: str
    at_least: float | None = None
    at_most: float | None = None
    written: str = ""
    hypothesis: str = ""
    against: str = CONTROL

    def __post_init__(self) -> None:
        if self.measure not in FIT_MEASURES and not self.test_split:
            raise SpaceError(f"prediction for {self.arm!r}: measure {self.measure!r} is none of "
                             "bleu:<test set>, fit:train_nll, fit:valid_nll")
        if self.at_least is None and self.at_most is None:
            raise SpaceError(f"prediction for {self.arm!r} ({self.measure}): give at_least, at_most or both")
        if self.at_least is not None and self.at_most is not None and self.at_least > self.at_most:
            raise SpaceError(f"prediction for {self.arm!r} ({self.measure}): at_least {self.at_least} > at_most "
                             f"{self.at_most}")
        if not self.written:
            raise SpaceError(f"prediction for {self.arm!r} ({self.measure}): say when it was written (written=...)")
        if self.against == self.arm:
            raise SpaceError(f"prediction for {self.arm!r} ({self.measure}): an arm against itself")

    @property
    def test_split(self) -> str:
        """The test set of a ``bleu:`` measure; "" for the others."""
        return self.measure[len(BLEU_MEASURE):] if self.measure.startswith(BLEU_MEASURE) else ""

    def bound(self) -> str:
        """``≥ -0.30``, ``≤ 0.00`` or ``in [-0.30, +0.50]``."""
        if self.at_most is None:
            return f"≥ {self.at_least:+.2f}"
        if self.at_least is None:
            return f"≤ {self.at_most:+.2f}"
        return f"in [{self.at_least:+.2f}, {self.at_most:+.2f}]"

    def holds(self, value: float) -> bool:
        """Whether ``value`` keeps the bound(s)."""
        return ((self.at_least is None or value >= self.at_least)
                and (self.at_most is None or value <= self.at_most))

    def describe(self) -> dict[str, Any]:
        """JSON-friendly, as the sweep records it with its space."""
        return {"arm": self.arm, "measure": self.measure, "at_least": self.at_least, "at_most": self.at_most,
                "written": self.written, "hypothesis": self.hypothesis, "against": self.against}

    @classmethod
    def from_description(cls, d: Mapping[str, Any]) -> "Prediction":
        """The inverse of :meth:`describe` (a sweep's recorded space)."""
        return cls(**{k: d.get(k) for k in ("arm", "measure", "at_least", "at_most")},
                   written=d.get("written") or "", hypothesis=d.get("hypothesis") or "",
                   against=d.get("against") or CONTROL)


# ---------------------------------------------------------------------------------- the space
@dataclass(frozen=True)
class SearchSpace:
    """One study variant: what is varied, around which model, judged by which metric.

    Args:
        study: the study's name (its module in :mod:`search_spaces`).
        variant: this variant's name (``"full"``, ``"demo"``, ``"paper"``, ``"optuna"``...).
        model: the registered model name the study is about, set as ``model.name`` on every trial;
            ``None`` keeps the base config's model. Entry points may override it (``--model``).
        params: flat dotted config key → domain.
        arms: named bundles of flat overrides, searched as a grid (ablations M0–M3). The first arm
            is the reference unless ``reference`` says otherwise (studies without a control).
        fixed: flat overrides applied to every trial (e.g. clearing ``model.bert.name`` so a size
            can be set).
        metric / mode: what early stopping and Optuna optimise (per-epoch validation metric).
        num_samples: trials Optuna draws (sampled spaces only).
        early_stopping: whether ASHA is on by default for this space.
        reference: without a control arm, the configuration the report compares with: an arm name or
            a mapping of flat key → value; ``None`` = the first configuration of the grid.
        plot: the report's figure for this study.
        description / citation: shown in the MLflow parent run and the report.
        defaults: the study's own defaults for the base experiment (e.g. its BERT: ``model.bert.name``),
            applied before the user's ``--set``, which therefore wins; smoke tests keep them too.
        budget: the arms' run budget and schedule (``train.max_epochs``, ``train.lr``...), applied by
            the entry points to the base config *before* the user's ``--set``, which therefore wins.
        budgets: named budgets an entry point may run instead (``--budget quick``: :meth:`with_budget`);
            the one equal to ``budget`` is the default.
        protocol: how arms are trained and compared (:class:`Protocol`); ``None`` = plain trials, compared
            with ``reference`` (a study that tunes the baseline itself).
        report_metrics: per-epoch metrics the trials log that the report shows per arm beside BLEU (their
            last epoch's value, mean over seeds): e.g. the θ study's ``valid_masked_fraction``.
        arm_overrides: the user's overrides of keys that only the arms' model has (``--set model.tgt_bert.layers=4``
            over a study whose control is a Transformer: :meth:`with_arm_overrides`), applied to every trial but
            the control, last (after the arm's own bundle: the user's value wins, as ``--set`` does elsewhere).
        predictions: what arms will do against the control, written before any run (:class:`Prediction`):
            recorded with the sweep, checked by its report.
    """

    study: str
    variant: str
    model: str | None
    params: Mapping[str, Domain] = field(default_factory=dict)
    arms: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    metric: str = "valid_bleu"
    mode: str = "max"
    num_samples: int = 16
    early_stopping: bool = False
    reference: str | Mapping[str, Any] | None = None
    plot: Plot = None
    description: str = ""
    citation: str = ""
    budget: Mapping[str, Any] = field(default_factory=dict)
    budgets: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)
    protocol: Protocol | None = None
    report_metrics: tuple[str, ...] = ()
    arm_overrides: Mapping[str, Any] = field(default_factory=dict)
    predictions: tuple[Prediction, ...] = ()

    def __post_init__(self) -> None:
        name = self.name
        if not self.params and not self.arms:
            raise SpaceError(f"{name}: a space needs params or arms")
        if ARM_KEY in self.params:
            raise SpaceError(f"{name}: {ARM_KEY!r} is reserved for arms")
        for key, dom in self.params.items():
            if not isinstance(dom, (Grid, Choice, Uniform, LogUniform, IntRange)):
                raise SpaceError(f"{name}: {key}: expected a domain (grid, choice, uniform, loguniform, "
                                 f"integer), got {dom!r}")
            if key in self.fixed:
                raise SpaceError(f"{name}: {key} is both varied and fixed")
            if key in self.arm_overrides:
                raise SpaceError(f"{name}: {key} is varied by the study: it cannot be set for every arm")
        for arm, overrides in self.arms.items():
            clash = set(overrides) & set(self.params)
            if clash:
                raise SpaceError(f"{name}: arm {arm!r} sets varied key(s) {sorted(clash)}")
        if self.sampled and any(isinstance(d, Grid) for d in self.params.values()):
            raise SpaceError(f"{name}: grid() cannot be mixed with sampled ranges (Optuna cannot enumerate "
                             "a grid); use choice() for categorical dimensions")
        if self.mode not in ("min", "max"):
            raise SpaceError(f"{name}: mode must be 'min' or 'max', got {self.mode!r}")
        if isinstance(self.reference, str) and self.reference not in self.arms:
            raise SpaceError(f"{name}: reference arm {self.reference!r} is not an arm ({', '.join(self.arms)})")
        if CONTROL in self.arms:
            raise SpaceError(f"{name}: {CONTROL!r} is reserved for the protocol's control arm")
        if self.num_samples < 1:
            raise SpaceError(f"{name}: num_samples must be >= 1")
        for pred in self.predictions:
            if pred.arm not in self.arms:
                raise SpaceError(f"{name}: a prediction names arm {pred.arm!r}, not an arm ({', '.join(self.arms)})")
            if pred.against == CONTROL and (self.protocol is None or not self.protocol.control):
                raise SpaceError(f"{name}: a prediction compares {pred.arm} with the control, and this study has none")

    # ------------------------------------------------------------------ views
    @property
    def name(self) -> str:
        return f"{self.study}:{self.variant}"

    @property
    def sampled(self) -> bool:
        """True if any dimension is a range: the adapter then uses Optuna (TPE) instead of a grid."""
        return any(isinstance(d, CONTINUOUS) for d in self.params.values())

    @property
    def varied_keys(self) -> tuple[str, ...]:
        """The dimensions a report tabulates: params, then ``arm`` if there are arms."""
        return tuple(self.params) + ((ARM_KEY,) if self.arms else ())

    def config_keys(self) -> tuple[str, ...]:
        """Every flat config key this space may set (params, fixed, arm overrides)."""
        keys = dict.fromkeys([*self.params, *self.fixed])
        for overrides in self.arms.values():
            keys.update(dict.fromkeys(overrides))
        keys.update(dict.fromkeys(self.arm_overrides))
        return tuple(keys)

    def grid_size(self) -> int | None:
        """Number of configurations of a pure grid (choices count once per sample), else None."""
        if self.sampled:
            return None
        n = max(1, len(self.arms))
        for d in self.params.values():
            if isinstance(d, Grid):
                n *= len(d.values)
        return n

    def grid_points(self) -> list[dict[str, Any]]:
        """All configurations of the grid dimensions (and arms), in order; choices take their first value."""
        dims: list[tuple[str, tuple[Any, ...]]] = []
        for key, dom in self.params.items():
            if isinstance(dom, Grid):
                dims.append((key, dom.values))
            elif isinstance(dom, Choice):
                dims.append((key, dom.values[:1]))
            else:
                raise SpaceError(f"{self.name}: {key} is a range; a sampled space has no grid points")
        if self.arms:
            dims.append((ARM_KEY, tuple(self.arms)))
        return [dict(zip([k for k, _ in dims], combo)) for combo in itertools.product(*[v for _, v in dims])]

    def cells(self) -> list[Cell]:
        """The configurations of a grid study in order: the control first (when the protocol has one),
        then every grid point. A sampled space's cells are its control only (Optuna samples the rest)."""
        out: list[Cell] = []
        if self.protocol is not None and self.protocol.control:
            control = {k: v for k, v in self.fixed.items() if not k.startswith("model.")}  # trained the same way
            out.append(Cell(CONTROL, {}, {**control, **self.protocol.control_overrides()}, control=True))
        if not self.sampled:
            for point in self.grid_points():
                out.append(Cell(point_label(point), point, self.overrides(point)))
        return out

    def example_points(self) -> list[dict[str, Any]]:
        """Points that together touch every value (grid) or both ends of every range: for validation."""
        if not self.sampled:
            return self.grid_points()
        low, high = {}, {}
        for key, dom in self.params.items():
            if isinstance(dom, Choice):
                low[key], high[key] = dom.values[0], dom.values[-1]
            else:
                low[key], high[key] = dom.low, dom.high
        points = []
        for arm in (list(self.arms) or [None]):
            for p in (low, high):
                points.append({**p, **({ARM_KEY: arm} if arm is not None else {})})
        return points

    def overrides(self, point: Mapping[str, Any]) -> dict[str, Any]:
        """Flat config overrides of one sampled point: fixed, then the arm's bundle, then the params, then the
        user's :attr:`arm_overrides`."""
        out: dict[str, Any] = {}
        if self.model is not None:
            out["model.name"] = self.model
        out.update(self.fixed)
        if self.arms:
            arm = point.get(ARM_KEY)
            if arm not in self.arms:
                raise SpaceError(f"{self.name}: unknown arm {arm!r} (arms: {', '.join(self.arms)})")
            out.update(self.arms[arm])
        for key in self.params:
            if key not in point:
                raise SpaceError(f"{self.name}: sample lacks {key}")
            out[key] = point[key]
        out.update(self.arm_overrides)
        return out

    def reference_point(self) -> dict[str, Any] | None:
        """The reference as a partial point (``{"arm": "M0"}`` or key → value), None = first configuration."""
        if self.reference is None:
            return None
        if isinstance(self.reference, str):
            return {ARM_KEY: self.reference}
        return dict(self.reference)

    # ------------------------------------------------------------------ derived spaces
    def with_model(self, model: str | None) -> "SearchSpace":
        """The same study around another model (``--model``)."""
        return replace(self, model=model)

    @property
    def budget_name(self) -> str:
        """The name of the budget this space runs (a key of ``budgets``), or "" for an unnamed one."""
        return next((name for name, b in self.budgets.items() if dict(b) == dict(self.budget)), "")

    def with_budget(self, name: str) -> "SearchSpace":
        """The same study on its named budget ``name``; a budget other than the default names the variant
        ``<variant>-<name>`` (its sweep, results and report stay apart from the default's)."""
        if name not in self.budgets:
            raise SpaceError(f"{self.name}: no budget {name!r} (budgets: {', '.join(self.budgets) or 'none'})")
        if dict(self.budgets[name]) == dict(self.budget):
            return self
        return replace(self, variant=f"{self.variant}-{name}", budget=self.budgets[name])

    def with_arms(self, names: Sequence[str]) -> "SearchSpace":
        """The same study with only the arms ``names`` (``--arms``), in the study's order, under the variant
        ``<variant>-<arm>+<arm>...`` so its sweep stays apart from the whole study's. The control stays (a study
        whose protocol has one, and is the reference if the reference arm is left out); a study without one keeps
        its reference arm. Runs of the two sweeps report
        together: ``nmtcore report --sweep <whole> --sweep <subset>`` (a run in both counts once)."""
        if not names:
            return self
        if not self.arms:
            raise SpaceError(f"{self.name}: --arms selects arms, and this study varies {', '.join(self.params)}")
        unknown = [n for n in names if n not in self.arms]
        if unknown:
            raise SpaceError(f"{self.name}: no arm {', '.join(map(repr, unknown))} (arms: {', '.join(self.arms)})")
        kept = [n for n in self.arms if n in names]
        has_control = self.protocol is not None and self.protocol.control
        if not has_control and isinstance(self.reference, str) and self.reference not in kept:
            raise SpaceError(f"{self.name}: the study has no control and compares with its arm {self.reference!r}: "
                             f"add it to --arms")
        # A study with a control whose reference arm is left out compares with the control (BERT-JAM's M1 and M2
        # without M0: the whole study's reference row comes back in a report pooled with M0's sweep).
        reference = self.reference if not isinstance(self.reference, str) or self.reference in kept else None
        return replace(self, variant=f"{self.variant}-{'+'.join(kept)}", arms={n: self.arms[n] for n in kept},
                       reference=reference, predictions=tuple(p for p in self.predictions if p.arm in kept))

    def with_arm_overrides(self, overrides: Mapping[str, Any]) -> "SearchSpace":
        """The same study with ``overrides`` set on every trial but the control (:attr:`arm_overrides`): keys
        of the arms' model that the base config's model lacks, which ``--set`` cannot reach through it."""
        if not overrides:
            return self
        return replace(self, arm_overrides={**self.arm_overrides, **overrides})

    def shrunk(self, n_trials: int = 2) -> "SearchSpace":
        """A smoke-test version with at most ``n_trials`` configurations: the first grid dimension keeps
        its first ``n_trials`` values, other grid dimensions and the arms their first; a sampled space
        draws ``n_trials`` samples."""
        if self.sampled:
            return replace(self, variant=f"{self.variant}-smoke", num_samples=n_trials)
        params: dict[str, Domain] = {}
        budget = n_trials
        for key, dom in self.params.items():
            if isinstance(dom, Grid):
                keep = max(1, min(budget, len(dom.values)))
                params[key] = Grid(dom.values[:keep])
                budget = max(1, budget // keep)
            else:
                params[key] = dom
        arms = dict(self.arms)
        if arms:
            names = list(arms)[: max(1, budget)]
            arms = {a: arms[a] for a in names}
        reference = self.reference if not isinstance(self.reference, str) or self.reference in arms else None
        return replace(self, variant=f"{self.variant}-smoke", params=params, arms=arms, reference=reference,
                       predictions=tuple(p for p in self.predictions if p.arm in arms))

    def describe(self) -> dict[str, Any]:
        """JSON-friendly summary for the MLflow parent run."""
        def dom(d: Domain) -> Any:
            if isinstance(d, (Grid, Choice)):
                return {type(d).__name__.lower(): list(d.values)}
            return {type(d).__name__.lower(): [d.low, d.high]}

        plot: Any = None
        if isinstance(self.plot, Heatmap):
            plot = {"kind": "heatmap", "rows": self.plot.rows, "cols": self.plot.cols}
        elif isinstance(self.plot, Curve):
            plot = {"kind": "curve", "x": self.plot.x}
        return {"space": self.name, "model": self.model, "params": {k: dom(d) for k, d in self.params.items()},
                "arms": {k: dict(v) for k, v in self.arms.items()}, "fixed": dict(self.fixed),
                "metric": self.metric, "mode": self.mode, "sampled": self.sampled,
                "num_samples": self.num_samples if self.sampled else self.grid_size(),
                "reference": self.reference if not isinstance(self.reference, Mapping) else dict(self.reference),
                "protocol": None if self.protocol is None else {
                    "control": self.protocol.control, "warm_start": self.protocol.warm_start,
                    "baseline_model": self.protocol.baseline_model,
                    "baseline_budget": dict(self.protocol.baseline_budget)},
                "plot": plot, "description": self.description, "citation": self.citation,
                "budget": dict(self.budget), "budget_name": self.budget_name, "defaults": dict(self.defaults),
                "report_metrics": list(self.report_metrics),
                **({"arm_overrides": dict(self.arm_overrides)} if self.arm_overrides else {}),
                **({"predictions": [p.describe() for p in self.predictions]} if self.predictions else {})}
