"""Module swapping: a model whose forward torch.fx cannot trace, run on shards by its own forward.

Why: a forward may branch or loop in Python (on a config flag, a list of blocks, a shape) in ways
torch.fx refuses, yet every tensor operation in it is one a split volume supports: registered layers
and elementwise arithmetic. Without a pipeline nothing needs the graph: each registered layer is
swapped in place for its split counterpart (a copy of the model, weights loaded), every layer runs
under the grid's split, and the model's own forward runs on this rank's shard. A ``Flatten`` gathers
its split input first (the dense head then runs replicated, as after a planned gather).

A layer whose input is replicated (what a whole-volume pooling and the layers after it compute: a
squeeze-and-excitation gate) runs whole on it. The Python between the layers runs as on the volume:
:mod:`hybridpar.pipeline.split_forward` follows the forward's calls (shape reads answer global
extents, ``F.interpolate`` runs split, a reduction gives the volume's value).

What it cannot do: cut the model into pipeline stages (that needs the data flow), or let one layer run
under another split.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.layout import Gather
from hybridpar.nn.sharing import sharing_copy
from hybridpar.planner.swapped import leaves

Convert = Callable[[str, nn.Module, ProcessGrid], nn.Module]


def _has_params(m: nn.Module) -> bool:
    """Whether a leaf holds parameters (its children's too: a registered container runs as one layer)."""
    return next(m.parameters(), None) is not None


def swap(model: nn.Module, grid: ProcessGrid, convert: Convert
         ) -> tuple[nn.Module, dict[nn.Module, nn.Module]]:
    """A copy of ``model`` (sharing its parameters and buffers) whose registered layers are their split
    counterparts under ``grid`` (``convert(name, module, grid)``), a ``Flatten`` gathering its split
    input first; and per swapped layer, the layer it stands for (which computes on the volume)."""
    swapped = sharing_copy(model)
    whole: dict[nn.Module, nn.Module] = {}
    for name, m in leaves(swapped):
        entry = registry.lookup(m)
        if entry is not None and entry.flattens:
            new: nn.Module = nn.Sequential(Gather(grid), m) if grid.spatial_size > 1 else m
        elif entry is not None and (entry.to_dist is not None or _has_params(m)):
            new = convert(name, m, grid)  # a copy whose parameters' shard gradients are summed
        else:
            continue
        for parent, slot in _slots(swapped, m):
            parent.register_module(slot, new)
        whole[new] = m
    return swapped, whole


def _slots(model: nn.Module, m: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, attribute) that holds ``m``: a module listed under several names
    (``nn.ModuleList([block] * 3)``, ``self.b = self.a``) is walked once, under its first, and must
    be swapped in each (the others ran unsplit on the shards, without halos)."""
    return [(parent, key) for _, parent in model.named_modules(remove_duplicate=False)
            for key, child in parent._modules.items() if child is m]
