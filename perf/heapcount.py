"""Exact heap peaks on CPU: the bytes malloc has handed out, now and at their highest since a reset.

Why: the CPU has no ``torch.cuda.max_memory_allocated``. The resident set is what the OS charges, but
between two implementations of the same computation it also differs by which pages each happened to
touch: code pages of the libraries (file-backed, shared), thread stacks, heap fragmentation. A
memory comparison of tensors needs the allocator's own count, so ``heap_peak.c`` (next to this file)
interposes glibc's allocator in the benchmark's ranks (``LD_PRELOAD``) and counts every block.

    env = heapcount.preload_env()        # {} when no C compiler is found: the column is left out
    os.environ.update(env)               # before spawning the ranks
    ...                                  # in a rank:
    heapcount.reset(); step(); heapcount.peak() - base
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "heap_peak.c"


def library() -> Path | None:
    """Build ``heap_peak.c`` once per source version (into the temp dir); None without a compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:12]
    out = Path(tempfile.gettempdir()) / f"hybridpar-heap-peak-{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.so")
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(tmp), str(SOURCE), "-ldl"], check=True)
        tmp.replace(out)
    return out


def preload_env() -> dict[str, str]:
    """Environment that loads the counter into processes started after it is set."""
    lib = library()
    return {} if lib is None else {"LD_PRELOAD": str(lib)}


def _lib() -> ctypes.CDLL | None:
    lib = ctypes.CDLL(None)
    if not hasattr(lib, "heap_peak_peak"):
        return None
    for name in ("heap_peak_current", "heap_peak_peak"):
        getattr(lib, name).restype = ctypes.c_longlong
    return lib


def active() -> bool:
    """Whether this process runs with the counter loaded."""
    return _lib() is not None


def current() -> int:
    """Bytes handed out now (0 without the counter)."""
    lib = _lib()
    return 0 if lib is None else int(lib.heap_peak_current())


def peak() -> int:
    """Highest :func:`current` since the last :func:`reset` (0 without the counter)."""
    lib = _lib()
    return 0 if lib is None else int(lib.heap_peak_peak())


def reset() -> None:
    """Start a new peak from the bytes handed out now."""
    lib = _lib()
    if lib is not None:
        lib.heap_peak_reset()
