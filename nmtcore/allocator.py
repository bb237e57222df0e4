"""The C heap allocator under nmtcore's processes: glibc's malloc tuned where a process decodes, tcmalloc
preloaded where it trains.

PyTorch's CPU tensors come from the C library's ``malloc``; what it does with freed blocks decides both a
process's speed (pages faulted in again) and its resident memory (freed memory kept mapped):

- **Decoding** (:func:`tune_allocator`): a beam-search step frees and reallocates its (rows × vocabulary)
  tensors; glibc hands each such block a fresh zeroed mapping unless its thresholds are raised.
- **Training** (:func:`preload_env`): under activation checkpointing's recompute glibc keeps freed heap mapped
  that it cannot reuse: the PLM-sponsored trial's resident peak was 2.2× what its allocations ever held at
  once (the baseline's 1.5×). gperftools' tcmalloc (``libtcmalloc_minimal``) took a third off that trial's
  peak, left the baseline's as it was and was not slower (docs/performance.md, "The allocator for training"; jemalloc: smaller
  everywhere, the baseline's updates slower). An allocator cannot be swapped inside a running process, so the
  library is preloaded (``LD_PRELOAD``) into the processes that train: the ``nmtcore`` command re-executes
  itself once (:func:`reexec_with_allocator`; training commands only) and a sweep passes it to the processes
  that train (its trial actors or Train workers, its baseline task) through the Ray runtime environment
  (``SweepSettings.allocator``).

``NMTCORE_ALLOCATOR`` (or a sweep's ``--allocator``) chooses: ``auto`` (default: tcmalloc where it is
installed, else the C library's own), ``tcmalloc``, ``jemalloc``, ``system``, or a library's path. A library
the user already preloads (``LD_PRELOAD`` naming a ``*malloc*`` library) is left as it is.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
import sysconfig
from pathlib import Path
from typing import Mapping

ALLOCATOR_VAR = "NMTCORE_ALLOCATOR"
CHOICES = ("auto", "tcmalloc", "jemalloc", "system")
# The shared objects each name stands for, in order of preference (tcmalloc_minimal: no heap profiler).
LIBRARIES = {"tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"), "jemalloc": ("libjemalloc.so.2",)}
INSTALL = {"tcmalloc": "apt install libtcmalloc-minimal4, dnf install gperftools-libs or conda install gperftools",
           "jemalloc": "apt install libjemalloc2, dnf install jemalloc or conda install jemalloc"}
_REEXEC_VAR = "NMTCORE_ALLOCATOR_REEXEC"  # set in the re-executed process: never a second time


class AllocatorError(ValueError):
    """An allocator choice that cannot be honoured (unknown name, library not installed, not Linux)."""


# ---------------------------------------------------------------------------------------- preloading (training)
def _library_dirs() -> list[Path]:
    """Where shared libraries live: the environment's own (conda), then the system's."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{platform.machine()}-linux-gnu"
    dirs = [Path(sys.prefix) / "lib", Path("/usr/local/lib"), Path("/usr/lib") / arch, Path("/lib") / arch,
            Path("/usr/lib64"), Path("/usr/lib")]
    return list(dict.fromkeys(dirs))


def find_library(name: str) -> str | None:
    """Path of the installed library for allocator ``name`` (``tcmalloc`` / ``jemalloc``), or None."""
    for soname in LIBRARIES[name]:
        for d in _library_dirs():
            if (d / soname).is_file():
                return str(d / soname)
    return None


def allocator_choice(choice: str | None = None) -> str:
    """``choice`` where given, else ``$NMTCORE_ALLOCATOR``, else ``auto``."""
    return (choice or os.environ.get(ALLOCATOR_VAR, "")).strip() or "auto"


def user_preloads_allocator(env: Mapping[str, str] | None = None) -> bool:
    """True where ``env`` (default: this process's) preloads an allocator of its own (``LD_PRELOAD`` naming a
    ``*malloc*`` library: jemalloc, tcmalloc, mimalloc): nmtcore then leaves the allocator alone."""
    return "malloc" in (os.environ if env is None else env).get("LD_PRELOAD", "")


