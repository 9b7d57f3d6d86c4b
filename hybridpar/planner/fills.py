"""A tensor of one value made at a split activation's global extents (``out = h.new_zeros(h.shape)``,
``torch.zeros(n, c, *h.shape[2:])``) is born split: each rank makes its shard's box of it.

Why: shape reads answer the volume's extents, so such a tensor would otherwise be the whole volume on
every rank, and writing a split activation into a box of it (``out[:, :, 1:-1] = h[:, :, 1:-1]``, a
crop padded back) would fill each rank's own part only. One value everywhere has the same box on every
shard, so making the shard's box alone is exact, and the write then runs on the shards as any write
into a split activation does (:mod:`hybridpar.planner.calls`, ``assign``). A random fill
(``torch.randn``) is not one value: it stays whole, drawn alike on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridpar.planner.calls import name_of

FILLS = {"new_zeros": 1, "new_ones": 1, "new_full": 1, "new_empty": 1, "zeros": 0, "ones": 0, "full": 0,
         "empty": 0}
"""The factories of one value, by the position of their size among the arguments (after ``self`` for a
tensor's ``new_*``)."""

Extents = tuple[int, ...]


def _size(args: tuple, kwargs: dict, pos: int) -> tuple[tuple[int, ...] | None, int]:
    """The size a factory is given (a sequence, or ints one by one) and the position after it."""
    if "size" in kwargs:
        return tuple(kwargs["size"]), pos
    if len(args) > pos and isinstance(args[pos], Sequence):
        return tuple(args[pos]), pos + 1
    end = pos
    while end < len(args) and isinstance(args[end], int) and not isinstance(args[end], bool):
        end += 1
    return (tuple(args[pos:end]) if end > pos else None), end


def born_split(watch: Any, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Run factory ``func`` (one of :data:`FILLS`) at this rank's box where its size ends in the global
    extents of a split activation that ``watch`` (a :class:`~hybridpar.planner.layout_watch.LayoutWatch`)
    follows, and mark what it made split; None (nothing run) where it is not such a call."""
    pos = FILLS[name_of(func)]
    size, after = _size(args, kwargs, pos)
    if not watch.splits or size is None or len(size) < 3 or tuple(size[-3:]) not in set(watch.split.values()):
        return None
    extents = tuple(size[-3:])
    shape = (*size[:-3], *watch.local(extents))
    if "size" in kwargs:
        out = func(*args, **{**kwargs, "size": shape})
    else:
        out = func(*args[:pos], shape, *args[after:], **kwargs)
    watch.mark(out, extents)
    return out
