"""Turn an ordinary torch layer into its spatially distributed counterpart, weights included.

Why: users write ordinary models; the spec says per layer how it is split. The layer registry
(:mod:`hybridpar.nn.registry`) builds the Dist class from the torch layer's own constructor arguments
(so they agree by construction); this module then hands it the torch layer's own parameters and
buffers (the same tensors, not copies), as FSDP2's ``fully_shard`` keeps the user's: an optimizer
built on ``model.parameters()`` trains what the engine runs, and ``model.state_dict()`` is current
after training (:mod:`hybridpar.nn.sharing`). Layers that work voxel by voxel run as copies of the module
sharing those tensors.
"""

from __future__ import annotations

from torch import nn

from hybridpar.comm.reduce import mark_grad_split
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.sharing import share_state, sharing_copy


def to_distributed(m: nn.Module, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    """The Dist counterpart of ``m`` under ``grid``'s split, or a copy of ``m`` if it is pointwise.

    A copied layer with parameters on a split input computes partial gradients on each shard: its
    parameters are marked so that the engine's reduction sums them over the shards.
    """
    entry = registry.lookup(m)
    if entry is None or entry.to_dist is None:
        d = sharing_copy(m)
        if grid.spatial_size > 1 and entry is not None and entry.role == "pointwise":
            mark_grad_split(d.parameters(), grid.spatial_size)
        return d
    d = entry.to_dist(m, grid, overlap)
    ref = next((t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()), None)
    if ref is not None:  # floating tensors only: a complex one cast to a real dtype loses its imaginary part
        d = d.to(device=ref.device)._apply(lambda t: t.to(ref.dtype) if t.is_floating_point() else t)
    share_state(m, d)
    d.train(m.training)
    return d
