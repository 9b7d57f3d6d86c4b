"""Whether a forward run by module swapping computes on a shard what it computes on the whole volume.

Why: a model whose forward torch.fx cannot trace runs on each rank's shard by its own forward
(:mod:`hybridpar.pipeline.swap`). Its layers run split and exact, but the Python between them sees the
shard: where it reads a split activation's spatial extents (``x.shape[2]``, ``x.size(3)``), it reads the
shard's. A reshape by those extents is what a shard needs (a pixel shuffle: the plan checks that its
shards map onto the output's); a branch on them (``if x.shape[2] > 16``), a number made of them
(``h * h.size(2) / 8``) or a layer added when the input is deep enough gives another answer on a shard
than on the volume, and could differ between ranks of uneven shards.

So where the plan saw such a read, the forward is rehearsed on the meta device as each rank runs it:
on the rank's input shard, each layer standing in for its split counterpart by returning that rank's
shard of the output the plan gave it (a layer is not run on a shard: a split norm normalises over the
volume). What the forward does outside its layers is compared, call by call, with what it does on the
volume: the same layers called in the same order, the same functions with the same non-tensor
arguments (sizes given to a reshape excepted). Any difference refuses the model, naming the call and
its line, on every rank alike and before any step.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridpar.geometry import shard_box
from hybridpar.nn.meta import meta_call, meta_state
from hybridpar.planner.space_maps import STEPS
from hybridpar.planner.terms import SpecError, Split

Call = tuple[str, Any]
Outputs = dict[str, list[tuple[tuple[int, ...], Split]]]
"""Per layer name, the global shape and the split of each of its calls' outputs, in call order."""


class _Tensor(NamedTuple):
    """A tensor argument, as far as it must agree: its rank (its extents are the shard's)."""

    dim: int

    def __repr__(self) -> str:
        return f"<{self.dim}-d tensor>"


def _constant(v: Any) -> Any:
    """What of an argument must agree between the volume and a shard: a tensor's rank, a number or a
    name as it is, a sequence element by element."""
    if isinstance(v, torch.Tensor):
        return _Tensor(v.dim())
    if isinstance(v, list | tuple):
        return tuple(_constant(a) for a in v)
    if v is None or isinstance(v, bool | int | float | complex | str | torch.dtype | torch.device):
        return v
    return type(v).__name__


def _reads_shape(func: Any) -> bool:
    """A shape read: its result differs on a shard by design; what is done with it is what counts."""
    return getattr(func, "__self__", None) is torch.Tensor.shape or \
        getattr(func, "__name__", "") in ("size", "dim", "ndimension", "numel")


