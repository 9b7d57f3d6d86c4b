"""Forwards torch.fx cannot trace, as users write them, run split exactly (hybridpar.pipeline.split_forward).

A shape check anywhere in a forward (``if x.shape[2] % 2``) makes it untraceable; the engine then runs
the model's own forward on shards, at the top level or as a block inside a traced model (a block of
several inputs, ``up(h, skip)``: the whole model's forward). There, shape
reads answer the volume's extents, and ``F.pad``, ``F.interpolate`` to a skip's size, functional pools
and convs, reductions over the volume (a hand-written instance norm's ``std`` too), ``cat``, ``stack``
and ``chunk`` along channels, the model's own parameters, layers of the user's own type and a volume
flattened into Linear layers all give what one process gives: three SGD steps in float64, every loss,
every parameter and the predictions, on 2 ranks, 2x2x1 and data x spatial, with odd and uneven
extents. Other calls run on the gathered volume; what neither makes exact is refused before any step,
in one line naming the call and its line.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp

from layer_cases import Failures
from test_user_models import _compare

SHAPE = (2, 2, 9, 8, 6)  # D odd: the guard pads it to 10; split 2 ways along D, 5 + 4 before the pad


class UserUNet(nn.Module):
    """A small U-Net as users write it: an odd-size guard, a functional pool, ``interpolate`` to the
    skip's size, a branch on a shape, a reduction kept in the graph, a gate, a functional conv with
    its own weight, a learnable per-channel scale, ``chunk`` and ``stack``, and back to the input size."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(2, 4, 3, padding=1)
        self.down = nn.Conv3d(4, 4, 3, padding=1)
        self.dec = nn.Conv3d(8, 4, 3, padding=1)
        self.w = nn.Parameter(torch.randn(2, 4, 3, 3, 3) * 0.2)
        self.b = nn.Parameter(torch.randn(2) * 0.1)
        self.gamma = nn.Parameter(torch.ones(1, 4, 1, 1, 1) + 0.1 * torch.randn(1, 4, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[2:]
        if x.shape[2] % 2:  # even out odd depths for the pool
            x = F.pad(x, (0, 0, 0, 0, 0, 1), mode="replicate")
        e = F.relu(self.enc(x))
        d = F.relu(self.down(F.max_pool3d(e, 2)))
        if d.shape[2] > 4:  # deep enough: one more pass (on a shard of 5, 2 or 3 would say otherwise)
            d = F.relu(self.down(d))
        d = d - d.mean(dim=(2, 3, 4), keepdim=True)  # centred over the volume
        u = F.interpolate(d, size=e.shape[2:], mode="trilinear", align_corners=False)
        h = F.relu(self.dec(torch.cat([u, e], dim=1))) * self.gamma
        h = h * torch.sigmoid(F.adaptive_avg_pool3d(h, 1))  # a squeeze-and-excitation gate
        a, b = h.chunk(2, dim=1)
        h = torch.cat([torch.stack([a, b]).sum(0), h[:, 2:]], dim=1)
        h = h / (1 + h.amax(dim=(1, 2, 3, 4), keepdim=True))
        out = F.conv3d(h, self.w, self.b, padding=1)
        out = F.interpolate(out, size=size, mode="trilinear", align_corners=False)
        norm = torch.linalg.vector_norm(h, dim=(2, 3, 4), keepdim=True)  # per sample: the batch may be split
        return out + norm[:, :2] * 1e-2


class _Untraceable(nn.Module):
    """A block without weights of its own that torch.fx cannot trace (a branch on its input's depth)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size = x.shape[2:]
        if x.shape[2] % 2:
            x = F.pad(x, (0, 0, 0, 0, 0, 1))
        y = F.relu(self.conv(F.avg_pool3d(x, 2)))
        if y.shape[2] >= 5:
            y = y * 2
        y = (y - y.mean(dim=(2, 3, 4), keepdim=True)) / (y.std(dim=(2, 3, 4), keepdim=True) + 1e-3)
        return F.interpolate(y, size=size, mode="nearest")


class NestedUNet(nn.Module):
    """A traced model whose middle block torch.fx cannot trace: that block runs by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(2, 4, 3, padding=1)
        self.block = _Untraceable()
        self.head = nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        return self.head(self.block(h))


class DeepBranch(nn.Module):
    """Adds a layer when the input is deep enough (9 on the volume, 5 or 4 on a shard of two)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.extra = nn.Conv3d(2, 1, 3, padding=1), nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.conv(x)
        if x.shape[2] > 6:
            u = self.extra(u) * (u.size(2) / 8)
        return u / (1 + u.abs().amax()) + u.norm() * 1e-2 + u.var(unbiased=False)  # the whole batch's


class FlatRegressor(nn.Module):
    """A CosmoFlow-like regressor as users write it: a size check, then the pooled volume flattened by
    ``torch.flatten`` and ``view`` into Linear layers (gathered first, as a traced graph would)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4 * 3, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if min(x.shape[2:]) < 4:
            raise ValueError(f"input {tuple(x.shape)} too small")
        h = F.max_pool3d(F.relu(self.conv(x)), 2)
        h = torch.relu(self.fc(torch.flatten(h, 1)))
        return self.out(h.view(h.size(0), -1))


class ChannelScale(nn.Module):
    """A layer of the user's own with a parameter, not registered."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(1, c, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class ResidualScale(nn.Module):
    """A block of the user's own with a child and a parameter of its own (the graph keeps it whole)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(c, c, 3, padding=1)
        self.gamma = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gamma * self.conv(x)


class Squeeze(nn.Module):
    """A module of the user's own whose output is a reduction over the volume (replicated)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3, 4), keepdim=True)


class OwnLayersNet(nn.Module):
    """A traced model made of the user's own unregistered modules: each runs its own forward split."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(2, 4, 3, padding=1)
        self.scale, self.res, self.squeeze = ChannelScale(4), ResidualScale(4), Squeeze()
        self.fc, self.head = nn.Conv3d(4, 4, 1), nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.res(self.scale(torch.relu(self.stem(x))))
        return self.head(h * torch.sigmoid(self.fc(self.squeeze(h))))


class Idioms(nn.Module):
    """More of what users write between layers: a tensor made from the volume's shape without a device,
    tensors made from its shape, dtype and device (``arange``, ``new_ones``), functional group and
    instance norms without weights, a position parameter the size of the volume, a max, a repeat, an
    expand, a channel selected and clamped in place, and a normalisation along channels, a downsampling
    interpolate, a channel mean viewed back to N, C, D, H, W, and attention over the flattened voxels
    (both gathered)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)
        self.pos = nn.Parameter(0.1 * torch.randn(1, 4, *SHAPE[2:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)) + self.pos
        if h.shape[2] % 2:
            h = torch.cat([h, torch.zeros(h.shape[0], 1, *h.shape[2:])], dim=1)[:, :4]
        depth = torch.arange(h.shape[2], dtype=h.dtype, device=h.device)  # a position along the volume
        h = h * h.new_ones(h.shape) + 0.01 * depth.view(1, 1, -1, 1, 1)
        h = F.group_norm(h, 2) + 0.5 * F.instance_norm(h)  # statistics over the volume, no weights
        h = F.normalize(h * h.max(dim=1, keepdim=True).values, dim=1)
        h = h[:, :2].repeat(1, 2, 1, 1, 1) + h.expand(-1, -1, -1, -1, -1)
        h.select(1, 0).clamp_(min=-0.5)  # a channel's plane, written in place through the view
        h = F.interpolate(F.interpolate(h, scale_factor=0.5, mode="trilinear"), size=h.shape[2:])
        n, c, d, hh, w = h.shape
        h = h + h.mean(1).view(n, 1, d, hh, w)  # a channel reduced, viewed back to a volume (gathered)
        t = h.flatten(2).transpose(1, 2)  # (n, voxels, c)
        t = torch.softmax(t @ t.transpose(1, 2) / c, dim=-1) @ t
        return t.transpose(1, 2).reshape(n, c, d, hh, w)[:, :1]


class Planes(nn.Module):
    """Layers and calls on split activations that are not volumes (``h.mean(1)``: the depth become the
    channels of 2-d planes): a bilinear upsampling layer and its function, 2-d pools, a PReLU of a
    weight per depth, a group norm and a softmax along the split depth, a 2-d pad, a functional conv2d
    of the model's weight, each run on the gathered planes (per sample: a batch in parts runs them); an
    activation runs on the shard's planes, and a mean per sample over them."""

    def __init__(self) -> None:
        super().__init__()
        depth = SHAPE[2]
        self.c1, self.c2 = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)
        self.act, self.up = nn.Tanh(), nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False)
        self.pool, self.prelu = nn.AvgPool2d(2), nn.PReLU(depth, init=0.1)
        self.norm, self.soft = nn.GroupNorm(3, depth), nn.Softmax(dim=1)
        self.k = nn.Parameter(0.05 * torch.randn(depth, depth, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        if h.shape[2] % 2:  # a branch on a shape: module swapping
            h = h * 1.5
        a = self.act(h.mean(1))  # (N, D, H, W)
        b = self.norm(self.prelu(self.pool(self.up(a)))) + self.soft(a)
        b = F.pad(b, (1, 1, 0, 0), mode="replicate")[..., 1:-1] + \
            F.interpolate(a, scale_factor=2, mode="bilinear")[..., ::2, ::2]
        b = b + F.conv2d(F.max_pool2d(b, 3, 1, 1), self.k, padding=1)
        g = b.square().mean(dim=(1, 2, 3)).view(-1, 1, 1, 1, 1)
        return self.c2(h * (1 + g) + b.unsqueeze(1))


class SeveralInputs(nn.Module):
    """Layers of several inputs whose split one is not the first: attention of learned queries over the
    voxels (keys and values a reshape of the volume, read whole), and a bilinear form of a whole tensor
    and the volume's channels last (both read whole: the layer runs on the gathered volume); layers
    given their input by keyword (``conv(input=h)``), with a shape check (module swapping) and without
    (a traced graph)."""

    def __init__(self, check: bool = True) -> None:
        super().__init__()
        self.check = check
        self.c1, self.c2 = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)
        self.queries = nn.Parameter(torch.randn(1, 2, 4))
        self.attend, self.form = nn.MultiheadAttention(4, 1, batch_first=True), nn.Bilinear(4, 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(input=x))
        if self.check and h.shape[2] % 2:  # a branch on a shape: module swapping
            h = h * 1.5
        n, last = h.shape[0], h.permute(0, 2, 3, 4, 1)
        o, _ = self.attend(self.queries.expand(n, -1, -1), h.flatten(2).transpose(1, 2), h.flatten(2).mT)
        f = self.form(torch.full_like(last, 0.3), input2=last).permute(0, 4, 1, 2, 3)
        return self.c2(input=h * o.mean(1).view(n, 4, 1, 1, 1) + f)


def TracedSeveralInputs() -> SeveralInputs:  # noqa: N802 (a model's name, as the cases spell them)
    return SeveralInputs(check=False)


class Mixer(nn.Module):
    """A registered layer of the user's own whose weight lives in a module of its own."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.weights = nn.ParameterDict({"mix": nn.Parameter(torch.eye(c) + 0.1 * torch.randn(c, c))})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("ncdhw,ck->nkdhw", x, self.weights["mix"])


class DistMixer(hp.nn.SpatialLayer):
    """Its split version: a SpatialLayer alone (not a Mixer), holding the same module, reading the
    shape of its input (its shard's, inside the layer) as it works."""

    def __init__(self, m: Mixer, grid) -> None:
        super().__init__()
        self.weights = m.weights
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(x.shape[0], self.weights["mix"].shape[1], *x.shape[2:])
        return out + torch.einsum("ncdhw,ck->nkdhw", x, self.weights["mix"])


hp.nn.register(Mixer, role="window", op="pointwise", window=lambda m: (hp.nn.Window(1, 1, 0, 0),) * 3,
                 to_dist=lambda m, grid, overlap: DistMixer(m, grid),
                 flops=lambda m, x, y: ({"forward_other": 2 * x.numel() * y.shape[1]}, None))


class HeldWeights(nn.Module):
    """An untraceable forward calling a split layer that holds its weight in a module of its own and
    is no subclass of the layer it splits: its shape reads are its shard's, its output is split (a
    residual adds it to a split activation). Even extents: a shard taken for a whole value would not
    show in its size: H, 8, splits 4 + 4."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.mix = Mixer(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[3] > 4:  # untraceable (a shard of 4 would say otherwise)
            h = self.mix(h) + h
        return h


class VolumeMean(nn.Module):
    """An untraceable forward that returns a reduction over the volume: a replicated output."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        return h.mean((2, 3, 4), keepdim=True) if x.shape[2] > 1 else h


class CallSettings(nn.Module):
    """Calls that differ only in settings a layer's repr leaves out (``align_corners``,
    ``count_include_pad``), a split layer's own weights read again outside it (a tied functional
    conv, its bias on a reduction), a parameter made ``.to(h)`` and reduced, and NumPy's argument
    names (``tensors=``, ``axis=``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.p = nn.Parameter(1 + 0.1 * torch.randn(1, 2, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            a = F.interpolate(h, scale_factor=2, mode="trilinear", align_corners=True)
            b = F.interpolate(h, scale_factor=2, mode="trilinear", align_corners=False)
            h = F.avg_pool3d(a + 2 * b, 2)
        h = F.avg_pool3d(h, 3, 1, 1) + 3 * F.avg_pool3d(h, 3, 1, 1, count_include_pad=False)
        h = F.conv3d(h, self.conv.weight[:, :2], self.conv.bias, padding=1)  # the layer's weight again
        h = h + h.mean((2, 3, 4), keepdim=True) * self.conv.bias.view(1, -1, 1, 1, 1)
        g = self.p.to(h)
        t = torch.cat(tensors=[h, h * h], axis=1)
        return h * g + g.mean() - t.mean(axis=(1, 2, 3, 4), keepdims=True)


class Ties(nn.Module):
    """A maximum over the volume held by many voxels, unevenly over the shards (``torch.amax`` shares its
    gradient evenly between them: here between two parameters, by where the input is positive)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.a, self.b = nn.Parameter(torch.ones(())), nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            tied = torch.where(x[:, :1] > 0.3, self.a, self.b)  # a == b at first: every voxel the maximum
            h = h * tied.amax() + h.amin(dim=(2, 3, 4), keepdim=True)
        return h


class PooledConv(nn.Module):
    """A functional conv whose kernel is as wide as the pooled volume (W: 6 pooled to 3, split 2 + 1):
    its weight is no operand spanning the volume, not to be cut to the shard."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.w, self.b = nn.Parameter(0.2 * torch.randn(2, 3, 3, 3, 3)), nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[4] > 1:  # untraceable
            h = F.conv3d(F.max_pool3d(h, 2), self.w, self.b, padding=1)
        return F.interpolate(h, size=x.shape[2:])


class _Up(nn.Module):
    """A decoder block of two inputs with a shape check (torch.fx keeps it whole)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2 * c, c, 3, padding=1)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        if x.shape[2:] != skip.shape[2:]:  # odd extents: to the skip's size
            x = F.interpolate(x, size=skip.shape[2:], mode="trilinear")
        return torch.relu(self.conv(torch.cat([x, skip], 1)))


class TwoInputBlock(nn.Module):
    """A traceable U-Net whose decoder block reads the skip as a second input."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.mid = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 4, 3, padding=1)
        self.up, self.head = _Up(4), nn.Conv3d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.relu(self.enc(x))
        return self.head(self.up(torch.relu(self.mid(F.max_pool3d(s, 2))), s))


class ChannelCalls(nn.Module):
    """Calls along channels on a split activation: narrow, a list of channels, GLU, a gate broadcast by
    ``expand_as``; and logsumexp over the volume."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            g = torch.sigmoid(F.adaptive_avg_pool3d(h, 1)).expand_as(h)
            h = torch.cat([h.narrow(1, 0, 2) * g[:, [3, 1]], F.glu(h, dim=1)], 1)
            h = h - torch.logsumexp(h, dim=(2, 3, 4), keepdim=True) / 10
        return h


class TopLevelWeight(nn.Module):
    """A traceable forward reading a parameter of the model itself between layers."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.gamma = nn.Parameter(1 + 0.1 * torch.randn(1, 2, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) * self.gamma


class OwnGroupNorm(nn.GroupNorm):
    """A group norm of the user's with a forward of its own (in a wider dtype, then back)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x.double(), self.num_groups, self.weight.double(), self.bias.double(),
                            self.eps).type_as(x)


