"""Spectral layers: the power spectrum of a volume and FNO's spectral convolution, whole and split.

Why: both are global (every output depends on every voxel), so on a split volume they run on
:mod:`hybridpar.fft`'s distributed transform; each single-process layer and its Dist counterpart
share one function of the modes (:func:`shell_sums`, :func:`mix_modes`) fed by ``torch.fft`` on the
whole volume or by ``hp.fft`` on the shards, so the two agree by construction. ``SpectralConv3d`` is
registered with its Dist class: ``hp.parallelize`` splits FNO-style models with it, its output
split as its input (role ``pointwise``: the transposes happen inside).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from hybridpar import fft as hfft
from hybridpar.axes import DIM_NAMES
from hybridpar.comm.reduce import sum_to_replicated, sync_grads
from hybridpar.geometry import ntuple
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.formulas import Work
from hybridpar.nn.spatial import SpatialLayer


# ---------------------------------------------------------------------- the power spectrum
def shell_sums(modes: torch.Tensor, kd: torch.Tensor, kh: torch.Tensor, kw: torch.Tensor, width: int,
               edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per shell ``edges[b] <= |k| < edges[b + 1]`` (the zero mode left out): the weighted sum of
    ``|X_k|²`` over the held ``modes`` (N, C, bins) and the weight (bins,). A stored mode counts with
    its conjugate twin: 2 off the planes ``kw = 0`` and, for an even ``width``, ``kw = width / 2``.
    Shapes never depend on values (modes outside every shell add into a bin that is dropped), so the
    layer also runs on the meta device, where a plan traces it."""
    bins = edges.numel() - 1
    k = torch.sqrt(kd * kd + kh * kh + kw * kw).expand(modes.shape[2:]).reshape(-1)
    twin = kw != 0
    if width % 2 == 0:
        twin = twin & (kw != width // 2)
    weight = (1.0 + twin.to(k.dtype)).expand(modes.shape[2:]).reshape(-1)
    shell = torch.bucketize(k, edges.to(k.dtype), right=True) - 1
    shell = torch.where((shell >= 0) & (shell < bins) & (k > 0), shell, bins)
    power = (modes.real ** 2 + modes.imag ** 2).flatten(2) * weight
    sums = power.new_zeros((*modes.shape[:2], bins + 1)).index_add(2, shell, power)
    return sums[..., :bins], k.new_zeros(bins + 1).index_add(0, shell, weight)[:bins]


def _edges(edges: Sequence[float] | torch.Tensor, layer: str) -> tuple[float, ...]:
    bounds = tuple(float(e) for e in (edges.flatten().tolist() if isinstance(edges, torch.Tensor) else edges))
    if len(bounds) < 2 or any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"{layer}: edges must be at least two increasing shell bounds, got {list(bounds)}")
    return bounds


