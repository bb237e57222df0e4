"""The reliability table: bad inputs, faults and signals against the real commands, each run as a user runs it
(a separate process), with what it ended in: the exit status, the first line that is not a log record, and
what was kept. Not a speed figure: the table ``docs/reliability.md`` quotes, rebuilt by one command.

    python bench/faults.py                       # every case, a Markdown table on stdout (~5 min on 2 cores)
    python bench/faults.py --only diverges       # the cases whose name contains a word

Every case runs in a fresh temporary directory on the synthetic corpus (``nmtcore.testing.synthetic``); a
case's *expected* status is part of the table, and the script exits 1 if any case ended otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "NMTCORE_OFFLINE": "1", "PYTHONPATH": str(REPO)}  # this checkout's nmtcore, wherever installed
ERROR_PREFIXES = ("nmtcore: error: ", "nmtcore: stopped by ", "bert_size_grid.py: error: ",
                  "bert_size_grid.py: stopped by ")  # one line, ours
LOG_RECORD = re.compile(r"\d{4}[-/]\d\d[-/]\d\d \d\d:\d\d:\d\d\S* (DEBUG|INFO|WARNING) ")


@dataclass
class World:
    """One case's directory: the tiny experiment as YAML, a trained checkpoint (made on first use)."""

    root: Path
    config: Path
    _checkpoint: Path | None = None

    def checkpoint(self) -> Path:
        if self._checkpoint is None:
            run = nmtcore("train", "--config", self.config, "--no-track", "--output-dir", self.root / "trained")
            if run.returncode != 0:
                raise RuntimeError("training the case's checkpoint failed:\n" + run.stderr[-2000:])
            self._checkpoint = sorted((self.root / "trained" / "checkpoints").glob("epoch*.pt"))[-1]
        return self._checkpoint


@dataclass
class Case:
    name: str
    what: str  # the input or fault, in words
    expect: int  # the exit status a user should see
    run: Callable[[World], tuple[list[str], subprocess.CompletedProcess]]
    kept: Callable[[World], str]  # what is left behind, in words, measured after the run


def nmtcore(*argv, stdin: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nmtcore.cli", *map(str, argv)], capture_output=True, text=True,
                          input=stdin, timeout=timeout, cwd=REPO, env=ENV)


def cli(*argv, stdin: str | None = None) -> Callable[[World], tuple[list[str], subprocess.CompletedProcess]]:
    """A case running ``nmtcore <argv>``; an argument may be a function of the world (a path made there)."""
    def run(w: World):
        args = [a(w) if callable(a) else a for a in argv]
        return ["nmtcore", *map(str, args)], nmtcore(*args, stdin=stdin(w) if callable(stdin) else stdin)
    return run


def sweep(*argv) -> Callable[[World], tuple[list[str], subprocess.CompletedProcess]]:
    def run(w: World):
        args = [a(w) if callable(a) else a for a in argv]
        cmd = [sys.executable, str(REPO / "sweeps" / "bert_size_grid.py"), *map(str, args)]
        return (["python", "sweeps/bert_size_grid.py", *map(str, args)],
                subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, env=ENV))
    return run


