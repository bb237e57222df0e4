"""The direct trial (200 updates of multi30k_small, 2 threads) alone, then twice beside an idle local Ray cluster
(started by nmtcore's init_ray, dashboard on), then alone again.

  NMTCORE_DATA=../shared/data python results/bench/2026-11-28-all-bf16/idle_ray.py"""
import os, time, tempfile
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
from pathlib import Path
from nmtcore.allocator import reexec_with_allocator, allocator_in_use
reexec_with_allocator(); print("allocator", allocator_in_use(), flush=True)
from nmtcore.config import preset
from nmtcore.engine import run_experiment
from nmtcore.data import prepare_data
work = Path(tempfile.mkdtemp())
cfg = preset("multi30k_small").with_overrides({"data.data_dir": os.environ["NMTCORE_DATA"], "train.max_epochs": 1,
     "train.max_updates": 200, "train.num_threads": 2, "train.warmup_updates": 100, "train.keep_last": 1})
prepare_data(cfg.data)
def direct(tag):
    t0 = time.perf_counter(); run_experiment(cfg.with_overrides({"output_dir": str(work / tag)}), resume=False)
    print(tag, round(time.perf_counter() - t0, 1), flush=True)
direct("alone1")
from nmtcore.sweep.ray_backend import init_ray, shutdown_ray
init_ray(num_cpus=2)
time.sleep(10)
direct("with_ray1")
direct("with_ray2")
shutdown_ray(); time.sleep(3)
direct("alone2")
