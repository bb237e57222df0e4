"""A/B in the in-actor layout: Ray's daemons + driver at their default nice (0) vs reniced to 19 (trainers at 15)."""
import os, sys, time, threading, tempfile
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
from pathlib import Path
sys.path.insert(0, "/work/main")
from nmtcore.allocator import reexec_with_allocator, allocator_in_use
reexec_with_allocator(); print("allocator", allocator_in_use(), flush=True)
from nmtcore.config import preset
from nmtcore.engine import run_experiment
from nmtcore.sweep import driver
from nmtcore.sweep import settings as sweep_settings
from search_spaces import SearchSpace, grid
from nmtcore.data import prepare_data
MODES = sys.argv[1].split(",")
NICE = int(os.environ.get("NICE", "19"))
work = Path(tempfile.mkdtemp(prefix="niceab-"))
cfg = preset("multi30k_small").with_overrides({"data.data_dir": "/work/shared/data", "train.max_epochs": 2,
    "train.num_threads": 2, "train.warmup_updates": 100, "train.keep_last": 1})
prepare_data(cfg.data)
def renice(stop):
    me = os.getpid()
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if not pid.isdigit(): continue
            try:
                comm = open(f"/proc/{pid}/comm").read().strip(); cmd = open(f"/proc/{pid}/cmdline").read()
            except OSError: continue
            if comm.startswith("ray::") or int(pid) == me: continue
            if not ("ray" in cmd or comm.startswith(("raylet", "gcs_server", "ray-dashboard"))): continue
            try:
                for t in os.listdir(f"/proc/{pid}/task"):
                    if os.getpriority(os.PRIO_PROCESS, int(t)) < NICE: os.setpriority(os.PRIO_PROCESS, int(t), NICE)
            except OSError: pass
        stop.wait(1.0)
res = []
for i, mode in enumerate(MODES):
    if mode == "direct":
        t0 = time.perf_counter(); run_experiment(cfg.with_overrides({"output_dir": str(work / f"d{i}")}), resume=False)
        res.append((mode, round(time.perf_counter() - t0, 1))); print("RES", res[-1], flush=True); continue
    space = SearchSpace("bench", "one", None, params={"model.d_model": grid((256,))}, metric="valid_loss", mode="min")
    st = sweep_settings.SweepSettings(name=f"ab{i}", storage=str(work / f"ray{i}"), tracking_uri=f"sqlite:///{work}/m{i}.db",
        cpus_per_trial=2.0, num_cpus=2, dashboard=True, report_dir=str(work / f"r{i}"), verbose=0, seeds=1)
    stop = threading.Event()
    if mode == "nice":
        threading.Thread(target=renice, args=(stop,), daemon=True).start()
    t0 = time.time()
    r = driver.run_sweep(space, cfg.with_overrides({"output_dir": str(work / f"u{i}")}), st, log_to_driver=False)
    stop.set()
    from nmtcore import tracking
    for t in r.trials:
        c = tracking.get_run(t.run_id, r.tracking_uri)
        res.append((mode, round(time.time() - t0, 1), round(t.metrics.get("time_total_s"), 1), round(c.metrics["cost/wall_s"], 1)))
        print("RES", res[-1], flush=True)
    from nmtcore.sweep.ray_backend import shutdown_ray
    shutdown_ray(); time.sleep(3)
print("ALL", res)
