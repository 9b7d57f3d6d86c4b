"""Batches moved to the training device as they arrive, and finished there.

Why: a GPU consumes a CosmoFlow 128³ sample in a few milliseconds, faster than one reader process
turns int16 counts into float32 ``log1p`` values and faster than a 32 MB float32 batch crosses shared
memory and the PCIe bus on the training loop's thread. So the loader can hand the device the stored
form (int16: half the bytes) and let the device finish it (:class:`~hybridpar.data.dataset.StoredForm`),
and the copy runs on a side stream from the loader's receiver thread the moment a batch arrives, so
that the step finds its input already on the device.

Ordering without a host wait: the copy and the finish are queued on the side stream and an event is
recorded after them; :meth:`DeviceStage.take` makes the consuming stream wait for that event (a device
wait, not a host one) and records the batch's use on that stream, so the caching allocator cannot
hand its memory to the side stream again before the step is done with it. On a CPU device there is
no stream: the batch is moved and finished inline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class Ready(NamedTuple):
    """A batch input queued for the device: usable once ``event`` (None: at once) has fired."""

    x: torch.Tensor
    event: torch.cuda.Event | None


class DeviceStage:
    """Moves ``(x, y)`` host batches to ``device``, applying ``finish`` to ``x`` there (None: as is)."""

    def __init__(self, device: torch.device | str,
                 finish: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.finish = finish
        self._stream: torch.cuda.Stream | None = None

    def put(self, x: torch.Tensor, y: torch.Tensor, copied: bool = False) -> tuple[Ready, torch.Tensor]:
        """Queue the batch's move (any thread). Returns what :meth:`take` turns into device tensors.
        ``copied``: return only once nothing reads ``x`` any more (it is a buffer to be reused)."""
        if self.device.type != "cuda":
            x, y = x.to(self.device, copy=copied), y.to(self.device)
            return Ready(self.finish(x) if self.finish is not None else x, None), y
        with torch.cuda.device(self.device):  # the receiver thread has no current device of its own
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._stream):
                xd = x.to(self.device, non_blocking=True)
                yd = y.to(self.device, non_blocking=True)
                if self.finish is not None:
                    xd = self.finish(xd)
                event = torch.cuda.Event()
                event.record(self._stream)
            if copied:
                event.synchronize()  # this thread waits for the copy; the training loop does not
        return Ready(xd, event), yd

    def take(self, ready: Ready, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch on the device, ordered before whatever the current stream does next."""
        if ready.event is None:
            return ready.x, y
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(ready.event)
        ready.x.record_stream(stream)
        y.record_stream(stream)
        return ready.x, y
