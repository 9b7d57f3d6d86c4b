"""The GPU suite: CUDA parity tests, then the accelerator benchmarks, within a time budget; one table and
one JSON.

    PYTHONPATH=. python3 -m perf gpu_check --budget 480 --out "$OUT/gpu"   # the one command on a GPU machine
    make gpu-check                                       # the same, into perf/results/gpu/
    python -m perf gpu_check --dry-run --budget 300      # the plan: sections, estimates, what is skipped
    python -m perf gpu_check --cpu-smoke --out DIR       # the same code on CPU at a tiny size (= --tiny)

Why one script with a budget: a GPU is lent for short sessions (minutes, start-up included), so
everything that needs one runs in one call that must end inside the lease, and leaves its figures
beside the versions they were measured with (GPU, driver, CUDA, torch) in ``OUT/gpu_check.{md,json}``
(``--out``; default a scratch folder, ``perf/results/gpu`` with ``--record``), with the tests' full log
in ``OUT/gpu_check_tests.log``. It installs nothing: a GPU image has its own torch and no package
registry (``nvtx`` is optional in :mod:`hybridpar.profiling.ranges`).

Sections run in order of value, so that a short lease still returns the figures that matter most:

1. ``tests``: every pytest test marked ``cuda`` (layer parity on CUDA in float64 and under bf16
   autocast, channels_last_3d, ranks sharing the GPU through the staged transport, engine layouts
   with a pipeline cut and a spatial split, the sync-free step).
2. ``cosmoflow``: the MLPerf CosmoFlow reference model, 128³ x 4 channels, batch 1, one GPU, fed by
   ``hybridpar.data.VolumeLoader`` from HDF5 (synthetic universes; int16 counts onto the GPU, log1p
   there): training samples/s end to end (data wait included) and of the steps alone, MFU against
   the GPU's dense bf16 peak, the loader's data-wait share, for fp32, bf16, bf16 + channels_last,
   + torch.compile (inductor), + CUDA graphs; beside them plain PyTorch (bf16 + channels_last, input
   already on the GPU), the baseline.
3. ``memory``: LBANN's CosmoFlow variant at 256³, batch 1: peak memory per rank with 1, 2 and 4
   ranks sharing the GPU, split along depth.
4. ``checkpoint``: a >= 2 GiB state on the GPU: how long training stalls for our overlapped
   checkpoint (snapshot to pinned host memory while the next step runs; host buffers reserved before
   the loop, two saves, the worse counted) against ``torch.save`` and
   ``torch.distributed.checkpoint.async_save`` (the time its call blocks).
5. ``unet``: the reconstruction U-Net (:class:`cosmoflow.unet.UNet3d`, the ``reconstruct.yaml``
   configuration) at 128³ x 4, bf16: training step time (forward and backward, slowest rank) and peak
   memory per rank, 1 rank against 2 ranks sharing the GPU.
6. ``scaling`` (only with ``--scaling``: it takes the machine's CPUs for a while): the scaling harness
   (``perf/harness.py``) on the host's cores, one rank per core up to 8 ranks, twice.

The budget (``--budget``, seconds from the start) is spent by estimates (:data:`ESTIMATES`): a section
starts only if its set-up and first row fit in the time left, and each later row (a variant, a rank
count) only if its own estimate fits; what does not is skipped with one printed line and its reason
in the JSON. A section that runs past the budget is stopped (the tests' subprocess is killed; the
benchmarks stop at their next step or rank job) and marked ``timed_out``, keeping the rows it measured.
The JSON and the table are rewritten (atomically) after every row and section, so a run killed from
outside still leaves what it measured; its ``sections`` say for each one ``ran``, ``skipped``,
``timed_out``, ``failed`` (with the reason and seconds), ``pending`` (not reached) or ``running`` (the
one it was killed in).

Without CUDA (and without ``--cpu-smoke`` or ``--dry-run``) it says so in one line and exits with
status 2. The exit status is 1 when a section failed, a CUDA test failed or a row has an error;
skipped and timed-out sections leave it 0 (they are the budget's doing, and recorded).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent

# dense bf16 peak FLOP/s (no sparsity), by a name fragment of torch.cuda.get_device_name()
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}

# Seconds each section is expected to take, as (set-up, [(row, seconds), ...]) in the order the rows
# run: "gpu" on one H200 at the full sizes, "smoke" on a 2-core CPU at the --cpu-smoke sizes.
# ESTIMATES FOR PLANNING THE BUDGET, NOT MEASUREMENTS. The "gpu" figures are the first H200 run's
# section times (perf/results/gpu/, 2026-11-28: tests 28 s, cosmoflow 52 s for five variants, memory
# 29 s, checkpoint 12 s for one save, U-Net 18 s), split over their rows and rounded up by about half,
# so that a slower node or a cold inductor cache still fits. Every run records what each section
# really took (gpu_check.json: sections.NAME.seconds): correct this table from those. The "smoke"
# figures are a 2-core VM's, rounded up, and no smaller than 2 s, so that a 1-second budget skips
# every section.
ESTIMATES: dict[str, dict[str, tuple[float, list[tuple[str, float]]]]] = {
    "gpu": {
        "tests": (0, [("pytest -m cuda", 45)]),
        "cosmoflow": (10, [("torch bf16+cl", 8), ("fp32", 10), ("bf16", 8), ("bf16+cl", 8),
                           ("bf16+cl+compile", 40), ("bf16+cl+graphs", 10)]),
        "memory": (0, [("1 rank", 12), ("2 ranks", 15), ("4 ranks", 20)]),
        "checkpoint": (0, [("2 GiB", 35)]),
        "unet": (0, [("1 rank", 12), ("2 ranks", 16)]),
        "scaling": (0, [("run 1", 900), ("run 2", 900)]),
    },
    "smoke": {
        "tests": (0, [("pytest -m cuda", 8)]),
        "cosmoflow": (3, [("torch bf16+cl", 2), ("fp32", 4), ("bf16", 2), ("bf16+cl", 2),
                          ("bf16+cl+compile", 5)]),
        "memory": (0, [("1 rank", 4), ("2 ranks", 5)]),
        "checkpoint": (0, [("1 MiB", 2)]),
        "unet": (0, [("1 rank", 5), ("2 ranks", 7)]),
        "scaling": (0, [("run 1", 900), ("run 2", 900)]),
    },
}
SECTIONS = ("tests", "cosmoflow", "memory", "checkpoint", "unet", "scaling")  # the order of value


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: the GPU run and ``--cpu-smoke`` run the same code at these sizes."""

    cosmoflow: int  # CosmoFlow reference model's input side
    cosmoflow_n_conv: int
    cosmoflow_steps: int  # timed steps per variant (after 3 warm-up steps)
    compile_backend: str
    memory: int  # LBANN variant's input side
    checkpoint_bytes: int
    checkpoint_step_ms: float
    unet: int  # U-Net input side
    unet_steps: int  # timed steps per rank count (after 2 warm-up steps)


