"""What the sections share on the device: waiting for it, its peak memory over a step, and jobs of ranks
sharing the one GPU, killed at the budget's end.

Why here: the memory and U-Net sections run the same kind of job and read memory the same way, and a
CPU smoke run must take the same paths (no peak counter there: None).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from perf.gpu.budget import Overrun, Run


def rank_count(label: str) -> int:
    """``"2 ranks"`` -> 2: the memory and U-Net rows are named by their rank count."""
    return int(label.split()[0])


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(step: Callable[[], Any], device: torch.device) -> int | None:
    """Peak device memory ``step`` allocates above what was allocated before it (None on CPU: torch
    keeps no such counter there)."""
    if device.type != "cuda":
        step()
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 3)


def launch_ranks(run: Run, section: str, fn: Callable, world: int, *args: Any) -> list[dict[str, Any]]:
    """``fn`` on ``world`` ranks sharing the GPU (gloo + the staged transport: hybridpar sees more
    local ranks than devices), killed at the budget's end."""
    from perf.common import launch

    try:
        return launch(fn, world, *args, every_rank=True, timeout=max(run.left(), 1.0),
                      env={"LOCAL_WORLD_SIZE": str(world)})
    except TimeoutError as err:
        raise Overrun(f"{world}-rank job killed at the budget's end: {err}") from err


def rank_rows(run: Run, section: str, rows: list[tuple[str, float]], size: int, job: Callable,
              fill: Callable[[dict[str, Any], list[dict[str, Any]]], None], *args: Any) -> None:
    """Each row (``"N ranks"``, estimated seconds) of a section of ranks sharing the GPU that the budget
    lets run: ``job(rank, world, size, *args, device_type)`` on its ranks, ``fill(row, per_rank)`` the
    row's figures from their results. A job killed at the budget's end is recorded and ends the
    section; any other failure is recorded in its row and the next row runs."""
    device_type = "cuda" if run.mode == "gpu" else "cpu"
    for label, estimate in rows:
        if not run.fits(section, label, estimate):
            continue
        world = rank_count(label)
        row: dict[str, Any] = {"ranks": world, "size": size}
        try:
            fill(row, launch_ranks(run, section, job, world, size, *args, device_type))
        except Overrun:
            run.add(section, {**row, "note": "killed at the budget's end"})
            raise
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        run.add(section, row)
