"""Softmax over rows shorter than one vector: torch.softmax against the elementwise ops nmtcore.nn.layers.softmax uses, per row width
(python results/bench/2026-11-29-short-softmax/mb7.py; ATEN_CPU_CAPABILITY=avx2 for the AVX2 kernels)."""
import torch, time
torch.set_num_threads(2)
def bench(f, n=200):
    for _ in range(5): f()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    ts.sort(); return ts[len(ts) // 2] * 1e3
def manual(s):
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)
n = 7680 * 16
for d in (4, 8, 15, 16, 17, 24, 31, 32):
    s = torch.randn(n // d * 4, d)
    sb = s.bfloat16()
    print(d, f"softmax={bench(lambda: torch.softmax(s, -1)):.3f} manual={bench(lambda: manual(s)):.3f} bf16 softmax={bench(lambda: torch.softmax(sb, -1)):.3f} bf16->f32 softmax={bench(lambda: torch.softmax(sb, -1, dtype=torch.float32)):.3f}", flush=True)
