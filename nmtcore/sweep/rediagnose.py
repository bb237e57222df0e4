"""How each arm used BERT, measured again on a sweep that has run: every complete trial's tested weights through
the diagnostics of the code installed now (:func:`nmtcore.diagnostics.measure`).

A trial measures its diagnostics once, at its end, with the inference switches and probes its model had then. A
later version may add one (BERT-fused's ``enc_bert_off`` and ``dec_bert_off``: which side's BERT attention an arm's
gain comes through) that the report of a finished sweep would then lack, and training again for it would cost the
whole study. This loads each complete trial's tested weights (its ``summary.json``'s ``final_model``, as ``nmtcore
retest`` finds them), builds the trial's trainer from the checkpoint's own config (its data, its BERT, a frozen
BERT's features from the run's feature cache) on the threads the trial decoded with, and measures. The figures the
run lacks go into it as a trial logs its own (``diag/...`` at its final step; ``diagnostics.json`` becomes the union),
with the tag ``nmtcore.rediagnosed`` saying when, with which code and which weights; the figures it has keep their
values (``again``: the new values replace them), and the console says how far their re-measured values lie from
them (the same weights, data and threads: a check that the measure reproduces). ``nmtcore report`` reads them as
any trial's.

  nmtcore rediagnose --sweep NAME [--tracking-uri URI] [--again]
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from nmtcore import tracking
from nmtcore.sweep.lengths import LengthCheckError, tested_checkpoint
from nmtcore.sweep.lifecycle import ARM_TAG, find_sweep_run, sweep_children, trial_state
from nmtcore.sweep.retest import final_step, trial_threads
from nmtcore.sweep.settings import SweepError
from nmtcore.tracking import schema
from nmtcore.tracking.callback import DIAGNOSTICS_FILE as ARTIFACT

Measure = Callable[[Path, int], dict[str, float]]  # (checkpoint, threads) → its diagnostics


class RediagnoseError(SweepError):
    """A sweep this command cannot measure (one line saying which and why)."""


def measure_tested(checkpoint: Path, threads: int = 0) -> dict[str, float]:
    """:func:`nmtcore.diagnostics.measure` of ``checkpoint``'s weights in the trainer its own config builds (its
    data and BERT; outputs under a temporary folder), on ``threads`` threads (0: as many as torch has)."""
    import torch

    from nmtcore.bert import ensure_bert
    from nmtcore.decoding import load_translator
    from nmtcore.diagnostics import measure
    from nmtcore.engine import build_trainer

    tested = load_translator(checkpoint)  # the checkpoint's own config, and its weights in the model it builds
    was = torch.get_num_threads()
    with tempfile.TemporaryDirectory(prefix="nmtcore-rediagnose-") as tmp:
        cfg = ensure_bert(tested.cfg.with_overrides({
            "output_dir": tmp, "train.save_dir": "", "train.init_from": "",
            **({"train.num_threads": threads} if threads > 0 else {})}))
        try:
            trainer = build_trainer(cfg, device=torch.device("cpu"))
            trainer.model.load_state_dict(tested.model.state_dict())
            return measure(trainer)
        finally:
            torch.set_num_threads(was)


def recorded(run: tracking.RunRecord) -> dict[str, float]:
    """The diagnostics a run holds: its ``diag/...`` metrics (the latest value of each), what the report reads."""
    from nmtcore.diagnostics import PREFIX

    return {k[len(PREFIX):]: float(v) for k, v in run.metrics.items() if k.startswith(PREFIX)}


def rediagnose_sweep(sweep: str, tracking_uri: str | os.PathLike | None = None, measure: Measure = measure_tested,
                     say: Callable[[str], None] = print, again: bool = False) -> dict[str, list[str]]:
    """Measure every complete trial of ``sweep`` whose tested weights are on this machine again and log into its run
    the figures it lacks (``again``: every figure); the others (copied or imported trials) are named and skipped,
    and none at all is an error. Returns, per trial run id measured, the names of the figures logged."""
    from nmtcore.diagnostics import PREFIX
    from nmtcore.tracking.provenance import provenance_tags

    uri = tracking.resolve_tracking_uri(tracking_uri)
    parent = find_sweep_run(sweep, uri)
    runs = [r for r in sweep_children(parent.run_id, uri) if trial_state(r) == "complete"]
    if not runs:
        raise RediagnoseError(f"sweep {sweep}: no complete trial to measure")
    checkpoints, missing = {}, []  # every one looked for before the first measure
    for r in runs:
        try:
            checkpoints[r.run_id] = tested_checkpoint(r, uri)
        except LengthCheckError as e:  # a copied or imported trial: its weights stayed where it trained
            missing.append(str(e))
    if not checkpoints:
        raise RediagnoseError(f"sweep {sweep}: no complete trial's weights on this machine ({missing[0]})")
    for line in missing:
        say(f"rediagnose: skipped, {line}")
    runs = [r for r in runs if r.run_id in checkpoints]
    tests = schema.SweepTags.from_tags(parent.tags, default_name=sweep).test_splits
    code = provenance_tags({}).get(schema.GIT_SHA, "?")
    logged: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="nmtcore-rediagnose-") as tmp:
        for run in runs:
            label = f"{run.tags.get(ARM_TAG, '?')} seed {run.tags.get(schema.SEED, '?')}"
            t0 = time.perf_counter()
            figures = {k: v for k, v in measure(checkpoints[run.run_id], trial_threads(run)).items()
                       if math.isfinite(v)}
            had = recorded(run)
            new = {k: v for k, v in figures.items() if again or k not in had}
            logged[run.run_id] = sorted(new)
            same = [k for k in figures if k in had]
            check = (f"; the {len(same)} it had re-measured within {max(abs(figures[k] - had[k]) for k in same):.3g}"
                     if same else "")
            if not new:
                say(f"rediagnose: {label}: every figure recorded already ({len(figures)}), kept{check}")
                continue
            tracking.log_run_metrics(run.run_id, {PREFIX + k: v for k, v in new.items()},
                                     final_step(run.run_id, uri, tests), uri)
            path = Path(tmp, run.run_id, ARTIFACT)
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps({**had, **new}, indent=1, sort_keys=True), encoding="utf-8")
            tracking.log_run_artifacts(run.run_id, [path], None, uri)
            tracking.set_run_tags(run.run_id, {schema.REDIAGNOSED: f"{time.strftime('%Y-%m-%dT%H:%M:%S')}, code {code}, "
                                                                f"weights {checkpoints[run.run_id].name}, "
                                                                f"{len(new)} figure(s)"}, uri)
            shown = ", ".join(f"{k} {new[k]:.2f}" for k in sorted(new) if k.startswith("valid_bleu/"))
            say(f"rediagnose: {label}: {len(new)} figure(s) logged{': ' + shown if shown else ''}{check} "
                f"({time.perf_counter() - t0:.0f} s)")
    return logged
