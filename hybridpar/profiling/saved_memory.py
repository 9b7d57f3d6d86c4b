"""What autograd keeps for backward: the activation memory of a step, measured exactly.

Why a module of its own: peak activation memory decides which layouts fit (the advisor's memory
limit, a pipeline's micro-batches in flight), and on a CPU there is no allocator counter to read.
Autograd's saved-tensor hooks see every tensor it keeps; counting each distinct storage once while
it is held gives the bytes the step's backward needs, independent of allocator caching, and the same
on every device. The performance model's activation estimate is tested against it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

__all__ = ["SavedActivations"]


class _Held:
    """What autograd stores in place of a saved tensor; freed when autograd lets it go."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedActivations:
    """Peak bytes of the distinct storages autograd holds for backward, ``params`` excluded.

    Use as a context manager around forward *and* backward of a step::

        with SavedActivations(model.parameters()) as saved:
            loss = model(x).sum(); loss.backward()
        saved.peak_bytes

    A saved view counts its whole storage (what it keeps alive). Tensors saved inside activation
    recomputation's own hooks (``torch.utils.checkpoint``) are not seen.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[int, int] = {}
        self.live = self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.skip or t.device.type == "meta":
            return t
        if self.refs.get(key, 0) == 0:
            self.live += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live)
        self.refs[key] = self.refs.get(key, 0) + 1
        held = _Held(t)
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.live -= nbytes

    @staticmethod
    def _unpack(held):
        return held.t if isinstance(held, _Held) else held

    def __enter__(self) -> SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
