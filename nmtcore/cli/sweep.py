"""The command line every sweep entry point shares (``sweeps/<study>.py`` only names its study).

    python sweeps/<study>.py [--variant V] [--budget B] [--dry-run] [--smoke-test] [--resume] [--address HOST:PORT]
                             [--tracking-uri URI] [--data-dir DIR] [--seeds N] [--max-concurrent N] ...

Default: a local Ray cluster (dashboard on 127.0.0.1), a local sqlite MLflow store, Ray results under
``./runs/sweeps/<name>``. ``--smoke-test``: the tiny synthetic task and at most 2 trials, with Ray results
and MLflow in a temporary directory unless given. How the base experiment is made, in order: the preset (or
``--config``), the study's defaults (its BERT...), the variant's budget (real runs only), the data
directory, then the user's ``--set``, which wins. Errors a user can fix end as one line and exit status 2.

The flags of :class:`~nmtcore.sweep.settings.SweepSettings` are generated from its fields (their ``help``
metadata), so the command line and the settings cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import typing
from pathlib import Path
from typing import Any, Sequence

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def build_parser(description: str, study: str, variants: Sequence[str], default_variant: str,
                 variant_flag: str = "--variant") -> argparse.ArgumentParser:
    """The parser of a study's entry point: experiment flags, then one flag per sweep setting."""
    from nmtcore.sweep.settings import SweepSettings

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument(variant_flag, dest="variant", default=default_variant, choices=list(variants),
                   help=f"which {study} variant to run")
    p.add_argument("--smoke-test", action="store_true", help="tiny synthetic task, at most 2 trials, temp storage")
    p.add_argument("--data-dir", help="corpus directory (default: $NMTCORE_DATA, else ../shared/data if present)")
    p.add_argument("--model", help="model the study runs on (default: the search space's)")
    p.add_argument("--budget", help="the arms' named budget (the study's budgets; default: its own, "
                                     "to convergence where the study trains so; quick: a short fixed stage)")
    p.add_argument("--preset", default="multi30k_small", help="base experiment preset")
    p.add_argument("--config", help="base experiment YAML (instead of --preset)")
    p.add_argument("--set", nargs="*", action="extend", metavar="KEY=VALUE",
                   help="base config overrides (win over the study's defaults; the shared baseline's too)")
    p.add_argument("--arms", nargs="+", action="extend", metavar="ARM",
                   help="run only these arms of the study (its control too): another seed of one arm, an arm added "
                        "after the study ran; `nmtcore report --sweep <whole> --sweep <this>` reports them together")
    p.add_argument("--arms-set", nargs="*", action="extend", metavar="KEY=VALUE",
                   help="overrides of the arms and the control only (e.g. train.max_epochs=1: a shorter second "
                        "stage), not of the shared baseline they warm-start from")
    p.add_argument("--adopt-baseline", metavar="OLD_KEY",
                   help="use the shared baseline stored under OLD_KEY by older code (finished or part-trained) as this "
                        "code's: refused unless its config and data are this sweep's, only the code differs (see "
                        "`nmtcore baselines`)")
    p.add_argument("--dry-run", action="store_true",
                   help="train nothing: measure this machine's speed on every distinct trial model and the baseline "
                        "(a few updates each) and print what each phase of the sweep would cost")
    p.add_argument("-v", "--verbose", action="store_true")
    hints = typing.get_type_hints(SweepSettings)
    for f in dataclasses.fields(SweepSettings):
        help_text = f.metadata.get("help")
        if help_text is None:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        kind = [a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]]
        if kind[0] is bool:
            p.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            required = f.default is dataclasses.MISSING  # name, storage: the entry point fills them in
            p.add_argument(flag, dest=f.name, type=kind[0], default=None if required else f.default, help=help_text)
    return p


def main(study: Any, args: argparse.Namespace) -> int:
    """Run ``args.variant`` of ``study`` (a module of ``search_spaces``: ``STUDY``, ``SPACES``, ``DEFAULT``) as
    ``args`` say; returns the exit status."""
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("NMTCORE_NO_PROGRESS", "1")
    from nmtcore.cli.errors import USER_ERRORS

    try:
        return _run(study, args)
    except USER_ERRORS as e:
        print(f"{Path(sys.argv[0]).name}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}",
              file=sys.stderr)
        return 2