GPU = Sizes(128, 5, 30, "inductor", 256, 2 << 30, 200.0, 128, 10)
SMOKE = Sizes(16, 2, 2, "aot_eager", 16, 1 << 20, 20.0, 16, 2)  # CPU autocast, channels-last, aot_eager
# the U-Net of launch/configs/reconstruct.yaml, fed the four snapshots
UNET = {"in_channels": 4, "out_channels": 1, "width": 8, "levels": 4, "max_width": 64, "groups": 4,
        "padding_mode": "circular"}


class Overrun(Exception):
    """A section ran past the budget: stop it, keep its rows, mark it ``timed_out``."""


def _ranks(label: str) -> int:
    """``"2 ranks"`` -> 2: the memory and U-Net rows are named by their rank count."""
    return int(label.split()[0])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def environment() -> dict[str, Any]:
    """GPU, driver, CUDA and torch versions (and the host's CPU facts)."""
    from hybridpar.profiling.hostinfo import machine_info

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


# ---------------------------------------------------------------------------- the run and its budget
class Run:
    """One gpu_check run: the budget's clock, the results so far, and the writer called after each row.

    Why one object: every section asks the same two questions (does the next row fit in the time left?
    is the budget spent?) and every answer must land in the JSON at once, so that a run killed from
    outside still says what it measured and why the rest is missing.
    """

    def __init__(self, budget_s: float, out: Path, mode: str, results: dict[str, Any]) -> None:
        self.budget_s = budget_s
        self.out = out
        self.mode = mode
        self.results = results
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, section: str, label: str, seconds: float) -> bool:
        """Whether a row estimated at ``seconds`` fits in the time left; if not, say so and record it."""
        left = self.left()
        if seconds <= left:
            return True
        reason = f"estimated {seconds:.0f} s > {max(left, 0):.0f} s left of the {self.budget_s:.0f} s budget"
        self.results["sections"][section].setdefault("skipped_rows", {})[label] = reason
        print(f"gpu_check: {section} {label} skipped: {reason}", flush=True)
        return False

    def add(self, section: str, row: dict[str, Any]) -> None:
        """A measured row: printed, kept, written."""
        self.results.setdefault(section, []).append(row)
        print(f"{section}: {row}", flush=True)
        self.save()

    def check_deadline(self) -> None:
        """Stop the section (:class:`Overrun`) once the budget is spent."""
        if self.left() < 0:
            spent = time.monotonic() - self.started
            raise Overrun(f"past the {self.budget_s:.0f} s budget after {spent:.0f} s")

    def save(self) -> Path:
        self.results["wall_s"] = round(time.monotonic() - self.started, 1)
        return write(self.results, self.out)


