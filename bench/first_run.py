"""How long a fresh machine waits for the main job's first training update: ``python sweeps/bert_size_grid.py``
on an empty cache (a new ``NMTCORE_CACHE``, sweep storage, MLflow store and baseline store in ``--work``), stopped
with Ctrl-C once the shared baseline has logged its first update (the baseline's ``train.log_interval`` is set to 1
for this: a setting that changes no weight, so the baseline's key is the one the main job uses).

Prints one ``RESULT {json}`` line: the minutes from the command to the first baseline update
(``first_update_min``, the figure with the 8-minute bar of a 2-core AVX2 host), and when each phase before it ended
(``phases``: the sweep's own task lines, ``prepare data ...``, each ``prepare BERT ...``, the printed estimate), with
the machine's bf16 support and load average beside them. Run it alone on the machine: everything but pip's own
cache (the MPNet wheels) is made afresh.

  python bench/first_run.py --data-dir ../shared/data [--work /tmp/nmtcore-first-run] [--timeout-min 30]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_UPDATE = re.compile(r"train baseline \w+: epoch 1 update \d+ ")
TASK_DONE = re.compile(r"^\d\d:\d\d:\d\d (prepare [^:]+): done in")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--work", default="/tmp/nmtcore-first-run", help="emptied first: the run's cache and stores")
    p.add_argument("--timeout-min", type=float, default=30.0)
    args = p.parse_args()
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    cmd = [sys.executable, "-u", "sweeps/bert_size_grid.py", "--storage", str(work / "sweeps"),
           "--tracking-uri", f"sqlite:///{work / 'mlflow.db'}", "--baseline-store", str(work / "baselines"),
           "--name", "first-run", "--set", "train.log_interval=1"]
    env = {**os.environ, "NMTCORE_CACHE": str(work / "cache"),
           **({"NMTCORE_DATA": args.data_dir} if args.data_dir else {})}
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    phases: dict[str, float] = {}
    first = None
    with open(work / "console.log", "w", encoding="utf-8") as log:
        for line in proc.stdout:
            log.write(line)
            at = round((time.perf_counter() - t0) / 60, 2)
            done = TASK_DONE.match(line)
            if done:
                phases[done.group(1)] = at
            elif line.startswith("estimated cost on this machine"):
                phases["estimate printed"] = at
            elif FIRST_UPDATE.search(line):
                first = at
                print(line.rstrip(), flush=True)
                proc.send_signal(signal.SIGINT)
                break
            if time.perf_counter() - t0 > args.timeout_min * 60:
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=300)
        log.write(rest or "")
    from nmtcore.devices import cpu_supports_bf16

    print("RESULT " + json.dumps({
        "bench": "first_run", "first_update_min": first, "phases": phases, "bf16_kernels": cpu_supports_bf16(),
        "cores": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
        "console": str(work / "console.log")}), flush=True)
    return 0 if first is not None else 1


if __name__ == "__main__":
    sys.exit(main())
