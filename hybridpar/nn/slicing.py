"""A strided box of a volume as a layer: ``x[:, :, a:b:s, c:d:t, e:f:u]`` on a split volume.

Why a layer: a forward crops a skip connection to the decoder's size (the valid-convolution U-Net,
``s[:, :, dz:dz + D, ...]``) or keeps every other voxel (``x[..., ::2, ::2, ::2]``), and on a split
volume the voxels of a rank's share of the result lie partly on its neighbours. Seen as a window of
kernel 1, stride ``s`` and negative padding (``-a`` low, ``b' - E`` high, ``b'`` one past the last
voxel kept), the halo exchanger brings each rank exactly the voxels its output shard reads, as it
does for a crop by negative padding (:mod:`hybridpar.nn.pad`), and the backward is its adjoint.

:class:`VolumeSlice` is built by a forward run by module swapping for each such index
(:func:`hybridpar.planner.calls.classify`) from the volume's global extents, so its padding holds for
that volume; on it, its forward is the index's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.window import Window, Windows


class VolumeSlice(nn.Module):
    """``x[:, channels, a:b:s, c:d:t, e:f:u]`` of a volume of known extents: ``padding`` (torch's
    order, W first, every entry at most 0) crops to the box from the first voxel kept to the last,
    ``stride`` (D, H, W) keeps every s-th of it; ``channels`` slices the channels first (None: all)."""

    def __init__(self, padding: Sequence[int], stride: Sequence[int], channels: slice | None = None) -> None:
        super().__init__()
        if len(padding) != 6 or any(not isinstance(p, int) or p > 0 for p in padding):
            raise ValueError(f"VolumeSlice: padding must be six ints, none positive (a crop), got {padding}")
        if len(stride) != 3 or any(not isinstance(s, int) or s < 1 for s in stride):
            raise ValueError(f"VolumeSlice: stride must be three positive ints, got {stride}")
        self.padding, self.stride, self.channels = tuple(padding), tuple(stride), channels

    def _pick(self, x: torch.Tensor) -> torch.Tensor:
        s = self.stride
        return x if s == (1, 1, 1) else x[..., ::s[0], ::s[1], ::s[2]]

    def _channels(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.channels is None else x[:, self.channels]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._pick(F.pad(self._channels(x), self.padding))

    def extra_repr(self) -> str:
        return f"padding={self.padding}, stride={self.stride}, channels={self.channels}"


def per_dim_index(index: object, nd: int) -> list | None:
    """``x[index]`` of an ``nd``-dim ``x`` as one item per dim (the Ellipsis and the dims left out as
    full slices), or None where it names more dims than ``x`` has or holds two Ellipses."""
    items = list(index) if isinstance(index, tuple) else [index]
    if items.count(Ellipsis) > 1:
        return None
    per_dim: list = []
    for i in items:
        per_dim += [slice(None)] * (nd - len(items) + 1) if i is Ellipsis else [i]
    per_dim += [slice(None)] * (nd - len(per_dim))
    return per_dim if len(per_dim) == nd else None


def _per_dim(index: object) -> list[slice] | None:
    """``index`` as one slice per dim of a 5-D volume, or None where it is not a box of slices of ints
    that keeps every sample (an int drops a dim, a mask or a list picks; data parallelism holds the
    batch apart)."""
    per_dim = per_dim_index(index, 5)
    if per_dim is None or not all(isinstance(i, slice) for i in per_dim) or per_dim[0] != slice(None):
        return None
    if not all(isinstance(v, int | None) for s in per_dim for v in (s.start, s.stop, s.step)):
        return None
    return per_dim


def shard_index(index: object, extents: Sequence[int], box: Sequence[tuple[int, int]]) -> tuple[slice, ...]:
    """A box of slices ``index`` of a volume of global ``extents`` as the index of its part on a shard
    holding ``box`` ((lo, hi) per D, H, W); where the box misses the shard, an empty one (so that a
    value written there still meets the shard: its gradient's reduction runs on every rank)."""
    per_dim = _per_dim(index)
    if per_dim is None:
        raise ValueError(f"not a box of slices: {index!r}")
    local = per_dim[:2]
    for s, extent, (lo, hi) in zip(per_dim[2:], extents, box, strict=True):
        start, stop, step = s.indices(extent)
        first = start if start >= lo else start + -(-(lo - start) // step) * step
        end = min(stop, hi)
        local.append(slice(first - lo, end - lo, step) if first < end else slice(0, 0))
    return tuple(local)


def box_of(index: object, extents: Sequence[int]) -> VolumeSlice | None:
    """The :class:`VolumeSlice` that ``x[index]`` is on a 5-D volume of global ``extents`` (D, H, W),
    or None where the index is something else (see :func:`_per_dim`) or an empty box."""
    per_dim = _per_dim(index)
    if per_dim is None:
        return None
    pads: list[int] = []
    strides: list[int] = []
    for s, extent in zip(per_dim[2:], extents, strict=True):
        start, stop, step = s.indices(extent)
        n = len(range(start, stop, step))
        if n < 1:
            return None
        pads += [-start, -(extent - (start + (n - 1) * step + 1))]
        strides.append(step)
    channels = None if per_dim[1] == slice(None) else per_dim[1]
    d0, d1, h0, h1, w0, w1 = pads
    return VolumeSlice((w0, w1, h0, h1, d0, d1), strides, channels)


class DistVolumeSlice(SpatialLayer, VolumeSlice):
    """:class:`VolumeSlice` on a spatially split input: each rank's balanced shard of the box."""

    def __init__(self, padding: Sequence[int], stride: Sequence[int], channels: slice | None = None, *,
                 grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        VolumeSlice.__init__(self, padding, stride, channels)
        self.init_spatial(grid, transport)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The exchange brings the voxels from the shard's first kept one to its last; the stride picks."""
        return self._pick(self.with_halos(self._channels(x)))


def _window(m: VolumeSlice) -> Windows:
    w0, w1, h0, h1, d0, d1 = m.padding
    return tuple(Window(1, s, lo, hi) for (lo, hi), s in zip(((d0, d1), (h0, h1), (w0, w1)), m.stride))


def _dist(m: VolumeSlice, grid: ProcessGrid, overlap: bool = False) -> DistVolumeSlice:
    return DistVolumeSlice(m.padding, m.stride, m.channels, grid=grid)


registry.register(VolumeSlice, role="window", op="free", flops=registry.no_flops_pointwise, to_dist=_dist,
                  window=_window)
