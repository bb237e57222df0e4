"""A sweep report's figures (matplotlib, written as PNG): the study's own figure and BLEU against cost.

* ``heatmap.png`` for two-dimensional grids (BERT layers × hidden: BERT-JAM Table 6 / Fig. 3): each cell's
  ΔBLEU against the control (diverging colours around 0; ``*`` where the 95% interval excludes 0) with its
  mean BLEU, or its BLEU where the study has no control;
* ``curve.png`` for one-dimensional numeric sweeps (θ, p_net, α): BLEU (mean ± sd over seeds) against the
  key, the control as a horizontal band;
* ``bleu_vs_cost.png`` always;
* ``valid_curves.png``: every run's validation BLEU (and loss) per epoch, arms and control on one plot, with its
  training against its validation NLL where the runs logged both, and where each phase of a phased run begins.

One figure per test set would repeat the story; the figures use the report's first test set.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from nmtcore.sweep.results import SweepReport, sort_key


def figures(report: SweepReport, out: Path) -> list[Path]:
    """Draw the figures of ``report`` into ``out``; returns the files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    plot = report.space.get("plot") or {}
    if report.test_splits and plot.get("kind") == "heatmap":
        files.append(_heatmap(report, plot["rows"], plot["cols"], out / "heatmap.png", plt))
    elif report.test_splits and plot.get("kind") == "curve":
        files.append(_curve(report, plot["x"], out / "curve.png", plt))
    if report.test_splits:
        files.append(_cost(report, out / "bleu_vs_cost.png", plt))
    if any(c for g in report.groups for _, c in g.curves):
        files.append(_valid_curves(report, out / "valid_curves.png", plt))
    return files


