"""A window layer and its Dist class written outside the package (tests/softpool.py: SoftPool3d, one
``hp.nn.register`` call, public names only) go through everything the library's own layers do.

Without processes: the plan splits it with the halos of its registered window, ``explain`` shows it,
the FLOP counter counts it with its formula, ``count_sharded`` splits that work by its window, the
performance model prices it under a key naming its window; a window not given as ``Window`` records
is refused naming the layer. On 2 ranks, in float64 against one process: the Dist layer alone (odd
extents, uneven shards, strides 1 and 2, every split axis: output, input gradient), a model with it
converted by ``parallelize`` (three SGD steps: losses and weights), and a Dist layer whose window
differs from its entry's refused at conversion, naming the layer and both windows.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from softpool import DistSharpPool3d, DistSoftPool3d, SharpPool3d, SoftPool3d
from torch import nn

import hybridpar as hp
from hybridpar.planner import explain

from layer_cases import Failures, compare_layer, steps_match

SHAPE = (2, 1, 9, 7, 8)  # 9 = 5 | 4 over two ranks; after SoftPool3d(3, 2, 1): 5 = 3 | 2


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), SoftPool3d(3, 2, 1), nn.Tanh(),
                         nn.Conv3d(2, 1, 3, padding=1), nn.Flatten(), nn.Linear(5 * 4 * 4, 1))


def test_own_layer_reaches_planner_explain_flops_and_perfmodel():
    from hybridpar import perfmodel as pm

    model, spec = _model(), hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    rec = next(r for r in spec.plan(model, SHAPE, 2) if r.name == "1")
    assert rec.split == (2, 1, 1) and not rec.gather, rec
    row = next(line for line in explain(spec, model, SHAPE, 2).splitlines() if line.startswith("1 "))
    # halo (0, 1) along D from its window: rank 0's outputs 0-2 read inputs -1..5, rank 1's 3-4 read 5..9
    assert "SoftPool3d" in row and "2x1x1" in row and "0/1" in row, row

    pool = hp.flops.count(model, SHAPE).by_name()["1"]
    assert pool.forward_other == 2 * 27 * (2 * 2 * 5 * 4 * 4) + 2 * (2 * 2 * 9 * 7 * 8)
    assert pool.geometry.windows == (hp.nn.Window(3, 2, 1, 1),) * 3
    sharded = hp.flops.count_sharded(model, SHAPE, {"0": (2, 1, 1), "1": (2, 1, 1)}, world=2)
    ranks = next(s.ranks for s in sharded.per_layer if s.layer.name == "1")
    # output depth 5 splits 3 | 2; rank 0 receives one plane (N 2, C 2, 7x8, float32), rank 1 none
    assert [r.forward_other for r in ranks] == [pool.forward_other * 3 // 5, pool.forward_other * 2 // 5]
    assert [r.halo_bytes_forward for r in ranks] == [2 * 2 * 7 * 8 * 4, 0]

    w = pm.Workload(model, SHAPE)
    keys = [k for k, m, *_ in pm.layer_entries(w, w.plan(spec, 2)) if isinstance(m, SoftPool3d)]
    assert keys and keys[0].startswith("SoftPool3d(k3x3x3,s2x2x2,d1x1x1)|"), keys
    assert pm.predict(w, spec, pm.PRESETS["v100"], 2).step_time > 0


def test_a_window_not_given_as_records_is_refused_naming_the_layer():
    class DictPool(SoftPool3d):
        pass

    entry = hp.nn.register(DictPool, role="window", op="pool", flops=lambda m, x, y: ({}, None),
                           to_dist=lambda m, grid, overlap=False: DistSoftPool3d(3, 3, 1, 1, grid=grid),
                           window=lambda m: [dict(kernel=3, stride=1, pad_lo=1, pad_hi=1)] * 3)
    with pytest.raises(TypeError, match="DictPool: a registry entry's window= must give one hybridpar.nn.Wi"):
        entry.windows_of(DictPool())
    with pytest.raises(TypeError, match=r"register\(DictPool\): window= .* not window_args="):
        hp.nn.register(DictPool, role="window", op="pool", flops=lambda m, x, y: ({}, None),
                       window_args=lambda m: [])


def _layer_parity(rank: int, world: int, split: tuple[int, int, int]) -> None:
    fails = Failures()
    grid = hp.ProcessGrid(spatial=split)
    for i, (k, s, p) in enumerate([(3, 2, 1), (3, 1, 1), (2, 2, 0), (5, 1, 2)]):
        desc = f"DistSoftPool3d(k{k} s{s} p{p}) split {split}"
        compare_layer(fails, desc, grid, SoftPool3d(k, s, p), DistSoftPool3d(k, s, p, grid=grid),
                      (2, 3, 9, 7, 11), 7 * i)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("split", [(2, 1, 1), (1, 1, 2)], ids=["2x1x1", "1x1x2"])
def test_dist_layer_matches_one_process(pools, split):
    pools(2).run(_layer_parity, split, timeout=300)


def _train(rank: int, world: int) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE[0], 1, dtype=torch.float64, generator=g)
    torch.manual_seed(0)
    ref = _model().double()
    model = _model().double()
    model.load_state_dict(ref.state_dict())
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    local = engine.shard_batch(x, y)  # builds the stage
    split = [m for _, lay in engine.stage.layers for m in lay.modules() if isinstance(m, DistSoftPool3d)]
    if len(split) != 1:
        fails.append(f"{len(split)} DistSoftPool3d layers ran, not 1")
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    steps_match(fails, "SoftPool3d model", engine, opt, ref, ref_opt, local, (x, y), F.mse_loss)
    for k, v in ref.state_dict().items():
        fails.check(f"SoftPool3d model {k}", model.state_dict()[k], v, 1e-9)
    fails.raise_if_any(rank)


def test_parallelize_trains_a_model_with_the_own_layer(pools):
    pools(2).run(_train, timeout=300)


def _sharp_model() -> nn.Sequential:
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), SharpPool3d(2, 3, 2, 1), nn.Tanh(),
                         nn.Conv3d(2, 1, 3, padding=1), nn.Flatten(), nn.Linear(5 * 4 * 4, 1))


def _train_own_parameters(rank: int, world: int, splits: list[list[int]]) -> None:
    """A user's split layer with parameters of its own (one applied before the halo exchange, one after),
    written with the public recipe alone: every gradient, those two included, equals one process's
    (float64), on every split; three SGD steps keep the weights equal."""
    fails = Failures()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE[0], 1, dtype=torch.float64, generator=g)
    for split in splits:
        torch.manual_seed(0)
        ref = _sharp_model().double()
        model = _sharp_model().double()
        model.load_state_dict(ref.state_dict())
        engine = hp.parallelize(model, {"grid": {"spatial": split}}, loss_fn=F.mse_loss)
        local = engine.shard_batch(x, y)
        ran = [m for _, lay in engine.stage.layers for m in lay.modules() if isinstance(m, DistSharpPool3d)]
        if len(ran) != 1:
            fails.append(f"split {split}: {len(ran)} DistSharpPool3d layers ran, not 1")
        engine.train_step(*local)
        F.mse_loss(ref(x), y).backward()
        for (k, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            fails.check(f"split {split} gradient of {k}", p.grad, q.grad, 1e-9)
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
        steps_match(fails, f"split {split}", engine, opt, ref, ref_opt, local, (x, y), F.mse_loss)
        for k, v in ref.state_dict().items():
            fails.check(f"split {split} {k}", model.state_dict()[k], v, 1e-9)
    fails.raise_if_any(rank)


def test_own_layer_parameters_get_their_whole_gradient(pools):
    pools(2).run(_train_own_parameters, [[2, 1, 1], [1, 2, 1]], timeout=300)
    pools(4).run(_train_own_parameters, [[2, 2, 1]], timeout=300)


class Blur5(nn.Module):
    """A 5³ box filter whose registration says 3³ (the mistake a twice-described window allows)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.avg_pool3d(x, 5, 1, 2)


