"""Blocks that used to stop a model, run split exactly:

* norms without affine parameters (InstanceNorm3d, GroupNorm, BatchNorm3d) under in-place activations
  (their output was a view that autograd forbids writing in place);
* a squeeze-and-excitation gate, pooled to one voxel and replicated, multiplied into split features
  (``gate * x`` as well as ``x * gate``), traced and by module swapping;
* a 3D pixel shuffle and unshuffle written with ``view``/``permute``/``reshape``: each shard reshaped
  on its rank (no gather) where the split is even along the split axes, traced and by module
  swapping, also at other input sizes and with a gate multiplied into the shuffled features; traced,
  replicated after a gather where it is not (refused by module swapping, as a split volume reshaped
  part way and read by anything but a reshape is).

Each case: float64, one training step (forward and backward) against the same model in one process,
on 2 ranks (2, 1, 1) and 4 ranks (2, 2, 1): the loss, the forward output and every parameter's gradient.
The plans and the reshape arithmetic are checked without processes.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layer_cases import Failures


def shuffle3d(h: torch.Tensor, r: int) -> torch.Tensor:
    """(N, C·r³, D, H, W) -> (N, C, D·r, H·r, W·r), as users write it."""
    n, c, d, hh, w = h.shape
    h = h.view(n, c // r ** 3, r, r, r, d, hh, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
    return h.reshape(n, c // r ** 3, d * r, hh * r, w * r)


def unshuffle3d(h: torch.Tensor, r: int) -> torch.Tensor:
    """(N, C, D·r, H·r, W·r) -> (N, C·r³, D, H, W), the inverse of :func:`shuffle3d`."""
    n, c, d, hh, w = h.shape
    h = h.reshape(n, c, d // r, r, hh // r, r, w // r, r).permute(0, 1, 3, 5, 7, 2, 4, 6)
    return h.reshape(n, c * r ** 3, d // r, hh // r, w // r)


class NormInplaceNet(nn.Module):
    """Norms without affine parameters, each followed by an in-place activation (MONAI's decoders);
    no conv bias before a per-channel norm, whose gradient is zero."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv3d(1, 4, 3, padding=1, bias=False), nn.InstanceNorm3d(4), nn.ReLU(inplace=True),
            nn.Conv3d(4, 4, 3, padding=1), nn.GroupNorm(2, 4, affine=False), nn.LeakyReLU(0.1, inplace=True),
            nn.Conv3d(4, 4, 3, padding=1, bias=False), nn.BatchNorm3d(4, affine=False), nn.ReLU(inplace=True),
            nn.Conv3d(4, 1, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class ConvSENet(nn.Module):
    """A squeeze-and-excitation gate of 1³ convolutions, multiplied in as ``gate * features``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Sequential(nn.Conv3d(4, 2, 1), nn.ReLU(inplace=True), nn.Conv3d(2, 4, 1), nn.Sigmoid())
        self.out = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return self.out(self.fc(self.pool(h)) * h)


class LinearSENet(nn.Module):
    """MONAI's ChannelSELayer: Linear layers on the pooled (N, C), viewed back to (N, C, 1, 1, 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 4, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Sequential(nn.Linear(4, 2), nn.ReLU(inplace=True), nn.Linear(2, 4), nn.Sigmoid())
        self.out = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        b, c = h.shape[:2]
        gate = self.fc(self.pool(h).view(b, c)).view(b, c, 1, 1, 1)
        return self.out(h * gate)


class ShuffleNet(nn.Module):
    """Sub-pixel upsampling by 2, then its inverse (each shard reshaped on its rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 16, 3, padding=1)
        self.mid = nn.Conv3d(2, 2, 3, padding=1)
        self.out = nn.Conv3d(16, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mid(shuffle3d(self.stem(x), 2))
        return self.out(unshuffle3d(torch.tanh(h), 2))


class ShuffleSENet(ShuffleNet):
    """A squeeze-and-excitation gate multiplied into the shuffled (upsampled) features themselves."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Sequential(nn.Conv3d(2, 2, 1), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = shuffle3d(self.stem(x), 2)
        h = self.mid(h * self.fc(self.pool(h)))
        return self.out(unshuffle3d(torch.tanh(h), 2))


class _Untraced(nn.Module):
    """``inner`` behind a branch torch.fx cannot trace: the model runs by module swapping."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 5:  # a traced value in a Python branch: fx refuses the whole forward
            return self.inner(x)
        return x


def DynUNetInstance() -> nn.Module:  # noqa: N802 (named as the model it builds)
    """MONAI's DynUNet with InstanceNorm3d(affine=False) and its LeakyReLU(inplace=True) blocks."""
    from monai.networks.nets import DynUNet

    model = DynUNet(3, 1, 1, kernel_size=[3, 3, 3], strides=[1, 2, 2], upsample_kernel_size=[2, 2],
                    norm_name="instance", filters=[2, 3, 4])
    norms = [m for m in model.modules() if isinstance(m, nn.InstanceNorm3d)]
    assert norms and not any(m.affine for m in norms)
    assert any(isinstance(m, nn.LeakyReLU) and m.inplace for m in model.modules())
    return model


def SwappedConvSENet() -> nn.Module:  # noqa: N802 (named as the model it builds)
    return _Untraced(ConvSENet())


def SwappedLinearSENet() -> nn.Module:  # noqa: N802
    return _Untraced(LinearSENet())


def SwappedShuffleNet() -> nn.Module:  # noqa: N802
    return _Untraced(ShuffleNet())


def SwappedShuffleSENet() -> nn.Module:  # noqa: N802
    return _Untraced(ShuffleSENet())


def SwappedNormInplaceNet() -> nn.Module:  # noqa: N802
    return _Untraced(NormInplaceNet())


def _compare(fails: Failures, desc: str, make, spec: dict, shape: tuple[int, ...]) -> None:
    """One training step of ``make()`` parallelized by ``spec`` against one process: the forward
    output, the loss and every parameter's gradient (the model's own parameters, which the engine runs)."""
    import hybridpar as hp

    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, dtype=torch.float64, generator=g)
    torch.manual_seed(0)
    ref = make().double()
    model = make().double()
    model.load_state_dict(ref.state_dict())
    with torch.no_grad():
        y = torch.randn(ref(x).shape, dtype=torch.float64, generator=g)
    ref.load_state_dict(model.state_dict())  # the running statistics that forward touched
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, y)
    with torch.no_grad():
        fails.check(f"{desc} forward", engine.predict(x_local), ref(x))
    loss = engine.train_step(x_local, y_local)
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    fails.check(f"{desc} loss", loss.detach().reshape(()), ref_loss.detach())
    got = dict(engine.named_parameters())  # this rank's stage's: the model's own tensors
    if not got:
        fails.append(f"{desc}: no parameters on this rank")
    for name, p in ref.named_parameters():
        if name in got:
            fails.check(f"{desc} grad {name}", got[name].grad, p.grad)


