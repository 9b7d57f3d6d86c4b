"""A fixed ring of batch buffers in shared memory, page-locked for the GPU: the road from reader
processes to the device when the loader delivers on a GPU.

Why: a batch that crosses processes the usual way (a new shared-memory segment per batch, its file
descriptor passed over a socket, the trainer mapping it and faulting its pages in, then a copy from
pageable memory that the driver stages through a bounce buffer) costs the trainer milliseconds of
CPU per batch, which is as long as a GPU takes to train on a CosmoFlow 128³ sample. Here the trainer
allocates a few batch-sized buffers once, shares them with the workers when they start, and
page-locks them (``cudaHostRegister``); a worker writes a batch straight into a free buffer and sends
its number, and the trainer's receiver thread copies it to the device by DMA and hands the buffer
back. Where page-locking is refused, the buffers still spare the per-batch segment and mapping.

Which buffer is free is kept in a queue shared with the workers: a worker takes a number before it
reads and the receiver puts it back once the batch is on the device, so a buffer is never written
while it is being copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HostSlots:
    """``n`` shared buffers of ``shape`` and ``dtype``, page-locked for ``device`` where it is a GPU."""

    def __init__(self, n: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype = tuple(shape), dtype
        self.buffers = [torch.empty(self.shape, dtype=dtype).share_memory_() for _ in range(n)]
        locked = []
        if device.type == "cuda":
            for b in self.buffers:
                if not _register(b):
                    break
                locked.append(b)
        self.pinned = bool(locked) and len(locked) == n
        if not self.pinned:  # all or none: a partly locked ring would copy at two speeds
            for b in locked:
                _unregister(b)

    def close(self) -> None:
        """Unlock the buffers (before they are freed, after every copy from them is done)."""
        if self.pinned:
            for b in self.buffers:
                _unregister(b)
            self.pinned = False


def _register(buf: torch.Tensor) -> bool:
    """Page-lock ``buf`` for DMA (``cudaHostRegister``); False where the runtime refuses."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.nbytes, 0)
    except (AttributeError, AssertionError, RuntimeError):  # no such binding, or no CUDA build
        return False
    return int(getattr(err, "value", err)) == 0


def _unregister(buf: torch.Tensor) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
    except (AttributeError, AssertionError, RuntimeError):
        pass
