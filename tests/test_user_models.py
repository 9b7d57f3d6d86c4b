"""Models as users write them (or take them from MONAI and torchvision), parallelized exactly:

* a forward whose Python checks torch.fx fixes at trace time (``torch.jit.isinstance(e, torch.Tensor)``,
  MONAI's ``UpCat``): the traced graph is compared with the forward before it is trusted, and a graph
  that computes something else is never run (module swapping runs the forward itself; a pipeline,
  which needs the graph, is refused naming the node);
* a module registered under two names (MONAI's DynUNet) and a module the forward never calls:
  ``full_state_dict()`` is ``model.state_dict()`` key for key, loadable with ``strict=True``;
* an optimizer built on ``model.parameters()``: the engine runs the model's own tensors, so it trains.

Three SGD steps in float64 against the same model in one process, on 2 and 4 ranks, with a pipeline.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from graph_models import GradNormed
from layer_cases import Failures, on_one_rank, reference_steps, steps_match

SHAPE = (4, 1, 8, 6, 6)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor, e: torch.Tensor | None = None) -> torch.Tensor:
        if e is not None and torch.jit.isinstance(e, torch.Tensor):  # fx: a Proxy is no Tensor
            return self.conv(x + e)
        return self.conv(x)


class WholeNorm(nn.Module):
    """A traceable forward normalising split features by reductions over every dim (no ``dim=``): whole
    values (gathered) that a split computation reads, their gradients the shards' parts summed."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        return self.c2(h / h.abs().mean() + h.norm() / 100 - h.amax() / 10)


class OneSlice(nn.Module):
    """Traced slices of a split dim, gathered, broadcast back against the shards (extent 1 along it)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        return self.c2(h + h[:, :, -1:] - h[:, :, 2:3] * h[:, :, :, -2:-1] + h[:, :, [0, 2, 1]].mean(2, True))


class IsInstanceNet(nn.Module):
    """The 12-line model whose traced graph silently drops ``x + e``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.block(h, h * 2)


