"""Users' own layers with parameters, and parameters shared between layers, trained exactly or refused.

* A ``resample`` layer registered without a split version (a copy runs on each shard: nearest x2
  upsampling, a stride-2 pick, each times a learnable gain): where every shard boundary falls on its
  factor it runs split, its gain's gradient summed over the shards; where one does not (depth 9 split
  5 | 4) the plan runs it whole, or with ``strict`` refuses it naming the layer, the dim and what fits.
* A ``reduce`` layer's split version written with the public API (``volume_sum``, ``applied_whole`` for a
  weight on the pooled values, ``applied_split`` for one on the shard): both weights' gradients exact.
* A norm of one's own, its split version summing with ``volume_sum`` and using the totals on the shard
  (their gradients summed over the shards: ``nn/value_flow.py``), a weight on each side: exact.
* A parameter tied between two split layers trains exactly.
* A registered layer whose own forward works across the samples (a norm over the batch's too) is refused
  on micro-batches, as a BatchNorm is; one per sample is planned.

Three SGD steps in float64 against one process (``_compare``), on 2 ranks and 2x2x1 and data x spatial.
What cannot be exact is refused before any step, in one line: a split version whose gradients are not
the layer's on the volume (a sum by hand with ``dist.all_reduce``, blind to autograd), a parameter tied
between a split layer and one run replicated, a reduce layer's parameter of unstated accounting, a
window or reduce layer registered without a split version.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp

from layer_cases import Failures
from test_user_models import _compare

ALIGNED = (2, 2, 8, 8, 6)  # every boundary of a 2x2x1 split even (4 | 4): a copy of a x2 resampling is exact
UNEVEN = (2, 2, 9, 7, 6)  # depth 9 split 5 | 4: a boundary at 5, odd


def _gain(ch: int) -> nn.Parameter:
    return nn.Parameter(torch.linspace(0.5, 1.5, ch))


class LearnUp(nn.Module):
    """Nearest x2 upsampling times a learnable gain per channel: no split version of its own."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.gain = _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for d in (2, 3, 4):
            x = x.repeat_interleave(2, dim=d)
        return x * self.gain.view(1, -1, 1, 1, 1)


class LearnDown(nn.Module):
    """Every other voxel times a learnable gain: right on a shard only where it starts at an even index."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.gain = _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, ::2, ::2, ::2] * self.gain.view(1, -1, 1, 1, 1)


def _pointwise_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor):
    return {"forward_other": y.numel()}, None


hp.nn.register(LearnUp, role="resample", op="pointwise", flops=_pointwise_flops)
hp.nn.register(LearnDown, role="resample", op="pointwise", flops=_pointwise_flops)


class WeightedPool(nn.Module):
    """The volume's mean of ``x * a`` (``a`` on the voxels), times ``w`` (on the pooled values)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.a, self.w = _gain(ch), nn.Parameter(torch.linspace(2.0, 1.0, ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.a.view(1, -1, 1, 1, 1)).mean(dim=(2, 3, 4)) * self.w


class DistWeightedPool(hp.nn.SpatialLayer, WeightedPool):
    """Its split version, the README's recipe: each parameter's accounting said, the sum over the volume
    by ``volume_sum``."""

    def __init__(self, ch: int, *, grid, state: bool = True) -> None:
        WeightedPool.__init__(self, ch)
        self.init_spatial(grid)
        if state:
            self.applied_split(self.a)  # on the shard, before the reduction: a part per shard
            self.applied_whole(self.w)  # on the pooled, whole values: the whole gradient on every rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        voxels = x.new_tensor(self.global_shape(x)).prod()  # alike on every rank, whole
        total = self.volume_sum((x * self.a.view(1, -1, 1, 1, 1)).sum(dim=(2, 3, 4)))
        return total / voxels * self.w


class SilentPool(WeightedPool):
    """The same layer, whose split version says nothing of its parameters (refused)."""


hp.nn.register(WeightedPool, role="reduce", op="pool", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap=False: DistWeightedPool(m.w.numel(), grid=grid))
hp.nn.register(SilentPool, role="reduce", op="pool", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap=False: DistWeightedPool(m.w.numel(), grid=grid, state=False))


