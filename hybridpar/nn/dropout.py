"""Random element-wise layers on a split volume: dropout, and RReLU's drawn slopes, each shard given its
box of what one process draws for the whole volume.

Why: a dropout copied onto the shards draws a mask per shard, and the ranks of a split share one random
stream (they are seeded alike, so that replicated layers agree): every shard drew the same mask, the
pattern repeating with the shard's period, and the gradients were not one process's. Here every rank
draws the mask of the whole volume as one process draws it (``F.dropout`` of ones of the whole shape,
the same draws from the same stream) and keeps its box: the answer is one process's, and the stream
is left where one process leaves it. The cost is one whole-volume mask per call while training.
Channel-wise dropout (``nn.Dropout3d``: one draw per sample and channel) is the same on every shard
and runs as a copy. Alpha dropout has no such mask and is refused on a split volume while training.
RReLU draws a slope for each element its input has below zero (on a CPU), so the draws depend on the
whole input: while training it runs on the gathered volume, alike on every rank, each keeping its box.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.redistribute import gather, local_box
from hybridpar.grid import ProcessGrid
from hybridpar.nn import formulas, registry
from hybridpar.nn.spatial import SpatialLayer


class DistDropout(SpatialLayer, nn.Dropout):
    """``torch.nn.Dropout`` on a spatially split input: one process's mask, this shard's box of it."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, grid: ProcessGrid | None = None) -> None:
        nn.Dropout.__init__(self, p, inplace)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0 or self.grid.spatial_size == 1 or x.dim() != 5:
            return F.dropout(x, self.p, self.training, self.inplace)
        shape = self.global_shape(x)
        mask = F.dropout(torch.ones((*x.shape[:2], *shape), dtype=x.dtype, device=x.device), self.p, True)
        mine = _mine(mask, shape, self.grid)
        return x.mul_(mine) if self.inplace else x * mine


class DistAlphaDropout(SpatialLayer, nn.AlphaDropout):
    """``torch.nn.AlphaDropout`` on a split input: refused while training (see module doc)."""

    def __init__(self, p: float = 0.5, inplace: bool = False, *, grid: ProcessGrid | None = None) -> None:
        nn.AlphaDropout.__init__(self, p, inplace)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.p > 0 and self.grid.spatial_size > 1:
            raise ValueError(f"{self.layer_name}: alpha dropout on a split volume would draw one mask per "
                             f"shard, not the whole volume's; use nn.Dropout or nn.Dropout3d there, or run "
                             f"the layer whole (spatial: replicate)")
        return F.alpha_dropout(x, self.p, self.training, self.inplace)


class DistRReLU(SpatialLayer, nn.RReLU):
    """``torch.nn.RReLU`` on a spatially split input: while training, one process's slopes (see module
    doc), this shard's box of its output; in evaluation the fixed mean slope, on the shard."""

    def __init__(self, lower: float = 1 / 8, upper: float = 1 / 3, inplace: bool = False, *,
                 grid: ProcessGrid | None = None) -> None:
        nn.RReLU.__init__(self, lower, upper, inplace)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.grid.spatial_size == 1 or x.dim() != 5:
            return F.rrelu(x, self.lower, self.upper, self.training, self.inplace)
        shape = self.global_shape(x)
        whole = F.rrelu(gather(x, self.grid, shape), self.lower, self.upper, True)
        mine = _mine(whole, shape, self.grid)
        return x.copy_(mine) if self.inplace else mine


def _mine(whole: torch.Tensor, shape: tuple[int, int, int], grid: ProcessGrid) -> torch.Tensor:
    """This rank's box of a value every rank drew whole (a slice: its gradient stays this shard's)."""
    return whole[(Ellipsis, *(slice(lo, hi) for lo, hi in local_box(shape, grid)))]


def _dropout(m: nn.Dropout, grid: ProcessGrid, overlap: bool = False) -> DistDropout:
    return DistDropout(m.p, m.inplace, grid=grid)


def _rrelu(m: nn.RReLU, grid: ProcessGrid, overlap: bool = False) -> DistRReLU:
    return DistRReLU(m.lower, m.upper, m.inplace, grid=grid)


def _alpha_dropout(m: nn.AlphaDropout, grid: ProcessGrid, overlap: bool = False) -> DistAlphaDropout:
    return DistAlphaDropout(m.p, m.inplace, grid=grid)


registry.register(nn.Dropout, role="pointwise", op="pointwise", flops=formulas.elementwise_flops,
                  to_dist=_dropout)
registry.register(nn.RReLU, role="pointwise", op="pointwise", flops=formulas.elementwise_flops,
                  to_dist=_rrelu)
registry.register(nn.AlphaDropout, role="pointwise", op="pointwise", flops=formulas.elementwise_flops,
                  to_dist=_alpha_dropout)