class PReLUNet(nn.Module):
    """A pointwise layer with parameters and no Dist class (PReLU) in a model run by module swapping
    (the isinstance check): its gradient on each shard is partial and must be summed."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.act = nn.PReLU(2, init=-0.3)
        self.block = _Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.stem(x))
        return self.block(h, h * 2)


class WSConv3d(nn.Conv3d):
    """A subclass with its own forward (weight standardisation, as timm's StdConv3d and BiT write it):
    a split version of the base class would silently drop what the subclass adds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        w = (w - w.mean((1, 2, 3, 4), keepdim=True)) / (w.std((1, 2, 3, 4), keepdim=True) + 1e-5)
        return self._conv_forward(x, w, self.bias)


class _ScaledForward:
    """A mixin whose forward shadows the conv's (MONAI's DepthwiseFFTConv3d takes its FFT forward so):
    the subclass defines no forward of its own, the class before its registered base in the MRO does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * self._conv_forward(x, self.weight, self.bias) + 1.0


class MixinConv3d(_ScaledForward, nn.Conv3d):
    pass


class WSConvForward3d(nn.Conv3d):
    """Weight standardisation written in ``_conv_forward``, which ``nn.Conv3d.forward`` calls."""

    def _conv_forward(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        w = (w - w.mean((1, 2, 3, 4), keepdim=True)) / (w.std((1, 2, 3, 4), keepdim=True) + 1e-5)
        return super()._conv_forward(x, w, b)


class WSNet(nn.Module):
    def __init__(self, conv: type = WSConv3d) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.ws = conv(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ws(torch.tanh(self.stem(x)))


class AliasNet(nn.Module):
    """Blocks kept under two names (DynUNet's ``downsamples`` and ``skip_layers``), and a head the
    forward never calls."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.GroupNorm(1, 3), nn.ReLU())
        self.dec = nn.Conv3d(3, 1, 3, padding=1)
        self.blocks = nn.ModuleList([self.enc, self.dec])
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](x)
        return self.dec(h) + x


class SwappedUnusedNet(nn.Module):
    """Run by module swapping (the isinstance check), with heads the forward never calls that are
    split layers themselves (BasicUNet++'s ``final_conv_0_1..0_3`` without deep supervision)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.block = _Block()
        self.heads = nn.ModuleList([nn.Conv3d(2, 1, 1), nn.Sequential(nn.Conv3d(2, 2, 3), nn.BatchNorm3d(2))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.block(h, h * 2)


class ShapeNet(nn.Module):
    """Shapes read in a forward: an output size taken from the input (RegUNet), a ratio of extents, a
    function pad and a channel repeat (MedNeXt, VNet), a batch size."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv3d(1, 2, 3, stride=2, padding=1)
        self.conv = nn.Conv3d(4, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(self.down(x), size=x.shape[2:], mode="trilinear", align_corners=False)
        h = F.pad(h.repeat(1, 2, 1, 1, 1), (1, 1, 1, 1, 1, 1), mode="replicate")
        scale = h.shape[2] / x.size(2) + x.numel() / (x.size(0) * x.size()[-1] * 1000)  # global extents
        return self.conv(h) * scale


class SampleShapeNet(nn.Module):
    """A sample picked for its shape alone (``h[0].numel()``, ``h[-1, 0].shape``, ``full_like``): alike on
    every part of a batch that data parallelism holds in parts, and of the volume's extents on a shard."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h) * (h[0].numel() / 1000) + h[-1, 0].shape[-1] / h[0].dim() + torch.full_like(
            h[0, :1], 0.25)


class CheckedSampleShapeNet(SampleShapeNet):
    """The same behind a check of a sample's shape, which torch.fx cannot trace: run by module swapping."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x[0].shape != (1, *SHAPE[2:]) or len(x[-1]) != 1:
            raise ValueError(f"one sample is (1, {SHAPE[2:]}), not {tuple(x[0].shape)}")
        return super().forward(x)


class DictNet(nn.Module):
    """A dict with a list inside: two heads of one extent (stay split, one share weighs both)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.main = nn.Conv3d(2, 1, 3, padding=1)
        self.aux = nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = torch.relu(self.stem(x))
        return {"main": self.main(h), "aux": [self.aux(h)]}


class CBAMNet(nn.Module):
    """CBAM's attention (Woo et al.): one MLP called on the average- and the max-pooled features, and a
    spatial map from the mean and ``torch.max`` over channels. A module called twice and a function
    returning values and indices run by module swapping, weights shared as in torch."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)
        self.mlp = nn.Sequential(nn.Conv3d(4, 2, 1), nn.ReLU(), nn.Conv3d(2, 4, 1))
        self.spatial = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        h = h * torch.sigmoid(self.mlp(F.adaptive_avg_pool3d(h, 1)) + self.mlp(F.adaptive_max_pool3d(h, 1)))
        s = torch.cat([torch.mean(h, dim=1, keepdim=True), torch.max(h, dim=1, keepdim=True)[0]], dim=1)
        return self.c2(h * torch.sigmoid(self.spatial(s)))


class MaxChunkNet(nn.Module):
    """Traceable, but with values that are not one tensor between layers (``max``'s values and
    indices, ``chunk``'s tensors): the model's own forward runs split by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.c1(x))
        a, b = (h - torch.max(h, dim=1, keepdim=True).values).chunk(2, 1)
        return self.c2(a * b)


class RepeatNet(nn.Module):
    """One conv listed three times (``nn.ModuleList([conv] * 3)``) and applied in a loop: a module
    called more than once runs by module swapping, which must swap it in every slot."""

    def __init__(self) -> None:
        super().__init__()
        conv = nn.Conv3d(2, 2, 3, padding=1)
        self.inp, self.out = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 1)
        self.blocks = nn.ModuleList([conv] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.out(h)


class HalfNet(nn.Module):
    """A slice whose bound the forward reads from a shape (``h[:, :, :h.shape[2] // 2]``): the
    pipeline's stage code filled slices' node references in nowhere and crashed."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h[:, :, :h.shape[2] // 2])


class WNNet(nn.Module):
    """A weight-normalised conv (torch.nn.utils.parametrize), run whole on request or split: its split
    version computes the weight from the same ``g`` and ``v`` on each call, their gradients summed over
    the shards. ``branch``: behind a shape check, so the forward runs by module swapping."""

    def __init__(self, branch: bool = False) -> None:
        super().__init__()
        self.branch = branch
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.wn = torch.nn.utils.parametrizations.weight_norm(nn.Conv3d(2, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        if self.branch and x.shape[2] > 4:
            h = h * 2
        return self.wn(h)


def MixinNet() -> WSNet:  # noqa: N802 (a model's name, as CASES spell them)
    return WSNet(MixinConv3d)


def WSConvForwardNet() -> WSNet:  # noqa: N802
    return WSNet(WSConvForward3d)


def SwappedWNNet() -> WNNet:  # noqa: N802 (a model's name, as CASES spell them)
    return WNNet(branch=True)


class CondNet(nn.Module):
    """A conditioning input that defaults to None (the engine calls ``model(x)``): traced with it at
    its default, the graph's one input the volume."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.o = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.emb = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor, cond: torch.Tensor | None = None, scale: float = 0.5) -> torch.Tensor:
        if cond is None:
            cond = x.new_ones(x.shape[0], 2)
        h = torch.tanh(self.c(x)) * scale + self.emb(cond)[..., None, None, None]
        return self.o(h + (h // 0.25).detach() * 0.01 + torch.atan2(h, h.frac() + 2))


class DeepNet(nn.Module):
    """Deep supervision at two resolutions (a tuple): the plan gathers both for the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.down = nn.Conv3d(2, 1, 2, stride=2)
        self.out = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.stem(x))
        return self.out(h), self.down(h)


def _structured_loss(out, y: torch.Tensor) -> torch.Tensor:
    if isinstance(out, dict):
        return F.mse_loss(out["main"], y) + 0.5 * F.mse_loss(out["aux"][0], y)
    return F.mse_loss(out[0], y) + 0.5 * F.mse_loss(out[1], F.avg_pool3d(y, 2))


class InPlaceNet(nn.Module):
    """In-place calls whose result the forward does not assign (the usual idiom): the layers after them
    read the changed tensor, including where the plan runs the call whole (a mask from a comparison,
    a volume mean). A forward that changes a view in place runs by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        h.masked_fill_(h > 0.3, 0.3)
        h.sub_(h.mean((2, 3, 4), keepdim=True))
        F.leaky_relu_(h, 0.2)
        t = h * 2
        F.threshold_(t, -0.01, -0.01)
        g = self.c2(h + t)
        g += x
        g.sigmoid_()
        return g


class ViewedNet(nn.Module):
    """A view taken of a value that is then written in place and read after it (``f = h.flatten(2)``):
    one process's view sees the write, which a traced graph's node for the view would not; the forward
    runs by module swapping, on the shards themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        f = torch.flatten(h, 2)
        h.mul_(2.0)
        return self.c2(h + f.mean(-1)[..., None, None, None])


class AugAliasNet(nn.Module):
    """An augmented assignment on a value a view was taken of, the view read after (``v = h[:, :1];
    h *= 2``): in one process the view sees the write; fx records ``h *= 2`` as ``h * 2``, so the traced
    graph is not the forward (planner/faithful.py) and it runs by module swapping."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        first = h[:, :1]
        h *= 2.0
        return self.c2(torch.cat([first, h[:, 1:]], 1))


class _StraightThrough(torch.autograd.Function):
    """A clamp whose backward passes the gradient through unchanged (a straight-through estimator)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001 (torch's signature)
        return x.clamp(-0.1, 0.1)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        return g * 0.5


class STENet(nn.Module):
    """An autograd.Function of the user's between layers: its own backward, not its forward's derivative
    (fx would trace into its forward, so the forward runs by module swapping)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(_StraightThrough.apply(self.c1(x)))


class WeightSTENet(STENet):
    """The same Function on a split layer's weight (weights quantised, their gradient passed through),
    the result given to F.conv3d on the split volume: the weight's gradient is summed over the shards
    once (each rank's Function given its share)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        return F.conv3d(h, _StraightThrough.apply(self.c2.weight), self.c2.bias, padding=1)


class GlobalBackwardNet(nn.Module):
    """A Function whose backward reduces over the volume, then a gradient hook that does too (and one
    that works voxel by voxel): each run on the whole gradient, gathered."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = GradNormed.apply(torch.relu(self.c1(x)))
        if h.requires_grad:
            h.register_hook(lambda g: g - g.mean())
            h.register_hook(lambda g: g.clamp(-1e-3, 1e-3))
        return self.c2(h)


class RecomputeNet(nn.Module):
    """A traced ``F.interpolate`` by a scale whose output extent rounds down (0.6), with
    ``recompute_scale_factor=True``: the kernel then uses the scale the extents give, not 0.6."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(self.c1(x), scale_factor=0.6, mode="trilinear", recompute_scale_factor=True)
        return F.interpolate(self.c2(h), size=x.shape[2:], mode="trilinear")


class AttentionNet(nn.Module):
    """Self-attention over the voxels of a pooled bottleneck, as a 3D transformer block writes it:
    flattened to (N, L, C) tokens, ``F.scaled_dot_product_attention``, reshaped back."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.qkv = nn.Conv3d(1, 4, 3, padding=1), nn.Linear(4, 12)
        self.c2 = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.max_pool3d(self.c1(x), 2)
        n, c, d, hh, w = h.shape
        q, k, v = self.qkv(h.flatten(2).transpose(1, 2)).chunk(3, -1)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(n, c, d, hh, w)
        return self.c2(F.interpolate(h + a, size=x.shape[2:]))


class _GainInPlace(nn.Module):
    """A block of the user's with a parameter of its own that scales its input in place, behind a branch
    on a shape (untraceable): kept whole in the traced graph, run by module swapping inside."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.linspace(-0.5, 0.5, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] > 1:
            x.mul_(torch.sigmoid(self.s).view(1, -1, 1, 1, 1))
        return x


class NestedInPlaceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.gain = nn.Conv3d(1, 3, 3, padding=1), _GainInPlace(3)
        self.c2 = nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(torch.relu(self.gain(self.c1(x))))


class StackNet(nn.Module):
    """Features stacked along a new dim 0 and averaged over it (MONAI's registration blocks), and a
    per-sample vector transposed and back: the samples leave dim 0 and return, across a pipeline cut
    too (at ``act``)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(1, 2, 3, padding=1)
        self.act, self.out = nn.ReLU(), nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feats = [self.a(x), torch.tanh(self.b(x))]
        g = feats[0].mean(dim=(2, 3, 4)).t()  # (C, N)
        h = self.act(torch.stack(feats, 0) * 2).mean(0)
        return self.out(h * g.t()[:, :, None, None, None])


class ScalarCutNet(nn.Module):
    """A mean over the whole batch live across a pipeline cut (at ``act``): with one micro-batch per
    replica the batch is not held apart, and the 0-d value travels as one element."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(1, 2, 3, padding=1)
        self.act, self.out = nn.ReLU(), nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.a(x).mean()
        return self.out(self.act(self.b(x)) * m)


class LazyMaskNet(nn.Module):
    """A spherical mask made on the first call from the input's extents, behind a flag buffer the
    forward branches on (planning runs on meta tensors, which hold no value to branch on: the flag
    keeps its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.out = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.register_buffer("mask", torch.zeros(SHAPE[2:]))
        self.register_buffer("ready", torch.zeros((), dtype=torch.bool))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ready:
            axes = [torch.linspace(-1, 1, n, dtype=x.dtype) for n in x.shape[2:]]
            self.mask.copy_(sum(a.view([-1 if i == k else 1 for i in range(3)]) ** 2
                                for k, a in enumerate(axes)) < 1)
            self.ready.fill_(True)
        return self.out(torch.relu(self.c1(x)) * self.mask)


class VectorsNet(nn.Module):
    """Values of no batch returned beside the volume: a penalty per channel of the weights and the
    volume's extents as a vector (``torch.tensor(x.shape[2:])``, which fx cannot trace). With
    micro-batches each is one value for the batch, not joined along dim 0."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.o = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"main": self.o(torch.tanh(self.c(x))), "penalty": self.c.weight.square().sum((1, 2, 3, 4)),
                "extents": torch.tensor(x.shape[2:], dtype=x.dtype)}


def _vectors_loss(out: dict[str, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    extents = out.get("extents", torch.zeros(()))
    return F.mse_loss(out["main"], y) + 1e-2 * out["penalty"].sum() + 0.0 * extents.sum()


class PenaltyNet(nn.Module):
    """A weight penalty computed in the forward from ``self.parameters()`` (real tensors while fx traces:
    it keeps the result on the traced module, here the user's) and returned beside the volume."""

    def __init__(self) -> None:
        super().__init__()
        self.c, self.o = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.o(torch.tanh(self.c(x))), sum(p.square().sum() for p in self.parameters())


def _penalised_loss(out: tuple[torch.Tensor, torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out[0], y) + 1e-2 * out[1]


LOSSES = {"DictNet": _structured_loss, "DeepNet": _structured_loss, "VectorsNet": _vectors_loss,
          "PenaltyNet": _penalised_loss}


class BNNet(nn.Module):
    """Batch statistics: with data parallelism, over each replica's batch unless SyncBatchNorm asks."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(1, 3, 3, padding=1), nn.BatchNorm3d(3), nn.ReLU(),
                                  nn.Conv3d(3, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + x


def SyncBNNet() -> nn.Module:  # noqa: N802 (named as the model it builds)
    return nn.SyncBatchNorm.convert_sync_batchnorm(BNNet())


class BNBlockNet(nn.Module):
    """A BatchNorm inside a block torch.fx cannot trace into (``range`` of a shape): run whole."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.out = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.block = _ChannelLoopBlock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.stem(x)))


class _ChannelLoopBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv3d(3, 3, 3, padding=1), nn.BatchNorm3d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn(self.conv(x))
        return torch.cat([torch.relu(h[:, i:i + 1]) for i in range(h.shape[1])], 1) + x


def SyncBNBlockNet() -> nn.Module:  # noqa: N802
    return nn.SyncBatchNorm.convert_sync_batchnorm(BNBlockNet())


REFERENCE = {"SyncBNNet": BNNet, "SyncBNBlockNet": BNBlockNet}  # SyncBatchNorm in one process: a BatchNorm


def _in_float64(make: Callable[[], nn.Module]) -> nn.Module:
    """``make()`` in float64, its weights drawn so (not drawn in float32 and converted: a model of 45M
    weights spends seconds on the copy)."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return make().double()
    finally:
        torch.set_default_dtype(default)


def _compare(fails: Failures, desc: str, make: type, spec: dict, x: torch.Tensor, y: torch.Tensor,
             loss_fn=F.mse_loss, steps: int = 3, round_trip: bool = True) -> None:
    """Three (``steps``) steps of an optimizer over the *model's* parameters, against one process: every
    loss, the full state dict (loadable into a fresh model with strict=True) and predictions.
    ``round_trip=False`` (one stage only) compares the trained model's own state dict and leaves out
    the full state dict's round trip (gathered, loaded into a fresh model and back into the engine):
    the same code for every model, which a model of 45M weights spends seconds copying."""
    import hybridpar as hp

    torch.manual_seed(0)
    ref, model = _in_float64(REFERENCE.get(make.__name__, make)), _in_float64(make)
    model.load_state_dict(ref.state_dict())

    def reference() -> tuple[list[torch.Tensor], dict[str, torch.Tensor], object]:
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
        losses = reference_steps(ref, ref_opt, (x, y), loss_fn, steps)
        ref.eval()
        with torch.no_grad():
            return losses, {k: v.detach().clone() for k, v in ref.state_dict().items()}, ref(x)

    ref_losses, want, want_out = on_one_rank(reference)
    engine = hp.parallelize(model, spec, loss_fn=loss_fn)
    x_local, y_local = engine.shard_batch(x, y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    steps_match(fails, desc, engine, opt, ref_losses, None, (x_local, y_local), (x, y), loss_fn, steps)
    assert round_trip or engine.grid.pipe == 1, "a pipeline's model is compared through its full state"
    if round_trip:
        state = engine.full_state_dict()
        if list(state) != list(want):
            fails.append(f"{desc}: full_state_dict keys {list(state)} != the model's {list(want)}")
            return
        for k, v in want.items():
            if v.is_floating_point():
                fails.check(f"{desc} full_state_dict {k}", state[k].to(v.dtype), v, 1e-9)
        with torch.device("meta"):  # the keys and shapes a fresh model has, none of its weights drawn
            fresh = make()
        fresh.load_state_dict(state, strict=True, assign=True)
    if engine.grid.pipe == 1 and list(engine.local_state_dict()) != list(want):
        fails.append(f"{desc}: local_state_dict keys {list(engine.local_state_dict())} != {list(want)}")
    if engine.grid.pipe == 1:  # every rank runs every layer: the user's model is the trained one
        for k, v in want.items():
            if v.is_floating_point():
                fails.check(f"{desc} model.state_dict() {k}", model.state_dict()[k], v, 1e-9)
    if round_trip:
        engine.load_full_state_dict(state)  # a full state dict, aliases included, loads back
    engine.eval()
    rows = slice(engine.grid.data_index * (x.shape[0] // engine.grid.data),
                 (engine.grid.data_index + 1) * (x.shape[0] // engine.grid.data))
    got, want = tree_leaves(engine.predict(x_local)), tree_leaves(want_out)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        if not isinstance(w, torch.Tensor):  # a None returned beside the volume
            if g is not w:
                fails.append(f"{desc} predict output {k}: {g!r}, not {w!r}")
            continue
        fails.check(f"{desc} predict output {k}", g, w[rows] if w.dim() and w.shape[0] == x.shape[0] else w)


class CoordsNet(nn.Module):
    """Coordinates made from the volume's extents on the activation's device, of fewer dims than it
    (D x 1 x 1, H x W, W), which broadcasting lines up with its last dims: each cut to the shard's box."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        d = torch.arange(h.shape[2], device=h.device).view(-1, 1, 1)
        hw = torch.arange(h.shape[3], device=h.device).view(-1, 1) * torch.arange(h.shape[4], device=h.device)
        w = torch.linspace(-1, 1, h.shape[4], device=h.device)
        return self.b(h * d + hw - w * h)


class AreaNet(nn.Module):
    """``F.interpolate(mode="area")``, which no split layer computes: the plan runs it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.interpolate(torch.relu(self.a(x)), scale_factor=0.5, mode="area")
        return self.b(F.interpolate(h, size=x.shape[2:], mode="nearest"))


def _body(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    for desc, model, spec in cases:
        try:
            _compare(fails, f"{desc} {spec}", globals()[model], spec, x, y, LOSSES.get(model, F.mse_loss))
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


CASES = [
    (2, "reductions over every dim", "WholeNorm", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "CBAM, a shared MLP and max over channels", "CBAMNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "CBAM, 2x2", "CBAMNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "max's values and chunk's tensors between layers", "MaxChunkNet", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "one conv listed three times in a ModuleList", "RepeatNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "one conv listed three times, 2x2", "RepeatNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a weight-normalised conv run whole", "WNNet",
     {"grid": {"spatial": [2, 1, 1]}, "layers": {"wn": {"spatial": "replicate"}}}),
    (2, "slices of a split dim", "OneSlice", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "slices of split dims, 2x2", "OneSlice", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "isinstance check, spatial", "IsInstanceNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "isinstance check, data x spatial", "IsInstanceNet", {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    (4, "shape reads, 2x2", "ShapeNet", {"grid": {"spatial": [2, 2, 1]}}),
    (4, "shape reads, data x spatial", "ShapeNet", {"grid": {"data": 2, "spatial": [1, 1, 2]}}),
    (4, "a sample's shape read, data x spatial", "SampleShapeNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (4, "a sample's shape checked, data x spatial", "CheckedSampleShapeNet",
     {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    (2, "a sample's shape checked, micro-batches", "CheckedSampleShapeNet",
     {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}),
    (4, "dict of outputs, 2x2", "DictNet", {"grid": {"spatial": [2, 2, 1]}}),
    (4, "dict of outputs, pipe x spatial", "DictNet",
     {"grid": {"pipe": 2, "spatial": [1, 2, 1]},
      "pipeline": {"microbatches": 2, "stages": ["stem", "main"]}}),
    (4, "deep supervision at two extents, data x spatial", "DeepNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (2, "aliased modules, spatial", "AliasNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "PReLU by module swapping, 2x2", "PReLUNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a conv subclass with its own forward, run whole", "WSNet",
     {"grid": {"spatial": [2, 1, 1]}, "layers": {"ws": {"spatial": "replicate"}}}),
    (4, "a conv subclass with its own forward, run split by that forward", "WSNet",
     {"grid": {"spatial": [2, 2, 1]}}),
    (4, "aliased modules, 2x2", "AliasNet", {"grid": {"spatial": [2, 2, 1]}}),
    (4, "a conv whose forward a mixin gives, 2x2", "MixinNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a conv subclass overriding _conv_forward", "WSConvForwardNet", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "unused split heads by module swapping", "SwappedUnusedNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "unused split heads by module swapping, data x spatial", "SwappedUnusedNet",
     {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    (4, "SyncBatchNorm, data x spatial", "SyncBNNet", {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (4, "SyncBatchNorm run replicated, data x spatial", "SyncBNNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}, "layers": {"body.1": {"spatial": "replicate"}}}),
    (4, "SyncBatchNorm inside a block run whole, data x spatial", "SyncBNBlockNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}, "layers": {"block": {"spatial": "replicate"}}}),
    (2, "in-place calls not assigned", "InPlaceNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "in-place calls not assigned, 2x2", "InPlaceNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a view read after its base is written", "ViewedNet", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "an augmented assignment seen through a view", "AugAliasNet", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "an autograd.Function of the user's", "STENet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "an autograd.Function of the user's, 2x2", "STENet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "an autograd.Function on a split layer's weight", "WeightSTENet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "an autograd.Function on a split layer's weight, 2x2", "WeightSTENet",
     {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a traced interpolate that recomputes its scale", "RecomputeNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a layer a parametrization of another holds, 2x2", "HeldLayerNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a layer only a parametrization holds", "HeldOnlyNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a parametrization shared by two layers of one split", "SharedScaleNet",
     {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a nested block writing its input in place", "NestedInPlaceNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "attention over a bottleneck's voxels, data x spatial", "AttentionNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (2, "a Function and hooks reducing the gradient over the volume", "GlobalBackwardNet",
     {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a Function and hooks reducing the gradient over the volume, 2x2", "GlobalBackwardNet",
     {"grid": {"spatial": [2, 2, 1]}}),
    (4, "features stacked and averaged, data x spatial", "StackNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (4, "samples along dim 1 across a pipeline cut, pipe x spatial", "StackNet",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2, "stages": ["a", "act"]}}),
    (2, "a 0-d value across a pipeline cut", "ScalarCutNet",
     {"grid": {"pipe": 2}, "pipeline": {"microbatches": 1, "stages": ["a", "act"]}}),
    (4, "a mask made on the first call behind a flag buffer, 2x2", "LazyMaskNet",
     {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a weight-normalised conv run split", "WNNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a weight-normalised conv run split, data x spatial", "WNNet",
     {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    (4, "a weight-normalised conv by module swapping, 2x2", "SwappedWNNet", {"grid": {"spatial": [2, 2, 1]}}),
    (2, "a second forward argument left at its default", "CondNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a second forward argument left at its default, data x spatial", "CondNet",
     {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    (2, "coordinates of fewer dims than the volume", "CoordsNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "coordinates of fewer dims than the volume, 2x1x2", "CoordsNet", {"grid": {"spatial": [2, 1, 2]}}),
    (2, "an interpolation of area mode, run whole", "AreaNet", {"grid": {"spatial": [2, 1, 1]}}),
    (2, "a weight penalty from self.parameters() returned", "PenaltyNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "a weight penalty from self.parameters() returned, data x spatial", "PenaltyNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (2, "vectors of no batch returned, micro-batches", "VectorsNet",
     {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}),
    (4, "vectors of no batch returned, data x spatial, micro-batches", "VectorsNet",
     {"grid": {"data": 2, "spatial": [1, 2, 1]}, "pipeline": {"microbatches": 2}}),
    (4, "aliased modules, pipe x spatial", "AliasNet",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2, "stages": ["enc", "dec"]}}),
]


@pytest.mark.parametrize("world,desc,model,spec", CASES, ids=[c[1].replace(" ", "_") for c in CASES])
def test_user_models_match_torch(pools, world, desc, model, spec):
    pools(world).run(_body, [(desc, model, spec)], timeout=300)


def _seeded_apart_body(rank: int, world: int, make: str, spec: dict) -> None:
    """Each rank seeds itself apart before building the model (common before DDP): the engine trains
    the first rank's weights and buffers, as one process would."""
    import hybridpar as hp

    fails = Failures()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    torch.manual_seed(0)
    ref = globals()[make]().double()  # rank 0's model, made on every rank
    torch.manual_seed(rank)
    model = globals()[make]().double()
    for b in model.buffers():
        if b.is_floating_point():
            b.add_(rank)
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, y)
    desc = f"seeded apart {make} {spec}"
    for k, v in ref.state_dict().items():
        fails.check(f"{desc}: {k} after parallelize", model.state_dict()[k].to(v.dtype), v, 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    steps_match(fails, desc, engine, opt, ref, ref_opt, (x_local, y_local), (x, y), F.mse_loss)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("make,spec", [
    ("BNNet", {"grid": {"spatial": [2, 2, 1]}}),
    ("AliasNet", {"grid": {"data": 2, "spatial": [1, 2, 1]}}),
    ("AliasNet", {"grid": {"pipe": 2, "spatial": [2, 1, 1]},
                  "pipeline": {"microbatches": 2, "stages": ["enc", "dec"]}}),
], ids=["batchnorm_2x2", "data_x_spatial", "pipe_x_spatial"])
def test_ranks_seeded_apart_train_the_first_ranks_weights(pools, make, spec):
    pools(4).run(_seeded_apart_body, make, spec, timeout=300)


def _direct_layer_body(rank: int, world: int) -> list[str]:
    """A split layer built directly by ranks seeded apart refuses on its first forward, alike on every
    rank; built from one seed it runs."""
    import hybridpar as hp

    grid = hp.ProcessGrid(spatial=(2, 1, 1))
    x = torch.randn(1, 1, 4, 6, 6)
    torch.manual_seed(rank)
    said = []
    try:
        hp.nn.DistConv3d(1, 2, 3, padding=1, grid=grid)(x)
    except ValueError as err:
        said.append(str(err))
    torch.manual_seed(0)
    hp.nn.DistConv3d(1, 2, 3, padding=1, grid=grid)(x)
    return said


def test_a_split_layer_built_from_different_weights_refuses(pools):
    said = pools(2).run(_direct_layer_body)
    assert said[0] == said[1] and len(said[0]) == 1, said
    assert said[0][0].startswith("DistConv3d: its weight, bias differ between the 2 ranks"), said


def test_unfaithful_trace_is_found_and_never_planned():
    """The graph that drops ``x + e`` is named at the node where it parts from the forward; the plan
    is the module-swapping one (the forward itself), and a pipeline is refused."""
    import hybridpar as hp
    from hybridpar.planner.analysis import analyse
    from hybridpar.planner.graph import UntraceableError

    with pytest.raises(UntraceableError, match=r"at node block\.conv .*aten\.add.*aten\.convolution"):
        analyse(IsInstanceNet(), SHAPE)
    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(IsInstanceNet(), SHAPE, 2)
    assert [r.name for r in plan] == ["stem", "block.conv"]
    assert [r.rank_share for r in plan] == [0.5, 0.5]  # 4 samples, one micro-batch, split in two
    with pytest.raises(hp.SpecError, match="computes something other than its forward.*pipeline"):
        hp.ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": {"microbatches": 2}}).plan(
            IsInstanceNet(), SHAPE, 2)


def test_a_write_fx_records_as_a_new_value_is_found():
    """``h *= 2`` with a view of ``h`` read after it: the graph's ``h * 2`` leaves the view unchanged."""
    from hybridpar.planner.analysis import analyse
    from hybridpar.planner.graph import UntraceableError

    with pytest.raises(UntraceableError, match=r"the forward writes aten.mul.Tensor in place into a tensor "
                                               r"that shares memory with another"):
        analyse(AugAliasNet(), SHAPE)


class OutNet(nn.Module):
    """``out=`` writes: into a box of a tensor made like a split activation (its base read after it), or
    into the whole of one (its readers read the write)."""

    def __init__(self, box: bool) -> None:
        super().__init__()
        self.box = box
        self.c1, self.c2 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        buf = torch.zeros_like(h)
        if self.box:
            torch.tanh(h.detach()[:, :, 2:5], out=buf[:, :, 2:5])
        else:
            torch.tanh(h.detach(), out=buf)
        return self.c2(h + buf)


def test_an_out_write_is_followed_as_an_in_place_one():
    """A split ``buf``'s box is a copy on each shard, where one process writes through a view: the graph
    that reads ``buf`` after the write into its box is not run (module swapping follows the write, or
    refuses it); a write into the whole of ``buf`` is read by ``buf``'s later readers."""
    from hybridpar.planner.graph import UntraceableError, trace

    with pytest.raises(UntraceableError, match=r"changes getitem_1 in place \(tanh\) and reads zeros_like"):
        trace(OutNet(box=True))
    graph = trace(OutNet(box=False)).gm.graph
    add = next(n for n in graph.nodes if n.target is operator.add)
    assert [a.name for a in add.args] == ["c1", "tanh"], add.args


def test_faithful_graphs_pass_the_check():
    """Models whose traces are right are not refused: residual and U-Net graphs, functions, shapes."""
    from hybridpar.planner.analysis import analyse

    import graph_models

    for make in (graph_models.UNet3d, graph_models.ResNet3d, graph_models.FunctionalNet, AliasNet):
        analyse(make(), (2, 1, 12, 8, 8))


def _empty_shard_body(rank: int, world: int) -> list[str]:
    import hybridpar as hp

    grid = hp.ProcessGrid(spatial=(1, 1, 4))
    x = torch.randn(1, 2, 5, 4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    said = []
    for layer in (hp.nn.DistAdaptiveMaxPool3d(3, grid=grid), hp.nn.DistAdaptiveAvgPool3d(2, grid=grid),
                  hp.nn.DistGlobalAvgPool3d(grid=grid), hp.nn.DistBatchNorm3d(2, grid=grid),
                  hp.nn.DistGroupNorm(1, 2, grid=grid), hp.nn.DistConv3d(2, 2, 3, padding=1, grid=grid),
                  hp.nn.DistMaxPool3d(2, grid=grid), hp.nn.DistConstantPad3d(1, 0.0, grid=grid),
                  hp.nn.DistUpsample(scale_factor=2, grid=grid)):
        try:
            layer.double()(hp.scatter(x, grid))
        except ValueError as err:
            said.append(str(err))
        else:
            said.append(f"{type(layer).__name__} ran on an empty shard")
    return said


def test_an_empty_shard_is_one_error_on_every_rank(pools):
    """W = 3 split 4 ways leaves a rank nothing: every layer refuses, alike on every rank (no rank
    waits on another in a collective), naming the dim and the split that would fit."""
    said = pools(4).run(_empty_shard_body)
    assert all(s == said[0] for s in said), said
    for line in said[0]:
        assert "dim W has extent 3, too small to split over 4 ranks" in line and "at most 3" in line, line


def test_a_forward_argument_without_a_default_is_refused_naming_it():
    from hybridpar import SpecError
    from hybridpar.planner.graph import trace

    class TwoIn(nn.Module):
        def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
            return x * cond

    with pytest.raises(SpecError, match=r"^model \(TwoIn\): forward takes cond besides its input, with "
                                           r"no default; .* give cond a default \(e.g. cond=None\)"):
        trace(TwoIn())
    assert [n.op for n in trace(CondNet()).gm.graph.nodes].count("placeholder") == 1


def test_a_subclass_with_its_own_forward_is_not_split_as_its_base():
    """WSConv3d(nn.Conv3d) standardises its weight in its forward: split as a Conv3d it would silently
    lose that. It is not its base's entry: it runs its own forward, split call by call (its
    ``F.conv3d`` as a split conv with the standardised weight), in the traced planner and by module
    swapping alike (the numbers are CASES'); torch's own subclasses (Conv1d under _ConvNd) and
    hybridpar's split layers still resolve to their entries."""
    import hybridpar as hp
    from hybridpar.nn import registry
    from hybridpar.planner.swapped import swapped_plan

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    rows = {r.name: r for r in spec.plan(WSNet(), SHAPE, 2)}
    assert rows["ws"].kind == "WSConv3d" and rows["ws"].split == (2, 1, 1) and not rows["ws"].gather
    rows = {r.name: r for r in swapped_plan(WSNet(), SHAPE, (2, 1, 1), 1)}
    assert rows["conv3d"].kind == "Conv3d" and rows["conv3d"].split == (2, 1, 1)
    assert registry.lookup(WSConv3d) is None and registry.lookup(nn.Conv3d) is not None
    assert registry.lookup(MixinConv3d) is None and registry.overriding_forward(MixinConv3d) is _ScaledForward
    assert registry.lookup(WSConvForward3d) is None and "(WSConvForward3d._conv_forward)" in \
        registry.unregistered(WSConvForward3d(1, 1, 3))
    assert registry.lookup(nn.Conv1d) is not None and registry.lookup(nn.SyncBatchNorm) is not None
    assert registry.lookup(hp.nn.DistConv3d) is registry.lookup(nn.Conv3d)


def test_lazy_modules_are_refused_until_materialised():
    """A LazyConv3d before its first forward is one line saying how to materialise it; after, it runs."""
    import hybridpar as hp

    model = nn.Sequential(nn.LazyConv3d(4, 3, padding=1), nn.ReLU(), nn.LazyConvTranspose3d(1, 2, stride=2))
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    with pytest.raises(hp.SpecError, match=r"0 \(LazyConv3d\) has parameters not yet materialised.*Conv3d"):
        spec.plan(model, (2, 1, 8, 8, 8), 2)
    model(torch.zeros(1, 1, 8, 8, 8))
    assert [r.split for r in spec.plan(model, (2, 1, 8, 8, 8), 2)] == [(2, 1, 1)] * 3


def test_masks_comparisons_and_in_place_calls_plan_without_gathers():
    """``h > t``, ``masked_fill_``, ``sub_`` of a volume mean, ``leaky_relu_``, ``sigmoid_``: elementwise,
    run on the shards (each held the whole volume, gathered, before)."""
    import hybridpar as hp

    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 2, 1]}}).plan(InPlaceNet(), SHAPE, 4)
    assert not [r.name for r in plan if r.gather], [(r.name, r.split) for r in plan]


def test_shape_reads_plan_without_gathers():
    """Shapes read in a forward are planned as values, not gathers: ``x.size(0)`` on a split tensor, a
    size taken from one tensor for ``F.interpolate`` of another, a function pad, a channel repeat."""
    import hybridpar as hp

    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 2, 1]}}).plan(ShapeNet(), SHAPE, 4)
    rows = {r.name: r for r in plan}
    assert not [r.name for r in plan if r.gather]
    assert rows["interpolate"].kind == "interpolate" and rows["interpolate"].split == (2, 2, 1)
    assert rows["pad"].split == (2, 2, 1) and rows["repeat"].split == (2, 2, 1)
    assert rows["size"].output_shape == () and rows["size"].activation_bytes == 0


def test_a_parameter_tied_across_pipeline_stages_is_refused():
    """Two layers on two stages applying one weight: each stage would reduce its own part of the
    gradient and the two copies drift apart (0.7 relative error in the first step's gradient)."""
    from hybridpar.planner import ParallelSpec, SpecError
    from hybridpar.planner.plan import build_plan

    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1),
                          nn.Conv3d(2, 2, 3, padding=1), nn.Conv3d(2, 1, 1))
    model[2].weight = model[1].weight
    spec = ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": {"microbatches": 2,
                                                                     "stages": ["0", "2"]}})
    with pytest.raises(SpecError, match=r"^pipeline: 1.weight \(stage 0\) and 2.weight \(stage 1\) "
                                        r"are one parameter"):
        build_plan(spec, model, (2, 1, 8, 6, 6), 2)
    together = ParallelSpec.from_dict({"grid": {"pipe": 2}, "pipeline": {"microbatches": 2,
                                                                         "stages": ["0", "3"]}})
    assert {row.stage for row in build_plan(together, model, (2, 1, 8, 6, 6), 2)} == {0, 1}


