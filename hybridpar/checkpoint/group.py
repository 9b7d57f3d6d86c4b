"""Collectives for the checkpoint writer threads, on private gloo groups.

Why: the writer agrees with the other ranks (did everyone's files land? here is the manifest) from a
background thread while the training loop issues its own collectives on the main thread. Collectives on
one group from two threads may interleave in different orders on different ranks and deadlock, so each
writer thread gets a group of its own, always gloo (host-side work; NCCL cannot carry Python objects and
may be busy with gradients). In a plain process with no process group everything is local.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


class Group:
    """All ranks, on a private gloo group; or just this process when there is no process group."""

    def __init__(self, timeout_s: float) -> None:
        self.on = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.rank = dist.get_rank() if self.on else 0
        self.world = dist.get_world_size() if self.on else 1
        self.pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if self.on else None

    def all_gather(self, obj: Any) -> list[Any]:
        if not self.on:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def send(self, data: torch.Tensor, dst: int) -> list[tuple[dist.Work, torch.Tensor]]:
        """Post a byte tensor to ``dst`` (size first). The caller waits on the returned works, holding
        the tensors until then."""
        size = torch.tensor([data.numel()], dtype=torch.int64)
        return [(dist.isend(size, dst, group=self.pg), size), (dist.isend(data, dst, group=self.pg), data)]

    def recv(self, src: int) -> torch.Tensor:
        """The next byte tensor ``src`` sent us with :meth:`send`."""
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src, group=self.pg)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(data, src, group=self.pg)
        return data

    def close(self) -> None:
        """Release the private group (all ranks, once no writer uses it)."""
        if self.on and self.pg is not None:
            dist.destroy_process_group(self.pg)
            self.pg = None
