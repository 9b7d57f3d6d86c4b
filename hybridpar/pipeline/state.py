"""A pipelined model's state dict under the original model's keys, whatever the layout.

Why: a checkpoint must load into any layout (another pipeline cut, another split), so it is kept in
the original model's terms: each stage holds the entries of its own layers (split layers hold whole
weights: only activations are split), and the whole is their union in the original key order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.grid import ProcessGrid

Layers = list[tuple[str | None, nn.Module]]  # as pipeline.stage.Layers


def local_state(layers: Layers) -> dict[str, torch.Tensor]:
    """This stage's entries (a layer named None is one the original model does not have)."""
    return {f"{name}.{k}" if name else k: v for name, m in layers if name is not None
            for k, v in m.state_dict().items()}


def full_state(layers: Layers, grid: ProcessGrid, keys: list[str]) -> dict[str, torch.Tensor]:
    """Every stage's entries, gathered over the pipeline (on CPU), in the original model's ``keys``."""
    local = {k: v.detach().cpu().clone() for k, v in local_state(layers).items()}
    parts = [local]
    if grid.pipe > 1:
        parts = [None] * grid.pipe
        dist.all_gather_object(parts, local, group=grid.pipe_group)
    merged = {k: v for p in parts for k, v in p.items()}
    return {k: merged[k] for k in keys if k in merged}


def load_state(layers: Layers, state: dict[str, torch.Tensor]) -> None:
    """Load the original model's entries into this stage's layers."""
    for name, m in layers:
        if name is None:
            continue
        prefix = f"{name}." if name else ""
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not name:  # a graph stage holds only its own stage's layers
            sub = {k: v for k, v in sub.items() if k in m.state_dict()}
        m.load_state_dict(sub)