def _one_stage_refuses_body(rank: int, world: int) -> str:
    import hybridpar as hp

    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(),
                          torch.nn.utils.parametrizations.spectral_norm(nn.Conv3d(2, 1, 3, padding=1)))
    spec = {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2, "stages": ["0", "2"]}}
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    x = torch.randn(2, 1, 8, 6, 6)
    try:
        engine.train_step(*engine.shard_batch(x, x))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_refusal_on_one_stage_is_raised_on_every_rank(pools):
    """Only the second stage holds the layer it refuses: the first stage raised nothing and waited in
    the first step for the transport's timeout (two minutes) and a message about a receive."""
    said = set(pools(4).run(_one_stage_refuses_body, timeout=60))
    line = said.pop()
    assert not said and "2 (ParametrizedConv3d): its parametrization of weight keeps" in line, line


def _build_refusal(rank: int, world: int, make: Callable[[], nn.Module], spec: dict) -> str:
    """The SpecError a build of ``make()`` under ``spec`` raises on this rank ("no error" if none)."""
    import hybridpar as hp

    engine = hp.parallelize(make(), spec, loss_fn=F.mse_loss)
    try:
        engine.shard_batch(torch.randn(SHAPE))
    except hp.SpecError as err:
        return str(err)
    return "no error"


