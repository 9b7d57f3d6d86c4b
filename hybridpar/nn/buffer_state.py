"""Modules' buffers as they are now, and putting them back: one record for every place that runs a user's
forward where one process would not (planning's trace, a recomputation, micro-batches).

Why one: a buffer a forward moves (a step counter, an EMA, BatchNorm's statistics) may be updated in
place, or its slot rebound to a new tensor (``self.ema = 0.9 * self.ema + ...``); one tensor may sit in
several slots (a module under two names). Each place that undoes a forward's effect must handle all
three alike, and did so in three copies of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a buffer holding NaN has not moved because NaN != NaN); tensors on
    the meta device (a model's copy planned at another size) hold no values: alike in shape, alike."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_meta or b.is_meta:
        return True
    if a.is_floating_point() or a.is_complex():
        return bool(torch.isclose(a, b, rtol=0.0, atol=0.0, equal_nan=True).all())
    return torch.equal(a, b)


class Snapshot:
    """Every buffer slot of ``named`` ((name, module) pairs; a module met twice recorded once), with a
    copy of each tensor's values, taken once however many slots hold it, and its version counter.
    ``compare(module, slot)`` False: that slot's values are not copied (it is then followed by
    :meth:`touched` alone, which costs no copy)."""

    def __init__(self, named: Iterable[tuple[str, nn.Module]],
                 compare: Callable[[nn.Module, str], bool] | None = None) -> None:
        # module, slot, tensor (None: a slot registered empty, which a forward may fill), name
        self.slots: list[tuple[nn.Module, str, torch.Tensor | None, str]] = []
        self.copies: dict[int, torch.Tensor] = {}  # id(tensor) -> its values when taken
        self.versions: dict[int, int] = {}  # id(tensor) -> its version counter when taken
        seen: set[int] = set()
        with torch.no_grad():
            for prefix, m in named:
                if id(m) in seen:
                    continue
                seen.add(id(m))
                for slot, t in m._buffers.items():
                    self.slots.append((m, slot, t, f"{prefix}.{slot}" if prefix else slot))
                    if t is None:
                        continue
                    self.versions.setdefault(id(t), t._version)
                    if id(t) not in self.copies and (compare is None or compare(m, slot)):
                        self.copies[id(t)] = t.detach().clone()

    def moved(self) -> list[str]:
        """Names of the slots rebound since, or whose tensor's values changed (each tensor named once), of
        those whose values were copied."""
        named: set[int] = set()
        out = []
        for m, slot, t, name in self.slots:
            now = m._buffers.get(slot)
            if t is None:
                if now is not None:
                    out.append(name)
            elif id(t) in self.copies and id(t) not in named and (
                    now is not t or not same_values(t.detach(), self.copies[id(t)])):
                named.add(id(t))
                out.append(name)
        return out

    def touched(self) -> list[tuple[nn.Module, str, str]]:
        """The slots rebound since, or whose tensor was written in place (its version counter moved,
        whatever it wrote): (module, slot, name)."""
        return [(m, slot, name) for m, slot, t, name in self.slots if m._buffers.get(slot) is not t or (
            t is not None and t._version != self.versions[id(t)])]

    def restore(self) -> None:
        """Each slot holds its own tensor again, with the values it had."""
        with torch.no_grad():
            for m, slot, t, _ in self.slots:
                if m._buffers.get(slot) is not t:
                    m._buffers[slot] = t
            held = {id(t): t for _, _, t, _ in self.slots if t is not None and id(t) in self.copies}
            for t in held.values():
                saved = self.copies[id(t)]
                if not same_values(t, saved):
                    t.copy_(saved)

    def rebind(self, tensors: dict[int, torch.Tensor]) -> list[tuple[nn.Module, str, torch.Tensor | None]]:
        """Put ``tensors[id(original)]`` in each slot (a recomputation's own copies); what the slots held
        comes back, for :func:`put`."""
        held = [(m, slot, m._buffers.get(slot)) for m, slot, _, _ in self.slots]
        for m, slot, t, _ in self.slots:
            m._buffers[slot] = None if t is None else tensors[id(t)]
        return held

    def fresh(self) -> dict[int, torch.Tensor]:
        """New copies of the values taken, by the original tensor's id (a second use starts alike)."""
        with torch.no_grad():
            return {k: v.clone() for k, v in self.copies.items()}


def put(held: list[tuple[nn.Module, str, torch.Tensor | None]]) -> None:
    """The slots as :meth:`Snapshot.rebind` found them."""
    for m, slot, t in held:
        m._buffers[slot] = t