def base_experiment(space: Any, args: argparse.Namespace) -> tuple[Any, Any, dict[str, str], Any]:
    """The arms' base experiment of a run of ``space`` as ``args`` say, the shared baseline's experiment
    (None without a protocol), the storage of a smoke test, and ``space`` with the user's keys of the arms' model.

    In order: the preset (or ``--config``; a smoke test's tiny synthetic task), the study's defaults, the data
    directory, the arms' budget (real runs) or the baseline's, the user's ``--set`` (which wins), then the
    arms' ``--arms-set`` (not the baseline's: its key, and the cached baseline, stay), and for the baseline the
    protocol's baseline model without BERT. A key that the base config's model lacks and every arm's model has
    (``model.tgt_bert.*`` of PLM-sponsored arms over a Transformer control) goes to the arms alone
    (:meth:`~nmtcore.sweep.space.SearchSpace.with_arm_overrides`)."""
    from nmtcore.config import ExperimentConfig, parse_overrides, preset

    user = parse_overrides(args.set or [])
    arms = parse_overrides(getattr(args, "arms_set", None) or [])
    smoke: dict[str, str] = {}
    if args.smoke_test:
        from nmtcore.testing.synthetic import tiny_experiment

        tmp = Path(tempfile.mkdtemp(prefix=f"nmtcore-smoke-{space.study}-"))
        # A BERT size resolves as for English (the bottom layers of the packaged MiniLM: made in a second,
        # no corpus read); anything made here for a smoke test needs only a few steps.
        study = tiny_experiment(tmp, **{"train.max_epochs": 2, "train.valid_bleu": True, "train.num_threads": 1,
                                        "model.bert.pretrain_corpus": "multi30k:en",
                                        "model.bert.pretrain_steps": 100,
                                        # the study's data settings name real splits; the smoke test has its own
                                        **{k: v for k, v in space.defaults.items() if not k.startswith("data.")}})
        budget, baseline_budget = {}, {}
        smoke = {"storage": str(tmp / "ray_results"), "tracking_uri": f"sqlite:///{tmp / 'mlflow.db'}",
                 "baseline_store": str(tmp / "baselines")}
    else:
        data_dir = args.data_dir or os.environ.get("NMTCORE_DATA") or (
            str(SHARED_DATA) if (SHARED_DATA / "multi30k").is_dir() else "")
        study = ExperimentConfig.from_yaml(args.config) if args.config else preset(args.preset)
        study = study.with_overrides({**space.defaults, **({"data.data_dir": str(Path(data_dir).resolve())}
                                                             if data_dir else {})})
        budget = dict(space.budget)
        baseline_budget = dict(space.protocol.baseline_budget) if space.protocol is not None else {}
    base, only_arms = _base_and_arm_model_keys(study, space, budget, {**user, **arms})
    space = space.with_arm_overrides(only_arms)
    user = {k: v for k, v in user.items() if k not in only_arms}
    baseline = None
    if space.protocol is not None:
        baseline = study.with_overrides({**baseline_budget, **user}).with_overrides(space.protocol.control_overrides())
    return base, baseline, smoke, space


