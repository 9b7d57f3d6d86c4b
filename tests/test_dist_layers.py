"""Every Dist layer against torch.nn on the gathered tensors (float64, relative error <= 1e-10):
forward output, input gradient, weight and bias gradients, running statistics; adjoint tests of halo
exchange, scatter, gather and Redistribute; a CosmoFlow-like stack. One spawned group per world size
runs all its grids; see layer_cases.py for the cases (fixed ones plus a seeded random sweep)."""

from __future__ import annotations

import pytest

import distributed
import layer_cases


def _body(rank: int, world: int, grids: list, n_random: int) -> None:
    layer_cases.run_all(rank, grids, n_random=n_random)


@pytest.mark.parametrize("world,grids", [
    (1, [(1, 1, 1)]),
    (2, [(2, 1, 1), (1, 2, 1), (1, 1, 2)]),
    (3, [(3, 1, 1), (1, 3, 1), (1, 1, 3)]),
    (4, [(2, 2, 1), (1, 2, 2), (4, 1, 1)]),
    (8, [(2, 2, 2)]),
])
def test_layers_match_torch(world, grids):
    distributed.run(_body, world, grids, 16 if world < 8 else 8, timeout=600)