class GeM(nn.Module):
    """A generalised mean: its ``p`` on the shard (``x ** p``) and on the pooled value (``** (1 / p)``)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.full((ch,), 2.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs().add(1e-2).pow(self.p.view(1, -1, 1, 1, 1)).mean(dim=(2, 3, 4)).pow(1.0 / self.p)


class DistGeM(hp.nn.SpatialLayer, GeM):
    """Its split version, ``p`` said to be applied to the shard: true of one of its two uses only."""

    def __init__(self, ch: int, *, grid) -> None:
        GeM.__init__(self, ch)
        self.init_spatial(grid)
        self.applied_split(self.p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, h, w = self.global_shape(x)
        total = self.volume_sum(x.abs().add(1e-2).pow(self.p.view(1, -1, 1, 1, 1)).sum(dim=(2, 3, 4)))
        return (total / (d * h * w)).pow(1.0 / self.p)


hp.nn.register(GeM, role="reduce", op="pool", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap=False: DistGeM(m.p.numel(), grid=grid))


class OwnNorm(nn.Module):
    """An instance norm of one's own: ``t`` tempers the variance (a whole value), ``g`` scales the
    normalised voxels (the shard)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.t, self.g = nn.Parameter(torch.full((ch,), 1.5)), _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.mean(dim=(2, 3, 4), keepdim=True)
        v = (x - m).pow(2).mean(dim=(2, 3, 4), keepdim=True)
        return (x - m) * (v * self.t.view(1, -1, 1, 1, 1) + 1e-5).rsqrt() * self.g.view(1, -1, 1, 1, 1)


class DistOwnNorm(hp.nn.SpatialLayer, OwnNorm):
    """Its split version: the mean and variance by ``volume_sum``, subtracted from and applied to the
    shard, each shard's part of their gradients summed by the engine."""

    def __init__(self, ch: int, *, grid) -> None:
        OwnNorm.__init__(self, ch)
        self.init_spatial(grid)
        self.applied_whole(self.t)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.new_tensor(self.global_shape(x)).prod()
        m = self.volume_sum(x.sum(dim=(2, 3, 4), keepdim=True)) / n
        v = self.volume_sum((x - m).pow(2).sum(dim=(2, 3, 4), keepdim=True)) / n
        return (x - m) * (v * self.t.view(1, -1, 1, 1, 1) + 1e-5).rsqrt() * self.g.view(1, -1, 1, 1, 1)


hp.nn.register(OwnNorm, role="pointwise", op="norm", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap=False: DistOwnNorm(m.g.numel(), grid=grid))


def NormNet() -> nn.Module:  # noqa: N802
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), OwnNorm(2), nn.Conv3d(2, 1, 3, padding=1))


class HandNorm(OwnNorm):
    """The same norm, whose split version sums by hand with ``dist.all_reduce``: its forward is the
    layer's, its backward blind to the sum (each shard's part of the mean's gradient kept apart)."""


class DistHandNorm(hp.nn.SpatialLayer, HandNorm):
    def __init__(self, ch: int, *, grid) -> None:
        HandNorm.__init__(self, ch)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.new_tensor(self.global_shape(x)).prod()
        m = x.sum(dim=(2, 3, 4), keepdim=True)
        torch.distributed.all_reduce(m, group=self.grid.spatial_group)
        v = (x - m / n).pow(2).sum(dim=(2, 3, 4), keepdim=True)
        torch.distributed.all_reduce(v, group=self.grid.spatial_group)
        rstd = (v / n * self.t.view(1, -1, 1, 1, 1) + 1e-5).rsqrt()
        return (x - m / n) * rstd * self.g.view(1, -1, 1, 1, 1)


hp.nn.register(HandNorm, role="pointwise", op="norm", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap=False: DistHandNorm(m.g.numel(), grid=grid))


