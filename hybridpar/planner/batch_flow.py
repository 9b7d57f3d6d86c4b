"""Python control flow on the batch's extent, in a forward whose batch data parallelism or
micro-batches hold in parts.

Why: each part runs the forward on its own samples, and its shape reads answer its own extent
(``x.shape[0]``). A loop over it (``for i in range(x.shape[0])``) or a branch on it runs another program
on a part than one process runs on the whole batch: a value made from the loop's index
(``torch.tensor(float(i + 1))``, the i-th row of a table) is the sample's place in its part, which no
tag on the extent can follow (``range`` makes plain ints; :mod:`hybridpar.planner.batch_extent` follows
the extent itself). A value Python makes of the extent gives a part the same calls given other numbers
(``2.0 if x.shape[0] == 4 else 1.0``, ``min(n, 3)``, ``int(n)``, ``0.9 ** n``, ``math.log(n)``), which
no tag follows either, and so does one choosing a weight, a layer or a value computed beside another
(``self.c1 if n > 2 else self.c2``). Such a forward is found by running it on the meta device on the
whole batch and on a part's: where its calls, or what they are given (numbers, the model's weights by
name, tensors by the call that made them), differ, it is refused, naming the first that does; a size
given to the batch's dim (``h.view(n, -1)``, ``x.new_zeros(x.shape)``) is each part's own, as one
process sizes it.
"""

from __future__ import annotations

import array
import contextlib
import functools
import hashlib
import types
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn.meta import OnMeta, meta_state, meta_stop, run_unseen
from hybridpar.nn.torch_args import complete
from hybridpar.planner import applied, batch_extent, per_sample
from hybridpar.planner.elementwise import name_of
from hybridpar.planner.terms import SpecError
from hybridpar.user_lines import caller, in_torch_layer, line_of


