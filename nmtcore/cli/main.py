"""``nmtcore`` command line: train, translate, evaluate, report, export / import, lengths, retest, rediagnose,
bert-pretrain.

Every error a user can cause (bad config key, missing data, corrupt checkpoint...) ends as one line on
stderr and exit status 2; tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from nmtcore.allocator import reexec_with_allocator
from nmtcore.cli.errors import USER_ERRORS
from nmtcore.config import PRESETS, ConfigError, ExperimentConfig, parse_overrides, preset
from nmtcore.interrupts import interrupt


def _experiment_config(args: argparse.Namespace) -> ExperimentConfig:
    cfg = ExperimentConfig.from_yaml(args.config) if args.config else preset(args.preset)
    overrides: dict[str, Any] = parse_overrides(args.set or [])
    if args.data_dir:
        overrides["data.data_dir"] = str(Path(args.data_dir).resolve())
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    return cfg.with_overrides(overrides) if overrides else cfg


def cmd_train(args: argparse.Namespace) -> int:
    """``nmtcore train``: one experiment (preset or YAML, overrides), resumed from its checkpoints unless
    ``--no-resume``, tracked in MLflow; prints its summary as JSON."""
    from nmtcore import tracking
    from nmtcore.engine import run_experiment
    from nmtcore.tracking.callback import TrackingCallback

    cfg = _experiment_config(args)
    # Before the MLflow run starts and before any data is read: a run that cannot save fails at once.
    check_writable_dir(cfg.output_dir, "output_dir")
    if cfg.train.save_dir:
        check_writable_dir(cfg.train.save_dir, "train.save_dir")
    if args.no_track:
        summary = run_experiment(cfg, resume=not args.no_resume)
    else:
        # The tracker ends the run FAILED (reason tagged) if training raises, FINISHED otherwise.
        with tracking.Tracker(tracking_uri=args.tracking_uri, experiment=args.experiment or cfg.name,
                              run_name=args.run_name) as tracker:
            summary = run_experiment(cfg, callbacks=[TrackingCallback(tracker, cfg)], resume=not args.no_resume)
    out = summary.to_dict()
    if not args.no_track:
        out.update(mlflow_run_id=tracker.run_id, tracking_uri=tracker.tracking_uri)
    print(json.dumps(out, indent=2, default=str))
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    """``nmtcore translate``: a checkpoint translates a file or stdin (beam or greedy); the output is written
    whole at the end, to ``--output`` atomically or to stdout."""
    from nmtcore.files import atomic_write_bytes
    from nmtcore.data import decode_lines, read_lines
    from nmtcore.decoding import load_translator

    if args.output != "-":
        if Path(args.output).is_dir():
            raise ConfigError(f"--output: {args.output} is a directory")
        check_writable_dir(Path(args.output).absolute().parent, "--output")
    # Undecodable input is a one-line error naming the file and line, not a traceback.
    lines = decode_lines(sys.stdin.buffer.read(), "<stdin>") if args.input == "-" else read_lines(Path(args.input))
    translator = load_translator(Path(args.checkpoint), overrides=parse_overrides(args.set or []))
    text = "".join(hyp + "\n" for hyp in translator.translate(lines))
    if args.output == "-":
        sys.stdout.write(text)
    else:  # written whole or not at all: a failed run never leaves half a file of hypotheses
        atomic_write_bytes(Path(args.output), text.encode("utf-8"))
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    """``nmtcore evaluate``: sacreBLEU and chrF of a hypothesis file against references, with signatures."""
    from nmtcore import bleu
    from nmtcore.data import DataError, read_lines

    for path in (args.hyp, args.ref, *([args.against] if args.against else [])):
        read_lines(Path(path))  # a missing or undecodable file: one line naming it (and the line)
    try:
        scores = bleu.evaluate_files(args.hyp, args.ref)
        if args.against:  # the hypotheses against another system's on the same references
            scores["against"] = bleu.compare_files(args.hyp, args.against, args.ref, n_samples=args.bootstrap)
    except ValueError as e:  # the files' line counts differ (both named)
        raise DataError(str(e)) from None
    print(json.dumps(scores, indent=2))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``nmtcore report``: a sweep's tables and figures rebuilt from MLflow alone, written to a folder."""
    from nmtcore import tracking
    from nmtcore.sweep import report

    sweeps = args.sweep if len(args.sweep) > 1 else args.sweep[0]
    rep = report.build_report(sweeps, tracking_uri=args.tracking_uri, n_bootstrap=args.bootstrap, against=args.against,
                              same_arms=[tuple(pair) for pair in args.same_arm])
    out = Path(args.out or Path("reports") / "+".join(args.sweep))
    if args.against and not args.out:
        out = out / f"against-{args.against}"
    files = report.write_report(rep, out.resolve())
    # A pooled report belongs to no one sweep's run; one against another arm does not replace the sweep's own.
    log = not args.no_log and not rep.pooled and not args.against
    if log:
        tracking.log_run_artifacts(rep.parent_run_id, files, "report", rep.tracking_uri)
    print(report.render_markdown(rep))
    print("\n".join(f"wrote {f}" for f in files))
    if log:
        print(f"logged to MLflow run {rep.parent_run_id} (artifacts report/) in {rep.tracking_uri}")
    elif rep.pooled:
        print("a pooled report is not logged to MLflow (it belongs to no one sweep's run)")
    elif args.against:
        print(f"a report against {args.against!r} is not logged to MLflow (the sweep's report is the one against its "
              "control)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """``nmtcore export``: a sweep's MLflow record (what its report reads) in one file."""
    from nmtcore.sweep import archive

    done = archive.export_sweep(args.sweep, args.out, args.tracking_uri)
    print(f"wrote {done.where}: sweep {done.sweep!r}, {done.trial_runs} trial runs, "
          f"{Path(done.where).stat().st_size / 1e6:.1f} MB")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    """``nmtcore import``: a sweep exported by ``nmtcore export`` recreated in this store."""
    from nmtcore import tracking
    from nmtcore.sweep import archive

    done = archive.import_sweep(args.archive, args.tracking_uri)
    print(f"imported sweep {done.sweep!r} ({done.trial_runs} trial runs) as parent run {done.where} in "
          f"{tracking.resolve_tracking_uri(args.tracking_uri)}; nmtcore report --sweep {done.sweep} reads it")
    return 0


def cmd_lengths(args: argparse.Namespace) -> int:
    """``nmtcore lengths``: every arm of a finished sweep against its control at equal output length."""
    from nmtcore import tracking
    from nmtcore.sweep import lengths

    try:
        lenpens = tuple(float(x) for x in args.lenpens.split(","))
    except ValueError:
        raise ConfigError(f"--lenpens: a comma list of numbers, got {args.lenpens!r}") from None
    if not lenpens or any(lp < 0 for lp in lenpens):
        raise ConfigError(f"--lenpens: non-negative numbers, got {args.lenpens!r}")
    text, files, rep = lengths.check_sweep(args.sweep, args.tracking_uri, lenpens, args.out, n_bootstrap=args.bootstrap)
    print(text)
    print("\n".join(f"wrote {f}" for f in files))
    if not args.no_log:
        tracking.log_run_artifacts(rep.parent_run_id, files, "report", rep.tracking_uri)
        print(f"logged to MLflow run {rep.parent_run_id} (artifacts report/) in {rep.tracking_uri}")
    return 0


def cmd_retest(args: argparse.Namespace) -> int:
    """``nmtcore retest``: a sweep's complete trials decoded on test splits it did not test, scored into its runs."""
    from nmtcore.sweep import retest

    done = retest.retest_sweep(args.sweep, args.splits.split(","), args.tracking_uri, again=args.again)
    print("decoded: " + ", ".join(f"{split} {n} trial(s)" for split, n in done.items())
          + f"; nmtcore report --sweep {args.sweep} now tests every arm on them")
    return 0


def cmd_rediagnose(args: argparse.Namespace) -> int:
    """``nmtcore rediagnose``: a sweep's complete trials measured again by today's diagnostics, into their runs."""
    from nmtcore.sweep import rediagnose

    logged = rediagnose.rediagnose_sweep(args.sweep, args.tracking_uri, again=args.again)
    n = sum(1 for names in logged.values() if names)
    print(f"measured {len(logged)} trial(s), {n} with figures logged; nmtcore report --sweep {args.sweep} shows them")
    return 0


def cmd_bert_pretrain(args: argparse.Namespace) -> int:
    """``nmtcore bert-pretrain``: masked-LM pretraining of a BERT of any size on one side of a corpus, cached."""
    from nmtcore.bert.made_here import DEFAULT_STEPS, PretrainSpec
    from nmtcore.bert.pretrain import pretrain_bert
    from nmtcore.config import DataConfig

    spec = PretrainSpec(args.layers, args.hidden, args.corpus, args.lang, args.steps or DEFAULT_STEPS, args.seed,
                        args.vocab_size, args.max_length)
    data_cfg = DataConfig(corpus=args.corpus, data_dir=str(Path(args.data_dir).resolve()) if args.data_dir else "",
                          cache_dir=args.cache_dir or "", download=not args.no_download)
    result = pretrain_bert(spec, data_cfg, threads=args.threads or None, force=args.force, progress=print)
    print(json.dumps({"name": result.name, "path": str(result.path), "cached": result.cached,
                      **result.metrics}, indent=2))
    return 0


def _bert_data(args: argparse.Namespace) -> Any:
    from nmtcore.config import DataConfig

    return DataConfig(data_dir=str(Path(args.data_dir).resolve()) if args.data_dir else "",
                      cache_dir=args.cache_dir or "", download=not args.no_download)


def cmd_baselines(args: argparse.Namespace) -> int:
    """``nmtcore baselines``: the shared baselines in the store, one line each."""
    from nmtcore.config import DataConfig
    from nmtcore.sweep.baseline import stored_baselines

    root = Path(args.root) if args.root else DataConfig().resolved_cache_dir() / "baselines"
    rows = stored_baselines(root)
    print(f"{root}: {len(rows)} baseline(s)")
    for r in rows:
        state = ("converged" if r["converged"] else "finished, not converged") if r["finished"] else "part-trained"
        adopted = f"; adopted as {', '.join(k[:12] for k in r['adopted_as'])}" if r["adopted_as"] else ""
        print(f"  {r['key']}  {state}, {r['epochs']} epochs{adopted}")
    return 0


def cmd_bert_build(args: argparse.Namespace) -> int:
    """``nmtcore bert-build``: make (or find) a BERT by name, print where and what it is (and its quality
    figure with ``--quality``)."""
    from dataclasses import asdict

    import torch

    from nmtcore.bert.ensure import build_bert
    from nmtcore.bert.quality import quality_of
    from nmtcore.config import BertConfig

    data = _bert_data(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    bc = BertConfig(name=args.name, cache_dir=str(data.resolved_cache_dir()))
    resolved = build_bert(bc, data, threads=args.threads or None, progress=print)
    out: dict = {"name": args.name, "path": str(resolved.path), "source": resolved.source}
    if args.quality:
        out["quality"] = asdict(quality_of(resolved, args.lang, data, data.resolved_cache_dir()))
    meta = resolved.meta()
    out["meta"] = {k: v for k, v in meta.items() if k not in ("tensors", "heldout_curve", "quality")}
    print(json.dumps(out, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``nmtcore`` command line: one subcommand per ``cmd_*`` function."""
    p = argparse.ArgumentParser(prog="nmtcore", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one experiment, decode its test sets, log to MLflow")
    t.add_argument("--preset", default="multi30k_small", choices=sorted(PRESETS))
    t.add_argument("--config", help="YAML experiment config (instead of --preset)")
    t.add_argument("--set", nargs="*", action="extend", metavar="KEY=VALUE",
                   help="dotted overrides, e.g. train.lr=1e-3 (--set may be given more than once)")
    t.add_argument("--data-dir", help="directory holding the corpora (default: $NMTCORE_DATA)")
    t.add_argument("--output-dir")
    t.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    t.add_argument("--experiment", help="MLflow experiment name (default: the config's name)")
    t.add_argument("--run-name")
    t.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    t.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in the output dir")
    t.set_defaults(func=cmd_train, trains=True)

    tr = sub.add_parser("translate", help="translate a file or stdin with a checkpoint")
    tr.add_argument("--checkpoint", required=True)
    tr.add_argument("--input", default="-")
    tr.add_argument("--output", default="-")
    tr.add_argument("--set", nargs="*", action="extend", metavar="KEY=VALUE",
                    help="decode overrides, e.g. decode.beam=1 (--set may be given more than once)")
    tr.set_defaults(func=cmd_translate)

    ev = sub.add_parser("evaluate", help="sacreBLEU and chrF of a hypothesis file against references")
    ev.add_argument("--hyp", required=True)
    ev.add_argument("--ref", required=True)
    ev.add_argument("--against", metavar="HYP", help="another system's hypotheses of the same source: adds "
                    "ΔBLEU (--hyp minus these), its 95%% interval and two-sided p from a paired bootstrap")
    ev.add_argument("--bootstrap", type=int, default=1000, help="bootstrap resamples for --against")
    ev.set_defaults(func=cmd_evaluate)

    rp = sub.add_parser("report", help="a sweep's table and figures, from MLflow alone")
    rp.add_argument("--sweep", required=True, action="append",
                    help="the sweep's name or its MLflow parent run id; given again, one report over the sweeps' runs "
                         "pooled (the same study run again with other seeds; other studies' with --same-arm)")
    rp.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    rp.add_argument("--out", help="output folder (default: reports/<sweep>)")
    rp.add_argument("--bootstrap", type=int, default=1000, help="paired-bootstrap samples (0 = no p-values)")
    rp.add_argument("--no-log", action="store_true", help="do not attach the report to the parent run")
    rp.add_argument("--against", metavar="ARM",
                    help="compare every configuration with this arm instead of the control (e.g. an ablation's full "
                         "model, the paper's own reference row); written to <out>/against-<ARM> and not attached to "
                         "the sweep's run, whose report stays the one against the control")
    rp.add_argument("--same-arm", metavar=("A", "B"), nargs=2, action="append", default=[],
                    help="pool sweeps of different studies where their arm A and arm B are one configuration under two "
                         "names (a size grid's L4-H384 and BERT-fused's bert_fused on the BERT that size resolves "
                         "to): B's runs join A's row, the controls join one row; refused unless both are one "
                         "configuration but for seed and BERT naming. Repeatable")
    rp.set_defaults(func=cmd_report)

    ex = sub.add_parser("export", help="a sweep's MLflow record (runs, metrics, the report's artifacts) in one file, "
                                       "to rebuild its report in another store (nmtcore import)")
    ex.add_argument("--sweep", required=True, help="the sweep's name or its MLflow parent run id")
    ex.add_argument("--out", required=True, help="the file to write (gzip'd JSON, e.g. <sweep>.json.gz)")
    ex.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    ex.set_defaults(func=cmd_export)

    im = sub.add_parser("import", help="recreate a sweep written by nmtcore export in this MLflow store")
    im.add_argument("archive", help="the file nmtcore export wrote")
    im.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    im.set_defaults(func=cmd_import)

    ln = sub.add_parser("lengths", help="a finished sweep's arms against its control at equal output length: each "
                                        "trial's tested weights decoded at the length penalty best on validation")
    ln.add_argument("--sweep", required=True, help="the sweep's name or its MLflow parent run id")
    ln.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    ln.add_argument("--lenpens", default="0.6,1.0,1.4,1.8,2.4", help="length penalties tried on validation")
    ln.add_argument("--out", help="output folder (default: reports/<sweep>)")
    ln.add_argument("--bootstrap", type=int, default=1000, help="paired-bootstrap samples")
    ln.add_argument("--no-log", action="store_true", help="do not attach the result to the parent run")
    ln.set_defaults(func=cmd_lengths)

    rt = sub.add_parser("retest", help="a sweep's complete trials decoded on test splits it did not test (each "
                                       "trial's tested weights, its own decoding), scored into its runs for report")
    rt.add_argument("--sweep", required=True, help="the sweep's name or its MLflow parent run id")
    rt.add_argument("--splits", required=True, help="comma list of test splits, e.g. test_2017_flickr")
    rt.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    rt.add_argument("--again", action="store_true", help="decode trials that have scores on these splits again "
                                                         "(the new scores replace theirs)")
    rt.set_defaults(func=cmd_retest)

    rd = sub.add_parser("rediagnose", help="a sweep's complete trials measured again by this version's diagnostics "
                                           "(how each arm used BERT: switches and probes added since it ran), "
                                           "the figures their runs lack logged into them for report")
    rd.add_argument("--sweep", required=True, help="the sweep's name or its MLflow parent run id")
    rd.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    rd.add_argument("--again", action="store_true", help="log every figure, replacing those the runs have")
    rd.set_defaults(func=cmd_rediagnose)

    bp = sub.add_parser("bert-pretrain", help="masked-LM pretraining of a BERT of any size L x H on one side of a "
                                              "corpus (cached; resolves as pretrained-here:L<L>-H<H>:<corpus>:<lang>)")
    bp.add_argument("--layers", type=int, required=True, help="L, number of Transformer layers")
    bp.add_argument("--hidden", type=int, required=True, help="H, hidden size (a multiple of 64; H/64 heads)")
    bp.add_argument("--corpus", default="multi30k", help="registered corpus (default: multi30k)")
    bp.add_argument("--lang", default="en", help="which side of it (default: en)")
    bp.add_argument("--steps", type=int, help="MLM updates (default: model.bert.pretrain_steps' default)")
    bp.add_argument("--seed", type=int, default=1)
    bp.add_argument("--vocab-size", type=int, default=8000, help="WordPiece vocabulary size")
    bp.add_argument("--max-length", type=int, default=128, help="BERT positions")
    bp.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    bp.add_argument("--data-dir", help="directory holding the corpora (default: $NMTCORE_DATA)")
    bp.add_argument("--cache-dir", help="cache root (default: $NMTCORE_CACHE or ~/.cache/nmtcore)")
    bp.add_argument("--no-download", action="store_true", help="never download the corpus")
    bp.add_argument("--force", action="store_true", help="pretrain again even if the result is cached")
    bp.set_defaults(func=cmd_bert_pretrain, trains=True)

    bl = sub.add_parser("baselines", help="the shared baselines stored here: key, finished, converged, epochs, "
                                          "keys adopted onto it")
    bl.add_argument("--root", help="the store (default: $NMTCORE_CACHE/baselines or ~/.cache/nmtcore/baselines)")
    bl.set_defaults(func=cmd_baselines)

    bb = sub.add_parser("bert-build", help="make (or find) a BERT by name and print where it is and what it is: "
                                           "minilm | mpnet | e5 [:L<k>], distilled:L2-H128, pretrained-here:…")
    bb.add_argument("name", help="e.g. minilm:L2, mpnet:L4, e5:L6, distilled:L2-H128, a hub id or a directory")
    bb.add_argument("--quality", action="store_true",
                    help="also measure (once; cached) its quality figure on held-out Multi30k text")
    bb.add_argument("--lang", default="en", help="language of the quality probe's text (default: en)")
    bb.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    bb.add_argument("--data-dir", help="directory holding the corpora (default: $NMTCORE_DATA)")
    bb.add_argument("--cache-dir", help="cache root (default: $NMTCORE_CACHE or ~/.cache/nmtcore)")
    bb.add_argument("--no-download", action="store_true", help="never download a corpus")
    bb.set_defaults(func=cmd_bert_build)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``nmtcore`` with ``argv`` (default: the process's); returns the exit status: 0, 2 for bad input
    (one line), 1 for a training run that diverged (one line: where, which figure, what to try), 128 + the
    signal's number when SIGTERM or SIGINT stopped it (one line)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Schedulers stop jobs with SIGTERM, people with Ctrl-C: both unwind as KeyboardInterrupt, so the MLflow run
    # ends KILLED (not left RUNNING), checkpoints already written stay the resume point, and the command ends with
    # one line and the shell's status for that signal (128 + its number).
    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if argv is None and getattr(args, "trains", False):
            # The console command only (a caller's own process, a test's or a notebook's, is never replaced):
            # start again on tcmalloc where it is installed (nmtcore.allocator), before anything is allocated.
            reexec_with_allocator()
        return args.func(args)
    except USER_ERRORS as e:
        print(f"nmtcore: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2
    except FloatingPointError as e:  # the engine's NonFiniteLossError: a run that diverged, its message one line
        print(f"nmtcore: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        kept = ("the checkpoints written so far are kept: the same command resumes from the last one"
                if getattr(args, "trains", False) else "no output was written (it is written whole at the end)"
                if args.func is cmd_translate else "nothing was left half-written")
        print(f"nmtcore: stopped by {signal.Signals(signum).name}; {kept}", file=sys.stderr)
        return 128 + int(signum)
    finally:  # a caller's process (a test, a notebook) gets its own handlers back
        for sig, handler in before.items():
            signal.signal(sig, handler)


def check_writable_dir(path: str | os.PathLike, key: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` unless directory ``path`` exists or can be
    created, and is writable.

    Probes with a real write (a temporary directory in the nearest existing ancestor, removed at once):
    as root, permission bits say nothing (``/proc``, read-only mounts), and the probe leaves nothing behind.
    """
    target = Path(path).expanduser().absolute()
    ancestor = target
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if ancestor == target and not target.is_dir():
        raise ConfigError(f"{key}: {target} is not a directory")
    if not ancestor.is_dir():
        raise ConfigError(f"{key}: cannot create directory {target}: {ancestor} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nmtcore-write-check-", dir=ancestor))
    except OSError as e:
        where = "" if ancestor == target else f" (cannot create it in {ancestor})"
        raise ConfigError(f"{key}: directory {target} is not writable{where}: {e.strerror or e}") from None


