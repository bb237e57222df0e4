"""Peak memory and step time of the models that fine-tune a BERT, with and without activation checkpointing
over the BERT layers (``model.bert.activation_checkpointing``), against the baseline Transformer trial,
measured side by side in one run (each case in its own process, one after another).

Cases (``multi30k_small`` preset, Multi30k En→De, the trainer's own batches, same seed):

- ``baseline``: the Transformer 3+3, d 256 (what a sweep's control trial trains).
- ``bert_jam_ft``: BERT-JAM in its phase 3 (BERT fine-tuned with the NMT part and the GLUs), BERT = minilm.
- ``plm_sponsored``: the PLM-sponsored model as the kd_alpha study trains it (source BERT minilm fine-tuned,
  target BERT e5:L6 fine-tuned as the decoder, half-layer KD teacher, α = 0.9, MLM and target-LM losses).

Per case: the process's peak resident memory (VmHWM over the whole run: data, model, optimizer, updates),
the peak over the updates alone (VmHWM reset after the build), and seconds per update. Every case runs on the
allocator a sweep's trial trains on (:mod:`nmtcore.allocator`: tcmalloc where it is installed, else glibc's
malloc; ``NMTCORE_ALLOCATOR=system`` for glibc's); the first line says which. Under glibc's, beside the peak, the
peak of the memory the process's allocations hold (``mallinfo2``: in-use heap chunks plus mmapped blocks, sampled
every 10 ms during the updates): the difference between the two is what the allocator keeps mapped but free
(fragmentation), which the bar counts, as the machine does. Bars (the issue):
a fine-tuned BERT's trial peak <= 2 x the baseline trial's; PLM-sponsored peak <= 4 GB.

  python bench/finetune_memory.py --data-dir ../shared/data [--threads 2] [--updates 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

from nmtcore.allocator import allocator_in_use, reexec_with_allocator

CASES = {
    "baseline": {},
    "bert_jam_ft": {"model.name": "bert_jam", "model.bert.name": "minilm",
                    "train.phases": [{"name": "finetune", "epochs": 0, "trainable": ["nmt", "glu", "bert"]}]},
    "plm_sponsored": {"model.name": "plm_sponsored", "model.bert.name": "minilm", "model.bert.freeze": False,
                      "model.kd_teacher": True, "model.kd_layer": "half", "train.kd_alpha": 0.9},
}


def _vm(field: str) -> float:
    """A VmXXX line of /proc/self/status, in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _LivePeak:
    """Peak of glibc's in-use heap chunks + mmapped blocks (MiB), sampled by a thread; None where the C library
    has no ``mallinfo2`` (not glibc, or glibc < 2.33) or another allocator is preloaded (tcmalloc, jemalloc)."""

    def __init__(self) -> None:
        import ctypes
        import threading

        fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        info = type("mallinfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in fields]})
        self._call = None
        if allocator_in_use() == "system":  # glibc's counters say nothing where another allocator serves malloc
            with contextlib.suppress(OSError, AttributeError):  # not glibc, or glibc < 2.33
                self._call = ctypes.CDLL("libc.so.6").mallinfo2
                self._call.restype = info
        self.peak: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def live(self) -> float:
        m = self._call()
        return (m.uordblks + m.hblkhd) / 2**20

    def _run(self) -> None:
        while not self._stop.wait(0.01):  # mallinfo2 locks the arenas: not too often
            self.peak = max(self.peak or 0.0, self.live())

    def __enter__(self) -> "_LivePeak":
        if self._call is not None:
            self.peak = self.live()
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._call is not None:
            self._stop.set()
            self._thread.join()


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # VmHWM := current RSS


def child(args: argparse.Namespace) -> int:
    import torch

    from nmtcore.bert import ensure_bert
    from nmtcore.config import preset
    from nmtcore.data import prepare_data
    from nmtcore.engine import build_trainer

    _reset_peak()  # this process only (a child's counter may start at its parent's peak)
    ckpt = bool(args.checkpointing)
    cfg = preset("multi30k_small").with_overrides({
        "data.data_dir": args.data_dir, "data.download": False, "train.num_threads": args.threads,
        "train.max_updates": args.updates, "train.valid_bleu": False, "output_dir": "bench/out/finetune_memory",
        **CASES[args.case], **({} if args.case == "baseline" else {"model.bert.activation_checkpointing": ckpt}),
        **({"model.tgt_bert.activation_checkpointing": ckpt} if args.case == "plm_sponsored" else {})})
    cfg = ensure_bert(cfg)
    data = prepare_data(cfg.data)
    trainer = build_trainer(cfg, data, device=torch.device("cpu"))
    built = _vm("VmRSS")
    _reset_peak()
    batches = trainer.train_batches(1)
    with _LivePeak() as live:
        trainer.train_step([next(batches)])  # first update: allocator and optimizer state warm
        t0 = time.perf_counter()
        for _ in range(args.updates - 1):
            trainer.train_step([next(batches)])
        step_s = (time.perf_counter() - t0) / max(args.updates - 1, 1)
    print("RESULT " + json.dumps({"case": args.case, "checkpointing": ckpt, "built_mib": built,
                                  "updates_peak_mib": _vm("VmHWM"), "updates_live_peak_mib": live.peak, "step_s": step_s,
                                  "trainable": trainer.model.num_parameters(trainable=True),
                                  "loadavg": os.getloadavg()[0]}), flush=True)
    return 0


def _mib(result: dict) -> str:
    live = result.get("updates_live_peak_mib")
    return "n/a" if live is None else f"{live:.0f} MiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", default=os.environ.get("NMTCORE_DATA", ""))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--updates", type=int, default=20)
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--checkpointing", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        return child(args)
    reexec_with_allocator()  # its cases (children) start on the allocator a trial trains on (nmtcore.allocator)
    print(f"allocator={allocator_in_use()}", flush=True)
    rows = []
    for case in args.cases.split(","):
        # A first process builds what is cached (BERT, its WordPiece stream, FWET table) and is not measured:
        # the measured ones all find the caches warm, as a sweep's trials do.
        runs = [(0, 2, False)] + [(ckpt, args.updates, True) for ckpt in ((0,) if case == "baseline" else (0, 1))]
        for ckpt, updates, measured in runs:
            cmd = [sys.executable, __file__, "--case", case, "--checkpointing", str(ckpt), "--data-dir", args.data_dir,
                   "--threads", str(args.threads), "--updates", str(updates)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            result = next((json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")), None)
            if out.returncode != 0 or result is None:
                print(f"{case} checkpointing={ckpt}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", flush=True)
                return 1
            if not measured:
                continue
            # The whole process's peak, read by the parent from the child's rusage would carry the parent's
            # own peak across exec; the child's VmHWM after its reset is its own.
            rows.append(result)
            print(f"{case:14s} checkpointing={'on ' if ckpt else 'off'} built={result['built_mib']:.0f} MiB "
                  f"peak during updates={result['updates_peak_mib']:.0f} MiB (allocations {_mib(result)}) "
                  f"step={result['step_s']:.2f} s "
                  f"trainable={result['trainable'] / 1e6:.1f}M loadavg={result['loadavg']:.1f}", flush=True)
    base = next((r for r in rows if r["case"] == "baseline"), None)
    if base is not None:
        for r in rows:
            if r["case"] != "baseline":
                print(f"RESULT {r['case']} checkpointing={'on' if r['checkpointing'] else 'off'}: "
                      f"peak/baseline={r['updates_peak_mib'] / base['updates_peak_mib']:.2f} (bar <= 2.0) "
                      f"peak={r['updates_peak_mib'] / 1024:.2f} GiB step/baseline={r['step_s'] / base['step_s']:.2f}"
                      + (f" allocations' peak/baseline={r['updates_live_peak_mib'] / base['updates_live_peak_mib']:.2f}"
                         if r.get("updates_live_peak_mib") and base.get("updates_live_peak_mib") else ""),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
