"""Point-to-point transports for halo, redistribution and pipeline traffic.

Why: halos move over whatever the cluster does best (NCCL between GPUs, gloo on CPU, MPI where a
site's MPI is CUDA-aware or faster than TCP, pinned host memory over gloo where ranks share a GPU).
Everything above this module sees one call: post these sends and receives, then wait for all of
them (:class:`Transport`). A pipeline moves one message at a time and overlaps it with compute:
those transports also post single non-blocking sends and receives (:class:`PointToPoint`). Peers are
global ranks.

``HYBRIDPAR_TRANSPORT`` (read by :func:`requested` only) selects the halo transport and, set to
``mpi``, the pipeline's stage-to-stage transport too (:mod:`hybridpar.pipeline.stage_transport`).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist

from hybridpar.comm import devices
from hybridpar.device.memfmt import wire


class Transport(Protocol):
    """Posts a batch of sends and receives to peers (global ranks) and waits for all of them."""

    name: str

    def exchange(self, sends: list[tuple[int, torch.Tensor, int]],
                 recvs: list[tuple[int, torch.Tensor, int]]) -> None:
        """``sends``/``recvs``: (peer, tensor dense in its memory format, tag); receives fill their
        tensors in place (a ``channels_last_3d`` buffer receives NDHWC bytes: :func:`memfmt.wire`)."""


class Work(Protocol):
    """A pending transfer (torch's ``Work`` is one)."""

    def wait(self) -> bool: ...

    def is_completed(self) -> bool: ...


class PointToPoint(Protocol):
    """Posts single non-blocking sends and receives (of tensors dense in their memory format)."""

    name: str

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Work: ...

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Work: ...


class TorchP2P:
    """torch.distributed ``batch_isend_irecv`` (``isend``/``irecv`` for single messages) on a process
    group (NCCL or gloo)."""

    name = "torch"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    def exchange(self, sends, recvs) -> None:
        ops = [dist.P2POp(dist.irecv, wire(t), peer=p, group=self.group, tag=tag) for p, t, tag in recvs]
        ops += [dist.P2POp(dist.isend, wire(t), peer=p, group=self.group, tag=tag) for p, t, tag in sends]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        return dist.isend(wire(t), peer, group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        return dist.irecv(wire(t), peer, group=self.group, tag=tag)


class MPIP2P:
    """mpi4py non-blocking sends and receives on ``COMM_WORLD`` (global ranks equal torch ranks).

    CPU tensors go through their numpy views without a copy. CUDA tensors need a CUDA-aware MPI; as MPI
    is not stream-aware, the current stream is synchronised before posting (no hidden host copies).
    Tags stay below 32768, the bound every MPI guarantees (``MPI_TAG_UB`` >= 32767). MPI makes progress
    only inside MPI calls: a posted transfer advances when this rank posts, tests or waits.
    """

    name = "mpi"

    def __init__(self) -> None:
        try:
            from mpi4py import MPI  # noqa: PLC0415 (optional dependency)
        except ImportError as err:
            raise RuntimeError("hybridpar: the MPI transport needs mpi4py (pip install 'hybridpar[mpi]')") \
                from err
        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        mine = (self.comm.Get_rank(), self.comm.Get_size())
        if dist.is_initialized() and mine != (dist.get_rank(), dist.get_world_size()):
            raise RuntimeError(
                f"hybridpar: MPI rank {mine[0]} of {mine[1]} != torch rank {dist.get_rank()} of "
                f"{dist.get_world_size()}; launch with mpirun so both agree, or use transport='torch'")

    def _buf(self, t: torch.Tensor):
        t = wire(t.detach())  # same storage; numpy() refuses tensors that require grad
        if t.is_cuda:
            return t  # __cuda_array_interface__: needs a CUDA-aware MPI build
        return t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()

    @staticmethod
    def _sync(tensors) -> None:
        if any(t.is_cuda for t in tensors):
            torch.cuda.current_stream().synchronize()

    def exchange(self, sends, recvs) -> None:
        self._sync([t for _, t, _ in sends + recvs])
        reqs = [self.comm.Irecv(self._buf(t), source=p, tag=tag) for p, t, tag in recvs]
        reqs += [self.comm.Isend(self._buf(t), dest=p, tag=tag) for p, t, tag in sends]
        self.MPI.Request.Waitall(reqs)

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        self._sync([t])
        return _MPIWork(self.comm.Isend(self._buf(t), dest=peer, tag=tag), t)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        self._sync([t])  # the buffer may still be in use by queued kernels
        return _MPIWork(self.comm.Irecv(self._buf(t), source=peer, tag=tag), t)


class _MPIWork:
    """A pending MPI request as a :class:`Work`; holds the tensor, whose memory MPI reads or fills
    until the request completes."""

    def __init__(self, request, tensor: torch.Tensor) -> None:
        self.request, self.tensor = request, tensor

    def wait(self) -> bool:
        self.request.Wait()
        return True

    def is_completed(self) -> bool:
        return bool(self.request.Test())


class StagedP2P:
    """CUDA tensors staged through pinned host memory and moved by gloo; CPU tensors as they are.

    For ranks that share one GPU (NCCL refuses them) or a node without a working NCCL. Sends are
    copied device-to-host on the current stream, which is then synchronised once per exchange before
    gloo reads the host buffers: a deliberate host round trip, the price of this transport. Receives
    land in pinned buffers and are copied to the device asynchronously on the current stream (the
    pinned allocator keeps a buffer until that copy is done). Pipeline transfers use
    :meth:`isend` / :meth:`irecv` (one message each, same staging).
    """

    name = "staged"

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group

    @staticmethod
    def _host(t: torch.Tensor) -> torch.Tensor:
        t = wire(t)
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=True) if t.is_cuda else t

    def _staged_sends(self, sends):
        out = []
        for p, t, tag in sends:
            h = self._host(t)
            if t.is_cuda:
                h.copy_(wire(t), non_blocking=True)
            out.append((p, h, tag))
        if any(t.is_cuda for _, t, _ in sends):
            torch.cuda.current_stream().synchronize()  # deliberate: gloo reads host memory now
        return out

    def exchange(self, sends, recvs) -> None:
        host_recvs = [(p, self._host(t), tag) for p, t, tag in recvs]
        TorchP2P(self.group).exchange(self._staged_sends(sends), host_recvs)
        for (_, t, _), (_, h, _) in zip(recvs, host_recvs):
            if t.is_cuda:
                wire(t).copy_(h, non_blocking=True)

    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        ((_, h, _),) = self._staged_sends([(peer, t, tag)])
        return dist.isend(h, peer, group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        h = self._host(t)
        work = dist.irecv(h, peer, group=self.group, tag=tag)
        return _StagedRecv(work, h, t) if t.is_cuda else work


class _StagedRecv:
    """A pending staged receive: ``wait`` waits for gloo, then queues the copy onto the device."""

    def __init__(self, work, host: torch.Tensor, dst: torch.Tensor) -> None:
        self.work, self.host, self.dst = work, host, dst

    def wait(self) -> bool:
        self.work.wait()
        wire(self.dst).copy_(self.host, non_blocking=True)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


NAMES = ("torch", "mpi", "staged")
ENV = "HYBRIDPAR_TRANSPORT"


def requested() -> str | None:
    """The transport the user named in ``HYBRIDPAR_TRANSPORT`` (None: unset or empty)."""
    return os.environ.get(ENV) or None


def choose(name: str | None, env_value: str | None, shared: bool) -> str:
    """The transport to use: ``name``, else ``HYBRIDPAR_TRANSPORT``'s ``env_value``, else ``'staged'``
    where this rank shares its GPU and ``'torch'`` elsewhere. Asking for ``'torch'`` or ``'mpi'``
    while ranks share a GPU is an error: neither can move their CUDA tensors."""
    chosen = name or env_value or ("staged" if shared else "torch")
    if chosen not in NAMES:
        raise ValueError(f"hybridpar: unknown transport {chosen!r}; use one of {', '.join(NAMES)}")
    if shared and chosen != "staged":
        raise ValueError(f"hybridpar: transport {chosen!r} cannot move CUDA tensors between ranks that share "
                         f"a GPU (gloo carries no device memory, NCCL refuses them); use 'staged' or leave "
                         f"it unset")
    return chosen


def get_transport(name: str | None, group: dist.ProcessGroup | None) -> Transport:
    """The transport :func:`choose` picks (``HYBRIDPAR_TRANSPORT`` sets the default); the automatic
    choice of ``'staged'`` is said once per job."""
    chosen = choose(name, requested(), devices.shares_device())
    if chosen == "staged":
        if not (name or requested()):
            devices.say_staged_once()
        return StagedP2P(group)
    if chosen == "mpi":
        return MPIP2P()
    return TorchP2P(group)


def point_to_point(group: dist.ProcessGroup | None) -> Transport:
    """The main thread's transport for layout changes: torch.distributed, staged where ranks share a
    GPU (``HYBRIDPAR_TRANSPORT`` does not apply: it selects the halo and pipeline transports)."""
    return get_transport("staged" if devices.shares_device() else "torch", group)