def estimate_s(mode: str, name: str) -> float:
    """A section's whole estimate: its set-up and every row."""
    setup, rows = ESTIMATES[mode][name]
    return setup + sum(s for _, s in rows)


def plan(mode: str, budget_s: float, off: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], float]:
    """What a run would do at ``budget_s`` if every row took its estimate: per section, run or skip (why),
    and the rows it would skip; and the seconds it would take. The real run decides the same way, on
    the time really left."""
    out, used = [], 0.0
    for name in SECTIONS:
        setup, rows = ESTIMATES[mode][name]
        entry: dict[str, Any] = {"section": name, "estimate_s": estimate_s(mode, name), "starts_at_s": used,
                                 "skipped_rows": {}}
        reason = (off if off is not None else sections_off()).get(name)
        first, left = setup + rows[0][1], budget_s - used
        if reason is None and first > left:
            reason = f"estimated {first:.0f} s to its first row > {max(left, 0):.0f} s left"
        if reason is None:
            used += setup
            for label, s in rows:
                left = budget_s - used
                if s > left:
                    entry["skipped_rows"][label] = f"estimated {s:.0f} s > {max(left, 0):.0f} s left"
                else:
                    used += s
        entry["skip"] = reason
        out.append(entry)
    return out, used


def sections_off(skip_tests: bool = False, scaling: bool = False, only: str | None = None) -> dict[str, str]:
    """The sections a run's flags turn off, each with why, before any budget is counted."""
    off = {}
    if only is not None:
        wanted = {n.strip() for n in only.split(",") if n.strip()}
        unknown = wanted - set(SECTIONS)
        if unknown:
            raise ValueError(f"--only: no section {', '.join(sorted(unknown))}; one of {', '.join(SECTIONS)}")
        off.update({n: "not in --only" for n in SECTIONS if n not in wanted})
    if skip_tests:
        off["tests"] = "--skip-tests"
    if not scaling and "scaling" not in off:
        off["scaling"] = "off unless --scaling"
    return off


