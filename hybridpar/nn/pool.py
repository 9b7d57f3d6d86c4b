"""Spatially distributed pooling: max, average (kernel != stride, padding, ceil mode) and global.

Why: pooling windows cross shard faces exactly like convolution windows do, so the same halo plans
apply; only the boundary fill differs (-inf for max, zero for average) and average pooling's divisor,
which depends on where a window sits in the *global* volume, is computed from the geometry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.halo import HaloExchanger, halo_exchange
from hybridpar.comm.reduce import sum_to_replicated
from hybridpar.geometry import window_plans
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer, _triple


def _check_pad(layer: str, kernel, padding, dilation=(1, 1, 1)) -> None:
    for k, p, d in zip(kernel, padding, dilation):
        if p > (d * (k - 1) + 1) // 2:
            raise ValueError(f"{layer}: padding {p} should be at most half of the effective kernel "
                             f"size {d * (k - 1) + 1}, as in torch")


class DistMaxPool3d(SpatialLayer, nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` on a spatially split input (padding and ceil mode included)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, *, grid: ProcessGrid | None = None,
                 transport: str | None = None) -> None:
        nn.MaxPool3d.__init__(self, kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self._init_spatial(grid, transport)
        if return_indices:
            raise NotImplementedError("DistMaxPool3d: return_indices=True is not supported")
        self.k = _triple(kernel_size, "kernel_size", self.layer_name)
        self.s = _triple(stride if stride is not None else kernel_size, "stride", self.layer_name)
        self.p = _triple(padding, "padding", self.layer_name)
        self.d = _triple(dilation, "dilation", self.layer_name)
        _check_pad(self.layer_name, self.k, self.p, self.d)

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator (boundary fill -inf) for a global (D, H, W) = ``shape`` input."""
        return self.exchanger(shape, lambda n, parts, dim: window_plans(
            n, parts, self.k["DHW".index(dim)], self.s["DHW".index(dim)], self.p["DHW".index(dim)],
            self.p["DHW".index(dim)], self.d["DHW".index(dim)], self.ceil_mode, layer=self.layer_name,
            dim=dim), fill=float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.halo_exchanger(self.global_shape(x))
        return F.max_pool3d(halo_exchange(x, ex), self.k, self.s, 0, self.d)


class DistAvgPool3d(SpatialLayer, nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` on a spatially split input, divisors as torch computes them."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.AvgPool3d.__init__(self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)
        self._init_spatial(grid, transport)
        self.k = _triple(kernel_size, "kernel_size", self.layer_name)
        self.s = _triple(stride if stride is not None else kernel_size, "stride", self.layer_name)
        self.p = _triple(padding, "padding", self.layer_name)
        _check_pad(self.layer_name, self.k, self.p)
        self._divisors: dict[tuple, torch.Tensor] = {}

    def _divisor(self, shape, outs, like: torch.Tensor) -> torch.Tensor:
        key = (tuple(shape), tuple(outs), like.dtype, like.device)
        if key not in self._divisors:
            if self.divisor_override:
                self._divisors[key] = torch.tensor(float(self.divisor_override), dtype=like.dtype,
                                                   device=like.device)
            else:
                per_dim = []
                for n, (a, b), k, s, p in zip(shape, outs, self.k, self.s, self.p):
                    counts = []
                    for o in range(a, b):
                        start = o * s - p
                        end = min(start + k, n + p)
                        size = end - start
                        if not self.count_include_pad:
                            size = min(end, n) - max(start, 0)
                        counts.append(size)
                    per_dim.append(torch.tensor(counts, dtype=like.dtype))
                div = per_dim[0].view(-1, 1, 1) * per_dim[1].view(1, -1, 1) * per_dim[2].view(1, 1, -1)
                self._divisors[key] = div.to(like.device)
        return self._divisors[key]

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator (boundary fill 0) for a global (D, H, W) = ``shape`` input."""
        return self.exchanger(shape, lambda n, parts, dim: window_plans(
            n, parts, self.k["DHW".index(dim)], self.s["DHW".index(dim)], self.p["DHW".index(dim)],
            self.p["DHW".index(dim)], 1, self.ceil_mode, layer=self.layer_name, dim=dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        ex = self.halo_exchanger(shape)
        sums = F.avg_pool3d(halo_exchange(x, ex), self.k, self.s, 0, divisor_override=1)
        outs = [d.plan.out for d in ex.all_dims]  # type: ignore[attr-defined]
        return sums / self._divisor(shape, outs, sums)


class DistGlobalAvgPool3d(SpatialLayer):
    """``nn.AdaptiveAvgPool3d(1)`` over the whole split volume: (N, C, 1, 1, 1), replicated."""

    def __init__(self, *, grid: ProcessGrid | None = None) -> None:
        super().__init__()
        self._init_spatial(grid, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, h, w = self.global_shape(x)
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        return sum_to_replicated(x.sum(dim=(2, 3, 4), keepdim=True), group) / (d * h * w)


def _max_pool3d(m: nn.MaxPool3d, grid: ProcessGrid, overlap: bool = False) -> DistMaxPool3d:
    return DistMaxPool3d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode,
                         grid=grid)


def _avg_pool3d(m: nn.AvgPool3d, grid: ProcessGrid, overlap: bool = False) -> DistAvgPool3d:
    return DistAvgPool3d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                         m.divisor_override, grid=grid)


def _adaptive_avg_pool3d(m: nn.AdaptiveAvgPool3d, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    if registry.triple(m.output_size) != (1, 1, 1):
        raise NotImplementedError(f"AdaptiveAvgPool3d({m.output_size}): only output size 1 runs split")
    return DistGlobalAvgPool3d(grid=grid)


registry.register(nn.MaxPool3d, role="window", op="pool", flops=registry.pool_flops, to_dist=_max_pool3d,
                  window_args=registry.pool_window_args, saved=registry.saved_window)
registry.register(nn.AvgPool3d, role="window", op="pool", flops=registry.pool_flops, to_dist=_avg_pool3d,
                  window_args=registry.pool_window_args, saved=registry.saved_window)
registry.register(nn.AdaptiveAvgPool3d, role="reduce", op="pool", flops=registry.per_input_flops,
                  to_dist=_adaptive_avg_pool3d)
