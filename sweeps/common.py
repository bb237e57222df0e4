"""The command line every sweep entry point shares; each entry point only names its study.

    python sweeps/<study>.py [--variant V] [--smoke-test] [--resume] [--address HOST:PORT]
                             [--tracking-uri URI] [--data-dir DIR] [--seeds N] [--max-concurrent N] ...

Default: a local Ray cluster (dashboard on 127.0.0.1), a local sqlite MLflow store, Ray results under
``./runs/sweeps/<name>``. ``--smoke-test``: the tiny synthetic task and at most 2 trials, with Ray
results and MLflow in a temporary directory unless given. Errors a user can fix end as one line and
exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def build_parser(description: str, study: str, variants: Sequence[str], default_variant: str,
                 default_model: str | None = None, variant_flag: str = "--variant",
                 default_set: Sequence[str] = ()) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(variant_flag, dest="variant", default=default_variant, choices=list(variants),
                   help=f"which {study} variant to run")
    p.add_argument("--smoke-test", action="store_true", help="tiny synthetic task, at most 2 trials, temp storage")
    p.add_argument("--resume", action="store_true", help="continue the interrupted sweep of the same --name")
    p.add_argument("--name", help="sweep name (default: <study>-<variant>)")
    p.add_argument("--address", help="join this Ray cluster (host:port) instead of starting a local one")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI or local sqlite)")
    p.add_argument("--experiment", default="nmtcore-sweeps", help="MLflow experiment")
    p.add_argument("--data-dir", help="corpus directory (default: $NMTCORE_DATA, else ../shared/data if present)")
    p.add_argument("--storage", help="Ray results: a shared path or a cloud URI in cluster mode (default: runs/sweeps)")
    p.add_argument("--seeds", type=int, default=1, help="repeats of every configuration with seeds s, s+1, ...")
    p.add_argument("--max-concurrent", type=int, default=0, help="trials at once (0: as resources allow)")
    p.add_argument("--num-samples", type=int, default=0, help="Optuna trials for sampled spaces (0: the space's)")
    p.add_argument("--asha", action=argparse.BooleanOptionalAction, default=None,
                   help="ASHA early stopping on the validation metric (default: the space's)")
    p.add_argument("--workers-per-trial", type=int, default=1, help="Ray Train workers per trial (DDP if > 1)")
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="may be fractional (0.5: two trials per GPU)")
    p.add_argument("--max-failures", type=int, default=2, help="retries of a crashed trial from its checkpoint")
    p.add_argument("--num-cpus", type=int, help="logical CPUs of the local Ray cluster (default: all cores)")
    p.add_argument("--no-dashboard", action="store_true", help="do not start the Ray dashboard")
    p.add_argument("--report-dir", help="report folder (default: <storage>/<name>/report)")
    p.add_argument("--model", default=default_model,
                   help="model the study runs on (default: the search space's)")
    p.add_argument("--preset", default="multi30k_small", help="base experiment preset")
    p.add_argument("--config", help="base experiment YAML (instead of --preset)")
    p.add_argument("--set", nargs="*", default=list(default_set), metavar="KEY=VALUE",
                   help="base config overrides (replace the default list)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(study: str, args: argparse.Namespace) -> int:
    """Run the study's ``args.variant`` as ``args`` say; returns the exit status."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("NMTCORE_NO_PROGRESS", "1")
    from nmtcore.cli import user_errors

    try:
        return _run(study, args)
    except user_errors() as e:
        print(f"{Path(sys.argv[0]).name}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2


def _run(study: str, args: argparse.Namespace) -> int:
    import search_spaces
    from nmtcore import sweep
    from nmtcore.config import ExperimentConfig, parse_overrides, preset

    space = search_spaces.get_space(f"{study}:{args.variant}")
    if args.model:
        space = space.with_model(args.model)
    overrides: dict[str, Any] = parse_overrides(args.set)
    name = args.name or f"{study}-{args.variant}"
    storage, tracking_uri = args.storage, args.tracking_uri
    if args.smoke_test:
        sys.path.insert(0, str(REPO))
        from tests.synthetic import tiny_experiment

        tmp = Path(tempfile.mkdtemp(prefix=f"nmtcore-smoke-{name}-"))
        # A BERT made here for a smoke test needs only a few MLM steps.
        base = tiny_experiment(tmp, **{"train.max_epochs": 2, "train.valid_bleu": True, "train.num_threads": 1,
                                       "model.bert.pretrain_steps": 100})
        base = base.with_overrides(overrides) if overrides else base
        space = space.shrunk(2)
        name = args.name or f"{name}-smoke"
        storage = storage or str(tmp / "ray_results")
        tracking_uri = tracking_uri or f"sqlite:///{tmp / 'mlflow.db'}"
    else:
        base = ExperimentConfig.from_yaml(args.config) if args.config else preset(args.preset)
        if space.budget:
            base = base.with_overrides(space.budget)  # the variant's budget; --set below wins
        data_dir = args.data_dir or os.environ.get("NMTCORE_DATA") or (
            str(SHARED_DATA) if (SHARED_DATA / "multi30k").is_dir() else "")
        if data_dir:
            overrides.setdefault("data.data_dir", str(Path(data_dir).resolve()))
        base = base.with_overrides(overrides) if overrides else base
    settings = sweep.SweepSettings(
        name=name, storage=storage or sweep.default_storage(), tracking_uri=tracking_uri,
        experiment=args.experiment, seeds=args.seeds, max_concurrent=args.max_concurrent,
        num_samples=args.num_samples, early_stopping=args.asha, workers_per_trial=args.workers_per_trial,
        cpus_per_trial=args.cpus_per_trial, gpus_per_trial=args.gpus_per_trial, max_failures=args.max_failures,
        address=args.address, resume=args.resume, dashboard=not args.no_dashboard, num_cpus=args.num_cpus,
        report_dir=args.report_dir)
    t0 = time.perf_counter()
    result = sweep.run_sweep(space, base, settings)
    print(f"\nsweep {result.name} {'INTERRUPTED' if result.interrupted else 'finished'} in "
          f"{time.perf_counter() - t0:.0f} s: {len(result.trials)} trials "
          f"({', '.join(f'{t.status}' for t in result.trials)})")
    for t in result.trials:
        nodes = ",".join(n[:8] for n in t.node_ids)
        print(f"  {t.trial_id} {t.status:<10} run {t.run_id} nodes {nodes or '-'} {t.overrides}")
    table = next((f for f in result.report_files if f.endswith("table.md")), None)
    if table:
        print("\n" + Path(table).read_text(encoding="utf-8"))
    for f in result.report_files:
        print(f"report: {f}")
    from nmtcore import tracking

    print(f"MLflow parent run {result.parent_run_id} in {result.tracking_uri}\n"
          f"  UI: {tracking.ui_command(result.tracking_uri)}\n"
          f"  report again: nmtcore report --sweep {result.name} --tracking-uri {result.tracking_uri}")
    if result.interrupted:
        again = [a for a in sys.argv if a != "--resume"]
        print(f"resume with: python {' '.join(again)} --resume" + ("" if args.name else f" --name {result.name}"))
    return 1 if result.interrupted else 0
