"""More test sets for a sweep that has run: every complete trial decoded on a test split its sweep did not test.

A study names its test sets before it trains (``data.test_splits``); a reader of its report may later want another
one, e.g. Multi30k's ``test_2017_flickr`` beside ``test_2016_flickr`` when the two disagree with validation. Training
again for that would cost the whole study. This decodes each complete trial's tested weights (its ``summary.json``'s
``final_model``: the best epoch's checkpoint, or ``averaged.pt``) on the new split exactly as its trial decoded its
own test sets: the checkpoint's config, with the split added to ``data.test_splits``, prepares the data, so the
vocabulary, the BERT stream (a document model's context included) and a frozen BERT's features (through the run's
feature cache, as a test set's are) are the trial's; the run's own decoding settings (beam, length penalty)
translate it. The scores go into the trial's run as its test sets' do (``test/<split>/...`` at the run's final step,
the hypotheses and references as artifacts, BLEU's signature), with the tag ``nmtcore.retested.<split>`` saying when
and with which code. The sweep's parent run lists the split under ``nmtcore.test_splits_added``, which
``nmtcore report`` adds to the sweep's own test sets and names in the report's head.

A trial that already has scores on the split keeps them (``again``: decoded anew). A trial that completes later (a
sweep resumed after this ran) is decoded on the split when its sweep finishes, before the report
(:func:`nmtcore.sweep.driver.retest_added`); until then the report warns that it lacks it. The validation split,
which chose each trial's tested weights, and the training split are refused.

  nmtcore retest --sweep NAME --splits test_2017_flickr [--tracking-uri URI]
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from nmtcore import tracking
from nmtcore.sweep.lengths import tested_checkpoint
from nmtcore.sweep.lifecycle import ARM_TAG, find_sweep_run, sweep_children, trial_state
from nmtcore.sweep.settings import SweepError
from nmtcore.tracking import schema


class RetestError(SweepError):
    """A sweep, split or checkpoint this command cannot use (one line saying which and why)."""


@dataclass
class Decoded:
    """One split decoded by one trial's tested weights: its hypotheses, the references, and the seconds it took."""

    hyps: list[str]
    refs: list[str]
    wall_s: float


Decode = Callable[[Path, str, int], Decoded]  # (checkpoint, split, threads) → its decode


def decode_as_tested(checkpoint: Path, split: str, threads: int = 0) -> Decoded:
    """``split`` decoded by ``checkpoint`` as its run decodes a test set: data prepared from its own config with
    ``split`` added to the test sets, its BERT's stream and (frozen, cached) features, its decoding settings, on
    ``threads`` threads (0: as many as torch has), the trial's count: another one can change a bf16 decode's last
    bits, and with them a tie between two beams."""
    import torch

    was = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        return _decode(checkpoint, split)
    finally:
        torch.set_num_threads(was)


def _decode(checkpoint: Path, split: str) -> Decoded:
    from nmtcore.bert import prepare_bert_inputs
    from nmtcore.bert.features import FeatureCache
    from nmtcore.data import prepare_data
    from nmtcore.decoding import load_translator, translate_split

    translator = load_translator(checkpoint)
    cfg = translator.cfg
    data_cfg = dataclasses.replace(cfg.data, test_splits=tuple(dict.fromkeys((*cfg.data.test_splits, split))))
    data = prepare_data(data_cfg)
    if data.vocab.checksum != translator.vocab.checksum:
        raise RetestError(f"{checkpoint}: its data prepares another vocabulary than the one it trained with (its "
                          "data or cache changed since)")
    bl = prepare_bert_inputs(translator.model, data, stream_only=True)  # every split's stream: a context may need train
    encoded = data.splits[split]
    if bl is not None and bl.cache_wanted:  # a test set's frozen-BERT features, from the run's cache (built if absent)
        bl.attach_features(FeatureCache(data.cfg.resolved_cache_dir() / "bert_features"), split, encoded.bert)
    t0 = time.perf_counter()
    hyps = translate_split(translator.model, encoded, translator.vocab, cfg.decode, translator.device)
    return Decoded(hyps, list(encoded.raw_tgt), time.perf_counter() - t0)


def check_splits(splits: Sequence[str], tested: Sequence[str], valid_split: str,
                 train_split: str = "train") -> list[str]:
    """The splits to add, in order and once each: :class:`RetestError` for none, for one the sweep tested already,
    for its validation split (it chose each trial's tested weights) and for its training split."""
    wanted = list(dict.fromkeys(s.strip() for s in splits if s.strip()))
    if not wanted:
        raise RetestError("--splits: name at least one test split")
    for split in wanted:
        if split in tested:
            raise RetestError(f"{split}: the sweep tested it already (its test sets: {', '.join(tested)})")
        if split == valid_split:
            raise RetestError(f"{split}: the validation split chose each trial's tested weights, so it is no test set")
        if split == train_split:
            raise RetestError(f"{split}: the training split is no test set")
    return wanted


