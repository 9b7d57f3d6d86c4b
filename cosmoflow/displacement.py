"""The Zel'dovich displacement of the smoothed z = 0 field, as three more input channels of the U-Net.

Why: the map from today's field to the initial one is non-local (matter moved several Mpc/h), and a
CNN on the raw field learns it poorly; standard reconstruction (Eisenstein et al. 2007) first moves
the matter back along the displacement the linear theory infers from the smoothed field,
ψ(k) = i k / k² · δ(k) W(kR), and a network after it reaches twice the scale (Shallue & Eisenstein
2023). The displacement depends on the whole box, so on a split volume it is computed by the
distributed FFT (:mod:`hybridpar.fft`); :class:`Displacement` is registered with its split version,
so that the reconstruction model stays an ordinary module that ``hp.parallelize`` splits.

With ``reach`` > 0 the layer also takes standard reconstruction's own step: the z = 0 field moved
back along ψ, its channel 0 read at q + ψ(q) (trilinear; ψ clamped to [-reach, reach - 1] voxels). In a
Zel'dovich world the matter now at q + ψ(q) started near q, so that field is the initial one seen
through a local map, which the U-Net can learn, where the raw field scrambles it over several voxels.
On a split volume the read takes a halo of ``reach`` voxels (periodic, the box's own wrap).

The input's channel 0 is the loader's ``log1p(counts)`` at z = 0; δ = counts / mean - 1 (the mean
over the sample's whole volume); ψ is in voxels, ``smoothing`` R in voxels too.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import hybridpar as hp
from hybridpar.comm.halo import exchange
from hybridpar.comm.reduce import replicated_into_shards, sum_to_replicated
from hybridpar.geometry import HaloPlan, window_plans
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


def shifted(padded: torch.Tensor, psi: torch.Tensor, reach: int) -> torch.Tensor:
    """The field at q + ψ(q) (N, 1, d, h, w), trilinear, of a block whose field ``padded`` (N, 1,
    d + 2 reach, h + 2 reach, w + 2 reach) holds ``reach`` more voxels on every side; ψ (N, 3, d, h, w)
    in voxels, clamped to [-reach, reach - 1] so that every read falls inside ``padded``. The integer
    part of the shift and its fraction come from ψ alone, so a shard's read equals the whole's."""
    n = padded.shape[0]
    (d, h, w), (hp_, wp) = psi.shape[2:], padded.shape[3:]
    psi = psi.clamp(-reach, reach - 1)
    whole = torch.floor(psi)
    frac = psi - whole
    on = {"device": psi.device, "dtype": torch.long}
    at = [whole[:, i].long() + (torch.arange(e, **on) + reach).view(shape)
          for i, (e, shape) in enumerate(zip((d, h, w), ((-1, 1, 1), (1, -1, 1), (1, 1, -1)), strict=True))]
    flat = padded.reshape(n, -1)
    out = 0
    for corner in range(8):
        step = [(corner >> (2 - i)) & 1 for i in range(3)]
        index = ((at[0] + step[0]) * hp_ + at[1] + step[1]) * wp + at[2] + step[2]
        weight = math.prod(frac[:, i] if s else 1 - frac[:, i] for i, s in enumerate(step))
        out = out + weight * torch.gather(flat, 1, index.reshape(n, -1)).view(n, d, h, w)
    return out.unsqueeze(1)


class Displacement(nn.Module):
    """Appends ψ_x, ψ_y, ψ_z of the smoothed z = 0 field (channel 0, ``log1p`` counts) to the input,
    and with ``reach`` > 0 that channel moved back along ψ (:func:`shifted`)."""

    def __init__(self, smoothing: float = 2.0, reach: int = 0) -> None:
        super().__init__()
        self.smoothing = float(smoothing)
        self.reach = int(reach)
        if self.reach < 0:
            raise ValueError(f"Displacement: reach must be >= 0 voxels (0: no shifted channel), got {reach}")

    @property
    def added_channels(self) -> int:
        """Channels appended to the input: ψ's three, and the shifted field where ``reach`` > 0."""
        return 3 + (self.reach > 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.expm1(x[:, :1].double())
        modes = torch.fft.rfftn(counts, dim=(-3, -2, -1))
        d, h, w = x.shape[2:]
        k = hp.fft.wavenumbers((d, h, w), torch.float64, x.device)
        psi = displacement_modes(modes, *k, counts.sum((1, 2, 3, 4)), (d, h, w), self.smoothing)
        psi = torch.fft.irfftn(psi, s=(d, h, w), dim=(-3, -2, -1))
        if self.reach:
            r = self.reach
            if min(d, h, w) < r:
                raise ValueError(f"Displacement: reach {r} is wider than the volume {(d, h, w)}; use a reach "
                                 f"of at most {min(d, h, w)} voxels")
            padded = nn.functional.pad(x[:, :1].double(), (r,) * 6, mode="circular")
            psi = torch.cat([psi, shifted(padded, psi, r)], dim=1)
        return torch.cat([x, psi.to(x.dtype)], dim=1)

    def extra_repr(self) -> str:
        return f"smoothing={self.smoothing}" + (f", reach={self.reach}" if self.reach else "")


class DistDisplacement(SpatialLayer, Displacement):
    """:class:`Displacement` of a split volume: the sums per sample all-reduced, ψ by ``hp.fft``."""

    def __init__(self, smoothing: float = 2.0, reach: int = 0, *, grid: ProcessGrid | None = None) -> None:
        Displacement.__init__(self, smoothing, reach)
        self.init_spatial(grid, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        counts = torch.expm1(x[:, :1].double())
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        # the total scales every shard's modes: each shard's gradient of it is partial, summed back
        total = replicated_into_shards(sum_to_replicated(counts.sum((1, 2, 3, 4)), group), group)
        spec = hp.fft.rfftn(counts, self.grid, shape)
        psi = displacement_modes(spec.data, *spec.wavenumbers(), total, shape, self.smoothing)
        psi = hp.fft.irfftn(spec.replace(psi), self.grid)
        if self.reach:
            padded = exchange(x[:, :1].double(), self.exchanger(shape, self._reach_plans, key=("reach",)))
            psi = torch.cat([psi, shifted(padded, psi, self.reach)], dim=1)
        return torch.cat([x, psi.to(x.dtype)], dim=1)

    def _reach_plans(self, n: int, parts: int, dim: str) -> list[HaloPlan]:
        """``reach`` voxels more on every side, wrapped around the periodic box: a window of
        2 reach + 1 voxels padded circularly (refused, naming the dim, where a neighbour holds fewer)."""
        r = self.reach
        return window_plans(n, parts, 2 * r + 1, 1, r, r, layer=self.layer_name, dim=dim, mode="circular")


def _flops(m: Displacement, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, int], None]:
    volume = x.shape[2] * x.shape[3] * x.shape[4]
    fft = 5 * x.shape[0] * 4 * volume * math.log2(max(2, volume))
    return {"forward_other": int(fft + (x.shape[0] * 8 * 3 * volume if m.reach else 0))}, None


hp.nn.register(Displacement, role="pointwise", op="pointwise", flops=_flops,
               to_dist=lambda m, grid, overlap=False: DistDisplacement(m.smoothing, m.reach, grid=grid),
               transposes=lambda m, shape, split: hp.fft.transpose_elements(shape[2:], split, 1, 3))


class WithDisplacement(nn.Module):
    """A network fed its input and the input's displacement channels (``unet.displacement``)."""

    def __init__(self, net: nn.Module, displacement: Displacement) -> None:
        super().__init__()
        self.displacement = displacement
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.displacement(x))