def _body(rank: int, world: int, desc: str, model: str, spec: dict, shape: tuple[int, ...]) -> None:
    fails = Failures()
    try:
        _compare(fails, f"{desc} {spec['grid']}", globals()[model], spec, shape)
    except Exception as err:  # named with its case
        fails.append(f"{desc}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


S2, S4 = {"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [2, 2, 1]}}
ODD = (2, 1, 7, 6, 5)  # D split 4 + 3, W odd
CASES = [
    (2, "norms without affine under in-place activations", "NormInplaceNet", S2, ODD),
    (2, "SE gate of 1^3 convs, gate * x", "ConvSENet", S2, ODD),
    (2, "SE gate of Linear layers, x * gate", "LinearSENet", S2, ODD),
    (2, "SE gate of 1^3 convs by module swapping", "SwappedConvSENet", S2, ODD),
    (2, "SE gate of Linear layers by module swapping", "SwappedLinearSENet", S2, ODD),
    (2, "SE gate squeezed by mean, by module swapping", "SwappedMeanSENet", S2, ODD),
    (2, "SE gate squeezed by mean, traced", "MeanSENet", S2, ODD),
    (4, "SE gate squeezed by mean, traced", "MeanSENet", S4, (2, 1, 7, 5, 4)),
    (2, "a volume viewed flat into tanh and a Linear, by module swapping", "SwappedFlatHeadNet", S2,
     (2, 1, 4, 4, 4)),
    (2, "a volume viewed flat into a Linear, by module swapping", "SwappedDirectFlatHeadNet", S2,
     (2, 1, 4, 4, 4)),
    (2, "norms under in-place activations by module swapping", "SwappedNormInplaceNet", S2, ODD),
    (2, "pixel shuffle and unshuffle, even split", "ShuffleNet", S2, (2, 1, 6, 5, 3)),
    (2, "MONAI DynUNet, instance norms without affine", "DynUNetInstance", S2, (2, 1, 8, 8, 4)),
    (2, "pixel shuffle and unshuffle, uneven split (gathered)", "ShuffleNet", S2, (2, 1, 5, 4, 3)),
    (2, "pixel shuffle and unshuffle by module swapping", "SwappedShuffleNet", S2, (2, 1, 6, 5, 3)),
    (2, "SE gate on shuffled features, traced", "ShuffleSENet", S2, (2, 1, 6, 5, 3)),
    (2, "SE gate on shuffled features by module swapping", "SwappedShuffleSENet", S2, (2, 1, 6, 5, 3)),
    (4, "norms without affine under in-place activations", "NormInplaceNet", S4, (2, 1, 7, 5, 4)),
    (4, "SE gate of 1^3 convs, gate * x", "ConvSENet", S4, (2, 1, 7, 5, 4)),
    (4, "SE gate of Linear layers by module swapping", "SwappedLinearSENet", S4, (2, 1, 7, 5, 4)),
    (4, "pixel shuffle and unshuffle, even split", "ShuffleNet", S4, (2, 1, 4, 6, 3)),
    (4, "pixel shuffle and unshuffle by module swapping", "SwappedShuffleNet", S4, (2, 1, 4, 6, 3)),
    (4, "pixel shuffle, its output across a pipeline cut", "ShuffleNet",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2, "stages": ["stem", "mid"]}},
     (2, 1, 6, 5, 3)),
]


