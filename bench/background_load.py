"""How much a little background CPU load slows a training step that uses every core: the cause of most of
a sweep trial's overhead on a small machine, measured without Ray.

The trainer (``multi30k_small``, fp32, ``--threads`` torch threads) times the same ``--steps`` batches with
nothing else running and beside a process that is busy ``--busy-ms`` out of every ``--busy-ms + --sleep-ms``
(by default 30 of 150 ms: 0.2 of a core, about what Ray's processes take in the middle of a sweep trial on
2 cores), alternating quiet / loaded ``--repeat`` times in one process; ``--nice`` runs the load at that
niceness. Set ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` in the environment to compare OpenMP's waiting.
Prints one ``RESULT {json}`` line per timing and the loaded/quiet ratios.

    python bench/background_load.py --data-dir ../shared/data [--threads 2] [--steps 20] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from nmtcore.config import preset
from nmtcore.data import prepare_data
from nmtcore.engine import build_trainer

LOAD = """
import os, sys, time
os.nice(int(sys.argv[3]))
busy, idle = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", "../shared/data"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--busy-ms", type=float, default=30.0)
    ap.add_argument("--sleep-ms", type=float, default=120.0)
    ap.add_argument("--nice", type=int, default=0, help="niceness of the load process")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    cfg = preset("multi30k_small").with_overrides({
        "data.data_dir": args.data_dir, "data.download": False, "train.precision": "fp32",
        "output_dir": "bench/out/background_load"})
    trainer = build_trainer(cfg, prepare_data(cfg.data), device=torch.device("cpu"))
    it = trainer.train_batches(epoch=1)
    batches = [next(it) for _ in range(args.steps + 3)]
    for b in batches[:3]:
        trainer.train_step([b])
    tokens = sum(b.n_tgt_tokens for b in batches[3:])
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeat):
        for loaded in (False, True):
            load = subprocess.Popen([sys.executable, "-c", LOAD, str(args.busy_ms), str(args.sleep_ms),
                                     str(args.nice)]) if loaded else None
            try:
                t0 = time.perf_counter()
                for b in batches[3:]:
                    trainer.train_step([b])
                wall = time.perf_counter() - t0
            finally:
                if load is not None:
                    load.kill()
                    load.wait()
            times[loaded].append(wall)
            print("RESULT " + json.dumps({
                "loaded": loaded, "load_cores": round(args.busy_ms / (args.busy_ms + args.sleep_ms), 3),
                "load_nice": args.nice, "threads": args.threads, "cpus": os.cpu_count(),
                "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", ""),
                "gomp_spincount": os.environ.get("GOMP_SPINCOUNT", ""), "steps": args.steps,
                "wall_s": round(wall, 2), "tok_s": round(tokens / wall)}), flush=True)
    ratios = [round(b / a, 3) for a, b in zip(times[False], times[True])]
    print("RESULT " + json.dumps({"loaded_over_quiet": ratios, "load_average_1min": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
