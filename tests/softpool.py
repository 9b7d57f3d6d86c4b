"""A user's own window layer and its split version, written outside the hybridpar package with only its
public names, as a user's module would be: SoftPool3d (Stergiou et al. 2021, each window's voxels
weighted by their softmax) and DistSoftPool3d, registered in one call at import. test_own_layer.py
checks that the library takes them end to end."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp


class SoftPool3d(nn.Module):
    """Softmax-weighted pooling: ``sum(e^x * x) / sum(e^x)`` over each window (zero padding adds
    nothing to either sum)."""

    def __init__(self, kernel: int = 3, stride: int = 2, padding: int = 1) -> None:
        super().__init__()
        self.kernel, self.stride, self.padding = kernel, stride, padding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)
        num = F.avg_pool3d(e * x, self.kernel, self.stride, self.padding)
        return num / F.avg_pool3d(e, self.kernel, self.stride, self.padding)


class DistSoftPool3d(hp.nn.SpatialLayer, SoftPool3d):
    """SoftPool3d on a spatially split input: both sums over each rank's shard with its halos."""

    def __init__(self, kernel: int = 3, stride: int = 2, padding: int = 1, *, grid: hp.ProcessGrid) -> None:
        SoftPool3d.__init__(self, kernel, stride, padding)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(x)
        both = self.with_halos(torch.cat([e * x, e], dim=1))  # halos, and zeros beyond the faces
        w = self.window()                                     # SoftPool3d's entry's, per dim
        num, den = F.avg_pool3d(both, [a.kernel for a in w], [a.stride for a in w]).chunk(2, dim=1)
        return num / den


def window(m: SoftPool3d) -> tuple[hp.nn.Window, ...]:
    """The window, once: the planner, the FLOP counter and DistSoftPool3d all read it."""
    return (hp.nn.Window(m.kernel, m.stride, m.padding, m.padding),) * 3


def flops(m: SoftPool3d, x: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, int], None]:
    """Two window sums per output voxel, an exponential and a product per input voxel."""
    return {"forward_other": 2 * m.kernel ** 3 * y.numel() + 2 * x.numel()}, None


def to_dist(m: SoftPool3d, grid: hp.ProcessGrid, overlap: bool = False) -> DistSoftPool3d:
    return DistSoftPool3d(m.kernel, m.stride, m.padding, grid=grid)


hp.nn.register(SoftPool3d, role="window", op="pool", window=window, flops=flops, to_dist=to_dist)


class SharpPool3d(SoftPool3d):
    """SoftPool3d with learnable parameters on both sides of the halo exchange, as a user's layer has
    them: a per-channel sharpness ``beta`` (``e^(beta x)``, computed on the shard before its halos are
    exchanged) and a per-channel ``gain`` on the pooled output."""

    def __init__(self, channels: int, kernel: int = 3, stride: int = 2, padding: int = 1) -> None:
        super().__init__(kernel, stride, padding)
        self.beta = nn.Parameter(torch.linspace(0.5, 1.5, channels))
        self.gain = nn.Parameter(torch.linspace(1.0, 2.0, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.beta.view(1, -1, 1, 1, 1) * x)
        num = F.avg_pool3d(e * x, self.kernel, self.stride, self.padding)
        return self.gain.view(1, -1, 1, 1, 1) * num / F.avg_pool3d(e, self.kernel, self.stride, self.padding)


class DistSharpPool3d(hp.nn.SpatialLayer, SharpPool3d):
    """SharpPool3d split, written with the public recipe only: no call about its parameters' gradients."""

    def __init__(self, channels: int, kernel: int = 3, stride: int = 2, padding: int = 1, *,
                 grid: hp.ProcessGrid) -> None:
        SharpPool3d.__init__(self, channels, kernel, stride, padding)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.exp(self.beta.view(1, -1, 1, 1, 1) * x)
        both = self.with_halos(torch.cat([e * x, e], dim=1))
        w = self.window()
        num, den = F.avg_pool3d(both, [a.kernel for a in w], [a.stride for a in w]).chunk(2, dim=1)
        return self.gain.view(1, -1, 1, 1, 1) * num / den


hp.nn.register(SharpPool3d, role="window", op="pool", window=window, flops=flops,
               to_dist=lambda m, grid, overlap=False: DistSharpPool3d(m.beta.numel(), m.kernel, m.stride,
                                                                      m.padding, grid=grid))
