"""Buffers a forward run by module swapping rebinds to split values, held whole.

Why apart: a forward that rebinds a buffer (``self.ema_map = 0.9 * self.ema_map + 0.1 * h``) leaves in
it whatever the call made, and on a rank that is a shard; one process's buffer holds the volume, and
the next call, the state dict and a checkpoint read it so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.planner.terms import SpecError

if TYPE_CHECKING:
    from hybridpar.pipeline.split_forward import SplitForward


def whole_buffers(swapped: nn.Module, mode: SplitForward) -> None:
    """A buffer the forward rebound to a split value (``self.ema_map = 0.9 * self.ema_map + 0.1 * h``,
    a mask made at the input's extents) holds it whole, gathered, as one process's does: the next
    call reads it at each shard's box, and the state dict holds the volume. With data parallelism the
    replicas must hold the same value (a mask made from shapes); one made from each replica's own
    samples is refused, naming it (found by value: one all-reduce over the replicas, in the steps that
    rebind it)."""
    for name, m in swapped.named_modules():
        for slot, t in m._buffers.items():
            if t is None or not (t in mode.split or t in mode.chains):
                continue
            whole = m._buffers[slot] = mode.whole(t)
            if mode.grid.data > 1 and not _alike_over(whole.detach(), mode.grid.data_group):
                where = f"{name}.{slot}" if name else slot
                raise SpecError(f"model ({type(swapped).__name__}): its forward rebinds the buffer {where} "
                                f"to a value of the split volume that each data-parallel replica computes "
                                f"from its own samples; train it without data parallelism")


def _alike_over(t: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether ``t`` is the same on every rank of ``group`` (its elementwise minimum and maximum over
    the group agree), alike on every rank."""
    lo, hi = t.clone(), t.clone()
    dist.all_reduce(lo, dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, dist.ReduceOp.MAX, group=group)
    return torch.equal(lo, hi)