class BinomialBlur(nn.Module):
    """A fixed binomial blur (a buffer, saved for the backward by ``F.conv3d``) times a learnable gain."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        k = torch.tensor([0.25, 0.5, 0.25])
        self.register_buffer("kern", (k[:, None, None] * k[None, :, None] * k).expand(ch, 1, 3, 3, 3).clone())
        self.gain = _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(x, self.kern, padding=1, groups=len(self.gain)) * self.gain.view(1, -1, 1, 1, 1)


class DistBinomialBlur(hp.nn.SpatialLayer, BinomialBlur):
    def __init__(self, ch: int, *, grid) -> None:
        BinomialBlur.__init__(self, ch)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(self.with_halos(x), self.kern, groups=len(self.gain)) * self.gain.view(1, -1, 1, 1, 1)


hp.nn.register(BinomialBlur, role="window", op="conv", window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
               to_dist=lambda m, grid, overlap=False: DistBinomialBlur(m.gain.numel(), grid=grid),
               flops=_pointwise_flops)


class BlurTwice(nn.Module):
    """The blur on the volume and again on its depth-averaged planes (one plane: not split), the second
    call's buffer read while the first call's backward still needs it."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.blur = nn.Conv3d(2, 2, 3, padding=1), BinomialBlur(2)
        self.c2 = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.c1(x))
        low = F.avg_pool3d(h, (h.shape[2], 1, 1))
        return self.c2(self.blur(h) * torch.sigmoid(self.blur(low)))


class CheckpointedNorm(nn.Module):
    """``OwnNorm`` recomputed in the backward (``torch.utils.checkpoint``), its first forward checked
    inside the checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.norm = nn.Conv3d(2, 2, 3, padding=1), OwnNorm(2)
        self.c2 = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.utils.checkpoint.checkpoint(self.norm, self.c1(x), use_reentrant=False)
        return self.c2(h)


class AvgMax(nn.Module):
    """Average and max pools, weighted: two tensors out."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.mix = _gain(ch)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.mix.view(1, -1, 1, 1, 1)
        return F.avg_pool3d(x, 2) * w, F.max_pool3d(x, 2) * (1 - w)


class DistAvgMax(hp.nn.SpatialLayer, AvgMax):
    def __init__(self, ch: int, *, grid) -> None:
        AvgMax.__init__(self, ch)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, w = self.with_halos(x), self.mix.view(1, -1, 1, 1, 1)
        return F.avg_pool3d(h, 2) * w, F.max_pool3d(h, 2) * (1 - w)


hp.nn.register(AvgMax, role="window", op="pool", window=lambda m: (hp.nn.Window(2, 2, 0, 0),) * 3,
               to_dist=lambda m, grid, overlap=False: DistAvgMax(m.mix.numel(), grid=grid),
               flops=_pointwise_flops)


def UpNet() -> nn.Module:  # noqa: N802 (named as the model it builds)
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), LearnUp(2), nn.Tanh(), nn.Conv3d(2, 1, 3, padding=1))


def DownNet() -> nn.Module:  # noqa: N802
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Tanh(), LearnDown(2),
                         nn.Conv3d(2, 1, 3, padding=1))


def PoolNet() -> nn.Module:  # noqa: N802
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Tanh(), WeightedPool(2), nn.Linear(2, 1))


def SilentPoolNet() -> nn.Module:  # noqa: N802
    return nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), nn.Tanh(), SilentPool(2), nn.Linear(2, 1))


class TiedSplit(nn.Module):
    """Two convolutions sharing one weight, both run split: their shards' parts add up alike."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(2, 2, 3, padding=1)
        self.b = nn.Conv3d(2, 2, 3, padding=1)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TiedReplicated(nn.Module):
    """A weight shared by a split conv and one on a pooled level of depth 1, which runs replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d((1, 3, 3))
        self.b = nn.Conv3d(2, 2, 3, padding=1)
        self.b.weight = self.a.weight
        self.fc = nn.Linear(18, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.b(self.pool(torch.tanh(self.a(x)))), 1))