class PowerSpectrum(nn.Module):
    """P(k) of each channel of an (N, C, D, H, W) volume: (N, C, bins), per shell ``edges[b] <= |k| <
    edges[b + 1]`` (|k| in units of the fundamental frequency, the zero mode left out) the mean of
    ``|X_k|²`` over its modes, ``X = torch.fft.rfftn(x)`` unnormalised; 0 for a shell with no mode."""

    def __init__(self, edges: Sequence[float] | torch.Tensor) -> None:
        super().__init__()
        self.bounds = _edges(edges, type(self).__name__)
        self.register_buffer("edges", torch.tensor(self.bounds), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        modes = torch.fft.rfftn(x, dim=(-3, -2, -1))
        k = hfft.wavenumbers(tuple(x.shape[2:]), modes.real.dtype, modes.device)
        sums, counts = shell_sums(modes, *k, x.shape[-1], self.edges)
        return sums / counts.clamp_min(1)

    def extra_repr(self) -> str:
        return f"bins={self.edges.numel() - 1}"


class DistPowerSpectrum(SpatialLayer, PowerSpectrum):
    """:class:`PowerSpectrum` of a split volume (``hp.fft`` on the shards); the output, (N, C, bins),
    is replicated on every rank of ``grid``."""

    def __init__(self, edges: Sequence[float] | torch.Tensor, *, grid: ProcessGrid | None = None) -> None:
        PowerSpectrum.__init__(self, edges)
        self.init_spatial(grid, None)
        self._counts: dict[tuple, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        spec = hfft.rfftn(x, self.grid, shape)
        sums, counts = shell_sums(spec.data, *spec.wavenumbers(), shape[2], self.edges)
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        key = (shape, counts.dtype, counts.device)
        if key not in self._counts:  # the shells' weights: a fact of the shape, summed once
            if group is not None:
                torch.distributed.all_reduce(counts, group=group)
            self._counts[key] = counts.clamp_min(1)
        return sum_to_replicated(sums, group) / self._counts[key]


# ---------------------------------------------------------------------- FNO's spectral convolution
@functools.lru_cache(maxsize=256)
def kept_modes(extent: int, lo: int, hi: int, m: int, half: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Of the stored modes ``lo:hi`` along a dim of ``extent`` voxels (``half``: the halved W dim of a
    real transform), those kept by a spectral convolution of ``m`` modes (``|k| < m``): their local
    positions, and their weights' index ``k mod (2 m - 1)`` (``k`` along W). Index arithmetic only."""
    span = m if half else 2 * m - 1
    keep = [(i - lo, k % span) for i in range(lo, hi)
            for k in [i if half or i < (extent + 1) // 2 else i - extent] if abs(k) < m]
    return tuple(p for p, _ in keep), tuple(j for _, j in keep)


@functools.lru_cache(maxsize=256)
def kept_indices(select: Callable[..., tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...],
                 box: tuple[tuple[int, int], ...], kept: tuple[int, ...],
                 device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``select`` (:func:`kept_modes`, or another layer's rule of which modes it keeps) of each dim as
    index tensors on ``device``, made once per shape (no copy per step)."""
    picks, index = [], []
    for axis in range(3):
        pos, idx = select(shape[axis], *box[axis], kept[axis], axis == 2)
        picks.append(torch.tensor(pos, dtype=torch.long, device=device))
        index.append(torch.tensor(idx, dtype=torch.long, device=device))
    return picks, index


def mix_modes(modes: torch.Tensor, shape: Sequence[int], box: Sequence[tuple[int, int]],
              weight: torch.Tensor, kept: tuple[int, int, int]) -> torch.Tensor:
    """The held modes (N, C_in, ...; ``box`` of the whole field's, ``shape`` its real extents) of wave
    numbers ``|kd| < m1``, ``|kh| < m2``, ``kw < m3`` times the complex ``weight`` (C_in, C_out,
    2 m1 - 1, 2 m2 - 1, m3; index ``k mod (2 m - 1)``) summed over input channels, every other mode
    zero: (N, C_out, ...)."""
    picks, index = kept_indices(kept_modes, tuple(shape), tuple(map(tuple, box)), tuple(kept), modes.device)
    x = modes.index_select(2, picks[0]).index_select(3, picks[1]).index_select(4, picks[2])
    w = weight.index_select(2, index[0]).index_select(3, index[1]).index_select(4, index[2])
    out = modes.new_zeros((modes.shape[0], weight.shape[1], *modes.shape[2:]))
    out[:, :, picks[0].view(-1, 1, 1), picks[1].view(1, -1, 1), picks[2].view(1, 1, -1)] = \
        torch.einsum("nixyz,ioxyz->noxyz", x, w)
    return out


class SpectralConv3d(nn.Module):
    """FNO's spectral convolution (Li et al. 2021): ``irfftn`` of the input's modes of wave numbers
    ``|kd| < m1``, ``|kh| < m2``, ``kw < m3`` times learned complex weights (the rest zero).

    ``weight`` is real, (C_in, C_out, 2 m1 - 1, 2 m2 - 1, m3, 2): the complex weights as (re, im)
    pairs, so that optimizers, gradient reduction and checkpoints see an ordinary real tensor."""

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int]) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.modes = ntuple(modes, what="SpectralConv3d modes")
        m1, m2, m3 = self.modes
        if min(self.modes) < 1:
            raise ValueError(f"SpectralConv3d: modes must be positive, got {self.modes}")
        scale = 1.0 / (in_channels * out_channels)
        shape = (in_channels, out_channels, 2 * m1 - 1, 2 * m2 - 1, m3, 2)
        self.weight = nn.Parameter(scale * torch.rand(shape))

    def _check(self, shape: Sequence[int], name: str) -> None:
        spans = (2 * self.modes[0] - 1, 2 * self.modes[1] - 1, self.modes[2])
        for i, (n, need) in enumerate(zip(shape, spans, strict=True)):
            have = n if i < 2 else n // 2 + 1
            if have < need:
                raise ValueError(f"{name}: dim {DIM_NAMES[i]} of extent {n} has {have} modes, fewer than the "
                                 f"{need} kept (modes {self.modes}); use modes of at most "
                                 f"{(n + 1) // 2 if i < 2 else n // 2 + 1} along {DIM_NAMES[i]}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x.shape[2:], type(self).__name__)
        modes = torch.fft.rfftn(x, dim=(-3, -2, -1))
        whole = [(0, n) for n in modes.shape[2:]]
        out = mix_modes(modes, x.shape[2:], whole, torch.view_as_complex(self.weight), self.modes)
        return torch.fft.irfftn(out, s=x.shape[2:], dim=(-3, -2, -1))

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, modes={self.modes}"


class DistSpectralConv3d(SpatialLayer, SpectralConv3d):
    """:class:`SpectralConv3d` of a split volume: ``hp.fft`` on the shards, each rank mixing the modes
    it holds; the output is split as the input. After backward, ``weight.grad`` is the whole
    volume's on every rank (summed over the shards' modes)."""

    def __init__(self, in_channels: int, out_channels: int, modes: int | Sequence[int], *,
                 grid: ProcessGrid | None = None) -> None:
        SpectralConv3d.__init__(self, in_channels, out_channels, modes)
        self.init_spatial(grid, None)
        self._mark_params(self.grid.spatial_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        self._check(shape, self.layer_name)
        spec = hfft.rfftn(x, self.grid, shape)
        weight = sync_grads(self.grid.spatial_group if self.grid.spatial_size > 1 else None, self.weight)
        out = mix_modes(spec.data, spec.shape, spec.box(), torch.view_as_complex(weight), self.modes)
        return hfft.irfftn(spec.replace(out), self.grid)


def spectral_flops(m: SpectralConv3d, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    """The mode mixing as matmul FLOPs (8 real per complex multiply-add over the kept modes) and the
    transforms as other work (5 N log2 N per complex transform of N points, the usual FFT count)."""
    kept = x.shape[0] * (2 * m.modes[0] - 1) * (2 * m.modes[1] - 1) * m.modes[2]
    mix = 8 * kept * m.in_channels * m.out_channels
    volume = x.shape[2] * x.shape[3] * x.shape[4]
    transforms = int(5 * x.shape[0] * (m.in_channels + m.out_channels) * volume * math.log2(max(2, volume)))
    trainable = m.weight.requires_grad
    return {"forward": mix, "input_grad": mix if x.requires_grad else 0,
            "weight_grad": mix if trainable else 0, "forward_other": transforms,
            "backward_other": transforms}, None


def _spectral_conv(m: SpectralConv3d, grid: ProcessGrid, overlap: bool = False) -> DistSpectralConv3d:
    return DistSpectralConv3d(m.in_channels, m.out_channels, m.modes, grid=grid)


def power_flops(m: PowerSpectrum, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    """The transform (5 N log2 N per channel) and the shell sums (a few per mode) as other work."""
    volume = x.shape[2] * x.shape[3] * x.shape[4]
    work = int(x.shape[0] * x.shape[1] * volume * (5 * math.log2(max(2, volume)) + 4))
    return {"forward_other": work, "backward_other": work if x.requires_grad else 0}, None


def _power_spectrum(m: PowerSpectrum, grid: ProcessGrid, overlap: bool = False) -> DistPowerSpectrum:
    return DistPowerSpectrum(m.bounds, grid=grid)


# ``transposes(m, input_shape, split)``: real numbers per sample the FFT's transposes bring a rank
registry.register(SpectralConv3d, role="pointwise", op="conv", flops=spectral_flops, to_dist=_spectral_conv,
                  transposes=lambda m, shape, split: hfft.transpose_elements(shape[2:], split, m.in_channels,
                                                                             m.out_channels))
registry.register(PowerSpectrum, role="reduce", op="pointwise", flops=power_flops, to_dist=_power_spectrum,
                  transposes=lambda m, shape, split: hfft.transpose_elements(shape[2:], split, shape[1]))