@pytest.mark.parametrize("world,desc,model,spec,shape", CASES,
                         ids=[f"{c[0]}-{c[1].replace(' ', '_')}" for c in CASES])
def test_block_matches_one_process(pools, world, desc, model, spec, shape):
    pools(world).run(_body, desc, model, spec, shape, timeout=300)


def _sizes_body(rank: int, world: int, model: str) -> list[str]:
    """An engine built at one size predicts others exactly where the shuffles still fit the split."""
    import hybridpar as hp

    fails, said = Failures(), []
    torch.manual_seed(0)
    ref = globals()[model]().double()
    net = globals()[model]().double()
    net.load_state_dict(ref.state_dict())
    engine = hp.parallelize(net, S2, loss_fn=F.mse_loss, input_shape=(2, 1, 6, 5, 3))
    g = torch.Generator().manual_seed(4)
    for size in [(8, 4, 5), (5, 4, 3), (6, 5, 3), (4, 7, 2)]:
        x = torch.randn(2, 1, *size, dtype=torch.float64, generator=g)
        try:
            got = engine.predict(engine.shard_batch(x)[0])
        except ValueError as err:  # 5 planes over 2: the shuffle's boxes no longer scale
            said.append(str(err))
            continue
        with torch.no_grad():
            fails.check(f"{model} predicts at {size}", got, ref(x))
    fails.raise_if_any(rank)
    return said


@pytest.mark.parametrize("model", ["ShuffleNet", "SwappedShuffleNet"])
def test_shuffles_predict_at_other_sizes(pools, model):
    said = pools(2).run(_sizes_body, model, timeout=300)
    assert said[0] == said[1] and len(said[0]) == 1, said
    assert "an input of 5x4x3 voxels" in said[0][0], said
    assert ("view (view) would run split [1, 1, 1]" if model == "ShuffleNet" else
            "inner.mid (Conv3d) would run split [1, 1, 1]") in said[0][0], said