def print_plan(mode: str, budget_s: float, off: dict[str, str]) -> None:
    """``--dry-run``: the plan, one line per section and per skipped row; runs nothing."""
    where = "one H200 at the full sizes" if mode == "gpu" else "a 2-core CPU at the --cpu-smoke sizes"
    print(f"gpu_check plan at --budget {budget_s:.0f} s ({mode}; seconds are estimates for {where}, for "
          f"planning, not measurements):")
    entries, total = plan(mode, budget_s, off)
    for i, e in enumerate(entries, 1):
        setup, rows = ESTIMATES[mode][e["section"]]
        parts = ", ".join(f"{label} {s:.0f}" for label, s in rows)
        parts = f"set-up {setup:.0f}, {parts}" if setup else parts
        status = f"skip: {e['skip']}" if e["skip"] else f"run from ~{e['starts_at_s']:.0f} s"
        print(f"  {i}. {e['section']:<10} {e['estimate_s']:>5.0f} s  ({parts})  {status}")
        if not e["skip"]:
            for label, why in e["skipped_rows"].items():
                print(f"       {label} skipped: {why}")
    skipped = [e["section"] for e in entries if e["skip"]]
    rows = [f"{e['section']} {lb}" for e in entries if not e["skip"] for lb in e["skipped_rows"]]
    print(f"estimated {total:.0f} s of the {budget_s:.0f} s budget; skipped sections: "
          f"{', '.join(skipped) or 'none'}; skipped rows: {', '.join(rows) or 'none'}")


# ---------------------------------------------------------------------------- 1. tests
def run_tests(timeout: float, log: Path) -> dict[str, Any]:
    """The ``cuda``-marked pytest tests in a subprocess of their own session, killed (with every rank
    it started) after ``timeout`` seconds; their summary line, failures and status; the log to ``log``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output or "")
    lines = [ln for ln in (output or "").splitlines() if ln.strip()]
    return {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "timed_out": timed_out,
            "summary": lines[-1] if lines else "", "log": log.name,
            "failures": [ln for ln in lines if ln.startswith("FAILED")]}


def section_tests(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    run.results["tests"] = result = run_tests(run.left(), run.out / "gpu_check_tests.log")
    print(f"tests: {result['summary']}", flush=True)
    if result["timed_out"]:
        raise Overrun(f"pytest killed at the budget's end; {result['summary']!r}")


# ---------------------------------------------------------------------------- 2. cosmoflow throughput
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
        _sync(device)

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
                _sync(device)
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


# ---------------------------------------------------------------------------- 3. memory per rank
def _peak_bytes(step: Callable[[], Any], device: torch.device) -> int | None:
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


def _gib(nbytes: int | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**30, 3)


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

    return {"ranks": world, "rank": rank, "peak_gib": _gib(_peak_bytes(step, device))}


def _launch_ranks(run: Run, section: str, fn: Callable, world: int, *args: Any) -> list[dict[str, Any]]:
    """``fn`` on ``world`` ranks sharing the GPU (gloo + the staged transport: hybridpar sees more
    local ranks than devices), killed at the budget's end."""
    from perf.common import launch

    try:
        return launch(fn, world, *args, every_rank=True, timeout=max(run.left(), 1.0),
                      env={"LOCAL_WORLD_SIZE": str(world)})
    except TimeoutError as err:
        raise Overrun(f"{world}-rank job killed at the budget's end: {err}") from err


