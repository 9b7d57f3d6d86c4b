"""Predicting with an engine: the last stage's outputs of an inference pass, whole or left split,
handed to every stage.

Why a part of its own: training ends in a loss every rank already agrees on; inference ends in
volumes, which the user wants whole on every rank (``gather=True``) or, for a box too big for one
rank, left split exactly as ``shard_batch`` lays out a target (``gather=False``). What goes where is
this module's business; running the forwards is the stepping part's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_unflatten

from hybridpar.comm.redistribute import gather as gather_volume
from hybridpar.pipeline.building import Built
from hybridpar.pipeline.stage import REPLICATED


def outputs(built: Built, outs: list[list[Any]], batch: int, gather: bool, dtype: torch.dtype,
            device: torch.device) -> Any:
    """The model's outputs, in the structure it returns them in, from ``outs`` (the last stage's
    outputs of each micro-batch, flattened; empty on other stages): on the last stage, the
    micro-batches joined and split volumes gathered where ``gather``; on the other stages, received
    from the last one, except split volumes left split (those stages hold None in their place)."""
    grid, stage = built.layout.grid, built.stage
    last = grid.pipe_index == grid.pipe - 1
    ys = []
    for k, rec in enumerate(stage.outputs):
        split = stage.output_split != REPLICATED and len(rec.output_shape) == 5
        if last:
            y = torch.cat([leaves[k] for leaves in outs])
            if split and gather:  # whole volumes
                y = gather_volume(y, built.layout.of(stage.output_split), tuple(rec.output_shape[2:]))
        elif split and not gather:
            y = None  # the last stage holds the shards
        else:
            y = torch.empty((batch, *rec.output_shape[1:]), dtype=dtype, device=device)
        if grid.pipe > 1 and (gather or not split):
            dist.broadcast(y, built.transport.peer(grid.pipe - 1), group=grid.pipe_group)
        ys.append(y)
    return ys[0] if stage.output_spec is None else tree_unflatten(ys, stage.output_spec)
