"""Module swapping: a model whose forward torch.fx cannot trace, run on shards by its own forward.

Why: a forward may branch or loop in Python (on a config flag, a list of blocks, a shape) in ways
torch.fx refuses, yet every tensor operation in it is one a split volume supports: registered layers
and elementwise arithmetic. Without a pipeline nothing needs the graph: each registered layer is
swapped in place for its split counterpart (a copy of the model, weights loaded), every layer runs
under the grid's split, and the model's own forward runs on this rank's shard. A ``Flatten`` gathers
its split input first (the dense head then runs replicated, as after a planned gather).

A layer whose input is replicated (what a whole-volume pooling and the layers after it compute: a
squeeze-and-excitation gate) runs whole on it; where the forward multiplies such a gate into split
features, the layouts are followed at run time (:func:`follow_gates`) so that the gate's gradient is
the sum of every shard's part.

What it cannot do: cut the model into pipeline stages (that needs the data flow), or let one layer run
under another split. Python code that reads a split tensor's spatial shape sees the shard's: the plan
refuses the model where what it computes from them would differ from the volume's
(:mod:`hybridpar.planner.shard_rehearsal`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hybridpar.comm.reduce import replicated_into_shards
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.layout import Gather
from hybridpar.nn.sharing import sharing_copy
from hybridpar.planner.swapped import LayoutWatch, leaves

Convert = Callable[[str, nn.Module, ProcessGrid], nn.Module]


def _has_params(m: nn.Module) -> bool:
    """Whether a leaf holds parameters (its children's too: a registered container runs as one layer)."""
    return next(m.parameters(), None) is not None


class _Gates(LayoutWatch):
    """The forward's layouts followed at run time: a replicated gate read by a split computation
    goes in through :func:`replicated_into_shards`, so that its gradient is the sum of the shards'."""

    def __init__(self, split: tuple[int, int, int], group) -> None:
        super().__init__(split)
        self.group = group

    def into_shards(self, t: torch.Tensor) -> torch.Tensor:
        return replicated_into_shards(t, self.group)

    def _reshaped(self, name: str, args: tuple, kwargs: dict, src: torch.Tensor, out: object) -> None:
        """A reshape of a split volume (the plan accepted it on the global shapes; here the shapes are
        the shard's): a volume again is split."""
        if isinstance(out, torch.Tensor):
            if out.dim() == 5:
                self.mark(out)
            else:
                self.chains[out] = ()


def follow_gates(swapped: nn.Module, grid: ProcessGrid) -> None:
    """Make ``swapped`` (:func:`swap`'s) follow its forward's layouts under ``grid``'s split where it
    multiplies a replicated gate into split features (the plan found such calls:
    :func:`hybridpar.planner.swapped.swapped_gates`); only then, since following costs every call."""
    watch = _Gates(grid.spatial_shape, grid.spatial_group if grid.spatial_size > 1 else None)
    watch.hook([m for _, m in leaves(swapped)])

    def start(m: nn.Module, args: tuple) -> None:
        watch.reset()
        watch.__enter__()

    def stop(m: nn.Module, args: tuple, out: object) -> None:
        watch.__exit__(None, None, None)
        watch.reset()

    swapped.register_forward_pre_hook(start)
    swapped.register_forward_hook(stop, always_call=True)


def swap(model: nn.Module, grid: ProcessGrid, convert: Convert) -> nn.Module:
    """A copy of ``model`` (sharing its parameters and buffers) whose registered layers are their split
    counterparts under ``grid`` (``convert(name, module, grid)``), a ``Flatten`` gathering its split
    input first."""
    swapped = sharing_copy(model)
    for name, m in leaves(swapped):
        entry = registry.lookup(m)
        if entry is not None and entry.extra.get("flattens"):
            new: nn.Module = nn.Sequential(Gather(grid), m) if grid.spatial_size > 1 else m
        elif entry is not None and (entry.to_dist is not None or _has_params(m)):
            new = convert(name, m, grid)  # a copy whose parameters' shard gradients are summed
        else:
            continue
        parent, _, leaf = name.rpartition(".")
        (swapped.get_submodule(parent) if parent else swapped).register_module(leaf, new)
    return swapped
