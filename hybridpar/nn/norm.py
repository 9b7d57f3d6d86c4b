"""Batch, group and instance normalisation with statistics exact over the whole (split) volume.

Why: per-shard statistics (what LBANN and MPI4DL do) change the model as the split changes. Here the
mean and variance are reduced over the spatial group (optionally the data-parallel replicas too) in
one all-reduce of each shard's count, sum and centred squares (:func:`_moments`), the running
statistics are identical on every rank, and the backward pass reduces its two per-channel sums in
one collective. GroupNorm and InstanceNorm3d keep statistics per sample (and group
or channel), so only the spatial group takes part, never the data replicas. (Over data-parallel
replicas, the engine averages the running statistics after every step:
:mod:`hybridpar.pipeline.running_stats`.)

Precision: whatever the input's dtype, sums accumulate in float64 and the elementwise work is done in
float32 (float64 for a float64 input), as torch's own CPU kernels do: a bfloat16 activation of mean
100 has a resolution of 0.5, and its mean and variance summed in bfloat16 would be off by more than
its standard deviation; summed in float32 the mean keeps too few digits to centre values near 100
to float32 accuracy. The mean is carried as two float32 parts, so the centred values are as exact as
float32 allows (:func:`_centre`). Only the output is rounded, to the dtype torch's own layer returns for the
same input under the same autocast state (:func:`_result_dtype`), and the input gradient to the
input's dtype. The layer keeps its input for the backward (not the normalised float32 values), so a
half-precision activation costs half-precision memory.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from hybridpar.comm.reduce import replicated_into_shards
from hybridpar.device import precision
from hybridpar.device.switch import Switch
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.profiling import range as prange

_RECOMPUTING = Switch(False)


def recomputing() -> AbstractContextManager[None]:
    """Marks activation recomputation: running statistics must not be updated a second time."""
    return _RECOMPUTING.set(True)


def _allreduce(t: torch.Tensor, group) -> torch.Tensor:
    if group is not None:
        with prange("norm_reduce"):  # named for a profile; charged to the layer's category
            dist.all_reduce(t, group=group)
    return t


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype statistics are computed in: float32 for half-precision inputs, float64 stays."""
    return torch.promote_types(x.dtype, torch.float32)


_PROBES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "batch_norm": lambda z: F.batch_norm(z, None, None, training=True),
    "group_norm": lambda z: F.group_norm(z, 1),
    "instance_norm": lambda z: F.instance_norm(z),
}


def _summed_over_shards(group, weight: torch.Tensor | None, bias: torch.Tensor | None):
    """The affine parameters of a norm in eval mode (running statistics: a per-voxel affine map), their
    gradients summed over the shards within this backward.

    Why not :func:`~hybridpar.comm.reduce.sync_grads`: that sum is switched off inside the engine's
    steps, where its reduction sums parameters marked as split; these layers mark theirs as leaving
    already reduced (their training branch sums them), so a step taken in eval mode (frozen
    statistics, as in fine-tuning) would otherwise average the shards' partial gradients."""
    return tuple(None if p is None else replicated_into_shards(p, group) for p in (weight, bias))


def _result_dtype(x: torch.Tensor, op: str) -> torch.dtype:
    """The dtype torch's ``op`` returns for ``x`` under the current autocast state.

    Without autocast, the input's. Under autocast it depends on the device's op lists: ``group_norm``
    is a float32 op under CUDA's autocast (float32 out for a bfloat16 input) and no listed op under
    the CPU's (the input's dtype out), so torch is asked (:func:`hybridpar.device.precision.result_dtype`).
    """
    return precision.result_dtype(op, _PROBES[op], x)


