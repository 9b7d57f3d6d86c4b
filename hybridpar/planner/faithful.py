"""Is a traced graph the model's forward? The two are run on the meta device and their operations compared.

Why: ``torch.fx`` records the tensor operations a forward makes on proxies, and evaluates everything
else once, at trace time. A Python-level check on a traced value (``isinstance(e, torch.Tensor)``,
``torch.jit.isinstance``, ``hasattr``, a comparison that a proxy answers with a constant) is fixed
then, so the graph may take a branch the eager model never takes, and nothing fails: the model would
train, split, on a function other than its own. Each run here records every ATen operation (its
name, in-place or not alike, the shapes and dtypes of its tensor arguments and its other arguments)
on meta tensors: no memory is allocated and no FLOP is spent, whatever the volume. The graph's run
replays the same leaf modules in the same order, so a faithful graph makes exactly the operations
the forward makes; the first one that differs names the node where they part.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn.meta import CarriedState, exact_operations, meta_call, meta_state
from hybridpar.planner.graph import OUTPUT, GraphRunError, ModelGraph, UntraceableError, trace_values
from hybridpar.planner.terms import SpecError

_WHY = ("a Python check on a traced value, such as isinstance, torch.jit.isinstance or hasattr, was fixed "
        "at trace time")
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _summary(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype)
    return v if isinstance(v, _PLAIN) else type(v).__name__


class _Ops(TorchDispatchMode):
    """Records ``(operation, where)`` for each ATen call; ``where()`` says which node is running. Also,
    by the operation's index: which write in place (``written``), which write a tensor that shares
    memory with another read after the write (``aliased``: a view, or a value a view was taken of), and
    of those which share it with a tensor made before the node that writes began (``outside``: a layer
    writing its input, not a scratch tensor of its own)."""

    def __init__(self, where: Callable[[], str]) -> None:
        super().__init__()
        self.where = where
        self.ops: list[tuple[tuple, str]] = []
        self.written: set[int] = set()
        self.aliased: set[int] = set()
        self.outside: set[int] = set()
        self._made = WeakIdKeyDictionary()  # every tensor made, still alive -> the operation that made it
        self._shared = WeakIdKeyDictionary()  # one sharing memory with a written one -> (the write, outside)
        self._node, self._start = "", 0  # the node running, and its first operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        i, here = len(self.ops), self.where()
        if here != self._node:
            self._node, self._start = here, i
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and t in self._shared:
                write, outside = self._shared[t]
                self.aliased.add(write)
                if outside:
                    self.outside.add(write)
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if target is not None and _writes(func):
            self.written.add(i)
            self._shared.update((t, (i, made < self._start)) for t, made in self._made.items()
                                if t is not target and torch._C._is_alias_of(t, target))
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t not in self._made:
                self._made[t] = i
        self.ops.append(((_name(func), tree_map(_summary, (args, kwargs)), tree_map(_summary, out)), here))
        return out


def _writes(func: Any) -> bool:
    packet = func.overloadpacket.__name__
    return packet.endswith("_") and not packet.endswith("__")


def _name(func: Any) -> str:
    """The operation's name, its in-place and out-of-place variants alike: fx records ``x += y`` as
    ``x + y`` (the values agree unless another name of ``x`` is read after it)."""
    packet = func.overloadpacket.__name__
    if packet.endswith("_") and not packet.endswith("__"):
        packet = packet[:-1]
    return f"{func.namespace}.{packet}.{func._overloadname}"


def _eager_ops(model: nn.Module, x: torch.Tensor, state: dict[str, torch.Tensor]) -> _Ops:
    mode = _Ops(lambda: "")
    with mode, exact_operations():
        meta_call(model, state, x)
    return mode


def _graph_ops(graph: ModelGraph, input_shape: tuple[int, ...], kind: str) -> _Ops:
    modes: list[_Ops] = []

    def watch(where: Callable[[], str]) -> _Ops:
        modes.append(_Ops(where))
        return modes[-1]

    try:  # the run that also gives the plan its traced values (trace_values keeps them)
        with exact_operations():
            trace_values(graph, input_shape, watch)
    except GraphRunError as err:  # the forward ran: the graph is not the forward
        raise UntraceableError(f"model ({kind}): torch.fx traced a graph that computes something other than "
                               f"its forward: the forward runs on this input, the graph fails at node "
                               f"{err.node} ({err.cause}; {_WHY})") from None
    return modes[0]


def check_faithful(graph: ModelGraph, model: nn.Module, input_shape: tuple[int, ...]) -> None:
    """Raise :class:`UntraceableError` naming the first node where ``graph`` computes something other
    than ``model``'s forward on a global input of ``input_shape`` (checked once per shape)."""
    if input_shape in graph.faithful_for:
        return
    state, dtype = meta_state(model)
    x = torch.empty(input_shape, device="meta", dtype=dtype)
    try:
        eager_run = _eager_ops(model, x, state)
    except CarriedState as err:  # state no graph keeps (a counter bumped, a tensor left on the model)
        raise SpecError(str(err)) from None
    except Exception:  # the forward itself fails on this shape: the trace of values says where
        return
    kind = type(model).__name__
    graph_run = _graph_ops(graph, input_shape, kind)
    eager, traced = eager_run.ops, graph_run.ops
    layers = {n.name for n in graph.nodes if n.op == "module"}  # a layer's write of its input: not a node
    for i, (want, got) in enumerate(zip(eager, traced)):
        if want[0] != got[0]:
            raise UntraceableError(
                f"model ({kind}): torch.fx traced a graph that computes something other than its forward: "
                f"at node {got[1]} the forward's operation {i + 1} is {want[0][0]} where the graph's is "
                f"{got[0][0]} ({_WHY})")
        dropped = i in eager_run.aliased and i not in graph_run.written  # fx made a write a new value
        if dropped or i in graph_run.outside and got[1] in layers:
            raise UntraceableError(
                f"model ({kind}): torch.fx traced a graph that computes something other than its forward: "
                f"at node {got[1]} the forward writes {want[0][0]} in place into a tensor that shares memory "
                f"with another read after it (w = h[:, :, a:b]; w += 1, or a layer writing its input), where "
                f"the graph computes a new value (fx records w += 1 as w + 1), so the other misses the write")
    if len(eager) != len(traced):
        more = len(eager) > len(traced)
        longer, node = ("forward", "the graph's end") if more else ("graph", traced[len(eager)][1])
        raise UntraceableError(
            f"model ({kind}): torch.fx traced a graph that computes something other than its forward: the "
            f"{longer} makes {abs(len(eager) - len(traced))} more operation(s), from {node} on ({_WHY})")
    values = graph.traced[tuple(input_shape)]
    for n in graph.nodes:
        v = values[n.name]
        if n.name != OUTPUT and not isinstance(v, torch.Tensor) and not shape_value(v):
            raise untraced_value(kind, n.name, n.kind, v)
    graph.faithful_for.add(input_shape)


def shape_value(v: object) -> bool:
    """Sizes, extents, ranks, and what arithmetic makes of them (what a forward computes from shapes)."""
    if isinstance(v, list | tuple):
        return all(shape_value(e) for e in v)
    return isinstance(v, int | float | bool | torch.dtype | torch.device) or v is None


def untraced_value(model: str, name: str, kind: str, value: object) -> UntraceableError:
    """A node whose value is neither a tensor nor computed from shapes (``torch.max(x, 1)``'s values and
    indices, ``x.chunk(2, 1)``'s tensors): the traced plan places tensors, one per node, so the model's
    own forward runs split by module swapping, which follows such calls (or refuses them by name)."""
    return UntraceableError(f"model ({model}): {name} ({kind}) returns {type(value).__name__}, "
                            f"not a tensor or a value computed from shapes, between layers")
