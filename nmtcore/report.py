"""Sweep reports, from MLflow alone: a paper-style table, a figure for the study, BLEU against cost.

Everything is read back from the sweep's parent run (its study, varied keys, baseline and plot hint,
stored as tags by :mod:`nmtcore.sweep`) and its child runs (test BLEU/chrF, validation metrics, cost
figures, hypotheses and references as artifacts), so a report can be made on any machine that reaches
the tracking store, long after the Ray cluster is gone::

    nmtcore report --sweep bert_size_grid-demo [--out DIR]

* ``table.md`` / ``table.csv``: one row per configuration (seeds pooled): test BLEU and chrF as
  mean ± std over seeds, ΔBLEU and a paired-bootstrap p-value against the baseline (the space's
  named baseline, else the first configuration), the searched validation metric, parameters,
  training tokens/s, wall minutes and CPU hours, and what happened to the trials (done, stopped
  early by ASHA, failed).
* ``heatmap.png`` for two-dimensional grids (BERT layers × hidden: BERT-JAM Table 6 / Fig. 3);
  ``curve.png`` for one-dimensional numeric sweeps (θ, p_net, α); ``bleu_vs_cost.png`` always.
* ``report.json``: the same numbers for machines.

The p-value pools seeds: the hypotheses of every seed both configurations completed are concatenated
(and the references repeated), and the paired bootstrap (:func:`nmtcore.bleu.paired_bootstrap`)
resamples segments of that pooled test set; it is two-sided (H1: the systems differ).

A warning is added when two different configurations trained *identically* (equal validation loss at
every epoch for the same seed): the varied keys then never reached the model, the failure mode a
sweep platform must not hide.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nmtcore import bleu, tracking

CONFIG_KEY_TAG = "nmtcore.config_key"
SEED_TAG = "nmtcore.seed"


@dataclass
class Group:
    """The trials of one configuration (all seeds)."""

    config_key: str
    values: dict[str, Any]  # varied key → value
    runs: list[tracking.RunRecord]
    order: int  # first Tune trial index: the grid's order
    test_bleu: list[float] = field(default_factory=list)
    test_chrf: list[float] = field(default_factory=list)
    valid_metric: list[float] = field(default_factory=list)
    parameters: float | None = None
    tokens_per_s: float | None = None
    wall_s: float | None = None
    cpu_s: float | None = None
    status: dict[str, int] = field(default_factory=dict)
    p_value: float | None = None
    delta_bleu: float | None = None
    pooled_seeds: int = 0

    @property
    def label(self) -> str:
        return ", ".join(f"{_short(k)}={_fmt(v)}" for k, v in self.values.items()) or "base"


@dataclass
class SweepReport:
    sweep: str
    parent_run_id: str
    tracking_uri: str
    study: str
    space: dict[str, Any]
    varied_keys: list[str]
    metric: str
    test_split: str
    groups: list[Group]
    baseline: Group | None
    warnings: list[str]


# ================================================================================== building
def build_report(sweep: str, tracking_uri: str | os.PathLike | None = None, n_bootstrap: int = 1000,
                 bootstrap_seed: int = 12345) -> SweepReport:
    """Collect a sweep's runs from MLflow and compute the table's numbers.

    Args:
        sweep: the sweep's name or its parent run id.
        n_bootstrap: paired-bootstrap samples per comparison (0 = no p-values).
    """
    uri = tracking.resolve_tracking_uri(tracking_uri)
    parent = tracking.find_sweep_run(sweep, uri)
    space = json.loads(parent.tags.get("nmtcore.space_json", "{}") or "{}")
    varied = [k for k in parent.tags.get("nmtcore.varied_keys", "").split(",") if k]
    split = parent.tags.get("nmtcore.test_split", "")
    metric = space.get("metric", "valid_bleu")
    children = tracking.sweep_children(parent.run_id, uri)

    by_key: dict[str, list[tracking.RunRecord]] = {}
    for run in children:
        by_key.setdefault(run.tags.get(CONFIG_KEY_TAG, run.run_id), []).append(run)
    groups = [_group(key, runs, varied, split, metric) for key, runs in by_key.items()]
    groups.sort(key=lambda g: (g.order, g.config_key))
    baseline = _find_baseline(groups, space.get("baseline"))
    warnings: list[str] = []
    if baseline is not None and n_bootstrap > 0:
        for g in groups:
            if g is not baseline:
                _compare(baseline, g, split, uri, n_bootstrap, bootstrap_seed, warnings)
    warnings.extend(_identical_trajectories(groups, uri))
    for g in groups:
        if g.status.get("failed"):
            reasons = {r.tags.get(tracking.FAILURE_REASON_TAG, "") for r in g.runs if r.status == "FAILED"}
            warnings.append(f"{g.label}: {g.status['failed']} trial(s) failed: {'; '.join(sorted(reasons))}")
    return SweepReport(sweep=parent.tags.get(tracking.SWEEP_TAG, sweep), parent_run_id=parent.run_id,
                       tracking_uri=uri, study=parent.tags.get("nmtcore.study", ""), space=space, varied_keys=varied,
                       metric=metric, test_split=split, groups=groups, baseline=baseline, warnings=warnings)


def _group(key: str, runs: list[tracking.RunRecord], varied: list[str], split: str, metric: str) -> Group:
    values = {k: _parse(runs[0].tags.get(f"varied.{k}", "")) for k in varied}
    order = min(_trial_index(r) for r in runs)
    g = Group(config_key=key, values=values, runs=runs, order=order)
    complete = [r for r in runs if _state(r) == "complete"]
    for r in runs:
        state = _state(r)
        g.status[state] = g.status.get(state, 0) + 1
        if metric in r.metrics:
            g.valid_metric.append(r.metrics[metric])
    for r in complete:
        if f"test/{split}/bleu" in r.metrics:
            g.test_bleu.append(r.metrics[f"test/{split}/bleu"])
            g.test_chrf.append(r.metrics.get(f"test/{split}/chrf", math.nan))
    g.parameters = _mean([r.metrics["cost/parameters"] for r in complete if "cost/parameters" in r.metrics])
    g.tokens_per_s = _mean([r.metrics["cost/train_tokens_per_s"] for r in complete
                            if "cost/train_tokens_per_s" in r.metrics])
    g.wall_s = _mean([r.metrics["cost/wall_s"] for r in complete if "cost/wall_s" in r.metrics])
    g.cpu_s = _mean([r.metrics["cost/cpu_s"] for r in complete if "cost/cpu_s" in r.metrics])
    return g


def _state(run: tracking.RunRecord) -> str:
    state = run.tags.get(tracking.TRIAL_STATE_TAG, "")
    if run.status == "FAILED":
        return "failed"
    if state == "complete" and run.status == "FINISHED":
        return "complete"
    if state == "stopped_early":
        return "stopped_early"
    return state or run.status.lower()


def _find_baseline(groups: list[Group], baseline: Any) -> Group | None:
    if not groups:
        return None
    if baseline is None:
        return groups[0]
    want = {"arm": baseline} if isinstance(baseline, str) else dict(baseline)
    for g in groups:
        if all(k in g.values and _same(g.values[k], v) for k, v in want.items()):
            return g
    return groups[0]


def _compare(base: Group, g: Group, split: str, uri: str, n: int, seed: int, warnings: list[str]) -> None:
    """Paired bootstrap of ``g`` against ``base`` on the hypotheses of the seeds both completed."""
    def by_seed(group: Group) -> dict[str, tracking.RunRecord]:
        return {r.tags.get(SEED_TAG, ""): r for r in group.runs if _state(r) == "complete"}

    a, b = by_seed(base), by_seed(g)
    seeds = sorted(set(a) & set(b))
    if not seeds:
        return
    hyps_a: list[str] = []
    hyps_b: list[str] = []
    refs: list[str] = []
    try:
        for s in seeds:
            lang = a[s].params.get("data.tgt_lang", "")
            name = f"{split}.{lang}"
            hyps_a += _lines(tracking.read_artifact_text(a[s].run_id, f"hypotheses/{name}", uri))
            hyps_b += _lines(tracking.read_artifact_text(b[s].run_id, f"hypotheses/{name}", uri))
            refs += _lines(tracking.read_artifact_text(a[s].run_id, f"references/{name}", uri))
        result = bleu.paired_bootstrap(hyps_a, hyps_b, refs, n_samples=n, seed=seed)
    except (tracking.TrackingError, OSError, ValueError) as e:
        warnings.append(f"{g.label}: no paired bootstrap ({e})")
        return
    g.p_value = result.p_value_two_sided
    g.delta_bleu = _mean(g.test_bleu) - _mean(base.test_bleu) if g.test_bleu and base.test_bleu else result.diff
    g.pooled_seeds = len(seeds)


def _identical_trajectories(groups: list[Group], uri: str) -> list[str]:
    """Different configurations with the same seed and bit-identical validation losses."""
    seen: dict[tuple[str, tuple[float, ...]], Group] = {}
    out: list[str] = []
    for g in groups:
        for r in g.runs:
            if _state(r) != "complete":
                continue
            try:
                hist = tracking.get_run_metrics(r.run_id, uri).get("valid_loss", [])
            except tracking.TrackingError:
                continue
            if not hist:
                continue
            sig = (r.tags.get(SEED_TAG, ""), tuple(v for _, v in hist))
            other = seen.setdefault(sig, g)
            if other is not g:
                out.append(f"{other.label} and {g.label} trained identically (same validation loss at every "
                           "epoch): the varied keys did not reach the model")
    return out


# ================================================================================== rendering
def table_rows(report: SweepReport) -> list[dict[str, Any]]:
    """The table as plain rows (also the CSV)."""
    rows = []
    for g in report.groups:
        row: dict[str, Any] = {_short(k): _fmt(v) for k, v in g.values.items()}
        row.update({
            "test BLEU": _pm(g.test_bleu), "chrF": _pm(g.test_chrf),
            "ΔBLEU": "—" if g is report.baseline else (f"{g.delta_bleu:+.2f}" if g.delta_bleu is not None else ""),
            "p": "base" if g is report.baseline else (_p(g.p_value) if g.p_value is not None else ""),
            report.metric: _pm(g.valid_metric),
            "params (M)": f"{g.parameters / 1e6:.2f}" if g.parameters else "",
            "tok/s": f"{g.tokens_per_s:.0f}" if g.tokens_per_s else "",
            "wall (min)": f"{g.wall_s / 60:.1f}" if g.wall_s else "",
            "CPU-h": f"{g.cpu_s / 3600:.2f}" if g.cpu_s else "",
            "trials": ", ".join(f"{n} {s}" for s, n in sorted(g.status.items())),
        })
        rows.append(row)
    return rows


def render_markdown(report: SweepReport) -> str:
    rows = table_rows(report)
    split = report.test_split or "test"
    head = [f"### {report.sweep}: {report.space.get('description') or report.study}",
            "",
            f"Test set `{split}` (sacreBLEU, detokenized). Mean ± std over seeds; p: two-sided paired bootstrap "
            f"against the baseline, seeds pooled. Parent run `{report.parent_run_id}`.",
            ""]
    if not rows:
        return "\n".join(head + ["(no trials)"]) + "\n"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    tail = ["", *[f"- warning: {w}" for w in report.warnings]] if report.warnings else []
    return "\n".join(head + lines + tail) + "\n"


def write_report(report: SweepReport, out_dir: str | os.PathLike) -> list[Path]:
    """Write table.md, table.csv, report.json and the figures into ``out_dir``; returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    md = out / "table.md"
    md.write_text(render_markdown(report), encoding="utf-8")
    files.append(md)
    rows = table_rows(report)
    if rows:
        path = out / "table.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        files.append(path)
    path = out / "report.json"
    path.write_text(json.dumps(_to_json(report), indent=1, default=str), encoding="utf-8")
    files.append(path)
    files += _figures(report, out)
    return files


