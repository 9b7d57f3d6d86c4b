"""Reductions across the ranks that split one activation.

Convention (the one every primitive here and in :mod:`hybridpar.comm.redistribute` follows): a
*replicated* tensor is one tensor held in identical copies, and so is its gradient; a *split* tensor
is the disjoint union of its shards. A weight is replicated and used on every shard, so its gradient
is the sum of the shards' contributions: after ``backward`` every rank's ``weight.grad`` is the
gradient of the sum of all ranks' (shard) losses, exactly what ``torch.nn`` gives on the whole volume.

The pipeline engine accumulates micro-batches before reducing: inside :func:`no_grad_sync` layers
skip their per-layer reduction, and :func:`reduce_gradients` later reduces every parameter in a few
large buckets with the scale each needs (see ``grad_split``).
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.device.eager import eager
from hybridpar.device.switch import Switch
from hybridpar.profiling import range as prange

_SYNC = Switch(True)


def grad_sync_enabled() -> bool:
    """False inside :func:`no_grad_sync`."""
    return _SYNC.on


def no_grad_sync() -> AbstractContextManager[None]:
    """Leave weight gradients as local contributions (for accumulation over micro-batches)."""
    return _SYNC.set(False)


def real_view(t: torch.Tensor) -> torch.Tensor:
    """A complex tensor as its real pairs (a view), to be flattened beside real ones into one buffer
    (``torch.cat`` would make the whole buffer complex); a real tensor as it is."""
    return torch.view_as_real(t) if t.is_complex() else t


def _all_reduce(tensors: list[torch.Tensor], group: dist.ProcessGroup | None, async_op: bool = False):
    """Sum ``tensors`` in place across ``group`` with one collective (flattened when several)."""
    if group is None or dist.get_world_size(group) == 1:
        return None
    if len(tensors) == 1:
        return dist.all_reduce(tensors[0], group=group, async_op=async_op)
    flat = torch.cat([real_view(t).reshape(-1) for t in tensors])
    work = dist.all_reduce(flat, group=group, async_op=async_op)

    class _Unflatten:
        def wait(self) -> None:
            if work is not None:
                work.wait()
            off = 0
            for t in map(real_view, tensors):
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    done = _Unflatten()
    if not async_op:
        done.wait()
    return done


def all_reduce_async(tensors: list[torch.Tensor], group: dist.ProcessGroup | None):
    """Start summing ``tensors`` across ``group``; returns a handle with ``wait()`` (or None)."""
    return _all_reduce(tensors, group, async_op=True)


class SyncGrads(torch.autograd.Function):
    """Identity on replicated parameters whose backward sums their gradient over the split group."""

    @staticmethod
    def forward(ctx, group, *params: torch.Tensor):
        ctx.group = group
        views = tuple(p.view_as(p) for p in params)
        return views if len(views) > 1 else views[0]

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        if not grad_sync_enabled():
            return (None, *grads)
        if torch.is_grad_enabled():  # a gradient that is differentiated again: one sum per tensor
            return (None, *(SumToReplicated.apply(g, ctx.group) for g in grads))
        grads = [g.contiguous().clone() for g in grads]
        with prange("grad_sync", "grad_reduce"):
            _all_reduce(grads, ctx.group)
        return (None, *grads)


@eager  # communication in backward: runs eagerly under torch.compile
def _synced(group: dist.ProcessGroup, *live: torch.Tensor):
    return SyncGrads.apply(group, *live)


def sync_grads(group: dist.ProcessGroup | None, *params: torch.Tensor):
    """Use replicated ``params`` on a shard; their gradients come back summed over ``group``."""
    live = [p for p in params if p is not None]
    if group is None or dist.get_world_size(group) == 1 or not live or not torch.is_grad_enabled():
        return params if len(params) > 1 else params[0]
    synced = _synced(group, *live)
    out = iter(synced if len(live) > 1 else [synced])
    res = tuple(next(out) if p is not None else None for p in params)
    return res if len(res) > 1 else res[0]


class SumToReplicated(torch.autograd.Function):
    """Partial sums on each shard -> their total on every rank (replicated).

    Adjoint under the replicated-counts-once convention: each partial sum's gradient is the
    (replicated) gradient of the total, so backward needs no communication (it is
    :class:`ReplicatedIntoShards`, an identity whose own backward sums again: twice differentiable).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        y = x.clone(memory_format=torch.contiguous_format)  # a collective takes dense tensors
        _all_reduce([y], group)
        return y

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ReplicatedIntoShards.apply(g, ctx.group), None


