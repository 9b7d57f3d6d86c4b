"""Predict the time and memory of one training step of a spec before running it.

Why a module of its own: the scaling harness validates it against measurements on this machine, the
advisor (``python -m hybridpar.plan``) ranks thousands of layouts with it, and the extrapolations to
published systems run it on machines we do not have. All three need the same arithmetic, and none
may allocate a model: everything here comes from shapes (:mod:`hybridpar.spec.plan`,
:mod:`hybridpar.flops`) and a small :class:`Machine` description.

The model, per training step of a spec on a machine
----------------------------------------------------
* **Compute.** Each layer's work on the most loaded rank for one micro-batch (its FLOPs from
  :func:`hybridpar.flops.count`, scaled by the rank's share of output voxels; forward, input and
  weight gradient; no input gradient for the first layer of stage 0) and the bytes it moves
  (input incl. halos, output, weights) cost ``flops / flop_rate + bytes / byte_rate + overhead``
  (:class:`Cost`), per op class (conv forward, conv backward, linear, pooling, pointwise). On a
  calibrated machine the three coefficients of each class are fitted to timings of conv/pool/
  activation/linear layers at a few sizes (:func:`calibrate_compute`, cached to JSON), and layers
  timed at the exact shapes a workload needs (:func:`measure_layers`, ``Machine.measured``) replace
  the fit: on CPUs a kernel's rate depends on its exact shape (batch 1 vs 4 of the same conv differ
  up to 4x in FLOP/s), which no smooth fit captures. Per step and per micro-batch engine overheads
  are measured too (:func:`measure_engine_overhead`). For accelerators the coefficients are the
  datasheet peak times an achievable fraction (:data:`PRESETS`, each stating its sources).
* **Communication: an alpha-beta model.** A message of ``n`` bytes over a :class:`Link` costs
  ``latency + n / bandwidth``; on a CPU host the link is measured as a halo-like exchange right
  after computing (:func:`exchange_after_compute`), which can cost far more than a ping-pong.
  Halo exchange: per split dim, one message from each neighbour of the widest halo of the plan
  (``LayerPlan.halo``) times the face of the local shard, forward, and the same volume of halo
  gradients back in the backward when the layer's input needs a gradient.
  Redistributions (before a replicated head, or between splits): the bytes the most loaded rank
  receives, from the same box intersections :mod:`hybridpar.comm.redistribute` computes (a gather
  to replicated costs nothing in the backward). Pipeline: one activation send per stage boundary
  and micro-batch each way. Gradients: a ring all-reduce of the stage's parameters over its data x
  spatial ranks, hierarchical across nodes (``2 (n-1)/n`` of the bytes over the slowest link, the
  node's NIC shared by the groups that span it), overlapped with the last backward by
  ``Machine.grad_overlap``; the global loss, one tiny all-reduce over the replicas at the step's
  end on the stages before the last (the last stage sends it on after its last forward).
* **Pipeline.** With per-micro-batch stage times ``t_s`` (compute + halo + sends) and ``M``
  micro-batches: ``T = sum_s t_s + (M - 1) max_s t'_s``; for equal stages that is the GPipe
  ``(M + S - 1) t`` whose idle share is the bubble ``(S - 1) / (M + S - 1)``. ``t'_s`` leaves out
  the sends' latencies: the engine posts receives ahead, so once the pipeline is full a message
  travels while its receiver computes the micro-batch before (the bytes still take time: on a CPU
  the copies run on the cores). The engine's last backward of a stage after the first sends its
  input gradient before computing its weight gradients (all of them where the schedule holds two
  or more micro-batches there, those of its first conv or linear layer where it holds one;
  :mod:`hybridpar.pipeline.deferred`): the drain then runs the stages' input gradients back to back
  and each stage's deferred weight gradients beside it (:func:`drain_saving`).
* **Shared cores (CPU only).** Ranks computing at the same time slow each other (memory bandwidth,
  caches, a virtual machine's vCPUs sharing a host core): ``Machine.contention`` multiplies compute
  when two or more ranks share a node. Ranks beyond ``Machine.cores`` time-share the cores: the step
  takes at least the busy time (compute and transfers, not waits) of all the node's ranks divided by
  the cores, a rank's compute stretches by the busy ranks per core, and a message costs the
  calibrated latency: its receiver sleeps in the receive, and a task waking from sleep runs ahead of
  those that used their slices. (Scaling latencies by ranks / cores predicted 4-5 of 28
  configurations of two back-to-back sweeps within 15 %; the calibrated latency 13-16.)
  ``Machine.drift`` multiplies all compute: a shared host's speed at the moment of a run against
  the moment of calibration (1 on a dedicated machine; the scaling harness measures it before
  every configuration, since the development VM varied by up to 1.5x within minutes).
* **Memory per rank.** Weights, gradients and optimizer state of the rank's stage, plus the
  activations autograd keeps per micro-batch (layer outputs, halo-extended inputs of window layers,
  max-pool indices) times the micro-batches in flight (GPipe: M; 1F1B: S - s; with recomputation,
  the stage inputs in flight plus one micro-batch's activations), plus the rank's input shard.

What it leaves out: kernel-level effects no shape shows (algorithm choice, tensor-core alignment,
launch latency beyond a constant per op), I/O, and overlap of halo exchange with interior compute
(the harness runs without it). Breakdown categories follow :data:`hybridpar.profiling.CATEGORIES`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridpar import flops as flop_count
from hybridpar import geometry
from hybridpar.nn import registry
from hybridpar.pipeline.schedule import in_flight, schedule
from hybridpar.spec import plan as _plan
from hybridpar.spec.config import ParallelSpec, SpecError, Split
from hybridpar.spec.graph import INPUT
from hybridpar.spec.plan import LayerPlan

__all__ = ["Cost", "Link", "Machine", "PRESETS", "Prediction", "StageCost", "LayerCost", "Workload",
           "allreduce_time", "bubble_fraction", "calibrate_compute", "fit_cost", "fit_link", "get_machine",
           "halo_bytes", "load_machine", "pingpong", "predict", "save_machine", "default_cache", "time_loop",
           "exchange_after_compute", "link_from_samples", "measure_layer", "measure_layers", "layer_entries",
           "layer_key",
           "measure_engine_overhead", "local_machine", "layer_callables"]

REPLICATED: Split = (1, 1, 1)
GB = 1e9


# ---------------------------------------------------------------------------------------------------
# Machine description


@dataclass(frozen=True)
class Cost:
    """Time of one op class: ``flops / flop_rate + bytes / byte_rate + overhead`` (seconds)."""

    flop_rate: float = math.inf  # FLOP/s
    byte_rate: float = math.inf  # bytes/s
    overhead: float = 0.0        # seconds per call

    def time(self, flops: float, nbytes: float, calls: int = 1) -> float:
        if calls <= 0 or (flops <= 0 and nbytes <= 0):
            return 0.0
        return flops / self.flop_rate + nbytes / self.byte_rate + self.overhead * calls

    def rate(self, flops: float, nbytes: float) -> float:
        """Achieved FLOP/s at this work size."""
        t = self.time(flops, nbytes)
        return flops / t if t > 0 else 0.0


@dataclass(frozen=True)
class Compute:
    """Cost per op class, and the bytes of one activation element."""

    conv_fwd: Cost
    conv_bwd: Cost
    linear: Cost
    pool: Cost
    pointwise: Cost
    dtype_bytes: int = 4


@dataclass(frozen=True)
class Link:
    """An alpha-beta link: ``latency + bytes / bandwidth`` per message."""

    latency: float     # seconds (alpha)
    bandwidth: float   # bytes/s (1 / beta)

    def time(self, nbytes: float, messages: int = 1) -> float:
        if messages <= 0:
            return 0.0
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Machine:
    """What the model needs to know about a machine; see :data:`PRESETS` and :func:`load_machine`.

    ``intra`` is the link between two ranks of one node (per rank); ``inter`` is a node's network
    injection (its bandwidth shared by the node's ranks that talk across nodes at once).
    """

    name: str
    description: str
    compute: Compute
    intra: Link
    inter: Link
    ranks_per_node: int = 1 << 30
    memory: float | None = None          # bytes per rank (device memory)
    cores: int | None = None             # CPU cores a node's ranks share (None: one device per rank)
    contention: float = 1.0              # compute slowdown when >= 2 ranks of a node compute at once
    grad_overlap: float = 0.0            # share of the last backward that hides the gradient all-reduce
    step_overhead: float = 0.0           # seconds per step outside the layers (engine, optimizer calls)
    micro_overhead: float = 0.0          # seconds per micro-batch and stage (schedule, loss, autograd)
    sources: str = ""
    measured: Mapping[str, tuple[float, float]] = field(default_factory=dict, compare=False)
    """Measured (forward, backward) seconds of layers at exact shapes (:func:`layer_key`); used
    before the fitted costs when present (see :func:`measure_layers`)."""
    drift: float = 1.0
    """Compute slowdown of this moment against the calibration (a shared host's speed varies)."""

    def to_dict(self) -> dict[str, Any]:
        """Plain data for JSON (infinite rates as the string ``"inf"``, which strict JSON lacks)."""
        return _finite(dataclasses.asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Machine:
        c = dict(d["compute"])
        num = lambda v: {k: float(x) for k, x in v.items()}  # noqa: E731
        compute = Compute(**{k: Cost(**num(v)) for k, v in c.items() if k != "dtype_bytes"},
                          dtype_bytes=c.get("dtype_bytes", 4))
        rest = {k: v for k, v in d.items() if k not in ("compute", "intra", "inter", "measured")}
        measured = {k: tuple(v) for k, v in d.get("measured", {}).items()}
        return cls(compute=compute, intra=Link(**num(d["intra"])), inter=Link(**num(d["inter"])),
                   measured=measured, **rest)

    def with_measured(self, table: Mapping[str, tuple[float, float]]) -> Machine:
        """This machine with more measured layer times (new entries win)."""
        return dataclasses.replace(self, measured={**self.measured, **table})


def _finite(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _gpu(name: str, description: str, *, flops: float, fraction: float, hbm: float, mem_fraction: float,
         overhead: float, dtype_bytes: int, intra: Link, inter: Link, per_node: int, memory: float,
         sources: str) -> Machine:
    conv = Cost(flops * fraction, hbm * mem_fraction, overhead)
    mem = Cost(math.inf, hbm * mem_fraction, overhead)
    return Machine(name, description, Compute(conv, conv, conv, mem, mem, dtype_bytes), intra, inter,
                   per_node, memory, None, 1.0, 1.0, 5e-4, 5e-5, sources)


_V100_SRC = ("V100 SXM2: 15.7 TFLOP/s fp32, 125 TFLOP/s fp16 tensor, 900 GB/s HBM2 (NVIDIA V100 datasheet); "
             "NVLink2 between GPU pairs 50 GB/s per direction (2 bricks x 25 GB/s, Summit/Lassen nodes); "
             "dual-rail EDR InfiniBand 2 x 12.5 GB/s per node. Assumed achievable: 50 % of peak for 3D "
             "convolutions in fp32 (cuDNN implicit GEMM), 30 % on tensor cores, 80 % of HBM bandwidth, "
             "10 us per op (launch + framework), 0.5 ms per step and 50 us per micro-batch of engine "
             "overhead, alpha 5 us (NVLink) and 5 us (IB, NCCL/MPI level).")
_H100_SRC = ("H100 SXM5: 67 TFLOP/s fp32, 989 TFLOP/s bf16 dense, 3.35 TB/s HBM3 (NVIDIA H100 datasheet); "
             "NVLink4 450 GB/s per direction per GPU (NVSwitch, DGX H100); one NDR 400 Gb/s (50 GB/s) "
             "InfiniBand NIC per GPU, 8 per node = 400 GB/s. Assumed achievable: 50 % of fp32 peak, "
             "35 % of bf16 tensor peak for 3D convolutions, 80 % of HBM bandwidth, 5 us per op, 0.5 ms "
             "per step and 50 us per micro-batch of engine overhead, alpha 3 us (NVLink) and 5 us (IB).")

PRESETS: dict[str, Machine] = {
    "v100": _gpu("v100", "4 x V100-16GB per node (Lassen-like), fp32, NVLink2 + dual-rail EDR",
                 flops=15.7e12, fraction=0.5, hbm=900 * GB, mem_fraction=0.8, overhead=10e-6, dtype_bytes=4,
                 intra=Link(5e-6, 50 * GB), inter=Link(5e-6, 25 * GB), per_node=4, memory=16 * 2**30,
                 sources=_V100_SRC),
    "v100-fp16": _gpu("v100-fp16", "4 x V100-16GB per node (Lassen-like), fp16 tensor cores",
                      flops=125e12, fraction=0.3, hbm=900 * GB, mem_fraction=0.8, overhead=10e-6,
                      dtype_bytes=2, intra=Link(5e-6, 50 * GB), inter=Link(5e-6, 25 * GB), per_node=4,
                      memory=16 * 2**30, sources=_V100_SRC),
    "summit": _gpu("summit", "6 x V100-16GB per node (Summit), fp32, NVLink2 + dual-rail EDR",
                   flops=15.7e12, fraction=0.5, hbm=900 * GB, mem_fraction=0.8, overhead=10e-6, dtype_bytes=4,
                   intra=Link(5e-6, 50 * GB), inter=Link(5e-6, 25 * GB), per_node=6, memory=16 * 2**30,
                   sources=_V100_SRC),
    "h100": _gpu("h100", "8 x H100-80GB per node (DGX H100-like), bf16, NVLink4 + NDR",
                 flops=989e12, fraction=0.35, hbm=3350 * GB, mem_fraction=0.8, overhead=5e-6, dtype_bytes=2,
                 intra=Link(3e-6, 450 * GB), inter=Link(5e-6, 400 * GB), per_node=8, memory=80 * 2**30,
                 sources=_H100_SRC),
    "h100-fp32": _gpu("h100-fp32", "8 x H100-80GB per node (DGX H100-like), fp32, NVLink4 + NDR",
                      flops=67e12, fraction=0.5, hbm=3350 * GB, mem_fraction=0.8, overhead=5e-6,
                      dtype_bytes=4, intra=Link(3e-6, 450 * GB), inter=Link(5e-6, 400 * GB), per_node=8,
                      memory=80 * 2**30,
                      sources=_H100_SRC),
}
"""Accelerator clusters. ``get_machine("local")`` is this machine, calibrated (see :func:`load_machine`)."""


def default_cache() -> Path:
    """Where this host's calibration is kept: ``$HYBRIDPAR_MACHINE`` or ``~/.cache/hybridpar/``."""
    env = os.environ.get("HYBRIDPAR_MACHINE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "hybridpar" / f"machine-{socket.gethostname()}.json"


def save_machine(machine: Machine, path: str | os.PathLike, extra: Mapping[str, Any] | None = None) -> Path:
    """Write ``machine`` (and ``extra`` facts such as the raw calibration samples) as JSON."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine.to_dict(), **_finite(dict(extra or {}))}, indent=1) + "\n")
    return path


def load_machine(path: str | os.PathLike | None = None) -> Machine:
    """A machine saved by :func:`save_machine` (default: this host's calibration cache)."""
    path = Path(path) if path is not None else default_cache()
    if not path.is_file():
        raise FileNotFoundError(
            f"no calibration at {path}; measure this machine once with `python perf/harness.py "
            f"--calibrate-only` (or hybridpar.perfmodel.calibrate_compute + pingpong), or pick a "
            f"preset: {', '.join(PRESETS)}")
    return Machine.from_dict(json.loads(path.read_text())["machine"])


def get_machine(name: str | os.PathLike | Machine) -> Machine:
    """A preset by name, ``local`` (this host's calibration cache), or a saved JSON path."""
    if isinstance(name, Machine):
        return name
    if str(name) in PRESETS:
        return PRESETS[str(name)]
    if str(name) == "local":
        return load_machine()
    if Path(name).suffix == ".json":
        return load_machine(name)
    raise ValueError(f"unknown machine {name!r}; use one of {', '.join([*PRESETS, 'local'])} or a "
                     f".json file written by save_machine")


# ---------------------------------------------------------------------------------------------------
# Calibration on this machine


def fit_cost(samples: Iterable[tuple[float, float, float]]) -> Cost:
    """Least-squares fit of ``t = a*flops + b*bytes + c`` to ``(flops, bytes, seconds)`` samples.

    Relative errors are minimised (each row is divided by its time), and the coefficients must not be
    negative: every subset of the three terms is fitted and the best non-negative one kept.
    """
    rows = [(float(f), float(b), float(t)) for f, b, t in samples if t > 0]
    if not rows:
        raise ValueError("fit_cost: no samples with a positive time")
    best: tuple[float, list[float]] | None = None
    for mask in itertools.product((0, 1), repeat=3):
        if not any(mask):
            continue
        cols = [i for i in range(3) if mask[i]]
        a = torch.tensor([[(f, b, 1.0)[i] / t for i in cols] for f, b, t in rows], dtype=torch.float64)
        y = torch.ones(len(rows), 1, dtype=torch.float64)
        try:
            coef = torch.linalg.lstsq(a, y, driver="gelsd").solution.flatten().tolist()
        except RuntimeError:
            continue
        if any(c < 0 for c in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(cols, coef):
            full[i] = c
        err = sum(((full[0] * f + full[1] * b + full[2]) / t - 1) ** 2 for f, b, t in rows)
        if best is None or err < best[0] - 1e-12:
            best = (err, full)
    assert best is not None
    a, b, c = best[1]
    return Cost(1 / a if a > 0 else math.inf, 1 / b if b > 0 else math.inf, c)


def fit_link(samples: Iterable[tuple[int, float]]) -> Link:
    """Alpha-beta fit of one-way message times ``(bytes, seconds)`` (relative least squares)."""
    cost = fit_cost((0.0, n, t) for n, t in samples)
    return Link(cost.overhead, cost.byte_rate)


def link_from_samples(samples: Sequence[tuple[int, float]], small: int = 1 << 15) -> Link:
    """A robust alpha-beta link from noisy ``(bytes, seconds)`` samples: alpha is the median time of
    the messages up to ``small`` bytes, the bandwidth what the largest message adds to it (falling
    back to :func:`fit_link` when that is not positive)."""
    lat = statistics.median(t for n, t in samples if n <= small)
    n_max, t_max = max(samples)
    if t_max > lat:
        return Link(lat, n_max / (t_max - lat))
    return fit_link(samples)


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                 stat: Callable = statistics.median) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def time_loop(fn: Callable[[], Any], seconds: float, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` called repeatedly for ``seconds`` of wall time."""
    for _ in range(warmup):
        fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CONV_CASES = ((4, 8, 32, 1), (4, 8, 16, 2), (4, 16, 16, 1), (8, 16, 16, 1), (8, 16, 8, 2), (16, 32, 8, 1),
              (16, 32, 16, 1), (32, 64, 8, 1), (32, 64, 4, 2), (4, 32, 16, 1), (64, 64, 4, 1))
"""(C_in, C_out, S, N) of the calibration convolutions (k3, padding 1, on N x C_in x S^3)."""
ELEMENTWISE_CASES = ((8, 32, 1), (16, 16, 2), (32, 16, 1), (64, 8, 1), (4, 32, 1), (32, 8, 2))
"""(C, S, N) of the calibration pooling and activation layers."""
LINEAR_CASES = ((1, 4096, 32), (4, 4096, 32), (2, 16384, 128), (8, 512, 64))
"""(N, in, out) of the calibration linear layers."""


def _conv_samples(repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    fwd, bwd = [], []
    for c_in, c_out, s, n in CONV_CASES:
        conv = nn.Conv3d(c_in, c_out, 3, padding=1)
        for needs_grad in (False, True):
            x = torch.randn(n, c_in, s + 2, s + 2, s + 2, requires_grad=needs_grad)
            conv_nopad = nn.Conv3d(c_in, c_out, 3)  # distributed convs run unpadded on extended inputs
            conv_nopad.load_state_dict(conv.state_dict())
            y = conv_nopad(x)
            g = torch.randn_like(y)
            f = 2 * y.numel() * c_in * 27
            nbytes = 4 * (x.numel() + y.numel() + conv.weight.numel())
            if not needs_grad:
                fwd.append((f, nbytes, _median_time(lambda c=conv_nopad, x=x: c(x), repeats)))
            params = list(conv_nopad.parameters())

            def backward(c=conv_nopad, x=x, g=g, params=params) -> None:
                out = c(x)
                torch.autograd.grad(out, [x, *params] if x.requires_grad else params, g)

            t = _median_time(backward, repeats) - _median_time(lambda c=conv_nopad, x=x: c(x), repeats)
            bwd.append((f * (2 if needs_grad else 1), nbytes * (2 if needs_grad else 1), max(t, 1e-6)))
    return {"conv_fwd": fwd, "conv_bwd": bwd}


def _elementwise_samples(repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    pool, point = [], []
    for c, s, n in ELEMENTWISE_CASES:
        x = torch.randn(n, c, s, s, s, requires_grad=True)
        for layer in (nn.MaxPool3d(2), nn.AvgPool3d(3, 2, 1)):
            y = layer(x)
            g = torch.randn_like(y)
            k = layer.kernel_size
            taps = math.prod(k) if isinstance(k, tuple) else k ** 3
            pool.append((taps * y.numel(), 4 * (x.numel() + y.numel()),
                         _median_time(lambda layer=layer, x=x: layer(x.detach()), repeats)))
            t = _median_time(lambda layer=layer, x=x, g=g: torch.autograd.grad(layer(x), x, g), repeats)
            t -= pool[-1][2]
            pool.append((0.0, 4 * (x.numel() + 2 * y.numel()), max(t, 1e-6)))
        act = nn.LeakyReLU(0.3)
        g = torch.randn_like(x)
        point.append((0.0, 4 * 2 * x.numel(), _median_time(lambda x=x, a=act: a(x.detach()), repeats)))
        t = _median_time(lambda x=x, g=g, a=act: torch.autograd.grad(a(x), x, g), repeats) - point[-1][2]
        point.append((0.0, 4 * 3 * x.numel(), max(t, 1e-6)))
    return {"pool": pool, "pointwise": point}


def _linear_samples(repeats: int) -> list[tuple[float, float, float]]:
    out = []
    for n, fin, fout in LINEAR_CASES:
        lin = nn.Linear(fin, fout)
        x = torch.randn(n, fin, requires_grad=True)
        f = 2 * n * fin * fout
        nbytes = 4 * (x.numel() + n * fout + lin.weight.numel())
        t = _median_time(lambda lin=lin, x=x: lin(x.detach()), repeats)
        out.append((f, nbytes, t))
        g = torch.randn(n, fout)
        tb = _median_time(lambda lin=lin, x=x, g=g: torch.autograd.grad(lin(x), [x, *lin.parameters()], g),
                          repeats) - t
        out.append((2 * f, 2 * nbytes, max(tb, 1e-6)))
    return out


def calibrate_compute(repeats: int = 5, threads: int = 1) -> tuple[Compute, dict[str, Any]]:
    """Time conv/pool/activation/linear layers at a few sizes on this host; fit a :class:`Cost` each.

    Runs with ``threads`` intra-op threads (the harness runs one per rank). Returns the fitted
    :class:`Compute` and the raw samples with the fit's relative error per sample (for the record).
    About 10-30 s on a laptop core.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        samples = _conv_samples(repeats)
        samples.update(_elementwise_samples(repeats))
        samples["linear"] = _linear_samples(repeats)
    finally:
        torch.set_num_threads(before)
    costs = {k: fit_cost(v) for k, v in samples.items()}
    compute = Compute(**costs, dtype_bytes=4)
    record = {k: [{"flops": f, "bytes": b, "seconds": t, "fit_ratio": costs[k].time(f, b) / t}
                  for f, b, t in v] for k, v in samples.items()}
    return compute, record


def pingpong(peer: int, sizes: Sequence[int] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24),
             repeats: int = 20, group: Any = None) -> list[tuple[int, float]]:
    """One-way message times ``(bytes, seconds)`` between this rank and ``peer`` (half a round trip).

    Call on both ranks of an initialised process group (the lower rank sends first).
    """
    import torch.distributed as dist  # noqa: PLC0415

    me = dist.get_rank()
    out = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        reps = max(3, repeats if n <= 1 << 20 else repeats // 4)
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            if me < peer:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append((buf.numel() * 4, statistics.median(times)))
    return out


def exchange_after_compute(peer: int, sizes: Sequence[int] = (8, 1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 21),
                           busy: float = 3e-3, repeats: int = 12,
                           group: Any = None) -> list[tuple[int, float]]:
    """Seconds of a halo-like exchange (``batch_isend_irecv``, one message each way) right after
    ``busy`` seconds of computation, per message size; median over ``repeats``.

    This is what a halo exchange costs between layers, which ping-pong does not show: a rank that
    finishes first blocks, and on a virtual machine waking its idle core again can take milliseconds.
    Call on both ranks of an initialised process group.
    """
    import torch.distributed as dist  # noqa: PLC0415

    a = torch.randn(96, 96)
    out = []
    for n in sizes:
        send, recv = torch.zeros(max(n // 4, 1)), torch.zeros(max(n // 4, 1))
        times = []
        for i in range(repeats + 2):
            end = time.perf_counter() + busy
            while time.perf_counter() < end:
                torch.mm(a, a)
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.irecv, recv, peer, group), dist.P2POp(dist.isend, send, peer, group)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out.append((send.numel() * 4, statistics.median(times)))
    return out


def local_machine(compute: Compute, link: Link, contention: float = 1.0, step_overhead: float = 0.0,
                  micro_overhead: float = 0.0, description: str = "", sources: str = "") -> Machine:
    """This host as a :class:`Machine`: one node whose ranks share its cores over loopback."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Machine("local", description or f"{platform.node()}: {cores} cores, gloo over loopback",
                   compute, link, link, 1 << 30, float(mem), cores, contention, 0.0, step_overhead,
                   micro_overhead, sources or "measured: calibrate_compute, measure_layers and "
                   "measure_engine_overhead (1 thread per rank), pingpong over gloo")


# ---------------------------------------------------------------------------------------------------
# The workload: a model and a global input, analysed once


def _op_class(m: nn.Module | None, fwd_flops: int) -> str:
    """The kernel class a layer is timed as (its registry entry's ``op``)."""
    entry = registry.lookup(m) if m is not None else None
    if entry is not None:
        return entry.op
    return "conv" if fwd_flops else "free"


@dataclass(frozen=True)
class _Leaf:
    name: str
    module: nn.Module
    op: str
    forward: int       # whole global batch, matmul FLOPs
    input_grad: int
    weight_grad: int
    other: int         # forward_other (pool taps)
    params: int
    window: bool       # a conv/pool whose halos the plan computes


def _quick_halos(name: str, m: nn.Module | None, entry: registry.LayerEntry | None, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...], split: Split) -> tuple[tuple[int, int], ...]:
    """The plan's halos without geometry's search for what would fit (which costs O(extent^2) per
    call, ~1 s a layer at 512^3): a planner only needs to know that a split fails, so the message is
    shorter; :meth:`ParallelSpec.plan` gives the full one."""
    try:
        return _plan.node_halos("", m, entry, in_shape, out_shape, split)
    except SpecError:
        size = "x".join(map(str, in_shape[2:]))
        kind = type(m).__name__ if m is not None else "function"
        raise SpecError(f"layers: {name} ({kind}) cannot run split {list(split)} on its input of {size} "
                        f"voxels (spec.plan says what would fit)") from None


class Workload:
    """``model`` on a global input of ``input_shape``: leaves, shapes and per-leaf FLOPs, computed once.

    :meth:`plan` resolves a spec exactly as :meth:`ParallelSpec.plan` does (and is tested to give the
    same records; its errors are the same kind, with shorter messages) but reuses the traced shapes and
    memoises halo plans, so a planner can resolve thousands of specs for one model.
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        shape = _plan.check_input_shape(tuple(int(s) for s in input_shape))
        self.model, self.input_shape = model, shape
        self.analysis = _plan.analyse(model, shape)
        self.leaves, self.containers = self.analysis.leaves, self.analysis.containers
        self.shapes = self.analysis.shapes
        self.count = self.analysis.count or flop_count.count(model, shape)
        sums = _plan.leaf_flop_sums(self.count, self.leaves)
        self.layers = []
        for node, s in zip(self.analysis.graph.nodes, sums, strict=True):
            m = node.module
            entry = registry.lookup(m) if m is not None else None
            op = _op_class(m, s[0]) if m is not None else \
                ("pointwise" if registry.function_role(node.target) in ("pointwise", "concat") else "free")
            self.layers.append(_Leaf(node.name, m, op, s[0], s[1], s[2], s[3],
                                     sum(p.numel() for p in m.parameters()) if m is not None else 0,
                                     entry is not None and entry.role in ("window", "transposed")))
        self.fwd_flops = [lf.forward for lf in self.layers]
        self.train_flops = [s[0] + s[1] + s[2] for s in sums]
        self._halo_cache: dict[tuple[str, Split], Any] = {}

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    @property
    def total_flops(self) -> int:
        """Matmul FLOPs of one training step on the global batch (forward + backward)."""
        return self.count.total

    @property
    def params(self) -> int:
        return sum(lf.params for lf in self.layers)

    def _halos(self, name: str, m: nn.Module | None, entry: registry.LayerEntry | None,
               in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               split: Split) -> tuple[tuple[int, int], ...]:
        """The plan's halo widths of node ``name`` under ``split`` (memoised, errors included)."""
        key = (name, split)
        if key not in self._halo_cache:
            try:
                self._halo_cache[key] = _quick_halos(name, m, entry, in_shape, out_shape, split)
            except SpecError as err:
                self._halo_cache[key] = err
        found = self._halo_cache[key]
        if isinstance(found, SpecError):
            raise found
        return found

    def plan(self, spec: ParallelSpec, world_size: int | None = None) -> list[LayerPlan]:
        """:func:`hybridpar.spec.plan.build_plan` on the cached analysis (same records; halo errors
        are terser)."""
        return _plan.resolve(spec, self.analysis, world_size, halos=self._halos)


# ---------------------------------------------------------------------------------------------------
# Layer times measured at exact shapes


def _signature(m: nn.Module) -> str:
    """The hyperparameters that decide a layer's kernel (not its weights)."""
    if isinstance(m, nn.modules.conv._ConvNd):
        return (f"{type(m).__name__}({m.in_channels},{m.out_channels},k{m.kernel_size},s{m.stride},"
                f"d{m.dilation},g{m.groups},b{int(m.bias is not None)})")
    if isinstance(m, nn.modules.pooling._MaxPoolNd | nn.modules.pooling._AvgPoolNd):
        return f"{type(m).__name__}(k{m.kernel_size},s{m.stride},d{getattr(m, 'dilation', 1)})"
    if isinstance(m, nn.Linear):
        return f"Linear({m.in_features},{m.out_features},b{int(m.bias is not None)})"
    return type(m).__name__


def kernel_shape(m: nn.Module, rec: LayerPlan) -> tuple[int, ...]:
    """The input shape the torch kernel of ``rec`` runs on, on the most loaded rank, per micro-batch.

    Window layers run unpadded on their halo- and padding-extended shard (as the distributed layers
    do): per dim ``(out - 1) * stride + dilation * (kernel - 1) + 1``; other layers on their shard.
    """
    entry = registry.lookup(m) if m is not None else None
    if entry is not None and entry.role == "window" and len(rec.local_output_shape) == 5:
        args = entry.window_args(m)
        out = rec.local_output_shape[2:]
        ext = tuple((o - 1) * a["stride"] + a["dilation"] * (a["kernel"] - 1) + 1 for o, a in zip(out, args))
        return (rec.local_input_shape[0], rec.local_input_shape[1], *ext)
    return tuple(rec.local_input_shape)


def layer_key(m: nn.Module, shape: Sequence[int], input_grad: bool) -> str:
    """Key of a measured layer time: signature, kernel input shape, whether the input needs a gradient."""
    return f"{_signature(m)}|{'x'.join(map(str, shape))}|{'g' if input_grad else 'n'}"


def _runnable(m: nn.Module, shape: Sequence[int],
              wrap: bool | None = None) -> tuple[nn.Module, tuple[int, ...]]:
    """``m`` as a rank runs it, and the input that makes its kernel see ``shape``.

    With ``wrap`` (default: when a one-rank process group is initialised), window layers become their
    distributed counterparts on a one-rank grid fed ``shape`` minus their padding, so the time
    includes what the distributed layer adds around the kernel (assembling the extended input,
    autograd plumbing); without it, plain unpadded torch layers on ``shape``.
    """
    import copy  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    entry = registry.lookup(m)
    if entry is not None and entry.role in ("window", "transposed") and len(shape) == 5:
        pads = [(a["pad_lo"], a["pad_hi"]) if "pad_lo" in a else (0, 0) for a in entry.window_args(m)]
        if wrap is None:
            wrap = dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1
        if wrap and isinstance(m, (nn.Conv3d, nn.MaxPool3d, nn.AvgPool3d)):
            from hybridpar.grid import ProcessGrid  # noqa: PLC0415
            from hybridpar.pipeline.convert import to_distributed  # noqa: PLC0415

            k = to_distributed(m.float(), ProcessGrid().with_spatial((1, 1, 1)))
            inner = (*shape[:2], *(n - lo - hi for n, (lo, hi) in zip(shape[2:], pads)))
            k.global_input_shape = tuple(inner[2:])
            return k.float().train(), inner
        if isinstance(m, nn.Conv3d):
            k = nn.Conv3d(m.in_channels, m.out_channels, m.kernel_size, m.stride, 0, m.dilation, m.groups,
                          m.bias is not None)
        elif isinstance(m, nn.MaxPool3d):
            k = nn.MaxPool3d(m.kernel_size, m.stride, 0, m.dilation)
        elif isinstance(m, nn.AvgPool3d):
            k = nn.AvgPool3d(m.kernel_size, m.stride, 0)
        else:
            k = copy.deepcopy(m)
        return k.float().train(), tuple(shape)
    return copy.deepcopy(m).float().train(), tuple(shape)


def measure_layer(m: nn.Module, shape: Sequence[int], input_grad: bool, repeats: int = 5,
                  wrap: bool | None = None) -> tuple[float, float]:
    """Forward and backward seconds of ``m`` whose kernel runs on ``shape`` (this thread).

    See :func:`_runnable` for what is timed and ``wrap``. The backward is (forward + backward) -
    forward. Each is the fastest of ``repeats`` calls: on a shared machine other processes only ever
    add time, so the minimum is the estimate of the layer alone.
    """
    forward, both = layer_callables(m, shape, input_grad, wrap)
    fwd = _median_time(forward, repeats, warmup=2, stat=min)
    if both is None:
        return fwd, 0.0
    return fwd, max(_median_time(both, repeats, warmup=1, stat=min) - fwd, 0.0)


def layer_callables(m: nn.Module, shape: Sequence[int], input_grad: bool,
                    wrap: bool | None = None) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """(forward, forward + backward) of ``m``'s kernel on a random input (see :func:`_runnable`);
    the second is None for a layer with nothing to differentiate."""
    k, real = _runnable(m, shape, wrap)
    x = torch.randn(real, requires_grad=input_grad)
    params = [p for p in k.parameters() if p.requires_grad]
    wrt = ([x] if input_grad else []) + params
    forward = lambda: k(x if input_grad else x.detach())  # noqa: E731
    if not wrt:
        return forward, None
    g = torch.randn_like(k(x))
    return forward, lambda: torch.autograd.grad(k(x), wrt, g)


def measure_engine_overhead(repeats: int = 20) -> tuple[float, float]:
    """(per step, per micro-batch) seconds of a one-rank engine step on a model of almost no work.

    Needs an initialised process group (one rank). What it times: ``shard_batch``, ``train_step``
    (schedule, loss, autograd, gradient bucketing) and an SGD step, with 1 and 4 micro-batches.
    """
    import torch.nn.functional as F  # noqa: PLC0415

    from hybridpar.pipeline import parallelize  # noqa: PLC0415
    from hybridpar.spec import ParallelSpec  # noqa: PLC0415

    times = {}
    for m in (1, 4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(1, 1, 1), nn.Flatten(), nn.Linear(8, 4))
        spec = ParallelSpec.from_dict({"pipeline": {"microbatches": m}})
        engine = parallelize(model, spec, loss_fn=F.mse_loss, input_shape=(4, 1, 2, 2, 2))
        x, y = torch.randn(4, 1, 2, 2, 2), torch.randn(4, 4)
        opt = torch.optim.SGD(engine.parameters(), lr=1e-3, momentum=0.9)

        def step(engine=engine, opt=opt, x=x, y=y) -> None:
            xl, yl = engine.shard_batch(x, y)
            engine.train_step(xl, yl)
            opt.step()
            opt.zero_grad(set_to_none=True)

        # the three layers' own cost is part of the measured layer times: subtract it
        layers = sum(sum(measure_layer(layer, s, i > 0, repeats)) for i, (layer, s) in enumerate(
            [(model[0], (4 // m, 1, 2, 2, 2)), (model[2], (4 // m, 8))]))
        times[m] = _median_time(step, repeats, warmup=3) - m * layers
    per_micro = max((times[4] - times[1]) / 3, 0.0)
    return max(times[1] - per_micro, 0.0), per_micro


def layer_entries(workload: Workload,
                  plan: list[LayerPlan]) -> list[tuple[str, nn.Module, tuple[int, ...], bool]]:
    """``(key, module, kernel shape, input_grad)`` of every layer of ``plan`` whose time matters."""
    out = []
    for rec, leaf, needs in zip(plan, workload.layers, _input_grads(plan, workload)):
        if leaf.op == "free":
            continue
        shape = kernel_shape(leaf.module, rec)
        out.append((layer_key(leaf.module, shape, needs), leaf.module, shape, needs))
    return out


def measure_layers(entries: Iterable[tuple[str, nn.Module, tuple[int, ...], bool]], repeats: int = 5,
                   threads: int = 1, skip: Iterable[str] = ()) -> dict[str, tuple[float, float]]:
    """Measure each distinct entry of :func:`layer_entries` once (``threads`` intra-op threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    done = set(skip)
    table: dict[str, tuple[float, float]] = {}
    try:
        torch.manual_seed(0)
        for key, m, shape, needs in entries:
            if key in done or key in table:
                continue
            table[key] = measure_layer(m, shape, needs, repeats)
    finally:
        torch.set_num_threads(before)
    return table


def _input_grads(plan: list[LayerPlan], workload: Workload) -> list[bool]:
    """Whether each layer's input needs a gradient: not before the first parameter of stage 0."""
    out, flows, stage = [], False, -1
    for rec, leaf in zip(plan, workload.layers):
        if rec.stage != stage:
            stage = rec.stage
            flows = flows or stage > 0
        out.append(flows)
        flows = flows or leaf.params > 0
    return out


# ---------------------------------------------------------------------------------------------------
# Communication pieces


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a synchronous pipeline step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def halo_bytes(local_input: Sequence[int], halo: Sequence[tuple[int, int]], split: Split,
               dtype_bytes: int = 4) -> tuple[int, int]:
    """Bytes and messages the most loaded rank receives to extend its ``local_input`` (N, C, D, H, W).

    ``halo`` is the plan's widest (low, high) halo per dim; an interior rank receives both (one
    message each), a rank of a 2-way split only one. Dims are exchanged in order (d, then h on the
    d-extended shard, then w), as :class:`hybridpar.comm.halo.HaloExchanger` does, so later faces
    include earlier halos (the corners).
    """
    ext = list(local_input[2:])
    nc = local_input[0] * local_input[1]
    total = msgs = 0
    for d in range(3):
        if split[d] == 1:
            continue
        lo, hi = max(halo[d][0], 0), max(halo[d][1], 0)
        if split[d] == 2:  # each of the two ranks has one neighbour: the wider side is the worst
            lo, hi = max(lo, hi), 0
        face = math.prod(ext[e] for e in range(3) if e != d)
        total += (lo + hi) * face * nc * dtype_bytes
        msgs += (lo > 0) + (hi > 0)
        ext[d] += lo + hi
    return total, msgs


def _boxes(shape: Sequence[int], split: Split) -> list[tuple[tuple[int, int], ...]]:
    sd, sh, sw = split
    return [tuple(geometry.shard_range(shape[a], split[a], c[a]) for a in range(3))
            for c in itertools.product(range(sd), range(sh), range(sw))]


@functools.lru_cache(maxsize=4096)
def _redistribute_volume(shape: tuple[int, int, int], src: Split, dst: Split, stage: int) -> tuple[int, int]:
    """Voxels and messages the most loaded stage rank receives moving ``src`` -> ``dst``, routed as
    :func:`hybridpar.comm.redistribute.redistribute_tensor` routes them: stage rank ``q`` needs the
    ``dst`` box ``q % |dst|`` and already holds the ``src`` shard ``q % |src|``; every other ``src``
    shard overlapping its box sends one message. The ``src`` shards tile the volume, so the voxels
    received are the box minus the part q holds."""
    if src == dst:
        return 0, 0
    ns, nd = math.prod(src), math.prod(dst)
    src_ranges = [geometry.shard_ranges(shape[a], src[a]) for a in range(3)]
    sb, db = _boxes(shape, src), _boxes(shape, dst)
    worst = (0, 0)
    for qd, qs in {(q % nd, q % ns) for q in range(stage)}:
        want, own = db[qd], sb[qs]
        held = math.prod(max(0, min(a[1], b[1]) - max(a[0], b[0])) for a, b in zip(own, want))
        senders = math.prod(sum(1 for r in src_ranges[a] if min(r[1], want[a][1]) > max(r[0], want[a][0]))
                            for a in range(3))
        vox = math.prod(hi - lo for lo, hi in want) - held
        worst = max(worst, (vox, senders - (1 if held else 0)))
    return worst


def allreduce_time(nbytes: float, ranks: Sequence[int], machine: Machine, world: int) -> float:
    """Ring all-reduce of ``nbytes`` over global ``ranks``; hierarchical when they span nodes.

    Within a node: ``2 (g-1)/g`` of the bytes over the intra link and ``2 (g-1)`` latencies. Across
    ``k`` nodes: ``2 (k-1)/k`` of the bytes through each node's NIC, which every group with members
    on that node shares (``G / g`` of them, G ranks per node, g of this group), and
    ``2 ceil(log2 k)`` latencies (tree-like latency at scale).
    """
    return sum(_allreduce_parts(nbytes, ranks, machine, world))


def _allreduce_parts(nbytes: float, ranks: Sequence[int], machine: Machine,
                     world: int) -> tuple[float, float]:
    """(latency, transfer) seconds of :func:`allreduce_time`."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    per = machine.ranks_per_node
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // per] = nodes.get(r // per, 0) + 1
    k, g = len(nodes), max(nodes.values())
    lat = xfer = 0.0
    if g > 1:
        lat += 2 * (g - 1) * machine.intra.latency
        xfer += 2 * (g - 1) / g * nbytes / machine.intra.bandwidth
    if k > 1:
        share = max(min(per, world) / g, 1.0)
        lat += 2 * math.ceil(math.log2(k)) * machine.inter.latency
        xfer += 2 * (k - 1) / k * nbytes * share / machine.inter.bandwidth
    return lat, xfer


def _link_between(machine: Machine, span: int, world: int) -> tuple[Link, float]:
    """The link for point-to-point traffic inside blocks of ``span`` consecutive ranks, and the share
    of its bandwidth one flow gets: the intra-node link when a block fits a node, else the node's NIC
    shared by all of the node's ranks (they exchange at the same time)."""
    per = machine.ranks_per_node
    if world <= per or span <= per:
        return machine.intra, 1.0
    return machine.inter, 1.0 / per


# ---------------------------------------------------------------------------------------------------
# Prediction


@dataclass
class LayerCost:
    """One layer on the most loaded rank of its stage, per micro-batch (seconds, bytes)."""

    name: str
    op: str
    stage: int
    split: Split
    forward: float
    backward: float
    halo_forward: float
    halo_backward: float
    redistribute_forward: float
    redistribute_backward: float
    flops: float
    halo_bytes: int
    saved_bytes: int
    latency: float = 0.0  # the message latencies inside the halo and redistribute times
    weight_backward: float = 0.0  # the weight-gradient part of ``backward`` (conv, linear)


@dataclass
class StageCost:
    """Per micro-batch times of one stage on its most loaded rank, and its memory."""

    stage: int
    compute: float
    halo: float
    send: float
    grad_reduce: float
    params: int
    memory: dict[str, float]
    latency: float = 0.0  # message latencies inside halo and send
    grad_reduce_latency: float = 0.0
    send_latency: float = 0.0  # the latencies inside send: hidden once the pipeline is full

    @property
    def time(self) -> float:
        return self.compute + self.halo + self.send


@dataclass
class Prediction:
    """Predicted step of ``spec`` on ``machine``; ``breakdown`` sums to ``step_time``."""

    spec: ParallelSpec
    machine: str
    world: int
    batch: int
    step_time: float
    breakdown: dict[str, float]
    memory: dict[str, float]          # bytes per rank on the stage that needs most
    model_flops: int                  # matmul FLOPs of the step (the whole global batch)
    stages: list[StageCost]
    layers: list[LayerCost] = field(repr=False)
    bubble: float = 0.0
    oversubscribed: bool = False

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_time

    @property
    def flops_per_s(self) -> float:
        return self.model_flops / self.step_time

    @property
    def peak_memory(self) -> float:
        return self.memory["total"]

    def summary(self) -> str:
        g, p = self.spec.grid, self.spec.pipeline
        parts = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in self.breakdown.items() if v > 0)
        return (f"{g.arithmetic}, M={p.microbatches}: {1e3 * self.step_time:.2f} ms/step "
                f"({self.samples_per_s:.1f} samples/s, {self.flops_per_s / 1e12:.3f} TFLOP/s; {parts} ms), "
                f"{self.memory['total'] / 2**30:.2f} GiB/rank")


def _stage_memory(layers: list[LayerCost], plan: list[LayerPlan], stage: int, spec: ParallelSpec,
                  dtype_bytes: int, optimizer_states: int) -> dict[str, float]:
    recs = [r for r in plan if r.stage == stage]
    mine = [lc for lc in layers if lc.stage == stage]
    params = sum(r.params for r in recs)
    S, M = spec.grid.pipe, spec.pipeline.microbatches
    inflight = M if spec.pipeline.schedule == "gpipe" else min(M, S - stage)
    per_micro = sum(lc.saved_bytes for lc in mine)
    first = recs[0]
    stage_in = math.prod(first.local_input_shape) * dtype_bytes
    if spec.pipeline.recompute:
        acts = inflight * stage_in + per_micro
    else:
        acts = inflight * per_micro
    biggest = max((math.prod(r.local_input_shape) + math.prod(r.local_output_shape)) * dtype_bytes
                  for r in recs)
    inputs = stage_in * M if stage == 0 else stage_in * inflight  # the rank's input shard / received
    weights = params * dtype_bytes
    mem = {"weights": weights, "gradients": weights, "optimizer": weights * optimizer_states,
           "activations": acts, "workspace": biggest, "inputs": inputs}
    mem["total"] = sum(mem.values())
    return mem


def predict(workload: Workload | nn.Module, spec: ParallelSpec | Mapping[str, Any],
            machine: Machine | str, world_size: int | None = None, *,
            input_shape: Sequence[int] | None = None, plan: list[LayerPlan] | None = None,
            optimizer_states: int = 1) -> Prediction:
    """Predicted step time, breakdown and memory per rank of ``spec`` (see the module doc).

    ``workload`` is a :class:`Workload` or a model (then ``input_shape`` is required).
    ``optimizer_states``: tensors of optimizer state per parameter (1: SGD with momentum, 2: Adam).
    """
    if not isinstance(workload, Workload):
        if input_shape is None:
            raise ValueError("predict: pass input_shape=(N, C, D, H, W) with a model, or a Workload")
        workload = Workload(workload, input_shape)
    if not isinstance(spec, ParallelSpec):
        spec = ParallelSpec.from_dict(spec)
    machine = get_machine(machine)
    world = world_size or math.prod(spec.grid.sizes)
    spec = spec.resolve_grid(world)
    plan = plan if plan is not None else workload.plan(spec)
    pred = _predict(workload, spec, machine, world, plan, optimizer_states, 1.0)
    node_ranks = min(world, machine.ranks_per_node)
    if machine.cores is not None and node_ranks > machine.cores:
        # Time-shared cores: a rank computes on its share of a core while the other busy ranks
        # compute too. How many are busy on average is the node's compute divided by the compute's
        # own critical path: every rank of data or spatial parallelism, (1 - bubble) of the ranks
        # of a pipeline of equal stages, fewer of one of unequal stages (most wait for their turn,
        # asleep). A message does not wait for its receiver's turn: the receiver sleeps in its
        # receive, and the scheduler runs a task that wakes from sleep ahead of those that used
        # their slices (its latency stays the calibrated wake-up's).
        g, M = spec.grid, spec.pipeline.microbatches
        comp = [st.compute for st in pred.stages]
        path = sum(comp) + (M - 1) * max(comp)
        busy = g.data * g.stage_size * M * sum(comp) * min(node_ranks, world) / world
        share = max(1.0, busy / (path * machine.cores)) if path > 0 else 1.0
        if share > 1.0:
            pred = _predict(workload, spec, machine, world, plan, optimizer_states, share)
    return pred


def _cut_bytes(plan: list[LayerPlan], graph: Any, stage: int, e: int) -> int:
    """Bytes per micro-batch a graph's stage sends on: every value live across its end, skips too."""
    end = max(i for i, r in enumerate(plan) if r.stage == stage)
    reader = next(r for r in plan if INPUT in r.inputs)
    index = graph.index()
    return sum(math.prod(reader.local_input_shape if v == INPUT else plan[index[v]].local_output_shape) * e
               for v in _plan.live_across(graph)[end])


def _predict(workload: Workload, spec: ParallelSpec, machine: Machine, world: int, plan: list[LayerPlan],
             optimizer_states: int, share: float) -> Prediction:
    """:func:`predict` with a rank's compute stretched ``share`` times by ranks sharing its core."""
    g, pl = spec.grid, spec.pipeline
    S, M, stage_size = g.pipe, pl.microbatches, g.stage_size
    e = machine.compute.dtype_bytes
    c = machine.compute
    node_ranks = min(world, machine.ranks_per_node)
    slow = machine.drift * (machine.contention if node_ranks >= 2 else 1.0) * share
    halo_link, halo_share = _link_between(machine, stage_size, world)

    layers: list[LayerCost] = []
    grads = _input_grads(plan, workload)
    for i, (rec, leaf) in enumerate(zip(plan, workload.layers)):
        out_n = math.prod(rec.local_output_shape)
        glob_out = math.prod(rec.output_shape)
        frac = out_n / glob_out if glob_out else 0.0
        in_n = math.prod(rec.local_input_shape)
        spatial = len(rec.local_input_shape) == 5
        hb, hmsg = halo_bytes(rec.local_input_shape, rec.halo, rec.split, e) \
            if spatial and rec.split != REPLICATED else (0, 0)
        ext_n = in_n + hb // e
        needs_igrad = grads[i]
        w = leaf.params
        fwd = bwd = 0.0
        f_fwd = leaf.forward * frac
        f_w = leaf.weight_grad * frac
        f_i = leaf.forward * frac if needs_igrad and leaf.op in ("conv", "linear") else 0.0
        saved = 0
        if leaf.op in ("conv", "linear"):
            cost_f = c.conv_fwd if leaf.op == "conv" else c.linear
            cost_b = c.conv_bwd if leaf.op == "conv" else c.linear
            nbytes = e * (ext_n + out_n + w)
            fwd = cost_f.time(f_fwd, nbytes)
            bwd = cost_b.time(f_i + f_w, nbytes * (2 if f_i else 1))
        elif leaf.op == "pool":
            fwd = c.pool.time(leaf.other * frac, e * (ext_n + out_n))
            bwd = c.pool.time(0.0, e * (ext_n + 2 * out_n)) if needs_igrad else 0.0
        elif leaf.op in ("pointwise", "norm"):
            k = 4 if leaf.op == "norm" else 1
            fwd = c.pointwise.time(0.0, k * 2 * e * in_n)
            bwd = c.pointwise.time(0.0, k * 3 * e * in_n) if needs_igrad else 0.0
        entry = registry.lookup(leaf.module) if leaf.module is not None else None
        if entry is not None:
            saved = entry.saved_bytes(leaf.module, e, out_n, ext_n if hb else 0)
        elif leaf.op != "free":
            saved = e * out_n
        key = layer_key(leaf.module, kernel_shape(leaf.module, rec), needs_igrad) \
            if machine.measured and leaf.op != "free" and leaf.module is not None else None
        if key in machine.measured:
            fwd, bwd = machine.measured[key]  # includes assembling the extended input
        elif leaf.window and (hb or any(a.get("pad_lo", 0) for a in entry.window_args(leaf.module))):
            fwd += c.pointwise.time(0.0, 2 * e * ext_n)   # assembling the extended input
            bwd += c.pointwise.time(0.0, 2 * e * ext_n) if needs_igrad else 0.0
        fwd *= slow
        bwd *= slow
        h_f = halo_link.time(hb / halo_share, hmsg) if hb else 0.0
        h_b = h_f if hb and needs_igrad else 0.0
        latency = hmsg * halo_link.latency * (1 + (h_b > 0))
        r_f = r_b = 0.0
        if rec.redistribute and spatial:
            prev = plan[i - 1]
            (r_f, r_b), lat = _redistribution(rec.input_shape, rec.local_input_shape, prev.split, rec.split,
                                              stage_size, e, halo_link, halo_share)
            latency += lat
        if hb and layers and layers[-1].stage == rec.stage:
            # a layer that exchanges halos saves its extended copy of the input, counted above; the
            # plain input (the layer before's output, counted there) is then kept by nobody
            layers[-1].saved_bytes = max(layers[-1].saved_bytes - e * in_n, 0)
        w_bwd = bwd * f_w / (f_i + f_w) if leaf.op in ("conv", "linear") and f_i + f_w > 0 else 0.0
        layers.append(LayerCost(rec.name, leaf.op, rec.stage, rec.split, fwd, bwd, h_f, h_b, r_f, r_b,
                                f_fwd + f_i + f_w, hb, saved, latency, w_bwd))
    # hand-over at the end of each stage (to the next stage's split, or replicated for the loss)
    graph = workload.analysis.graph
    handover: dict[int, tuple[tuple[float, float], float]] = {}
    for s in range(S):
        recs = [r for r in plan if r.stage == s]
        last = recs[-1]
        nxt = next((r for r in plan if r.stage == s + 1), None)
        target = nxt.split if nxt is not None else REPLICATED
        if not graph.chain:  # a graph's stages hand over every live value in its producer's layout
            continue
        if target != last.split and len(last.output_shape) == 5:
            micro_shape = (last.local_output_shape[0], *last.output_shape[1:])
            handover[s] = _redistribution(last.output_shape, micro_shape, last.split, target, stage_size, e,
                                          halo_link, halo_share)

    p2p_link, p2p_share = _link_between(machine, stage_size * S, world)
    stages: list[StageCost] = []
    for s in range(S):
        mine = [lc for lc in layers if lc.stage == s]
        comp = sum(lc.forward + lc.backward for lc in mine) + machine.micro_overhead
        (hf, hb_), hlat = handover.get(s, ((0.0, 0.0), 0.0))
        halo = sum(lc.halo_forward + lc.halo_backward + lc.redistribute_forward + lc.redistribute_backward
                   for lc in mine) + hf + hb_
        latency = sum(lc.latency for lc in mine) + hlat
        if pl.recompute:  # the backward runs the stage's forward again, halo exchanges included
            comp += sum(lc.forward for lc in mine)
            halo += sum(lc.halo_forward + lc.redistribute_forward for lc in mine) + hf
        send = send_lat = 0.0
        nxt = next((r for r in plan if r.stage == s + 1), None)
        if nxt is not None:
            nbytes = math.prod(nxt.local_input_shape) * e if graph.chain else _cut_bytes(plan, graph, s, e)
            send += 2 * p2p_link.time(nbytes / p2p_share)  # the activation forward, its gradient back
            send_lat = 2 * p2p_link.latency
            latency += send_lat
        params = sum(r.params for r in plan if r.stage == s)
        group = [(d * S + s) * stage_size + i for d in range(g.data) for i in range(stage_size)]
        ar_lat, ar_xfer = _allreduce_parts(params * e, group, machine, world)
        mem = _stage_memory(layers, plan, s, spec, e, optimizer_states)
        stages.append(StageCost(s, comp, halo, send, ar_lat + ar_xfer, params, mem, latency, ar_lat,
                                send_lat))

    # receives are posted ahead: once the pipeline is full a transfer's latency passes while the
    # receiving stage computes the micro-batch before; only the fill and the drain wait for it
    times = [st.time for st in stages]
    steady = [st.time - st.send_latency for st in stages]
    pipe_time = sum(times) + (M - 1) * max(steady)
    if S > 1 and not pl.recompute:
        # stages after the first defer their weight gradients: all of them where >= 2 micro-batches
        # are in flight, those of the first conv or linear layer where one is (the engine's prefix)
        backward = [sum(lc.backward + lc.halo_backward + lc.redistribute_backward for lc in layers
                        if lc.stage == s) for s in range(S)]
        weights = [0.0] * S
        for s in range(1, S):
            w = [lc.weight_backward for lc in layers if lc.stage == s and lc.weight_backward > 0]
            whole = in_flight(schedule(pl.schedule, S, M, s)) >= 2
            weights[s] = sum(w) if whole else (w[0] if w else 0.0)
        pipe_time -= drain_saving(backward, weights, [stages[s - 1].send / 2 for s in range(1, S)])
    crit = max(range(S), key=lambda s: steady[s])
    # exposed gradient reduction: a stage's all-reduce starts after its last backward and hides under
    # ``grad_overlap`` of that backward plus the drain of the stages before it (stage 0 finishes last)
    exposed = 0.0
    for s, st in enumerate(stages):
        last_bwd = sum(lc.backward for lc in layers if lc.stage == s)
        drain = sum(sum(lc.backward + lc.halo_backward for lc in layers if lc.stage == k) for k in range(s))
        exposed = max(exposed, st.grad_reduce - machine.grad_overlap * last_bwd - drain)
    exposed = max(exposed, 0.0)
    # optimizer step (memory-bound, 4 passes over params) and slicing the rank's input shard
    crit_params = max(st.params for st in stages)
    own = c.pointwise.time(0.0, 4 * e * crit_params) + machine.step_overhead
    # the global loss leaves the last stage after its last forward (its replica average overlaps the
    # backward); the other stages average what they received over the replicas at the step's end
    replicas = [d * S * stage_size for d in range(g.data)]
    other = own + (allreduce_time(8, replicas, machine, world) if S > 1 and g.data > 1 else 0.0)
    first_in = math.prod(plan[0].local_input_shape) * M * e
    data_wait = c.pointwise.time(0.0, 2 * first_in)
    compute = M * stages[crit].compute
    halo = M * stages[crit].halo
    breakdown = {"compute": compute, "halo": halo, "pipeline": pipe_time - compute - halo,
                 "grad_reduce": exposed, "data_wait": data_wait, "other": other}
    step = sum(breakdown.values())
    oversubscribed = False
    if machine.cores is not None and node_ranks > machine.cores:
        # every rank is busy for its own compute and communication; the node's cores share them
        # (latencies are waits, not work: they do not occupy a core; and a rank's compute is work
        # of its own length, not of the length it takes on its share of a core)
        busy = 0.0
        for s, st in enumerate(stages):
            ranks = g.data * stage_size
            ar_xfer = st.grad_reduce - st.grad_reduce_latency
            work = st.time - st.latency - st.compute * (1 - 1 / share)
            busy += ranks * (M * work + ar_xfer + own + (data_wait if s == 0 else 0.0))
        floor = busy * min(node_ranks, world) / world / machine.cores
        if floor > step:
            oversubscribed = True
            breakdown["other"] += floor - step
            step = floor
    memory = max((st.memory for st in stages), key=lambda m: m["total"])
    return Prediction(spec, machine.name, world, workload.batch, step, breakdown, memory,
                      workload.total_flops, stages, layers, bubble_fraction(S, M), oversubscribed)


def drain_saving(backward: Sequence[float], weights: Sequence[float], transfers: Sequence[float]) -> float:
    """Time the drain saves when stages send their input gradient before their weight gradients.

    ``backward[s]``: stage s's backward of one micro-batch; ``weights[s]``: the part of it that
    waits (0 where the stage does not split); ``transfers[s - 1]``: the gradient's trip from stage s
    to s - 1. Without the split the drain is every backward and transfer in a chain; with it the
    chain runs the input parts only and each stage's weight part beside the rest of the chain, so
    it ends when the slower of (the chain down to stage 0) and (the chain down to stage s, then
    s's weights) does.
    """
    S = len(backward)
    whole = sum(backward) + sum(transfers)
    chain = [b - w for b, w in zip(backward, weights)]
    ends = [sum(chain[s:]) + sum(transfers[s:]) + weights[s] for s in range(S)]
    return max(whole - max(ends), 0.0)


def _redistribution(shape: Sequence[int], local_shape: Sequence[int], src: Split, dst: Split, stage: int,
                    e: int, link: Link, share: float) -> tuple[tuple[float, float], float]:
    """Forward and backward seconds of moving one micro-batch's activation from ``src`` to ``dst``,
    and the latencies among them."""
    nc = local_shape[0] * shape[1]
    sp = tuple(shape[2:])
    vox, msgs = _redistribute_volume(sp, src, dst, stage)  # type: ignore[arg-type]
    back, bmsgs = _redistribute_volume(sp, dst, src, stage)  # type: ignore[arg-type]
    times = (link.time(vox * nc * e / share, msgs), link.time(back * nc * e / share, bmsgs))
    return times, (msgs + bmsgs) * link.latency
