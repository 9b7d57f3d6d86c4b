"""Point-to-point transports for halo and redistribution traffic.

Why: halos move over whatever the cluster does best (NCCL between GPUs, gloo on CPU, MPI where a
site's MPI is CUDA-aware or faster than TCP). Everything above this module sees one call: post these
sends and receives, then wait for all of them. Peers are global ranks.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.distributed as dist

from hybridpar.memfmt import wire


class Transport(Protocol):
    """Posts a batch of sends and receives to peers (global ranks) and waits for all of them."""

    name: str

    def exchange(self, sends: list[tuple[int, torch.Tensor, int]],
                 recvs: list[tuple[int, torch.Tensor, int]]) -> None:
        """``sends``/``recvs``: (peer, tensor dense in its memory format, tag); receives fill their
        tensors in place (a ``channels_last_3d`` buffer receives NDHWC bytes: :func:`memfmt.wire`)."""


class TorchP2P:
    """torch.distributed ``batch_isend_irecv`` on a process group (NCCL or gloo)."""

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


class MPIP2P:
    """mpi4py non-blocking sends and receives on ``COMM_WORLD`` (global ranks equal torch ranks).

    CPU tensors go through their numpy views without a copy. CUDA tensors need a CUDA-aware MPI; as MPI
    is not stream-aware, the current stream is synchronised before posting (no hidden host copies).
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
        if dist.is_initialized() and self.comm.Get_rank() != dist.get_rank():
            raise RuntimeError(
                f"hybridpar: MPI rank {self.comm.Get_rank()} != torch rank {dist.get_rank()}; launch with "
                f"mpirun so both agree, or use transport='torch'")

    def _buf(self, t: torch.Tensor):
        t = wire(t.detach())  # same storage; numpy() refuses tensors that require grad
        if t.is_cuda:
            return t  # __cuda_array_interface__: needs a CUDA-aware MPI build
        return t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()

    def exchange(self, sends, recvs) -> None:
        if any(t.is_cuda for _, t, _ in sends + recvs):
            torch.cuda.current_stream().synchronize()
        reqs = [self.comm.Irecv(self._buf(t), source=p, tag=tag) for p, t, tag in recvs]
        reqs += [self.comm.Isend(self._buf(t), dest=p, tag=tag) for p, t, tag in sends]
        self.MPI.Request.Waitall(reqs)


def get_transport(name: str | None, group: dist.ProcessGroup | None) -> Transport:
    """``'torch'`` (default) or ``'mpi'``; ``HYBRIDPAR_TRANSPORT`` sets the default."""
    name = name or os.environ.get("HYBRIDPAR_TRANSPORT", "torch")
    if name == "torch":
        return TorchP2P(group)
    if name == "mpi":
        return MPIP2P()
    raise ValueError(f"hybridpar: unknown transport {name!r}; use 'torch' or 'mpi'")
