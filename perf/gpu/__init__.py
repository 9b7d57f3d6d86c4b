"""The GPU suite's parts (``python -m perf gpu_check``, :mod:`perf.gpu_check`): its budget and plan, one
module per section, and the report.

Why a package: each section measures one thing (the CUDA tests, CosmoFlow's throughput, memory per rank,
the checkpoint stall, the U-Net, the scaling harness) and changes on its own; the budget that decides
which of them run, and the report that records them, are shared by all.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
