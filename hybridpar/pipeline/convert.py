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
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.window import describe


def to_distributed(m: nn.Module, grid: ProcessGrid, overlap: bool = False, name: str | None = None
                   ) -> nn.Module:
    """The Dist counterpart of ``m`` (the model's layer ``name``) under ``grid``'s split, or a copy of
    ``m`` if it is pointwise.

    A copied layer with parameters on a split input computes partial gradients on each shard: its
    parameters are marked so that the engine's reduction sums them over the shards. A window layer's
    Dist counterpart must run the window its entry gives for ``m`` (:func:`check_window`).
    """
    entry = registry.lookup(m)
    if entry is None or entry.to_dist is None:
        d = sharing_copy(m)
        if grid.spatial_size > 1 and entry is not None and entry.role == "pointwise":
            mark_grad_split(d.parameters(), grid.spatial_size)
        return d
    d = entry.to_dist(m, grid, overlap)
    registry.note_split(d, entry)
    check_window(entry, m, d, name)
    ref = next((t for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()), None)
    if ref is not None:  # floating tensors only: a complex one cast to a real dtype loses its imaginary part
        d = d.to(device=ref.device)._apply(lambda t: t.to(ref.dtype) if t.is_floating_point() else t)
    share_state(m, d)
    for s in d.modules():  # parameters a Dist layer made after init_spatial, or kept in plain submodules
        if isinstance(s, SpatialLayer):
            s.mark_split_params()
    d.train(m.training)
    return d


def check_window(entry: registry.LayerEntry, m: nn.Module, d: nn.Module, name: str | None = None) -> None:
    """Refuse a window layer's Dist counterpart ``d`` unless it runs the window the entry gives for
    ``m``: the planner, ``explain``, the FLOP counter and the performance model read the entry's, the
    Dist layer exchanges the halos of its own (:meth:`SpatialLayer.window`), and where they differ
    the plan is wrong while the numbers may still come out (a 5³ filter given a 3³ window)."""
    if entry.role not in ("window", "transposed"):
        return
    want = entry.windows_of(m)
    what = f"{name} ({type(m).__name__})" if name else type(m).__name__
    if not isinstance(d, SpatialLayer):
        raise TypeError(f"{what}: the registry's to_dist gave a {type(d).__name__}, not a hybridpar.nn."
                        "SpatialLayer, so nothing ties its halos to the entry's window; subclass "
                        "hybridpar.nn.SpatialLayer and the registered layer")
    got = d.window()
    if tuple(got) != tuple(want):
        raise ValueError(f"{what}: the registry entry gives the window {describe(want)}, but its Dist layer "
                         f"{type(d).__name__} runs {describe(got)}; build the Dist layer from the module's "
                         "own hyperparameters in to_dist, or make window= describe what the layer computes")

