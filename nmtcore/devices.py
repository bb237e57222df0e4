"""Device and precision choices shared by training and decoding.

``precision`` is ``"fp32"``, ``"bf16"`` or ``"auto"``; auto means bf16 autocast where the hardware runs
bf16 matmuls natively (CUDA with bf16 support; CPUs with AVX512-BF16 or AMX), fp32 otherwise. Losses,
log-probs and optimizer state always stay fp32.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os

import torch

from nmtcore.host import cpu_info

log = logging.getLogger(__name__)


def env_flag(var: str) -> bool:
    """True when environment variable ``var`` is set to anything but empty, 0, false, no or off."""
    return os.environ.get(var, "").strip().lower() not in ("", "0", "false", "no", "off")


_CUDNN_SDPA_CHECKED = False


def shape_free_cuda_attention() -> None:
    """Take cuDNN out of SDPA's CUDA backends (once per process; ``NMTCORE_CUDNN_SDPA=1`` keeps it in).

    torch 2.11 on an H100 sends bf16 attention with a padding mask to cuDNN first, and cuDNN builds an
    execution plan for every new (batch, length) shape: a few hundred ms each, forward and backward. Every
    token-budget batch here has new shapes, and every beam-search step a new key length, so the plans are
    never reused: measured on one H100 (``bench/gpu.py``, section ``sdpa``: 3+3 layers d 256, 4,096-token
    batches, 40 unseen batches each way), a bf16 training step took 555 ms with cuDNN in the choice and 38 ms
    without. The flash and memory-efficient kernels that remain need no per-shape plan. Every attention of the
    platform (:func:`nmtcore.nn.layers.attend`, the BERT layers through transformers' SDPA path) calls this
    before running on a GPU.
    """
    global _CUDNN_SDPA_CHECKED
    if _CUDNN_SDPA_CHECKED:
        return
    _CUDNN_SDPA_CHECKED = True
    if not env_flag("NMTCORE_CUDNN_SDPA"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def default_device() -> torch.device:
    """The GPU where there is one, else the CPU."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@functools.lru_cache(maxsize=None)
def cpu_supports_bf16() -> bool:
    """True when this CPU has native bf16 matrix instructions (AVX512-BF16 or AMX)."""
    flags = cpu_info()[1]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast_dtype(precision: str, device: torch.device | str) -> torch.dtype | None:
    """The autocast dtype for ``precision`` on ``device`` (None = plain fp32)."""
    device_type = torch.device(device).type
    if precision == "fp32":
        return None
    if device_type == "cuda":
        return torch.bfloat16 if (precision == "bf16" or torch.cuda.is_bf16_supported()) else None
    if cpu_supports_bf16():
        return torch.bfloat16
    if precision == "bf16":
        _warn_slow_cpu_bf16()
        return torch.bfloat16
    return None


@functools.lru_cache(maxsize=None)
def _warn_slow_cpu_bf16() -> None:
    """Once per process: bf16 was asked for on a CPU that has no bf16 matrix instructions."""
    log.warning("precision=bf16 on a CPU without AVX512-BF16 or AMX: bf16 matmuls run without hardware support "
                "here, up to ~100x slower than fp32 (measured on an AVX2-only CPU: < 1 GFLOP/s against ~120); "
                "precision=auto picks fp32 on such CPUs")


def autocast(dtype: torch.dtype | None, device: torch.device | str,
             cache: bool = True) -> contextlib.AbstractContextManager:
    """``torch.autocast`` for ``dtype`` on ``device``'s type, or a no-op for fp32. ``cache=False`` turns off
    autocast's cache of cast weights (a CUDA graph capture needs it off)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype, cache_enabled=cache)
