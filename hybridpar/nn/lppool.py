"""Spatially distributed power-average pooling: ``torch.nn.LPPool3d`` on a split volume.

Why a file of its own, and nothing else: the registry entry at the bottom is this layer's one
description. Its window (``registry.pool_window``: kernel, stride, ceil mode) is what
:class:`DistLPPool3d` builds its halos from (:meth:`SpatialLayer.window_exchanger`), and what the FLOP
counter, the planner, ``explain`` and the performance model read; no other module names the layer.

torch computes ``(sum of x**p over a window) ** (1/p)`` as an average pool of ``x**p`` times the
kernel volume, so with ``ceil_mode`` a window that overhangs the volume is scaled by its full size
over the part inside it. The distributed layer computes the same average over the split volume (the
window sums of the exchanged shard over torch's divisors, :func:`~hybridpar.nn.pool.window_divisors`)
and the same formula after it. ``x**p`` is taken before the exchange, so the halos carry it and the
filled voxels beyond the volume are zeros of the sum, not powers of a fill.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.halo import exchange
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.pool import window_divisors
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.window import Windows


class DistLPPool3d(SpatialLayer, nn.LPPool3d):
    """``torch.nn.LPPool3d`` (any ``norm_type``, stride, ceil mode) on a spatially split input."""

    def __init__(self, norm_type: float, kernel_size, stride=None, ceil_mode: bool = False, *,
                 grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.LPPool3d.__init__(self, norm_type, kernel_size, stride, ceil_mode)
        self.init_spatial(grid, transport)
        self.window()  # checks the arguments, one line naming the layer
        self._divisors: dict[tuple, torch.Tensor] = {}

    def _divisor(self, shape: tuple[int, int, int], outs: tuple, w: Windows,
                 like: torch.Tensor) -> torch.Tensor:
        key = (tuple(shape), outs, like.dtype, like.device)
        if key not in self._divisors:
            self._divisors[key] = window_divisors(shape, outs, w, like)
        return self._divisors[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, w = self.global_shape(x), self.window()
        ex = self.window_exchanger(shape)
        kernel, stride = tuple(a.kernel for a in w), tuple(a.stride for a in w)
        p = float(self.norm_type)
        sums = F.avg_pool3d(exchange(x.pow(p), ex), kernel, stride, 0, divisor_override=1)
        mean = sums / self._divisor(shape, tuple(d.plan.out for d in ex.all_dims), w, sums)
        return (torch.sign(mean) * F.relu(torch.abs(mean))).mul(math.prod(kernel)).pow(1.0 / p)


def _lp_pool3d(m: nn.LPPool3d, grid: ProcessGrid, overlap: bool = False) -> DistLPPool3d:
    return DistLPPool3d(m.norm_type, m.kernel_size, m.stride, m.ceil_mode, grid=grid)


def _as_module(x, norm_type, kernel_size, stride=None, ceil_mode=False) -> nn.Module:
    return nn.LPPool3d(norm_type, kernel_size, stride, ceil_mode)


registry.register(nn.LPPool3d, role="window", op="pool", flops=registry.pool_flops, to_dist=_lp_pool3d,
                  window=registry.pool_window, saved=registry.saved_window)
for _t in (nn.LPPool1d, nn.LPPool2d):  # not split (3D only); their window still splits their work
    registry.register(_t, role="dense", op="pool", flops=registry.pool_flops,
                      window=registry.pool_window, saved=registry.saved_window)
registry.register_function(F.lp_pool3d, as_module=_as_module)