@eager
def sum_to_replicated(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Differentiable all-reduce of partial sums (see :class:`SumToReplicated`)."""
    return SumToReplicated.apply(x, group)


# The split of each marked parameter, kept beside the parameter rather than on it: no attribute bolted onto
# a torch object, nothing added to its state_dict, the optimizer's view or a pickle; a parameter that goes
# away takes its entry with it (a deep copy is a new, unmarked parameter).
_SPLIT: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_grad_split(params: Iterable[torch.Tensor], split: int) -> None:
    """Record that ``split`` shards each contribute a partial gradient to every one of ``params``."""
    for p in params:
        _SPLIT[p] = split


def is_marked(param: torch.Tensor) -> bool:
    """Whether anyone has said how many shards contribute to ``param``'s gradient."""
    return param in _SPLIT


def grad_split(param: torch.Tensor) -> int:
    """How many shards contribute partial gradients to ``param`` (1 for replicated computation)."""
    return _SPLIT.get(param, 1)


def reduce_gradients(params: Iterable[torch.nn.Parameter], group: dist.ProcessGroup | None,
                     bucket_bytes: int = 25 << 20) -> None:
    """Reduce accumulated local gradients over ``group`` (a stage's data × spatial ranks), bucketed.

    A parameter used by a layer split ``s`` ways, on a group of ``n`` ranks, receives ``n / s`` copies
    of each of its ``s`` partial contributions per data replica: it is scaled by ``s / n`` so that the
    result sums over shards and averages over data-parallel replicas.
    """
    params = [p for p in params if p.grad is not None]
    if group is None or not params:
        return
    n = dist.get_world_size(group)
    if n == 1:
        return
    buckets: list[list[torch.nn.Parameter]] = [[]]
    size = 0
    for p in params:
        if size and size + p.grad.numel() * p.grad.element_size() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += p.grad.numel() * p.grad.element_size()
    pending = []
    for bucket in buckets:
        flat = torch.cat([real_view(p.grad).reshape(-1) * (grad_split(p) / n) for p in bucket])
        pending.append((bucket, flat, dist.all_reduce(flat, group=group, async_op=True)))
    for bucket, flat, work in pending:
        work.wait()
        off = 0
        for p in bucket:
            g = real_view(p.grad)
            g.copy_(flat[off:off + g.numel()].view_as(g))
            off += g.numel()


class ReplicatedIntoShards(torch.autograd.Function):
    """Identity on a replicated activation that every shard of a split computation reads (a pooled
    gate multiplied into split features); backward sums the shards' partial gradients over ``group``.

    Why always, unlike :class:`SyncGrads`: these are activation gradients, needed whole by the layers
    before it within the same backward; only weight gradients may wait for the engine's reduction.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return SumToReplicated.apply(g, ctx.group), None


@eager
def replicated_into_shards(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``x`` (replicated over ``group``) for use by split computations (see :class:`ReplicatedIntoShards`)."""
    if group is None or dist.get_world_size(group) == 1 or not x.requires_grad:
        return x
    return ReplicatedIntoShards.apply(x, group)


class _MaxOverShards(torch.autograd.Function):
    """The maxima over the shards' maxima, replicated; backward: each shard's share of the gradient is
    its number of elements equal to the maximum over all of them (see :func:`max_to_replicated`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ties: torch.Tensor, group) -> torch.Tensor:
        top = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        mine = torch.where(x == top, ties.to(x.dtype), torch.zeros_like(x))
        total = mine.clone(memory_format=torch.contiguous_format)
        _all_reduce([total], group)
        ctx.save_for_backward(mine / total)
        return top

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (share,) = ctx.saved_tensors
        return g * share, None, None


def max_to_replicated(x: torch.Tensor, group: dist.ProcessGroup | None,
                      ties: torch.Tensor | None = None) -> torch.Tensor:
    """Each shard's maxima ``x`` -> the maxima over the shards on every rank (replicated), differentiable.

    ``ties``: how many elements of each shard equal its maximum (1 where not given). ``torch.amax``
    shares the gradient evenly between the elements equal to the maximum; a shard's own ``amax``
    shares what it receives between its own, so each shard receives its number of them over the
    number in the whole volume. The value is the maximum itself, exact.
    """
    if group is None or dist.get_world_size(group) == 1:
        return x
    if not x.requires_grad:  # the value alone (a shift): no gradient to share, no ties to count
        top = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        return top
    return _MaxOverShards.apply(x, torch.ones_like(x) if ties is None else ties, group)
