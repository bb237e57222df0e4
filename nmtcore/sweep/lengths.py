"""Is an arm's Δ a length effect? The comparison at equal output length.

A report's ``Δ: length / precision`` column says where BLEU's points landed at the study's decoding. It cannot say
whether the control would match the arm if it wrote longer output, because a longer beam output usually has
lower n-gram precision. This check answers it. Every complete trial of a sweep has its tested weights decoded
again (beam search, the run's own settings) at each length penalty of ``lenpens`` (``decode.lenpen``, fairseq
semantics: a hypothesis scores its log-probability over length ** lenpen). Each model keeps the penalty with its
best validation BLEU. Its test sets are then decoded with that penalty, and every arm is compared with the
reference arm as the report compares them: seeds pooled (the seeds both completed, their hypotheses one after
another), paired bootstrap over the sentences.

The tested weights are found from the trial's run: its ``output_dir`` parameter and the ``final_model`` its
``summary.json`` names (a best epoch's checkpoint, or ``averaged.pt``). A sentence-level model translates the
split's lines; a model that reads document context (its BERT's ``[CLS] context [SEP] sentence [SEP]`` stream) decodes
the split as its trial did, from the run's prepared data, so each sentence keeps its document's context. A frozen
BERT's states come from the run's feature cache where it holds these sentences, as in the trial's own decode, so
at the study's penalty the check gives the trial's hypotheses.

  nmtcore lengths --sweep NAME [--lenpens 0.6,1.0,1.4,1.8,2.4] [--out DIR]
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from nmtcore import bleu, tracking
from nmtcore.engine.trainer import tested_file
from nmtcore.sweep import results
from nmtcore.sweep.settings import SweepError

log = logging.getLogger("nmtcore.sweep")

LENPENS = (0.6, 1.0, 1.4, 1.8, 2.4)


class LengthCheckError(SweepError):
    """A sweep, run or checkpoint this check cannot use (one line saying which and why)."""


@dataclass
class TrialDecodes:
    """One trial's decodes: its validation BLEU and length ratio per penalty, the penalty kept, and its test
    hypotheses (and scores) at that penalty."""

    arm: str
    seed: str
    checkpoint: Path
    valid: dict[float, dict[str, float]] = field(default_factory=dict)
    lenpen: float = math.nan
    test_hyps: dict[str, list[str]] = field(default_factory=dict)
    test: dict[str, dict[str, float]] = field(default_factory=dict)


def tested_checkpoint(run: tracking.RunRecord, uri: str) -> Path:
    """The weights a trial tested: ``<output_dir>/checkpoints/<final_model>`` from its run."""
    out = run.params.get("output_dir", "")
    try:
        summary = json.loads(tracking.read_artifact_text(run.run_id, "summary.json", uri))
    except (tracking.TrackingError, OSError, ValueError):
        raise LengthCheckError(f"run {run.run_id}: no summary.json, so which weights it tested is unknown") from None
    name = tested_file(str(summary.get("final_model") or ""))
    save_dir = Path(run.params.get("train.save_dir") or Path(out) / "checkpoints")
    path = save_dir / name
    if not out or not name or not path.is_file():
        raise LengthCheckError(f"run {run.run_id} ({run.tags.get(results.ARM_TAG, '?')}): its tested weights "
                               f"{path} are not on this machine (the check needs the trial's checkpoints)")
    return path


def pick_lenpen(valid: dict[float, dict[str, float]]) -> float:
    """The penalty with the best validation BLEU; ties go to the one nearest 1.0 (the usual default)."""
    return max(valid, key=lambda lp: (round(valid[lp]["bleu"], 6), -abs(lp - 1.0)))


Translate = Callable[[Path, str, list[str], float], list[str]]  # (checkpoint, split, its source lines, lenpen) → hyps


def decode_trial(trial: TrialDecodes, valid: tuple[str, list[str], list[str]], tests: dict[str, tuple[list[str], list[str]]],
                 lenpens: Sequence[float], translate: Translate) -> TrialDecodes:
    """Decode ``trial``'s validation set (``valid``: its split name, sources and references) at each penalty, keep
    the best, decode its test sets with it."""
    valid_name, valid_src, valid_ref = valid
    for lp in lenpens:
        hyps = translate(trial.checkpoint, valid_name, valid_src, lp)
        score = bleu.corpus_bleu(hyps, valid_ref)
        trial.valid[lp] = {"bleu": score.score, "len_ratio": score.len_ratio}
    trial.lenpen = pick_lenpen(trial.valid)
    for split, (src, ref) in tests.items():
        hyps = translate(trial.checkpoint, split, src, trial.lenpen)
        score = bleu.corpus_bleu(hyps, ref)
        trial.test_hyps[split] = hyps
        trial.test[split] = {"bleu": score.score, "bp": score.bp, "len_ratio": score.len_ratio}
    return trial


def compare(trials: list[TrialDecodes], reference: str, refs: dict[str, list[str]], n_bootstrap: int = 1000) -> list[dict[str, Any]]:
    """Each arm against ``reference`` per test set, seeds pooled (the seeds both completed)."""
    rows = []
    by_arm: dict[str, dict[str, TrialDecodes]] = {}
    for t in trials:
        by_arm.setdefault(t.arm, {})[t.seed] = t
    if reference not in by_arm:
        raise LengthCheckError(f"the reference arm {reference!r} has no complete trial to compare with")
    for split, ref in refs.items():
        for arm, seeds in by_arm.items():
            if arm == reference:
                continue
            common = sorted(set(seeds) & set(by_arm[reference]))
            if not common:
                continue
            a = [h for s in common for h in by_arm[reference][s].test_hyps[split]]
            b = [h for s in common for h in seeds[s].test_hyps[split]]
            pooled_ref = ref * len(common)
            res = bleu.paired_bootstrap(a, b, pooled_ref, n_samples=n_bootstrap)
            sa, sb = bleu.corpus_bleu(a, pooled_ref), bleu.corpus_bleu(b, pooled_ref)
            rows.append({"test_set": split, "arm": arm, "reference": reference, "seeds": common,
                         "reference_bleu": sa.score, "reference_bp": sa.bp, "arm_bleu": sb.score, "arm_bp": sb.bp,
                         "delta": res.diff, "ci_low": res.ci_diff[0], "ci_high": res.ci_diff[1],
                         "p": res.p_value_two_sided,
                         "lenpens": {"reference": [by_arm[reference][s].lenpen for s in common],
                                     "arm": [seeds[s].lenpen for s in common]}})
    return rows


def render(sweep: str, lenpens: Sequence[float], trials: list[TrialDecodes], rows: list[dict[str, Any]]) -> str:
    """The check as Markdown: each model's penalty and validation BLEU, then the comparison table."""
    out = [f"### {sweep}: every arm against its reference at equal length", "",
           "Each trial's tested weights decoded again at the length penalty (of " + ", ".join(f"{lp:g}" for lp in lenpens)
           + ") that gives it its best validation BLEU, then its test sets at that penalty; seeds pooled, paired "
           "bootstrap. `BP` near 1.000 on both sides: the Δ is at equal length, not a brevity-penalty effect.", "",
           "| arm | seed | lenpen kept | validation BLEU at each lenpen (length ratio) |", "|---|---|---|---|"]
    for t in sorted(trials, key=lambda t: (t.arm, t.seed)):
        out.append(f"| {t.arm} | {t.seed} | {t.lenpen:g} | " + ", ".join(
            f"{lp:g}: {v['bleu']:.2f} ({v['len_ratio']:.3f})" for lp, v in t.valid.items()) + " |")
    out += ["", "| test set | arm | reference BLEU (BP) | arm BLEU (BP) | ΔBLEU | 95% CI | p |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = "< 0.001" if r["p"] < 0.001 else f"{r['p']:.3f}"
        out.append(f"| {r['test_set']} | {r['arm']} | {r['reference_bleu']:.2f} ({r['reference_bp']:.3f}) | "
                   f"{r['arm_bleu']:.2f} ({r['arm_bp']:.3f}) | {r['delta']:+.2f} | [{r['ci_low']:+.2f}, {r['ci_high']:+.2f}] | {p} |")
    return "\n".join(out) + "\n"


_LOADED: dict[Path, Any] = {}  # the model being decoded (one in memory at a time)


def _translator(checkpoint: Path) -> Any:
    """The checkpoint's model, vocabulary and config (its own, as it trained), loaded once."""
    from nmtcore.decoding import load_translator

    translator = _LOADED.get(checkpoint)
    if translator is None:
        _LOADED.clear()
        translator = _LOADED[checkpoint] = load_translator(checkpoint)
    return translator


_PREPARED: dict[Path, Any] = {}  # a document model's prepared data (its splits with their BERT streams)


def reads_documents(model: Any) -> bool:
    """Whether ``model``'s BERT reads a context segment (a document model: the previous, a random or a fixed
    sentence), which a lone line does not carry."""
    from nmtcore.bert import bert_layers

    layers = bert_layers(model)
    return bool(layers) and (layers[0].context_source is not None or layers[0].cfg.context == "previous")


def _document_split(checkpoint: Path, split: str, lines: list[str]) -> Any:
    """``split`` as the run's data prepares it for ``checkpoint``'s model (documents, context, BERT stream and
    cached features), prepared once per checkpoint."""
    from nmtcore.bert import prepare_bert_inputs
    from nmtcore.data import prepare_data

    translator = _translator(checkpoint)
    data = _PREPARED.get(checkpoint)
    if data is None:
        _PREPARED.clear()
        data = prepare_data(translator.cfg.data)
        if data.vocab.checksum != translator.vocab.checksum:
            raise LengthCheckError(f"{checkpoint}: the run's data prepares another vocabulary than the one it trained "
                                   "with (its data or cache changed since)")
        prepare_bert_inputs(translator.model, data)
        _PREPARED[checkpoint] = data
    if split not in data.splits or list(data.splits[split].raw_src) != list(lines):
        raise LengthCheckError(f"{checkpoint}: the run's data has no split {split!r} with these {len(lines)} sources")
    return data.splits[split]


def _translate(checkpoint: Path, split: str, lines: list[str], lenpen: float) -> list[str]:
    """Beam search with ``checkpoint``'s own decoding settings and ``lenpen``: the lines, or for a document model
    the run's prepared split (each sentence with its context)."""
    from nmtcore.decoding import translate_split

    translator = _translator(checkpoint)
    translator.cfg = translator.cfg.with_overrides({"decode.lenpen": lenpen})
    if not reads_documents(translator.model):
        return translator.translate(lines)
    return translate_split(translator.model, _document_split(checkpoint, split, lines), translator.vocab,
                           translator.cfg.decode, translator.device)


def check_sweep(sweep: str, tracking_uri: str | os.PathLike | None = None, lenpens: Sequence[float] = LENPENS,
                out_dir: str | os.PathLike | None = None, n_bootstrap: int = 1000,
                translate: Translate = _translate) -> tuple[str, list[Path], Any]:
    """Run the check on a finished sweep; write ``lengths.md`` and ``lengths.json`` to ``out_dir``. Returns the
    Markdown, the files and the sweep's report (its parent run and store)."""
    from nmtcore.data import load_split

    rep = results.build_report(sweep, tracking_uri, n_bootstrap=0)
    if rep.reference is None:
        raise LengthCheckError(f"sweep {sweep}: no reference arm (control) to compare with")
    runs = [(g.label, r) for g in rep.groups for r in g.runs if results.trial_state(r) == "complete"]
    if not runs:
        raise LengthCheckError(f"sweep {sweep}: no complete trial")
    checkpoints = [tested_checkpoint(run, rep.tracking_uri) for _, run in runs]
    cfg = _translator(checkpoints[0]).cfg  # where its data is: the trial's own config
    valid = load_split(cfg.data, cfg.data.valid_split)
    tests: dict[str, tuple[list[str], list[str]]] = {}
    for split in rep.test_splits:
        src = load_split(cfg.data, split).src
        ref_text = tracking.read_artifact_text(runs[0][1].run_id, f"references/{split}.{cfg.data.tgt_lang}",
                                               rep.tracking_uri)
        tests[split] = (src, ref_text.splitlines())
    trials = []
    for (label, run), checkpoint in zip(runs, checkpoints):
        t = TrialDecodes(arm=label, seed=run.tags.get(results.SEED_TAG, ""), checkpoint=checkpoint)
        log.info("lengths: %s seed %s: %s", t.arm, t.seed, t.checkpoint)
        trials.append(decode_trial(t, (cfg.data.valid_split, valid.src, valid.tgt), tests, lenpens, translate))
    rows = compare(trials, rep.reference.label, {s: r for s, (_, r) in tests.items()}, n_bootstrap)
    text = render(rep.sweep, lenpens, trials, rows)
    out = Path(out_dir or Path("reports") / rep.sweep)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"sweep": rep.sweep, "lenpens": list(lenpens), "rows": rows,
               "trials": [{"arm": t.arm, "seed": t.seed, "checkpoint": str(t.checkpoint), "lenpen": t.lenpen,
                           "valid": {str(k): v for k, v in t.valid.items()}, "test": t.test} for t in trials]}
    files = [out / "lengths.md", out / "lengths.json"]
    files[0].write_text(text, encoding="utf-8")
    files[1].write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")
    return text, files, rep