def _moments(x: torch.Tensor, dims: tuple[int, ...], shape: tuple[int, ...],
             group) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 mean and centred sum of squares of ``x`` over ``dims`` and the ``group``'s shards, in one
    all-reduce: each shard's count, sum and sum of squares about its own mean, every rank in its own
    slot (the others zero: the sum is exact), merged in rank order alike on every rank (Chan et al.'s
    pairwise update, as stable as two passes over the whole volume). Sums accumulate in float64 (a
    float32 sum of values offset from zero, mean 100 and std 1, would lose the digits the centring
    needs); ``x`` is read as it is. ``shape`` views a statistic against ``x`` (reduced dims as 1)."""
    n = math.prod(x.shape[d] for d in dims)
    total = x.sum(dim=dims, dtype=torch.float64)
    mean = total / max(n, 1)
    sq = _centre(x.to(_stat_dtype(x)), _mean_parts(mean, _stat_dtype(x)), shape).square() \
        .sum(dim=dims, dtype=torch.float64)
    if group is None:
        return mean, sq
    slots = total.new_zeros((dist.get_world_size(group), 3, *total.shape))
    slots[dist.get_rank(group)] = torch.stack([torch.full_like(total, n), total, sq])
    counts, totals, squares = _allreduce(slots, group).unbind(1)
    whole = totals.sum(0) / counts.sum(0)
    spread = counts * (totals / counts.clamp_min(1) - whole).square()
    return whole, squares.sum(0) + spread.sum(0)


def _mean_parts(mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float64 mean as two ``dtype`` parts, (hi, lo) stacked, for :func:`_centre`."""
    hi = mean.to(dtype)
    return torch.stack([hi, (mean - hi).to(dtype)])