class WideSoftPool3d(SoftPool3d):
    """SoftPool3d whose to_dist forgets the module's kernel."""


def _disagreements(rank: int, world: int) -> None:
    fails = Failures()
    hp.nn.register(Blur5, role="window", op="pool", flops=lambda m, x, y: ({}, None),
                   window=lambda m: (hp.nn.Window(3, 1, 1, 1),) * 3,
                   to_dist=lambda m, grid, overlap=False: hp.nn.DistAvgPool3d(5, 1, 2, grid=grid))
    hp.nn.register(WideSoftPool3d, role="window", op="pool", flops=lambda m, x, y: ({}, None),
                   window=lambda m: (hp.nn.Window(m.kernel, m.stride, m.padding, m.padding),) * 3,
                   to_dist=lambda m, grid, overlap=False: DistSoftPool3d(3, 1, 1, grid=grid))
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    for layer, want in ((Blur5(), "1 (Blur5): the registry entry gives the window k3 s1 p1/1 x3, but its "
                                  "Dist layer DistAvgPool3d runs k5 s1 p2/2 x3"),
                        (WideSoftPool3d(5, 1, 2), "1 (WideSoftPool3d): the registry entry gives the "
                                                  "window k5 s1 p2/2 x3, but its Dist layer DistSoftPool3d "
                                                  "runs k3 s1 p1/1 x3")):
        model = nn.Sequential(nn.Conv3d(1, 1, 3, padding=1), layer, nn.Conv3d(1, 1, 3, padding=1))
        try:
            hp.parallelize(model, spec, loss_fn=F.mse_loss, input_shape=(2, 1, 12, 8, 8))
            fails.append(f"{type(layer).__name__}: converted with a window its Dist layer does not run")
        except ValueError as err:
            if want not in str(err):
                fails.append(f"{type(layer).__name__}: {err}")
    fails.raise_if_any(rank)