class TiedBiasHead(nn.Module):
    """A split conv's bias tied to the replicated Linear head's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(2, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(2, 2)
        self.fc.bias = self.conv.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(torch.tanh(self.conv(x))), 1))


def _body(rank: int, world: int, cases: list[tuple[str, str, tuple[int, ...], dict]]) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(5)
    for desc, model, shape, spec in cases:
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        with torch.no_grad():
            y = torch.randn(globals()[model]().double()(x).shape, dtype=torch.float64, generator=g)
        try:
            _compare(fails, f"{desc} {spec}", globals()[model], spec, x, y)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


def _cases(spec: dict) -> list[tuple[str, str, tuple[int, ...], dict]]:
    return [("resample copy, aligned: run split", "UpNet", ALIGNED, spec),
            ("resample copy, unaligned: run whole", "UpNet", UNEVEN, spec),
            ("stride-2 pick, aligned: run split", "DownNet", ALIGNED, spec),
            ("stride-2 pick, unaligned: run whole", "DownNet", UNEVEN, spec),
            ("reduce layer, weights before and after the reduction", "PoolNet", UNEVEN, spec),
            ("a norm of one's own, volume_sum's totals used on the shard", "NormNet", UNEVEN, spec),
            ("a window layer reading a buffer, on the volume and on one plane", "BlurTwice", UNEVEN, spec),
            ("a norm of one's own under torch.utils.checkpoint", "CheckpointedNorm", UNEVEN, spec),
            ("a weight tied between two split layers", "TiedSplit", UNEVEN, spec)]


@pytest.mark.parametrize("world,spec", [
    (2, {"grid": {"spatial": [2, 1, 1]}}),
    (4, {"grid": {"spatial": [2, 2, 1]}}),
    (4, {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
], ids=["2_ranks", "2x2", "data_x_spatial"])
def test_own_layers_with_parameters_match_one_process(pools, world, spec):
    pools(world).run(_body, _cases(spec), timeout=300)


def _refused_body(rank: int, world: int) -> list[str]:
    """Each model's build on 2 ranks: what it says (every rank alike), before any step."""
    said = []
    for make in (TiedReplicated, TiedBiasHead, SilentPoolNet):
        try:
            engine = hp.parallelize(make().double(), {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
            engine.bind(UNEVEN)
            said.append(f"{make.__name__}: built")
        except ValueError as err:
            said.append(str(err))
    return said


def _both_sides_body(rank: int, world: int) -> str:
    """A reduce layer's parameter applied both to the shard and to whole values: its first forward says
    so, before any gradient is reduced."""
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), GeM(2), nn.Linear(2, 1)).double()
    engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
    x = torch.randn(2, 1, *UNEVEN[2:], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"DistGeM\(1\): its parameter p is applied both to the shard") \
            as err:
        engine.train_step(*engine.shard_batch(x, torch.randn(2, 1, dtype=torch.float64)))
    return str(err.value)


class GuardedGain(nn.Module):
    """A gain registered ``pointwise`` with no split version, whose forward reads its input's depth: a copy
    on a shard of depth 4 takes the other branch than the volume of depth 9 (and on one rank only)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.g = _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g.view(1, -1, 1, 1, 1) if x.shape[2] > 4 else x


hp.nn.register(GuardedGain, role="pointwise", op="pointwise", flops=_pointwise_flops)

class AddedParts(nn.Module):
    """``AvgMax``'s two tensors added (torch.fx cannot unpack a layer's output: run by module swapping)."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.conv, self.pool = nn.Conv3d(1, ch, 3, padding=1), AvgMax(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.pool(self.conv(x))
        return (a + b).mean(1, keepdim=True)


def _between(layer: type[nn.Module]) -> Callable[[int], nn.Module]:
    return lambda ch: nn.Sequential(nn.Conv3d(1, ch, 3, padding=1), layer(ch), nn.Conv3d(ch, 1, 3, padding=1))


FIRST_FORWARD_REFUSALS = [
    (_between(HandNorm), r"1 \(HandNorm\): its split version DistHandNorm .* does not give the layer's "
                         r"gradients on the volume: on rank \d the gradient of its input differs by up to"),
    (_between(GuardedGain), r"1 \(GuardedGain\): run as a copy on each shard \(registered without "
                            r"to_dist\), it does not give the layer's outputs on the volume: its output does "
                            r"not depend on its parameter g"),
    (AddedParts, r"AvgMax \(a registered layer\) gives a tuple; a registered layer gives one tensor"),
]
"""Models whose first forward on a split volume is refused, and what it says: a split version whose
backward misses its sum over the shards; a copy that reads its extents; a layer giving two tensors."""


