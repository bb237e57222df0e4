"""``nmtcore`` command line: train, translate, evaluate.

Every error a user can cause (bad config key, missing data, corrupt checkpoint...) ends as one line on
stderr and exit status 2; tracebacks are for bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from nmtcore.config import ConfigError, ExperimentConfig, parse_overrides, preset, PRESETS


def _experiment_config(args: argparse.Namespace) -> ExperimentConfig:
    cfg = ExperimentConfig.from_yaml(args.config) if args.config else preset(args.preset)
    overrides: dict[str, Any] = parse_overrides(args.set or [])
    if args.data_dir:
        overrides["data.data_dir"] = str(Path(args.data_dir).resolve())
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    return cfg.with_overrides(overrides) if overrides else cfg


def cmd_train(args: argparse.Namespace) -> int:
    from nmtcore import tracking
    from nmtcore.train import run_experiment

    cfg = _experiment_config(args)
    if args.no_track:
        summary = run_experiment(cfg, resume=not args.no_resume)
    else:
        # The tracker ends the run FAILED (reason tagged) if training raises, FINISHED otherwise.
        with tracking.Tracker(tracking_uri=args.tracking_uri, experiment=args.experiment or cfg.name,
                              run_name=args.run_name) as tracker:
            summary = run_experiment(cfg, callbacks=[tracking.TrackingCallback(tracker, cfg)],
                                     resume=not args.no_resume)
            summary["mlflow_run_id"] = tracker.run_id
            summary["tracking_uri"] = tracker.tracking_uri
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from nmtcore.translate import load_translator

    translator = load_translator(Path(args.checkpoint), overrides=parse_overrides(args.set or []))
    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    out = sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    with src, out:
        lines = [line.rstrip("\n") for line in src]
        for hyp in translator.translate(lines):
            out.write(hyp + "\n")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from nmtcore import bleu

    print(json.dumps(bleu.evaluate_files(args.hyp, args.ref), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nmtcore", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train one experiment, decode its test sets, log to MLflow")
    t.add_argument("--preset", default="multi30k_small", choices=sorted(PRESETS))
    t.add_argument("--config", help="YAML experiment config (instead of --preset)")
    t.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. train.lr=1e-3")
    t.add_argument("--data-dir", help="directory holding the corpora (default: $NMTCORE_DATA)")
    t.add_argument("--output-dir")
    t.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or a local sqlite store)")
    t.add_argument("--experiment", help="MLflow experiment name (default: the config's name)")
    t.add_argument("--run-name")
    t.add_argument("--no-track", action="store_true", help="do not log to MLflow")
    t.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in the output dir")
    t.set_defaults(func=cmd_train)

    tr = sub.add_parser("translate", help="translate a file or stdin with a checkpoint")
    tr.add_argument("--checkpoint", required=True)
    tr.add_argument("--input", default="-")
    tr.add_argument("--output", default="-")
    tr.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="decode overrides, e.g. decode.beam=1")
    tr.set_defaults(func=cmd_translate)

    ev = sub.add_parser("evaluate", help="sacreBLEU and chrF of a hypothesis file against references")
    ev.add_argument("--hyp", required=True)
    ev.add_argument("--ref", required=True)
    ev.set_defaults(func=cmd_evaluate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except user_errors() as e:
        print(f"nmtcore: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean bad input, not a bug: reported as one line, exit status 2."""
    from nmtcore.checkpoint import CheckpointError
    from nmtcore.data import DataError
    from nmtcore.tracking import TrackingError

    return (ConfigError, DataError, CheckpointError, TrackingError, FileNotFoundError, PermissionError)

if __name__ == "__main__":
    sys.exit(main())
