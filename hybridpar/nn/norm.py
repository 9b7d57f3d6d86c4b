"""Batch normalisation with statistics exact over the whole (split) volume.

Why: per-shard statistics (what LBANN and MPI4DL do) change the model as the split changes. Here the
mean and variance are reduced over the spatial group (optionally the data-parallel replicas too), in
two passes for float32 accuracy, the running statistics are identical on every rank, and the backward
pass reduces its two per-channel sums in one collective.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.reduce import sync_grads
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.switch import Switch

_RECOMPUTING = Switch(False)


def recomputing() -> AbstractContextManager[None]:
    """Marks activation recomputation: running statistics must not be updated a second time."""
    return _RECOMPUTING.set(True)


def _allreduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(t, group=group)
    return t


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, count, data_replicas):
        dims = (0, 2, 3, 4)
        mean = _allreduce(x.sum(dim=dims), group) / count
        centred = x - mean.view(1, -1, 1, 1, 1)
        var = _allreduce(centred.square().sum(dim=dims), group) / count
        invstd = torch.rsqrt(var + eps)
        xhat = centred * invstd.view(1, -1, 1, 1, 1)
        y = xhat if weight is None else xhat * weight.view(1, -1, 1, 1, 1) + bias.view(1, -1, 1, 1, 1)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.meta = (group, count, data_replicas)
        return y, mean, var

    @staticmethod
    def backward(ctx, gy, _gmean, _gvar):
        xhat, invstd, weight = ctx.saved_tensors
        group, count, replicas = ctx.meta
        dims = (0, 2, 3, 4)
        sums = _allreduce(torch.stack([gy.sum(dim=dims), (gy * xhat).sum(dim=dims)]), group)
        g_bias, g_weight = sums[0], sums[1]
        scale = invstd if weight is None else invstd * weight
        gx = (gy - (g_bias / count).view(1, -1, 1, 1, 1) - xhat * (g_weight / count).view(1, -1, 1, 1, 1)) \
            * scale.view(1, -1, 1, 1, 1)
        if weight is None:
            return gx, None, None, None, None, None, None
        # Reduced over data replicas too: divide so the engine's average over replicas keeps the sum.
        return gx, g_weight / replicas, g_bias / replicas, None, None, None, None


class DistBatchNorm3d(SpatialLayer, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` with statistics over the whole volume of every sample of the batch.

    ``stats="spatial"`` reduces over the ranks that split the volume (what one replica's BatchNorm3d
    computes on the whole volume); ``stats="stage"`` also over the data-parallel replicas (global-batch
    statistics, like ``SyncBatchNorm``).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None, *,
                 grid: ProcessGrid | None = None, stats: str = "spatial") -> None:
        nn.BatchNorm3d.__init__(self, num_features, eps, momentum, affine, track_running_stats, device,
                                dtype)
        self._init_spatial(grid, None)
        if stats not in ("spatial", "stage"):
            raise ValueError(f"DistBatchNorm3d: stats must be 'spatial' or 'stage', got {stats!r}")
        self.stats = stats
        self._mark_params(1)  # gradients leave the layer already reduced

    def _group(self):
        if self.stats == "stage" and self.grid.data > 1:
            return self.grid.stage_group if self.grid.spatial_size == self.grid.stage_size \
                else _error(self.layer_name)
        return self.grid.spatial_group if self.grid.spatial_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
            weight, bias = sync_grads(group, self.weight, self.bias)
            return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, False, 0.0, self.eps)
        group = self._group()
        replicas = self.grid.data if self.stats == "stage" else 1
        count = x.shape[0] * shape[0] * shape[1] * shape[2] * replicas
        if count <= 1:
            raise ValueError(f"{self.layer_name}: expected more than 1 value per channel when training, "
                             f"got input of global size {(x.shape[0], x.shape[1], *shape)}")
        y, mean, var = _SyncBatchNorm.apply(x, self.weight, self.bias, self.eps, group, count, replicas)
        if self.training and self.track_running_stats and not _RECOMPUTING.on:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                factor = self.momentum if self.momentum is not None \
                    else 1.0 / float(self.num_batches_tracked)
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var * count / (count - 1), alpha=factor)
        return y


def _error(layer: str):
    raise NotImplementedError(f"{layer}: stats='stage' needs the layer's split to use every rank of the "
                              f"stage (no layout replicas)")


def _batch_norm3d(m: nn.BatchNorm3d, grid: ProcessGrid, overlap: bool = False) -> DistBatchNorm3d:
    return DistBatchNorm3d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, grid=grid)


registry.register(nn.BatchNorm3d, role="pointwise", op="norm", flops=registry.norm_flops, to_dist=_batch_norm3d)
