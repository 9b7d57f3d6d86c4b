"""A window layer added by its own file alone (``hybridpar/nn/lppool.py``: ``LPPool3d``): its one
registry record gives the distributed layer its halos and gives the converter, ``explain``, the FLOP
counter, ``count_sharded`` and the performance model what they need, with no other module naming it.

Against torch in float64: the layer on every grid of 1-8 ranks (odd sizes, strides, ceil mode, norm
types; a split too fine is a HaloError exactly where the geometry says), and a model using it as a
module and as ``F.lp_pool3d`` trained by ``parallelize`` on 2 and 4 ranks.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp
from hybridpar.geometry import window_plans
from hybridpar.planner import explain

import distributed
import layer_cases
from layer_cases import Failures, compare_layer, steps_match

SHAPE = (4, 1, 9, 8, 7)


def run_lppool(fails: Failures, grid, rng: random.Random, opts: dict) -> int:
    cases = [dict(p=2.0, k=2, s=None, ceil=False), dict(p=1.0, k=3, s=2, ceil=True),
             dict(p=3.0, k=(3, 2, 1), s=(2, 1, 1), ceil=False), dict(p=1.5, k=2, s=3, ceil=True)]
    for _ in range(4):
        cases.append(dict(p=rng.choice((1.0, 2.0, 2.5)), k=rng.randint(1, 3), s=rng.randint(1, 3),
                          ceil=rng.random() < 0.5))
    for i, c in enumerate(cases):
        shape = (2, 2, *[rng.choice((8, 9, 13)) for _ in range(3)])
        k = hp.geometry.ntuple(c["k"])
        s = hp.geometry.ntuple(c["s"] if c["s"] is not None else c["k"])
        fits = all(layer_cases._fits(window_plans, shape[2 + a], grid.spatial_shape[a], k[a], s[a], 0, 0, 1,
                                     c["ceil"]) for a in range(3))
        ref = nn.LPPool3d(c["p"], c["k"], c["s"], c["ceil"])
        ours = hp.nn.DistLPPool3d(c["p"], c["k"], c["s"], c["ceil"], grid=grid)
        # |x| keeps fractional powers real, as LPPool's users feed it (magnitudes, activations)
        compare_layer(fails, f"lppool {c} grid {grid.spatial_shape}", grid, nn.Sequential(_Abs(), ref),
                      nn.Sequential(_Abs(), ours), shape, 11 * i, expect_error=not fits)
    return len(cases)


class _Abs(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() + 0.1


FAMILIES = {"lppool": run_lppool}


@pytest.mark.parametrize("world,shape", distributed.flat_grids(),
                         ids=distributed.grid_ids(distributed.flat_grids()))
def test_dist_lppool_matches_torch(pools, world, shape):
    counts = pools(world).run(layer_cases.run_family, "test_lppool", shape, "lppool", timeout=600)
    assert counts[0] > 0


class LPNet(nn.Module):
    """LPPool3d as a module (ceil mode, an odd extent) and as a function call."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 3, 3, padding=1)
        self.pool = nn.LPPool3d(2, 2, ceil_mode=True)
        self.conv2 = nn.Conv3d(3, 2, 3, padding=1)
        self.head = nn.Linear(2 * 3 * 2 * 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(torch.sigmoid(self.conv(x)))
        h = F.lp_pool3d(torch.sigmoid(self.conv2(h)), 1.5, 2, ceil_mode=True)
        return self.head(torch.flatten(h, 1))


def _train_body(rank: int, world: int, spec: dict) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(SHAPE, dtype=torch.float64, generator=g), torch.randn(SHAPE[0], 1, dtype=torch.float64)
    torch.manual_seed(0)
    ref = LPNet().double()
    model = LPNet().double()
    model.load_state_dict(ref.state_dict())
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
    xl, yl = engine.shard_batch(x, y)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    steps_match(fails, str(spec), engine, opt, ref, ref_opt, (xl, yl), (x, y), F.mse_loss)
    for k, v in ref.state_dict().items():
        fails.check(f"{spec} {k}", model.state_dict()[k], v, 1e-9)
    split = sum(isinstance(m, hp.nn.DistLPPool3d) for _, lay in engine.stage.layers for m in lay.modules())
    if split != 2:  # the module and the function call, both split
        fails.append(f"{spec}: {split} DistLPPool3d layers ran, not 2")
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,spec", [(2, {"grid": {"spatial": [2, 1, 1]}}),
                                        (4, {"grid": {"data": 2, "spatial": [1, 2, 1]}})],
                         ids=["spatial", "data_x_spatial"])
def test_parallelize_trains_a_model_with_lppool(pools, world, spec):
    pools(world).run(_train_body, spec, timeout=300)


def test_lppool_record_reaches_planner_flops_and_perfmodel():
    """No process group: the plan splits both LPPool calls with halos from the record, ``explain``
    shows them, ``count_sharded`` splits their work by their window, the performance model prices
    them."""
    from hybridpar import perfmodel as pm

    model, spec = LPNet(), hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}})
    plan = spec.plan(model, SHAPE, 2)
    pools = [r for r in plan if "pool" in r.name]
    assert [r.name for r in pools] == ["pool", "lp_pool3d"]
    assert all(r.split == (2, 1, 1) and not r.gather for r in pools), pools
    table = explain(spec, model, SHAPE, 2)
    assert "pool" in table and "lp_pool3d" in table

    flops = hp.flops.count(model, SHAPE)
    pool = flops.by_name()["pool"]
    assert pool.geometry.kind == "window" and pool.geometry.kernel == (2, 2, 2) and pool.geometry.ceil_mode
    assert pool.spatial_dims == 3 and pool.forward_other == pool.output_shape[0] * 3 * 5 * 4 * 4 * 8
    sharded = hp.flops.count_sharded(model, SHAPE, {"conv": (2, 1, 1), "pool": (2, 1, 1)}, world=2)
    ranks = next(s.ranks for s in sharded.per_layer if s.layer.name == "pool")
    assert [r.forward_other for r in ranks] == [pool.forward_other * 3 // 5, pool.forward_other * 2 // 5]
    assert ranks[0].halo_bytes_forward > 0 == ranks[1].halo_bytes_forward  # 9 = 5 | 4: 3 windows need 6

    w = pm.Workload(model, SHAPE)
    keys = [k for k, m, *_ in pm.layer_entries(w, w.plan(spec, 2)) if isinstance(m, nn.LPPool3d)]
    assert keys and keys[0].startswith("LPPool3d(k2x2x2,s2x2x2,d1x1x1)|")
    pred = pm.predict(w, spec, pm.PRESETS["v100"], 2)
    assert pred.step_time > 0
