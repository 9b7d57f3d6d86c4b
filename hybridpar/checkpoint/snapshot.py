"""The consistent snapshot: device tensors copied into host buffers that are reused from save to save.

Why: ``save`` may return once the training state is copied out, because the writes then go on in the
background from the copy. Reusing the host buffers (pinned on CUDA, so the copy is a DMA that overlaps
compute) avoids allocating and page-faulting a gigabyte per save, which alone costs more than the copy.

Overlap (the DataStates-LLM idea): weights and optimizer state do not change between one optimizer step
and the next, so the copy need not happen inside ``save`` at all. With ``overlap=True`` the large
tensors are copied while the next forward/backward runs (on CPU by the writer thread, on CUDA by a side
stream), and only the next optimizer step waits for the copy (:meth:`Snapshot.guard`). Small tensors
(below ``overlap_min_bytes``: RNG states, step counters, norm statistics that the forward pass updates)
are still copied at once. Every deferred tensor's version counter is checked: a tensor changed in place
before its copy was safely taken fails that save loudly instead of storing a torn state.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from hybridpar.checkpoint.format import CheckpointError


class HostBuffers:
    """Host tensors kept across saves, one per (file, key), reallocated only when shape or dtype change."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def get(self, slot: tuple[str, str], like: torch.Tensor) -> torch.Tensor:
        buf = self._bufs.get(slot)
        pin = like.is_cuda
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype or buf.is_pinned() != pin:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._bufs[slot] = buf
        return buf

    def retain(self, slots: Iterable[tuple[str, str]]) -> None:
        """Free the buffers of keys that the last save no longer had."""
        keep = set(slots)
        for s in [s for s in self._bufs if s not in keep]:
            del self._bufs[s]

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


def _version(t: torch.Tensor) -> int:
    """torch's in-place write counter of ``t`` (what autograd checks saved tensors with): a different
    value later means the tensor was written to. The one reach into this private torch attribute."""
    return t._version


def check_tensor(key: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, if a checkpoint can hold it; else a TypeError naming the entry and what would do."""
    if not isinstance(t, torch.Tensor) or type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise TypeError(f"state entry {key!r} is a {type(t).__name__}: store plain tensors (a DTensor: "
                        f".full_tensor() or .to_local())")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"state entry {key!r} has layout {t.layout}: store it dense (.to_dense())")
    if t.is_quantized or t.is_meta:
        raise TypeError(f"state entry {key!r} is a {'quantized' if t.is_quantized else 'meta'} tensor: "
                        f"only materialised, unquantized tensors can be checkpointed")
    return t.detach()


class Snapshot:
    """The tensors of one save on their way into host buffers.

    ``items`` are (file, key, tensor); :attr:`host` maps each file to its (key, host tensor) list in the
    same order, ready for the writer once :meth:`finish` returned.
    """

    def __init__(self, items: Iterable[tuple[str, str, torch.Tensor]], buffers: HostBuffers,
                 overlap: bool = False, overlap_min_bytes: int = 1 << 20) -> None:
        self.host: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self.nbytes = 0
        self._copied = threading.Event()
        self._deferred: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        self._cuda_done: list[torch.cuda.Event] = []
        self._cuda_later: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        self._device: torch.device | None = None
        self._guarded = False
        self._error: str | None = None
        now_cuda: list[tuple[torch.Tensor, torch.Tensor]] = []
        later_cuda: list[tuple[str, torch.Tensor, torch.Tensor, int]] = []
        slots = []
        for file, key, t in items:
            src = check_tensor(key, t)
            buf = buffers.get((file, key), src)
            slots.append((file, key))
            self.host.setdefault(file, []).append((key, buf))
            self.nbytes += buf.nbytes
            big = overlap and src.nbytes >= overlap_min_bytes
            if src.is_cuda:
                (later_cuda.append((key, src, buf, _version(src))) if big else now_cuda.append((src, buf)))
            elif big:
                self._deferred.append((key, src, buf, _version(src)))
            else:
                buf.copy_(src)
        buffers.retain(slots)
        if now_cuda or later_cuda:
            self._launch_cuda(buffers, now_cuda, later_cuda)
        if not self._deferred and not later_cuda:
            self._copied.set()

    def _launch_cuda(self, buffers: HostBuffers, now: list, later: list) -> None:
        """Copy on a side stream that first waits for the work already queued on the compute stream."""
        device = (now[0][0] if now else later[0][1]).device
        self._device = device
        main = torch.cuda.current_stream(device)
        side = buffers.stream(device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            if now:
                for src, buf in now:
                    buf.copy_(src, non_blocking=True)
                    src.record_stream(side)
                done = torch.cuda.Event()
                done.record(side)
                done.synchronize()
            if later:
                for _, src, buf, _ in later:
                    buf.copy_(src, non_blocking=True)
                    src.record_stream(side)
                done = torch.cuda.Event()
                done.record(side)
                self._cuda_done.append(done)
                self._cuda_later = later

    @property
    def pending(self) -> bool:
        """Whether a copy is still in flight (only in overlap mode)."""
        return not self._copied.is_set()

    def guard(self) -> None:
        """Call before the state changes (the optimizer step): afterwards the snapshot cannot be torn.

        On CPU this blocks until the writer thread has copied the deferred tensors; on CUDA it only makes
        the compute stream wait for the copy stream, so the host never blocks.
        """
        if self._cuda_done:
            for key, src, _, version in self._cuda_later:
                if _version(src) != version and self._error is None:
                    self._error = self._torn(key, "before ckpt.before_update()")
            for ev in self._cuda_done:
                torch.cuda.current_stream(self._device).wait_event(ev)
            self._guarded = True
            return
        self._copied.wait()

    def _torn(self, key: str, when: str) -> str:
        return (f"tensor {key!r} was changed in place {when} while save(overlap=True) was copying it: "
                f"call ckpt.before_update() (or ckpt.attach(optimizer)) before the optimizer step, or "
                f"save with overlap=False")

    def release(self) -> None:
        """Let :meth:`guard` return even if :meth:`finish` never ran (the save failed before its copy)."""
        self._copied.set()

    def finish(self) -> None:
        """Complete the copy (writer thread): deferred CPU copies, or wait for the CUDA copy stream."""
        try:
            for _, src, buf, _ in self._deferred:
                buf.copy_(src)
            for key, src, _, version in self._deferred:
                if _version(src) != version:
                    self._error = self._error or self._torn(key, "during the copy")
            for ev in self._cuda_done:
                ev.synchronize()
            if self._cuda_done and not self._guarded:
                for key, src, _, version in self._cuda_later:
                    if _version(src) != version:
                        self._error = self._error or self._torn(key, "before ckpt.before_update()")
        finally:
            self._deferred = []
            self._cuda_later = []
            self._copied.set()
        if self._error:
            raise CheckpointError(self._error)