def _first_forward_body(rank: int, world: int) -> list[str]:
    said = []
    for make, match in FIRST_FORWARD_REFUSALS:
        model = make(2).double()
        engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
        x = torch.randn(2, 1, *ALIGNED[2:], dtype=torch.float64)
        with torch.no_grad():
            y = torch.randn_like(make(2).double()(x))
        with pytest.raises(ValueError, match=match) as err:
            engine.train_step(*engine.shard_batch(x, y))
        assert all(p.grad is None for p in model.parameters())  # refused before any gradient
        said.append(str(err.value))
    return said


def test_what_its_first_forward_shows_wrong_is_refused_alike_on_every_rank(pools):
    said = pools(2).run(_first_forward_body)
    assert said[0] == said[1], said


def test_a_parameter_applied_on_both_sides_of_the_reduction_is_refused(pools):
    said = pools(2).run(_both_sides_body)
    assert said[0] == said[1], said


def test_what_cannot_be_exact_is_refused_at_build(pools):
    said = pools(2).run(_refused_body)
    assert said[0] == said[1], said
    tied, head, silent = said[0]
    assert tied.startswith("parameter a.weight is also b.weight: a applies it (split over 2 ranks, a part "
                           "of its gradient per shard) and b (run replicated, its whole gradient on every "
                           "rank)"), tied
    assert head.startswith("parameter conv.bias is also fc.bias: conv applies it (split over 2 ranks"), head
    assert silent.startswith("2 (SilentPool): its split version DistWeightedPool reduces over the volume but "
                             "does not say how its parameter a is applied; in its __init__ call "
                             "self.applied_whole(self.a) if"), silent


def test_a_copied_resample_off_its_factor_is_refused_under_strict():
    """Planned on the volume, no spawn: the layer, the dim, where the boundaries fall and what fits."""
    from hybridpar.planner.terms import SpecError

    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}, "strict": True})
    with pytest.raises(SpecError, match=r"1 \(LearnUp\).*exact only where the shards' boundaries fall on its "
                                        r"factor 2, and extent 9 split 2 ways along d puts them at \[5\] "
                                        r"\(output \[9\]\); use an extent along d that is a multiple of 2"):
        spec.plan(UpNet(), UNEVEN, 2)
    with pytest.raises(SpecError, match=r"2 \(LearnDown\).*factor 2, .* at \[5\] \(output \[3\]\); use an "
                                        r"extent along d that is a multiple of 4"):
        spec.plan(DownNet(), UNEVEN, 2)
    spec.plan(UpNet(), ALIGNED, 2)  # boundaries on the factor: planned split


def test_copied_resample_boundaries_are_pure_geometry():
    from hybridpar.copied_resample import check_copied_resample
    from hybridpar.geometry import HaloError

    for extent, out, parts in ((8, 16, 2), (8, 4, 2), (9, 9, 2), (12, 6, 3), (9, 27, 3), (9, 5, 1)):
        check_copied_resample(extent, out, parts, "up", "d")
    for extent, out, parts in ((9, 18, 2), (9, 5, 2), (10, 5, 2), (8, 12, 2), (9, 4, 3)):
        with pytest.raises(HaloError):
            check_copied_resample(extent, out, parts, "r", "d")


@pytest.mark.parametrize("role,match", [
    ("window", r"register\(Blur\): a window layer needs to_dist= .* a copy on each shard would run without "
               r"its neighbours' halos"),
    ("transposed", r"register\(Blur\): a transposed layer needs to_dist="),
    ("reduce", r"register\(Blur\): a reduce layer needs to_dist= .* would reduce its own shard alone"),
])
def test_roles_a_copy_never_runs_exactly_need_a_split_version(role, match):
    class Blur(nn.Module):
        pass

    with pytest.raises(ValueError, match=match):
        hp.nn.register(Blur, role=role, op="conv", window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
                       flops=_pointwise_flops)
    assert hp.nn.lookup(Blur) is None


