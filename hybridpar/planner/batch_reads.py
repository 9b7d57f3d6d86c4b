"""Reads off a batch that data parallelism or micro-batches hold in parts, in a forward run by module
swapping: its extent, and a sample picked for its shape alone.

Why: each part runs the forward on its own samples. Its extent (``x.shape[0]``) is the part's, which
sizes a tensor along the batch as one process does, followed as a :class:`~hybridpar.planner.batch_extent.
PartBatch` (a value made of it is refused); the sized calls whose batch it gave are noted, so that
:mod:`hybridpar.planner.batch_flow`, which compares the calls of a part with the whole batch's, takes a
size that differs in proportion for the batch's only there (``torch.ones(int(x.shape[0]))``, an extent
the tag no longer follows, gives each part a tensor whose sum is the part's extent: refused). Picking a
sample is across the samples (each part's first is another one), but its shape is every sample's, the
same on every part, so a forward that reads nothing else of it (a per-sample element count,
``h[0].numel()``, a check of the volume's shape, ``x[0].shape``) runs as one process runs it.
:class:`~hybridpar.planner.layout_watch.LayoutWatch` therefore holds such a pick back instead of refusing
it, and refuses it, naming the line where it was picked, once its values are used (by a torch call other
than a read of its shape or attributes, a layer, an autograd.Function) or where it outlives the forward
(returned, kept in an attribute). Only a pick that every part can make is held back: ``h[0]`` or
``h[-1]`` (``h[1]`` fails on a part of one sample).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.fx
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.planner import batch_extent, calls
from hybridpar.planner.batch_extent import part_kind
from hybridpar.user_lines import caller

LIKE = ("zeros_like", "ones_like", "empty_like", "full_like")
"""Calls that read a tensor's shape, dtype and device alone (a pick's are every sample's)."""


def picks(func: Any, args: tuple) -> bool:
    """Whether ``func(*args)`` (a call, or a traced graph's node) picks one sample that every part
    holds: ``h[0]``, ``h[-1, :, 2]``."""
    if calls.name_of(func).strip("_") != "getitem" or len(args) < 2:
        return False
    first = args[1][0] if isinstance(args[1], tuple) and args[1] else args[1]
    return type(first) is int and first in (0, -1)  # a literal: not an extent read off the batch


def read_for_shape(node: torch.fx.Node) -> bool:
    """Whether a traced graph's pick ``node`` (:func:`picks`) is read for nothing but its shape and
    attributes by the nodes that read it (``h[0].numel()``, ``h[0].shape``), none of them the output."""
    def shape_only(user: torch.fx.Node) -> bool:
        if user.op == "call_method":
            return user.target in calls.SHAPE_READS or user.target in calls.SAFE
        return user.op == "call_function" and (calls.name_of(user.target) in LIKE or calls.name_of(
            user.target) == "getattr" and (user.args[1] == "shape" or user.args[1] in calls.SAFE))
    return bool(node.users) and all(shape_only(u) for u in node.users)


class BatchReads:
    """The side of a watch that reads off a batch in parts; the watch gives ``unsafe``, ``batched``,
    ``split`` and ``batch_apart``, and calls :meth:`reset_reads` as it starts a forward."""

    unsafe: list[str]
    batched: WeakIdKeyDictionary
    split: WeakIdKeyDictionary
    batch_apart: bool

    def reset_reads(self) -> None:
        self.picked = WeakIdKeyDictionary()  # a sample picked -> why it is refused if its values are used
        # a sized call (name, line, the size it gave dim 0) -> whether that size was the followed extent
        self.sized: dict[tuple[str, str, int], bool] = {}

    def followed(self) -> set[tuple[str, str, int]]:
        """The sized calls (name, line, size) that gave dim 0 the batch's extent as followed, every time."""
        return {call for call, tagged in self.sized.items() if tagged}

    def refuse_or_hold(self, func: Any, args: tuple, out: Any, why: str) -> None:
        """Refuse a call across the samples (``why``), or hold back a pick of one (:func:`picks`)."""
        if not picks(func, args):
            self.unsafe.append(why)
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.picked[t] = why

    def use(self, func: Any, tensors: list[torch.Tensor]) -> None:
        """Refuse the picks among ``tensors`` that ``func`` (a call, or a layer: None) reads the values of."""
        if not self.picked or func is not None and (
                calls.reads_shape(func) or calls.name_of(func) in (*calls.SAFE, *LIKE)):
            return
        self.unsafe += list(dict.fromkeys(self.picked[t] for t in tensors if t in self.picked))

    def batch_read(self, name: str, args: tuple, kwargs: dict, tensors: list[torch.Tensor], out: Any) -> Any:
        """Where the batch runs in parts, a call's result seen through its extent (read off a tensor
        holding the batch, :func:`batch_extent.followed`; refused as a value); a pick holds no batch."""
        for t in tree_leaves(out) if self.picked else ():
            if isinstance(t, torch.Tensor) and t in self.picked:
                self.batched.pop(t, None)
        first = tensors[0] if tensors else None
        held = first is not None and first not in self.picked and (
            first in self.batched or first in self.split)
        out, why = batch_extent.followed(name, args, kwargs, out, held)
        self.unsafe += [f"{why} at {caller()}"] if why else []
        if name not in batch_extent.SIZED:
            return out
        tagged = isinstance(out, torch.Tensor) and batch_extent.sizes_batch(name, args, kwargs, part_kind)
        if tagged:
            self.batched[out] = True  # torch.ones(n): each part's own samples along dim 0
        lead = (batch_extent.sizes_of(name, args, kwargs) or [None])[0]
        if isinstance(lead, int) and lead != -1:  # a size the batch's extent may have given
            call = (name, caller(), int(lead))
            self.sized[call] = tagged and self.sized.get(call, True)
        return out

    def kept_picks(self, outs: list[Any]) -> None:
        """Refuse the picks that outlive the forward: returned (``outs``), or held by anything else (an
        attribute of the model) once the forward's own references are gone."""
        self.use(None, [t for t in outs if isinstance(t, torch.Tensor)])
        if self.picked:
            gc.collect()  # a pick in a cycle of the forward's locals is not kept
            self.use(None, list(self.picked.keys()))
