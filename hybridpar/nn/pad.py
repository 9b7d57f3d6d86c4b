"""Spatially distributed padding layers: ``DistConstantPad3d``, ``DistReplicationPad3d``,
``DistReflectionPad3d`` and ``DistCircularPad3d``.

Why no kernel of their own: a pad is a window layer of kernel 1 whose padding is the whole result,
so the halo exchanger that extends a convolution's shard computes it exactly. Each rank's output is
its balanced shard of the *padded* extent (as every split layer's output is): the geometry says which
input voxels that shard reads (its own, a neighbour's where the shards of input and output do not line
up, copies of edge voxels or, for a periodic box, voxels across the opposite face) and the backward is
the exchanger's adjoint. Negative padding crops, as torch's does (circular crops before it wraps).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.halo import HaloExchanger, exchange
from hybridpar.device.precision import narrowed, result_dtype, widened
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.window import Window, Windows

Pads = list[tuple[int, int]]


def _dhw_pads(padding: tuple[int, ...]) -> Pads:
    """(low, high) per D, H, W from torch's 6-tuple, which lists W first."""
    w0, w1, h0, h1, d0, d1 = padding
    return [(d0, d1), (h0, h1), (w0, w1)]


class _DistPad(SpatialLayer):
    """What the four pads share: the padded shard is the halo exchanger's extended input (the pad's
    window: kernel 1, its padding, its mode; see :func:`_pad_window`)."""

    padding: tuple[int, ...]

    def _fill(self) -> float:
        return 0.0

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The operator from this rank's input shard to its output shard, for a global input ``shape``."""
        return self.window_exchanger(shape, fill=self._fill())

    def _torch_pad(self, t: torch.Tensor) -> torch.Tensor:
        mode = _mode(self)
        return F.pad(t, (1,) * 6, mode="constant" if mode == "zeros" else mode)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The exchange is the whole pad; under autocast the dtype is torch's pad's (``precision``)."""
        dtype = result_dtype(f"pad-{_mode(self)}", self._torch_pad, x)
        return widened(exchange(narrowed(x, dtype), self.halo_exchanger(self.global_shape(x))), dtype)


class DistConstantPad3d(_DistPad, nn.ConstantPad3d):
    """``torch.nn.ConstantPad3d`` on a spatially split input; output balanced-split over the padded
    extent."""

    def __init__(self, padding, value: float, *, grid: ProcessGrid | None = None,
                 transport: str | None = None) -> None:
        nn.ConstantPad3d.__init__(self, padding, value)
        self.init_spatial(grid, transport)

    def _fill(self) -> float:
        return float(self.value)


class DistReplicationPad3d(_DistPad, nn.ReplicationPad3d):
    """``torch.nn.ReplicationPad3d`` on a spatially split input: the ranks at the volume's faces
    repeat its edge voxels; the backward sums the copies' gradients into them."""

    def __init__(self, padding, *, grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.ReplicationPad3d.__init__(self, padding)
        self.init_spatial(grid, transport)


class DistReflectionPad3d(_DistPad, nn.ReflectionPad3d):
    """``torch.nn.ReflectionPad3d`` on a spatially split input: a rank at a face mirrors the voxels
    1..p next to it, fetched from its neighbour where its shard is thinner than that."""

    def __init__(self, padding, *, grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.ReflectionPad3d.__init__(self, padding)
        self.init_spatial(grid, transport)


class DistCircularPad3d(_DistPad, nn.CircularPad3d):
    """``torch.nn.CircularPad3d`` on a spatially split input (a periodic box): the padding is a halo
    from the rank at the opposite face."""

    def __init__(self, padding, *, grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.CircularPad3d.__init__(self, padding)
        self.init_spatial(grid, transport)


# ---------------------------------------------------------------------- registry entries
_MODES: dict[type, str] = {nn.ConstantPad3d: "zeros", nn.ReplicationPad3d: "replicate",
                           nn.ReflectionPad3d: "reflect", nn.CircularPad3d: "circular"}


def _mode(m: nn.Module) -> str:
    """A pad's mode as :mod:`hybridpar.geometry` names it."""
    return next(v for t, v in _MODES.items() if isinstance(m, t))


def _pad_window(m: nn.Module) -> Windows:
    """Per dim a kernel-1 window with the pad's (low, high) padding (negative: a crop) and its mode."""
    return tuple(Window(1, 1, lo, hi, mode=_mode(m)) for lo, hi in _dhw_pads(m.padding))


def _constant(m: nn.ConstantPad3d, grid: ProcessGrid, overlap: bool = False) -> DistConstantPad3d:
    return DistConstantPad3d(m.padding, m.value, grid=grid)


def _replication(m: nn.ReplicationPad3d, grid: ProcessGrid, overlap: bool = False) -> DistReplicationPad3d:
    return DistReplicationPad3d(m.padding, grid=grid)


def _reflection(m: nn.ReflectionPad3d, grid: ProcessGrid, overlap: bool = False) -> DistReflectionPad3d:
    return DistReflectionPad3d(m.padding, grid=grid)


def _circular(m: nn.CircularPad3d, grid: ProcessGrid, overlap: bool = False) -> DistCircularPad3d:
    return DistCircularPad3d(m.padding, grid=grid)


_PAD = dict(role="window", op="free", flops=registry.no_flops_pointwise, window=_pad_window)
registry.register(nn.ConstantPad3d, to_dist=_constant, **_PAD)
registry.register(nn.ReplicationPad3d, to_dist=_replication, **_PAD)
registry.register(nn.ReflectionPad3d, to_dist=_reflection, **_PAD)
registry.register(nn.CircularPad3d, to_dist=_circular, **_PAD)
