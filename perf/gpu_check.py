"""The GPU suite: CUDA parity tests, then the accelerator benchmarks; one table and one JSON.

    make gpu-check                                   # = python -m perf gpu_check, on any CUDA GPU
    python -m perf gpu_check --cpu-smoke --out DIR   # its CPU-testable parts at a tiny size (= --tiny)

Why one script: a GPU is lent for short sessions, so everything that needs one runs in one call
(< 20 minutes on an H100) and leaves its figures beside the versions they were measured with
(GPU, driver, CUDA, torch) in ``perf/results/gpu/gpu_check.{md,json}``. Sections:

1. ``tests``: every pytest test marked ``cuda`` (layer parity on CUDA in float64 and under bf16
   autocast, channels_last_3d, ranks sharing the GPU through the staged transport, engine layouts
   with a pipeline cut and a spatial split, the sync-free step).
2. ``cosmoflow``: the MLPerf CosmoFlow reference model, 128³ x 4 channels, batch 1, one GPU, fed by
   ``hybridpar.data.VolumeLoader`` from HDF5 (synthetic universes; log1p in the reader): training
   samples/s (median of windows), MFU against the GPU's dense bf16 peak, the loader's data-wait
   share, for fp32, bf16, bf16 + channels_last, + torch.compile (inductor), + CUDA graphs.
3. ``memory``: LBANN's CosmoFlow variant at 256³, batch 1: peak memory per rank with 1, 2 and 4
   ranks sharing the GPU, split along depth.
4. ``checkpoint``: a >= 2 GiB state on the GPU: how long training stalls for our overlapped
   checkpoint (snapshot to pinned host memory while the next step runs) against ``torch.save`` and
   ``torch.distributed.checkpoint.async_save`` (the time its call blocks).
5. ``--scaling`` (off by default: it takes the machine's CPUs for a while): the scaling harness
   (``perf/harness.py``) on the host's cores, one rank per core up to 8 ranks, twice, so that the
   performance model can be judged on configurations that repeat.

Without CUDA (and without ``--cpu-smoke``) it says so in one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

# dense bf16 peak FLOP/s (no sparsity), by a name fragment of torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def environment() -> dict[str, Any]:
    """GPU, driver, CUDA and torch versions (and the host's CPU facts)."""
    from hybridpar.hostinfo import machine_info

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "machine": machine_info()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    return env


def run_tests(timeout: float = 600) -> dict[str, Any]:
    """The ``cuda``-marked pytest tests; their summary line and status."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    return {"command": " ".join(cmd[2:]), "returncode": res.returncode, "summary": lines[-1] if lines else "",
            "failures": [ln for ln in lines if ln.startswith("FAILED")]}


# ---------------------------------------------------------------------------- cosmoflow throughput
def _universes(out: Path, n: int, size: int) -> Path:
    if not out.exists() or len(list(out.glob("*.h5"))) < n:
        subprocess.run([sys.executable, "-m", "cosmoflow.generate", "--out", str(out), "--universes", str(n),
                        "--size", str(size), "--seed", "5", "--workers", "2"], check=True, cwd=ROOT,
                       capture_output=True)
    return out


def _variant_step(variant: str, size: int, n_conv: int, data: Path, steps: int, device: torch.device,
                  compile_backend: str) -> dict[str, Any]:
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.data import open_dataset
    from cosmoflow.model import build_model
    from hybridpar.accel import Accel
    from hybridpar.data import VolumeLoader

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
    loader = VolumeLoader(ds, engine.input_grid, batch_size=1, workers=2 if device.type == "cuda" else 0,
                          prefetch=4)
    times, waits, done, warmup = [], [], 0, 3
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    while done < warmup + steps:
        for x, y in loader:
            t0 = time.perf_counter()
            accel.step(engine, opt, x, y)
            sync()
            if done >= warmup:
                times.append(time.perf_counter() - t0)
                waits.append(loader.last_wait)
            done += 1
            if done >= warmup + steps:
                break
        loader.set_epoch(loader.epoch + 1)
    loader.close()
    step = statistics.median(times)
    rate = 1.0 / step
    name = torch.cuda.get_device_name() if device.type == "cuda" else ""
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"variant": variant, "samples_per_s": round(rate, 2), "step_ms": round(1e3 * step, 2),
            "mfu": round(flops * rate / peak, 4) if peak else None,
            "data_wait_share": round(sum(waits) / (sum(waits) + sum(times)), 4), "steps": steps,
            "gflop_per_sample": round(flops / 1e9, 2)}


def bench_cosmoflow(size: int, n_conv: int, steps: int, variants: list[str], work: Path,
                    device: torch.device, compile_backend: str) -> list[dict[str, Any]]:
    data = _universes(work / f"universes{size}", 16, size)
    rows = []
    for v in variants:
        try:
            rows.append(_variant_step(v, size, n_conv, data, steps, device, compile_backend))
        except Exception as err:  # one variant failing must not cost the others' figures
            rows.append({"variant": v, "error": f"{type(err).__name__}: {err}"[:300]})
        print(rows[-1], flush=True)
    return rows


# ---------------------------------------------------------------------------- memory per rank
def _memory_rank(rank: int, world: int, size: int) -> dict[str, Any]:
    import torch.nn.functional as F

    import hybridpar as hp
    from cosmoflow.model import build_model

    n_conv = int(math.log2(size)) - 2
    torch.manual_seed(0)
    model = build_model(size, 4, n_conv=n_conv, base_filters=16, max_filters=256, pool="avg",
                        dense=(2048, 256), init="kaiming", dropout=0.0).cuda()
    engine = hp.parallelize(model, {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss,
                            input_shape=(1, 4, size, size, size))
    x = torch.randn(1, 4, size, size, size, device="cuda")
    y = torch.randn(1, 4, device="cuda")
    x_local, y_local = engine.shard_batch(x, y)
    del x
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        engine.train_step(x_local, y_local)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"ranks": world, "rank": rank, "peak_gib": round(peak / 2**30, 3)}


def bench_memory(size: int, worlds: list[int]) -> list[dict[str, Any]]:
    from perf.common import launch

    rows = []
    for world in worlds:
        os.environ["LOCAL_WORLD_SIZE"] = str(world)  # ranks share the GPU: gloo + staged transport
        try:
            per_rank = launch(_memory_rank, world, size, every_rank=True, timeout=600)
            peak = max(r["peak_gib"] for r in per_rank)
            rows.append({"ranks": world, "size": size, "peak_gib_per_rank": peak})
        except Exception as err:
            rows.append({"ranks": world, "size": size, "error": f"{type(err).__name__}: {err}"[:300]})
        print(rows[-1], flush=True)
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    return rows


# ---------------------------------------------------------------------------- checkpoint stall
def bench_checkpoint(nbytes: int, device: torch.device, work: Path, step_ms: float = 200.0) -> dict[str, Any]:
    """Stall of one save: ours (overlapped snapshot, measured as the time save() blocks plus the wait
    before the next optimizer update, while a step of ``step_ms`` of device work runs) vs torch.save."""
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
            if device.type == "cuda":
                torch.cuda.synchronize()

    ck = Checkpointer(work / "ckpt")
    t0 = time.perf_counter()
    ck.save(1, state, overlap=True)
    blocked = time.perf_counter() - t0
    fake_step()
    t1 = time.perf_counter()
    ck.before_update()  # what the optimizer step waits for
    stall = blocked + time.perf_counter() - t1
    ck.close()
    t0 = time.perf_counter()
    torch.save(state, work / "torch_save.pt")
    if device.type == "cuda":
        torch.cuda.synchronize()
    plain = time.perf_counter() - t0
    dcp: float | str
    try:
        import torch.distributed.checkpoint as dcp_mod

        t0 = time.perf_counter()
        future = dcp_mod.async_save(state, checkpoint_id=str(work / "dcp"))
        dcp = round(time.perf_counter() - t0, 4)  # what the caller waits before training on
        future.result()
    except Exception as err:  # not every torch build can (needs a process group and a writer)
        dcp = f"{type(err).__name__}: {err}"[:200]
    return {"state_gib": round(nbytes / 2**30, 2), "step_ms": step_ms, "ours_stall_s": round(stall, 4),
            "ours_stall_share_of_step": round(stall / (step_ms / 1e3), 4), "torch_save_s": round(plain, 3),
            "dcp_async_save_blocking_s": dcp}


def run_scaling(out: Path, runs: int = 2) -> list[dict[str, Any]]:
    """The scaling harness on this host's cores (1..8 ranks), ``runs`` times, each into its own folder."""
    rows = []
    for i in range(runs):
        dest = out / f"scaling-{i + 1}"
        cmd = [sys.executable, "-m", "perf", "harness", "--ranks", "1,2,4,8", "--no-wait",
               "--out-dir", str(dest)]
        res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                             text=True, timeout=3600)
        rows.append({"out": str(dest.relative_to(ROOT)) if dest.is_relative_to(ROOT) else str(dest),
                     "returncode": res.returncode, "tail": res.stdout[-500:]})
    return rows