class Crops(nn.Module):
    """A valid-convolution U-Net: the skip centre-cropped to the decoder's size by slices computed from
    shapes, a strided box of voxels, a crop by negative padding, a channel slice with a crop, and norms
    of the user's own weights (a group norm subclass with its own forward, a functional instance norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(2, 4, 3)
        self.mid = nn.Conv3d(4, 4, 3, padding=1)
        self.up = nn.ConvTranspose3d(4, 4, 2, stride=2)
        self.dec = nn.Conv3d(8, 2, 1)
        self.norm = OwnGroupNorm(2, 2)
        self.w = nn.Parameter(1 + 0.1 * torch.randn(2))
        self.b = nn.Parameter(0.1 * torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = F.relu(self.enc(x))
        u = self.up(F.relu(self.mid(F.max_pool3d(s, 2))))
        if s.shape[2] != u.shape[2]:  # untraceable: the centre crop's offsets come from shapes
            dd = [(a - b) // 2 for a, b in zip(s.shape[2:], u.shape[2:])]
            s = s[:, :, dd[0]:dd[0] + u.shape[2], dd[1]:dd[1] + u.shape[3], dd[2]:dd[2] + u.shape[4]]
        h = F.relu(F.instance_norm(self.dec(torch.cat([u, s], dim=1)), weight=self.w, bias=self.b))
        h = self.norm(h)
        k = h[:, :, 1::2, ::2, 1:]  # a strided box
        h = h + F.interpolate(k, size=h.shape[2:], mode="nearest")
        h = F.pad(h, (0, -1, -1, 0, 1, -2))  # crops and a pad at once
        return h[:, :1, 1:-1]


class ChannelsLast(nn.Module):
    """A ConvNeXt block (depthwise conv, permute to channels last, LayerNorm over channels, Linear MLP, a
    layer scale read in the forward, permute back) and a group norm written by hand (``view`` to groups,
    statistics, ``view_as`` back): values part way through reshapes, read whole where a call needs them."""

    def __init__(self) -> None:
        super().__init__()
        self.dw = nn.Conv3d(2, 2, 3, padding=1, groups=2)
        self.ln = nn.LayerNorm(2)
        self.fc1, self.fc2 = nn.Linear(2, 4), nn.Linear(4, 2)
        self.gamma = nn.Parameter(0.5 + 0.1 * torch.randn(2))
        self.head = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dw(x).permute(0, 2, 3, 4, 1)
        h = self.fc2(F.gelu(self.fc1(self.ln(h)))) * self.gamma
        h = x + h.permute(0, 4, 1, 2, 3)
        n = h.shape[0]
        g = h.view(n, 1, -1)
        g = (g - g.mean(-1, keepdim=True)) / torch.sqrt(g.var(-1, unbiased=False, keepdim=True) + 1e-5)
        return self.head(g.view_as(h))


class DeepHeads(nn.Module):
    """Deep supervision: heads at two scales returned as a dict in training, one volume and a 0-d weight
    penalty in eval, and a single-channel head squeezed to (N, D, H, W) for a BCE target: returned
    volumes that are not alike, read whole by the loss (as a traced forward's are)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(2, 4, 3, padding=1)
        self.full, self.coarse = nn.Conv3d(4, 1, 1), nn.Conv3d(4, 1, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | dict[str, torch.Tensor]:
        h = torch.relu(self.enc(x))
        if h.shape[2] % 2:  # untraceable
            h = h * 1.5
        out = self.full(h)
        if self.training:
            return {"full": out, "half": self.coarse(F.avg_pool3d(h, 2)), "mask": out.squeeze(1)}
        return out, self.full.weight.square().sum()  # a 0-d value beside the volume (a weight penalty)


def deep_loss(out: tuple | dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    if not isinstance(out, dict):
        return F.mse_loss(out[0], y) + 1e-3 * out[1]
    mask = F.binary_cross_entropy_with_logits(out["mask"], (y[:, 0] > 0).to(y.dtype))
    return F.mse_loss(out["full"], y) + 0.5 * F.mse_loss(out["half"], F.avg_pool3d(y, 2)) + mask


class Writes(nn.Module):
    """Channels mixed per voxel by ``einsum`` with a parameter, and values written into boxes of the
    volume: a border zeroed, every other plane set to a learnable per-channel value (whose gradient
    comes from the shards the box meets; the others write an empty part), a channel overwritten."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.mix = nn.Parameter(0.5 * torch.randn(2, 3))
        self.fill = nn.Parameter(0.3 * torch.randn(1, 2, 1, 1, 1))
        self.head = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("ncdhw,oc->nodhw", torch.tanh(self.conv(x)), self.mix)
        if h.shape[2] > 1:  # untraceable
            h[:, :, :2] = 0.0
            h[:, :, -1:, 1::3] = self.fill
            h[:, 1:] = h[:, 1:] * 2
        return self.head(h)


class BroadcastPlanes(nn.Module):
    """A plane, a row and a column of the volume broadcast back over it (``h + h[:, :, -1:]``,
    ``expand_as``), along dims the grid splits and dims it does not: each shard broadcasts as the volume
    does where the operands agree along the split dims; else the plane is read whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if h.shape[2] > 4:  # untraceable
            h = h + h[:, :, -1:]  # the last depth plane
            h = h * h[:, :, :, :1].expand_as(h).sigmoid()  # the first row
            h = torch.where(h > 0, h, h[..., 2:3])  # a column, as the other branch
        return self.b(h)


class LayoutReads(nn.Module):
    """Reads of a split activation's extents that are not ``shape``: ``len`` of a value whose dim 0 is
    the split depth, the bytes it holds (traced too: ``nbytes`` in a graph), each the volume's."""

    def __init__(self, check: bool = True) -> None:
        super().__init__()
        self.check = check
        self.a, self.b = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.check and h.shape[2] > 4:  # untraceable: len() of a depth of 9, split 5 | 4
            h = h * (len(h[0, 0]) / 9)
        return self.b(h * (h.nbytes / (h.numel() * h.element_size())))


def TracedLayoutReads() -> LayoutReads:  # noqa: N802 (a model's name, as the cases spell them)
    return LayoutReads(check=False)


class Fills(nn.Module):
    """Tensors of one value made at the volume's extents (``h.new_zeros(h.shape)``, ``torch.zeros(n, 4,
    *h.shape[2:])``, a D, H, W mask) and written into: a valid conv's output put back into a padded
    frame, channels placed into a wider tensor, planes of a mask set (by a constant index made in the
    forward, on the model's device); whole tensors a volume is written into (a pad by hand, a ramp);
    boxes added to in place (``h[:, :, a:b] += v``, a learnable per-channel value among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.valid = nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3)
        self.shift = nn.Parameter(0.3 * torch.randn(1, 2, 1, 1, 1))
        self.head = nn.Conv3d(4, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            framed = h.new_zeros(h.shape)
            framed[:, :, 1:-1, 1:-1, 1:-1] = self.valid(h)
            mask = torch.zeros(h.shape[2:], dtype=h.dtype)
            mask[1:4] = 1.0
            mask[:, 2:] += 0.5
            mask.index_fill_(0, torch.tensor([0, 5]), 0.25)
            h = framed + h * mask
            padded = h.new_zeros(*h.shape[:2], *(s + 2 for s in h.shape[2:]))  # a pad by hand
            padded[:, :, 1:-1, 1:-1, 1:-1] = h  # a whole tensor: written whole, alike on every rank
            ramp = torch.linspace(0, 1, h.shape[-1], dtype=h.dtype).expand(h.shape).clone()
            ramp.add_(h)
            h = h + self.valid(padded) * ramp.mean(dim=(1, 2, 3, 4), keepdim=True)
            h[:, :, 1:-1, ::2] += self.shift
            h[:, :, :3] *= 2
        wide = torch.zeros(h.shape[0], 4, *h.shape[2:], dtype=h.dtype)
        wide[:, 1:3] = h
        return self.head(wide)


class Bottleneck(nn.Module):
    """Downsampled below the split (9 voxels along D over 4 ranks: 5, then 3): the bottleneck runs whole
    on the gathered volume, as a traced plan replicates it, and the decoder split again."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 3, 3, padding=1)
        self.down = nn.Sequential(nn.Conv3d(3, 3, 3, stride=2, padding=1), nn.ReLU(),
                                  nn.Conv3d(3, 3, 3, stride=2, padding=1), nn.Conv3d(3, 3, 3, padding=1))
        self.head = nn.Conv3d(6, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            h = h * 1.5
        b = F.interpolate(self.down(h), size=h.shape[2:], mode="trilinear")
        return self.head(torch.cat([h, b], 1))


class Gathered(nn.Module):
    """Calls that cannot run on shards, run on the volume gathered onto every rank and taken back to
    each shard's box: test-time augmentation (a layer between two flips), a cumulative sum and a mean
    along D alone, a roll, planes picked by ``unbind``, ``cat`` along a split dim, an einsum over the
    volume, writes in place from another box and through a mask (back into each shard), a view of a
    cumulative sum (one process's result is contiguous)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.mid = nn.Conv3d(2, 2, 3, padding=1)
        self.head = nn.Conv3d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))
        if h.shape[2] > 1:  # untraceable
            h = 0.5 * (h + self.mid(h.flip(2)).flip(2)) + torch.cumsum(h, dim=2) / h.shape[2]
            g = torch.cumsum(h, dim=3)  # contiguous in one process: viewed (a shard's box taken is not)
            h = h + g.view(g.shape[0], g.shape[1], -1).softmax(-1).view_as(h)
            h = h - h.mean(dim=2, keepdim=True) + torch.roll(h, 2, dims=3)
            planes = h.unbind(2)
            h = h * (planes[1] * planes[-1]).mean(dim=(1, 2, 3))[:, None, None, None, None] + torch.cat(
                [h[:, :, 1:], h[:, :, :1]], dim=2)
            h = h * torch.einsum("ncdhw,ncdhw->nc", h, h)[:, :, None, None, None] / 500
            h = h.clone()
            h[:, :, 1:3] = h[:, :, 4:6]  # written in place from another box: in the gathered volume
            h[h > 0.5] = 0.5  # a mask of the volume
        return self.head(h)


class PooledGate(nn.Module):
    """A block torch.fx cannot trace into (a shape check), whose layers run on the volume and on pooled
    values: a squeeze-and-excitation gate of its own, and a conv reused on a pooled copy."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Conv3d(2, 2, 1)
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool3d(h, 2)
        if h.shape[2] > 1:
            h = self.conv(h)
        gate = torch.sigmoid(self.fc(F.adaptive_avg_pool3d(h, 1)) + self.conv(pooled).mean((2, 3, 4), True))
        return h * gate


class Reused(nn.Module):
    """Layers called on the split volume and on whole values (a decoder reused by a VAE branch): a
    conv first on a pooled copy, then on the volume, another the other way round, a BatchNorm on both
    (its running statistics updated by each call, as in one process), and a nested block doing both; in
    eval the forward returns None beside the volume, as MONAI's SegResNetVAE does."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(2, 2, 3, padding=1)
        self.first_pooled = nn.Conv3d(2, 2, 3, padding=1)
        self.first_split = nn.Conv3d(2, 2, 3, padding=1)
        self.block = PooledGate()
        self.norm = nn.BatchNorm3d(2)
        self.head = nn.Conv3d(2, 2, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = torch.tanh(self.stem(x))
        small = F.adaptive_avg_pool3d(h, 3)
        p = self.first_pooled(self.norm(small))
        h = self.norm(h)
        h = self.first_pooled(h) * torch.sigmoid(p.mean((2, 3, 4), keepdim=True))
        h = self.first_split(h)
        q = self.first_split(F.interpolate(small, scale_factor=2))
        out = self.head(self.block(h))
        return out, (q.square().mean() if self.training else None)


class ToSkipSize(nn.Module):
    """A transposed conv given the skip's size (``output_size=skip.shape[2:]``, the U-Net idiom for odd
    extents: 9 pooled to 5, back to 9), in a forward with a shape check."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(2, 2, 3, padding=1)
        self.down = nn.Conv3d(2, 4, 3, stride=2, padding=1)
        self.up = nn.ConvTranspose3d(4, 2, 3, stride=2, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = torch.tanh(self.enc(x))
        d = torch.relu(self.down(skip))
        assert d.shape[2] == (skip.shape[2] + 1) // 2
        return skip + self.up(d, output_size=skip.shape[2:])


class PerSampleCalls(nn.Module):
    """Elementwise calls no list names (torch tags them: ``atan2``, ``frac``), conversions and integer
    division (``.long()``, ``//``), a complex tensor's parts (``.real`` of an FFT), max pooling with
    indices undone by ``max_unpool3d``, calls along the volume's dims, a warp by a grid per sample, a
    product of two batches alike, torch's attention over each sample's voxels and a tensor of shape
    values: each keeps the samples apart, so a batch in parts runs them, with a shape check (module
    swapping) and without (a traced graph)."""

    def __init__(self, check: bool = True) -> None:
        super().__init__()
        self.check = check
        self.c1, self.c2 = nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1)
        self.attend = nn.MultiheadAttention(2, 1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check:
            assert x.shape[2] > 4
        h = torch.tanh(self.c1(x))
        level = (h * 4 // 1).long().to(h.dtype) / 4  # a quantised copy: no gradient through it
        spec = torch.fft.fftn(h, dim=(2, 3, 4)).real.mean((2, 3, 4), keepdim=True)
        pooled, where = F.max_pool3d(h, 2, ceil_mode=True, return_indices=True)
        back = F.max_unpool3d(pooled, where, 2, output_size=h.shape[2:])
        h = self.c2(torch.atan2(h, 1 + h.frac().abs()) + level.detach() * 0.1 + spec * 0.01 + back)
        # along the volume's dims only: a rotation, a similarity, finite differences, a warp, q @ k
        h = h + torch.rot90(h, 2, dims=(3, 4)) + F.cosine_similarity(h, h.flip(2), dim=2).unsqueeze(2)
        h = h + sum(torch.gradient(h, dim=(2, 3, 4)))
        theta = torch.eye(3, 4, dtype=h.dtype).expand(h.shape[0], 3, 4) * 0.9
        h = F.grid_sample(h, F.affine_grid(theta, list(h.shape), align_corners=False), align_corners=False)
        t = h.flatten(2)  # tokens (N, C, V): the samples' gram matrices, each its own
        gram = torch.softmax(t @ t.transpose(1, 2) / t.shape[2], dim=-1)
        h = h + (gram @ t).view_as(h) * h.new_tensor(h.shape[2:]).sum() / 32
        tokens = t.transpose(1, 2)  # (N, V, C): torch's attention over each sample's voxels
        return h + self.attend(tokens, tokens, tokens)[0].transpose(1, 2).reshape(h.shape)


def TracedPerSampleCalls() -> PerSampleCalls:  # noqa: N802 (a model's name, as the cases spell them)
    return PerSampleCalls(check=False)


class FiniteChecks(nn.Module):
    """Checks of finiteness as users write them, which a plan on meta tensors answers as a sound run
    does (hybridpar/nn/sound_values.py): any, all, counts, logic and an assert, over the volume, per
    sample and over the batch (the data-parallel parts agree on them while they hold)."""

    def __init__(self, nested: bool = False) -> None:
        super().__init__()
        self.conv, self.out = nn.Conv3d(2, 4, 3, padding=1), nn.Conv3d(4, 2, 3, padding=1)
        self.nested = nested

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv(x))
        if torch.isnan(h).any():
            raise ValueError("NaN in the features")
        assert torch.isfinite(h).all(), "non-finite features"
        if (torch.isnan(h).sum() > 0) | torch.isinf(h).flatten(1).any(1).any():
            raise ValueError("NaN or inf")
        if not bool(h.isfinite().all(dim=(2, 3, 4)).all()) or h.sum(dim=(2, 3, 4)).isnan().any().item():
            h = torch.nan_to_num(h)
        return self.out(h)


class NestedChecks(nn.Module):
    """A traced model around a block with finiteness checks (run by module swapping inside)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.block = nn.Conv3d(2, 2, 1), FiniteChecks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.tanh(self.stem(x)))


def reused_loss(out: tuple[torch.Tensor, torch.Tensor | None], y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], y) + 0.1 * out[1]


def _body(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    for desc, model, spec in cases:
        out = {"NestedUNet": 1, "DeepBranch": 1, "OwnLayersNet": 1, "Idioms": 1, "DeepHeads": 1,
               "ChannelCalls": 4}.get(model, 2)
        shape = {"FlatRegressor": (SHAPE[0], 4), "VolumeMean": (SHAPE[0], 2, 1, 1, 1),
                 "Crops": (SHAPE[0], 1, 3, 5, 3)}.get(
            model, (SHAPE[0], out, *SHAPE[2:]))
        y = torch.randn(shape, dtype=torch.float64, generator=g)
        try:
            _compare(fails, f"{desc} {spec}", globals()[model], spec, x, y,
                     {"DeepHeads": deep_loss, "Reused": reused_loss}.get(model, F.mse_loss))
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


TWO = [("top level", "UserUNet", {"grid": {"spatial": [2, 1, 1]}}),
       ("nested block", "NestedUNet", {"grid": {"spatial": [2, 1, 1]}}),
       ("shape branch", "DeepBranch", {"grid": {"spatial": [2, 1, 1]}}),
       ("flattened into Linear layers", "FlatRegressor", {"grid": {"spatial": [2, 1, 1]}}),
       ("own unregistered layers", "OwnLayersNet", {"grid": {"spatial": [2, 1, 1]}}),
       ("a reduction returned", "VolumeMean", {"grid": {"spatial": [2, 1, 1]}}),
       ("idioms", "Idioms", {"grid": {"spatial": [2, 1, 1]}}),
       ("layers on planes of the split depth", "Planes", {"grid": {"spatial": [2, 1, 1]}}),
       ("layers of several inputs, the split one not first", "SeveralInputs",
        {"grid": {"spatial": [2, 1, 1]}}),
       ("layers of several inputs, traced", "TracedSeveralInputs", {"grid": {"spatial": [2, 1, 1]}}),
       ("a split layer holding a module, no subclass of its layer", "HeldWeights",
        {"grid": {"spatial": [1, 2, 1]}}),
       ("call settings, a layer's weights again, .to(h), NumPy names", "CallSettings",
        {"grid": {"spatial": [2, 1, 1]}}),
       ("a parameter of the model read between layers", "TopLevelWeight", {"grid": {"spatial": [2, 1, 1]}}),
       ("a maximum tied over many voxels", "Ties", {"grid": {"spatial": [2, 1, 1]}}),
       ("a functional conv as wide as its split input", "PooledConv", {"grid": {"spatial": [1, 1, 2]}}),
       ("a block of two inputs with a shape check", "TwoInputBlock", {"grid": {"spatial": [2, 1, 1]}}),
       ("calls along channels, logsumexp over the volume", "ChannelCalls", {"grid": {"spatial": [2, 1, 1]}}),
       ("crops, strided boxes, norms of the user's weights", "Crops", {"grid": {"spatial": [2, 1, 1]}}),
       ("channels last and view_as", "ChannelsLast", {"grid": {"spatial": [1, 2, 1]}}),
       ("deep supervision and a squeezed head", "DeepHeads", {"grid": {"spatial": [2, 1, 1]}}),
       ("einsum per voxel, writes into boxes", "Writes", {"grid": {"spatial": [2, 1, 1]}}),
       ("calls run on the gathered volume", "Gathered", {"grid": {"spatial": [2, 1, 1]}}),
       ("tensors of one value at the volume's extents, boxes added to", "Fills",
        {"grid": {"spatial": [2, 1, 1]}}),
       ("layers called on the volume and on pooled values", "Reused", {"grid": {"spatial": [2, 1, 1]}}),
       ("a transposed conv to the skip's size", "ToSkipSize", {"grid": {"spatial": [2, 1, 1]}}),
       ("checks of finiteness", "FiniteChecks", {"grid": {"spatial": [2, 1, 1]}}),
       ("checks of finiteness in a block", "NestedChecks", {"grid": {"spatial": [1, 2, 1]}}),
       ("planes broadcast over the volume", "BroadcastPlanes", {"grid": {"spatial": [1, 1, 2]}}),
       ("len and nbytes of split activations", "LayoutReads", {"grid": {"spatial": [2, 1, 1]}}),
       ("nbytes of a split activation, traced", "TracedLayoutReads", {"grid": {"spatial": [2, 1, 1]}})]
FOUR = [("top level 2x2", "UserUNet", {"grid": {"spatial": [2, 2, 1]}}),
        ("top level data x spatial", "UserUNet", {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("nested block 2x2", "NestedUNet", {"grid": {"spatial": [2, 2, 1]}}),
        ("nested block data x spatial", "NestedUNet", {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
        ("flattened into Linear layers, 2x2", "FlatRegressor", {"grid": {"spatial": [2, 2, 1]}}),
        ("flattened into Linear layers, data x spatial", "FlatRegressor",
         {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("own unregistered layers, data x spatial", "OwnLayersNet",
         {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("call settings, 2x2", "CallSettings", {"grid": {"spatial": [2, 2, 1]}}),
        ("layers on planes of the split depth, 2x2", "Planes", {"grid": {"spatial": [2, 2, 1]}}),
        ("layers on planes of the split depth, data x spatial", "Planes",
         {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("crops, 2x2", "Crops", {"grid": {"spatial": [2, 2, 1]}}),
        ("crops, data x spatial", "Crops", {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
        ("channels last and view_as, 2x2", "ChannelsLast", {"grid": {"spatial": [2, 2, 1]}}),
        ("deep supervision, data x spatial", "DeepHeads", {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
        ("einsum per voxel, writes into boxes, 2x2", "Writes", {"grid": {"spatial": [2, 2, 1]}}),
        ("calls run on the gathered volume, data x spatial", "Gathered",
         {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
        ("a bottleneck too small to split, run whole", "Bottleneck", {"grid": {"spatial": [4, 1, 1]}}),
        ("tensors of one value at the volume's extents, data x spatial", "Fills",
         {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("layers called on the volume and on pooled values, 2x2", "Reused", {"grid": {"spatial": [2, 2, 1]}}),
        ("a transposed conv to the skip's size, 2x2", "ToSkipSize", {"grid": {"spatial": [2, 2, 1]}}),
        ("per-sample calls, data x spatial", "PerSampleCalls", {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("per-sample calls traced, data x spatial", "TracedPerSampleCalls",
         {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
        ("checks of finiteness, 2x2", "FiniteChecks", {"grid": {"spatial": [2, 2, 1]}}),
        ("checks of finiteness, data x spatial", "FiniteChecks", {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("checks of finiteness in a block, data x spatial", "NestedChecks",
         {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
        ("planes broadcast over the volume, 1x2x2", "BroadcastPlanes", {"grid": {"spatial": [1, 2, 2]}})]


@pytest.mark.parametrize("world,cases", [(2, TWO), (4, FOUR)], ids=["2_ranks", "4_ranks"])
def test_untraceable_forwards_match_one_process(pools, world, cases):
    pools(world).run(_body, cases, timeout=400)


class ModeBranch(nn.Module):
    """A traceable forward that differs between training and eval (deep supervision's extra output)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return h * 2 if self.training else h


def _mode_body(rank: int, world: int) -> None:
    """A forward that differs between training and eval runs by module swapping, exact in both modes;
    with per-layer rules (which need the graph) the graph traced in one mode is refused in the other."""
    from hybridpar.planner.terms import SpecError

    torch.manual_seed(0)
    ref = ModeBranch().double()
    model = ModeBranch().double()
    model.load_state_dict(ref.state_dict())
    engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x_local, y_local = engine.shard_batch(x, x)
    loss = engine.train_step(x_local, y_local)
    assert abs(loss.item() - F.mse_loss(ref(x), x).item()) < 1e-12, "training mode: the loss"
    model.eval()
    ref.eval()
    with torch.no_grad():
        assert (engine.predict(x_local) - ref(x)).abs().max().item() < 1e-12, "eval mode: predict"
    ruled = hp.parallelize(ModeBranch().double(), {"grid": {"spatial": [2, 1, 1]},
                                                   "layers": {"conv": {"spatial": [2, 1, 1]}}},
                           loss_fn=F.mse_loss)
    ruled.train_step(*ruled.shard_batch(x, x))
    ruled.eval()
    with pytest.raises(SpecError, match=r"differs between training and eval .* traced it in training"):
        ruled.predict(x_local)
    ruled.train()
    ruled.predict(x_local)
    heads = hp.parallelize(DeepHeads().double(), {"grid": {"spatial": [2, 1, 1]}}, loss_fn=deep_loss)
    xh, yh = heads.shard_batch(x, x[:, :1])
    heads.train_step(xh, yh)
    heads.eval()  # one volume returned, split, where training returned a dict read whole
    assert heads.predict(xh)[0].shape == (2, 1, *SHAPE[2:])
    with pytest.raises(ValueError, match=r"returns other outputs in eval mode than in training mode"):
        heads.train_step(xh, yh)
    # an eval branch that reads the batch's extent as a value, on micro-batches: each would divide by
    # its own 1, one process by 2; the built (training) mode never followed it
    parts = hp.parallelize(EvalBatchValue().double(), {"grid": {"spatial": [2, 1, 1]},
                                                      "pipeline": {"microbatches": 2}}, loss_fn=F.mse_loss)
    xp, yp = parts.shard_batch(x, x)
    parts.train_step(xp, yp)
    parts.eval()
    with pytest.raises(ValueError, match=r"Engine.predict in eval mode, which the engine was not built in: "
                                         r".*div \(reads the batch's extent"):
        parts.predict(xp)
    # a branch on a single sample: never met by the build's 4 in parts of 2, met predicting 2 in parts of 1
    single = hp.parallelize(SingleSample().double(), {"grid": {"spatial": [2, 1, 1]},
                                                     "pipeline": {"microbatches": 2}}, loss_fn=F.mse_loss)
    single.train_step(*single.shard_batch(torch.cat([x, x]), torch.cat([x, x])))
    with pytest.raises(ValueError, match=r"Engine.predict on a batch of 2 in parts of 1: .* other calls"):
        single.predict(single.shard_batch(x)[0])


class SingleSample(ModeBranch):
    """Another path for a batch of one sample (untraceable: a branch on the batch's extent)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return h * 2 if x.shape[0] == 1 else h


class EvalBatchValue(ModeBranch):
    """Divides by the batch's extent in eval mode only (untraceable: a shape check)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if x.shape[2] > 4 and not self.training:
            h = h / x.shape[0]
        return h


def test_a_forward_that_differs_between_modes_runs_in_both(pools):
    pools(2).run(_mode_body, timeout=120)


def _unsound_body(rank: int, world: int) -> None:
    """A NaN where the plan took the checks to find none: the forward's own raise, as in one process,
    on every rank; a check whose branch does not raise stops the forward at its end, naming it."""
    from hybridpar.planner.terms import SpecError

    x = torch.randn(SHAPE, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[1, 0, 7, 2, 3] = float("nan")  # in the second shard of D only
    engine = hp.parallelize(FiniteChecks().double(), {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, x)
    with pytest.raises(ValueError, match="NaN in the features"):
        FiniteChecks().double()(x)
    with pytest.raises(ValueError, match="NaN in the features"):
        engine.train_step(x_local, y_local)

    class Mended(FiniteChecks):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.conv(x)
            if x.shape[2] > 0 and torch.isnan(h).any():  # mended in place of raising: the planned path left
                h = torch.nan_to_num(h)
            return self.out(h)

    mended = hp.parallelize(Mended().double(), {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
    with pytest.raises(SpecError, match=r"left the path it was planned on: __bool__ at "
                                        r"test_untraced_forwards.py:\d+ came out True where a run without "
                                        r"NaN or infinity gives False"):
        mended.train_step(*mended.shard_batch(x, x))


def test_a_check_of_finiteness_that_finds_a_nan_raises_on_every_rank(pools):
    pools(2).run(_unsound_body, timeout=120)


class _GateIn(nn.Module):
    """A user's block with a parameter that gates its input in place and hands it back."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor([0.3]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(torch.sigmoid(self.s))


class _Halved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (torch's signature)
        return x * 1.0

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g * 0.5


class _Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (torch's signature)
        ctx.mark_dirty(x)
        return x.mul_(2.0)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g * 2.0


class _Refused(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)
        self.gate = nn.Sequential(nn.AdaptiveAvgPool3d(1), nn.Conv3d(1, 1, 1), nn.Sigmoid())
        self.flat, self.gate_in, self.cos = nn.Flatten(), _GateIn(), nn.CosineSimilarity(dim=1)
        self.what = what
        self.register_buffer("seen", torch.zeros(()), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if x.shape[2] > 0:  # untraceable
            if self.what == "a gate inside a checkpoint":
                h = h * torch.utils.checkpoint.checkpoint(self.gate, h, use_reentrant=False)
            elif self.what == "noise drawn from the shape":
                h = h + torch.randn(h.shape, dtype=h.dtype)
            elif self.what == "stochastic depth":
                h = h * (torch.rand(h.shape[0], 1, 1, 1, 1) > 0.5)
            elif self.what == "noise drawn like the volume":
                h = h + torch.randn_like(h)
            elif self.what == "branch on a value":
                h = h * 2 if h.mean() > 0 else h
            elif self.what == "a mean of the positive voxels":
                h = h - h[h > 0].mean()
            elif self.what == "batch mean":
                h = h - h.mean()
            elif self.what == "mean over the batch alone":
                h = h - h.mean(0, keepdim=True)
            elif self.what == "item":
                h = h * len(h.tolist())
            elif self.what == "chunk along the batch":
                a, b = h.chunk(2, 0)
                h = torch.cat([b, a])
            elif self.what == "a sample picked":
                h = h - h[:1]
            elif self.what == "softmax over the batch":
                h = torch.softmax(h, dim=0)
            elif self.what == "a sample of a volume mean picked":
                h = h - h.mean(dim=(2, 3, 4), keepdim=True)[:1]
            elif self.what == "volume means summed over the batch":
                h = h - h.mean(dim=(2, 3, 4), keepdim=True).sum()
            elif self.what == "attention across the samples' means":
                m = h.mean(dim=(2, 3, 4))  # (N, C): a 2-d input attends across its rows
                h = h + F.scaled_dot_product_attention(m, m, m).view(-1, 1, 1, 1, 1)
            elif self.what == "volume means swapped between samples":
                a, b = h.mean(dim=(2, 3, 4), keepdim=True).chunk(2, 0)
                h = h - torch.cat([b, a])
            elif self.what == "volume means flipped over the batch":
                h = h - h.amax(dim=(2, 3, 4), keepdim=True).flip(0)
            elif self.what == "features mixed by a product":
                s = h.mean(dim=(2, 3, 4))
                h = h * (s @ s.transpose(0, 1)).mean()
            elif self.what == "a buffer from the first sample":
                self.seen.copy_(h.detach().mean(dim=(2, 3, 4)).reshape(-1)[0])  # the first sample's
                h = h * self.seen
            elif self.what == "a narrowed view written in place":
                h.narrow(2, 1, 3).mul_(2)
            elif self.what == "a box written in place, not back":
                box = h[:, :, 1:5]
                box *= 2
            elif self.what == "a box read after its volume is written":
                s = h[:, :, 1:-1]
                h.relu_()
                h = F.pad(s, (0, 0, 0, 0, 1, 1)) + h
            elif self.what == "a depth unshuffled on odd shards":  # 6 voxels split 3 | 3, unshuffled by 2
                h = h[:, :, 1:-1]
                n, c, d, hh, w = h.shape
                h = h.view(n, c, d // 2, 2, hh, w).permute(0, 1, 3, 2, 4, 5).reshape(n, c * 2, d // 2, hh, w)
            elif self.what == "a flattened volume written in place":
                f = h.flatten(2)
                f[:, :, :3] = 0.0
            elif self.what == "channels last scaled in place":
                h.permute(0, 2, 3, 4, 1).mul_(2)
            elif self.what == "a flattened head read after its volume is written":
                flat = self.flat(h)  # read whole: in one process a view of h
                h.mul_(2.0)
                h = h + flat.sum(-1).view(-1, 1, 1, 1, 1)
            elif self.what == "a flattened volume unflattened and written in place":
                h.flatten(2).unflatten(2, (8, 8, 8)).mul_(2.0)
            elif self.what == "a box read after a layer wrote its volume":
                box = h[:, :, 1:3]
                h = self.gate_in(h) + box.mean(dim=(1, 2, 3, 4), keepdim=True)
            elif self.what == "an out= into a box":
                buf = torch.zeros_like(h)
                torch.tanh(h.detach()[:, :, 1:3], out=buf[:, :, 1:3])
                h = h + buf
            elif self.what == "a mean spread over the volume, then written":
                g = h.mean((2, 3, 4), keepdim=True)
                spread = g.expand_as(h)
                g.mul_(2.0)
                h = h * spread
            elif self.what == "a view's offset in memory":  # one process's: 2 planes in; a shard's box: 0
                h = h * (h[:, :, 2:].storage_offset() / 1000)
            elif self.what == "a derivative taken in the forward":
                with torch.enable_grad():
                    g = h.detach().requires_grad_(True)
                    h = h + torch.autograd.grad(g.square().sum(), g, create_graph=True)[0]
            elif self.what == "an unregistered layer given the volume second":  # a weight first, broadcast
                h = h * self.cos(self.conv.weight[:1, :1, :1, :1, :1], h).unsqueeze(1)
            elif self.what == "a Function of its own":
                h = _Halved.apply(h)
            elif self.what == "a gradient hook":
                h.register_hook(lambda g: g / g.norm())
            elif self.what == "a gradient hook on a weight":  # sees each part's sum over its samples
                w = self.conv.weight * 1
                w.register_hook(lambda g: g.clamp(-0.01, 0.01))
                h = F.conv3d(h, w, padding=1)
            elif self.what == "a Function on a weight":
                h = F.conv3d(h, _Halved.apply(self.conv.weight), padding=1)
            elif self.what == "a hook on a flattened volume":
                h.flatten(2).register_hook(lambda g: g / g.norm())
            elif self.what == "a Function writing its input":
                h = _Doubled.apply(h * 1.0)
            elif self.what == "a copied reshape read after its volume is written":
                flat = h.transpose(2, 4).reshape(h.shape[0], -1)  # a copy in one process
                h.add_(1.0)
                h = h + flat.sum(-1).view(-1, 1, 1, 1, 1)
        return h


@pytest.mark.parametrize("what,match", [
    ("branch on a value", r"at test_untraced_forwards.py:\d+: RuntimeError.*branch on configuration"),
    ("a mean of the positive voxels", r"at test_untraced_forwards.py:\d+: nonzero makes a tensor whose size "
                                      r"its values set \(h\[h > 0\]\)\); use a masked sum"),
    ("item", r"at test_untraced_forwards.py:\d+ reads the values of a split activation"),
    ("batch mean", r"mean \(over the batch, which data parallelism or micro-batches hold apart"),
    ("mean over the batch alone", r"mean \(over the batch, which data parallelism"),
    ("noise drawn like the volume", r"randn_like \(draws random numbers, alike on every part of the batch\), "
                                    r"computed whole on a batch in parts, at test_untraced_forwards.py:\d+"),
    ("chunk along the batch", r"chunk \(across the samples of the batch, which data parallelism"),
    ("a sample picked", r"__getitem__ \(across the samples of the batch"),
    ("a flattened volume written in place", r"__setitem__ \(writes in place into a reshape of a split "
                                            r"activation, .* at test_untraced_forwards.py:\d+"),
    ("channels last scaled in place", r"mul_ \(writes in place into a reshape of a split activation"),
    ("a flattened head read after its volume is written",
     r"sum of the output of Flatten, a view of its input read whole, written in place since \(in one process "
     r"a view, which would see the write; here a copy\)"),
    ("a flattened volume unflattened and written in place",
     r"mul_ \(writes in place into a view of a reshape of a split activation read whole at "),
    ("a box read after a layer wrote its volume",
     r"mean of a box of slices at test_untraced_forwards.py:\d+, written in place since"),
    ("an out= into a box", r"tanh \(writes in place into a box of slices at test_untraced_forwards.py:\d+, "
                           r"which the split activation does not share, and no write of it back follows"),
    ("a mean spread over the volume, then written",
     r"mul of a view of a whole value at test_untraced_forwards.py:\d+, written in place since"),
    ("a view's offset in memory", r"storage_offset: the memory layout of a view of a split activation .* at "
                                  r"test_untraced_forwards.py:\d+"),
    ("a derivative taken in the forward", r"grad: a derivative taken inside the forward, of values on "
                                          r"shards, .* at test_untraced_forwards.py:\d+"),
    ("a copied reshape read after its volume is written",
     r"sum of a reshape of a split activation at test_untraced_forwards.py:\d+, written in place since \(in "
     r"one process a copy, which keeps the values before the write; here made again from its source\)"),
    ("a narrowed view written in place", r"mul_ \(writes in place into a view of the volume gathered for"),
    ("a box written in place, not back",
     r"mul_ \(writes in place into a box of slices at test_untraced_forwards.py:\d+, which the split "
     r"activation does not share, and no write of it back follows"),
    ("a box read after its volume is written", r"pad of a box of slices at .*, written in place since"),
    ("softmax over the batch", r"softmax \(across the samples of the batch"),
    ("noise drawn from the shape", r"randn \(draws random numbers per sample of the batch, which each part "
                                   r"would draw alike\) at test_untraced_forwards.py:\d+"),
    ("stochastic depth", r"rand \(draws random numbers per sample of the batch"),
    ("a depth unshuffled on odd shards",
     r"view \(a reshape no shard makes of its own\) at test_untraced_forwards.py:\d+"),
    ("a gate inside a checkpoint", r"gate.1 \(Conv3d\) runs on a value that is not split inside torch.utils"),
    ("a Function of its own", r"_Halved.apply \(an autograd.Function of the model's own on values whose "
                              r"gradient .* at test_untraced_forwards.py:\d+"),
    ("a gradient hook", r"register_hook \(on a value whose gradient data parallelism or micro-batches "
                        r"compute in parts.* the hook would see each part's gradient\) at test_untraced_"),
    ("a gradient hook on a weight", r"register_hook \(on a value whose gradient .* at test_untraced_"),
    ("a Function on a weight", r"_Halved.apply \(an autograd.Function of the model's own on values whose "
                               r"gradient data parallelism or micro-batches compute in parts"),
    ("an unregistered layer given the volume second", r"cos \(CosineSimilarity\): this layer type is not "
                                                      r"registered and its input is split"),
])
def test_what_cannot_run_split_is_refused_naming_the_call(what, match):
    """Planned on the volume before any step, alike on every rank: one error naming the call and line."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"data": 2, "spatial": [2, 1, 1]}})
    with pytest.raises(SpecError, match=match):
        spec.plan(_Refused(what), (2, 1, 8, 8, 8), 4)


@pytest.mark.parametrize("what,match", [
    ("a hook on a flattened volume", r"register_hook \(on a reshape of a split activation part way"),
    ("a Function writing its input", r"_Doubled.apply \(writes its input in place, which runs on the "
                                     r"volume gathered for it, not on the shards\) at test_untraced_fo"),
])
def test_backward_code_that_cannot_see_the_whole_gradient_is_refused(what, match):
    """A Function or a gradient hook on split activations runs on the gathered volume and gradient;
    where that cannot stand for one process, the plan says so before any step."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    with pytest.raises(SpecError, match=match):
        spec.plan(_Refused(what), (2, 1, 8, 8, 8), 2)


@pytest.mark.parametrize("what,match", [
    ("a sample of a volume mean picked", r"indexing \(picks among the samples\)"),
    ("volume means summed over the batch", r"sum \(over the samples' dim\)"),
    ("attention across the samples' means", r"scaled_dot_product_attention \(a 2-d input attends across its "
                                            r"rows, the samples\)"),
    ("volume means swapped between samples", r"chunk \(along the samples' dim\)"),
    ("volume means flipped over the batch", r"flip \(along the samples' dim\)"),
    ("features mixed by a product", r"transpose \(along the samples' dim\)"),
    ("a buffer from the first sample", r"indexing \(picks among the samples\)"),
])
@pytest.mark.parametrize("grid,world", [({"data": 2, "spatial": [2, 1, 1]}, 4), ({"data": 2}, 2)],
                         ids=["data_x_spatial", "data"])
def test_samples_mixed_after_the_volume_is_reduced_are_refused(what, match, grid, world):
    """A volume's mean per sample is no longer split, but its batch still is (data parallelism,
    micro-batches): a call across its samples gave each replica its own answer, silently."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": grid})
    with pytest.raises(SpecError, match=f"{match}, on values per sample of a batch in parts, at test_untr"):
        spec.plan(_Refused(what), (2, 1, 8, 8, 8), world)


def test_a_layer_too_small_to_split_is_refused_when_strict():
    """Module swapping runs a layer too small for the split whole, as a traced plan replicates it;
    ``strict: true`` refuses it, naming the layer and what would fit."""
    import hybridpar as hp
    from hybridpar.planner.analysis import TooSmallToSplit

    spec = {"grid": {"spatial": [4, 1, 1]}}
    plan = hp.ParallelSpec.from_dict(spec).plan(Bottleneck(), SHAPE, 4)
    whole = [(r.name, r.gather) for r in plan if r.split == (1, 1, 1)]
    assert whole == [("down.2", True), ("down.3", False)], whole  # gathered for down.2, then whole
    with pytest.raises(TooSmallToSplit, match=r"down.2 \(Conv3d\) cannot run split \[4, 1, 1\] on its input "
                                              r"of 5x4x3 voxels.*use a split of at most"):
        hp.ParallelSpec.from_dict({**spec, "strict": True}).plan(Bottleneck(), SHAPE, 4)


def test_a_layer_given_a_whole_tensor_first_and_the_volume_after_is_planned_gathered():
    """nn.Bilinear(whole, the volume's channels last) runs on the gathered volume: its plan record says
    so (the engine warns of it once, ``strict: true`` sees it), as for a layer too small to split."""
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    plan = spec.plan(SeveralInputs(), (2, 2, 9, 8, 6), 2)
    assert [(r.name, r.kind) for r in plan if r.gather] == [("form", "Bilinear")], \
        [(r.name, r.kind, r.gather) for r in plan]


def test_explain_lists_every_call_between_the_layers():
    """``explain`` of a model run by module swapping shows each call on split activations, as it runs."""
    from hybridpar.planner.explain import explain

    text = explain(hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}), UserUNet(), SHAPE, 2)
    calls = text.split("calls between the layers (the model runs by module swapping):\n")[1]
    for want in (r"pad: runs as its split layer \(ReplicationPad3d\) at test_untraced_forwards.py:\d+",
                 r"mean: mean over D, H, W, the volume's value on every rank \(all-reduce\)",
                 r"cat: joins along channels or batch, on shards", r"shape: reads the volume's extents"):
        assert re.search(want, calls), want


class _TracedMix(nn.Module):
    """The same calls in a forward torch.fx traces: the graph's planner refuses them alike."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        g = h.mean(dim=(2, 3, 4), keepdim=True)
        if self.what == "flip":
            g = g.flip(0)
        elif self.what == "roll":
            g = torch.roll(g, 1, 0)
        elif self.what == "view":
            g = g.view(-1)[:2].sum()
        elif self.what == "latent drawn per sample":  # a VAE's reparametrisation: one draw for the batch
            g = g + torch.randn_like(g) * g.exp()
        elif self.what == "noise drawn from the shape":
            g = g + torch.randn(g.shape)
        elif self.what == "transposed and summed":  # (C, N) summed over N: the batch, silently
            g = g.flatten(1).t().sum(1)[None, :, None, None, None]
        elif self.what == "a histogram of the batch":
            g = g * torch.histc(h, bins=4, min=-1.0, max=1.0)[:1].view(1, 1, 1, 1, 1)
        elif self.what == "a Gram matrix over the batch":
            m = g.flatten(1)
            g = (m.T @ m).sum()
        elif self.what == "renorm of each channel":  # over N, D, H, W
            g = torch.renorm(h, 2, 1, 1.0)
        elif self.what == "renorm of each sample":
            g = torch.renorm(h, 2, 0, 1.0)
        elif self.what == "the batch's norm":
            g = torch.linalg.norm(h)
        elif self.what == "each sample's norm":
            g = torch.linalg.vector_norm(h, dim=(1, 2, 3, 4), keepdim=True)
        elif self.what == "each sample's matrix norms":  # over (H, W)
            g = torch.linalg.matrix_norm(h).unsqueeze(-1).unsqueeze(-1)
        elif self.what == "an FFT over H and W":
            g = torch.fft.fft2(h).abs()
        elif self.what == "each sample's RMS norm":
            g = F.rms_norm(h, h.shape[1:])
        elif self.what == "each sample's pseudo-inverses":
            g = torch.linalg.pinv(h.flatten(2, 3)).sum(-1)[..., None, None]
        elif self.what == "a contiguous stride read":
            g = h / h.stride(1)
        elif self.what == "an einsum over n":
            g = torch.einsum("ncdhw->c", h).view(1, -1, 1, 1, 1)
        elif self.what == "a tensordot over n":
            g = torch.tensordot(h, h, dims=([0, 2, 3, 4], [0, 2, 3, 4])).sum(1).view(1, -1, 1, 1, 1)
        elif self.what == "a tensordot of n with a weight":
            g = torch.tensordot(h, torch.ones(2, dtype=h.dtype), dims=([0], [0]))[None]
        elif self.what == "a tensordot over D with a weight":  # (N, C, H, W): each sample's own
            w = torch.linspace(0, 1, h.shape[2], dtype=h.dtype)
            g = torch.tensordot(h, w, dims=([2], [0])).unsqueeze(2)
        elif self.what == "buckets of each voxel":
            g = torch.bucketize(h.detach(), torch.tensor([-0.5, 0.0, 0.5], dtype=h.dtype)).to(h.dtype)
        elif self.what == "distances between samples":
            g = torch.cdist(h.flatten(1), h.flatten(1)).mean(1).view(-1, 1, 1, 1, 1)
        elif self.what == "per-sample values summed":  # (N,): one value per sample, then their sum
            g = g.mean(dim=(1, 2, 3, 4)).sum()
        elif self.what == "per-sample maxima summed":  # a tuple's first part: the samples' maxima
            g = g.flatten(1).max(1)[0].sum()
        return h - g


AT = r" at test_untraced_forwards.py:\d+: "  # the line of the forward that made the node


@pytest.mark.parametrize("what,match", [
    ("flip", r"flip: flip \(along the samples' dim\)" + AT + "works across the samples of the batch"),
    ("roll", r"roll: roll \(along the samples' dim\)" + AT + "works across the samples of the batch"),
    ("view", r"getitem: indexing \(picks among the samples\)" + AT + "works across the samples of the batch"),
    ("latent drawn per sample",
     r"randn_like \(randn_like\)" + AT + "draws random numbers for the samples of a batch"),
    ("noise drawn from the shape",  # torch.fx cannot trace a draw of a traced shape: module swapping refuses
     r"randn \(draws random numbers per sample of the batch"),
    ("transposed and summed", r"sum_1: sum \(over the samples' dim\)" + AT),
    ("a Gram matrix over the batch", r"matmul: matmul \(reads the samples along different dims\)" + AT),
    ("a histogram of the batch", r"histc: histc \(not known to keep the samples apart\)" + AT),
    ("renorm of each channel", r"renorm: renorm \(norms each slice along its dim over the others, the "
                               r"samples' among them\)" + AT),
    ("the batch's norm", r"linalg_norm: linalg_norm \(along the samples' dim\)" + AT),
    ("an einsum over n", r"einsum: einsum \(mixes samples\)" + AT),
    ("a tensordot over n", r"tensordot: tensordot \(contracts the samples' dim, or of operands that both "
                           r"carry them\)" + AT),
    ("a tensordot of n with a weight", r"tensordot \(contracts the samples' dim"),  # a graph or swapping
    ("distances between samples", r"cdist: cdist \(not known to keep the samples apart\)" + AT),
    ("per-sample values summed", r"sum_\d+: sum \(over the samples' dim\)" + AT),
    ("per-sample maxima summed", r"sum \(over the samples' dim\)")])  # the graph, or module swapping
def test_samples_mixed_in_a_traced_graph_are_refused(what, match):
    """What the graph's planner does not know to keep the samples apart is refused, as module swapping
    refuses it: a call it has no rule for (torch.linalg.norm, cdist) never runs on each part alone."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"data": 2}})
    with pytest.raises(SpecError, match=match):
        spec.plan(_TracedMix(what), (2, 1, 8, 8, 8), 2)


@pytest.mark.parametrize("what", ["renorm of each sample", "each sample's norm", "each sample's matrix norms",
                                  "an FFT over H and W", "each sample's RMS norm",
                                  "each sample's pseudo-inverses", "a contiguous stride read",
                                  "a tensordot over D with a weight", "buckets of each voxel"])
def test_per_sample_calls_in_a_traced_graph_are_planned(what):
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict({"grid": {"data": 2}})
    assert spec.plan(_TracedMix(what), (2, 1, 8, 8, 8), 2)


class _LayerMix(nn.Module):
    """torch layers on per-sample features (N, C) or tokens (N, L, C): those that read dim 0 as their
    sequence or channels mix the samples. ``check``: with a shape check (run by module swapping)."""

    def __init__(self, what: str, check: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 4, 3, padding=1)
        self.what, self.check = what, check
        self.layer = {"GRU": nn.GRU(4, 4), "GRU batch_first": nn.GRU(4, 4, batch_first=True),
                      "attention": nn.MultiheadAttention(4, 2),
                      "attention batch_first": nn.MultiheadAttention(4, 2, batch_first=True),
                      "Softmax(dim=0)": nn.Softmax(dim=0), "Softmax(dim=1)": nn.Softmax(dim=1),
                      "Conv1d": nn.Conv1d(4, 4, 1), "Linear": nn.Linear(4, 4),
                      "Dropout1d": nn.Dropout1d(0.0), "a block's batch mean": _BatchScale()}[what]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check:
            assert x.shape[2] > 4
        h = self.conv(x)
        t = h.mean(dim=(2, 3, 4))
        if self.what.startswith("GRU"):
            t = self.layer(t[:, None] if self.what.endswith("first") else t[None])[0].reshape(t.shape)
        elif self.what.startswith("attention"):  # tokens: the volume's 2 x 2 x 2 means
            tokens = F.adaptive_avg_pool3d(h, 2).flatten(2).transpose(1, 2)  # (N, L, C)
            tokens = tokens if self.what.endswith("first") else tokens.transpose(0, 1)
            t = self.layer(tokens, tokens, tokens)[0].mean(1 if self.what.endswith("first") else 0)
        elif self.what == "a block's batch mean":
            return self.layer(h)
        else:
            t = self.layer(t)
        return h * t[:, :, None, None, None]


class _BatchScale(nn.Module):
    """A block of the user's that scales by a mean over the whole batch."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h / (1 + h.pow(2).mean())


@pytest.mark.parametrize("what,match", [
    ("GRU", r"GRU \(reads its sequence along the samples' dim: batch_first=True keeps them apart\)"),
    ("attention", r"(MultiheadAttention \(reads its sequence|transpose \(along) the samples' dim"),
    ("Softmax(dim=0)", r"Softmax \(along the samples' dim\)"),
    ("Conv1d", r"Conv1d \(of an unbatched input: reads dim 0 as its channels\)"),
    ("a block's batch mean", r"mean \(over the (samples' dim|batch)")])
@pytest.mark.parametrize("spatial", [[1, 1, 1], [2, 1, 1]])
@pytest.mark.parametrize("check", [False, True], ids=["traced", "swapped"])
def test_layers_across_the_samples_are_refused(what, match, spatial, check):
    """A torch layer is judged by what it does along dim 0 of its input, and a block of the user's by its
    forward's calls, whether or not the volume is split, in a traced graph and by module swapping."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"data": 2, "spatial": spatial}})
    with pytest.raises(SpecError, match=match):
        spec.plan(_LayerMix(what, check), (4, 1, 8, 8, 8), 2 * math.prod(spatial))


@pytest.mark.parametrize("what", ["GRU batch_first", "attention batch_first", "Softmax(dim=1)", "Linear",
                                  "Dropout1d"])
@pytest.mark.parametrize("check", [False, True], ids=["traced", "swapped"])
def test_layers_on_each_sample_are_planned(what, check):
    """torch's attention holds its output projection as a child but calls it as a function: one layer
    to both planners, judged by its ``batch_first``, not by the transposes inside it."""
    import hybridpar as hp

    assert hp.ParallelSpec.from_dict({"grid": {"data": 2}}).plan(_LayerMix(what, check), (4, 1, 8, 8, 8), 2)


class _Unique(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c(x)
        return h * torch.unique(h.round()).numel()


class _ValueBranchBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.conv(h) * 2 if h.mean() > 0 else self.conv(h)


def test_a_branch_on_a_value_inside_a_block_is_refused_naming_its_line():
    """A traced model around a block that branches on a tensor's value: the refusal names the block,
    the block's line and what to do, as at the top level."""
    model = nn.Sequential(nn.Conv3d(1, 1, 1), _ValueBranchBlock())
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    with pytest.raises(Exception, match=r"at layer 1 \(test_untraced_forwards.py:\d+\): RuntimeError: "
                                        r"Tensor.item\(\) cannot be called on meta tensors; branch on "
                                        r"configuration or on shapes, not on tensor values"):
        spec.plan(model, (1, 1, 8, 8, 8), 2)


class _MaskedSum(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1 + h[h > 0.2].sum())


def test_a_mask_picking_voxels_in_a_traced_forward_says_what_to_write_instead():
    from hybridpar.planner.graph import GraphRunError, trace, trace_values

    with pytest.raises(GraphRunError, match=r"cannot follow it at \[1, 1, 6, 6, 6\]: at layer getitem "
                                            r"\(test_untraced_forwards.py:\d+\): nonzero makes a tensor "
                                            r"whose size its values set \(h\[h > 0\]\); use a masked sum"):
        trace_values(trace(_MaskedSum()), (1, 1, 6, 6, 6))


def test_a_call_without_a_meta_implementation_is_said_to_be_the_plans_limit():
    """torch.unique runs on values, not on the meta device the plan follows shapes on: the line says
    the plan cannot follow the model, not that the model does not run."""
    from hybridpar.planner.graph import GraphRunError, trace, trace_values

    with pytest.raises(GraphRunError, match=r"^the plan's run on the meta device \(shapes, no values\) "
                                            r"cannot follow it at \[1, 1, 6, 6, 6\]: at layer unique "
                                            r"\(test_untraced_forwards.py:\d+\): NotImplementedError(?s:.*)"
                                            r"; that call has no meta implementation"):
        trace_values(trace(_Unique()), (1, 1, 6, 6, 6))


class _Keeps(nn.Module):
    """State kept in plain attributes by the forward: a tensor read in the next call, one left after
    the call (an auxiliary loss for ``loss_fn`` to read), terms collected in a list or a dict, one
    used within the call and dropped (or left in a list, read back within the call), a counter bumped
    on each call, and a shape recorded alike on each call (or logged in a list)."""

    def __init__(self, how: str, shape_check: bool) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 1, 3, padding=1)
        self.how, self.shape_check, self.prev, self.calls, self.size = how, shape_check, None, 0, None
        self.terms: list = []
        self.named: dict = {"start": 1}
        self.grid = torch.ones(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        if self.shape_check and x.shape[2] > 0:
            h = h * 2
        if self.how == "carried":
            if self.prev is not None:
                h = h + self.prev
            self.prev = h.detach()
        elif self.how == "left":
            self.prev = h.pow(2).mean()
        elif self.how == "within":
            self.prev = h * 0.5
            h = h - self.prev
            del self.prev
        elif self.how == "counter":
            self.calls += 1
            h = h * (1 - 0.5 ** self.calls)
        elif self.how == "size":
            self.size = tuple(x.shape)
        elif self.how == "list":
            self.terms.clear()
            self.terms.append(self.conv.weight.pow(2).sum())
        elif self.how == "dict":
            self.named["w"] = self.conv.weight.abs().sum()
        elif self.how == "shapes":
            self.terms.append(tuple(x.shape))
        elif self.how == "side outputs":  # rebound to a new list on every call, for the loss to read
            self.terms = [h * 0.5]
        elif self.how == "moved":  # MONAI's AffineHead: on one process the same tensor, nothing moves
            self.grid = self.grid.to(device=x.device)
            h = h + self.grid
        elif self.how == "doubled":
            self.grid = self.grid * 2
            h = h + self.grid
        elif self.how == "scratch":  # read back within the call (MONAI DynUNet's deep-supervision heads)
            self.terms.clear()
            self.terms.append(h * 0.5)
            h = torch.stack([h, *self.terms]).sum(0)
        return h


@pytest.mark.parametrize("how,match", [
    ("carried", r"keeps a tensor in self.prev and reads it in the next call"),
    ("left", r"keeps a tensor in self.prev after the call \(an auxiliary loss, a cache\), which your model "
             r"would not hold.*return it from the forward"),
    ("counter", r"changes self.calls on every call.*keep it in a buffer updated in place"),
    ("list", r"leaves tensors in self.terms \(a list\) after the call.*return them from the forward"),
    ("dict", r"leaves tensors in self.named \(a dict\) after the call"),
    ("side outputs", r"leaves tensors in self.terms \(a list\) after the call"),
    ("doubled", r"keeps a tensor in self.grid"),
    ("within", None), ("size", None), ("shapes", None), ("scratch", None), ("moved", None)])
@pytest.mark.parametrize("shape_check", [False, True], ids=["traced", "untraceable"])
def test_state_a_forward_keeps_in_plain_attributes(how, match, shape_check):
    """Planning on the meta device once left a meta tensor in ``self.prev`` (the next real step then
    failed on devices), a trace a Proxy, and bumped a counter in the user's model; each attribute is
    put back, and a list's or dict's contents. What no split run can follow as one process does is
    refused naming it: a value carried to the next call, a tensor left on the model, or in a list or
    dict on it (a loss reading ``model.prev`` got a stale value, silently; ``sum(model.terms)`` a meta
    tensor), a counter (a traced graph keeps its value at the trace). Used within a call, or set
    alike on every call, or rebound to itself moved to the input's device (``x.to``: on one process the
    same tensor), it plans."""
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    model = _Keeps(how, shape_check)
    grid = model.grid
    if match is None:
        spec.plan(model, (2, 1, 8, 8, 8), 2)
    else:
        with pytest.raises(SpecError, match=r"model \(_Keeps\): its forward " + match):
            spec.plan(model, (2, 1, 8, 8, 8), 2)
    assert model.prev is None and model.calls == 0 and model.size is None
    assert model.terms == [] and model.named == {"start": 1} and model.grid is grid


@pytest.mark.parametrize("name,args,kwargs,moves", [
    ("norm", (2,), {}, True),  # x.norm(2): over every dim (the order is not a dim)
    ("norm", (2, 1), {}, False),
    ("max", ("other",), {}, False),  # torch.max(a, b): elementwise
    ("max", (0,), {}, True),
    ("diff", (1, 1), {}, False),
    ("flip", ([0],), {}, True),
    ("transpose", (1, 0), {}, True),
    ("permute", (0, 2, 1), {}, False),
    ("view", (-1,), {}, False),  # each sample's 12 elements 12 rows of their own: a fold
    ("view", (4, -1), {}, False),  # each sample's in 2 rows
    ("view", (3, -1), {}, True),  # the second of 3 rows straddles the two samples
    ("repeat", (2, 1, 1), {}, True),  # the batch copied after itself: no sample's rows together
    ("softmax", (), {"dim": 1}, False),
])
def test_which_calls_move_the_samples(name, args, kwargs, moves):
    """The rule both planners read (:mod:`hybridpar.planner.per_sample`), on a (2, 3, 4) per-sample value."""
    from hybridpar.planner.per_sample import moves_samples

    g = torch.zeros(2, 3, 4)
    args = tuple(g if a == "other" else a for a in args)
    out = tuple(getattr(g, name)(*args).shape) if name in ("view", "repeat", "transpose", "permute") else None
    assert bool(moves_samples(name, (g, *args), kwargs, 3, 2, out)) is moves


def test_per_sample_functions_pass_and_mixing_ones_do_not():
    """Per-sample work on a (N, C) value that carries the batch plans (calls along other dims: unfold,
    index_select, repeat_interleave, gather or scatter with an index of every sample, a triangle, an
    FFT, an integral; pools, pads, a PReLU and convolutions of a batched input); what mixes its samples
    does not (a conv2d of an unbatched 3-d input: dim 0 its channels; a pad of dim 0)."""
    from hybridpar.planner.per_sample import across

    s, w, v, v5 = torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, 3, 3), torch.randn(2, 1, 4, 4, 4)
    v4 = torch.zeros(2, 3, 4, 4)
    top, first = torch.zeros(2, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    keep = [(F.layer_norm, (s, (4,)), {}), (torch.einsum, ("nc,dc->nd", s, w), {}),
            (torch.einsum, ("nc,dc->nd", [s, w]), {}), (F.linear, (s, w), {}), (torch.matmul, (s, w.T), {}),
            (F.gelu, (s,), {}), (torch.Tensor.unfold, (s, 1, 2, 1), {}),
            (torch.index_select, (s, 1, top[:, 0]), {}),
            (torch.repeat_interleave, (s, 2), {"dim": 1}), (torch.gather, (s, 1, top), {}),
            (torch.gather, (s,), {"dim": 1, "index": top}), (torch.take_along_dim, (s, top, 1), {}),
            (torch.triu, (v,), {}), (torch.diagonal, (v,), {"dim1": 1, "dim2": 2}), (torch.fft.fft, (s,), {}),
            (torch.fft.rfftn, (v,), {"dim": (1, 2)}), (torch.fft.fftshift, (s,), {"dim": 1}),
            (torch.trapezoid, (s,), {"dim": 1}), (torch.cumulative_trapezoid, (s,), {}),
            (torch.scatter_add, (s, 1, top, s[:, :1]), {}), (F.one_hot, (top[:, 0], 3), {}),
            (F.local_response_norm, (v, 2), {}), (torch.atan2, (s, s), {}), (torch.Tensor.long, (s,), {}),
            (torch.Tensor.__floordiv__, (s, 2), {}), (torch.remainder, (s, 3), {}), (torch.frac, (s,), {}),
            (torch.Tensor.real.__get__, (s.to(torch.complex64),), {}), (torch.Tensor.data.__get__, (s,), {}),
            (torch.as_tensor, (s,), {"dtype": torch.float64}),
            (F.max_pool3d_with_indices, (v5, 2), {}),
            (F.max_unpool3d, (*F.max_pool3d_with_indices(v5, 2), 2), {}), (F.max_pool2d, (v4, 2), {}),
            (F.avg_pool1d, (v, 2), {}), (F.adaptive_avg_pool2d, (v4, 1), {}), (F.lp_pool2d, (v4, 2, 2), {}),
            (F.conv2d, (v4, torch.zeros(2, 3, 3, 3)), {}), (F.conv1d, (v, torch.zeros(1, 3, 2)), {}),
            (F.pad, (v4, (1, 1, 1, 1)), {}), (torch.constant_pad_nd, (v4, (1, 1)), {}),
            (F.prelu, (v4, torch.ones(3)), {})]
    mix = [(F.layer_norm, (s, (2, 4)), {}), (torch.einsum, ("nc,mc->nm", s, s), {}),
           (torch.matmul, (w, s.T), {}), (torch.Tensor.__getitem__, (s, 0), {}), (torch.roll, (s, 1), {}),
           (torch.Tensor.unfold, (s, 0, 1, 1), {}), (torch.index_select, (s, 0, top[:1, 0]), {}),
           (torch.repeat_interleave, (s, 2), {}), (torch.gather, (s, 1, first), {}),
           (torch.gather, (s, 0, top), {}), (torch.triu, (s,), {}), (torch.diagonal, (v,), {}),
           (torch.fft.fft, (s, None, 0), {}), (torch.fft.rfftn, (v,), {}), (torch.fft.fftshift, (s,), {}),
           (torch.trapezoid, (s,), {"dim": 0}), (torch.scatter_add, (s, 1, first, s[:1, :1]), {}),
           (torch.scatter_add, (s, 0, top, s[:, :1]), {}), (F.conv2d, (v, torch.zeros(1, 2, 2, 2)), {}),
           (F.pad, (v4, (1, 1, 1, 1, 1, 1, 1, 1)), {})]
    for mixes, (func, args, kwargs) in [(False, c) for c in keep] + [(True, c) for c in mix]:
        carrier = args[0] if isinstance(args[0], torch.Tensor) and args[0].dim() >= 3 else s
        said = across(func, args, kwargs, [carrier], func(*args, **kwargs))
        assert bool(said) is mixes, (func, args, kwargs, said)



def test_split_operands_broadcast_where_they_agree_along_the_split_dims():
    """Pure geometry: operands of other extents broadcast on shards only along dims the grid leaves whole,
    and only where one of them spans the output (the others' boxes are its own there)."""
    from hybridpar.planner.elementwise import broadcast_extents

    assert broadcast_extents([(9, 8, 6), (1, 8, 6)], (1, 1, 2)) == (9, 8, 6)  # a plane, W split
    assert broadcast_extents([(9, 1, 6), (9, 8, 6)], (1, 2, 1)) is None  # a row along the split H
    assert broadcast_extents([(1, 8, 6), (9, 8, 1)], (1, 2, 1)) is None  # no operand spans (9, 8, 6)
    assert broadcast_extents([(9, 8, 6), (7, 8, 6)], (1, 1, 2)) is None  # no broadcast: 9 against 7