def test_a_dist_layer_whose_window_differs_is_refused_at_conversion(pools):
    pools(2).run(_disagreements, timeout=300)


class _GainUp(nn.Module):
    """A user's upsampling by 2 with a gain per channel, registered ``resample`` without a split version."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode, self.g = mode, nn.Parameter(torch.linspace(0.5, 1.5, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(x, scale_factor=2, mode=self.mode) * self.g.view(1, -1, 1, 1, 1)


class _PerVolume(nn.Module):
    """A user's "pointwise" layer that reads its input's extents: on a shard, the shard's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (x.shape[2] * x.shape[3] * x.shape[4]) ** 0.5


hp.nn.register(_GainUp, role="resample", op="pointwise",
               flops=lambda m, x, y: ({"forward_other": y.numel()}, None))
hp.nn.register(_PerVolume, role="pointwise", flops=lambda m, x, y: ({"forward_other": y.numel()}, None))


@pytest.mark.parametrize("mode,split", [("nearest", (2, 1, 1)), ("trilinear", (1, 1, 1)),
                                        ("volume", (1, 1, 1))])
def test_a_copy_that_reads_across_shards_runs_whole(mode, split):
    """A user's resample or pointwise layer without a split version runs as a copy on each shard only
    where that gives the volume's shards: nearest does; trilinear reads the neighbour's plane (each shard
    interpolated alone gave another answer at every boundary, silently), a scale by ``x.shape`` reads the
    shard's extents. A run of the layer on a small random volume, whole and by shards, finds it before
    any step: the planner runs it whole and says why."""
    layer = _PerVolume() if mode == "volume" else _GainUp(mode)
    model = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.AvgPool3d(2), layer, nn.Conv3d(2, 1, 1))
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    state = torch.get_rng_state()
    rec = next(r for r in spec.plan(model, (2, 1, 16, 8, 8), 2) if r.name == "2")
    assert rec.split == split, rec
    assert torch.equal(torch.get_rng_state(), state)  # the check draws from a generator of its own
    if mode != "nearest":
        assert "reads across the shards' boundaries" in explain(spec, model, (2, 1, 16, 8, 8), 2)


class _Untraceable(nn.Module):
    """The same layers in a forward torch.fx cannot trace: module swapping plans them, on meta tensors."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.stem, self.layer, self.head = nn.Conv3d(1, 2, 3, padding=1), layer, nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.avg_pool3d(self.stem(x), 2)
        if h.shape[2] < 2:
            raise ValueError("too thin")
        return self.head(self.layer(h))


@pytest.mark.parametrize("mode", ["nearest", "volume"])
def test_a_copy_checked_under_module_swapping(mode):
    """Module swapping plans with meta tensors in the layers' slots: the check runs the layer with drawn
    weights; the nearest copy runs split, the one reading the volume's extents runs whole on the
    gathered volume, as a traced plan runs it, and ``strict`` refuses it by name."""
    from hybridpar.planner.terms import SpecError

    model = _Untraceable(_PerVolume() if mode == "volume" else _GainUp(mode))
    spec = {"grid": {"spatial": [2, 1, 1]}}
    plan = hp.ParallelSpec.from_dict(spec).plan(model, (2, 1, 16, 8, 8), 2)
    rec = next(r for r in plan if r.name == "layer")
    assert (rec.split, rec.gather) == (((2, 1, 1), False) if mode == "nearest" else ((1, 1, 1), True)), rec
    if mode == "volume":
        with pytest.raises(SpecError, match=r"layer \(_PerVolume\).*reads across the shards' boundaries"):
            hp.ParallelSpec.from_dict({**spec, "strict": True}).plan(model, (2, 1, 16, 8, 8), 2)