# ---------------------------------------------------------------------- without processes
def test_norm_output_written_in_place_backpropagates():
    """The split norms' Function returns a tensor of its own: an in-place activation on it
    back-propagates as on torch's own norm (one process, no group)."""
    from hybridpar.nn.norm import _SyncGroupNorm

    x = torch.randn(2, 4, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    y = _SyncGroupNorm.apply(x, None, None, 2, 1e-5, None, 2 * 60, x.dtype)[0]
    torch.relu_(y).square().sum().backward()
    want = x.detach().clone().requires_grad_()
    torch.relu_(F.group_norm(want, 2)).square().sum().backward()
    torch.testing.assert_close(x.grad, want.grad)


def test_shuffle_plans_split_where_even_and_gathers_where_not():
    import hybridpar as hp

    rows = {r.name: r for r in hp.ParallelSpec.from_dict(S2).plan(ShuffleNet(), (2, 1, 6, 5, 3), 2)}
    assert not [r.name for r in rows.values() if r.gather or r.redistribute]
    assert rows["view"].split == rows["reshape_1"].split == rows["mid"].split == (2, 1, 1)
    assert rows["reshape"].local_output_shape == (2, 2, 6, 10, 6)  # 3 of 6 planes, doubled
    assert rows["permute_1"].local_output_shape == (2, 2, 2, 2, 2, 3, 5, 3)  # unshuffled: 6 / 2 planes
    rows = {r.name: r for r in hp.ParallelSpec.from_dict(S2).plan(ShuffleNet(), (2, 1, 5, 4, 3), 2)}
    assert rows["view"].gather and rows["view"].split == (1, 1, 1)  # 3 + 2 planes: 6 + 4 is not 5 + 5


def test_a_shuffle_by_module_swapping_is_gathered_where_shards_would_mix():
    """Run by module swapping, the forward reshapes each shard by the extents it reads: on an even split
    that is the output's split, and it computes alike on a shard and the volume (sizes given to a
    reshape may differ: no warning, no refusal); where the split is uneven (5 planes over 2) it is not,
    and the layer reading the shuffled volume reads it gathered, as a traced plan does."""
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict(S2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r.split for r in spec.plan(SwappedShuffleNet(), (2, 1, 6, 5, 3), 2)] == [(2, 1, 1)] * 3
    rows = spec.plan(SwappedShuffleNet(), (2, 1, 5, 4, 3), 2)
    assert [(r.split, r.gather) for r in rows] == [((2, 1, 1), False), ((1, 1, 1), True), ((1, 1, 1), False)]


def test_a_stage_cut_inside_a_shuffle_is_refused():
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict({"grid": {"pipe": 2, "spatial": [2, 1, 1]},
                                      "pipeline": {"microbatches": 2, "stages": ["stem", "permute"]}})
    with pytest.raises(hp.SpecError, match="a stage cut falls inside the reshapes view, permute, reshape"):
        spec.plan(ShuffleNet(), (4, 1, 6, 5, 3), 4)


def test_gate_first_is_laid_out_by_the_features():
    """``gate * x`` with the gate pooled to 1³: the product runs on the features' split, no gather."""
    import hybridpar as hp

    rows = {r.name: r for r in hp.ParallelSpec.from_dict(S4).plan(ConvSENet(), (2, 1, 7, 5, 4), 4)}
    assert rows["mul"].split == (2, 2, 1) and rows["mul"].input_shape == (2, 4, 7, 5, 4)
    assert not rows["mul"].redistribute and not any(r.gather for r in rows.values())


class _Reshaping(nn.Module):
    """A 1³ conv to 16 channels, then ``write`` (reshapes as a forward writes them)."""

    def __init__(self, write) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 16, 1)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.write(self.conv(x))


@pytest.mark.parametrize("write,shape,splits", [
    (lambda h: shuffle3d(h, 2), (2, 1, 6, 5, 2),
     {(2, 1, 1): True, (3, 1, 1): True, (4, 1, 1): False, (1, 2, 1): False, (1, 1, 2): True}),
    (lambda h: unshuffle3d(h, 2), (2, 1, 6, 4, 2),
     {(3, 1, 1): True, (2, 1, 1): False, (1, 2, 1): True, (1, 1, 2): False}),
], ids=["shuffle", "unshuffle"])
def test_space_maps_keep_shards_where_boxes_scale(write, shape, splits):
    """A shuffle keeps shards local where the split is even (6 over 2 or 3, 2 over 2; not 6 over 4 or
    5 over 2); an unshuffle where every shard holds whole 2-voxel cells (6 over 3, 4 over 2; not 6
    over 2, 2 over 2)."""
    from hybridpar.planner.analysis import analyse

    a = analyse(_Reshaping(write), shape)
    maps = set(map(id, a.space_maps.values()))
    assert len(maps) == 1 and len(a.space_maps) == 3
    space_map = next(iter(a.space_maps.values()))
    assert {s: space_map.fits(s) for s in splits} == splits


