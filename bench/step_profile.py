"""Where a training step of the peer benchmark's model goes on this machine: the trainer's own steps
(bench/vs_fairseq.py's model, batches and settings) timed, then under ``torch.profiler``: every operator by its
own CPU time, and every matrix product by shape with the rate it ran at beside the machine's peak matmul rate.

What a speed-up can still take from a step: the matrix products' share, how near the peak they run, and what the
rest is made of (casts, dropout, the loss, normalisation). ``--compile`` times ``train.compile`` beside eager.

``--loop ROUNDS`` instead asks what the training loop costs beside its steps: per round, ``trainer.fit()`` over
the benchmark's first ``--loop-updates`` updates with the next batch collated in a background thread
(``data.prefetch_batches`` 1), the same with batches collated in the loop (0), and the bare ``train_step`` over the
same batches collated beforehand, each a new trainer from the same seed; each prints its target tokens/s, the
time outside its steps, and its steps' median time past the first ten.

  python bench/step_profile.py --data-dir ../shared/data [--precisions fp32,auto] [--steps 16] [--compile]
  python bench/step_profile.py --data-dir ../shared/data --precisions fp32 --loop 2 [--loop-updates 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def matmul_flops(name: str, shapes: list) -> int:
    """Floating-point operations of one matrix product from its input shapes as the profiler records them
    (``aten::mm`` (m, k) @ (k, n); ``aten::addmm`` bias, (m, k), (k, n); ``aten::bmm`` (b, m, k) @ (b, k, n))."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return 2 * m * k * n
    if name == "aten::addmm":
        (m, k), (_, n) = shapes[1], shapes[2]
        return 2 * m * k * n
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return 2 * b * m * k * n
    raise ValueError(f"not a matrix product: {name}")


@dataclass
class Row:
    name: str
    seconds: float  # own CPU time over the profiled steps
    calls: int
    shapes: str = ""
    gflops: float = 0.0  # a matrix product's rate (GFLOP/s)


def summarize(events: Iterable[Any]) -> tuple[list[Row], list[Row]]:
    """(operators by own CPU time, matrix products by shape) from ``key_averages(group_by_input_shape=True)``,
    largest first."""
    ops: dict[str, Row] = {}
    products = []
    for e in events:
        seconds = e.self_cpu_time_total / 1e6
        row = ops.setdefault(e.key, Row(e.key, 0.0, 0))
        row.seconds += seconds
        row.calls += e.count
        if e.key in MATMULS and seconds > 0:
            flops = matmul_flops(e.key, e.input_shapes) * e.count
            products.append(Row(e.key, seconds, e.count, str(e.input_shapes), flops / seconds / 1e9))
    return (sorted(ops.values(), key=lambda r: -r.seconds), sorted(products, key=lambda r: -r.seconds))


def profile_precision(args, vs_fairseq, precision: str, data, compiled: bool) -> None:
    from torch.profiler import ProfilerActivity, profile

    from decode_speed import peak_matmul_gflops  # bench/
    from nmtcore.devices import autocast_dtype
    from nmtcore.engine import build_trainer

    cfg = vs_fairseq.experiment(args, "thr", 5e-4, 4000, 10**6, precision)
    cfg = cfg.with_overrides({"train.compile": compiled})
    trainer = build_trainer(cfg, data, device=torch.device("cpu"))
    it = trainer.train_batches(epoch=1)
    batches = [next(it) for _ in range(args.warmup + 2 * args.steps)]
    warm, timed, profiled = (batches[:args.warmup], batches[args.warmup:args.warmup + args.steps],
                             batches[args.warmup + args.steps:])
    for b in warm:
        trainer.train_step([b])
    t0 = time.perf_counter()
    for b in timed:
        trainer.train_step([b])
    step_s = (time.perf_counter() - t0) / len(timed)
    tokens = sum(b.n_tgt_tokens for b in timed) / len(timed)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for b in profiled:
            trainer.train_step([b])
    ops, products = summarize(prof.key_averages(group_by_input_shape=True))
    total = sum(r.seconds for r in ops)
    mm_s = sum(r.seconds for r in ops if r.name in MATMULS)
    mm_flops = sum(r.gflops * r.seconds for r in products)
    peak = peak_matmul_gflops(autocast_dtype(precision, trainer.device) or torch.float32)
    tag = f"{precision}{' compiled' if compiled else ''}"
    print(f"step[{tag}]: ms_per_step={step_s * 1000:.0f} tgt_tok_per_s={tokens / step_s:.0f} "
          f"matmul_share={mm_s / total:.3f} matmul_gflops={mm_flops / mm_s:.0f} peak_gflops={peak:.0f} "
          f"other_ms_per_step={(total - mm_s) / len(profiled) * 1000:.0f} (profiled)", flush=True)
    print(f"  operators by own CPU time, {len(profiled)} profiled steps ({total:.2f} s):")
    for r in ops[:args.top]:
        print(f"    {r.seconds / total:6.1%} {r.seconds * 1000 / len(profiled):7.1f} ms/step {r.calls / len(profiled):6.1f}"
              f" calls/step  {r.name}")
    print("  matrix products by shape:")
    for r in products[:args.top]:
        print(f"    {r.seconds / total:6.1%} {r.gflops:7.0f} GFLOP/s ({r.gflops / peak:4.0%} of peak) "
              f"{r.calls / len(profiled):5.1f}/step  {r.name} {r.shapes}")


