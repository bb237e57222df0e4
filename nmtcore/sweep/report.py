"""Sweep reports, from MLflow alone: a paper-style table per test set, the study's figure, BLEU against cost.

Everything is read back from the sweep's parent run (its study, varied keys, protocol, test sets and plot
hint, stored as tags by :mod:`nmtcore.sweep.driver`) and its child runs (test BLEU/chrF, validation
histories, cost figures, hypotheses and references as artifacts), so a report can be made on any machine
that reaches the tracking store, long after the Ray cluster is gone::

    nmtcore report --sweep bert_size_grid-demo [--out DIR]

What each row says, per test set: test BLEU and chrF as mean ± sd over seeds; against the **control** (the
baseline model trained the same way without BERT, the first row) — or, in a study without one, against
its reference configuration — ΔBLEU (difference of the means), its 95% confidence interval and two-sided
p-value from a paired bootstrap (Koehn 2004; sacreBLEU statistics, 1000 resamples) over the hypotheses of
the seeds both completed, pooled, and with two or more seeds a paired t-test across seeds; then the
budget each arm had (epochs, updates, wall time), which rule stopped its runs (``patience``: converged;
``cap``: the epoch or update cap with the rule on; ``schedule``: a fixed budget) and ``converged`` = every run
stopped by patience, none while its validation loss was still falling or its BLEU still rising. A report in
which any run — or the baseline the arms warm-started from — did not converge opens with one line saying its
Δs are not an answer. Below the tables, how each arm used BERT (:mod:`nmtcore.diagnostics`), each arm's Δ on the
validation set beside its Δ on each test set, how each arm fit its training data against validation (training and
validation NLL at the lowest validation NLL and at the last epoch: overfitting shows there; each arm's validation
NLL where its training NLL came down to the reference's, the two at equal fit; for arms trained in phases, each
phase's end beside the reference's end of that phase, or its same epoch), and ``valid_curves.png``: every run's
validation BLEU, loss and (where logged) training against validation NLL per epoch on one figure.

Files: ``table.md`` and ``table.csv`` (for people), ``table.json`` (a list of rows, one per arm and test
set: ``arm``, ``n_seeds``, ``bleu_mean``, ``bleu_sd``, ``delta``, ``ci_low``, ``ci_high``, ``p``,
``test_set``, ``stopped_by``, ``converged``, ``diagnostics`` and more), ``report.json`` (everything), and the
figures of :mod:`nmtcore.sweep.figures`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from nmtcore import tracking
from nmtcore.sweep import timing
from nmtcore.sweep.figures import figures
from nmtcore.sweep.space import CONTROL
from nmtcore.sweep.results import (
    BERT_OFF_SWITCHES,
    GAIN,
    Comparison,
    Group,
    PhaseEnd,
    SweepReport,
    build_report,
    fmt,
    mean,
    other_dropout,
    short,
)


# ================================================================================== rendering
def json_rows(report: SweepReport) -> list[dict[str, Any]]:
    """One row per test set and arm, the reference (control) first: what ``table.json`` holds."""
    rows = []
    for split in report.test_splits:
        for g in report.groups:
            bleus = list(g.bleu.get(split, {}).values())
            chrfs, bps, lens = ([x for x in figure.get(split, {}).values() if not math.isnan(x)]
                                for figure in (g.chrf, g.bp, g.len_ratio))
            c = g.comparisons.get(split, Comparison())
            rows.append({
                "test_set": split, "arm": g.label, "control": g.control, "reference": g is report.reference,
                **{short(k): v for k, v in g.values.items()},
                "n_seeds": len(bleus), "bleu_mean": mean(bleus), "bleu_sd": _sd(bleus), "bleu_by_seed": dict(
                    g.bleu.get(split, {})), "chrf_mean": mean(chrfs), "bp_mean": mean(bps),
                "len_ratio_mean": mean(lens), "precisions_mean": _mean_precisions(g.precisions.get(split, {})),
                "delta": 0.0 if g is report.reference else c.delta, "ci_low": c.ci_low, "ci_high": c.ci_high,
                "p": c.p, "p_seeds": c.p_seeds, "significant": c.significant, "paired_seeds": c.pooled_seeds,
                "epochs": mean([float(e) for e in g.epochs]), "updates": mean(g.updates),
                "wall_min": (mean(g.wall_s) or 0) / 60 or None, "cpu_h": (mean(g.cpu_s) or 0) / 3600 or None,
                "estimated_min": None if report.estimated_s(g) is None else report.estimated_s(g) / 60,
                "still_improving": g.still_improving, "stopped_by": dict(Counter(g.stopped_by)),
                "converged": g.converged,
                "diagnostics": {name: mean(values) for name, values in sorted(g.diagnostics.items())},
                "parameters": g.parameters, "tokens_per_s": g.tokens_per_s,
                "bert": g.bert, "bert_layers": g.bert_layers, "bert_hidden": g.bert_hidden,
                "bert_quality": g.bert_quality, "trials": {s: n for s, n in sorted(g.status.items())},
                **{name: mean(g.extra.get(name, [])) for name in report.space.get("report_metrics") or []},
                "phases": " | ".join(dict.fromkeys(g.phases)),
            })
    for row in rows:
        ref = next((r for r in rows if r["reference"] and r["test_set"] == row["test_set"]), None)
        # Δ pairs the seeds both ran: fewer than either row's own (a pooled or joined study) is said beside it.
        row["delta_on_fewer_seeds"] = (ref is not None and row is not ref and row["delta"] is not None
                                       and row["paired_seeds"] < max(row["n_seeds"], ref["n_seeds"]))
        row["delta_length"], row["delta_precision"] = (None, None) if ref is None or row is ref else \
            length_and_precision(ref["bleu_mean"], ref["bp_mean"], row["bleu_mean"], row["bp_mean"])
    return rows


def length_and_precision(bleu_ref: float | None, bp_ref: float | None, bleu: float | None,
                         bp: float | None) -> tuple[float | None, float | None]:
    """The difference of two mean BLEU scores split in two parts that sum to it: what the brevity penalty
    accounts for (the arm's penalty at the reference's n-gram precisions) and what the n-gram precisions do (at
    the arm's penalty). BLEU = BP · G, G the geometric mean of the 1-4-gram precisions, so
    BLEU − BLEU_ref = (BP − BP_ref) · G_ref + BP · (G − G_ref)."""
    if any(v is None or math.isnan(v) for v in (bleu_ref, bp_ref, bleu, bp)) or not bp_ref or not bp:
        return None, None
    g_ref, g = bleu_ref / bp_ref, bleu / bp
    return (bp - bp_ref) * g_ref, bp * (g - g_ref)


def _mean_precisions(by_seed: dict[str, tuple[float, ...]]) -> list[float]:
    """BLEU's 1- to 4-gram precisions averaged over seeds; empty where a run logged none (an older store)."""
    seeds = [p for p in by_seed.values() if len(p) == 4 and not any(math.isnan(x) for x in p)]
    return [mean([p[n] for p in seeds]) for n in range(4)] if seeds else []


def table_rows(report: SweepReport) -> list[dict[str, str]]:
    """The tables as printable rows (also the CSV), one per test set and arm."""
    out = []
    for row in json_rows(report):
        is_ref = row["reference"]
        ci = "" if row["ci_low"] is None else f"[{row['ci_low']:+.2f}, {row['ci_high']:+.2f}]"
        p_seeds = "" if row["p_seeds"] is None else f"{row['p_seeds']:.3f}"
        out.append({
            "test set": row["test_set"], "arm": row["arm"],
            **{short(k): fmt(row[short(k)]) if short(k) in row else "" for k in report.varied_keys if k != "arm"},
            "seeds": str(row["n_seeds"]),
            "BLEU": _pm(row["bleu_mean"], row["bleu_sd"]), "chrF": _f(row["chrf_mean"]),
            "length": _f(row["len_ratio_mean"], 3), "BP": _f(row["bp_mean"], 3),
            "1-4-gram precision (%)": "/".join(f"{p:.1f}" for p in row["precisions_mean"]),
            **{f"{name} (last epoch)": _f(row[name], 4) for name in report.space.get("report_metrics") or []},
            "ΔBLEU": "—" if is_ref else ("" if row["delta"] is None else f"{row['delta']:+.2f}" + (
                _paired(row["paired_seeds"]) if row["delta_on_fewer_seeds"] else "")),
            "Δ: length / precision": "—" if is_ref or row["delta_length"] is None else
            f"{row['delta_length']:+.2f} / {row['delta_precision']:+.2f}",
            "95% CI": "ref" if is_ref else ci, "p": "ref" if is_ref else ("" if row["p"] is None else _p(row["p"])),
            "p (seeds)": "ref" if is_ref else p_seeds,
            "epochs": _f(row["epochs"], 1),
            **({"phases (first epoch); stop": row["phases"]} if any(g.phases for g in report.groups) else {}),
            "updates": _f(row["updates"], 0), "wall (min)": _f(row["wall_min"], 1),
            **({"estimated (min)": _f(row["estimated_min"], 1)} if report.estimate else {}),
            "stopped by": ", ".join(rule if n == 1 and len(row["stopped_by"]) == 1 else f"{rule} {n}"
                                    for rule, n in row["stopped_by"].items()),
            "converged": "" if not row["stopped_by"] else "yes" if row["converged"] else "no",
            "BERT": row["bert"] or "—",
            "BERT L×H": f"{row['bert_layers']}×{row['bert_hidden']}" if row["bert_layers"] else "—",
            "BERT quality": _f(row["bert_quality"], 3),
            "params (M)": "" if row["parameters"] is None else _f(row["parameters"] / 1e6, 2),
            "trials": ", ".join(f"{n} {s}" for s, n in row["trials"].items()),
        })
    return out


def render_markdown(report: SweepReport) -> str:
    """The tables in Markdown, one per test set, with what they mean and the warnings."""
    ref = report.reference.label if report.reference is not None else "—"
    head = [f"### {report.sweep}: {report.space.get('description') or report.study}", "",
            f"Protocol: {report.protocol or 'not recorded'}. Reference row: `{ref}`. BLEU: sacreBLEU, detokenized, "
            "mean ± sd over seeds; `length`: the output's length over the references' and `BP` BLEU's brevity "
            "penalty (a shorter output loses BLEU at equal n-gram precision), beside BLEU's 1-4-gram precisions; "
            "`Δ: length / precision`: the difference of the mean BLEUs split into what the brevity penalty accounts "
            "for (the arm's at the reference's precisions) and what the precisions do (at the arm's penalty). "
            "ΔBLEU, 95% CI and p (two-sided) from a paired bootstrap (1000 resamples, seeds pooled) against the "
            "reference; p (seeds): paired t-test across seeds. Δ, its CI and both p pair the seeds both rows ran; "
            "where that is fewer than a row's own, the count stands beside Δ (the BLEU column is each row's mean "
            "over all its seeds, so the two BLEUs' difference need not be Δ). "
            f"Parent run `{report.parent_run_id}`.", ""]
    if report.pooled:
        head += [f"Pooled over the sweeps {', '.join(f'`{n}`' for n in report.pooled)}: their runs of the same "
                 "configuration are one row, each seed once (the parent run above is the first sweep's). Each "
                 "sweep's own report has its cost estimate and time split.", ""]
    if report.joined:
        head += ["Rows joined across studies (`--same-arm`), each checked to be one configuration but for its seed "
                 "and how it names its BERT (every setting that decides a result, the data's checksums, the BERT it "
                 "resolved to): " + "; ".join(report.joined) + ".", ""]
    if report.added_test_splits:
        head += [f"Decoded after the sweep by `nmtcore retest`: {', '.join(report.added_test_splits)} (each trial's "
                 "tested weights with its own decoding settings, as its trial decoded its test sets).", ""]
    if report.reused():
        head += ["Trained before, copied into this sweep, not trained again (the same config, seed, code, data and "
                 "starting weights; their cost columns are the original runs'): " + "; ".join(report.reused()) + ".",
                 ""]
    if report.shared_phases():
        head += ["Started where another trial's first phases ended, those phases not trained again (the same "
                 "computation by the model's own account, `nmtcore.engine.shared_phases`: BERT-JAM's M0-M2 warm-up; "
                 "their epochs are in the curves, their cost is the other trial's): "
                 + "; ".join(report.shared_phases()) + ".", ""]
    if report.estimate:
        est = report.estimate
        phases = "; ".join(f"{p['name']} {p['seconds'] / 60:.1f} min" for p in est.get("phases", []))
        head += [f"Cost estimated before training ({est.get('machine', '?')}): {phases}; the `estimated (min)` "
                 "column is each arm's estimate beside its `wall (min)`.", ""]
    if report.time_split:
        head += ["Time split (wall clock, measured; the report's own time is the console's last lines and "
                 f"`{timing.ARTIFACT}`):", *(f"- {line}" for line in timing.describe(report.time_split)), ""]
    head += prediction_lines(report)
    verdict = report.not_an_answer()
    if verdict:
        head = [f"**{verdict}**", ""] + head
    rows = table_rows(report)
    if not rows:
        return "\n".join(head + ["(no trials)"]) + "\n"
    lines: list[str] = []
    for split in report.test_splits:
        part = [{k: v for k, v in r.items() if k != "test set"} for r in rows if r["test set"] == split]
        cols = list(part[0])
        lines += [f"**{split}**", "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
        lines += ["| " + " | ".join(r.get(c, "") for c in cols) + " |" for r in part] + [""]
    lines += rarity_tables(report)
    lines += why_table(report)
    lines += diagnostics_table(report)
    lines += valid_beside_test(report)
    lines += fit_table(report)
    lines += unfinished_lines(report)
    tail = [f"- warning: {w}" for w in report.warnings]
    return "\n".join(head + lines + tail) + "\n"


def prediction_lines(report: SweepReport) -> list[str]:
    """The predictions written before the runs (:class:`~nmtcore.sweep.space.Prediction`), each with what the runs
    measured and whether it held; nothing when the study has none."""
    if not report.predictions:
        return []
    lines = ["**Predictions written before any run**, each arm against the control unless it says otherwise (mean "
             "over seeds; ΔBLEU's CI and p from the bootstrap when this report's reference is what the arm is "
             "against; NLLs in bits per target token at each run's lowest validation NLL):", ""]
    said = ""  # the hypothesis the line before gave: several predictions of one hypothesis say it once
    for c in report.predictions:
        pred = c.prediction
        what = (f"ΔBLEU on {pred.test_split}" if pred.test_split
                else f"Δ {'training' if pred.measure == 'fit:train_nll' else 'validation'} NLL")
        measured = "not measured yet" if c.value is None else "measured " + (
            f"{c.value:+.{2 if pred.test_split else 3}f}"
            + (f" [{c.ci[0]:+.2f}, {c.ci[1]:+.2f}], p {_p(c.p)}" if c.ci is not None and c.p is not None else "")
            + f" ({c.seeds} seed{'s' * (c.seeds != 1)})")
        verdict = f"**{c.verdict()}**" + (f" ({c.why})" if c.why else "")
        hypothesis = f" Hypothesis: {pred.hypothesis}" if pred.hypothesis and pred.hypothesis != said else ""
        said = pred.hypothesis
        against = "" if pred.against == CONTROL else f" against `{pred.against}`"
        lines.append(f"- `{pred.arm}`: {what}{against} {pred.bound()} (written {pred.written}; {c.source}): "
                     f"{measured}: {verdict}.{hypothesis}")
    return lines + [""]


def rarity_tables(report: SweepReport) -> list[str]:
    """Where each arm's Δ comes from (:mod:`~nmtcore.sweep.rare_words`): per test set, the arm against the reference
    on the sentences with a source word rare in training and on the rest; one line saying why when there is none."""
    from nmtcore.sweep.rare_words import RARE_MAX

    arms = [g for g in report.groups if g.by_rarity]
    ref = report.reference.label if report.reference is not None else "the reference"
    if not arms:
        return [f"No comparison by source-word rarity: {report.rarity_missing}.", ""] if report.rarity_missing else []
    lines = [f"**Where the Δ comes from**: the test sentences with a source word seen at most {RARE_MAX} times in the "
             f"training source (`rare`) against the rest, each arm against `{ref}` on both parts (seeds pooled, "
             "paired bootstrap). A pretrained encoder that helps with the words the training set barely has gains "
             "on `rare` first.", ""]
    for split in report.test_splits:
        rows = [(g, g.by_rarity[split]) for g in arms if split in g.by_rarity]
        if not rows:
            continue
        n = {part: c.sentences for _, parts in rows for part, c in parts.items()}
        lines += [f"*{split}* (rare: {n.get('rare', 0)} sentences, rest: {n.get('rest', 0)})", "",
                  "| arm | rare: reference → arm | ΔBLEU [95% CI] | p | rest: reference → arm | ΔBLEU [95% CI] | p |",
                  "|---|---|---|---|---|---|---|"]
        for g, parts in rows:
            cells = []
            for part in ("rare", "rest"):
                c = parts.get(part)
                cells += ["—"] * 3 if c is None else [
                    f"{c.reference_bleu:.2f} → {c.arm_bleu:.2f}", f"{c.delta:+.2f} [{c.ci_low:+.2f}, {c.ci_high:+.2f}]",
                    _p(c.p)]
            lines.append(f"| {g.label} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def unfinished_lines(report: SweepReport) -> list[str]:
    """Where each trial that has not finished stands (a sweep stopped at a session's end, or still running): its
    epochs and best greedy validation BLEU so far, beside the reference's best over its finished runs."""
    groups = [g for g in report.groups if g.unfinished]
    if not groups:
        return []
    ref = report.reference
    best = mean([max(c["valid_bleu"]) for _, c in ref.curves if c.get("valid_bleu")]) if ref is not None else None
    against = (f"; the {ref.label}'s best over its finished runs: {_f(best)}"
               if ref is not None and best is not None and not math.isnan(best) else "")
    lines = [f"**Not finished yet** (no test score until they are; `--resume` continues a stopped sweep){against}:", ""]
    lines += [f"- {g.label}: " + "; ".join(p.describe() for p in g.unfinished) for g in groups]
    return lines + [""]


def _paired_arms(report: SweepReport, figure: str) -> tuple[Group | None, list[Group]]:
    """The reference and the arms whose ``figure`` (a :class:`~nmtcore.sweep.results.Group`'s seed → greedy
    validation BLEU) has a seed the reference's tested model has too; no arms without such a reference."""
    ref = report.reference
    if ref is None or not ref.valid_tested:
        return ref, []
    return ref, [g for g in report.groups if g is not ref and set(getattr(g, figure)) & set(ref.valid_tested)]


def why_table(report: SweepReport) -> list[str]:
    """Why each arm stands where it does against the reference, from its inference switches (greedy validation
    BLEU of the tested weights, mean over seeds): the arm against the reference, its own NMT path (BERT switched
    off everywhere) against the reference, what BERT adds to that path, and what each other switch's part adds.
    Nothing without a reference that logged the figure or an arm with a switch that turns BERT off."""
    ref, arms = _paired_arms(report, "valid_bert_off")
    if not arms:
        return []
    off = {s for s in BERT_OFF_SWITCHES for g in arms if f"{GAIN}{s}" in g.diagnostics}
    parts = sorted({name[len(GAIN):] for g in arms for name in g.diagnostics
                    if name.startswith(GAIN) and name[len(GAIN):] not in off})
    lines = [f"**Why each arm stands where it does** (greedy validation BLEU of the tested weights, mean over seeds; "
             f"`nmtcore.diagnostics`' inference switches): `Δ vs {ref.label}` the arm's minus the {ref.label}'s; "
             f"`without BERT vs {ref.label}` the same weights with BERT switched off everywhere "
             f"({' / '.join(f'`{s}`' for s in BERT_OFF_SWITCHES)}), the NMT path the arm trained, minus the "
             f"{ref.label}'s: below 0, fusing BERT left the arm's own path weaker than a model trained without it, "
             "and BERT has that much to make up before it helps; `BERT adds` the tested model minus that; each "
             "`<switch> part adds` what the part that switch turns off adds (tested minus the switch; BERT-fused's "
             "`bert_only` part is its NMT branches). The reference's and the arm's figures pair the seeds both "
             "ran.", "",
             "| " + " | ".join(["arm", f"Δ vs {ref.label}", f"without BERT vs {ref.label}", "BERT adds",
                                *(f"`{p}` part adds" for p in parts)]) + " |",
             "|---|---|---|---|" + "".join("---|" for _ in parts)]
    for g in arms:
        seeds = sorted(set(g.valid_bert_off) & set(g.valid_tested) & set(ref.valid_tested))
        fewer = len(seeds) < max(len(g.valid_tested), len(ref.valid_tested))
        note = _paired(len(seeds)) if fewer else ""
        cells = [f"{mean([g.valid_tested[s] - ref.valid_tested[s] for s in seeds]):+.2f}{note}",
                 f"{mean([g.valid_bert_off[s] - ref.valid_tested[s] for s in seeds]):+.2f}{note}",
                 f"{mean([g.valid_tested[s] - g.valid_bert_off[s] for s in seeds]):+.2f}"]
        cells += [f"{mean(g.diagnostics[GAIN + p]):+.2f}" if GAIN + p in g.diagnostics else "" for p in parts]
        lines.append(f"| {g.label} | " + " | ".join(cells) + " |")
    return lines + [""]


def diagnostics_table(report: SweepReport) -> list[str]:
    """How much each arm used BERT and how its scores and translations relate (:mod:`nmtcore.diagnostics`, mean
    over seeds): one row per figure, one column per arm; nothing when no arm has a figure."""
    arms = [g for g in report.groups if g.diagnostics]
    if not arms:
        return []
    names = sorted({name for g in arms for name in g.diagnostics})
    ref = report.reference
    lines = ["**How each arm used BERT** (validation set, the tested weights; mean over seeds). "
             "`valid_bleu/<switch>`: greedy validation BLEU with only those branches on (BERT-fused: `mix` = Eq. 1, "
             "what is tested; `nmt_only` = BERT switched off; `bert_only` = the BERT-attention branches alone; "
             "`enc_bert_off` / `dec_bert_off` = BERT switched off in the encoder's / the decoder's layers only, the "
             "other stack mixing as tested: `mix` minus each is what that side's BERT attention adds; mask fusion: "
             "`tested`; `mask_off` = Eq. 4's mask off; `gate_bert_off` = λ = 0 in Eq. 5, the gate passing E only; "
             "`adaptive_off` = η = 0 in Eq. 9, the decoder reading the encoder's top; `bert_off` = all three; "
             "BERT-JAM: `tested`; `enc_bert_off` / `dec_bert_off` / `bert_off` = BERT's keys masked out of the "
             "encoder's / the decoder's / every joint attention; `tested_minus/<switch>`: the tested model's greedy validation "
             "BLEU minus the switch's, per run: what the part that switch turns off adds, BERT-fused's `bert_only` "
             "giving what its NMT branches add)"
             + (f"; the {ref.label}'s best validation BLEU over its epochs, for comparison: "
                f"{_f(mean([max(c['valid_bleu']) for _, c in ref.curves if c.get('valid_bleu')]))}"
                if ref is not None and ref.control else "")
             + ". `bert_usage/...`: read off the weights (BERT-JAM: GLU weight per BERT layer, Eq. 8; mask fusion: the "
             "GLU's value and gate weight per BERT layer, Eq. 1-2); "
             "`probe/...`: over one pass of the validation set (document context: the gates' weight on BERT; "
             "mask fusion: the masked fraction and the mean of Eq. 6's λ and Eq. 8's η per source token; BERT-JAM: "
             "the share of each joint attention on BERT or the encoder; PLM-sponsored: the coordinator's attention on "
             "the source BERT, the target BERT and its own states, Eq. 6's gate, the fine-tuned source BERT's mean squared distance from the pretrained "
             "one's top layer, the MLM head's and the target BERT's next-token accuracy). For every arm, the control too (`tested`: a model without "
             "switches): `valid_len_ratio` the greedy output's length over the references', `valid_token_acc` the "
             "teacher-forced share of target tokens that are the top choice, `valid_entropy` and `valid_nll` in "
             "bits per target token: where equal NLL and unequal BLEU part ways. A figure only some of an arm's "
             "runs have (a switch added after the others ran, measured by `nmtcore rediagnose` where their weights "
             "were) is the mean of those, marked `(n of m)`.", "",
             "| figure | " + " | ".join(g.label for g in arms) + " |", "|---|" + "|".join("---" for _ in arms) + "|"]
    runs = {g.label: max(len(v) for v in g.diagnostics.values()) for g in arms}

    def cell(g: Any, name: str) -> str:
        values = g.diagnostics.get(name, [])
        part = f" ({len(values)} of {runs[g.label]})" if 0 < len(values) < runs[g.label] else ""
        return _f(mean(values), 3) + part

    for name in names:
        lines.append(f"| {name} | " + " | ".join(cell(g, name) for g in arms) + " |")
    return lines + [""]


def _paired(n: int) -> str:
    """What stands beside a Δ that pairs fewer seeds than a row ran: `` (2 paired seeds)``."""
    return f" ({n} paired seed{'s' if n != 1 else ''})"


def valid_beside_test(report: SweepReport) -> list[str]:
    """Each arm's Δ on the validation set (the tested model's greedy BLEU, arm minus reference over the seeds both
    ran) beside its Δ on each test set, against the reference: sets drawn alike should agree within their noise,
    and where they part the reader sees it next to the test Δ the study's answer rests on. Nothing without the
    validation figure."""
    ref, arms = _paired_arms(report, "valid_tested")
    if not arms:
        return []
    lines = [f"**Validation beside test** (Δ against the {ref.label}, mean over the seeds both ran): the "
             "validation set's greedy BLEU of the model each run tested, beside the test sets' Δ (beam search, the "
             "tables above). The validation set chose when each run stopped, so it leans its way; a test set whose Δ "
             "parts from it by more than its CI is one where a single set's draw decides the answer.", "",
             "| arm | Δ validation (greedy) | " + " | ".join(f"Δ {split}" for split in report.test_splits) + " |",
             "|---|---|" + "|".join("---" for _ in report.test_splits) + "|"]
    for g in arms:
        seeds = sorted(set(g.valid_tested) & set(ref.valid_tested))
        fewer = len(seeds) < max(len(g.valid_tested), len(ref.valid_tested))
        cells = [f"{mean([g.valid_tested[s] - ref.valid_tested[s] for s in seeds]):+.2f}"
                 + (_paired(len(seeds)) if fewer else "")]
        for split in report.test_splits:
            c = g.comparisons.get(split)
            cells.append("—" if c is None or c.delta is None else
                         f"{c.delta:+.2f}" + ("" if c.ci_low is None else f" [{c.ci_low:+.2f}, {c.ci_high:+.2f}]"))
        lines.append(f"| {g.label} | " + " | ".join(cells) + " |")
    return lines + [""]


def fit_table(report: SweepReport) -> list[str]:
    """How each arm fit its training data against validation (:class:`~nmtcore.sweep.results.Fit`, mean over
    seeds), one row per arm: what tells an arm that learns less from one that learns the training set and
    generalises less. Nothing when no run logged both NLLs."""
    arms = [g for g in report.groups if g.fit]
    if not arms:
        return []
    ref = report.reference if report.reference is not None and report.reference.fit else None
    lines = ["**How each arm fit the training data** (bits per target token, mean over seeds): the training NLL is "
             "the epoch's mean as it trained (dropout on, the NMT output's NLL without label smoothing or other loss "
             "terms), the validation NLL at the epoch's end (dropout off); at the epoch of the lowest validation NLL "
             "and at the last epoch. `gap`: validation − training NLL at that epoch. Of two arms trained alike, "
             "the one with the lower training NLL and the higher validation NLL learnt the training set more "
             "and generalises less."
             + (f" `Δ vs {ref.label}`: the arm's minus the {ref.label}'s, at each one's lowest validation NLL."
                f" `at the {ref.label}'s train NLL`: the arm's validation NLL where its training NLL first came down"
                f" to the {ref.label}'s at the {ref.label}'s lowest validation NLL (interpolated between epochs),"
                f" and that minus the {ref.label}'s there: the two at equal fit, whatever either went on to; above"
                f" zero, the arm generalises less from what it has learnt."
                if ref is not None else ""), "",
             "| arm | last epoch | lowest valid NLL at epoch | train NLL there | valid NLL there | gap"
             + (f" | Δ train vs {ref.label} | Δ valid vs {ref.label}" if ref is not None else "")
             + " | train NLL, last epoch | valid NLL, last epoch"
             + (f" | valid NLL at the {ref.label}'s train NLL | Δ valid there vs {ref.label}"
                if ref is not None else "")
             + " |",
             "|---|---|---|---|---|---" + ("|---|---" if ref is not None else "") + "|---|---"
             + ("|---|---" if ref is not None else "") + "|"]

    def m(g: Any, attr: str) -> float | None:
        return mean([getattr(f, attr) for f in g.fit])

    noisier = {g.label: other_dropout(g, ref) for g in arms} if ref is not None else {}
    for g in arms:
        cells = [_f(m(g, "last_epoch"), 1), _f(m(g, "best_epoch"), 1), _f(m(g, "train_at_best"), 3),
                 _f(m(g, "valid_at_best"), 3), _f(m(g, "gap_at_best"), 3)]
        if ref is not None:
            cells += ["—" if g is ref else f"{m(g, attr) - m(ref, attr):+.3f}"
                      for attr in ("train_at_best", "valid_at_best")]
        cells += [_f(m(g, "train_last"), 3), _f(m(g, "valid_last"), 3)]
        if ref is not None:
            cells += _equal_fit_cells(g, ref, m(ref, "train_at_best"), m(ref, "valid_at_best"))
            if noisier[g.label] and cells[-1] != "—":
                cells[-1] += " †"
        lines.append(f"| {g.label} | " + " | ".join(cells) + " |")
    marked = {label: keys for label, keys in noisier.items() if keys}
    if marked:
        lines += ["", f"† Trained under other dropout than the {ref.label} ("
                  + "; ".join(f"{label}: {', '.join(keys)}" for label, keys in marked.items())
                  + "): its training NLL is measured through other noise, so at equal training NLL the two have not"
                  " learnt equally much, and the Δ there does not compare them."]
    return lines + [""] + phase_fit_table(report, ref)


def _equal_fit_cells(g: Any, ref: Any, level: float, ref_valid: float) -> list[str]:
    """The fit table's two cells at equal fit: ``g``'s validation NLL where its training NLL first came down to
    ``level`` (the reference's at its lowest validation NLL; the epoch beside it), and that minus the reference's
    validation NLL there; "—" for the reference, "not reached" where no seed got that far."""
    if g is ref:
        return ["—", "—"]
    found = [f.at_train_nll(level) for f in g.fit]
    reached = [x for x in found if x is not None]
    if not reached:
        return ["not reached", "—"]
    valid = mean([v for _, v in reached])
    short = f"; {len(found) - len(reached)} of {len(found)} seeds never got there" if len(reached) < len(found) else ""
    return [f"{valid:.3f} (epoch {mean([e for e, _ in reached]):.1f}{short})", f"{valid - ref_valid:+.3f}"]


def _phase_ends(g: Any) -> dict[int, list[PhaseEnd]]:
    """``g``'s phase ends (:meth:`~nmtcore.sweep.results.Fit.phase_ends`) by phase, one per seed that reached it."""
    out: dict[int, list[PhaseEnd]] = {}
    for f in g.fit:
        for end in f.phase_ends():
            out.setdefault(end.phase, []).append(end)
    return dict(sorted(out.items()))


def phase_fit_table(report: SweepReport, ref: Any) -> list[str]:
    """For arms trained in phases: each phase's last epoch, its training and validation NLL and validation BLEU
    (mean over seeds), beside the reference's: at the end of the same phase where the reference has phases too
    (an ablation against its full model), else at the same epoch. It shows in which phase an arm's fit parts from
    the reference's. Nothing when no arm has phases."""
    ref_ends = _phase_ends(ref) if ref is not None else {}
    rows = []
    for g in report.groups:
        for phase, at in _phase_ends(g).items():
            digits = 1 if len(at) > 1 else 0
            cells = [f"{_f(mean([p.first for p in at]), digits)}-{_f(mean([p.last for p in at]), digits)}",
                     _f(mean([p.train for p in at]), 3), _f(mean([p.valid for p in at]), 3),
                     _f(mean([p.valid - p.train for p in at]), 3), _f(mean([p.bleu for p in at]), 2)]
            if ref is None:
                pass
            elif ref is g:
                cells += ["—"] * 3
            elif ref_ends:  # at the end of the same phase
                theirs = ref_ends.get(phase, [])
                cells += ([_f(mean([p.train for p in theirs]), 3), _f(mean([p.valid for p in theirs]), 3),
                           _f(mean([p.bleu for p in theirs]), 2)] if theirs
                          else [f"— (no phase {phase})", "—", "—"])
            else:  # at the same epoch
                there = [x for f in ref.fit for p in at if (x := f.at_epoch(p.last)) is not None]
                stopped = f"— (stopped after epoch {_f(mean([f.last_epoch for f in ref.fit]), 0)})"
                cells += ([_f(mean([x[i] for x in there]), 3 if i < 2 else 2) for i in range(3)] if there
                          else [stopped, "—", "—"])
            rows.append(f"| {g.label} | {phase} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    against = ref is not None
    where = "at the end of the same phase" if ref_ends else "at the same epoch"
    return ["**Phase by phase** (arms trained in phases, mean over seeds): each phase's last epoch, the training "
            "and validation NLL there (bits per target token) and the greedy validation BLEU"
            + (f", beside the {ref.label}'s {where}: the phase in which an arm's fit parts from the "
               f"{ref.label}'s" if against else "") + ".", "",
            "| arm | phase | epochs | train NLL | valid NLL | gap | valid BLEU"
            + (f" | {ref.label}: train NLL | {ref.label}: valid NLL | {ref.label}: valid BLEU" if against else "")
            + " |",
            "|---|---|---|---|---|---|---" + ("|---|---|---" if against else "") + "|", *rows, ""]


def write_report(report: SweepReport, out_dir: str | os.PathLike) -> list[Path]:
    """Write table.md, table.csv, table.json, report.json and the figures into ``out_dir``; returns the files."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "table.md", out / "table.json", out / "report.json"]
    files[0].write_text(render_markdown(report), encoding="utf-8")
    files[1].write_text(json.dumps(json_rows(report), indent=1, default=str) + "\n", encoding="utf-8")
    files[2].write_text(json.dumps(_to_json(report), indent=1, default=str) + "\n", encoding="utf-8")
    rows = table_rows(report)
    if rows:
        path = out / "table.csv"
        with open(path, "w", newline="", encoding="utf-8") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        files.append(path)
    return files + figures(report, out)


def make_report(sweep: str, tracking_uri: str | os.PathLike | None = None, out_dir: str | os.PathLike = "report",
                log: bool = True, n_bootstrap: int = 1000) -> list[Path]:
    """Build, write and (``log``) attach the report to the sweep's parent run under ``report/``."""
    report = build_report(sweep, tracking_uri, n_bootstrap=n_bootstrap)
    files = write_report(report, out_dir)
    if log:
        tracking.log_run_artifacts(report.parent_run_id, files, "report", report.tracking_uri)
    return files


# ================================================================================== utilities
def _to_json(report: SweepReport) -> dict[str, Any]:
    return {"sweep": report.sweep, "parent_run_id": report.parent_run_id, "study": report.study,
            "space": report.space, "metric": report.metric, "test_splits": report.test_splits,
            "added_test_splits": report.added_test_splits, "protocol": report.protocol,
            "by_source_rarity": {g.label: {split: {part: dataclasses.asdict(c) for part, c in parts.items()}
                                           for split, parts in g.by_rarity.items()}
                                 for g in report.groups if g.by_rarity},
            "by_source_rarity_missing": report.rarity_missing,
            "reference": report.reference.label if report.reference else None,
            "not_an_answer": report.not_an_answer(), "baseline_converged": report.baseline_converged,
            "rows": json_rows(report), "run_ids": {g.label: [r.run_id for r in g.runs] for g in report.groups},
            "warnings": report.warnings, "time_split": report.time_split, "pooled": report.pooled,
            "joined": report.joined, "reused": report.reused(), "shared_phases": report.shared_phases(),
            "fit": {g.label: [dataclasses.asdict(f) for f in g.fit] for g in report.groups if g.fit},
            "predictions": [{**c.prediction.describe(), "source": c.source, "value": c.value, "held": c.held,
                             "verdict": c.verdict(), "why": c.why, "ci": c.ci, "p": c.p, "seeds": c.seeds}
                            for c in report.predictions],
            "unfinished": {g.label: [dataclasses.asdict(p) for p in g.unfinished] for g in report.groups if g.unfinished}}


def _sd(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.stdev(xs) if len(xs) > 1 else None


def _pm(m: float | None, sd: float | None) -> str:
    if m is None:
        return ""
    return f"{m:.2f}" if sd is None else f"{m:.2f} ± {sd:.2f}"


def _f(v: float | None, digits: int = 2) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def _p(p: float) -> str:
    return f"{p:.3f}" + (" *" if p < 0.05 else "")
