"""One section under the budget: skipped with its reason, or run with its status, reason and seconds
recorded, whatever happens inside it.

Why one runner for all: every section must end the same way (``ran``, ``skipped``, ``timed_out``,
``failed``) and leave the results written, so that one broken section costs only its own figures.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch

from perf.gpu.budget import ESTIMATES, Overrun, Run, Sizes
from perf.gpu.checkpoint import section_checkpoint
from perf.gpu.cuda_tests import section_tests
from perf.gpu.memory import section_memory
from perf.gpu.scaling import section_scaling
from perf.gpu.throughput import section_cosmoflow
from perf.gpu.unet import section_unet

RUNNERS: dict[str, Callable[[Run, Sizes, list[tuple[str, float]], Path], None]] = {
    "tests": section_tests, "cosmoflow": section_cosmoflow, "memory": section_memory,
    "checkpoint": section_checkpoint, "unet": section_unet, "scaling": section_scaling}


def run_section(run: Run, name: str, sizes: Sizes, work: Path, off: dict[str, str]) -> None:
    """One section under the budget: skipped (why) if off or if its set-up and first row do not fit,
    else run, with its status, reason and seconds recorded and the results written either way."""
    record = run.results["sections"][name]
    setup, rows = ESTIMATES[run.mode][name]
    reason = off.get(name)
    first, left = setup + rows[0][1], run.left()
    if reason is None and first > left:
        reason = (f"estimated {first:.0f} s to its first row > {max(left, 0):.0f} s left of the "
                  f"{run.budget_s:.0f} s budget")
    if reason is not None:
        record.update(status="skipped", reason=reason)
        print(f"gpu_check: {name} skipped: {reason}", flush=True)
        run.save()
        return
    record["status"] = "running"  # what a run killed inside this section leaves
    run.save()
    t0 = time.monotonic()
    try:
        RUNNERS[name](run, sizes, rows, work)
        record.update(status="ran", reason=None)
    except Overrun as err:
        record.update(status="timed_out", reason=str(err))
        print(f"gpu_check: {name} timed out: {err}", flush=True)
    except Exception as err:  # a broken section must not cost the later ones
        record.update(status="failed", reason=f"{type(err).__name__}: {err}"[:300])
        print(f"gpu_check: {name} failed: {record['reason']}", flush=True)
    record["seconds"] = round(time.monotonic() - t0, 1)
    if torch.cuda.is_initialized():  # the cached blocks of this section's models would count against
        gc.collect()  # the next section's ranks, which share the GPU with this process
        torch.cuda.empty_cache()
    run.save()
