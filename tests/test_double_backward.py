"""Twice differentiable where torch is: a gradient of a gradient through split layers (a gradient
penalty, a Hessian-vector product) equals the single process's, or is refused in one line.

Why: a communication primitive is linear, so its backward is another one (the halo exchange's is the
halo sum, a redistribution's the reverse one, an all-reduce's the replicated read); written as plain
tensor code outside autograd, a second backward would treat it as a constant and return a wrong
answer without a word. Layers whose backward is not differentiable (the synchronised norms, the
overlapped convolution) say so when asked to differentiate twice.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from layer_cases import Failures

SPLITS = [(1, (1, 1, 1)), (2, (2, 1, 1)), (3, (1, 3, 1)), (4, (2, 1, 2))]


def _filter(kd: torch.Tensor, kh: torch.Tensor, kw: torch.Tensor) -> torch.Tensor:
    return torch.exp(-0.1 * (kd ** 2 + kh ** 2 + kw ** 2))


def _body(rank: int, world: int, split: tuple[int, int, int]) -> None:
    import hybridpar as hp
    from hybridpar.comm.reduce import replicated_into_shards
    from hybridpar.pipeline.convert import to_distributed

    fails = Failures()
    grid = hp.ProcessGrid(spatial=split)
    group = grid.spatial_group if grid.spatial_size > 1 else None
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 2, 9, 8, 7, dtype=torch.float64, generator=g)
    v = torch.randn(x.shape, dtype=torch.float64, generator=g)
    w = torch.randn((2, 3, 9, 8, 7), dtype=torch.float64, generator=g)
    for mode in ("zeros", "circular"):
        case = f"split {split} conv padding {mode}"
        conv = nn.Conv3d(2, 3, 3, padding=1, padding_mode=mode).double()
        pool = nn.AdaptiveAvgPool3d(1)
        dconv, dpool = to_distributed(copy.deepcopy(conv), grid), to_distributed(pool, grid)

        def whole(t: torch.Tensor, conv: nn.Module = conv, pool: nn.Module = pool) -> torch.Tensor:
            y = torch.tanh(conv(t))
            y = y * torch.sigmoid(pool(y))  # a squeeze-and-excitation gate, replicated
            modes = torch.fft.rfftn(y, dim=(-3, -2, -1))
            k = hp.fft.wavenumbers(tuple(t.shape[2:]), torch.float64, t.device)
            return torch.fft.irfftn(modes * _filter(*k), s=t.shape[2:], dim=(-3, -2, -1))

        def split_(t: torch.Tensor, dconv: nn.Module = dconv, dpool: nn.Module = dpool) -> torch.Tensor:
            y = torch.tanh(dconv(hp.scatter(t, grid)))
            y = y * replicated_into_shards(torch.sigmoid(dpool(y)), group)
            s = hp.fft.rfftn(y, grid)
            return hp.gather(hp.fft.irfftn(s.replace(s.data * _filter(*s.wavenumbers())), grid), grid)

        grads = []
        for f, layer in ((whole, conv), (split_, dconv)):
            t = x.clone().requires_grad_()
            loss = (f(t) ** 2 * w).sum()
            (gx,) = torch.autograd.grad(loss, t, create_graph=True)
            (gx * v).sum().backward()  # the Hessian-vector product, by input and by weight
            grads.append((gx.detach(), t.grad, layer.weight.grad))  # a split layer's: summed in backward
        for name, got, want in zip(("gradient", "Hessian-vector product", "its weight gradient"),
                                   grads[1], grads[0], strict=True):
            fails.check(f"{case}: {name}", got, want, 1e-10)
    if grid.spatial_size > 1:
        norm = to_distributed(nn.BatchNorm3d(2).double(), grid)
        t = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(hp.gather(norm(hp.scatter(t, grid)), grid).pow(2).sum(), t,
                                    create_graph=True)
        try:
            gx.sum().backward()
            fails.append(f"split {split} batch norm: differentiated twice without a word")
        except RuntimeError as err:
            if "once_differentiable" not in str(err):
                raise
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,split", SPLITS, ids=[f"{w}-{'x'.join(map(str, s))}" for w, s in SPLITS])
def test_a_gradient_of_a_gradient_equals_one_process(pools, world, split):
    pools(world).run(_body, split, timeout=180)
