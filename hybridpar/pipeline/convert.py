"""Turn an ordinary torch layer into its spatially distributed counterpart, weights included.

Why: users write ordinary models; the spec says per layer how it is split. The layer registry
(:mod:`hybridpar.nn.registry`) builds the Dist class from the torch layer's own constructor arguments
(so they agree by construction); this module then loads the torch layer's state (so weights and
running statistics carry over). Layers that work voxel by voxel run as copies on their shard.
"""

from __future__ import annotations

import copy

from torch import nn

from hybridpar.comm.reduce import mark_grad_split
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry


def to_distributed(m: nn.Module, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    """The Dist counterpart of ``m`` under ``grid``'s split, or a copy of ``m`` if it is pointwise.

    A copied layer with parameters on a split input computes partial gradients on each shard: its
    parameters are marked so that the engine's reduction sums them over the shards.
    """
    entry = registry.lookup(m)
    if entry is None or entry.to_dist is None:
        d = copy.deepcopy(m)
        if grid.spatial_size > 1 and entry is not None and entry.role == "pointwise":
            mark_grad_split(d.parameters(), grid.spatial_size)
        return d
    d = entry.to_dist(m, grid, overlap)
    ref = next((t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()), None)
    if ref is not None:
        d = d.to(dtype=ref.dtype, device=ref.device)
    d.load_state_dict(m.state_dict())
    d.train(m.training)
    return d