def signalled(sig: signal.Signals, argv: Callable[[World], list[str]], when: Callable[[World], bool],
              stdin: Callable[[World], str] | None = None, program: tuple[str, ...] = ("-m", "nmtcore.cli")):
    """A case that starts ``nmtcore <argv>`` (or ``python <program> <argv>``) and sends ``sig`` once
    ``when(world)`` holds."""
    def run(w: World):
        args = [str(a) for a in argv(w)]
        source = write(w, "signal-input.txt", stdin(w) if stdin is not None else "")
        out_path, err_path = w.root / "signal-stdout.txt", w.root / "signal-stderr.txt"
        with open(source) as fin, open(out_path, "w") as fout, open(err_path, "w") as ferr:
            proc = subprocess.Popen([sys.executable, *program, *args], cwd=REPO, text=True,
                                    stdin=fin, stdout=fout, stderr=ferr, env=ENV)
            t0 = time.time()
            while not (handles(proc.pid, sig) and when(w)) and proc.poll() is None and time.time() - t0 < 300:
                time.sleep(0.2)
            time.sleep(0.5)
            if proc.poll() is None:
                proc.send_signal(sig)
            proc.wait(120)
        out, err = out_path.read_text(), err_path.read_text()
        shown = ["nmtcore"] if program[0] == "-m" else ["python", str(Path(program[0]).relative_to(REPO))]
        return ([*shown, *args, f"(then {sig.name})"],
                subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return run


def handles(pid: int, sig: signal.Signals) -> bool:
    """Whether process ``pid`` has installed a handler for ``sig`` yet (``SigCgt`` in /proc): a signal sent
    earlier, while the interpreter is still importing, kills it the default way, which no program can help."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = next((int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:")), 0)
    return bool(caught >> (int(sig) - 1) & 1)


def first_line(r: subprocess.CompletedProcess) -> str:
    """The error line (argparse's after its usage lines), else the first line that is not a log record."""
    lines = [line for line in r.stderr.splitlines() if line.strip() and not LOG_RECORD.match(line)]
    lines = [line for line in lines if re.match(r"\S+: (error|stopped by)", line)] or lines
    if r.returncode == 0:  # a success: its warning if it gave one, else what it printed
        warnings = [line for line in r.stderr.splitlines() if " WARNING " in line]
        if warnings:
            return "WARNING " + warnings[0].split(" WARNING ", 1)[1]
        return "(the run's summary, JSON on stdout)" if r.stdout.startswith("{") else (r.stdout.splitlines() or [""])[0]
    return lines[0] if lines else (r.stdout.splitlines() or [""])[0]


def files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.exists() else []


def nothing(w: World, where: str = "out") -> str:
    found = files(w.root / where)
    return "nothing written" if not found else f"{len(found)} file(s) under {where}/"


def checkpoints(w: World, where: str = "out") -> str:
    found = sorted(p.name for p in (w.root / where / "checkpoints").glob("epoch*.pt"))
    return f"checkpoints {', '.join(found)}" if found else "no checkpoint"


def write(w: World, name: str, text: str | bytes) -> Path:
    path = w.root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


def train(*extra):
    return cli("train", "--config", lambda w: w.config, "--no-track", "--output-dir", lambda w: w.root / "out", *extra)


def corpus_with(w: World, edit: Callable[[Path], None]) -> Path:
    import shutil

    data = w.root / "data-copy"
    if not data.exists():
        shutil.copytree(w.root / "data", data)
    edit(data)
    return data


SWEEP = (str(REPO / "sweeps" / "bert_size_grid.py"),)


def smoke_sweep(w: World) -> list[str]:
    """The main job's smoke test with its storage, MLflow store and baselines in the case's directory."""
    return ["--smoke-test", "--name", "stopped", "--storage", w.root / "sweeps", "--tracking-uri",
            f"sqlite:///{w.root / 'mlflow.db'}", "--baseline-store", w.root / "baselines"]


def trial_checkpoints(w: World) -> list[Path]:
    return sorted((w.root / "sweeps" / "stopped").glob("*/checkpoint_*"))


def sweep_kept(w: World) -> str:
    state = (w.root / "sweeps" / "stopped" / "nmtcore_sweep.json").is_file()
    return f"{len(trial_checkpoints(w))} trial checkpoint(s)" + (", the sweep's state" if state else "")


def truncated_checkpoint(w: World) -> Path:
    """The trained checkpoint's first 5000 bytes, with the whole one's checksum file (a copy cut short)."""
    src = w.checkpoint()
    write(w, "cut.pt.sha256", src.with_name(src.name + ".sha256").read_bytes())
    return write(w, "cut.pt", src.read_bytes()[:5000])


def translated(w: World) -> str:
    out = w.root / "out" / "hyp.txt"
    return f"{len(out.read_text().splitlines())} lines translated" if out.exists() else "no output"


def long_line(w: World) -> str:
    return "ka lo\n" + " ".join(["mi"] * 2000) + "\npe ra si\n"


CASES = [
    # train: the config
    Case("unknown-key", "an unknown config key", 2, train("--set", "train.lrr=1"), nothing),
    Case("out-of-range", "dropout 2", 2, train("--set", "model.dropout=2"), nothing),
    Case("lr-inf", "train.lr=inf", 2, train("--set", "train.lr=inf"), nothing),
    Case("lr-zero", "train.lr=0", 2, train("--set", "train.lr=0"), nothing),
    Case("unknown-model", "a misspelt model name", 2, train("--set", "model.name=bert_fusd"), nothing),
    Case("config-missing", "--config naming no file", 2,
         cli("train", "--config", lambda w: w.root / "nope.yaml", "--no-track", "--output-dir",
             lambda w: w.root / "out"), nothing),
    Case("config-dir", "--config naming a directory", 2,
         cli("train", "--config", lambda w: w.root, "--no-track", "--output-dir", lambda w: w.root / "out"), nothing),
    Case("config-empty", "an empty config file", 2,
         cli("train", "--config", lambda w: write(w, "empty.yaml", "# nothing\n"), "--no-track",
             "--output-dir", lambda w: w.root / "out"), nothing),
    Case("config-duplicate", "a YAML key given twice", 2,
         cli("train", "--config", lambda w: write(w, "dup.yaml", w.config.read_text() + "\nname: again\nname: twice\n"),
             "--no-track", "--output-dir", lambda w: w.root / "out"), nothing),
    Case("config-list", "a config that is a list, not a mapping", 2,
         cli("train", "--config", lambda w: write(w, "list.yaml", "- a\n- b\n"), "--no-track",
             "--output-dir", lambda w: w.root / "out"), nothing),
    Case("config-syntax", "broken YAML", 2,
         cli("train", "--config", lambda w: write(w, "bad.yaml", "model: {name: [\n"), "--no-track",
             "--output-dir", lambda w: w.root / "out"), nothing),
    # train: data, output, tracking
    Case("data-missing", "--data-dir naming no directory", 2, train("--data-dir", lambda w: w.root / "nodata"),
         nothing),
    Case("data-uneven", "source and target line counts differ", 2,
         train("--data-dir", lambda w: corpus_with(w, lambda d: (d / "test.yy").write_text(
             "".join((d / "test.yy").read_text().splitlines(keepends=True)[:-1])))), nothing),
    Case("data-bad-byte", "a corpus file that is not UTF-8", 2,
         train("--data-dir", lambda w: corpus_with(w, lambda d: (d / "valid.xx").write_bytes(
             (d / "valid.xx").read_bytes().replace(b"\n", b"\xff\n", 1)))), nothing),
    Case("output-unwritable", "an output directory nobody can create", 2,
         cli("train", "--config", lambda w: w.config, "--no-track", "--output-dir", "/proc/nmtcore-out"),
         lambda w: nothing(w)),
    Case("store-unwritable", "a tracking store in a directory nobody can write", 2,
         cli("train", "--config", lambda w: w.config, "--tracking-uri", "sqlite:////proc/mlflow.db",
             "--output-dir", lambda w: w.root / "out"), nothing),
    Case("server-unreachable", "a tracking server that does not answer", 2,
         cli("train", "--config", lambda w: w.config, "--tracking-uri", "http://127.0.0.1:9",
             "--output-dir", lambda w: w.root / "out"), nothing),
    Case("diverges", "a learning rate that blows the loss up (train.lr=50)", 1,
         train("--set", "train.lr=50", "train.warmup_updates=1"), checkpoints),
    Case("sigterm-train", "SIGTERM during training (after the first checkpoint)", 143,
         signalled(signal.SIGTERM, lambda w: ["train", "--config", w.config, "--no-track", "--output-dir",
                                              w.root / "out", "--set", "train.max_epochs=200"],
                   lambda w: bool(list((w.root / "out" / "checkpoints").glob("epoch1.pt")))), checkpoints),
    Case("sigint-train", "Ctrl-C during training (after the first checkpoint)", 130,
         signalled(signal.SIGINT, lambda w: ["train", "--config", w.config, "--no-track", "--output-dir",
                                             w.root / "out", "--set", "train.max_epochs=200"],
                   lambda w: bool(list((w.root / "out" / "checkpoints").glob("epoch1.pt")))), checkpoints),
    Case("resume-after-sigterm", "the same command after SIGTERM: resumes", 0,
         lambda w: (signalled(signal.SIGTERM, lambda w: ["train", "--config", w.config, "--no-track", "--output-dir",
                                                         w.root / "out", "--set", "train.max_epochs=3"],
                              lambda w: bool(list((w.root / "out" / "checkpoints").glob("epoch1.pt"))))(w),
                    train("--set", "train.max_epochs=3")(w))[1], checkpoints),
    # translate
    Case("ckpt-missing", "a checkpoint that does not exist", 2,
         cli("translate", "--checkpoint", lambda w: w.root / "none.pt", stdin="ka lo\n"), nothing),
    Case("ckpt-truncated", "a checkpoint cut short, its checksum file beside it", 2,
         cli("translate", "--checkpoint", lambda w: truncated_checkpoint(w), stdin="ka lo\n"), nothing),
    Case("ckpt-not-torch", "a text file given as the checkpoint", 2,
         cli("translate", "--checkpoint", lambda w: write(w, "text.pt", "hello\n"), stdin="ka lo\n"), nothing),
    Case("long-line", "one source line longer than the model's positions", 0,
         cli("translate", "--checkpoint", lambda w: w.checkpoint(), "--output", lambda w: w.root / "out" / "hyp.txt",
             "--set", "decode.beam=1", stdin=long_line), translated),
    Case("input-missing", "--input naming no file", 2,
         cli("translate", "--checkpoint", lambda w: w.checkpoint(), "--input", lambda w: w.root / "none.txt"), nothing),
    Case("output-dir", "--output naming a directory", 2,
         cli("translate", "--checkpoint", lambda w: w.checkpoint(), "--output", lambda w: w.root, stdin="ka lo\n"),
         nothing),
    Case("decode-bad", "decode.beam=0", 2,
         cli("translate", "--checkpoint", lambda w: w.checkpoint(), "--set", "decode.beam=0", stdin="ka lo\n"),
         nothing),
    Case("sigterm-translate", "SIGTERM while decoding", 143,
         signalled(signal.SIGTERM, lambda w: ["translate", "--checkpoint", w.checkpoint(), "--output",
                                              w.root / "out" / "hyp.txt", "--set", "decode.beam=8"],
                   lambda w: time.sleep(3) or True, stdin=lambda w: "ka lo mi nu pe ra si\n" * 20000), nothing),
    # evaluate
    Case("eval-uneven", "hypotheses and references of different lengths", 2,
         cli("evaluate", "--hyp", lambda w: write(w, "h.txt", "a\nb\n"), "--ref", lambda w: write(w, "r.txt", "a\n")),
         lambda w: "nothing written"),
    Case("eval-missing", "a hypothesis file that does not exist", 2,
         cli("evaluate", "--hyp", lambda w: w.root / "none.txt", "--ref", lambda w: write(w, "r.txt", "a\n")),
         lambda w: "nothing written"),
    Case("eval-empty", "empty hypothesis and reference files", 2,
         cli("evaluate", "--hyp", lambda w: write(w, "h.txt", ""), "--ref", lambda w: write(w, "r.txt", "")),
         lambda w: "nothing written"),
    # sweeps: signals (a local Ray cluster, the smoke test's tiny trials)
    Case("sigterm-sweep", "SIGTERM while a sweep's trials run", 143,
         signalled(signal.SIGTERM, smoke_sweep, lambda w: bool(trial_checkpoints(w)), program=SWEEP), sweep_kept),
    Case("resume-after-sigterm-sweep", "the same sweep with --resume after SIGTERM: finishes", 0,
         lambda w: (signalled(signal.SIGTERM, smoke_sweep, lambda w: bool(trial_checkpoints(w)), program=SWEEP)(w),
                    sweep(*smoke_sweep(w), "--resume")(w))[1], sweep_kept),
    # sweeps (refused before Ray starts)
    Case("sweep-nothing-to-resume", "--resume of a sweep that never ran", 2,
         sweep("--resume", "--name", "never", "--storage", lambda w: w.root / "sweeps"),
         lambda w: nothing(w, "sweeps")),
    Case("sweep-damaged-state", "--resume of a sweep whose state file is damaged", 2,
         sweep("--resume", "--name", "damaged", "--storage",
               lambda w: write(w, "sweeps/damaged/nmtcore_sweep.json", "{not json").parent.parent),
         lambda w: "state file left as it was"),
    Case("sweep-bad-variant", "a variant the study does not have", 2, sweep("--variant", "nope"),
         lambda w: "nothing written"),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[], help="run the cases whose name contains one of these words")
    args = ap.parse_args()
    from nmtcore.testing.synthetic import tiny_experiment

    cases = [c for c in CASES if not args.only or any(word in c.name for word in args.only)]
    print("| case | input or fault | command | exit (expected) | first line | what was kept |")
    print("|---|---|---|---|---|---|")
    wrong = 0
    with tempfile.TemporaryDirectory(prefix="nmtcore-faults-") as tmp:
        shared: dict[str, Path] = {}
        for case in cases:
            root = Path(tmp) / case.name
            cfg = tiny_experiment(root, **{"train.max_epochs": 1, "train.num_threads": 1})
            config = root / "tiny.yaml"
            config.write_text(cfg.to_yaml(), encoding="utf-8")
            w = World(root, config, shared.get("checkpoint"))
            result = case.run(w)
            argv, r = result if isinstance(result, tuple) else (["(two commands)"], result)
            if w._checkpoint is not None:
                shared["checkpoint"] = w._checkpoint
            def short(text: str) -> str:
                return text.replace(str(root), "<dir>").replace(tmp, "<tmp>").replace(sys.executable, "python")

            line, command = short(first_line(r)).replace("|", "\\|"), short(" ".join(argv))
            ok = r.returncode == case.expect and (case.expect == 0 or line.startswith(ERROR_PREFIXES))
            wrong += not ok
            print(f"| {case.name} | {case.what} | `{command[:170]}` | {r.returncode}"
                  f"{'' if ok else f' (expected {case.expect})'} | {line[:200]} | {case.kept(w)} |", flush=True)
    print(f"\n{len(cases)} cases, {wrong} ended otherwise than expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
