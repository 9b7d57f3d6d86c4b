"""Cases run on every rank of a spawned group: the U-Net layers against torch on the whole volume.

DistUpsample and dist_interpolate (nearest, nearest-exact, trilinear with and without align_corners;
int, float and per-dim scale factors, sizes, recompute_scale_factor), DistGroupNorm,
DistInstanceNorm3d (affine or not, tracked running statistics or not, training and eval),
DistAdaptiveAvgPool3d and DistAdaptiveMaxPool3d (any output size; ties across shards), the
DistBatchNorm3d fixes (``bias=False``, an empty batch), boxes of slices (``x[..., a:b:s]``, a
crop), and the registry's conversions. Everything in
float64 against torch.nn with :func:`layer_cases.compare_layer` (relative error <= 1e-10 on output,
input gradient, parameter gradients and buffers). Extents are odd and uneven (5, 7, 9, 13) so shards
differ in size; every description names its case and grid.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp
from hybridpar.geometry import HaloError
from hybridpar.nn import registry
from hybridpar.nn.upsample import dim_taps, resample_plans, resampling

from layer_cases import Failures, _same_on_all, compare_layer

SHAPES = [(2, 2, 7, 9, 5), (1, 3, 13, 5, 9), (2, 2, 9, 13, 7)]


def _fits_upsample(shape, grid, **kw) -> bool:
    """Whether every dim's halo plan exists (the layer must then run; otherwise raise HaloError)."""
    dhw = tuple(shape[2:])
    r = resampling(dhw, kw.get("size"), kw.get("scale_factor"), kw["mode"], kw.get("align_corners"),
                   kw.get("recompute_scale_factor"))
    try:
        for i, parts in enumerate(grid.spatial_shape):
            taps = dim_taps(dhw[i], r.out[i], r.scales[i], kw["mode"], kw.get("align_corners"), torch.float64)
            resample_plans(dhw[i], r.out[i], parts, taps)
    except HaloError:
        return False
    return True


def upsample_cases() -> list[dict]:
    """Every mode with every way of giving the output extent, up- and downsampling."""
    cases = []
    for mode, ac in (("nearest", None), ("nearest-exact", None), ("trilinear", False), ("trilinear", True)):
        for extent in (dict(scale_factor=2), dict(scale_factor=3), dict(scale_factor=1.5),
                       dict(scale_factor=(2, 1.5, 3)), dict(scale_factor=2.5, recompute_scale_factor=True),
                       dict(scale_factor=0.6), dict(size=(11, 20, 8)), dict(size=(7, 9, 13))):
            cases.append(dict(mode=mode, align_corners=ac, **extent))
    return cases


class Interp(nn.Module):
    """``F.interpolate`` as a module: ``dist_interpolate`` when given a grid (the functional form)."""

    def __init__(self, grid=None, **kw) -> None:
        super().__init__()
        self.grid, self.kw = grid, kw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grid is None:
            return F.interpolate(x, **self.kw)
        return hp.nn.dist_interpolate(x, self.grid, **self.kw)


def run_upsample(fails: Failures, grid) -> int:
    count = 0
    for i, kw in enumerate(upsample_cases()):
        shape = SHAPES[i % len(SHAPES)]
        ok = _fits_upsample(shape, grid, **kw)
        ours = hp.nn.DistUpsample(**kw, grid=grid)
        compare_layer(fails, f"upsample {kw} shape {shape} grid {grid.spatial_shape}", grid,
                      nn.Upsample(**kw), ours, shape, 3 * i, expect_error=not ok)
        count += 1
        if i % 3 == 0:  # the functional form, with and without the global shape given
            given = dict(global_shape=shape[2:]) if i % 2 else {}
            ours = Interp(grid, **kw, **given)
            compare_layer(fails, f"dist_interpolate {kw} {given} shape {shape} grid {grid.spatial_shape}",
                          grid, Interp(**kw), ours, shape, 5 * i, expect_error=not ok)
            count += 1
    # a split finer than the output extent (13 -> 2) must be a HaloError on 3-way splits
    kw = dict(scale_factor=0.2, mode="nearest")
    shape = (1, 1, 13, 13, 13)
    ok = _fits_upsample(shape, grid, **kw)
    compare_layer(fails, f"upsample {kw} too fine grid {grid.spatial_shape}", grid, nn.Upsample(**kw),
                  hp.nn.DistUpsample(**kw, grid=grid), shape, 1, expect_error=not ok)
    return count + 1