def _caller() -> str:
    """``file:line`` of the innermost frame outside torch and this package: the forward's line."""
    f = sys._getframe(2)
    while f is not None and (f"{os.sep}torch{os.sep}" in f.f_code.co_filename
                             or f"{os.sep}hybridpar{os.sep}" in f.f_code.co_filename):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class _Calls(TorchFunctionMode):
    """Records a forward's calls outside its layers, and each layer call, in order, with the line of
    the forward that made each (kept apart: it is shown, not compared)."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.calls: list[Call] = []
        self.lines: list[str] = []

    def add(self, call: Call) -> None:
        self.calls.append(call)
        self.lines.append(_caller())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.depth and not _reads_shape(func):
            name = getattr(func, "__name__", str(func))
            consts = (_constant(args), tuple(sorted((k, _constant(v)) for k, v in kwargs.items())))
            self.add((name, None if name in STEPS else consts))
        return func(*args, **kwargs)


StandIn = Callable[[nn.Module, str, int], "torch.Tensor | None"]


def _calls(model: nn.Module, layers: dict[nn.Module, str], shape: Sequence[int],
           stand_in: StandIn | None = None) -> _Calls:
    """The calls of ``model``'s forward on a meta input of ``shape``; ``stand_in(layer, name, k)``, if
    given, is what the ``k``-th call of a layer returns instead of running it (None: run it)."""
    rec = _Calls()
    count: dict[str, int] = {}

    def enter(m: nn.Module, args: tuple) -> None:
        if not rec.depth:
            rec.add((f"layer {layers[m]}", None))
        rec.depth += 1

    def leave(m: nn.Module, args: tuple, out: object) -> None:
        rec.depth -= 1

    def stub(m: nn.Module, name: str) -> Callable[..., Any]:
        real = m.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            k = count[name] = count.get(name, -1) + 1
            out = stand_in(m, name, k)  # type: ignore[misc]
            return real(*args, **kwargs) if out is None else out
        return forward

    handles = [m.register_forward_pre_hook(enter) for m in layers]
    handles += [m.register_forward_hook(leave, always_call=True) for m in layers]
    if stand_in is not None:
        for m, name in layers.items():
            m.forward = stub(m, name)  # an instance attribute, removed below
    state, dtype = meta_state(model)
    x = torch.empty(tuple(shape), dtype=dtype, device="meta")
    try:
        with rec:
            meta_call(model, state, x)
    finally:
        for h in handles:
            h.remove()
        for m in layers if stand_in is not None else ():
            vars(m).pop("forward", None)
    return rec


def _local(shape: Sequence[int], split: Split, coord: Sequence[int]) -> tuple[int, ...]:
    """The shard at ``coord`` of a volume of ``shape`` under ``split`` (the whole where not split)."""
    if len(shape) != 5:
        return tuple(shape)
    return (*shape[:2], *(hi - lo for lo, hi in shard_box(shape[2:], split, coord)))


def _show(call: Call | None) -> str:
    if call is None:
        return "nothing more"
    name, consts = call
    if consts is None:
        return name
    args = [repr(a) for a in consts[0]] + [f"{k}={v!r}" for k, v in consts[1]]
    return f"{name}({', '.join(args)})"


def check_shards_compute_alike(model: nn.Module, layers: dict[nn.Module, str], input_shape: Sequence[int],
                               split: Split, outputs: Outputs) -> None:
    """Refuse (:class:`SpecError`) a forward that does something else outside its ``layers`` (module ->
    name) on a rank's shard of ``split`` than on the volume of ``input_shape``; ``outputs``: the plan's
    layer outputs."""
    whole = _calls(model, layers, input_shape)
    extents = lambda s: "x".join(map(str, s[2:]))  # noqa: E731
    for coord in itertools.product(*(range(p) for p in split)):
        shape = _local(input_shape, split, coord)
        if shape == tuple(input_shape):
            continue

        def stand_in(m: nn.Module, name: str, k: int, coord: tuple[int, ...] = coord) -> torch.Tensor | None:
            known = outputs.get(name, [])
            if k >= len(known):
                return None
            out_shape, out_split = known[k]
            floats = [p.dtype for p in m.parameters() if p.is_floating_point()]
            return torch.empty(_local(out_shape, out_split, coord), device="meta",
                               dtype=floats[0] if floats else torch.get_default_dtype())

        where = f"on rank {list(coord)}'s shard ({extents(shape)} of {extents(input_shape)})"
        try:
            part = _calls(model, layers, shape, stand_in)
        except Exception as err:
            raise SpecError(f"model ({type(model).__name__}): run by module swapping, its forward reads the "
                            f"spatial extents of a split activation, and {where} it fails "
                            f"({type(err).__name__}: {err}); make the forward traceable by torch.fx, or "
                            f"independent of the input's extents") from None
        for k, (a, b) in enumerate(itertools.zip_longest(whole.calls, part.calls)):
            if a != b:
                line = whole.lines[k] if k < len(whole.lines) else part.lines[k]
                raise SpecError(
                    f"model ({type(model).__name__}): run by module swapping, its forward reads the spatial "
                    f"extents of a split activation and computes something else {where}: at {line} the "
                    f"volume runs {_show(a)}, the shard {_show(b)}. Branch on configuration rather than "
                    f"on extents, or make the forward traceable by torch.fx (a traced forward reads the "
                    f"volume's extents)")
