"""The reconstruction network: a 3D U-Net written as an ordinary ``nn.Module``.

Why a U-Net: reconstructing the initial density field from the evolved one maps a volume to a volume
of the same size, and the map is non-local (particles moved by several Mpc/h, so a voxel's initial
density is written in a neighbourhood of tens of voxels around it) yet must keep voxel-scale detail.
The encoder's pooling levels reach the displacement scale cheaply, the skip concatenations carry the
full-resolution detail past them (Ronneberger et al. 2015, Çiçek et al. 2016).

Every choice keeps it a plain torch model that hybridpar parallelizes from a spec, with no
hand-written distributed layer:

* convolutions pad circularly: the universes are periodic boxes, so split over ranks the halos wrap
  around the faces and a voxel at a face sees its true neighbours;
* GroupNorm, not BatchNorm: the statistics are per sample (over its whole volume, all-reduced across
  the spatial shards), so they do not depend on a batch of one or two volumes per replica;
* trilinear upsampling followed by a convolution rather than a transposed convolution, which avoids
  checkerboard artefacts (Odena et al. 2016) in a field whose power spectrum is measured afterwards.
"""

from __future__ import annotations

import torch
from torch import nn


class ConvBlock(nn.Sequential):
    """Two ``conv k3 -> GroupNorm -> LeakyReLU`` units at one resolution."""

    def __init__(self, c_in: int, c_out: int, groups: int, padding_mode: str, slope: float) -> None:
        layers: list[nn.Module] = []
        for c in (c_in, c_out):
            layers += [nn.Conv3d(c, c_out, 3, padding=1, padding_mode=padding_mode, bias=False),
                       nn.GroupNorm(groups, c_out), nn.LeakyReLU(slope)]
        super().__init__(*layers)


class UNet3d(nn.Module):
    """A ``levels``-level U-Net: level ``i`` has ``min(width·2^i, max_width)`` channels at extent S/2^i.

    The input extent must be divisible by ``2^(levels-1)``; the output has ``out_channels`` channels at
    the input's extent. ``padding_mode="circular"`` for periodic volumes, ``"zeros"`` otherwise.
    """

    def __init__(self, in_channels: int = 1, out_channels: int = 1, width: int = 8, levels: int = 4,
                 max_width: int = 128, groups: int = 4, padding_mode: str = "circular",
                 slope: float = 0.1) -> None:
        super().__init__()
        if levels < 2:
            raise ValueError(f"UNet3d: levels must be at least 2 (one pooling level), got {levels}")
        if padding_mode not in ("zeros", "circular"):
            raise ValueError(f"UNet3d: padding_mode must be 'zeros' or 'circular', got {padding_mode!r}")
        self.levels = levels
        chans = [min(width * 2 ** i, max_width) for i in range(levels)]
        self.encoder = nn.ModuleList()
        prev = in_channels
        for c in chans:
            self.encoder.append(ConvBlock(prev, c, groups, padding_mode, slope))
            prev = c
        self.down = nn.ModuleList(nn.MaxPool3d(2) for _ in chans[1:])
        self.up = nn.ModuleList(nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
                                for _ in chans[1:])
        self.decoder = nn.ModuleList(ConvBlock(chans[i] + chans[i + 1], chans[i], groups, padding_mode, slope)
                                     for i in reversed(range(levels - 1)))
        self.head = nn.Conv3d(chans[0], out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.encoder):
            if i:
                x = self.down[i - 1](x)
            x = block(x)
            skips.append(x)
        skips.pop()
        for up, block in zip(self.up, self.decoder):
            x = block(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)

    def check_extent(self, extent: int) -> None:
        """Raise a one-line error when a cube of side ``extent`` cannot pass the pooling levels."""
        step = 2 ** (self.levels - 1)
        if extent < step or extent % step:
            lower = extent // step * step
            fits = " or ".join(str(v) for v in (lower, lower + step) if v > 0)
            raise ValueError(f"UNet3d: {self.levels} levels halve the volume {self.levels - 1} times, so its "
                             f"side must divide by {step}; {extent} does not (sizes that fit: {fits})")
