"""The search-space language: a few domain types keyed by flat dotted config keys.

A study is data, not code: ``{"model.bert.layers": grid([2, 4, 6]), "train.lr": loguniform(1e-4, 1e-3)}``
plus the model it is about, fixed overrides, named *arms* (ablation variants: bundles of overrides)
and a plot hint for the report. :mod:`nmtcore.sweep` is the one adapter that turns a
:class:`SearchSpace` into a Ray Tune search; nothing here imports Ray, torch or the model registry, so
a space can be read and checked anywhere.

Which search algorithm runs follows from the domains: a space made only of :func:`grid` (and
:func:`choice`) dimensions is enumerated exactly; one with any continuous or integer range is sampled
by Optuna's TPE. Mixing :func:`grid` with a range is refused: TPE cannot enumerate a grid (use
:func:`choice` for a categorical dimension of a sampled space).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Union

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
    low: float
    high: float


@dataclass(frozen=True)
class LogUniform:
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
    values = tuple(values)
    if not values:
        raise SpaceError("grid() needs at least one value")
    if len(set(map(repr, values))) != len(values):
        raise SpaceError(f"grid() values must be distinct, got {list(values)}")
    return Grid(values)


def choice(values: Any) -> Choice:
    values = tuple(values)
    if not values:
        raise SpaceError("choice() needs at least one value")
    return Choice(values)


def uniform(low: float, high: float) -> Uniform:
    if not low < high:
        raise SpaceError(f"uniform() needs low < high, got [{low}, {high}]")
    return Uniform(float(low), float(high))


def loguniform(low: float, high: float) -> LogUniform:
    if not 0 < low < high:
        raise SpaceError(f"loguniform() needs 0 < low < high, got [{low}, {high}]")
    return LogUniform(float(low), float(high))


def integer(low: int, high: int) -> IntRange:
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
            is the baseline unless ``baseline`` says otherwise.
        fixed: flat overrides applied to every trial (e.g. clearing ``model.bert.name`` so a size
            can be set).
        metric / mode: what early stopping and Optuna optimise (per-epoch validation metric).
        num_samples: trials Optuna draws (sampled spaces only).
        early_stopping: whether ASHA is on by default for this space.
        baseline: the reference configuration of the report's p-values: an arm name or a mapping
            of flat key → value; ``None`` = the first configuration of the grid.
        plot: the report's figure for this study.
        description / citation: shown in the MLflow parent run and the report.
        budget: the variant's default run budget (``train.max_epochs``...), applied by the entry
            points to the base config *before* the user's ``--set``, which therefore wins.
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
    baseline: str | Mapping[str, Any] | None = None
    plot: Plot = None
    description: str = ""
    citation: str = ""
    budget: Mapping[str, Any] = field(default_factory=dict)

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
        for arm, overrides in self.arms.items():
            clash = set(overrides) & set(self.params)
            if clash:
                raise SpaceError(f"{name}: arm {arm!r} sets varied key(s) {sorted(clash)}")
        if self.sampled and any(isinstance(d, Grid) for d in self.params.values()):
            raise SpaceError(f"{name}: grid() cannot be mixed with sampled ranges (Optuna cannot enumerate "
                             "a grid); use choice() for categorical dimensions")
        if self.mode not in ("min", "max"):
            raise SpaceError(f"{name}: mode must be 'min' or 'max', got {self.mode!r}")
        if isinstance(self.baseline, str) and self.baseline not in self.arms:
            raise SpaceError(f"{name}: baseline arm {self.baseline!r} is not an arm ({', '.join(self.arms)})")
        if self.num_samples < 1:
            raise SpaceError(f"{name}: num_samples must be >= 1")

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
        """Flat config overrides of one sampled point: fixed, then the arm's bundle, then the params."""
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
        return out

    def baseline_point(self) -> dict[str, Any] | None:
        """The baseline as a partial point (``{"arm": "M0"}`` or key → value), None = first configuration."""
        if self.baseline is None:
            return None
        if isinstance(self.baseline, str):
            return {ARM_KEY: self.baseline}
        return dict(self.baseline)

    # ------------------------------------------------------------------ derived spaces
    def with_model(self, model: str | None) -> "SearchSpace":
        """The same study around another model (``--model``)."""
        return replace(self, model=model)

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
        baseline = self.baseline if not isinstance(self.baseline, str) or self.baseline in arms else None
        return replace(self, variant=f"{self.variant}-smoke", params=params, arms=arms, baseline=baseline)

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
                "baseline": self.baseline if not isinstance(self.baseline, Mapping) else dict(self.baseline),
                "plot": plot, "description": self.description, "citation": self.citation,
                "budget": dict(self.budget)}
