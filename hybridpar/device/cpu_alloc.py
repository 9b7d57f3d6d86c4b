"""Keep glibc's malloc from returning activation memory to the kernel between micro-batches (CPU only).

Why: on CPU every activation tensor comes from glibc ``malloc``. By default glibc serves blocks
above a *dynamic* threshold (128 KiB rising to the largest block freed, at most 32 MiB) with a
fresh ``mmap``, and gives the top of its heap back to the kernel whenever more than twice that
threshold is free. A GPipe step allocates the activations of all M micro-batches and then frees
them all, so each step shrinks the heap and the next one faults every page back in (the kernel
zeroes each 4 KiB page): GPipe's order (all forwards, then all backwards) then costs markedly more
than running the same micro-batches one after another, the same kernels, and with the settings below
the two cost the same. A whole batch run at once pays the same cost.

The cure is the one CUDA's caching allocator applies on GPUs: keep freed memory for the next
step. :func:`tune` fixes the mmap threshold at its ceiling (32 MiB, so only very large blocks are
mapped and unmapped) and stops heap trimming, through ``mallopt`` (no environment variable has to
be set before the process starts). The price is that a process keeps its peak heap; that is what
a training loop reaches every step anyway. ``HYBRIDPAR_MALLOC_TUNING=0`` turns it off (a memory
benchmark that wants the resident set to follow live tensors does this).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

# mallopt parameters, from glibc's <malloc.h>
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1     # mallopt takes an int: 2 GiB free at the heap's top before a trim

_tuned: bool | None = None


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None  # musl and others have no mallopt


SWITCH = "HYBRIDPAR_MALLOC_TUNING"


def enabled() -> bool:
    """Whether the tuning is on (``HYBRIDPAR_MALLOC_TUNING=0`` turns it off)."""
    return os.environ.get(SWITCH, "1") != "0"


def tune(force: bool = False) -> bool:
    """Apply the settings above once per process; True when glibc took them.

    A no-op (False) off Linux/glibc, or when ``HYBRIDPAR_MALLOC_TUNING=0``. Safe to call often.
    """
    global _tuned
    if _tuned is not None and not force:
        return _tuned
    _tuned = False
    if not enabled():
        return False
    libc = _libc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    ok = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX))
    ok = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and ok
    _tuned = ok
    return ok


def tuned() -> bool:
    """Whether :func:`tune` has taken effect in this process."""
    return bool(_tuned)
