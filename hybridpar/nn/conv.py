"""Spatially distributed convolutions: ``DistConv3d`` and ``DistConvTranspose3d``.

Why subclasses of the torch layers: same constructor arguments, same parameter initialisation (so a
seed gives the same weights), same ``state_dict`` keys and shapes (weights load both ways), and
``isinstance(m, nn.Conv3d)`` still holds for tools that inspect models. Only ``forward`` changes:
exchange halos, then run the torch kernel on the extended shard with no padding.

Under autocast the shard is cast to the kernel's compute dtype *before* its halos are exchanged (half
the bytes under bf16, and the same numbers as casting the whole volume, a cast being elementwise);
the kernel then casts the weight as torch's does. ``channels_last_3d`` shards stay so throughout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.halo import HaloExchanger, exchange
from hybridpar.comm.reduce import sync_grads
from hybridpar.device import memfmt
from hybridpar.device.eager import eager
from hybridpar.device.precision import narrowed, result_dtype
from hybridpar.geometry import HaloPlan
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.overlap import OverlappedConv3d
from hybridpar.nn.spatial import SpatialLayer


class DistConv3d(SpatialLayer, nn.Conv3d):
    """``torch.nn.Conv3d`` on a spatially split input; gives what Conv3d gives on the whole volume.

    ``overlap=True`` computes the interior while halos are in flight (forward and backward).

    ``padding_mode`` as torch's: ``'zeros'``; ``'circular'`` (a periodic box: halos wrap around, so the
    boundary ranks exchange with each other instead of padding); ``'replicate'`` and ``'reflect'`` (the
    boundary ranks pad with copies of the volume's edge voxels, fetched from the neighbour where the
    shard is thinner than a reflection; the backward adds the copies' gradients back into them).
    These two assemble the extended input before computing: ``overlap`` applies to the other two.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 dilation=1, groups: int = 1, bias: bool = True, padding_mode: str = "zeros",
                 device=None, dtype=None, *, grid: ProcessGrid | None = None, overlap: bool = False,
                 transport: str | None = None) -> None:
        nn.Conv3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding, dilation,
                           groups, bias, padding_mode, device, dtype)
        self.init_spatial(grid, transport)
        self.overlap = overlap
        self._mark_params(self.grid.spatial_size)

    def _native_pads(self) -> tuple[int, int, int]:
        """Padding torch's kernel can apply itself: symmetric zero padding along dims that are not
        split (no copy of the input). The overlapped path pads everything in the exchanger instead, and
        so do the other padding modes (``F.conv3d`` pads with zeros only)."""
        if self._overlapped() or self.padding_mode != "zeros":
            return (0, 0, 0)
        return tuple(a.pad_lo if a.pad_lo == a.pad_hi and parts == 1 else 0  # type: ignore[return-value]
                     for a, parts in zip(self.window(), self.grid.spatial_shape))

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator this layer applies to a shard of a global (D, H, W) = ``shape`` input:
        its window's (:meth:`window`), less the padding the kernel applies itself."""
        native = self._native_pads()
        if not any(native):
            return self.window_exchanger(shape)
        ws = self.window()

        def plans_of(n: int, parts: int, dim: str) -> list[HaloPlan]:
            i = dim_i(dim)
            if native[i]:  # unsplit, padded by the kernel: nothing to exchange, trim or fill
                return [HaloPlan((0, n), (0, n), (0, n), 0, 0, 0, 0, 0, 0, (0, 0), (0, 0))]
            return ws[i].plans(n, parts, layer=self.layer_name, dim=dim)

        return self.exchanger(shape, plans_of, key=("native", native))

    def _overlapped(self) -> bool:
        """Whether the interior is computed while halos are in flight: with ``overlap``, for fills and
        periodic halos (an edge copy of ``replicate``/``reflect`` exists only once the halos are in),
        on a split grid (unsplit, nothing is in flight: the kernel pads)."""
        return self.overlap and self.padding_mode in ("zeros", "circular") and self.grid.spatial_size > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ex = self.halo_exchanger(self.global_shape(x))
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        x = narrowed(x, result_dtype("conv3d", _conv_probe, x))
        if self._overlapped():
            return _overlapped(x, self.weight, self.bias, ex, self.stride, self.dilation, self.groups, group)
        weight, bias = sync_grads(group, self.weight, self.bias)
        return F.conv3d(exchange(x, ex), weight, bias, self.stride, self._native_pads(), self.dilation,
                        self.groups)


@eager  # computes around its communication: runs eagerly under torch.compile
def _overlapped(x, weight, bias, ex, stride, dilation, groups, group) -> torch.Tensor:
    return OverlappedConv3d.apply(x, weight, bias, ex, stride, dilation, groups, group)


def _conv_probe(t: torch.Tensor) -> torch.Tensor:
    return F.conv3d(t, torch.ones((1, 1, 1, 1, 1), dtype=t.dtype, device=t.device))


def _conv_transpose_probe(t: torch.Tensor) -> torch.Tensor:
    return F.conv_transpose3d(t, torch.ones((1, 1, 1, 1, 1), dtype=t.dtype, device=t.device))


def dim_i(name: str) -> int:
    """Index of a dim name (``"D"``, ``"H"``, ``"W"``)."""
    return "DHW".index(name)


