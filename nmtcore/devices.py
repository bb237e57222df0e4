"""Device and precision choices shared by training and decoding.

``precision`` is ``"fp32"``, ``"bf16"`` or ``"auto"``; auto means bf16 autocast where the hardware runs
bf16 matmuls natively (CUDA with bf16 support; CPUs with AVX512-BF16 or AMX), fp32 otherwise. Losses,
log-probs and optimizer state always stay fp32.
"""

from __future__ import annotations

import contextlib
import functools

import torch


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None = plain fp32)."""
    device_type = torch.device(device).type
    if precision == "fp32":
        return None
    if device_type == "cuda":
        return torch.bfloat16 if (precision == "bf16" or torch.cuda.is_bf16_supported()) else None
    if precision == "bf16" or cpu_supports_bf16():
        return torch.bfloat16
    return None


def autocast(dtype: torch.dtype | None, device: torch.device | str) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` on ``device``'s type, or a no-op for fp32."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