def run_group_norm(fails: Failures, grid) -> int:
    count = 0
    for groups, channels, affine, bias in ((1, 4, True, True), (2, 4, True, True), (4, 4, False, True),
                                           (3, 6, True, False), (2, 6, False, True)):
        for i, shape in enumerate(SHAPES[:2]):
            shape = (shape[0], channels, *shape[2:])
            torch.manual_seed(i)
            ref = nn.GroupNorm(groups, channels, affine=affine, bias=bias)
            if affine:  # not the initial ones and zeros: gradients through them must be right too
                with torch.no_grad():
                    ref.weight.normal_()
                    if ref.bias is not None:
                        ref.bias.normal_()
            ours = hp.nn.DistGroupNorm(groups, channels, affine=affine, bias=bias, grid=grid)
            compare_layer(fails, f"groupnorm G={groups} C={channels} affine={affine} bias={bias} "
                          f"shape {shape} grid {grid.spatial_shape}", grid, ref, ours, shape, 7 + i)
            count += 1
    return count


def run_instance_norm(fails: Failures, grid) -> int:
    count = 0
    for affine, track, momentum, bias in ((False, False, 0.1, True), (True, False, 0.1, True),
                                          (False, True, 0.1, True), (True, True, 0.3, True),
                                          (True, True, None, True), (True, True, 0.1, False)):
        shape = (2, 3, 9, 7, 5)
        torch.manual_seed(3)
        kw = dict(affine=affine, track_running_stats=track, momentum=momentum, bias=bias)
        ref = nn.InstanceNorm3d(3, **kw)
        if affine:
            with torch.no_grad():
                ref.weight.normal_()
                if ref.bias is not None:
                    ref.bias.normal_()
        if track:
            with torch.no_grad():
                ref.running_mean.normal_()
                ref.running_var.uniform_(0.5, 2.0)
        ours = hp.nn.DistInstanceNorm3d(3, **kw, grid=grid)
        desc = f"instancenorm {kw} grid {grid.spatial_shape}"
        compare_layer(fails, desc, grid, ref, ours, shape, 21, steps=2)
        ref.eval()
        ours.eval()
        compare_layer(fails, f"{desc} eval", grid, ref, ours, shape, 23)
        count += 2
    return count