class NaiveDown(LearnDown):
    """``LearnDown`` given a split version that runs the layer's own forward on each shard: on a shard
    starting at an odd index it picks the volume's odd planes."""


class DistNaiveDown(hp.nn.SpatialLayer, NaiveDown):
    def __init__(self, ch: int, *, grid: hp.ProcessGrid) -> None:
        NaiveDown.__init__(self, ch)
        self.init_spatial(grid)


class NaiveUp(LearnUp):
    """``LearnUp`` with a split version that doubles its shard's planes and stops there: on odd splits
    the extents differ from the plan's (the next layer's halos would not fit)."""


class DistNaiveUp(hp.nn.SpatialLayer, NaiveUp):
    def __init__(self, ch: int, *, grid: hp.ProcessGrid) -> None:
        NaiveUp.__init__(self, ch)
        self.init_spatial(grid)


class Blur(nn.Module):
    """A depthwise 3³ blur with a learnable kernel."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.1, 0.3, ch * 27).reshape(ch, 1, 3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(x, self.weight, None, 1, 1, groups=self.weight.shape[0])


class DistBlurNoHalos(hp.nn.SpatialLayer, Blur):
    """Its forward forgotten: the layer's own, zero-padding each shard where it needs the neighbours'."""

    def __init__(self, ch: int, *, grid: hp.ProcessGrid) -> None:
        Blur.__init__(self, ch)
        self.init_spatial(grid)


class KeptBlur(Blur):
    """``Blur`` with a split version that reads its weight detached (kept from another call)."""


class DistKeptBlur(hp.nn.SpatialLayer, KeptBlur):
    def __init__(self, ch: int, *, grid: hp.ProcessGrid) -> None:
        KeptBlur.__init__(self, ch)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv3d(self.with_halos(x), self.weight.detach(), None, 1, 0, groups=self.weight.shape[0])


class ChannelMean(nn.Module):
    """The volume's mean per sample and channel."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean((2, 3, 4))


class DistChannelMeanLocal(hp.nn.SpatialLayer, ChannelMean):
    """Its split version dividing the volume's sum by the shard's voxels."""

    def __init__(self, *, grid: hp.ProcessGrid) -> None:
        ChannelMean.__init__(self)
        self.init_spatial(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.volume_sum(x.sum((2, 3, 4))) / x[0, 0].numel()


hp.nn.register(ChannelMean, role="reduce", op="pool", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap: DistChannelMeanLocal(grid=grid))
hp.nn.register(KeptBlur, role="window", op="conv", flops=_pointwise_flops,
               window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
               to_dist=lambda m, grid, overlap: DistKeptBlur(m.weight.shape[0], grid=grid))
hp.nn.register(NaiveDown, role="resample", op="pointwise", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap: DistNaiveDown(len(m.gain), grid=grid))
hp.nn.register(NaiveUp, role="resample", op="pointwise", flops=_pointwise_flops,
               to_dist=lambda m, grid, overlap: DistNaiveUp(len(m.gain), grid=grid))
hp.nn.register(Blur, role="window", op="conv", flops=_pointwise_flops,
               window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
               to_dist=lambda m, grid, overlap: DistBlurNoHalos(m.weight.shape[0], grid=grid))


def _wrong_split_body(rank: int, world: int) -> list[str]:
    """Each model with a wrong split version of the user's layer, one step on an uneven split."""
    said = []
    for layer in (NaiveDown(2), NaiveUp(2), Blur(2), ChannelMean(), KeptBlur(2)):
        head = nn.Linear(2, 1) if isinstance(layer, ChannelMean) else nn.Conv3d(2, 1, 3, padding=1)
        model = nn.Sequential(nn.Conv3d(2, 2, 3, padding=1), layer, head).double()
        engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss)
        x = torch.randn(UNEVEN, dtype=torch.float64)
        with torch.no_grad():
            y = model(x)
        try:
            engine.train_step(*engine.shard_batch(x, y))
            said.append(f"{type(layer).__name__}: trained")
        except hp.SpecError as err:
            said.append(str(err))
    return said