def final_step(run_id: str, uri: str, tested: Sequence[str]) -> int:
    """The step the trial logged its own test scores at (its epochs), so the new split's sit beside them."""
    metrics = tracking.get_run_metrics(run_id, uri)
    for split in tested:
        points = metrics.get(f"test/{split}/bleu")
        if points:
            return int(points[-1][0])
    return max((int(step) for step, _ in metrics.get("valid_loss", [])), default=0)


def trial_threads(run: tracking.RunRecord) -> int:
    """The threads a trial decoded its test sets on: the most it used (idle CPUs borrowed), else its own count."""
    return int(run.tags.get(schema.MAX_THREADS) or run.params.get("train.num_threads") or 0)


def retest_sweep(sweep: str, splits: Sequence[str], tracking_uri: str | os.PathLike | None = None,
                 decode: Decode = decode_as_tested, say: Callable[[str], None] = print,
                 again: bool = False) -> dict[str, int]:
    """Decode every complete trial of ``sweep`` on each of ``splits`` and log the scores in its run; record each split
    on the parent run once all its trials have scores. Returns how many trials were decoded per split (a trial that
    had scores on it keeps them, unless ``again``: then the new ones replace them)."""
    from nmtcore.engine.experiment import score_test
    from nmtcore.tracking.callback import test_metrics
    from nmtcore.tracking.provenance import provenance_tags

    uri = tracking.resolve_tracking_uri(tracking_uri)
    parent = find_sweep_run(sweep, uri)
    recorded = schema.SweepTags.from_tags(parent.tags, default_name=sweep)
    runs = [r for r in sweep_children(parent.run_id, uri) if trial_state(r) == "complete"]
    if not runs:
        raise RetestError(f"sweep {recorded.name}: no complete trial to decode")
    params = runs[0].params
    wanted = check_splits(splits, recorded.test_splits, params.get("data.valid_split", "val"),
                          params.get("data.train_split", "train"))
    checkpoints = {r.run_id: tested_checkpoint(r, uri) for r in runs}  # every one found before the first decode
    code = provenance_tags({}).get(schema.GIT_SHA, "?")
    added = list(recorded.added_test_splits)
    done = {split: 0 for split in wanted}
    with tempfile.TemporaryDirectory(prefix="nmtcore-retest-") as tmp:
        for split in wanted:
            for run in runs:
                label = f"{run.tags.get(ARM_TAG, '?')} seed {run.tags.get(schema.SEED, '?')}"
                if f"test/{split}/bleu" in run.metrics and not again:
                    say(f"retest {split}: {label}: scored already ({run.metrics[f'test/{split}/bleu']:.2f}), kept")
                    continue
                decoded = decode(checkpoints[run.run_id], split, trial_threads(run))
                name = f"{split}.{run.params.get('data.tgt_lang', '')}"  # the file names the report reads
                hyp_path, ref_path = (Path(tmp, run.run_id, what, name) for what in ("hypotheses", "references"))
                for path, lines in ((hyp_path, decoded.hyps), (ref_path, decoded.refs)):
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
                scores = score_test(decoded.hyps, decoded.refs, hyp_path, decoded.wall_s)
                tracking.log_run_metrics(run.run_id, test_metrics(split, scores),
                                         final_step(run.run_id, uri, recorded.test_splits), uri)
                tracking.log_run_artifacts(run.run_id, [hyp_path], "hypotheses", uri)
                tracking.log_run_artifacts(run.run_id, [ref_path], "references", uri)
                tracking.set_run_tags(run.run_id, {
                    schema.bleu_signature(split): scores.signature,
                    schema.RETESTED_PREFIX + split: f"{time.strftime('%Y-%m-%dT%H:%M:%S')}, code {code}, "
                                                    f"weights {checkpoints[run.run_id].name}"}, uri)
                done[split] += 1
                say(f"retest {split}: {label}: BLEU {scores.bleu:.2f}, chrF {scores.chrf:.2f} "
                    f"({len(decoded.hyps)} sentences in {decoded.wall_s:.0f} s)")
            added = list(dict.fromkeys((*added, split)))
            tracking.set_run_tags(parent.run_id, {schema.TEST_SPLITS_ADDED: ",".join(added)}, uri)
    return done