class Quantize(nn.Module):
    """Rounds to multiples of 0.5 (many ties in every bin, across shards too) with an identity
    gradient, so that a max pool's choice among ties decides where the gradient goes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (torch.round(2 * x) / 2 - x).detach()


ADAPTIVE_SIZES = [1, 2, (3, 1, 2), (None, 2, 5), (4, 6, 3), 11]


def run_adaptive(fails: Failures, grid) -> int:
    count = 0
    for i, size in enumerate(ADAPTIVE_SIZES):
        shape = SHAPES[i % len(SHAPES)]
        where = f"size {size} shape {shape} grid {grid.spatial_shape}"
        compare_layer(fails, f"adaptive avg {where}", grid, nn.AdaptiveAvgPool3d(size),
                      hp.nn.DistAdaptiveAvgPool3d(size, grid=grid), shape, 31 + i, replicated_out=True)
        compare_layer(fails, f"adaptive max {where}", grid, nn.AdaptiveMaxPool3d(size),
                      hp.nn.DistAdaptiveMaxPool3d(size, grid=grid), shape, 41 + i, replicated_out=True)
        compare_layer(fails, f"adaptive max with ties {where}", grid,
                      nn.Sequential(Quantize(), nn.AdaptiveMaxPool3d(size)),
                      nn.Sequential(Quantize(), hp.nn.DistAdaptiveMaxPool3d(size, grid=grid)), shape, 51 + i,
                      replicated_out=True)
        count += 3
    for size in (1, (3, 1, 2)):  # return_indices: torch's flat indices into each (n, c) volume
        shape = SHAPES[0]
        x = torch.round(2 * _same_on_all(shape, 61)) / 2
        want, want_idx = nn.AdaptiveMaxPool3d(size, return_indices=True)(x)
        got, got_idx = hp.nn.DistAdaptiveMaxPool3d(size, return_indices=True, grid=grid)(hp.scatter(x, grid))
        fails.check(f"adaptive max indices size {size} grid {grid.spatial_shape} values", got, want)
        if not torch.equal(got_idx, want_idx):
            fails.append(f"adaptive max indices size {size} grid {grid.spatial_shape}: indices differ")
        count += 1
    return count


def run_batch_norm_fixes(fails: Failures, grid) -> int:
    shape = (2, 3, 9, 7, 5)
    ref = nn.BatchNorm3d(3, bias=False)
    with torch.no_grad():
        ref.weight.normal_()
    ours = hp.nn.DistBatchNorm3d(3, bias=False, grid=grid)
    desc = f"batchnorm bias=False grid {grid.spatial_shape}"
    compare_layer(fails, desc, grid, ref, ours, shape, 71, steps=2)
    ref.eval()
    ours.eval()
    compare_layer(fails, f"{desc} eval", grid, ref, ours, shape, 73)
    for momentum in (0.1, None):  # an empty batch: empty output, one more batch counted, stats kept
        ref = nn.BatchNorm3d(3, momentum=momentum)
        with torch.no_grad():
            ref.running_mean.normal_()
            ref.weight.normal_()
        ours = hp.nn.DistBatchNorm3d(3, momentum=momentum, grid=grid)
        compare_layer(fails, f"batchnorm empty batch momentum={momentum} grid {grid.spatial_shape}", grid,
                      ref, ours, (0, 3, 9, 7, 5), 75, steps=2)
    return 4


def _converted(m: nn.Module, grid) -> nn.Module:
    """What the converter does: the registry's Dist layer from the module's own hyperparameters."""
    return registry.lookup(m).to_dist(m, grid, False)


def run_conversions(fails: Failures, grid) -> int:
    """Every new registry entry builds a Dist layer that gives torch's results."""
    shape = (2, 4, 9, 7, 5)
    torch.manual_seed(0)
    mods = [(nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True), False),
            (nn.Upsample(size=(13, 11, 9)), False), (nn.GroupNorm(2, 4, bias=False), False),
            (nn.InstanceNorm3d(4, affine=True, track_running_stats=True), False),
            (nn.BatchNorm3d(4, bias=False), False), (nn.AdaptiveAvgPool3d((2, 3, 1)), True),
            (nn.AdaptiveAvgPool3d(1), True), (nn.AdaptiveMaxPool3d((1, 2, 2)), True)]
    for i, (m, replicated) in enumerate(mods):
        entry = registry.lookup(m)
        if entry.replicated_output(m) != replicated:
            fails.append(f"registry: {m} replicated_output is {entry.replicated_output(m)}")
        ours = _converted(m, grid)
        if type(ours).__name__.removeprefix("Dist") != type(m).__name__:
            fails.append(f"registry: {m} converts to {type(ours).__name__}")
        compare_layer(fails, f"converted {m} grid {grid.spatial_shape}", grid, m, ours, shape, 81 + i,
                      steps=2, replicated_out=replicated)
    return len(mods)