def make_report(sweep: str, tracking_uri: str | os.PathLike | None = None, out_dir: str | os.PathLike = "report",
                log: bool = True, n_bootstrap: int = 1000) -> list[Path]:
    """Build, write and (``log``) attach the report to the sweep's parent run under ``report/``."""
    report = build_report(sweep, tracking_uri, n_bootstrap=n_bootstrap)
    files = write_report(report, out_dir)
    if log:
        tracking.log_run_artifacts(report.parent_run_id, files, "report", report.tracking_uri)
    return files


# ================================================================================== figures
def _figures(report: SweepReport, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    plot = report.space.get("plot") or {}
    if plot.get("kind") == "heatmap":
        files.append(_heatmap(report, plot["rows"], plot["cols"], out / "heatmap.png", plt))
    elif plot.get("kind") == "curve":
        files.append(_curve(report, plot["x"], out / "curve.png", plt))
    files.append(_cost(report, out / "bleu_vs_cost.png", plt))
    return files


def _heatmap(report: SweepReport, rows_key: str, cols_key: str, path: Path, plt: Any) -> Path:
    rows = sorted({g.values.get(rows_key) for g in report.groups}, key=_sort_key)
    cols = sorted({g.values.get(cols_key) for g in report.groups}, key=_sort_key)
    cell = {(g.values.get(rows_key), g.values.get(cols_key)): g for g in report.groups}
    grid = [[_mean(cell[(r, c)].test_bleu) if (r, c) in cell and cell[(r, c)].test_bleu else math.nan
             for c in cols] for r in rows]
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(cols), 1.2 + 0.9 * len(rows)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            g = cell.get((r, c))
            if g is not None and g.test_bleu:
                sd = f"\n±{statistics.stdev(g.test_bleu):.2f}" if len(g.test_bleu) > 1 else ""
                ax.text(j, i, f"{_mean(g.test_bleu):.2f}{sd}", ha="center", va="center", color="w", fontsize=9)
            elif g is not None:
                ax.text(j, i, "/".join(sorted(g.status)), ha="center", va="center", color="k", fontsize=7)
    ax.set_xticks(range(len(cols)), [_fmt(c) for c in cols])
    ax.set_yticks(range(len(rows)), [_fmt(r) for r in rows])
    ax.set_xlabel(cols_key)
    ax.set_ylabel(rows_key)
    ax.set_title(f"{report.sweep}: test BLEU ({report.test_split})", fontsize="medium", wrap=True)
    fig.colorbar(im, ax=ax, label="BLEU")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long titles stay whole
    plt.close(fig)
    return path


def _curve(report: SweepReport, x_key: str, path: Path, plt: Any) -> Path:
    pts = sorted(((g.values.get(x_key), g) for g in report.groups if g.test_bleu), key=lambda t: _sort_key(t[0]))
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        xs = [float(x) for x, _ in pts]
        ys = [_mean(g.test_bleu) for _, g in pts]
        sds = [statistics.stdev(g.test_bleu) if len(g.test_bleu) > 1 else 0.0 for _, g in pts]
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, label="mean ± std over seeds")
        for x, g in pts:
            ax.scatter([float(x)] * len(g.test_bleu), g.test_bleu, s=10, color="grey", alpha=0.6)
        ax.legend()
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"test BLEU ({report.test_split})")
    ax.set_title(report.sweep)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long titles stay whole
    plt.close(fig)
    return path


