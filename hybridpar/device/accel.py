"""How a training step runs on its device: precision, memory format, compilation, CUDA graphs.

Why one object: the choices interact, and a training loop should not carry their cases. fp16 needs a
gradient scaler whose skip-or-step decision must agree over every rank (pipeline stages hold
different parameters, so one stage's overflow is not another's: ``ShardedGradScaler`` all-reduces
it); bf16 needs none. ``channels_last_3d`` is a property of the activations the engine hands out.
``compile`` compiles each stage's layers in place (state-dict keys unchanged; communication runs
eagerly between the graphs). ``cuda_graphs`` replays the whole captured step
(:mod:`hybridpar.device.cuda_graphs`), which needs CUDA and NCCL; asking for it elsewhere is an error when
the configuration is checked, not a silent fallback.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Accel:
    """``precision``: fp32 | bf16 | fp16 (autocast, float32 weights); ``channels_last``: NDHWC
    activations; ``compile``: torch.compile the layers (``compile_options`` passed on);
    ``cuda_graphs``: capture the step in a CUDA graph."""

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    channels_last: bool = False
    compile: bool = False
    cuda_graphs: bool = False
    compile_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        problem = check(self.precision, self.cuda_graphs, self.device)
        if problem:
            raise ValueError(problem)
        self.scaler: Any = None
        self.graphed: Any = None

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast dtype (None: float32 throughout)."""
        return PRECISIONS[self.precision]

    @property
    def memory_format(self) -> torch.memory_format:
        return torch.channels_last_3d if self.channels_last else torch.contiguous_format

    def autocast(self) -> contextlib.AbstractContextManager:
        """Autocast on the model's device type in the chosen dtype (nothing for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def prepare(self, engine: Any) -> None:
        """Compile the engine's layers, make the fp16 scaler, arm CUDA-graph capture."""
        if self.compile:
            engine.compile(**self.compile_options)
        if self.precision == "fp16":
            if dist.is_initialized() and dist.get_world_size() > 1:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415

                self.scaler = ShardedGradScaler(self.device.type, process_group=dist.group.WORLD)
            else:
                self.scaler = torch.amp.GradScaler(self.device.type)
        if self.cuda_graphs:
            from hybridpar.device.cuda_graphs import GraphedStep  # noqa: PLC0415

            self.graphed = GraphedStep(engine, self.autocast)

    def step(self, engine: Any, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One training step: forward and backward (under autocast, scaled for fp16), optimizer step,
        gradients cleared. Returns the unscaled mean loss as a device tensor (no host sync here; the
        fp16 scaler's overflow check is one, deliberate)."""
        scale = None
        if self.scaler is not None:  # the scale as a device tensor: scaler.scale(1)
            scale = self.scaler.scale(torch.ones((), device=self.device))
        if self.graphed is not None:
            loss = self.graphed(x, y, scale)
        else:
            with self.autocast():
                loss = engine.train_step(x, y, loss_scale=scale)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        # a captured step writes its gradients into the .grad tensors it was captured with
        opt.zero_grad(set_to_none=self.graphed is None)
        return loss


def check(precision: str, cuda_graphs: bool, device: torch.device | str | None = None) -> str | None:
    """What is wrong with these settings here (one line), or None."""
    if precision not in PRECISIONS:
        return f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}"
    cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if cuda_graphs and not cuda:
        return ("cuda_graphs: true captures the training step in a CUDA graph and needs a CUDA device; "
                "this run has none (set cuda_graphs: false)")
    return None
