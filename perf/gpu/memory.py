"""Section 3, ``memory``: peak memory per rank of LBANN's CosmoFlow at 256³ with 1, 2 and 4 ranks sharing
the GPU, split along depth.

Why ranks sharing one GPU: the spatial split's point is the memory per rank, and that is measured
where only one device is lent.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from perf.gpu.budget import Run, Sizes
from perf.gpu.device import gib, peak_bytes, rank_rows


def _memory_rank(rank: int, world: int, size: int, device_type: str) -> dict[str, Any]:
    """One rank's peak memory for one bf16 training step of LBANN's CosmoFlow at ``size``³."""
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.model import build_model

    device = torch.device(device_type)
    n_conv = int(math.log2(size)) - 2
    torch.manual_seed(0)
    model = build_model(size, 4, n_conv=n_conv, base_filters=16, max_filters=256, pool="avg",
                        dense=(2048, 256), init="kaiming", dropout=0.0).to(device)
    engine = hp.parallelize(model, {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss,
                            input_shape=(1, 4, size, size, size))
    x = torch.randn(1, 4, size, size, size, device=device)
    y = torch.randn(1, 4, device=device)
    x_local, y_local = engine.shard_batch(x, y)
    del x

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            engine.train_step(x_local, y_local)

    return {"ranks": world, "rank": rank, "peak_gib": gib(peak_bytes(step, device))}


def section_memory(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    def fill(row: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
        peaks = [r["peak_gib"] for r in per_rank]
        row["peak_gib_per_rank"] = None if None in peaks else max(peaks)

    rank_rows(run, "memory", rows, sizes.memory, _memory_rank, fill)
