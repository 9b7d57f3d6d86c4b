"""Norm layers under bfloat16 / float16 autocast against torch's own layers under the same autocast.

Input of mean 100.3 and standard deviation 1 (where statistics summed in half precision fail), given
in half precision (a convolution's output under autocast) and in float32. For DistBatchNorm3d
(training and eval), DistGroupNorm and DistInstanceNorm3d (affine, tracked statistics), whole and on
split grids of 2 and 4 ranks: the output has the dtype torch's layer returns, and the errors of the
output, the input gradient, the weight and bias gradients and the running statistics against the
float64 result on the same input values are at most 1.25 times torch's own (plus float32 rounding of
1e-6 relative). One spawned group of 4 ranks runs every case; a failure names its case.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import distributed
from layer_cases import Failures

SHAPE = (2, 4, 8, 6, 4)
SLACK, FLOOR = 1.25, 1e-6


def _layers(kind: str, grid) -> tuple[nn.Module, nn.Module]:
    """(torch's layer, ours) with the same random affine parameters and running statistics."""
    import hybridpar as hp

    torch.manual_seed(5)
    if kind.startswith("batchnorm"):
        ref = nn.BatchNorm3d(4)
        ours = hp.nn.DistBatchNorm3d(4, grid=grid)
    elif kind == "groupnorm":
        ref = nn.GroupNorm(2, 4)
        ours = hp.nn.DistGroupNorm(2, 4, grid=grid)
    else:
        ref = nn.InstanceNorm3d(4, affine=True, track_running_stats=True)
        ours = hp.nn.DistInstanceNorm3d(4, affine=True, track_running_stats=True, grid=grid)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2.0)
        ref.bias.normal_()
        if hasattr(ref, "running_mean") and ref.running_mean is not None:
            ref.running_mean.fill_(100.0)
            ref.running_var.fill_(1.2)
    ours.load_state_dict(ref.state_dict())
    if kind == "batchnorm eval":
        ref.eval()
        ours.eval()
    return ref, ours


def _errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], split: dict[str, bool],
            group) -> dict[str, float]:
    """Max abs error per entry over all ranks (split entries are this rank's box of a global tensor)."""
    out = {}
    for k, w in want.items():
        e = (got[k].double() - w).abs().max() if w.numel() else torch.zeros((), dtype=torch.float64)
        e = e.reshape(1).clone()
        if split[k]:
            dist.all_reduce(e, op=dist.ReduceOp.MAX, group=group)
        out[k] = e.item()
    return out


def _run(layer: nn.Module, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype | None):
    """Output and gradients of ``layer`` on ``x`` (under autocast to ``dtype``, or none)."""
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        y = layer(x)
    y.backward(g.to(y.dtype))
    res = {"out": y.detach(), "x.grad": x.grad}
    for name, p in layer.named_parameters():
        res[f"{name}.grad"] = p.grad
    for name, b in layer.named_buffers():
        if b.is_floating_point():
            res[name] = b.detach().clone()
    return res


def _case(fails: Failures, grid, kind: str, low: torch.dtype, given_low: bool) -> None:
    from hybridpar.comm import local_box

    desc = f"{kind} {low} input {'half' if given_low else 'float32'} grid {grid.spatial_shape}"
    gen = torch.Generator().manual_seed(7)
    x32 = torch.randn(SHAPE, generator=gen) + 100.3
    g = torch.randn(SHAPE, generator=gen)
    x = x32.to(low) if given_low else x32
    ref, ours = _layers(kind, grid)
    exact = _run(ref.double(), x.double(), g.double(), None)  # float64 on the same input values
    ref = _layers(kind, grid)[0]
    theirs = _run(ref, x, g, low)
    box = (Ellipsis, *(slice(a, b) for a, b in local_box(SHAPE[2:], grid)))
    mine = _run(ours, x[box], g[box], low)
    if mine["out"].dtype != theirs["out"].dtype or mine["x.grad"].dtype != theirs["x.grad"].dtype:
        fails.append(f"{desc}: output/grad dtype {mine['out'].dtype}/{mine['x.grad'].dtype}, torch's "
                     f"{theirs['out'].dtype}/{theirs['x.grad'].dtype}")
    split = {k: k in ("out", "x.grad") for k in exact}
    want_local = {k: v[box] if split[k] else v for k, v in exact.items()}
    err_mine = _errors(mine, want_local, split, grid.spatial_group if grid.spatial_size > 1 else None)
    err_theirs = _errors(theirs, exact, {k: False for k in exact}, None)
    for k, e in err_mine.items():
        bound = SLACK * err_theirs[k] + FLOOR * max(exact[k].abs().max().item(), 1.0)
        if not e <= bound:
            fails.append(f"{desc}: {k} error {e:.3e} > {SLACK} x torch's {err_theirs[k]:.3e} (+ rounding)")


def _body(rank: int, world: int) -> None:
    import hybridpar as hp

    fails = Failures()
    grids = [hp.ProcessGrid(data=4), hp.ProcessGrid(data=2, spatial=(2, 1, 1)),
             hp.ProcessGrid(spatial=(2, 2, 1))]
    for grid in grids:
        for kind in ("batchnorm", "batchnorm eval", "groupnorm", "instancenorm"):
            for low in (torch.bfloat16, torch.float16):
                for given_low in (True, False):
                    try:
                        _case(fails, grid, kind, low, given_low)
                    except Exception as err:  # name the case, go on with the others
                        fails.append(f"{kind} {low} grid {grid.spatial_shape}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


def test_norms_under_autocast_as_accurate_as_torch():
    distributed.run(_body, 4, timeout=300)