class _Recorded(OnMeta):
    """A run on the meta device that records each call: its name, line and what it was given, as
    :func:`_plain` says (a torch layer's own calls, a GRU's initial state sized by its batch: which tensors
    alone, since what a layer does across the samples is ``samples.module_across``'s to say)."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names  # id of a tensor of the model's state -> "@" and its name
        self.made = WeakIdKeyDictionary()  # a tensor -> "#k.j": output j of call k made it
        self.record: list[tuple[str, str, Any]] = []

    def _tag(self, t: torch.Tensor) -> Any:
        """A tensor as two runs tell it apart: a name (a weight's, the input's), the call that made it,
        or its content (a tensor the forward reads from elsewhere, a table kept at module level, which
        NumPy may have written: ``torch.from_numpy(a)``); a meta tensor of neither by the object it is."""
        named = self.names.get(id(t)) or self.made.get(t)
        if named or t.device.type == "meta":
            return named or f"@object {id(t)}"
        with torch._C.DisableTorchFunction():
            return "@", tuple(t.shape), str(t.dtype), _digest(t.detach().cpu().contiguous().reshape(-1))

    def layer(self, m: nn.Module, args: tuple) -> None:
        """A torch layer called: recorded with its settings (a bound set in the forward,
        ``nn.Hardtanh(-k, k)``), since its own calls are recorded by their tensors alone."""
        if type(m).__module__.startswith("torch.nn."):
            settings = {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
            self.record.append((type(m).__name__, caller(), _plain(settings, self._tag)))

    def applied(self, cls: type, apply: Any, args: tuple, kwargs: dict) -> Any:
        """An autograd.Function of the user's applied: recorded with what it was given (a number its
        backward reads from ``ctx``), then applied as it is."""
        self.record.append((f"{cls.__qualname__}.apply", caller(), _plain((args, kwargs), self._tag)))
        return applied.PASS

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = complete(func, kwargs or {})
        given = _plain((args, kwargs), self._tag)
        if in_torch_layer():  # its tensors alone: the numbers it makes of its input's shape are its own
            given = tuple(n for n in _leaves(given) if isinstance(n, str) and n[:1] in ("@", "#"))
        if per_sample.draws(name_of(func)):  # the global generator's state: seeded in the forward?
            given = (given, _digest(torch.random.get_rng_state()))
        self.record.append((name_of(func), caller(), given))
        made = len(self.record)
        out = super().__torch_function__(func, types, args, kwargs)
        for j, t in enumerate(tree_leaves(out)):
            if isinstance(t, torch.Tensor) and t not in self.made:  # in place: made where it was first
                self.made[t] = f"#{made}.{j}"
        return out


def _digest(data: torch.Tensor | np.ndarray) -> str:
    """Content as a short string: a tensor's bytes (1-D, contiguous, on the CPU) or an array's."""
    raw = data.view(torch.uint8).numpy() if isinstance(data, torch.Tensor) else np.ascontiguousarray(data)
    return hashlib.sha1(raw.tobytes()).hexdigest()[:12]


_PLAIN = (int, float, complex, str, slice, torch.dtype, torch.device, torch.memory_format, type(None))


def _plain(value: Any, tag: Callable[[torch.Tensor], Any], depth: int = 0) -> Any:
    """What a call was given, containers as tuples (a ``torch.Size`` too), so that two runs' arguments
    compare by value: numbers (a ``Fraction``, a class with ``__float__``), dtypes, slices, ranges, arrays
    (NumPy's, Python's, bytes) and generators' states by content; a function by its name and what its
    closure and defaults hold (a gradient hook's ``lambda g: g * n``); a tensor by ``tag`` (a weight's
    name, the call that made it); any other object by its type's name."""
    if isinstance(value, torch.Tensor):
        return tag(value)
    if isinstance(value, _PLAIN) or value is Ellipsis:
        return value
    if isinstance(value, list | tuple):
        return tuple(_plain(v, tag, depth) for v in value)
    if isinstance(value, dict):
        return tuple((k, _plain(v, tag, depth)) for k, v in value.items())
    deeper = lambda v: _plain(v, tag, depth + 1) if depth < 4 else type(v).__name__  # noqa: E731 (closures)
    if isinstance(value, range):  # torch.tensor(range(n))
        return ("range", value.start, value.stop, value.step)
    if isinstance(value, np.ndarray | np.generic | array.array | bytes | bytearray | memoryview):
        a = np.frombuffer(value, np.uint8) if isinstance(value, bytes | bytearray) else np.asarray(value)
        return (type(value).__name__, a.shape, a.dtype.str, _digest(a))  # by content: np.arange(n)
    if isinstance(value, torch.Generator):  # seeded in the forward, torch.Generator().manual_seed(n)
        return ("Generator", str(value.device), _digest(value.get_state()))
    if isinstance(value, functools.partial):
        return ("partial", deeper(value.func), deeper(value.args), deeper(value.keywords))
    if isinstance(value, types.FunctionType):
        cells = []
        for cell in value.__closure__ or ():
            with contextlib.suppress(ValueError):  # a cell not yet filled
                cells.append(cell.cell_contents)
        return ("function", value.__qualname__, deeper(tuple(cells)), deeper(value.__defaults__ or ()))
    with contextlib.suppress(Exception):  # a number of another class: Fraction(n, 4), Decimal
        return (type(value).__name__, float(value))
    return type(value).__name__


def _calls(model: nn.Module, input_shape: Sequence[int], nested: bool) -> list[tuple[str, str, Any]]:
    """What the forward calls on a batch of ``input_shape``: each call's name, line and what it was
    given (:class:`_Recorded`), in order."""
    state, dtype = meta_state(model, grads=True)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if nested:  # as the watched run: a layer's output in training
        x = x.requires_grad_().clone()
    names = {id(t): f"@{k}" for k, t in reversed(state.items())}  # tied weights: the first name
    run = _Recorded({**names, id(x): "@input"})
    hook = torch.nn.modules.module.register_module_forward_pre_hook(run.layer)
    try:
        with torch.random.fork_rng(devices=[]), applied.watching(run.applied):  # each run from one state
            run_unseen(model, state, (x,), run)
    finally:
        hook.remove()
    return run.record


