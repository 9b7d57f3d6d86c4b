"""How one pipeline stage talks to the others: which communicator carries which traffic, which
transport moves a tensor to which peer, and the tags that keep micro-batches apart.

Why a module of its own: the runtime (:mod:`~hybridpar.pipeline.runtime`) says *what* moves (micro-
batch m's activation to the next stage); this module decides *how*, once per engine, the same way on
every rank: ranks sharing a GPU stage through pinned host memory, the rest use torch.distributed.
Each is a :class:`~hybridpar.comm.transport.PointToPoint`. ``HYBRIDPAR_TRANSPORT=mpi`` (the variable
that selects the halo transport) moves all of a stage's traffic over MPI instead, activations,
gradients and the loss (ranks started by mpirun). Between CPU ranks of one host that is the fast
path: MPI copies through shared memory (MPICH by cross-memory attach), one copy where gloo's TCP
loopback makes two; a copy of our own would not beat it (``perf/PIPELINE.md``).

Communicators: gloo matches messages by tag, so the default group carries activations and gradients
and the pipe group (or the default) the loss. NCCL runs a pair's sends and receives in issue order
on one stream, and the runtime posts receives ahead of its sends: a receive of a gradient queued
before the send of the next activation would wait for a peer that waits for that send. Under NCCL
each kind of traffic therefore gets a communicator of its own, in which both sides issue it in the
same order (activations forward, gradients backward, the loss).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.comm import devices
from hybridpar.comm.transport import MPIP2P, PointToPoint, StagedP2P, TorchP2P, Work, choose, requested
from hybridpar.device import memfmt
from hybridpar.grid import ProcessGrid
from hybridpar.profiling import range as prange

# Tags: a kind of traffic plus the micro-batch (fewer than 4096 micro-batches per step); all below
# 32768, MPI's guaranteed tag bound, and above the halo exchange's tags (hybridpar.comm.halo).
FWD_TAG, BWD_TAG, LOSS_TAG = 1 << 12, 1 << 13, 1 << 14


class StageTransport:
    """The communicators and transports of this rank's stage (see module doc); create on every rank
    in the same order, after the layouts' groups."""

    def __init__(self, grid: ProcessGrid, memory_format: torch.memory_format) -> None:
        self.grid, self.memory_format = grid, memory_format
        nccl = "nccl" in str(dist.get_backend()).lower()
        g = grid
        pipeline = lambda r: (r % g.stage_size, r // (g.stage_size * g.pipe))  # noqa: E731
        self.loss_group = g.group_of(pipeline, world_ok=not nccl, purpose="loss" if nccl else "")
        self.p2p_groups: dict[str, dist.ProcessGroup | None] = {"F": None, "B": None}
        if nccl and g.pipe > 1:
            self.p2p_groups = {d: g.group_of(pipeline, purpose=f"pipeline-{d}") for d in "FB"}
        # every stage-to-stage transfer, where the user chose MPI (choose refuses it where ranks share
        # a GPU, as it does for halos)
        mpi = g.pipe > 1 and requested() == "mpi" and choose(None, "mpi", devices.shares_device()) == "mpi"
        self.mpi: MPIP2P | None = MPIP2P() if mpi else None

    def peer(self, stage: int) -> int:
        """Global rank of this rank's counterpart on pipeline stage ``stage``."""
        return self.grid.global_rank(self.grid.data_index, stage, self.grid.spatial_index)

    def group(self, other_stage: int, sending: bool) -> dist.ProcessGroup | None:
        """The communicator of an activation (forward) or gradient (backward) transfer."""
        forward = (other_stage > self.grid.pipe_index) == sending
        return self.p2p_groups["F" if forward else "B"]

    def _transport(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None) -> PointToPoint:
        if self.mpi is not None:
            return self.mpi
        if t.is_cuda and devices.shares_device():  # ranks sharing a GPU: through pinned host memory
            return StagedP2P(group)
        return TorchP2P(group)

    def post_recv(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Work:
        """Receive into ``t`` from global rank ``peer`` (``group``: for torch.distributed)."""
        t = memfmt.wire(t)  # a channels_last_3d buffer as the contiguous NDHWC view of its storage
        return self._transport(t, peer, group).irecv(t, peer, tag)

    def post_send(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Work:
        """Send the dense ``t`` to global rank ``peer`` (the counterpart of :meth:`post_recv`)."""
        t = memfmt.wire(t)
        return self._transport(t, peer, group).isend(t, peer, tag)

    def irecv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src_stage: int,
              tag: int) -> tuple[torch.Tensor, Work]:
        """A new buffer (in the stage's memory format) and the pending receive into it."""
        fmt = self.memory_format if len(shape) == 5 else torch.contiguous_format
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)
        with prange("pipeline_post_recv", "pipeline"):
            return t, self.post_recv(t, self.peer(src_stage), self.group(src_stage, False), tag)

    def send(self, t: torch.Tensor, dst_stage: int, tag: int) -> Work:
        """Send ``t`` to stage ``dst_stage``, in the memory format its receiver allocates."""
        with prange("pipeline_send", "pipeline"):
            fmt = self.memory_format if t.dim() == 5 else torch.contiguous_format
            return self.post_send(t.detach().contiguous(memory_format=fmt), self.peer(dst_stage),
                                  self.group(dst_stage, True), tag)
