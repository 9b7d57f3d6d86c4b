"""The Zel'dovich displacement of the smoothed z = 0 field, as three more input channels of the U-Net.

Why: the map from today's field to the initial one is non-local (matter moved several Mpc/h), and a
CNN on the raw field learns it poorly; standard reconstruction (Eisenstein et al. 2007) first moves
the matter back along the displacement the linear theory infers from the smoothed field,
ψ(k) = i k / k² · δ(k) W(kR), and a network after it reaches twice the scale (Shallue & Eisenstein
2023). The displacement depends on the whole box, so on a split volume it is computed by the
distributed FFT (:mod:`hybridpar.fft`); :class:`Displacement` is registered with its split version,
so that the reconstruction model stays an ordinary module that ``hp.parallelize`` splits.

The input's channel 0 is the loader's ``log1p(counts)`` at z = 0; δ = counts / mean - 1 (the mean
over the sample's whole volume); ψ is in voxels, ``smoothing`` R in voxels too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import hybridpar as hp
from hybridpar.comm.reduce import sum_to_replicated
from hybridpar.grid import ProcessGrid
from hybridpar.nn.spatial import SpatialLayer


def displacement_modes(counts: torch.Tensor, kd: torch.Tensor, kh: torch.Tensor, kw: torch.Tensor,
                       total: torch.Tensor, shape: tuple[int, int, int], smoothing: float) -> torch.Tensor:
    """ψ(k) (N, 3, ...) from the held modes of the counts (N, 1, ...) of whole-volume ``shape``, whose
    sums per sample are ``total`` (N,): i k / k² · δ(k) · exp(-k²R²/2), the zero mode left out."""
    mean = (total / math.prod(shape)).view(-1, 1, 1, 1, 1)
    k = [2 * math.pi * f / n for f, n in zip((kd, kh, kw), shape, strict=True)]  # radians per voxel
    k2 = k[0] ** 2 + k[1] ** 2 + k[2] ** 2
    kernel = torch.where(k2 > 0, torch.exp(-0.5 * k2 * smoothing ** 2) / torch.where(k2 > 0, k2, 1.0), 0.0)
    delta = counts / mean
    return torch.cat([1j * kj * kernel * delta for kj in k], dim=1)


class Displacement(nn.Module):
    """Appends ψ_x, ψ_y, ψ_z of the smoothed z = 0 field (channel 0, ``log1p`` counts) to the input."""

    def __init__(self, smoothing: float = 2.0) -> None:
        super().__init__()
        self.smoothing = float(smoothing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.expm1(x[:, :1].double())
        modes = torch.fft.rfftn(counts, dim=(-3, -2, -1))
        d, h, w = x.shape[2:]
        k = hp.fft.wavenumbers((d, h, w), torch.float64, x.device)
        psi = displacement_modes(modes, *k, counts.sum((1, 2, 3, 4)), (d, h, w), self.smoothing)
        return torch.cat([x, torch.fft.irfftn(psi, s=(d, h, w), dim=(-3, -2, -1)).to(x.dtype)], dim=1)

    def extra_repr(self) -> str:
        return f"smoothing={self.smoothing}"


class DistDisplacement(SpatialLayer, Displacement):
    """:class:`Displacement` of a split volume: the sums per sample all-reduced, ψ by ``hp.fft``."""

    def __init__(self, smoothing: float = 2.0, *, grid: ProcessGrid | None = None) -> None:
        Displacement.__init__(self, smoothing)
        self._init_spatial(grid, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        counts = torch.expm1(x[:, :1].double())
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        total = sum_to_replicated(counts.sum((1, 2, 3, 4)), group)
        spec = hp.fft.rfftn(counts, self.grid, shape)
        psi = displacement_modes(spec.data, *spec.wavenumbers(), total, shape, self.smoothing)
        return torch.cat([x, hp.fft.irfftn(spec.replace(psi), self.grid).to(x.dtype)], dim=1)


def _flops(m: Displacement, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, int], None]:
    volume = x.shape[2] * x.shape[3] * x.shape[4]
    return {"forward_other": int(5 * x.shape[0] * 4 * volume * math.log2(max(2, volume)))}, None


hp.nn.register(Displacement, role="pointwise", op="pointwise", flops=_flops,
               to_dist=lambda m, grid, overlap=False: DistDisplacement(m.smoothing, grid=grid),
               transposes=lambda m, shape, split: hp.fft.transpose_elements(shape[2:], split, 1, 3))


class WithDisplacement(nn.Module):
    """A network fed its input and the input's displacement channels (``unet.displacement``)."""

    def __init__(self, net: nn.Module, smoothing: float = 2.0) -> None:
        super().__init__()
        self.displacement = Displacement(smoothing)
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.displacement(x))