class DistConvTranspose3d(SpatialLayer, nn.ConvTranspose3d):
    """``torch.nn.ConvTranspose3d`` on a spatially split input (output balanced-split as well).

    A rank gathers the inputs that reach its output shard, runs the transposed convolution with no
    padding and crops to its shard; the bias is added after the crop so padded voxels get it too.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, stride=1, padding=0,
                 output_padding=0, groups: int = 1, bias: bool = True, dilation=1,
                 padding_mode: str = "zeros", device=None, dtype=None, *, grid: ProcessGrid | None = None,
                 transport: str | None = None) -> None:
        nn.ConvTranspose3d.__init__(self, in_channels, out_channels, kernel_size, stride, padding,
                                    output_padding, groups, bias, dilation, padding_mode, device, dtype)
        self.init_spatial(grid, transport)
        self._mark_params(self.grid.spatial_size)
        self._origins: dict[tuple[int, ...], list[int]] = {}

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator this layer applies to a shard of a global (D, H, W) = ``shape`` input."""
        return self.window_exchanger(shape)

    def _pad_for(self, shape: tuple[int, int, int], output_size) -> None:
        """Take the output padding that makes the global output of a (D, H, W) = ``shape`` input
        ``output_size`` (the volume's extents, as torch's ``forward(x, output_size=...)`` takes them;
        ``skip.shape[2:]`` answers them), checked as torch checks it: one setting per call, its halo
        plans memoised anew where it changes."""
        probe = torch.empty((1, self.in_channels, *shape), device="meta")
        try:
            padding = nn.ConvTranspose3d._output_padding(self, probe, list(output_size), list(self.stride),
                                                         list(self.padding), list(self.kernel_size), 3,
                                                         list(self.dilation))
        except ValueError as err:  # torch's own check, on the volume's extents: named here
            raise ValueError(f"{self.layer_name}: on an input of global extents {list(shape)}, {err}"
                             ) from None
        if tuple(padding) != tuple(self.output_padding):
            self.output_padding = tuple(padding)
            self.__dict__.pop("_window", None)  # SpatialLayer.window reads the settings anew
            self._exchangers.clear()
            self._origins.clear()

    def origins(self, shape: tuple[int, int, int]) -> list[int]:
        """Per dim, where the kernel's result on this rank's extended input starts in the global output
        (memoised per global input ``shape``)."""
        found = self._origins.get(tuple(shape))
        return found if found is not None else self._new_origins(tuple(shape))

    @eager  # computed once per shape, eagerly (a compiled forward finds it memoised)
    def _new_origins(self, shape: tuple[int, ...]) -> list[int]:
        ws = self.window()
        self._origins[shape] = [ws[i].transposed_plans(shape[i], self.grid.spatial_shape[i],
                                                       layer=self.layer_name, dim="DHW"[i])[1][coord]
                                for i, coord in enumerate(self.grid.spatial_coord)]
        return self._origins[shape]

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        shape = self.global_shape(x)
        if output_size is not None:
            self._pad_for(shape, output_size)
        ex = self.halo_exchanger(shape)
        origins = self.origins(shape)
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        weight, bias = sync_grads(group, self.weight, self.bias)
        ext = exchange(narrowed(x, result_dtype("conv_transpose3d", _conv_transpose_probe, x)), ex)
        outs = [d.plan.out for d in ex.all_dims]
        if all(s > 0 for s in ext.shape[2:]):
            y = F.conv_transpose3d(ext, weight, None, self.stride, 0, 0, self.groups, self.dilation)
        else:  # the dtype the kernel would give (autocast)
            y = memfmt.zeros((*ext.shape[:1], self.out_channels, 0, 0, 0), ext).to(
                result_dtype("conv_transpose3d", _conv_transpose_probe, ext))
        pad = []
        for i in (2, 1, 0):  # F.pad lists the last dim first; negative values crop
            origin, (a, b) = origins[i], outs[i]
            pad += [origin - a, b - (origin + y.shape[2 + i])]
        y = F.pad(y, pad) if y.numel() else memfmt.zeros((y.shape[0], self.out_channels,
                                                          *(b - a for a, b in outs)), y)
        if bias is not None:  # in the output's dtype, as the kernel adds it under autocast
            y = y + bias.to(y.dtype).view(1, -1, 1, 1, 1)
        return y


def _conv3d(m: nn.Conv3d, grid: ProcessGrid, overlap: bool = False) -> DistConv3d:
    return DistConv3d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding, m.dilation,
                      m.groups, m.bias is not None, m.padding_mode, grid=grid, overlap=overlap)


def _conv_transpose3d(m: nn.ConvTranspose3d, grid: ProcessGrid, overlap: bool = False) -> DistConvTranspose3d:
    return DistConvTranspose3d(m.in_channels, m.out_channels, m.kernel_size, m.stride, m.padding,
                               m.output_padding, m.groups, m.bias is not None, m.dilation, m.padding_mode,
                               grid=grid)


registry.register(nn.Conv3d, role="window", op="conv", flops=registry.conv_flops, to_dist=_conv3d,
                  window=registry.conv_window, saved=registry.saved_window)
registry.register(nn.ConvTranspose3d, role="transposed", op="conv", flops=registry.conv_flops,
                  to_dist=_conv_transpose3d, window=registry.transposed_window,
                  saved=registry.saved_window)
