"""``parallelize(model, "auto", ...)``: the layout the advisor predicts fastest, on this job.

Why: a user should not have to know how data, pipeline and spatial parallelism trade off to run a
model on W ranks. :mod:`hybridpar.advisor` already enumerates every layout and ranks them with the
performance model; here it runs on the job itself, on its world size, its device memory and this
machine's calibration, and the choice becomes the spec, printed (with the runners-up) and, where
asked, written as YAML that any later run can load.

The first rank chooses and the others read its choice (through the default group's store, as text:
a spec is data), so every rank builds the same layout even where their calibrations or free memory
differ. A model the advisor cannot size (its forward must be traceable: the performance model reads
the traced graph), or no layout that fits, is refused in one line on every rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from itertools import count
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from hybridpar import perfmodel as pm
from hybridpar.advisor import Advice, advise, format_advice, spec_yaml
from hybridpar.comm.store import default_store
from hybridpar.grid import require_group
from hybridpar.planner import ParallelSpec
from hybridpar.planner.terms import SpecError

PRESET_OF = {"H100": "h100", "H200": "h100", "V100": "v100"}
"""CUDA device names whose preset stands in where this machine has no calibration of its own."""
_CALLS = count()


def machine_here(device: torch.device) -> pm.Machine:
    """This machine's calibration (``python -m perf harness --calibrate-only`` writes it), or, on a GPU
    the presets know, its preset. A CPU without a calibration has no figures to rank layouts by."""
    try:
        return pm.load_machine()
    except FileNotFoundError as err:
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            preset = next((p for key, p in PRESET_OF.items() if key in name), None)
            if preset is not None:
                return pm.get_machine(preset)
        raise SpecError(f"parallelize(model, 'auto'): {err}") from None


def memory_per_rank(device: torch.device, machine: pm.Machine, world: int) -> float:
    """Bytes one rank may use: the GPU's memory, or this host's shared by the ranks on it."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return machine.memory / max(1, min(local, world))


def _device(model: nn.Module) -> torch.device:
    p = next(iter(model.parameters()), None)
    return p.device if p is not None else torch.device("cpu")


def _choose(model: nn.Module, input_shape: Sequence[int], world: int) -> Advice:
    device = _device(model)
    machine = machine_here(device)
    return advise(model, tuple(input_shape), world, memory_per_rank(device, machine, world), machine)


def auto_spec(model: nn.Module, input_shape: Sequence[int] | None, out: str | Path | None = None,
              echo: bool = True) -> ParallelSpec:
    """The spec the advisor chooses for ``model`` on a global input of ``input_shape`` (N, C, D, H, W) on
    this job's ranks: chosen on the first rank, the same on every rank. ``echo``: the first rank prints
    the ranked layouts and the choice. ``out``: the first rank writes the chosen spec there as YAML
    (a file already there is not replaced)."""
    if input_shape is None or len(input_shape) != 5:
        raise SpecError(f"parallelize(model, 'auto'): needs input_shape=(N, C, D, H, W), the global batch "
                        f"it will train on, to choose a layout; got {input_shape!r}")
    require_group("parallelize")
    world, rank = dist.get_world_size(), dist.get_rank()
    key = f"hybridpar/auto_spec/{next(_CALLS)}"
    if rank == 0:
        try:
            if out is not None and Path(out).exists():  # before the choice, which takes a while
                raise _taken(Path(out))
            advice = _choose(model, input_shape, world)
            text = spec_yaml(advice)
            if out is not None:
                _write(Path(out), text)
            if echo:
                print(format_advice(advice, top=3), flush=True)
        except Exception as err:  # noqa: BLE001 (said on every rank: the others wait for this text)
            text = f"error: {err}"
        if world > 1:
            default_store().set(key, text)
    else:
        text = default_store().get(key).decode()
    if text.startswith("error: "):
        raise SpecError(text.removeprefix("error: "))
    return ParallelSpec.from_yaml(text, source="the advisor's choice")


def _write(path: Path, text: str) -> None:
    """Write the chosen spec, never over a file that is there."""
    try:
        with path.open("x") as f:
            f.write(text)
    except FileExistsError:
        raise _taken(path) from None


def _taken(path: Path) -> SpecError:
    return SpecError(f"parallelize(model, 'auto', spec_out={str(path)!r}): {path} exists; the chosen spec is "
                     f"not written over it (name a new file, or load that one)")
