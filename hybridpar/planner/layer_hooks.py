"""How :class:`~hybridpar.planner.layout_watch.LayoutWatch` meets the model's layers: hooks that pause
it inside each (its ``depth``), tell it what a layer read and wrote, and let a run change a layer's
arguments (a volume gathered for a layer that reads it whole).

Why apart: the watch follows torch functions between the layers; a layer's own calls are the layer's,
and what it does to the forward's tensors is seen at its edges: the copies its inputs are or were taken
of (:mod:`hybridpar.planner.copies`), and an input written in place inside it (its version counter).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from hybridpar.nn import samples
from hybridpar.user_lines import caller


class LayerHooks:
    """The layer side of a watch; the watch gives ``depth``, ``unsafe``, ``copies``, ``split``, ``chains``,
    :meth:`runs_split`, :meth:`needs_whole`, :meth:`original` and :meth:`after_layer`."""

    depth: int
    unsafe: list[str]
    batch_apart: bool
    part: int  # the samples of each part of the batch (a replica's micro-batch)
    batch: int  # the whole batch's
    batched: Any
    split: Any
    _versions: list[tuple[torch.Tensor, int]]
    original: Callable[[nn.Module], nn.Module]
    needs_whole: Callable[[nn.Module, torch.Tensor], bool]
    use: Callable[[Any, list[torch.Tensor]], None]

    def hook(self, modules: Iterable[nn.Module],
             on_leave: Callable[[nn.Module, tuple, object], None] | None = None) -> list:
        """Hooks that follow ``modules`` (the model's leaves): inside one, functions are the layer's and
        this mode lets them pass (its ``depth``). ``on_leave(m, args, out)`` runs as a layer ends, still
        inside it, so that what it reads is not the forward's (default: :meth:`after_layer` on the
        outermost layer). The one place this mode is paused inside layers."""
        def enter(m: nn.Module, args: tuple, kwargs: dict) -> tuple | None:  # before_layer's calls pass too
            if self.depth == 0:
                if kwargs:  # conv(input=h): its split counterpart names its input x
                    args, kwargs = positional(type(self.original(m)).forward, args, kwargs)
                self._layer_reads(m, [a for a in args if isinstance(a, torch.Tensor)])
            self.depth += 1
            if self.depth == 1:  # read inside the layer: not one of the forward's calls
                self._versions = [(a, a._version) for a in args if isinstance(a, torch.Tensor)]
            new = self.before_layer(m, args) if self.depth == 1 else None
            return (args if new is None else new), kwargs

        def leave(m: nn.Module, args: tuple, kwargs: dict, out: object) -> object:
            # a layer that hands back its input tensor (a crop whose shard is its input's) gives a new
            # tensor object of it, so that marking its output's extents leaves the input's as they were
            fresh = out.view_as(out) if self.depth == 1 and isinstance(out, torch.Tensor) and any(
                out is a for a in args) else None
            try:
                (on_leave or self._left)(m, args, out if fresh is None else fresh)
                if self.depth == 1:  # an input the layer wrote in place (x.mul_(gate) in a user's block)
                    self._wrote(m, [a for a, version in self._versions if a._version != version])
            finally:
                self.depth -= 1
            return fresh

        modules = list(modules)
        return [m.register_forward_pre_hook(enter, with_kwargs=True) for m in modules] + \
            [m.register_forward_hook(leave, with_kwargs=True, always_call=True) for m in modules]

    def _wrote(self, m: nn.Module, inputs: list[torch.Tensor]) -> None:
        """What layer ``m`` writing ``inputs`` in place in its own forward breaks (one said ``inplace``
        was met as it started): copies taken of them; a write into an input it read gathered."""
        self._versions = []
        for a in [] if getattr(m, "inplace", False) else inputs:
            self.unsafe += self.copies.layer_wrote(f"{type(m).__name__} (in its forward)", a)
            if (a in self.split or a in self.chains) and not self.runs_split(m, a):
                self.unsafe.append(f"{type(m).__name__} (writes its input in place, which it reads whole: "
                                   f"the write would land on the gathered copy)")

    def _layer_reads(self, m: nn.Module, inputs: list[torch.Tensor]) -> None:
        """What a layer's inputs say about copies (:meth:`Copies.layer_reads`); a layer that works across
        the samples of a batch held in parts (a GRU reading them as its sequence) is refused, as a call
        would be (:func:`hybridpar.nn.samples.module_across`)."""
        self.unsafe += self.copies.layer_reads(type(m).__name__, inputs, getattr(m, "inplace", False))
        self.use(None, inputs)  # a sample picked off a batch in parts, its values read by the layer
        x = inputs[0] if inputs else None
        if x is not None and self.batch_apart and (x in self.batched or x in self.split) and (
                why := samples.module_across(m, x)
                or samples.single_values(m, self._shape(x), self.part, self.batch)):
            self.unsafe.append(f"{why}, on values per sample of a batch in parts, at {caller()}")

    def _shape(self, x: torch.Tensor) -> tuple[int, ...]:
        """``x``'s shape, read as the watch's own call (inside a layer), not one of the forward's."""
        self.depth += 1
        try:
            return tuple(x.shape)
        finally:
            self.depth -= 1

    def _left(self, m: nn.Module, args: tuple, out: object) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and self.depth == 1:
            self.after_layer(m, x, out, self.runs_split(m, x))

    def read_whole(self, m: nn.Module, args: tuple) -> list[bool]:
        """Which of layer ``m``'s arguments it reads whole (gathered, in a run): a reshape of a split volume
        always; every split one where it reads its first input whole (:meth:`needs_whole`) or is given it
        whole (a bilinear form of a whole tensor and the volume)."""
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        whole = x is not None and (self.needs_whole(m, x) or x not in self.split)
        return [isinstance(a, torch.Tensor) and (a in self.chains or whole and a in self.split) for a in args]

    def before_layer(self, m: nn.Module, args: tuple) -> tuple | None:
        """Called as layer ``m`` starts on ``args``; new arguments, or None (the plan needs nothing
        here; a run sets extents and gathers what a layer reads whole)."""
        return None


def positional(forward: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call of ``forward`` (a method: its first parameter is ``self``) with every argument given by
    keyword that could come next by position moved there (``conv(input=h)`` as ``conv(h)``): a layer's
    split counterpart, and the planners' hooks, take a layer's inputs by position."""
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):  # no signature to read (a builtin): as it comes
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for p in params[len(args):]:
        if p.kind is not p.POSITIONAL_OR_KEYWORD or p.name not in kwargs:
            break
        args.append(kwargs.pop(p.name))
    return tuple(args), kwargs
