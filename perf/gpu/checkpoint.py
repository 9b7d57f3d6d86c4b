"""Section 4, ``checkpoint``: how long training stalls for a save of a >= 2 GiB state, ours (overlapped,
into host buffers reserved once) against ``torch.save`` and DCP's ``async_save``.

Why the stall and not the save's time: an overlapped save is written while the next steps run; what
training pays is the time it blocks.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from perf.gpu.budget import Run, Sizes
from perf.gpu.device import sync


def bench_checkpoint(nbytes: int, device: torch.device, work: Path, step_ms: float = 200.0,
                     deadline: float = math.inf) -> dict[str, Any]:
    """Stall of a save: ours (overlapped snapshot, measured as the time save() blocks plus the wait
    before the next optimizer update, while a step of ``step_ms`` of device work runs; the worse of two
    saves after ``reserve``, whose one-time cost is reported apart) vs torch.save and DCP's async_save;
    the later two are left out (None) once ``deadline`` has passed."""
    import hybridpar as hp
    from hybridpar.checkpoint import Checkpointer

    hp.init_distributed()
    n = nbytes // 4 // 16
    state = {"model": {f"w{i}": torch.randn(n, device=device) for i in range(16)}}
    a = torch.randn(2048, 2048, device=device)

    def fake_step() -> None:  # device work standing in for forward/backward
        t0 = time.perf_counter()
        while (time.perf_counter() - t0) * 1e3 < step_ms:
            a.mul_(1.0000001)
            sync(device)

    ck = Checkpointer(work / "ckpt", keep_last=1)
    t0 = time.perf_counter()
    ck.reserve(state)  # once, before the training loop: the host buffers every save reuses
    reserve = time.perf_counter() - t0
    stalls = []
    for version in (1, 2):
        t0 = time.perf_counter()
        ck.save(version, state, overlap=True)
        blocked = time.perf_counter() - t0
        fake_step()
        t1 = time.perf_counter()
        ck.before_update()  # what the optimizer step waits for
        sync(device)  # on CUDA before_update makes the compute stream wait: count that wait too
        stalls.append(blocked + time.perf_counter() - t1)
        ck.wait()  # the next save starts after this one is written (saves are many steps apart)
    ck.close()
    stall = max(stalls)
    row: dict[str, Any] = {"state_gib": round(nbytes / 2**30, 2), "step_ms": step_ms,
                           "reserve_s": round(reserve, 3), "ours_stall_s": round(stall, 4),
                           "ours_stall_share_of_step": round(stall / (step_ms / 1e3), 4),
                           "torch_save_s": None, "dcp_async_save_blocking_s": None}
    if time.monotonic() > deadline:
        return row
    t0 = time.perf_counter()
    torch.save(state, work / "torch_save.pt")
    sync(device)
    row["torch_save_s"] = round(time.perf_counter() - t0, 3)
    (work / "torch_save.pt").unlink()  # 2 GiB of a small disk
    if time.monotonic() > deadline:
        return row
    try:
        import torch.distributed.checkpoint as dcp_mod

        t0 = time.perf_counter()
        future = dcp_mod.async_save(state, checkpoint_id=str(work / "dcp"))
        row["dcp_async_save_blocking_s"] = round(time.perf_counter() - t0, 4)  # what training waits for
        future.result()
    except Exception as err:  # not every torch build can (needs a process group and a writer)
        row["dcp_async_save_blocking_s"] = f"{type(err).__name__}: {err}"[:200]
    return row


def section_checkpoint(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    device = torch.device("cuda" if run.mode == "gpu" else "cpu")
    run.results["checkpoint"] = bench_checkpoint(sizes.checkpoint_bytes, device, work,
                                                 sizes.checkpoint_step_ms, run.deadline)
    print(f"checkpoint: {run.results['checkpoint']}", flush=True)
    run.check_deadline()