def _cost(report: SweepReport, path: Path, plt: Any) -> Path:
    done = [g for g in report.groups if g.test_bleu]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, label, scale in ((axes[0], "parameters", "parameters (M)", 1e6),
                                   (axes[1], "cpu_s", "CPU-hours per trial", 3600.0)):
        pts = [(getattr(g, attr) / scale, _mean(g.test_bleu), g.label) for g in done if getattr(g, attr)]
        for x, y, name in pts:
            ax.scatter([x], [y])
            ax.annotate(name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel(f"test BLEU ({report.test_split})")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.sweep}: BLEU vs cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long titles stay whole
    plt.close(fig)
    return path


# ================================================================================== utilities
def _to_json(report: SweepReport) -> dict[str, Any]:
    groups = []
    for g in report.groups:
        d = {k: v for k, v in asdict(g).items() if k != "runs"}
        d["run_ids"] = [r.run_id for r in g.runs]
        d["label"] = g.label
        d["baseline"] = g is report.baseline
        groups.append(d)
    return {"sweep": report.sweep, "parent_run_id": report.parent_run_id, "study": report.study,
            "space": report.space, "metric": report.metric, "test_split": report.test_split, "groups": groups,
            "warnings": report.warnings}


def _trial_index(run: tracking.RunRecord) -> int:
    tid = run.tags.get("nmtcore.tune_trial_id", "")
    try:
        return int(tid.rsplit("_", 1)[-1])
    except ValueError:
        return 10**9


def _parse(text: str) -> Any:
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-12)
    return str(a) == str(b)


def _sort_key(v: Any) -> tuple[int, Any]:
    return (0, float(v)) if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, str(v))


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return sum(xs) / len(xs) if xs else None


def _pm(xs: list[float]) -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return ""
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}"


def _p(p: float) -> str:
    return f"{p:.3f}" + (" *" if p < 0.05 else "")


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1] if key.startswith(("model.", "train.", "data.", "decode.")) else key


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _lines(text: str) -> list[str]:
    return text.splitlines()