class TinyUNet(nn.Module):
    """One U-Net level: conv, GroupNorm, max pool, conv, InstanceNorm, trilinear upsampling, a skip
    concatenated on channels, conv, and an adaptive average pool head (replicated output)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Conv3d(2, 4, 3, padding=1)
        self.norm1 = nn.GroupNorm(2, 4)
        self.down = nn.MaxPool3d(2)
        self.mid = nn.Conv3d(4, 4, 3, padding=1, bias=False)  # InstanceNorm makes a bias's gradient 0
        self.norm2 = nn.InstanceNorm3d(4, affine=True, track_running_stats=True)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear")
        self.dec = nn.Conv3d(8, 4, 3, padding=1)
        self.head = nn.AdaptiveAvgPool3d((2, 1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = torch.relu(self.norm1(self.enc(x)))
        m = torch.relu(self.norm2(self.mid(self.down(e))))
        return self.head(self.dec(torch.cat([e, self.up(m)], 1)))


def run_unet(fails: Failures, grid) -> int:
    """The layers composed (every child converted through the registry), global shapes set once."""
    torch.manual_seed(1)
    ref = TinyUNet()
    ours = TinyUNet()
    for name, child in list(ours.named_children()):
        setattr(ours, name, _converted(child, grid))
    shape = (2, 2, 10, 12, 8)
    hp.nn.set_global_shapes(ours, shape)
    compare_layer(fails, f"tiny unet grid {grid.spatial_shape}", grid, ref, ours, shape, 91, steps=2,
                  replicated_out=True)
    return 1


class Index(nn.Module):
    """``x[index]`` as a module: the reference a :class:`~hybridpar.nn.slicing.VolumeSlice` must match."""

    def __init__(self, index) -> None:
        super().__init__()
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.index]


SLICES = [(Ellipsis, slice(1, -1), slice(None), slice(2, None)),  # a crop at both ends, one dim whole
          (slice(None), slice(None), slice(None, None, 2), slice(1, None, 3), slice(None)),  # strided
          (slice(None), slice(1, 2), slice(3, 9), slice(0, 4), slice(2, 7, 2)),  # a channel, a box
          (Ellipsis, slice(-4, None), slice(None, -3, 2), slice(1, 2)),  # one voxel thick along W
          (slice(None), slice(None), slice(5, 6))]  # one plane of D, kept as a dim
"""Boxes of slices on the odd, uneven extents of :data:`SHAPES` (steps and negative bounds too)."""


def _box_fits(box: nn.Module, shape, grid) -> bool:
    """Whether every dim's halo plan exists (a box thinner than the split, or one that reads beyond a
    neighbour's shard, is a HaloError naming the dim and the split that fits)."""
    try:
        for w, extent, parts in zip(registry.lookup(box).windows_of(box), shape[2:], grid.spatial_shape):
            w.plans(extent, parts)
    except HaloError:
        return False
    return True


def run_volume_slice(fails: Failures, grid) -> int:
    """``x[index]`` on a split volume: every rank's balanced shard of the box, and its backward."""
    from hybridpar.nn.slicing import box_of

    count = 0
    for i, index in enumerate(SLICES):
        for shape in SHAPES:
            box = box_of(index, shape[2:])
            ours = registry.lookup(box).to_dist(box, grid)
            compare_layer(fails, f"x[{index}] shape {shape} grid {grid.spatial_shape}", grid, Index(index),
                          ours, shape, 7 * i + shape[3], expect_error=not _box_fits(box, shape, grid))
            count += 1
    return count


FAMILIES = {  # layer_cases.run_family runs one per pytest test
    "upsample": lambda fails, grid, rng, opts: run_upsample(fails, grid),
    "group_norm": lambda fails, grid, rng, opts: run_group_norm(fails, grid),
    "instance_norm": lambda fails, grid, rng, opts: run_instance_norm(fails, grid),
    "adaptive": lambda fails, grid, rng, opts: run_adaptive(fails, grid),
    "batch_norm_fixes": lambda fails, grid, rng, opts: run_batch_norm_fixes(fails, grid),
    "conversions": lambda fails, grid, rng, opts: run_conversions(fails, grid),
    "unet": lambda fails, grid, rng, opts: run_unet(fails, grid),
    "volume_slice": lambda fails, grid, rng, opts: run_volume_slice(fails, grid),
}
