"""A loss that does not split over the output's shards, evaluated on the whole output, gathered.

Why: the engine evaluates ``loss_fn`` on each rank's output shard and combines the values, which is
the whole output's loss only for a mean or a sum over voxels. Dice, class-weighted cross entropy, an
``ignore_index``, a masked mean, Pearson, differences across a split dim: none is any combination of
its parts. Each is exact on the whole volume, so where the check
(:mod:`hybridpar.pipeline.loss_check`) finds the shards' parts do not combine, the engine gathers the
output and the target on each rank that shares them and evaluates ``loss_fn`` there.

How the gradient stays exact: each of the ``R`` ranks that share an output evaluates the same whole
loss ``L`` and weighs it ``1 / R`` (the ranks' values then sum to ``L``, as the shards' shares do). The
gather's backward hands each rank its box of the gradient it is given (a replicated tensor counts
once: :mod:`hybridpar.comm.redistribute`), so :class:`_Shared` multiplies that gradient by ``R`` on
the way: the shard's gradient is its box of ``dL/d output``, as in one process. A term the loss adds
from the model's parameters is weighed ``1 / R`` on each rank and summed over them
(:mod:`hybridpar.pipeline.loss_params`): once. The cost is the whole output and target on each rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from hybridpar.comm.redistribute import gather
from hybridpar.grid import ProcessGrid


class _Shared(torch.autograd.Function):
    """The tensor itself forward; its gradient times ``ranks`` backward (see module doc)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, ranks: int) -> torch.Tensor:
        ctx.ranks = ranks
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g * ctx.ranks, None


def _volume(t: Any, box: tuple[int, ...]) -> bool:
    """A split volume of the output's shard extent: N, C, D, H, W, or N, D, H, W (class indices)."""
    return isinstance(t, torch.Tensor) and t.dim() in (4, 5) and tuple(t.shape[-3:]) == box


def shard_box(out: Any) -> tuple[int, ...]:
    """The (D, H, W) of this rank's output shard: its first volume's."""
    return tuple(next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5).shape[2:])


def gathered(out: Any, y: Any, grid: ProcessGrid, volume: tuple[int, int, int]) -> tuple[Any, Any]:
    """``out`` and ``y`` with every split volume of this rank's output extent gathered whole over
    ``grid``'s spatial group (of global ``volume``), the output's gradient counted once per rank that
    shares it (:class:`_Shared`). Every rank of the group calls this with the same structure."""
    box, ranks = shard_box(out), grid.spatial_size
    whole = tree_map(lambda t: _Shared.apply(gather(t, grid, volume), ranks) if _volume(t, box) else t, out)
    return whole, target(y, box, grid, volume)


def target(y: Any, box: tuple[int, ...], grid: ProcessGrid, volume: tuple[int, int, int]) -> Any:
    """``y`` gathered whole where it is a split volume of extent ``box`` (no gradient)."""
    return tree_map(lambda t: gather(t.detach(), grid, volume) if _volume(t, box) else t, y)


def mebibytes(out: Any, y: Any) -> float:
    """MiB the whole output and target take on each rank."""
    leaves = [t for t in tree_leaves((out, y)) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in leaves) / 2**20