def section_memory(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    device_type = "cuda" if run.mode == "gpu" else "cpu"
    for label, estimate in rows:
        if not run.fits("memory", label, estimate):
            continue
        world = _ranks(label)
        row: dict[str, Any] = {"ranks": world, "size": sizes.memory}
        try:
            per_rank = _launch_ranks(run, "memory", _memory_rank, world, sizes.memory, device_type)
            peaks = [r["peak_gib"] for r in per_rank]
            row["peak_gib_per_rank"] = None if None in peaks else max(peaks)
        except Overrun:
            run.add("memory", {**row, "note": "killed at the budget's end"})
            raise
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        run.add("memory", row)


# ---------------------------------------------------------------------------- 4. checkpoint stall
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
            _sync(device)

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
        _sync(device)  # on CUDA before_update makes the compute stream wait: count that wait too
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
    _sync(device)
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


# ---------------------------------------------------------------------------- 5. U-Net
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
        _sync(device)

    times = slowest_rank(time_steps(step, 2, steps, before=barrier))
    return {"rank": rank, "times": times, "peak_gib": _gib(_peak_bytes(step, device))}


def section_unet(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    device_type = "cuda" if run.mode == "gpu" else "cpu"
    for label, estimate in rows:
        if not run.fits("unet", label, estimate):
            continue
        world = _ranks(label)
        row: dict[str, Any] = {"ranks": world, "size": sizes.unet}
        try:
            per_rank = _launch_ranks(run, "unet", _unet_rank, world, sizes.unet, sizes.unet_steps,
                                     device_type)
            peaks, times = [r["peak_gib"] for r in per_rank], per_rank[0]["times"]
            row.update(step_ms=round(1e3 * statistics.median(times), 2), steps=len(times),
                       peak_gib_per_rank=None if None in peaks else max(peaks))
        except Overrun:
            run.add("unet", {**row, "note": "killed at the budget's end"})
            raise
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"[:300]
        run.add("unet", row)


# ---------------------------------------------------------------------------- 6. scaling (--scaling)
def section_scaling(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    """The scaling harness on this host's cores (1..8 ranks), once per row, each into its own folder."""
    for i, (label, estimate) in enumerate(rows):
        if not run.fits("scaling", label, estimate):
            continue
        dest = run.out / f"scaling-{i + 1}"
        cmd = [sys.executable, "-m", "perf", "harness", "--ranks", "1,2,4,8", "--no-wait",
               "--out-dir", str(dest)]
        try:
            res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 capture_output=True, text=True, timeout=max(run.left(), 1.0))
        except subprocess.TimeoutExpired as err:
            raise Overrun(f"harness run {i + 1} killed at the budget's end") from err
        run.add("scaling", {"out": str(dest), "returncode": res.returncode, "tail": res.stdout[-500:]})


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


# ---------------------------------------------------------------------------- report
def _atomic_write(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a run killed mid-write leaves the previous version."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write(results: dict[str, Any], out: Path) -> Path:
    """``out/gpu_check.md`` (the tables) and ``out/gpu_check.json`` (everything), both atomically."""
    from perf.common import print_table

    out.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    parts = [f"GPU suite on {env.get('gpu', 'CPU (smoke)')}: driver {env.get('driver', '-')}, CUDA "
             f"{env.get('cuda')}, torch {env['torch']}; budget {results['budget_s']:.0f} s, "
             f"{results.get('wall_s', 0):.0f} s used"]
    rows = [[name, s["status"], f"{s['seconds']:.1f}" if "seconds" in s else "-", f"{s['estimate_s']:.0f}",
             s.get("reason") or "",
             "; ".join(f"{k}: {v}" for k, v in s.get("skipped_rows", {}).items())]
            for name, s in results["sections"].items()]
    parts.append(print_table(["section", "status", "seconds", "estimate s", "reason", "rows skipped"], rows,
                             "Sections", echo=False))
    if "tests" in results:
        parts.append(f"tests: {results['tests']['summary']}")
    if results.get("cosmoflow"):
        rows = [[r["variant"], r.get("samples_per_s", "-"), r.get("compute_samples_per_s", "-"),
                 r.get("step_ms", "-"), r.get("mfu", "-"), r.get("data_wait_share", "-"), _problem(r)]
                for r in results["cosmoflow"]]
        parts.append(print_table(["variant", "samples/s", "steps alone /s", "step ms", "MFU", "data wait",
                                  "error / note"], rows,
                                 f"CosmoFlow {results['cosmoflow_size']}³ x 4, batch 1; samples/s end to end "
                                 f"(loader included), MFU of that", echo=False))
    if results.get("memory"):
        rows = [[r["ranks"], r["size"], r.get("peak_gib_per_rank", "-"), _problem(r)]
                for r in results["memory"]]
        parts.append(print_table(["ranks", "size", "peak GiB / rank", "error / note"], rows,
                                 "Peak memory, ranks sharing the GPU (None: not measured on CPU)",
                                 echo=False))
    c = results.get("checkpoint")
    if c:
        parts.append(print_table(["state GiB", "step ms", "reserve s (once)", "our stall s", "share of step",
                                  "torch.save s", "DCP async_save blocks s"],
                                 [[c["state_gib"], c["step_ms"], c.get("reserve_s", "-"), c["ours_stall_s"],
                                   c["ours_stall_share_of_step"], c["torch_save_s"],
                                   c["dcp_async_save_blocking_s"]]], "Checkpoint stall", echo=False))
    if results.get("unet"):
        rows = [[r["ranks"], r["size"], r.get("step_ms", "-"), r.get("peak_gib_per_rank", "-"),
                 _problem(r)] for r in results["unet"]]
        parts.append(print_table(["ranks", "size", "step ms", "peak GiB / rank", "error / note"], rows,
                                 "U-Net (reconstruct.yaml's), batch 1, bf16, fwd + bwd, ranks sharing the "
                                 "GPU (None: not measured on CPU)", echo=False))
    if results.get("scaling"):
        parts.append("scaling harness runs: " + ", ".join(f"{r['out']} (exit {r['returncode']})"
                                                         for r in results["scaling"]))
    _atomic_write(out / "gpu_check.md", "\n\n".join(parts) + "\n")
    path = out / "gpu_check.json"
    _atomic_write(path, json.dumps(results, indent=1) + "\n")
    return path


def _problem(row: dict[str, Any]) -> str:
    return row.get("error", row.get("note", ""))


def _failed(results: dict[str, Any]) -> bool:
    """A failed section, a failed CUDA test or a row with an error (not a skip or a timeout)."""
    rows = [r for key in ("cosmoflow", "memory", "unet") for r in results.get(key, [])]
    tests = results.get("tests", {})
    return bool(any(s["status"] == "failed" for s in results["sections"].values())
                or (not tests.get("timed_out") and tests.get("returncode", 0))
                or any("error" in r for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", "--tiny", dest="cpu_smoke", action="store_true",
                    help="the same code on CPU at a tiny size")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole run; sections and rows that would not fit are skipped")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and the estimated seconds per section at --budget; run nothing")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu_check.{json,md} and the tests' log (default: a scratch folder; "
                         "with --record perf/results/gpu)")
    ap.add_argument("--record", action="store_true",
                    help="write into perf/results/gpu (tracked: the figures the READMEs quote)")
    ap.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help=f"run only these sections, comma-separated ({', '.join(SECTIONS)})")
    ap.add_argument("--scaling", action="store_true", help="also run the scaling harness twice on the CPUs")
    args = ap.parse_args(argv)
    if args.out is None:
        from perf.common import SCRATCH  # noqa: PLC0415 (as the other perf.common imports here)

        args.out = ROOT / "perf/results/gpu" if args.record else SCRATCH / "gpu"
    mode = "smoke" if args.cpu_smoke else "gpu"
    if args.budget <= 0:
        print(f"gpu_check: --budget must be a positive number of seconds, got {args.budget:g}",
              file=sys.stderr)
        return 2
    try:
        off = sections_off(args.skip_tests, args.scaling, args.only)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan(mode, args.budget, off)
        return 0
    if mode == "gpu" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, or "
              f"with --cpu-smoke for its CPU-testable parts", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "environment": environment(), "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode, "budget_s": args.budget,
        "sections": {name: {"status": "pending", "estimate_s": estimate_s(mode, name)} for name in SECTIONS}}
    run = Run(args.budget, args.out, mode, results)
    sizes = GPU if mode == "gpu" else SMOKE
    with tempfile.TemporaryDirectory() as tmp:
        for name in SECTIONS:
            run_section(run, name, sizes, Path(tmp), off)
    path = run.save()
    counts = {s: [n for n, r in results["sections"].items() if r["status"] == s]
              for s in ("ran", "skipped", "timed_out", "failed")}
    summary = "; ".join(f"{status} {', '.join(names)}" for status, names in counts.items() if names)
    print(f"gpu_check: {summary}; {results['wall_s']:.0f} s of the {args.budget:.0f} s budget; wrote {path}",
          flush=True)
    return 1 if _failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
