"""What machine a figure was measured on: stored beside every benchmark and every result file.

Why here and not in perf/: the applications write result files too (the reconstruction task's
``reconstruction.json``), and a figure without its machine cannot be compared with another one.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch

from hybridpar.device import cpu_alloc


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (or what ``platform`` knows elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """Facts that decide what a timing means: CPU, cores usable, memory, torch and its threads, GPU."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": affinity,
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
        "torch": torch.__version__,
        "torch_default_threads": torch.get_num_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", cpu_alloc.SWITCH)
                if k in os.environ},
        "malloc_tuning": cpu_alloc.enabled(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info