def _leaves(value: Any) -> list[Any]:
    return [leaf for v in value for leaf in _leaves(v)] if isinstance(value, tuple) else [value]


def _sized_alike(whole: tuple[str, str, Any], part: tuple[str, str, Any], sizes: tuple[int, int],
                 followed: Collection[tuple[str, str, int]]) -> bool:
    """Whether a call's arguments on the whole batch (``whole``) and on a part differ only in the size
    they give the batch's dim, in proportion to ``sizes`` (the whole batch's, the part's): ``h.view(n,
    -1)``, or a fold of other dims into it, ``h.reshape(n * d, c, hh, w)``; and that size the batch's
    extent as a watch followed it (``followed``: name, line and size on the whole batch). A size Python
    made of it (``torch.ones(int(n))``) gives a tensor along the part's samples that no call after it is
    judged on: not alike."""
    name = whole[0]
    if name not in batch_extent.SIZED:
        return False
    leads = tuple((batch_extent.sizes_of(name, *run[2]) or [None])[0] for run in (whole, part))
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in leads) or \
            leads[0] * sizes[1] != leads[1] * sizes[0] or (*whole[:2], leads[0]) not in followed:
        return False
    a, b = _leaves(whole[2]), _leaves(part[2])
    return len(a) == len(b) and [(x, y) for x, y in zip(a, b) if x != y] == [leads]


def _differs(whole: tuple[str, str, Any], part: tuple[str, str, Any], sizes: tuple[int, int],
             followed: Collection[tuple[str, str, int]]) -> bool:
    """Whether two runs' calls differ: another call, or other arguments (:func:`_sized_alike` excepted)."""
    return whole[:2] != part[:2] or whole[2] != part[2] and not _sized_alike(whole, part, sizes, followed)


def _said(call: tuple[str, str, Any] | None) -> str:
    if call is None:
        return "nothing more"
    numbers = [v for v in _leaves(call[2]) if isinstance(v, int | float | str) and not isinstance(v, bool)]
    return f"{call[0]}" + (f"({', '.join(map(repr, numbers))})" if numbers else "") + f" at {call[1]}"


def refuse_batch_flow(model: nn.Module, input_shape: Sequence[int], part: int, nested: bool,
                      followed: Collection[tuple[str, str, int]]) -> None:
    """Refuse ``model``'s forward where it calls other functions on a part's ``part`` samples than on
    the batch of ``input_shape`` (``nested``: a block of a traced graph, its input a layer's output;
    ``followed``: the sized calls given the batch's extent, :meth:`BatchReads.followed`)."""
    try:
        whole = _calls(model, input_shape, nested)
        parts = _calls(model, (part, *input_shape[1:]), nested)
    except Exception as err:  # noqa: BLE001 - the forward's own error, named in the refusal
        why = (meta_stop(err) or (f"{type(err).__name__}: {err}",))[0]
        raise SpecError(f"model ({type(model).__name__}): its forward fails on a part of the batch, "
                        f"{part} of {input_shape[0]} samples, as data parallelism or micro-batches run it "
                        f"(at {line_of(err)}: {why})") from None
    sizes = (input_shape[0], part)
    k = next((i for i, (a, b) in enumerate(zip(whole, parts)) if _differs(a, b, sizes, followed)),
             min(len(whole), len(parts)))
    if k == len(whole) == len(parts):
        return
    said = [_said(calls[k] if k < len(calls) else None) for calls in (whole, parts)]
    raise SpecError(f"model ({type(model).__name__}): its forward runs other calls on a part of the batch "
                    f"than on the whole, as data parallelism or micro-batches run it (call {k + 1}: on "
                    f"{input_shape[0]} samples {said[0]}, on {part} {said[1]}): Python control flow on the "
                    f"batch's extent, a loop over range(x.shape[0]), a branch on it or a number made of it, "
                    f"gives each part what its own extent makes of it; compute on the whole batch "
                    f"(torch.arange, broadcasting) or use grid.data 1 and pipeline.microbatches 1")
