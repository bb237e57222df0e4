"""Every speed and memory figure of the platform against its bar, one bench after the other in one run, with
the machine's load beside each: the fairseq peer first (``../shared/bench/peer_fairseq.sh``), then nmtcore's
side of it and the benches that compare nmtcore with itself.

Steps (each a process of its own; its output goes to ``OUT/<step>.log``):

- ``peer``: the peer script (``UPDATES`` = ``--thr-updates``; ``QUALITY_UPDATES`` = 500 with ``--quality``,
  else 0: throughput only). Skipped with ``--peer-log`` (an earlier run's output, to reuse).
- ``vs_fairseq``: the same model trained on the same batches (``bench/vs_fairseq.py``, ``precision=auto``, and
  fp32 beside it on a bf16 host: ``--precisions``), its ratios to the peer: training tokens/s and the most the
  model's matmul work allows at the machine's peak rate (``train_bound_tok_per_s``), and with ``--quality`` BLEU after 500 updates and beam-5 / greedy
  sentences/s.
- ``bert_cache``: each BERT-consuming model's cached updates against the baseline's, in one process, alternating
  blocks of 5 updates on the same batches (``--cache-rounds`` blocks each way).
- ``decode_speed``: PLM-sponsored beam-5 sentences/s against the baseline's.
- ``finetune_memory``: peak memory of the fine-tuned BERT trials against the baseline trial's.
- ``bert_step``: a fine-tuned BERT's update with each of the platform's changes to ``transformers``' BERT on and off
  (its dropouts, its attention input's cast), alternated on the same batches (``bench/bert_step.py``).
- ``sweep_overhead``: one trial run directly and as the first of a two-seed sweep (2 threads, at most
  ``--sweep-updates`` updates in ``--sweep-epochs`` epochs; the second seed runs in the first one's Tune actor:
  what each further trial pays outside the trainer), ordered direct, sweep, sweep, direct (``--sweep-repeat 2``,
  the default): one pair alone read 9.3% where the same bench in that order right after read 1.3% (2026-11-29,
  ``results/bench/2026-11-29-all-short-rows/``), the drift of a 2-core machine over a pair's ~5 minutes.
- ``first_run``: the main job on an empty cache until the shared baseline's first update
  (``bench/first_run.py``: minutes from the command, and when each phase before it ended).

Load: for each step, the 1-minute load average at its start and end, and ``others_cores``: the CPU the machine
spent outside the step's own processes over the step's wall time, in cores (``/proc/stat`` busy time minus the
CPU time of the step's process tree, read from its waited-for descendants' rusage; processes a step leaves
running after it, e.g. Ray's, count as others). A figure is worth reading when ``others_cores`` is near 0; in
``sweep_overhead`` the trial itself trains in a Ray worker, which is not the bench's child, so about a core of
it shows as others' there, and its load is the bench's own ``load_average_1min``.

Allocator: ``bert_cache``, ``finetune_memory``, ``bert_step`` and ``sweep_overhead`` start on what a sweep's trials
train on (:mod:`nmtcore.allocator`: tcmalloc where installed); ``vs_fairseq`` and ``decode_speed`` on glibc's malloc,
as the fairseq peer runs and as ``nmtcore translate`` decodes. The summary names it.

Prints a summary (every ratio line the benches print, with its bar) and writes it, with the per-step load, to
``OUT/summary.json`` and ``OUT/summary.md``. Run it alone on the machine.

  python bench/all.py --data-dir ../shared/data [--quality] [--out bench/out/all] [--steps peer,vs_fairseq,...]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
STEPS = ("peer", "vs_fairseq", "bert_cache", "decode_speed", "finetune_memory", "bert_step", "sweep_overhead",
         "first_run")
# The lines each bench prints with a figure against a bar (or the ratios the bar is read from).
SUMMARY_LINE = re.compile(r"^(RESULT |ratio |peer=|ceiling |nmtcore (thr|qual)|nmtcore peak_rss)")


def _cpu_busy_s() -> float:
    """Seconds of CPU time the whole machine has spent busy (all cores) since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def default_precisions() -> str:
    """``auto``, plus ``fp32`` where this host's ``auto`` is bf16."""
    import torch

    from nmtcore.devices import autocast_dtype

    return "auto,fp32" if autocast_dtype("auto", torch.device("cpu")) is not None else "auto"