def test_a_split_version_that_gives_other_shards_is_refused(pools):
    """A user's Dist class is checked on its first forward against the layer on the gathered volume:
    values (a resample counting planes from its shard's origin, a window without halos, a mean over the
    shard's voxels of the volume's sum), the parameters it depends on (a weight read detached) and extents
    (which would leave the next layer's halo exchange waiting on one rank), one line on every rank."""
    said = pools(2).run(_wrong_split_body, timeout=300)
    assert said[0] == said[1], said
    down, up, blur, mean, kept = said[0]
    assert down.startswith("1 (NaiveDown): its split version DistNaiveDown (the registered to_dist) does not "
                           "give the shards of the layer's output on the volume: on rank 1 its values "
                           "differ"), down
    assert up.startswith("1 (NaiveUp): its split version DistNaiveUp (the registered to_dist) does not give "
                         "the shards of the layer's output on the volume: its output on rank 0 is 2x10x14x12 "
                         "where the layer gives 2x9x14x12 of its 18x14x12 on the volume"), up
    assert blur.startswith("1 (Blur): its split version DistBlurNoHalos"), blur
    assert mean.startswith("1 (ChannelMean): its split version DistChannelMeanLocal (the registered to_dist) "
                           "does not give the shards of the layer's output on the volume: on rank 0 its "
                           "values differ"), mean
    assert "its output does not depend on its parameter weight, where the layer's does" in kept, kept


class BatchCentre(nn.Module):
    """A norm of one's own over the batch's samples too (as BatchNorm), registered as pointwise: its split
    version sums the volume exactly, and sees only the samples a micro-batch holds."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.g = _gain(ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean((0, 2, 3, 4), keepdim=True)) * self.g.view(1, -1, 1, 1, 1)


class SampleCentre(BatchCentre):
    """The same over each sample's volume only: it keeps the samples apart."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean((2, 3, 4), keepdim=True)) * self.g.view(1, -1, 1, 1, 1)


for _centre in (BatchCentre, SampleCentre):
    hp.nn.register(_centre, role="pointwise", op="norm", flops=_pointwise_flops)


class Centred(nn.Module):
    def __init__(self, centre: type[nn.Module], traced: bool) -> None:
        super().__init__()
        self.c1, self.centre, self.c2 = nn.Conv3d(2, 2, 3, padding=1), centre(2), nn.Conv3d(2, 1, 1)
        self.traced = traced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c1(x)
        if not self.traced and x.shape[2] > 2:  # a branch torch.fx cannot trace: module swapping
            h = h * 2
        return self.c2(self.centre(h))


MICRO = {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "swapped"])
def test_a_registered_layer_across_micro_batches_is_refused(traced):
    """A registered layer of one's own is judged by its own forward, which one process runs: one over
    the batch's samples is refused on micro-batches (each would be normalised over its own samples), as
    a BatchNorm is, naming the layer, unless the spec accepts micro-batch statistics; with data
    parallelism alone it sees its replica's batch, as a BatchNorm does; one per sample is planned."""
    from hybridpar.planner.terms import SpecError

    shape = (4, 2, 8, 6, 6)
    with pytest.raises(SpecError, match=r"centre \(BatchCentre\), a registered layer whose own forward works "
                                        r"across the samples.*mean \(over the samples' dim\)"):
        hp.ParallelSpec.from_dict(MICRO).plan(Centred(BatchCentre, traced), shape, 2)
    accepted = {**MICRO, "pipeline": {"microbatches": 2, "micro_batch_stats": True}}
    assert hp.ParallelSpec.from_dict(accepted).plan(Centred(BatchCentre, traced), shape, 2)
    assert hp.ParallelSpec.from_dict({"grid": {"data": 2}}).plan(Centred(BatchCentre, traced), shape, 2)
    assert hp.ParallelSpec.from_dict(MICRO).plan(Centred(SampleCentre, traced), shape, 2)
