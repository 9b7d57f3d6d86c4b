"""Checks a forward makes on its own values (``if torch.isnan(h).any(): raise ...``), answered on the
meta device as a sound run answers them, and held to that answer when the model runs.

Why: a plan is made on meta tensors, which hold no values, so a forward that reads one into Python
could not be planned. A check of finiteness reads one whose answer is known wherever nothing has gone
wrong: every element of ``isnan(h)`` is False there, of ``isfinite(h)`` True, and so is what logic,
comparisons, counts and reductions make of them (``isnan(h).sum() > 0`` is False). The plan follows
the forward on that answer. When the model runs, each such read is compared with it: a run whose
check comes out otherwise (a NaN did appear) has left the planned path, and unless the forward's own
branch raised first, it is stopped at the forward's end naming the check (:attr:`SoundValues.left`).
Any other read of a value still stops the plan (:class:`hybridpar.planner.layout_watch.LayoutWatch`).

Such a value is the same on every rank of a sound run whatever the layout (the batch in parts
included): the rules that keep a read of values from differing between ranks do not apply to it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.user_lines import caller

SOURCES = {"isnan": False, "isinf": False, "isposinf": False, "isneginf": False, "isfinite": True}
"""Predicates on values, and what each gives for every element of a tensor without NaN or infinity."""
NOT = ("logical_not", "bitwise_not", "__invert__")
KEEP = ("any", "all", "amax", "amin", "max", "min", "bool", "float", "double", "int", "long", "to",
        "flatten", "view", "reshape", "squeeze", "unsqueeze", "clone", "detach", "contiguous")
"""Calls of one tensor that leave a constant where it was: reductions of it, casts, reshapes."""
COUNTS = ("sum", "count_nonzero")  # of a tensor of constant False: 0
BINARY: dict[str, Callable[[Any, Any], Any]] = {
    **dict.fromkeys(("__or__", "__ror__", "logical_or", "bitwise_or"), operator.or_),
    **dict.fromkeys(("__and__", "__rand__", "logical_and", "bitwise_and"), operator.and_),
    **dict.fromkeys(("__xor__", "__rxor__", "logical_xor", "bitwise_xor"), operator.xor),
    **dict.fromkeys(("__eq__", "eq"), operator.eq), **dict.fromkeys(("__ne__", "ne"), operator.ne),
    **dict.fromkeys(("__gt__", "gt", "greater"), operator.gt),
    **dict.fromkeys(("__lt__", "lt", "less"), operator.lt),
    **dict.fromkeys(("__ge__", "ge"), operator.ge), **dict.fromkeys(("__le__", "le"), operator.le)}
UNKNOWN = object()
"""What :meth:`SoundValues.read` gives where the call must be made."""
READS = {"__bool__": bool, "item": None, "__float__": float, "__int__": int, "__index__": int}
"""Reads of a value into Python; ``item`` gives the tensor's own kind of number."""


class SoundValues:
    """Per tensor, the constant each of its elements holds in a sound run (tensors derived from
    :data:`SOURCES` only); and the reads of them whose value differed, in :attr:`left`."""

    def __init__(self) -> None:
        self.of: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.left: list[str] = []

    def known(self, tensors: list[torch.Tensor]) -> bool:
        """Whether every one of ``tensors`` (at least one) holds a constant of a sound run."""
        return bool(tensors) and all(t in self.of for t in tensors)

    def read(self, func: Any, args: tuple) -> Any:
        """What a read of a constant on the meta device gives (the constant); :data:`UNKNOWN` for any
        other call, which is then made and shown to :meth:`after`. (Two calls around the call, no
        wrapper: the frames between the forward and a mode are read, ``calls.in_checkpoint``.)"""
        read = self._read_of(func, args) if self.of else None  # nothing tagged: no check in this forward
        return UNKNOWN if read is None or not args[0].is_meta else read

    def after(self, func: Any, args: tuple, out: Any) -> None:
        """Note what ``out`` holds in a sound run; a read of a constant that gave another value, in
        :attr:`left`."""
        name = getattr(func, "__name__", "")
        if not self.of and name not in SOURCES:  # the common forward, with no check: nothing to follow
            return
        if (expected := self._read_of(func, args)) is not None:
            if out != expected:
                self.left.append(f"{name} at {caller()} came out {out!r} where a run without NaN or "
                                 f"infinity gives {expected!r}")
        elif isinstance(out, torch.Tensor) and (value := self._constant(name, args)) is not None:
            self.of[out] = value

    def _read_of(self, func: Any, args: tuple) -> Any:
        """What ``func(*args)`` reads into Python in a sound run where it reads a constant, else None."""
        name, first = getattr(func, "__name__", ""), args[0] if args else None
        if name not in READS or not isinstance(first, torch.Tensor) or first not in self.of \
                or first.numel() != 1:
            return None
        own = bool if first.dtype == torch.bool else float if first.is_floating_point() else int
        return (READS[name] or own)(self.of[first])

    def _constant(self, name: str, args: tuple) -> Any:
        """What every element of ``name(*args)``'s result holds in a sound run, or None if unknown."""
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if name in SOURCES and first is not None:
            return SOURCES[name]
        if name in BINARY and len(args) == 2 and self.known(tensors):  # against a number or another's
            return BINARY[name](*(self.of[a] if isinstance(a, torch.Tensor) else a for a in args))
        if first is None or first not in self.of or len(tensors) != 1:
            return None
        value = self.of[first]
        if name in NOT and isinstance(value, bool):
            return not value
        if name in KEEP:
            return value
        return 0 if name in COUNTS and value is False else None