def commands(args: argparse.Namespace, out: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each step's command line and its extra environment."""
    py, data = sys.executable, args.data_dir
    peer_log = args.peer_log or str(out / "peer.log")
    quality = [] if args.quality else ["--skip-qual"]
    return {
        "peer": (["bash", args.peer_script],
                 {"UPDATES": str(args.thr_updates), "QUALITY_UPDATES": "500" if args.quality else "0",
                  "THREADS": str(args.threads)}),
        "vs_fairseq": ([py, str(BENCH / "vs_fairseq.py"), "--data-dir", data, "--thr-updates", str(args.thr_updates),
                        "--peer-log", peer_log, "--precisions", args.precisions, *quality], {}),
        "bert_cache": ([py, str(BENCH / "bert_cache.py"), "--data-dir", data, "--model", "all", "--threads",
                        str(args.threads), "--block", "5", "--rounds", str(args.cache_rounds)], {}),
        "decode_speed": ([py, str(BENCH / "decode_speed.py"), "--data-dir", data, "--threads", str(args.threads),
                          "--sentences", str(args.decode_sentences)], {}),
        "finetune_memory": ([py, str(BENCH / "finetune_memory.py"), "--data-dir", data, "--threads",
                             str(args.threads), "--updates", str(args.memory_updates)], {}),
        "bert_step": ([py, str(BENCH / "bert_step.py"), "--data-dir", data, "--threads", str(args.threads)], {}),
        "sweep_overhead": ([py, str(BENCH / "sweep_overhead.py"), "--data-dir", data, "--threads", str(args.threads),
                            "--repeat", str(args.sweep_repeat), "--epochs", str(args.sweep_epochs),
                            "--max-updates", str(args.sweep_updates), "--out", str(out)], {}),
        "first_run": ([py, str(BENCH / "first_run.py"), "--data-dir", data, "--work", str(out / "first_run")], {}),
    }


def run_step(name: str, cmd: list[str], env: dict[str, str], out: Path) -> dict:
    """Runs one step, its output to ``out/<name>.log`` (and this console), and measures the load beside it."""
    print(f"\n== {name}: {' '.join(cmd)}" + (f" ({' '.join(f'{k}={v}' for k, v in env.items())})" if env else ""),
          flush=True)
    log_path = out / f"{name}.log"
    load0, busy0, mine0, t0 = os.getloadavg()[0], _cpu_busy_s(), _children_cpu_s(), time.perf_counter()
    lines = []
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env}, cwd=BENCH.parent)
        for line in proc.stdout:
            log.write(line)
            log.flush()
            lines.append(line.rstrip("\n"))
            if SUMMARY_LINE.match(line):
                print(f"  {line.rstrip()}", flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    busy, mine = _cpu_busy_s() - busy0, _children_cpu_s() - mine0
    step = {"step": name, "command": cmd, "env": env, "exit": rc, "wall_s": round(wall, 1),
            "load_1min_start_end": [round(load0, 2), round(os.getloadavg()[0], 2)],
            "own_cores": round(mine / wall, 2), "others_cores": round(max(busy - mine, 0.0) / wall, 2),
            "log": str(log_path), "figures": list(dict.fromkeys(ln.strip() for ln in lines if SUMMARY_LINE.match(ln)))}
    print(f"== {name}: exit {rc} in {wall:.0f} s; own {step['own_cores']:.2f} cores, others "
          f"{step['others_cores']:.2f}, load {step['load_1min_start_end']}", flush=True)
    if rc != 0:
        print("\n".join(lines[-30:]), flush=True)
    return step


def machine() -> dict:
    import torch

    from nmtcore.allocator import AllocatorError, resolve_allocator
    from nmtcore.devices import cpu_supports_bf16

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines() if ln.startswith("model name")), "?")
    try:  # what the training benches (bert_cache, finetune_memory, sweep_overhead) start on, as trials do
        allocator = resolve_allocator() or "glibc's malloc"
    except AllocatorError as e:
        allocator = f"none: {e}"
    return {"cpu": model, "cores": os.cpu_count(), "bf16_kernels": cpu_supports_bf16(),
            "torch": torch.__version__, "python": platform.python_version(), "training_allocator": allocator,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


def write_summary(out: Path, info: dict, steps: list[dict]) -> None:
    (out / "summary.json").write_text(json.dumps({"machine": info, "steps": steps}, indent=2) + "\n")
    md = [f"# bench/all.py, {info['started']}", "",
          f"{info['cpu']}, {info['cores']} cores, bf16 kernels: {'yes' if info['bf16_kernels'] else 'no'}; "
          f"torch {info['torch']}, Python {info['python']}; training benches' allocator: {info['training_allocator']} "
          "(vs_fairseq and decode_speed run on glibc's, as the fairseq peer and `nmtcore translate` do)", "",
          "| step | exit | wall s | own cores | others' cores | load 1 min (start, end) |", "|---|---|---|---|---|---|"]
    md += [f"| {s['step']} | {s['exit']} | {s['wall_s']:.0f} | {s['own_cores']:.2f} | {s['others_cores']:.2f} | "
           f"{s['load_1min_start_end'][0]:.2f}, {s['load_1min_start_end'][1]:.2f} |" for s in steps]
    for s in steps:
        md += ["", f"## {s['step']}", "", "    " + " ".join(s["command"]), ""]
        md += [f"    {f}" for f in s["figures"]] or ["    (no figure lines: see the log)"]
    (out / "summary.md").write_text("\n".join(md) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--out", default="bench/out/all")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma list of {', '.join(STEPS)}")
    p.add_argument("--peer-script", default=str(BENCH.parent.parent / "shared" / "bench" / "peer_fairseq.sh"))
    p.add_argument("--peer-log", help="an earlier peer run's output: skip the peer step and read its figures")
    p.add_argument("--quality", action="store_true",
                   help="also the 500-update runs that translate (BLEU, decoding vs fairseq): ~45 more minutes")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--precisions", default=default_precisions(),
                   help="vs_fairseq's precisions (default: auto, and fp32 beside it where auto is bf16: the fp32 "
                        "figure is what an AVX2-only host trains at)")
    p.add_argument("--thr-updates", type=int, default=100)
    p.add_argument("--cache-rounds", type=int, default=8, help="bert_cache: blocks of 5 updates each way")
    p.add_argument("--decode-sentences", type=int, default=500)
    p.add_argument("--memory-updates", type=int, default=20)
    p.add_argument("--sweep-updates", type=int, default=100,
                   help="the swept trial's updates, 0 = whole --sweep-epochs (the bar asks for >= 2 minutes)")
    p.add_argument("--sweep-epochs", type=int, default=1,
                   help="the swept trial's epochs of multi30k_small (~300 updates each): on a fast machine "
                        "--sweep-updates 0 --sweep-epochs 3 makes a trial of over 2 minutes")
    p.add_argument("--sweep-repeat", type=int, default=2, choices=(1, 2),
                   help="sweep_overhead: 2 = direct, sweep, sweep, direct (ABBA); 1 = one pair (half the time)")
    args = p.parse_args()
    steps = args.steps.split(",")
    unknown = sorted(set(steps) - set(STEPS))
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)}; known: {', '.join(STEPS)}")
    if not args.data_dir or not Path(args.data_dir).is_dir():
        p.error("--data-dir (or NMTCORE_DATA): the shared data folder, e.g. ../shared/data")
    if args.peer_log:
        steps = [s for s in steps if s != "peer"]
        if not Path(args.peer_log).is_file():
            p.error(f"--peer-log: no file {args.peer_log}")
    elif "peer" in steps and not Path(args.peer_script).is_file():
        p.error(f"--peer-script: no file {args.peer_script} (or pass --peer-log, or leave peer out of --steps)")
    elif "vs_fairseq" in steps and "peer" not in steps:
        p.error("vs_fairseq needs the peer's figures: add peer to --steps or pass --peer-log")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"{info['cpu']}, {info['cores']} cores, bf16 kernels: {info['bf16_kernels']}, torch {info['torch']}, "
          f"training benches' allocator: {info['training_allocator']}; started {info['started']}", flush=True)
    cmds = commands(args, out)
    done: list[dict] = []
    for name in steps:
        if name == "vs_fairseq" and any(s["step"] == "peer" and s["exit"] != 0 for s in done):
            print("\n== vs_fairseq: skipped, the peer failed (no figures to compare with)", flush=True)
            continue
        done.append(run_step(name, *cmds[name], out))
        write_summary(out, info, done)
    print(f"\nsummary: {out / 'summary.md'}", flush=True)
    print((out / "summary.md").read_text(), flush=True)
    return max((s["exit"] != 0 for s in done), default=0)


if __name__ == "__main__":
    sys.exit(main())
