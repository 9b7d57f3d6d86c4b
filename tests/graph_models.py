"""Small models with skip connections, shared by the graph tests and the U-Net benchmark.

``UNet3d``: a 3-level encoder-decoder with skip concatenations, GroupNorm, trilinear upsampling and
periodic (circular) padding, as a cosmological field reconstruction would use; ``ResNet3d``: residual
blocks (``x + f(x)``) with BatchNorm and a strided conv, ending in a dense head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _conv_block(c_in: int, c_out: int, groups: int, padding_mode: str) -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(c_in, c_out, 3, padding=1, padding_mode=padding_mode),
                         nn.GroupNorm(groups, c_out), nn.LeakyReLU(0.1))


class UNet3d(nn.Module):
    """Levels of ``width * 2**level`` channels; the input extent must divide by ``2**(levels - 1)``."""

    def __init__(self, c_in: int = 1, c_out: int = 1, width: int = 4, levels: int = 3,
                 padding_mode: str = "circular", groups: int = 2) -> None:
        super().__init__()
        chans = [width * 2**i for i in range(levels)]
        self.enc = nn.ModuleList()
        prev = c_in
        for c in chans:
            self.enc.append(_conv_block(prev, c, groups, padding_mode))
            prev = c
        self.pool = nn.ModuleList(nn.AvgPool3d(2) for _ in chans[1:])
        self.up = nn.ModuleList(nn.Upsample(scale_factor=2, mode="trilinear", align_corners=False)
                                for _ in chans[1:])
        self.dec = nn.ModuleList(_conv_block(chans[i] + chans[i + 1], chans[i], groups, padding_mode)
                                 for i in reversed(range(levels - 1)))
        self.head = nn.Conv3d(chans[0], c_out, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skips = []
        for i, block in enumerate(self.enc):
            if i:
                x = self.pool[i - 1](x)
            x = block(x)
            skips.append(x)
        skips.pop()
        for up, block in zip(self.up, self.dec):
            x = block(torch.cat([skips.pop(), up(x)], dim=1))
        return self.head(x)


class Residual(nn.Module):
    """``x + f(x)``; with ``gate``, ``f(x)`` is scaled per channel by a squeeze-and-excitation gate (a
    whole-volume average, a 1x1x1 conv and a sigmoid: a replicated value multiplied into split ones)."""

    def __init__(self, c: int, gate: bool = False) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(c, c, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm3d(c)
        self.act = nn.ReLU()
        self.conv2 = nn.Conv3d(c, c, 3, padding=1)
        self.gate = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Conv3d(c, c, 1), nn.Sigmoid()) if gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv2(self.act(self.bn(self.conv1(x))))
        if self.gate is not None:
            h = h * self.gate(h)
        return self.act(x + h)


class ResNet3d(nn.Module):
    """stem -> residual -> strided conv -> gated residual -> global pool -> linear."""

    def __init__(self, c_in: int = 1, width: int = 4, outputs: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv3d(c_in, width, 3, padding=1)
        self.block1 = Residual(width)
        self.down = nn.Conv3d(width, 2 * width, 3, stride=2, padding=1)
        self.block2 = Residual(2 * width, gate=True)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.head = nn.Linear(2 * width, outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.block2(self.down(self.block1(self.stem(x))))
        return self.head(torch.flatten(self.pool(x), 1))


class FunctionalNet(nn.Module):
    """Layers called as functions in the forward (``F.max_pool3d``, ``F.interpolate``,
    ``F.adaptive_avg_pool3d``, ``F.leaky_relu``, ``torch.cat``): each runs as its split layer."""

    def __init__(self, c_in: int = 1, c_out: int = 1, width: int = 4) -> None:
        super().__init__()
        self.conv1 = nn.Conv3d(c_in, width, 3, padding=1)
        self.conv2 = nn.Conv3d(width, width, 3, padding=1)
        self.gate = nn.Conv3d(width, width, 1)
        self.out = nn.Conv3d(2 * width, c_out, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = F.leaky_relu(self.conv1(x), 0.1)
        m = self.conv2(F.max_pool3d(e, 2))
        m = m * torch.sigmoid(self.gate(F.adaptive_avg_pool3d(m, 1)))
        up = F.interpolate(m, scale_factor=2, mode="trilinear", align_corners=False)
        return self.out(torch.cat([e, up], dim=1))


def CosmoUNet() -> nn.Module:  # noqa: N802 (named like the other model classes the tests look up)
    """The reconstruction task's U-Net (two convs per level, max-pooling), small enough for a test."""
    from cosmoflow.unet import UNet3d as AppUNet  # noqa: PLC0415

    return AppUNet(1, 1, width=4, levels=3, max_width=16, groups=2)