def _spectral_net() -> nn.Module:
    model = WNNet()
    model.wn = torch.nn.utils.parametrizations.spectral_norm(nn.Conv3d(2, 1, 3, padding=1))
    return model


def test_a_parametrization_with_state_is_refused_split(pools):
    """spectral_norm's power iteration updates its vectors on each computation of the weight, which a
    split layer may compute more than once a forward: refused, saying what to do."""
    said = set(pools(2).run(_build_refusal, _spectral_net, {"grid": {"spatial": [2, 1, 1]}}, timeout=60))
    assert len(said) == 1, said
    line = said.pop()
    assert line.startswith("wn (ParametrizedConv3d): its parametrization of weight keeps state "
                           "(parametrizations.weight.0._u, parametrizations.weight.0._v)") and (
        "(layers: {wn: {spatial: replicate}})" in line), line


class _Scale(nn.Module):
    """A parametrization with a parameter of its own: the weight times a learnt scale."""

    def __init__(self) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.tensor(1.3))

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.s


class SharedScaleNet(nn.Module):
    """One parametrization (its scale) on two convs' weights."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a, self.b = (nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1),
                                     nn.Conv3d(2, 1, 3, padding=1))
        scale = _Scale()
        for conv in (self.a, self.b):
            torch.nn.utils.parametrize.register_parametrization(conv, "weight", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.stem(x)))))


def test_a_parametrization_shared_by_layers_of_two_splits_is_refused(pools):
    """Its scale's gradient comes in parts from both layers' shards, which the engine cannot add up one
    way for both (b's 2 shards are each held by 2 of the 4 ranks): refused, as tied weights are. The
    scale's mark was the first layer's, so the check passed and b's part was counted twice."""
    spec = {"grid": {"spatial": [2, 2, 1]}, "layers": {"b": {"spatial": [2, 1, 1]}}}
    said = set(pools(4).run(_build_refusal, SharedScaleNet, spec, timeout=60))
    assert len(said) == 1, said
    line = said.pop()
    assert line.startswith("parameter a.parametrizations.weight.0.s is also b.parametrizations.weight.0.s: "
                           "a applies it (split over 4 ranks"), line


class _AddOther(nn.Module):
    """A parametrization reading another layer's weight: that layer is also named inside it."""

    def __init__(self, src: nn.Module) -> None:
        super().__init__()
        self.src = src

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + 0.5 * self.src.weight


class HeldLayerNet(nn.Module):
    """``b`` is also ``a.parametrizations.weight.0.src``, the name fx first finds for it: its calls were
    keyed inside the parametrization, where no split version goes, and a plain conv ran on the shards."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a, self.b = (nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1),
                                     nn.Conv3d(2, 1, 3, padding=1))
        torch.nn.utils.parametrize.register_parametrization(self.a, "weight", _AddOther(self.b))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(torch.tanh(self.stem(x)))))


class HeldOnlyNet(nn.Module):
    """A layer only a parametrization holds, called in the forward: no name outside it to key its calls
    by, so the model runs by module swapping (traced, a plain conv ran on each shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.a = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 2, 3, padding=1)
        torch.nn.utils.parametrize.register_parametrization(self.a, "weight",
                                                           _AddOther(nn.Conv3d(2, 1, 3, padding=1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a.parametrizations.weight[0].src(torch.tanh(self.a(torch.tanh(self.stem(x)))))


class DropNet(nn.Module):
    """Element-wise dropout on split activations: a layer, and the function (traced, and in a forward
    fx cannot trace); dropout of whole channels; RReLU's random slopes; and on planes (``h.mean(1)``,
    the depth become channels: 2-d channel dropout and random slopes there, in a forward fx cannot
    trace)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.c1, self.c2 = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.drop = nn.Dropout3d(0.4) if how == "channels" else nn.RReLU(0.1, 0.3) if how in (
            "rrelu", "planes") else nn.Dropout(0.4)
        self.planes = nn.Dropout2d(0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        if self.how in ("untraced", "planes") and x.shape[2] > 4:  # a branch on a shape: module swapping
            h = self.drop(h)
        if self.how == "planes":
            return self.c2(h + self.drop(self.planes(h.mean(1))).unsqueeze(1))
        h = F.dropout(h, 0.3, self.training) if self.how == "function" else self.drop(h)
        return self.c2(h)


def _twins(make: Callable[[], nn.Module]) -> tuple[torch.Tensor, torch.Tensor, nn.Module, nn.Module]:
    """A (2, 1, 9, 6, 6) batch and its target, and two float64 copies of ``make()`` with one set of
    weights: the one process and the one to split."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn((2, 1, 9, 6, 6), dtype=torch.float64, generator=g)
    y = torch.randn(x.shape, dtype=torch.float64, generator=g)
    torch.manual_seed(0)
    ref, model = make().double(), make().double()
    model.load_state_dict(ref.state_dict())
    return x, y, ref, model


def _dropout_body(rank: int, world: int, how: str, spec: dict, apart: bool) -> float:
    """One step from one random state beside one process from the same (``apart``: each rank seeded
    apart, one process as the first): the largest gradient error."""
    import hybridpar as hp

    x, y, ref, model = _twins(lambda: DropNet(how))
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    local = engine.shard_batch(x, y)
    torch.manual_seed(3 + rank * apart)
    engine.train_step(*local)
    torch.manual_seed(3)
    F.mse_loss(ref(x), y).backward()
    return max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(),
                                                                     strict=True))


TWO, TWO_BY_TWO = {"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [2, 2, 1]}}


@pytest.mark.parametrize("world,how,spec,apart", [
    (2, "layer", TWO, False), (4, "layer", TWO_BY_TWO, False), (2, "function", TWO, False),
    (2, "untraced", TWO, False), (4, "layer", TWO_BY_TWO, True), (2, "channels", TWO, True),
    (2, "rrelu", TWO, False), (4, "rrelu", TWO_BY_TWO, False), (2, "planes", TWO, False),
], ids=["layer-2", "layer-2x2", "function-2", "untraced-2", "layer-2x2-seeded-apart",
        "channels-2-seeded-apart", "rrelu-2", "rrelu-2x2", "planes-2"])
def test_dropout_on_a_split_volume_draws_one_process_mask(pools, world, how, spec, apart):
    """Each shard masked by its box of the mask one process draws from the same random state (RReLU's
    slopes, drawn on the gathered volume): the same gradients, where a copy on the shards drew one mask
    per shard, alike. Ranks seeded apart draw from
    the split's first rank's stream (hybridpar.comm.random_streams): a channel dropped on one shard is
    dropped on all."""
    errors = pools(world).run(_dropout_body, how, spec, apart, timeout=120)
    assert max(errors) < 1e-12, f"{how} {spec}: gradients off one process's by {errors}"


class CheckpointNet(nn.Module):
    """Activation checkpointing in a forward fx cannot trace (a branch on depth): of layers alone it
    trains as one process; around a functional pool, which the engine runs split only while it follows
    the forward (the recomputation in the backward runs on the bare shards), it is refused."""

    def __init__(self, functional: bool, reentrant: bool) -> None:
        super().__init__()
        self.functional, self.reentrant = functional, reentrant
        self.c1 = nn.Conv3d(1, 4, 3, padding=1)
        self.block = nn.Sequential(nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Tanh())
        self.c2 = nn.Conv3d(4, 1, 3, padding=1)

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        h = self.block(h)
        return F.avg_pool3d(h, 3, 1, 1) if self.functional else h

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        if x.shape[2] > 4:
            h = torch.utils.checkpoint.checkpoint(self._inner, h, use_reentrant=self.reentrant)
        return self.c2(h)


def _checkpoint_body(rank: int, world: int, functional: bool, reentrant: bool) -> str:
    import hybridpar as hp

    x, y, ref, model = _twins(lambda: CheckpointNet(functional, reentrant))
    try:
        engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
        engine.train_step(*engine.shard_batch(x, y))
    except ValueError as err:
        return str(err)
    F.mse_loss(ref(x), y).backward()
    off = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters(),
                                                                    strict=True))
    return f"off by {off:.1e}"


@pytest.mark.parametrize("functional,reentrant", [(False, True), (False, False), (True, True), (True, False)],
                         ids=["layers-reentrant", "layers", "functional-reentrant", "functional"])
def test_activation_checkpointing_in_an_untraced_forward(pools, functional, reentrant):
    said = set(pools(2).run(_checkpoint_body, functional, reentrant, timeout=120))
    assert len(said) == 1, said
    line = said.pop()
    if functional:
        assert "avg_pool3d inside torch.utils.checkpoint" in line, line
    else:
        assert line.startswith("off by") and float(line.split()[-1]) < 1e-12, line


class CheckpointedPool(CheckpointNet):
    """A max pool (a Python function of torch's, whose frames lie between the planner's two modes)
    inside the checkpoint."""

    def _inner(self, h: torch.Tensor) -> torch.Tensor:
        return F.interpolate(F.max_pool3d(self.block(h), 2), scale_factor=2)


def test_a_checkpointed_call_is_refused_by_the_plan():
    """The plan (a forward on the meta device, under its own mode) sees the call inside the checkpoint
    too: refused before any step, not left to the run."""
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    with pytest.raises(hp.SpecError, match=r"max_pool3d inside torch.utils.checkpoint"):
        spec.plan(CheckpointedPool(True, False), (2, 1, 8, 8, 8), 2)


class EvalOnlyNet(nn.Module):
    """A forward fx cannot trace (a branch on depth) that calls, in eval mode only, what cannot run on
    shards (a flip along a split dim): planned in training, it must not run that call unsplit later."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        if x.shape[2] > 4 and not self.training:
            h = h + h.flip(2)
        return self.c2(h)


def _eval_only_body(rank: int, world: int) -> str:
    import hybridpar as hp

    x = torch.randn((2, 1, 9, 6, 6), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    model = EvalOnlyNet().double()
    ref = EvalOnlyNet().double().eval()
    ref.load_state_dict(model.state_dict())
    engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, x)
    engine.train_step(x_local, y_local)
    model.zero_grad()
    ref.load_state_dict(model.state_dict())
    engine.eval()
    try:
        got = engine.predict(x_local)
    except ValueError as err:
        return str(err)
    with torch.no_grad():
        return f"off by {(got - ref(x)).abs().max().item():.1e}"


def test_a_call_met_only_in_another_mode_is_never_run_unsplit(pools):
    said = set(pools(2).run(_eval_only_body, timeout=120))
    assert len(said) == 1, said
    line = said.pop()
    assert "flip" in line or (line.startswith("off by") and float(line.split()[-1]) < 1e-12), line


def test_a_trace_leaves_nothing_on_the_model():
    """fx keeps the tensors a forward computes from real ones while traced on the traced module: not on
    the user's model, which stays as it was (a deep copy of it still works)."""
    import copy

    import hybridpar as hp

    model = PenaltyNet()
    hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(model, (2, 1, 8, 6, 6), 2)
    assert not [k for k in vars(model) if k.startswith("_tensor_constant")]
    copy.deepcopy(model)
