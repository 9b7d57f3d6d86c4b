"""A block torch.fx could not trace into, run split by module swapping, its shape reads answering with
the volume's extents.

Why: a block of a traced model may be untraceable only for a Python check on its input's shape (MONAI's
``RegistrationDownSampleBlock`` checks that the extents are even before it pools). Running it whole would
gather the volume onto every rank; running it on the shard with its registered layers swapped for their
split counterparts (:func:`hybridpar.pipeline.swap.swap`) keeps the volume split, but then ``x.shape``
would give the shard's extents, where the block (and a traced graph, and the plan) read the volume's.
Here the block's forward runs under a ``TorchFunctionMode`` that answers ``x.shape`` and ``x.size()``
of its split activations (its input, what its layers return, what elementwise functions make of them)
with their global extents; inside its layers (which work on shards) nothing is changed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridpar.grid import ProcessGrid
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.pipeline.swap import swap
from hybridpar.planner.swapped import leaves, swapped_plan
from hybridpar.planner.terms import Split

Extents = tuple[int, ...]


class _GlobalExtents(TorchFunctionMode):
    """Answers shape reads of the tensors in ``extents`` (id -> (tensor, global D, H, W)) with their
    global extents, outside the block's layers (``depth`` > 0 inside one)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.extents: dict[int, tuple[torch.Tensor, Extents]] = {}  # the tensor kept: ids are not reused

    def track(self, t: torch.Tensor, extents: Sequence[int]) -> None:
        self.extents[id(t)] = (t, tuple(extents))

    def _global(self, t: torch.Tensor) -> torch.Size:
        return torch.Size((*t.shape[:2], *self.extents[id(t)][1]))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        if not self.depth and isinstance(first, torch.Tensor) and id(first) in self.extents:
            if getattr(func, "__self__", None) is torch.Tensor.shape:  # the property's getter
                return self._global(first)
            if func is torch.Tensor.size:
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                whole = self._global(first)
                return whole if dim is None else whole[dim]
        out = func(*args, **kwargs)
        if not self.depth and isinstance(out, torch.Tensor) and out.dim() == 5:
            flat = [*args, *(a for v in args if isinstance(v, list | tuple) for a in v), *kwargs.values()]
            src = next((a for a in flat if isinstance(a, torch.Tensor) and id(a) in self.extents
                        and a.shape[2:] == out.shape[2:]), None)
            if src is not None:  # elementwise on a split activation: the same global extents
                self.track(out, self.extents[id(src)][1])
        return out


class _Block:
    """What a swapped block knows of its sizes: the global extents of its input and of each of its
    layers' outputs (per call, in call order), from its plan at that input size."""

    def __init__(self, block: nn.Module, split: Split, layers: dict[str, nn.Module]) -> None:
        self.block, self.split, self.layers = block, split, layers  # the original, for meta runs
        self.input_extents: Extents = ()
        self.outputs: dict[str, list[Extents]] = {}

    def bind(self, input_shape: Sequence[int]) -> None:
        """Plan the block on a global input of ``input_shape`` and give its split layers their global
        input shapes (at build, and whenever the engine runs another size)."""
        records = swapped_plan(self.block, tuple(input_shape), self.split, 1, nested=True)
        self.input_extents = tuple(input_shape[2:])
        self.outputs = {}
        for r in records:
            self.outputs.setdefault(r.name.split("#")[0], []).append(tuple(r.output_shape[2:]))
        first = {r.name: r for r in reversed(records)}
        for name, layer in self.layers.items():
            if isinstance(layer, SpatialLayer) and name in first:
                layer.global_input_shape = tuple(first[name].input_shape[2:])


def bind_nested(m: nn.Module, input_shape: Sequence[int]) -> bool:
    """Give a block made by :func:`swap_nested` the global ``input_shape`` it now runs on; False for
    any other module."""
    sizes = getattr(m, "_hybridpar_block", None)
    if sizes is None:
        return False
    sizes.bind(input_shape)
    return True


def swap_nested(block: nn.Module, grid: ProcessGrid, input_shape: Sequence[int],
                convert: Callable[[str, nn.Module, ProcessGrid], nn.Module]) -> nn.Module:
    """A copy of ``block`` (sharing its parameters and buffers) whose registered layers run split on
    ``grid`` (``convert(name, layer, grid)``, names relative to the block), and whose forward reads
    global extents, those of a global input of ``input_shape`` (:func:`bind_nested` changes it)."""
    swapped = swap(block, grid, convert)
    layers = {name: swapped.get_submodule(name) for name, _ in leaves(block)}  # a split layer may hold
    sizes = _Block(block, grid.spatial_shape, layers)                          # children: the block's
    sizes.bind(input_shape)
    mode = _GlobalExtents()
    calls: dict[str, int] = {}

    for name, layer in layers.items():
        def enter(m: nn.Module, args: Any) -> None:
            mode.depth += 1

        def leave(m: nn.Module, args: Any, out: Any, name: str = name) -> None:
            mode.depth -= 1
            k = calls.get(name, 0)
            calls[name] = k + 1
            known = sizes.outputs.get(name, [])
            if isinstance(out, torch.Tensor) and out.dim() == 5 and k < len(known):
                mode.track(out, known[k])

        layer.register_forward_pre_hook(enter)
        layer.register_forward_hook(leave)
    inner = swapped.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mode.track(x, sizes.input_extents)
        calls.clear()
        try:
            with mode:
                return inner(x, *args, **kwargs)
        finally:
            mode.extents.clear()
            mode.depth = 0

    swapped.forward = forward  # an attribute of this copy only: its class and state dict keys unchanged
    swapped._hybridpar_block = sizes
    return swapped
