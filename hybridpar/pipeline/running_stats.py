"""Norm layers' running statistics, averaged over the data-parallel replicas after every step.

Why: a replica normalises its own share of the global batch, so each replica's BatchNorm and
InstanceNorm running averages drift apart; a checkpoint (written by one replica) would keep one
replica's, each replica would validate with its own, and a run resumed from the checkpoint would go on
from statistics the uninterrupted run never had.

When: every training step, not where the statistics are read. The all-reduce is launched as soon as
the stage's last forward of the step has run (no later update can come: a backward's recomputation
counts no batch, see :func:`hybridpar.nn.norm.recomputing`) and waited for beside the gradient
buckets, so a few kilobytes travel while the backward computes. Averaging only where the statistics
are read (validation, checkpoint, ``full_state_dict``) would give the same numbers in exact arithmetic
but not in floating point: a run resumed from averaged statistics would then differ in the last bits
from one whose replicas kept their own, and every reader (``local_state_dict``, ``eval()``, user code
reading the buffers) would need a hook. A forward in training mode outside a step (``predict``, as
precise-BN re-estimation uses it) synchronises when it returns.

What is exact: each update is linear, with the same factor on every replica (every replica runs the
same number of micro-batches, so ``num_batches_tracked`` agrees without an exchange). The average of
the replicas' running means is therefore the running average of the global batch's mean (replica
batches are equal), what one layer seeing the whole batch would track. The average of the running
variances is the running average of the replica batches' variances, the variances this layer
normalised with, which is what torch's ``running_var`` averages; it leaves out the spread of the
replicas' batch means that the global batch's variance would add (``SyncBatchNorm``'s). Layers whose
statistics already span the replicas (``DistBatchNorm3d(stats="stage")``, ``SyncBatchNorm``) are left
alone. The sum is taken in float64, so the average of identical values is that value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.nn.families import tracks_replica_statistics


class ReplicaStats:
    """Averages the running means and variances of ``modules``' norm layers over ``group``."""

    def __init__(self, modules: Iterable[nn.Module], group: dist.ProcessGroup) -> None:
        self.norms = [m for root in modules for m in root.modules() if tracks_replica_statistics(m)]
        self.group = group
        self.replicas = dist.get_world_size(group)
        self._pending: tuple[list[torch.Tensor], torch.Tensor, Any] | None = None

    def __bool__(self) -> bool:
        return bool(self.norms) and self.replicas > 1

    def start(self) -> None:
        """Launch the sum over the replicas (the buffers are read now: call after the last update)."""
        if not self:
            return
        # read each time: Module.to() and friends replace buffers by new tensors
        tensors = [t for m in self.norms for t in (m.running_mean, m.running_var)]
        flat = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors])
        self._pending = (tensors, flat, dist.all_reduce(flat, group=self.group, async_op=True))

    def finish(self) -> None:
        """Wait for the sum and write the average back (nothing to do if nothing was started)."""
        if self._pending is None:
            return
        tensors, flat, work = self._pending
        self._pending = None
        work.wait()
        flat /= self.replicas
        off = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

    def sync(self) -> None:
        """Average now (blocking)."""
        self.start()
        self.finish()