def _valid_curves(report: SweepReport, path: Path, plt: Any) -> Path:
    """Validation BLEU and loss against the epoch, one colour per arm (the control black), one line per seed; a
    third panel, where the runs logged them, the training NLL (dashed) beside the validation NLL (solid): a run
    whose training NLL falls below another's while its validation NLL rises above it overfits. A phased run's
    phases begin where its BLEU curve has a bar."""
    from matplotlib.ticker import MaxNLocator

    arms = [g for g in report.groups if g.curves]
    nll = any(curve.get("train_nll") and curve.get("valid_nll") for g in arms for _, curve in g.curves)
    fig, axes = plt.subplots(1, 3 if nll else 2, figsize=(18 if nll else 12, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    phased, top = False, 0.0  # top: the NLL panel's highest value after the first two epochs (they dwarf the rest)
    for i, g in enumerate(arms):
        colour = "k" if g.control else colours[i % len(colours)]
        for j, (seed, curve) in enumerate(g.curves):
            for ax, key in ((axes[0], "valid_bleu"), (axes[1], "valid_loss")):
                ys = curve.get(key) or []
                if ys:
                    ax.plot(range(1, len(ys) + 1), ys, color=colour, marker=".", alpha=0.85,
                            label=g.label if j == 0 else None)
            bleu, phase = curve.get("valid_bleu") or [], curve.get("phase") or []
            starts = [e for e in range(1, min(len(phase), len(bleu))) if phase[e] != phase[e - 1]]
            if starts:
                phased = True
                axes[0].plot([e + 1 for e in starts], [bleu[e] for e in starts], linestyle="none", marker="|",
                             markersize=16, markeredgewidth=2, color=colour)
            if nll:
                for key, style in (("train_nll", "--"), ("valid_nll", "-")):
                    ys = curve.get(key) or []
                    if ys:
                        axes[2].plot(range(1, len(ys) + 1), ys, color=colour, linestyle=style, alpha=0.85)
                        top = max([top, *ys[2:]])
    labels = ["validation BLEU (greedy)" + ("; | a phase begins" if phased else ""), "validation loss (bits)"]
    if nll:
        labels.append("NLL (bits/token): training --, validation —")
    for ax, label in zip(axes, labels):
        ax.set_xlabel("epoch of the run")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if nll and top > 0:
        axes[2].set_ylim(top=top * 1.05)
    if arms:
        axes[0].legend(fontsize=8)
    fig.suptitle(f"{report.sweep}: validation curves, every run")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _mean(values: Any) -> float | None:
    values = list(values)
    return statistics.mean(values) if values else None


def _heatmap(report: SweepReport, rows_key: str, cols_key: str, path: Path, plt: Any) -> Path:
    split = report.test_splits[0]
    arms = [g for g in report.groups if not g.control]
    rows = sorted({g.values.get(rows_key) for g in arms}, key=sort_key)
    cols = sorted({g.values.get(cols_key) for g in arms}, key=sort_key)
    cell = {(g.values.get(rows_key), g.values.get(cols_key)): g for g in arms}
    by_delta = report.reference is not None and report.reference.control

    def value(g: Any) -> float:
        if g is None or not g.bleu.get(split):
            return float("nan")
        c = g.comparisons.get(split)
        if by_delta:
            return c.delta if c is not None and c.delta is not None else float("nan")
        return _mean(g.bleu[split].values())

    grid = [[value(cell.get((r, c))) for c in cols] for r in rows]
    finite = [abs(v) for row in grid for v in row if v == v]
    fig, ax = plt.subplots(figsize=(1.8 + 1.7 * len(cols), 1.4 + 1.0 * len(rows)))
    if by_delta:
        lim = max(finite + [0.1])
        im = ax.imshow(grid, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto", origin="lower")
    else:
        im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    for i, r in enumerate(rows):
        for j, c in enumerate(cols):
            g = cell.get((r, c))
            if g is None:
                continue
            if not g.bleu.get(split):
                ax.text(j, i, "/".join(sorted(g.status)), ha="center", va="center", color="k", fontsize=7)
                continue
            bleu = _mean(g.bleu[split].values())
            comp = g.comparisons.get(split)
            if by_delta and comp is not None and comp.delta is not None:
                text = f"{comp.delta:+.2f}{'*' if comp.significant else ''}\n({bleu:.2f})"
            else:
                text = f"{bleu:.2f}"
            ax.text(j, i, text, ha="center", va="center", color="k", fontsize=9)
    ax.set_xticks(range(len(cols)), [str(c) for c in cols])
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(cols_key)
    ax.set_ylabel(rows_key)
    if by_delta:
        ref = _mean(report.reference.bleu.get(split, {}).values())
        title = (f"{report.sweep}: ΔBLEU vs control ({ref:.2f} BLEU) on {split}\n"
                 "* = 95% CI excludes 0; (cell BLEU)" if ref is not None else f"{report.sweep}: ΔBLEU vs control")
    else:
        title = f"{report.sweep}: test BLEU ({split})"
    ax.set_title(title, fontsize="medium", wrap=True)
    fig.colorbar(im, ax=ax, label="ΔBLEU vs control" if by_delta else "BLEU")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")  # long titles stay whole
    plt.close(fig)
    return path


def _curve(report: SweepReport, x_key: str, path: Path, plt: Any) -> Path:
    split = report.test_splits[0]
    pts = sorted(((g.values[x_key], g) for g in report.groups  # an arm of another study may not vary x_key
                  if not g.control and g.bleu.get(split) and g.values.get(x_key) is not None),
                 key=lambda t: sort_key(t[0]))
    fig, ax = plt.subplots(figsize=(6, 4))
    if pts:
        xs = [float(x) for x, _ in pts]
        ys = [_mean(g.bleu[split].values()) for _, g in pts]
        sds = [statistics.stdev(g.bleu[split].values()) if len(g.bleu[split]) > 1 else 0.0 for _, g in pts]
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, label="mean ± sd over seeds")
        for x, g in pts:
            ax.scatter([float(x)] * len(g.bleu[split]), list(g.bleu[split].values()), s=10, color="grey", alpha=0.6)
    control = report.reference if report.reference is not None and report.reference.control else None
    if control is not None and control.bleu.get(split):
        values = list(control.bleu[split].values())
        mean, sd = _mean(values), statistics.stdev(values) if len(values) > 1 else 0.0
        ax.axhline(mean, color="k", linestyle="--", label="control")
        if sd:
            ax.axhspan(mean - sd, mean + sd, color="k", alpha=0.1)
    if pts or control is not None:
        ax.legend()
    ax.set_xlabel(x_key)
    ax.set_ylabel(f"test BLEU ({split})")
    ax.set_title(report.sweep)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _cost(report: SweepReport, path: Path, plt: Any) -> Path:
    split = report.test_splits[0]
    done = [g for g in report.groups if g.bleu.get(split)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, label, scale, get in ((axes[0], "parameters (M)", 1e6, lambda g: g.parameters),
                                  (axes[1], "CPU-hours per trial", 3600.0, lambda g: _mean(g.cpu_s))):
        for g in done:
            x = get(g)
            if x:
                y = _mean(g.bleu[split].values())
                ax.scatter([x / scale], [y], marker="s" if g.control else "o")
                ax.annotate(g.label, (x / scale, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(label)
        ax.set_ylabel(f"test BLEU ({split})")
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report.sweep}: BLEU vs cost")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