LOOP_WAYS = ("fit, prefetch 1", "fit, prefetch 0", "bare steps")


def loop_round(args, vs_fairseq, precision: str, data, way: str, out: Path) -> dict[str, float]:
    """One of :data:`LOOP_WAYS` over the benchmark's first ``args.loop_updates`` updates: target tokens/s over
    the training wall time (``fit``: the epochs' own, as bench/vs_fairseq.py takes it), seconds outside the steps,
    and the steps' median past the first ten (ms)."""
    from nmtcore.engine import build_trainer

    cfg = vs_fairseq.experiment(args, "thr", 5e-4, 4000, args.loop_updates, precision)
    cfg = cfg.with_overrides({"output_dir": str(out), "data.prefetch_batches": 0 if "prefetch 0" in way else 1})
    trainer = build_trainer(cfg, data, device=torch.device("cpu"))
    steps: list[float] = []
    step = trainer.train_step

    def timed(batches):
        t = time.perf_counter()
        stats = step(batches)
        steps.append(time.perf_counter() - t)
        return stats

    if way == "bare steps":
        batches, epoch = [], 1
        while len(batches) < args.loop_updates:
            batches += [b for _, b in zip(range(args.loop_updates - len(batches)), trainer.train_batches(epoch))]
            epoch += 1
        t0 = time.perf_counter()
        for b in batches:
            timed([b])
        wall, tokens = time.perf_counter() - t0, sum(b.n_tgt_tokens for b in batches)
    else:
        trainer.train_step = timed
        trainer.fit()
        wall = sum(h["train_wall_s"] for h in trainer.state.history)
        tokens = sum(h["train_tokens"] for h in trainer.state.history)
    return {"tgt_tok_per_s": tokens / wall, "outside_steps_s": wall - sum(steps),
            "step_ms_median": 1000 * statistics.median(steps[10:] or steps), "updates": len(steps)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--cache-dir", default="")
    p.add_argument("--out", default=None, help="the trainers' output folder (default: a temporary one)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--precisions", default="fp32,auto")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="steps timed, then as many profiled")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--compile", action="store_true", help="also each precision with train.compile")
    p.add_argument("--loop", type=int, default=0, metavar="ROUNDS",
                   help="instead of the profile: the training loop against its bare steps, ROUNDS times")
    p.add_argument("--loop-updates", type=int, default=100)
    args = p.parse_args()
    if not args.data_dir:
        p.error("--data-dir (or NMTCORE_DATA) is required")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import vs_fairseq  # bench/: the peer benchmark's experiment

    from nmtcore.data import prepare_data
    from nmtcore.engine import setup_torch

    with tempfile.TemporaryDirectory(prefix="step-profile-") as tmp:
        args.out = args.out or tmp
        cfg = vs_fairseq.experiment(args, "thr", 5e-4, 4000, 1, "fp32")
        setup_torch(cfg)
        data = prepare_data(cfg.data)
        print(f"threads={torch.get_num_threads()} torch {torch.__version__}", flush=True)
        for precision in args.precisions.split(","):
            if not args.loop:
                for compiled in ((False, True) if args.compile else (False,)):
                    profile_precision(args, vs_fairseq, precision, data, compiled)
            for r in range(args.loop):
                for i, way in enumerate(LOOP_WAYS):
                    fig = loop_round(args, vs_fairseq, precision, data, way, Path(args.out) / f"loop-{precision}-{r}-{i}")
                    print(f"loop[{precision}] round {r + 1} {way}: tgt_tok_per_s={fig['tgt_tok_per_s']:.0f} "
                          f"outside_steps_s={fig['outside_steps_s']:.2f} step_ms_median={fig['step_ms_median']:.0f} "
                          f"updates={fig['updates']} load={os.getloadavg()[0]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