def test_reshapes_that_mix_axes_keep_them_whole():
    """Channels interleaved outside the spatial index (space inner), a transpose of two spatial axes,
    a flatten of space: an axis whose index is mixed with others' runs only unsplit; a flatten keeps
    its leading axis split (its box, times H·W, is the flat extent's)."""
    from hybridpar.planner.analysis import analyse

    def interleaved(h):
        n, c, d, hh, w = h.shape
        h = h.view(n, c // 8, 2, 2, 2, d, hh, w).permute(0, 1, 2, 5, 3, 6, 4, 7)
        return h.reshape(n, c // 8, d * 2, hh * 2, w * 2)

    splits = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]
    for write, fits in ((interleaved, [False, False, False]),
                        (lambda h: h.transpose(2, 3).contiguous(), [False, False, True]),
                        (lambda h: h.reshape(h.shape[0], h.shape[1], -1, 1, 1), [True, False, False])):
        maps = analyse(_Reshaping(write), (2, 1, 4, 4, 4)).space_maps
        assert [next(iter(maps.values())).fits(s) for s in splits] == fits


class MeanSENet(ConvSENet):
    """A gate squeezed by ``x.mean((2, 3, 4), keepdim=True)`` instead of a pooling layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        return self.out(self.fc(h.mean((2, 3, 4), keepdim=True)) * h)


def SwappedMeanSENet() -> nn.Module:  # noqa: N802
    return _Untraced(MeanSENet())


def test_a_mean_squeeze_is_reduced_split_traced_and_by_module_swapping():
    """A squeeze written as ``mean`` over a split volume gives the volume's mean on every rank, by
    module swapping and traced alike (one table: hybridpar.planner.calls), not a gather; the 1³
    layers after it run whole (the numbers are CASES')."""
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict(S2)
    swapped = {r.name: r for r in spec.plan(_Untraced(MeanSENet()), (2, 1, 7, 6, 5), 2)}
    assert swapped["inner.stem"].split == (2, 1, 1) and swapped["inner.fc.0"].split == (1, 1, 1)
    rows = {r.name: r for r in spec.plan(MeanSENet(), (2, 1, 7, 6, 5), 2)}
    assert not rows["mean"].gather and rows["mean"].split == (2, 1, 1)
    assert rows["mean"].output_split == (1, 1, 1)
    assert rows["mul"].split == (2, 1, 1)


class FlatHeadNet(nn.Module):
    """A conv, then its split output flattened by ``view`` for a Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.head = nn.Linear(2 * 4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.head(torch.tanh(h.view(h.shape[0], -1)))


class DirectFlatHeadNet(FlatHeadNet):
    """The split volume flattened by ``view`` straight into the Linear head."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x)
        return self.head(h.view(h.shape[0], -1))


def SwappedFlatHeadNet() -> nn.Module:  # noqa: N802
    return _Untraced(FlatHeadNet())


def SwappedDirectFlatHeadNet() -> nn.Module:  # noqa: N802
    return _Untraced(DirectFlatHeadNet())


def test_a_split_volume_reshaped_part_way_is_gathered_by_module_swapping():
    """By module swapping, a split volume flattened by ``view`` and read by a function or a layer is
    gathered first (the view replayed on the whole volume), as a traced graph gathers it: the layer
    is planned whole on a gathered input (the numbers are CASES')."""
    import hybridpar as hp

    spec = hp.ParallelSpec.from_dict(S2)
    for model in (SwappedFlatHeadNet(), SwappedDirectFlatHeadNet()):
        rows = {r.name: r for r in spec.plan(model, (2, 1, 4, 4, 4), 2)}
        assert rows["inner.conv"].split == (2, 1, 1) and rows["inner.head"].split == (1, 1, 1)
    assert rows["inner.head"].gather