class SizedUNet(nn.Module):
    """A user's U-Net whose calls take their arguments from shapes, traced: an odd-size guard's
    ``F.pad`` and ``F.interpolate`` back to the skip's size. At each input size these calls stand for
    layers of other settings than at the build size."""

    def __init__(self, out_channels: int = 1) -> None:
        super().__init__()
        self.enc, self.mid = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 3, 3, padding=1)
        self.out = nn.Conv3d(6, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.enc(x))
        d, h, w = s.shape[2:]
        m = torch.relu(self.mid(F.avg_pool3d(F.pad(s, (0, w % 2, 0, h % 2, 0, d % 2)), 2)))
        return self.out(torch.cat([s, F.interpolate(m, size=s.shape[2:], mode="trilinear")], 1))


class GuardedUNet(SizedUNet):
    """The same U-Net with Python branches on shapes torch.fx cannot trace (run by module swapping): the
    odd-size guard taken or not, one more pass of ``mid`` where the pooled volume is deep, and ``deep``
    (only on a volume of 20 voxels or more in depth, to test a layer a build of fewer never met)."""

    def __init__(self) -> None:
        super().__init__()
        self.deep = nn.Conv3d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.enc(x))
        if s.shape[2] % 2:
            s = F.pad(s, (0, 0, 0, 0, 0, 1))
        m = torch.relu(self.mid(F.max_pool3d(s, 2)))
        if m.shape[2] > 4:
            m = torch.relu(self.mid(m))
        if x.shape[2] >= 20:
            m = self.deep(m)
        return self.out(torch.cat([s, F.interpolate(m, size=s.shape[2:], mode="trilinear")], 1))


class Bottleneck(nn.Module):
    """Two pools to a bottleneck too thin to split at a small build size (replicated there, gathered), that
    a larger input could split: the built engine keeps it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1)
        self.c = nn.Conv3d(4, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.a(x))
        m = torch.relu(self.b(F.max_pool3d(F.max_pool3d(s, 2), 2)))
        return self.c(F.pad(torch.cat([s, F.interpolate(m, scale_factor=4, mode="nearest")], 1), (1,) * 6))


class CheckedBottleneck(Bottleneck):
    """The same behind a check on the input's channels, which torch.fx cannot trace (run by module
    swapping): its bottleneck's layers run whole at a small build, whole at every size after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 1:
            raise ValueError("one channel in")
        return super().forward(x)


class Untraceable(nn.Module):
    """A residual encoder-decoder whose forward branches in Python on a tensor's rank (torch.fx cannot
    follow it): run by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(1, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4),
                                 nn.ReLU())
        self.down, self.mid = nn.MaxPool3d(2), nn.Conv3d(4, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.dec = nn.Conv3d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.enc(x)
        m = self.mid(self.down(e))
        if m.dim() == 5:  # a Python branch on a tensor: torch.fx refuses it
            m = torch.relu(m) + m
        return self.dec(torch.cat([e, self.up(m)], dim=1))


class GradNormed(torch.autograd.Function):
    """Identity forward; backward: the gradient over its norm, a reduction over the whole volume that a
    shard's gradient alone would get wrong."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (torch's signature)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g / g.norm()
