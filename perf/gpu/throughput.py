"""Section 2, ``cosmoflow``: training throughput of the MLPerf CosmoFlow model fed from HDF5 by the sharded
loader, end to end and of the steps alone, per precision / layout / compile variant, beside plain
PyTorch with its input already on the GPU.

Why end to end: a step rate the loader cannot feed is not a training rate; the data-wait share says
which of the two limits a variant.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from perf.gpu import ROOT
from perf.gpu.budget import Run, Sizes
from perf.gpu.device import sync

# dense bf16 peak FLOP/s (no sparsity), by a name fragment of torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def _universes(out: Path, n: int, size: int) -> Path:
    if not out.exists() or len(list(out.glob("*.h5"))) < n:
        subprocess.run([sys.executable, "-m", "cosmoflow.generate", "--out", str(out), "--universes", str(n),
                        "--size", str(size), "--seed", "5", "--workers", "2"], check=True, cwd=ROOT,
                       capture_output=True)
    return out


def _torch_step(size: int, n_conv: int, steps: int, device: torch.device) -> dict[str, Any]:
    """The baseline beside the engine's rows: the same model as a plain ``nn.Module`` in bf16 autocast
    with channels_last_3d, its input already on the device (no loader): what PyTorch alone reaches."""
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.model import build_model
    from perf.common import time_steps

    torch.manual_seed(0)
    fmt = torch.channels_last_3d
    model = build_model(size, 4, n_conv=n_conv, dropout=0.0).to(device, memory_format=fmt)
    flops = hp.flops.count(model, (1, 4, size, size, size)).total
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    x = torch.randn(1, 4, size, size, size, device=device).contiguous(memory_format=fmt)
    y = torch.randn(1, 4, device=device)
    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)

    rate = 1.0 / statistics.median(time_steps(step, 3, steps))
    return {"variant": "torch bf16+cl", "steps": steps, "gflop_per_sample": round(flops / 1e9, 2),
            "samples_per_s": round(rate, 2), "compute_samples_per_s": round(rate, 2),
            "step_ms": round(1e3 / rate, 2), "mfu": _mfu(flops * rate, device), "data_wait_share": 0.0,
            "note": "plain PyTorch, input already on the device (no loader)"}


def _mfu(flop_per_s: float, device: torch.device) -> float | None:
    """Achieved FLOP/s over the GPU's dense bf16 peak (None where the peak is not known, or on CPU)."""
    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return round(flop_per_s / peak, 4) if peak else None


def _loader_workers(device: torch.device) -> int:
    """Reader processes for the GPU run: half the host's cores, 2 to 8 (a 128³ sample takes one about
    20 ms to read; the GPU consumes one in a few)."""
    return min(8, max(2, (os.cpu_count() or 2) // 2)) if device.type == "cuda" else 0


def _variant_step(variant: str, size: int, n_conv: int, data: Path, steps: int, device: torch.device,
                  compile_backend: str, deadline: float = math.inf) -> dict[str, Any]:
    """One variant's training throughput, end to end: the loader reads the HDF5 universes and delivers
    them on the device (int16 counts, ``log1p`` there), the step trains. ``samples_per_s`` counts the
    wall time between steps' ends (data wait included); ``compute_samples_per_s`` the steps alone.
    Stops early (fewer timed steps, a note) at ``deadline``."""
    if variant.startswith("torch"):
        return _torch_step(size, n_conv, steps, device)
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.data import open_dataset
    from cosmoflow.model import build_model
    from hybridpar.data import VolumeLoader
    from hybridpar.device.accel import Accel

    precision = "fp32" if variant == "fp32" else "bf16"
    accel = Accel(device, precision, channels_last="cl" in variant, compile="compile" in variant,
                  cuda_graphs="graphs" in variant, compile_options={"backend": compile_backend})
    torch.manual_seed(0)
    model = build_model(size, 4, n_conv=n_conv, dropout=0.0).to(device)
    flops = hp.flops.count(model, (1, 4, size, size, size)).total
    hp.init_distributed()  # a one-rank group where no launcher started this process
    engine = hp.parallelize(model, {"grid": {}}, loss_fn=F.mse_loss, input_shape=(1, 4, size, size, size),
                            memory_format=accel.memory_format)
    opt = torch.optim.SGD(engine.parameters(), lr=1e-4, momentum=0.9)
    accel.prepare(engine)
    ds = open_dataset(str(data), sample_size=size, channels=4)
    loader = VolumeLoader(ds, engine.input_grid, batch_size=1, workers=_loader_workers(device), prefetch=4,
                          device=device)
    times: list[float] = []
    walls: list[float] = []
    waits: list[float] = []
    done, warmup, stopped = 0, 3, False
    last = time.perf_counter()
    try:
        while done < warmup + steps and not stopped:
            for x, y in loader:
                t0 = time.perf_counter()
                accel.step(engine, opt, x, y)
                sync(device)
                end = time.perf_counter()
                if done >= warmup:
                    times.append(end - t0)
                    walls.append(end - last)
                    waits.append(loader.last_wait)
                last = end
                done += 1
                if done >= warmup + steps:
                    break
                if time.monotonic() > deadline:
                    stopped = True
                    break
            loader.set_epoch(loader.epoch + 1)
    finally:
        loader.close()
    row: dict[str, Any] = {"variant": variant, "steps": len(times), "gflop_per_sample": round(flops / 1e9, 2)}
    if stopped:
        row["note"] = f"stopped at the budget's end after {len(times)} of {steps} timed steps"
    if not times:
        return row
    rate = len(walls) / sum(walls)
    row.update(samples_per_s=round(rate, 2), compute_samples_per_s=round(1.0 / statistics.median(times), 2),
               step_ms=round(1e3 * statistics.median(times), 2), mfu=_mfu(flops * rate, device),
               data_wait_share=round(sum(waits) / sum(walls), 4))
    return row


def section_cosmoflow(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    device = torch.device("cuda" if run.mode == "gpu" else "cpu")
    run.results["cosmoflow_size"] = sizes.cosmoflow
    data = _universes(work / f"universes{sizes.cosmoflow}", 16, sizes.cosmoflow)
    for variant, estimate in rows:
        if not run.fits("cosmoflow", variant, estimate):
            continue  # a later, cheaper variant may still fit (CUDA graphs after a skipped compile)
        try:
            row = _variant_step(variant, sizes.cosmoflow, sizes.cosmoflow_n_conv, data, sizes.cosmoflow_steps,
                                device, sizes.compile_backend, run.deadline)
        except Exception as err:  # one variant failing must not cost the others' figures
            row = {"variant": variant, "error": f"{type(err).__name__}: {err}"[:300]}
        run.add("cosmoflow", row)
        run.check_deadline()