def _centre(x: torch.Tensor, parts: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``x - mean`` in ``x``'s dtype as exactly as the float64 mean allows: ``x - hi`` is exact for
    values near the mean (Sterbenz), so only the small difference ``- lo`` is rounded."""
    return (x - parts[0].view(shape)) - parts[1].view(shape)


class _SyncBatchNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, group, count, data_replicas, out_dtype):
        dims, shape, sd = (0, 2, 3, 4), (1, -1, 1, 1, 1), _stat_dtype(x)
        mean, squares = _moments(x, dims, shape, group)
        parts = _mean_parts(mean, sd)
        centred = _centre(x.to(sd), parts, shape)
        var = (squares / count).to(sd)
        invstd = torch.rsqrt(var + eps)
        y = _affine(centred * invstd.view(shape), weight, bias)
        ctx.save_for_backward(x, parts, invstd, weight)
        ctx.meta = (group, count, data_replicas, None if bias is None else bias.dtype)
        mean = mean.to(sd)
        ctx.mark_non_differentiable(mean, var)
        return y.to(out_dtype), mean, var

    @staticmethod
    @once_differentiable  # its backward runs collectives outside autograd: a second one is refused
    def backward(ctx, gy, _gmean, _gvar):
        x, parts, invstd, weight = ctx.saved_tensors
        group, count, replicas, bias_dtype = ctx.meta
        dims, shape, sd = (0, 2, 3, 4), (1, -1, 1, 1, 1), invstd.dtype
        xhat = _centre(x.to(sd), parts, shape) * invstd.view(shape)
        gy = gy.to(sd)
        sums = _allreduce(torch.stack([gy.sum(dim=dims, dtype=torch.float64),
                                       (gy * xhat).sum(dim=dims, dtype=torch.float64)]), group).to(sd)
        g_bias, g_weight = sums[0], sums[1]
        scale = invstd if weight is None else invstd * weight
        gx = (gy - (g_bias / count).view(shape) - xhat * (g_weight / count).view(shape)) * scale.view(shape)
        # Reduced over data replicas too: divide so the engine's average over replicas keeps the sum.
        gw = (g_weight / replicas).to(weight.dtype) if weight is not None else None
        gb = (g_bias / replicas).to(bias_dtype) if bias_dtype is not None else None
        return gx.to(x.dtype), gw, gb, None, None, None, None, None


def _affine(xhat: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """Per-channel scale and shift of a normalised (N, C, ...) tensor (either may be absent)."""
    shape = (1, -1) + (1,) * (xhat.dim() - 2)
    y = xhat if weight is None else xhat * weight.view(shape)
    return y if bias is None else y + bias.view(shape)


def _bias_kwarg(torch_type: type, bias: bool, layer: str) -> dict:
    """``bias=`` for a torch norm layer's constructor where this torch has it (torch >= 2.9)."""
    if "bias" in inspect.signature(torch_type.__init__).parameters:
        return {"bias": bias}
    if not bias:
        raise TypeError(f"{layer}: bias=False needs a torch whose {torch_type.__name__} accepts bias= "
                        f"(2.9 or newer)")
    return {}


class DistBatchNorm3d(SpatialLayer, nn.BatchNorm3d):
    """``torch.nn.BatchNorm3d`` with statistics over the whole volume of every sample of the batch.

    ``stats="spatial"`` reduces over the ranks that split the volume (what one replica's BatchNorm3d
    computes on the whole volume); ``stats="stage"`` also over the data-parallel replicas (global-batch
    statistics, like ``SyncBatchNorm``). ``bias=False`` (torch >= 2.9) as in torch; an empty batch
    gives an empty output and counts a batch without touching the running statistics, as torch does
    (with ``stats="stage"`` every replica's batch must then be empty).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, device=None, dtype=None, *,
                 bias: bool = True, grid: ProcessGrid | None = None, stats: str = "spatial") -> None:
        nn.BatchNorm3d.__init__(self, num_features, eps, momentum, affine, track_running_stats, device,
                                dtype, **_bias_kwarg(nn.BatchNorm3d, bias, "DistBatchNorm3d"))
        self.init_spatial(grid, None)
        if stats not in ("spatial", "stage"):
            raise ValueError(f"DistBatchNorm3d: stats must be 'spatial' or 'stage', got {stats!r}")
        self.stats = stats
        self._mark_params(1)  # gradients leave the layer already reduced

    def _group(self):
        if self.stats == "stage" and self.grid.data > 1:
            return self.grid.batch_group
        return self.grid.spatial_group if self.grid.spatial_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        use_batch = self.training or not self.track_running_stats
        if not use_batch:
            group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
            weight, bias = _summed_over_shards(group, self.weight, self.bias)
            return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, False, 0.0, self.eps)
        if x.shape[0] == 0:  # torch: an empty output, running statistics kept, one more batch counted
            self._count_batch()
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        group = self._group()
        replicas = self.grid.data if self.stats == "stage" else 1
        count = x.shape[0] * shape[0] * shape[1] * shape[2] * replicas
        if count == 1:
            raise ValueError(f"{self.layer_name}: expected more than 1 value per channel when training, "
                             f"got input of global size {(x.shape[0], x.shape[1], *shape)}")
        y, mean, var = _SyncBatchNorm.apply(x, self.weight, self.bias, self.eps, group, count, replicas,
                                            _result_dtype(x, "batch_norm"))
        factor = self._count_batch()
        if factor is not None:
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
                self.running_var.mul_(1 - factor).add_(var * count / (count - 1), alpha=factor)
        return y

    def _count_batch(self) -> float | None:
        """Count a training batch as torch does; the running statistics' update factor (None: no
        update: eval, untracked statistics, or a recomputation of a batch already counted)."""
        if not (self.training and self.track_running_stats) or _RECOMPUTING.on:
            return None
        self.num_batches_tracked.add_(1)
        return self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)


# ---------------------------------------------------------------------- per-sample statistics
class _SyncGroupNorm(torch.autograd.Function):
    """Group normalisation of a split (N, C, D, H, W) shard with statistics over the whole volume.

    Statistics are per sample and group of ``C / groups`` channels, over the spatial group in one
    all-reduce (:func:`_moments`), in float32 or wider. The backward needs, per sample and
    channel, the sums of ``gy`` and ``gy * xhat`` over the whole volume: one all-reduce of (2, N, C)
    gives them, and with them the per-group terms of the input gradient and the (already reduced)
    weight and bias gradients.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps, group, count, out_dtype):
        n, sd = x.shape[0], _stat_dtype(x)
        xg = x.reshape(n, groups, -1)
        mean, squares = _moments(xg, (2,), (n, groups, 1), group)
        parts = _mean_parts(mean, sd)
        centred = _centre(xg.to(sd), parts, (n, groups, 1))
        var = (squares / count).to(sd)
        invstd = torch.rsqrt(var + eps)
        # Scaled in x's own shape, so the output is a tensor of its own, not a view of the grouped one:
        # autograd forbids modifying a custom Function's view output in place, and without affine
        # parameters the output is xhat itself, which an in-place activation (ReLU(inplace=True)) writes.
        per_channel = invstd.repeat_interleave(x.shape[1] // groups, dim=1)
        xhat = centred.view(x.shape) * per_channel.view(per_channel.shape + (1,) * (x.dim() - 2))
        ctx.save_for_backward(x, parts, invstd, weight)
        ctx.meta = (groups, group, count, None if bias is None else bias.dtype)
        mean = mean.to(sd)
        ctx.mark_non_differentiable(mean, var)
        return _affine(xhat, weight, bias).to(out_dtype), mean, var

    @staticmethod
    @once_differentiable  # its backward runs collectives outside autograd: a second one is refused
    def backward(ctx, gy, _gmean, _gvar):
        x, parts, invstd, weight = ctx.saved_tensors
        groups, group, count, bias_dtype = ctx.meta
        n, c = gy.shape[:2]
        dims, sd = tuple(range(2, gy.dim())), invstd.dtype
        xhat = (_centre(x.reshape(n, groups, -1).to(sd), parts, (n, groups, 1)) * invstd.unsqueeze(-1)) \
            .view(x.shape)
        gy = gy.to(sd)
        sums = _allreduce(torch.stack([gy.sum(dim=dims, dtype=torch.float64),
                                       (gy * xhat).sum(dim=dims, dtype=torch.float64)]), group).to(sd)
        g_shift, g_scale = sums[0], sums[1]  # (N, C) each
        gyw = gy if weight is None else gy * weight.view((1, -1) + (1,) * len(dims))
        wsums = sums if weight is None else sums * weight.view(1, 1, -1)
        per_group = wsums.view(2, n, groups, c // groups).sum(-1) / count  # (2, N, G)
        gx = (gyw.reshape(n, groups, -1) - per_group[0].unsqueeze(-1)
              - xhat.reshape(n, groups, -1) * per_group[1].unsqueeze(-1)) * invstd.unsqueeze(-1)
        gw = g_scale.sum(0).to(weight.dtype) if weight is not None else None
        gb = g_shift.sum(0).to(bias_dtype) if bias_dtype is not None else None
        return gx.view(gy.shape).to(x.dtype), gw, gb, None, None, None, None, None


class _PerSampleNorm(SpatialLayer):
    """What DistGroupNorm and DistInstanceNorm3d share: the spatial group and the Function call."""

    def _init_per_sample(self, grid: ProcessGrid | None) -> None:
        self.init_spatial(grid, None)
        self._mark_params(1)  # the Function returns the weights' gradients already summed over shards

    def _split_shape(self, x: torch.Tensor, channels: int) -> tuple[int, int, int] | None:
        """Global (D, H, W) of ``x``, its channels checked; None where torch's own layer runs instead
        (an input that is not 5-D, on an unsplit grid)."""
        if x.dim() != 5 and self.grid.spatial_size == 1:
            return None
        shape = self.global_shape(x)
        if x.shape[1] != channels and self.affine:
            raise ValueError(f"{self.layer_name}: expected {channels} channels, got {x.shape[1]}")
        return shape

    def _spatial_group(self):
        return self.grid.spatial_group if self.grid.spatial_size > 1 else None

    def _normalise(self, x: torch.Tensor, shape: tuple[int, int, int], groups: int, op: str):
        """(y, mean, var) with per-(sample, group) statistics over the whole volume; ``y`` in the dtype
        torch's ``op`` returns."""
        c = x.shape[1]
        if c % groups:
            raise ValueError(f"{self.layer_name}: {c} channels do not split into {groups} groups")
        count = (c // groups) * shape[0] * shape[1] * shape[2]
        return _SyncGroupNorm.apply(x, self.weight, self.bias, groups, self.eps, self._spatial_group(), count,
                                    _result_dtype(x, op))


class DistGroupNorm(_PerSampleNorm, nn.GroupNorm):
    """``torch.nn.GroupNorm`` on a split (N, C, D, H, W) shard: each sample's group statistics over
    the whole volume (all-reduced over the spatial group), exact input and parameter gradients (the
    parameters' leave the layer already summed over the shards). Inputs that are not 5-D (a GroupNorm
    of a head) run torch's GroupNorm, on an unsplit grid only.
    """

    def __init__(self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True,
                 device=None, dtype=None, *, bias: bool = True, grid: ProcessGrid | None = None) -> None:
        nn.GroupNorm.__init__(self, num_groups, num_channels, eps, affine, device, dtype,
                              **_bias_kwarg(nn.GroupNorm, bias, "DistGroupNorm"))
        self._init_per_sample(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self._split_shape(x, self.num_channels)
        if shape is None:
            return nn.GroupNorm.forward(self, x)
        if x.shape[0] * (x.shape[1] // self.num_groups) * math.prod(shape) == 1:
            raise ValueError(f"{self.layer_name}: expected more than 1 value per channel, got input of "
                             f"global size {(x.shape[0], x.shape[1], *shape)}")
        return self._normalise(x, shape, self.num_groups, "group_norm")[0]


class DistInstanceNorm3d(_PerSampleNorm, nn.InstanceNorm3d):
    """``torch.nn.InstanceNorm3d`` on a split shard: each sample's and channel's statistics over the
    whole volume, in training and whenever running statistics are not tracked; with tracked running
    statistics in eval, a per-voxel affine map. Running statistics as torch keeps them: ``momentum``
    (None: no update), the batch average of the per-instance means and unbiased variances, and
    ``num_batches_tracked`` left alone.
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = False, track_running_stats: bool = False, device=None, dtype=None, *,
                 bias: bool = True, grid: ProcessGrid | None = None) -> None:
        nn.InstanceNorm3d.__init__(self, num_features, eps, momentum, affine, track_running_stats, device,
                                   dtype, **_bias_kwarg(nn.InstanceNorm3d, bias, "DistInstanceNorm3d"))
        self._init_per_sample(grid)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self._split_shape(x, self.num_features)
        if shape is None:
            return nn.InstanceNorm3d.forward(self, x)
        if not (self.training or not self.track_running_stats):
            weight, bias = _summed_over_shards(self._spatial_group(), self.weight, self.bias)
            return F.batch_norm(x, self.running_mean, self.running_var, weight, bias, False, 0.0, self.eps)
        volume = math.prod(shape)
        if volume == 1:
            raise ValueError(f"{self.layer_name}: expected more than 1 spatial element when training, got "
                             f"input of global size {(x.shape[0], x.shape[1], *shape)}")
        y, mean, var = self._normalise(x, shape, x.shape[1], "instance_norm")
        if self.training and self.track_running_stats and not _RECOMPUTING.on and x.shape[0] > 0:
            factor = self.momentum if self.momentum is not None else 0.0
            with torch.no_grad():
                self.running_mean.mul_(1 - factor).add_(mean.mean(0), alpha=factor)
                self.running_var.mul_(1 - factor).add_((var * volume / (volume - 1)).mean(0), alpha=factor)
        return y


def _has_bias(m: nn.Module) -> bool:
    """The ``bias=`` a torch norm layer was built with (only ``affine`` layers can lack one)."""
    return not (m.affine and m.bias is None)


def _batch_norm3d(m: nn.BatchNorm3d, grid: ProcessGrid, overlap: bool = False) -> DistBatchNorm3d:
    return DistBatchNorm3d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                           bias=_has_bias(m), grid=grid)


def _sync_batch_norm(m: nn.SyncBatchNorm, grid: ProcessGrid, overlap: bool = False) -> DistBatchNorm3d:
    """``convert_sync_batchnorm``'s way of asking for global-batch statistics: over the volume and the
    data-parallel replicas (a 5-D input; its ``process_group`` is the stage's, as the engine lays it)."""
    return DistBatchNorm3d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                           bias=_has_bias(m), grid=grid, stats="stage")


def _group_norm(m: nn.GroupNorm, grid: ProcessGrid, overlap: bool = False) -> DistGroupNorm:
    return DistGroupNorm(m.num_groups, m.num_channels, m.eps, m.affine, bias=_has_bias(m), grid=grid)


def _instance_norm3d(m: nn.InstanceNorm3d, grid: ProcessGrid, overlap: bool = False) -> DistInstanceNorm3d:
    return DistInstanceNorm3d(m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats,
                              bias=_has_bias(m), grid=grid)


registry.register(nn.BatchNorm3d, role="pointwise", op="norm", flops=registry.norm_flops,
                  to_dist=_batch_norm3d)
registry.register(nn.SyncBatchNorm, role="pointwise", op="norm", flops=registry.norm_flops,
                  to_dist=_sync_batch_norm)
registry.register(nn.GroupNorm, role="pointwise", op="norm", flops=registry.norm_flops, to_dist=_group_norm)
registry.register(nn.InstanceNorm3d, role="pointwise", op="norm", flops=registry.norm_flops,
                  to_dist=_instance_norm3d)