def resolve_allocator(choice: str | None = None) -> str | None:
    """The library to preload for ``choice`` (:func:`allocator_choice`); None = the C library's own malloc.
    Raises :class:`AllocatorError` for a choice that names something absent."""
    choice = allocator_choice(choice)
    if choice == "system":
        return None
    if "/" in choice:
        if not Path(choice).is_file():
            raise AllocatorError(f"allocator library {choice} does not exist")
        return choice
    if choice not in CHOICES:
        raise AllocatorError(f"unknown allocator {choice!r}: expected one of {', '.join(CHOICES)} or a library's path")
    if platform.system() != "Linux":
        if choice == "auto":
            return None
        raise AllocatorError(f"allocator {choice!r}: preloading an allocator is supported on Linux only")
    if choice == "auto":
        return find_library("tcmalloc")
    path = find_library(choice)
    if path is None:
        raise AllocatorError(f"allocator {choice!r} is not installed here ({INSTALL[choice]}); "
                             f"or set {ALLOCATOR_VAR}=system")
    return path


def preload_env(choice: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment variables that start a new process on ``choice``'s allocator: ``{"LD_PRELOAD": ...}``,
    or ``{}`` where that is the C library's own or ``env`` (default: this process's) already preloads one."""
    env = os.environ if env is None else env
    if user_preloads_allocator(env):
        return {}  # the user's own allocator wins
    lib = resolve_allocator(choice)
    if lib is None:
        return {}
    return {"LD_PRELOAD": f"{lib} {env.get('LD_PRELOAD', '')}".strip()}


def allocator_in_use() -> str:
    """``tcmalloc``, ``jemalloc`` or ``system``: the allocator this process runs on (its mapped libraries)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system"
    return next((name for name in LIBRARIES if f"lib{name}" in maps), "system")


def reexec_with_allocator() -> None:
    """Replace this process by itself started on the chosen allocator (:func:`preload_env`), once.

    For a command started from a shell (the ``nmtcore`` console command); returns where there is nothing to
    preload or this process already is the re-executed one. Raises :class:`AllocatorError` for a bad choice.
    """
    extra = preload_env()
    if not extra or os.environ.get(_REEXEC_VAR):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **extra, _REEXEC_VAR: "1"})


# ---------------------------------------------------------------------------------------- glibc (decoding)
# glibc's malloc, as tuned by :func:`tune_allocator`: blocks up to this size come from the heap, not from a fresh
# mmap each time, and the heap keeps up to this much free memory at its top instead of giving it back at once.
MMAP_THRESHOLD = 256 << 20
TRIM_THRESHOLD = 512 << 20
# Any of these set: the user tunes the allocator (or preloads another one) and we leave it alone.
ALLOCATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                 "GLIBC_TUNABLES")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


@functools.lru_cache(maxsize=None)
def on_glibc() -> bool:
    """True on Linux with glibc, the only allocator :func:`tune_allocator` knows how to tune."""
    return platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


@functools.lru_cache(maxsize=None)
def tune_allocator() -> bool:
    """Stop glibc's malloc from handing every large tensor freshly mapped, zeroed pages; True if it was tuned.

    By default glibc serves a block above its (adaptive, at most 32 MiB) mmap threshold with a new mapping and
    unmaps it on free, and gives the heap's free top back to the kernel beyond twice that threshold. A beam-search
    step frees and reallocates its large tensors (logits, log-probabilities) every time, so each step faults in,
    zeroed, memory it has just released. With the thresholds raised (:data:`MMAP_THRESHOLD`,
    :data:`TRIM_THRESHOLD`) the heap keeps and reuses it: measured here (2 threads, the baseline Transformer 3+3,
    d 256, beam 5) ~10x fewer minor page faults and ~25% more sentences/s (docs/performance.md, "The allocator").

    Called by processes that decode (:class:`~nmtcore.decoding.translator.Translator`), not by training: there
    the evidence was mixed (the baseline's updates faster in some pairs, PLM-sponsored's 14% slower in two runs
    and its peak resident memory higher), and a trial's memory is what sweeps pack by.

    Applies once per process, on Linux with glibc only; not when the user set any of :data:`ALLOCATOR_ENV` or
    preloads another allocator (``LD_PRELOAD`` naming a ``*malloc*`` library: jemalloc, tcmalloc, mimalloc).
    """
    if not on_glibc():
        return False
    if any(os.environ.get(name) for name in ALLOCATOR_ENV) or user_preloads_allocator():
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(MMAP_THRESHOLD))
                and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(TRIM_THRESHOLD)))
