"""Every Dist layer against torch.nn on the gathered tensors (float64, relative error <= 1e-10):
forward output, input gradient, weight and bias gradients, running statistics; adjoint tests of halo
exchange, scatter, gather and Redistribute; a CosmoFlow-like stack. One pytest test per world size,
grid and case family (layer_cases.py: fixed cases plus a seeded random sweep), the cases of a world
size sharing one process group."""

from __future__ import annotations

import pytest

import distributed
import layer_cases

GRIDS = [(1, (1, 1, 1)), (2, (2, 1, 1)), (2, (1, 2, 1)), (2, (1, 1, 2)), (3, (3, 1, 1)), (3, (1, 3, 1)),
         (3, (1, 1, 3)), (4, (2, 2, 1)), (4, (1, 2, 2)), (4, (4, 1, 1)), (8, (2, 2, 2))]


@pytest.mark.parametrize("family", list(layer_cases.FAMILIES))
@pytest.mark.parametrize("world,shape", GRIDS, ids=distributed.grid_ids(GRIDS))
def test_layers_match_torch(pools, world, shape, family):
    opts = {"n_random": 16 if world < 8 else 8}
    counts = pools(world).run(layer_cases.run_family, "layer_cases", shape, family, opts, timeout=600)
    assert counts[0] > 0, f"no {family} case fits grid {shape}"


def _bn_stage_body(rank: int, world: int) -> None:
    """stats='stage': statistics over the global batch of all data replicas; running statistics equal
    torch's on every rank; weight gradients averaged over replicas (the engine's convention)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import hybridpar as hp

    grid = hp.ProcessGrid(data=2, spatial=(2, 1, 1))
    fails = layer_cases.Failures()
    ref = nn.BatchNorm3d(3).double()
    ours = hp.nn.DistBatchNorm3d(3, grid=grid, stats="stage").double()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 3, 7, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(4, 3, 7, 5, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    rows = slice(2 * grid.data_index, 2 * grid.data_index + 2)
    xr = x.clone().requires_grad_()
    (ref(xr) * g).sum().backward()
    mine = x[rows].clone().requires_grad_()
    y = hp.gather(ours(hp.scatter(mine, grid)), grid)
    (y * g[rows]).sum().backward()
    fails.check("stage BN output", y.detach(), _train_out(x, rows))
    fails.check("stage BN input grad", mine.grad, xr.grad[rows])
    fails.check("stage BN weight grad x replicas", ours.weight.grad * grid.data, ref.weight.grad)
    fails.check("stage BN running mean", ours.running_mean, ref.running_mean)
    fails.check("stage BN running var", ours.running_var, ref.running_var)
    rm = ours.running_mean.clone()
    dist.all_reduce(rm)
    fails.check("running mean identical on all ranks", rm / world, ours.running_mean)
    fails.raise_if_any(rank)


def _train_out(x, rows):
    import torch.nn.functional as F

    return F.batch_norm(x, None, None, training=True)[rows]


def test_batchnorm_statistics_over_data_replicas():
    distributed.run(_bn_stage_body, 4, timeout=300)
