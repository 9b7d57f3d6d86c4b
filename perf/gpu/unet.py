"""Section 5, ``unet``: the reconstruction U-Net at 128³ x 4 in bf16, step time and peak memory per rank, one
rank against two sharing the GPU.

Why the ``reconstruct.yaml`` configuration: these are the figures of the model that configuration
trains, not of a stand-in.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch

from perf.gpu.budget import Run, Sizes
from perf.gpu.device import gib, peak_bytes, rank_rows, sync

# the U-Net of launch/configs/reconstruct.yaml, fed the four snapshots
UNET = {"in_channels": 4, "out_channels": 1, "width": 8, "levels": 4, "max_width": 64, "groups": 4,
        "padding_mode": "circular"}


def _unet_rank(rank: int, world: int, size: int, steps: int, device_type: str) -> dict[str, Any]:
    """One rank of the U-Net job: ``hp.parallelize`` over (world, 1, 1), bf16 autocast; its step times
    (the slowest rank's, per step) and its peak memory over one more step."""
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.unet import UNet3d
    from perf.common import barrier, slowest_rank, time_steps

    device = torch.device(device_type)
    torch.manual_seed(0)
    model = UNet3d(**UNET).to(device)
    model.check_extent(size)
    shape = (1, UNET["in_channels"], size, size, size)
    engine = hp.parallelize(model, {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss,
                            input_shape=shape)
    x = torch.randn(*shape, device=device)
    y = torch.randn(1, UNET["out_channels"], size, size, size, device=device)
    x_local, y_local = engine.shard_batch(x, y)
    del x, y
    params = list(engine.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            engine.train_step(x_local, y_local)
        sync(device)

    times = slowest_rank(time_steps(step, 2, steps, before=barrier))
    return {"rank": rank, "times": times, "peak_gib": gib(peak_bytes(step, device))}


def section_unet(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    def fill(row: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
        peaks, times = [r["peak_gib"] for r in per_rank], per_rank[0]["times"]
        row.update(step_ms=round(1e3 * statistics.median(times), 2), steps=len(times),
                   peak_gib_per_rank=None if None in peaks else max(peaks))

    rank_rows(run, "unet", rows, sizes.unet, _unet_rank, fill, sizes.unet_steps)
