"""What the performance model knows about a machine: per-op-class compute costs and alpha-beta links.

Why a module of its own: a machine is data (presets for clusters we do not have, a calibration
saved as JSON for this host), apart from how it is measured (:mod:`.calibrate`) and how it is used
(:mod:`.predict`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Compute", "Cost", "Link", "Machine", "PRESETS", "default_cache", "get_machine", "json_safe",
           "load_machine", "save_machine"]

GB = 1e9


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
        return json_safe(dataclasses.asdict(self))

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



def json_safe(x: Any) -> Any:
    """``x`` with infinite floats as the strings ``"inf"`` / ``"-inf"`` (strict JSON lacks them)."""
    if isinstance(x, float) and math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x


@dataclass(frozen=True)
class _Accelerator:
    """A datasheet and the share of it a 3D CNN achieves (see each family's sources)."""

    flops: float
    fraction: float
    hbm: float
    overhead: float
    dtype_bytes: int
    memory: float
    intra: Link
    inter: Link
    sources: str
    mem_fraction: float = 0.8

    def machine(self, name: str, description: str, per_node: int) -> Machine:
        conv = Cost(self.flops * self.fraction, self.hbm * self.mem_fraction, self.overhead)
        mem = Cost(math.inf, self.hbm * self.mem_fraction, self.overhead)
        return Machine(name, description, Compute(conv, conv, conv, mem, mem, self.dtype_bytes), self.intra,
                       self.inter, per_node, self.memory, None, 1.0, 1.0, 5e-4, 5e-5, self.sources)


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
_V100 = _Accelerator(15.7e12, 0.5, 900 * GB, 10e-6, 4, 16 * 2**30, Link(5e-6, 50 * GB), Link(5e-6, 25 * GB),
                     _V100_SRC)
_H100 = _Accelerator(989e12, 0.35, 3350 * GB, 5e-6, 2, 80 * 2**30, Link(3e-6, 450 * GB), Link(5e-6, 400 * GB),
                     _H100_SRC)

PRESETS: dict[str, Machine] = {
    "v100": _V100.machine("v100", "4 x V100-16GB per node (Lassen-like), fp32, NVLink2 + dual-rail EDR", 4),
    "v100-fp16": dataclasses.replace(_V100, flops=125e12, fraction=0.3, dtype_bytes=2).machine(
        "v100-fp16", "4 x V100-16GB per node (Lassen-like), fp16 tensor cores", 4),
    "summit": _V100.machine("summit", "6 x V100-16GB per node (Summit), fp32, NVLink2 + dual-rail EDR", 6),
    "h100": _H100.machine("h100", "8 x H100-80GB per node (DGX H100-like), bf16, NVLink4 + NDR", 8),
    "h100-fp32": dataclasses.replace(_H100, flops=67e12, fraction=0.5, dtype_bytes=4).machine(
        "h100-fp32", "8 x H100-80GB per node (DGX H100-like), fp32, NVLink4 + NDR", 8),
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
    record = {"machine": machine.to_dict(), **json_safe(dict(extra or {}))}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def load_machine(path: str | os.PathLike | None = None) -> Machine:
    """A machine saved by :func:`save_machine` (default: this host's calibration cache)."""
    path = Path(path) if path is not None else default_cache()
    if not path.is_file():
        raise FileNotFoundError(
            f"no calibration at {path}; measure this machine once with `python -m perf harness "
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