def _base_and_arm_model_keys(study: Any, space: Any, budget: dict[str, Any],
                             overrides: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``study`` with ``budget`` and the user's ``overrides``, less those of a key that ``study``'s model lacks
    and every arm's model has (returned apart: they are set on the arms alone). A key that some arms' model has
    and others' lacks, or that no model has, is refused (:class:`~nmtcore.config.ConfigError`, in one line)."""
    from nmtcore.config import ConfigError

    models = {str(space.overrides(p).get("model.name", study.model.name)) for p in space.example_points()}
    kept, only_arms = dict(overrides), {}
    while True:
        try:
            return study.with_overrides({**budget, **kept}), only_arms
        except ConfigError as e:
            key = next((k for k in kept if str(e).startswith(f"{k}:")), None)
            if key is None:
                raise
            read = {m: v for m in models for v in _read_as(study, m, key, kept[key])}
            if not read:
                raise
            if len(read) < len(models):
                raise ConfigError(f"{key}: a key of some arms' model ({', '.join(sorted(read))}) that the others' "
                                  f"({', '.join(sorted(models - set(read)))}) lacks: --set sets a key on every arm "
                                  "or on none") from None
            # as the config reads it (``false`` -> False): the arms' bundles and the report carry typed values
            only_arms[key] = read[min(read)]
            del kept[key]


def _read_as(study: Any, model: str, key: str, value: Any) -> tuple[Any, ...]:
    """``(value as model's config reads it,)`` where ``model`` has ``key``, else ``()``."""
    from nmtcore.config import ConfigError

    try:
        return (study.with_overrides({"model.name": model, key: value}).flat()[key],)
    except ConfigError:
        return ()


def _run(study: Any, args: argparse.Namespace) -> int:
    from nmtcore import tracking
    from nmtcore.sweep.driver import run_sweep
    from nmtcore.sweep.settings import SweepSettings, default_storage

    space = study.SPACES[args.variant]
    if args.model:
        space = space.with_model(args.model)
    if args.budget:
        space = space.with_budget(args.budget)
    if getattr(args, "arms", None):
        space = space.with_arms(args.arms)
    if args.smoke_test:
        space = space.shrunk(2)
    base, baseline, smoke, space = base_experiment(space, args)
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(SweepSettings) if hasattr(args, f.name)}
    values["name"] = args.name or f"{study.STUDY}-{space.variant}"  # the variant names a smoke test and a budget
    values["storage"] = args.storage or smoke.get("storage") or default_storage()
    values["tracking_uri"] = args.tracking_uri or smoke.get("tracking_uri")
    values["baseline_store"] = args.baseline_store or smoke.get("baseline_store")
    if values.get("estimate") is None:  # real runs say what they (or a resumed one's rest) will cost; smoke tests don't
        values["estimate"] = not args.smoke_test
    settings = SweepSettings(**values)
    if args.adopt_baseline:
        from nmtcore.sweep.baseline import AdoptError, adopt_baseline

        if baseline is None:
            raise AdoptError(f"{space.name} warm-starts from no shared baseline: nothing to adopt")
        new = adopt_baseline(baseline, args.adopt_baseline, settings.baseline_store, tracking_uri=settings.tracking_uri,
                             reason=f"--adopt-baseline by sweep {settings.name}")
        print(f"baseline {args.adopt_baseline[:12]} adopted as {new[:12]}: same data, same config or a stopping rule "
              "that replays to the same stop, older code (the reason is recorded in its adoptions.jsonl)")
    if args.dry_run:
        from nmtcore.sweep.cost import dry_run

        print("\n".join(dry_run(space, base, settings, baseline=baseline).lines()))
        return 0
    t0 = time.perf_counter()
    stop = SigtermAsCtrlC()
    try:
        with stop:
            result = run_sweep(space, base, settings, baseline=baseline)
    except KeyboardInterrupt as e:
        signum = stop.received or getattr(e, "signum", signal.SIGINT)
        again = [a for a in sys.argv if a != "--resume"]
        from nmtcore.sweep.state import STATE_FILE

        started = (Path(settings.storage) / settings.name / STATE_FILE).is_file()
        print(f"\n{Path(sys.argv[0]).name}: stopped by {signal.Signals(signum).name}; what was finished is kept ("
              + ("its trials' checkpoints: resume with python " + " ".join(again) + " --resume"
                 + ("" if args.name else f" --name {settings.name}") if started else
                 "the data, BERTs, feature caches and the baseline's checkpoints are cached: the same command, "
                 "with or without --resume, continues from them") + ")", file=sys.stderr)
        return 128 + int(signum)
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
    print(f"MLflow parent run {result.parent_run_id} in {result.tracking_uri}\n"
          f"  UI: {tracking.ui_command(result.tracking_uri)}\n"
          f"  report again: nmtcore report --sweep {result.name} --tracking-uri {result.tracking_uri}")
    if result.interrupted:
        again = [a for a in sys.argv if a != "--resume"]
        print(f"resume with: python {' '.join(again)} --resume" + ("" if args.name else f" --name {result.name}"))
        print(f"  on another machine --resume cannot (the checkpoints stay here): nmtcore export --sweep {result.name} "
              f"--tracking-uri {result.tracking_uri} --out {result.name}.json.gz keeps its finished trials; there, "
              "nmtcore import it and run the study again under a new name: they are copied, the rest trained "
              "(docs/sweeps.md, \"Across machines\")")
        if stop.received:
            print(f"{Path(sys.argv[0]).name}: stopped by {signal.Signals(stop.received).name}; the trials' "
                  "checkpoints are kept", file=sys.stderr)
            return 128 + stop.received
    return 1 if result.interrupted else 0


class SigtermAsCtrlC:
    """While a sweep runs, SIGTERM (how schedulers and ``kill`` stop a job) stops it as Ctrl-C does: during the
    trials through Tune's own graceful stop (its SIGINT handler saves the experiment state, so ``--resume``
    continues; a second signal skips that), elsewhere as a ``KeyboardInterrupt`` where the main thread is.
    ``received`` is the signal's number once one arrived, for the exit status and the last line."""

    def __init__(self) -> None:
        self.received = 0
        self._before: Any = None

    def __enter__(self) -> "SigtermAsCtrlC":
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._before = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._before is not None:
            signal.signal(signal.SIGTERM, self._before)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.received = signum
        on_ctrl_c = signal.getsignal(signal.SIGINT)
        if callable(on_ctrl_c) and on_ctrl_c is not signal.default_int_handler:
            on_ctrl_c(signal.SIGINT, frame)  # Tune's: it stops the trials and saves their state
            return
        from nmtcore.interrupts import interrupt

        interrupt(signum, frame)  # Stopped, now or when the store write under way has finished


def entry_point(study: Any, doc: str, variant_flag: str = "--variant") -> int:
    """What ``sweeps/<study>.py`` runs: parse the command line for ``study`` (its ``search_spaces`` module)
    and run it."""
    parser = build_parser(doc.splitlines()[0], study.STUDY, list(study.SPACES), study.DEFAULT, variant_flag)
    return main(study, parser.parse_args())
