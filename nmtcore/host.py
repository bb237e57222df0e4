"""What this machine's CPU is, in the words every figure names it by (torch-free: read by the tracking tags too)."""

from __future__ import annotations

import functools
import os
import platform


@functools.lru_cache(maxsize=None)
def cpu_info() -> tuple[str, frozenset[str]]:
    """(the CPU's model name, its feature flags) from ``/proc/cpuinfo`` (Linux); elsewhere the platform's
    processor name and no flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return platform.processor() or "unknown CPU", frozenset()
    model, flags = parse_cpuinfo(text)
    return model or platform.processor() or "unknown CPU", flags


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The first processor's model name and flags in a ``/proc/cpuinfo`` text ("" and none where it has none)."""
    model, flags = "", frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def isa_class(flags: frozenset[str]) -> str:
    """The widest kernels ``flags`` allow, as the figures name them: ``AMX-BF16``, ``AVX512-BF16`` (bf16 trains
    there), ``AVX512`` or ``AVX2`` (fp32), else ``no AVX2``."""
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"),
                       ("avx2", "AVX2")):
        if flag in flags:
            return name
    return "no AVX2"


def cpu_description() -> str:
    """``Intel(R) Xeon(R) Processor, 2 CPUs, AMX-BF16``: the model, the logical CPUs and :func:`isa_class`."""
    model, flags = cpu_info()
    return f"{model}, {os.cpu_count()} CPUs, {isa_class(flags)}"


__all__ = ["cpu_description", "cpu_info", "isa_class", "parse_cpuinfo"]