# ---------------------------------------------------------------------------- report
def write(results: dict[str, Any], out: Path) -> Path:
    from perf.common import print_table

    out.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    parts = [f"GPU suite on {env.get('gpu', 'CPU (smoke)')}: driver {env.get('driver', '-')}, CUDA "
             f"{env.get('cuda')}, torch {env['torch']}"]
    if "tests" in results:
        parts.append(f"tests: {results['tests']['summary']}")
    rows = [[r["variant"], r.get("samples_per_s", "-"), r.get("step_ms", "-"), r.get("mfu", "-"),
             r.get("data_wait_share", "-"), r.get("error", "")] for r in results.get("cosmoflow", [])]
    parts.append(print_table(["variant", "samples/s", "step ms", "MFU", "data wait", "error"], rows,
                             f"CosmoFlow {results['cosmoflow_size']}³ x 4, batch 1"))
    if results.get("memory"):
        rows = [[r["ranks"], r["size"], r.get("peak_gib_per_rank", "-"), r.get("error", "")]
                for r in results["memory"]]
        parts.append(print_table(["ranks", "size", "peak GiB / rank", "error"], rows,
                                 "Peak memory, ranks sharing the GPU"))
    c = results.get("checkpoint")
    if c:
        parts.append(print_table(["state GiB", "step ms", "our stall s", "share of step", "torch.save s",
                                  "DCP async_save blocks s"],
                                 [[c["state_gib"], c["step_ms"], c["ours_stall_s"],
                                   c["ours_stall_share_of_step"], c["torch_save_s"],
                                   c["dcp_async_save_blocking_s"]]], "Checkpoint stall"))
    if results.get("scaling"):
        parts.append("scaling harness runs: " + ", ".join(f"{r['out']} (exit {r['returncode']})"
                                                         for r in results["scaling"]))
    (out / "gpu_check.md").write_text("\n\n".join(parts) + "\n")
    path = out / "gpu_check.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", "--tiny", dest="cpu_smoke", action="store_true",
                    help="the CPU-testable parts at a tiny size")
    ap.add_argument("--out", type=Path, default=ROOT / "perf/results/gpu")
    ap.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    ap.add_argument("--scaling", action="store_true", help="also run the scaling harness twice on the CPUs")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.cpu_smoke:
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, or "
              f"with --cpu-smoke for its CPU-testable parts", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda and not args.cpu_smoke else "cpu")
    started = time.monotonic()
    results: dict[str, Any] = {"environment": environment(), "command": " ".join(sys.argv),
                               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if device.type == "cuda":
            if not args.skip_tests:
                results["tests"] = run_tests()
            results["cosmoflow_size"] = 128
            results["cosmoflow"] = bench_cosmoflow(128, 5, 30, ["fp32", "bf16", "bf16+cl", "bf16+cl+compile",
                                                                "bf16+cl+graphs"], work, device, "inductor")
            results["memory"] = bench_memory(256, [1, 2, 4])
            results["checkpoint"] = bench_checkpoint(2 << 30, device, work)
        else:  # the same code at a tiny size: CPU autocast, channels-last, compile (aot_eager)
            results["cosmoflow_size"] = 16
            results["cosmoflow"] = bench_cosmoflow(16, 2, 2, ["fp32", "bf16", "bf16+cl", "bf16+cl+compile"],
                                                   work, device, "aot_eager")
            results["checkpoint"] = bench_checkpoint(1 << 20, device, work, step_ms=20.0)
    if args.scaling:
        results["scaling"] = run_scaling(args.out)
    results["wall_s"] = round(time.monotonic() - started, 1)
    path = write(results, args.out)
    print(f"wrote {path}", flush=True)
    failed = [r for r in results["cosmoflow"] if "error" in r]
    return 1 if failed or results.get("tests", {}).get("returncode", 0) else 0


if __name__ == "__main__":
    sys.exit(main())
