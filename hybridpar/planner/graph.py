"""A model as a graph of layers: traced once by ``torch.fx``, in forward order, with each node's inputs.

Why: the planner and the engine must see skip connections (``x + f(x)``, ``torch.cat([skip, up], 1)``)
to split encoder-decoder networks and residual blocks, not only chains of children. ``torch.fx`` gives
the data flow of any forward without data-dependent control flow; a ``nn.Sequential`` traces to the
chain of its leaves, so sequences are the simplest graphs and need nothing else.

Which modules are nodes (run as one layer) and which are traced into:

* a module with an entry in :mod:`hybridpar.nn.registry` (every torch layer the library knows, and the
  user's registered layers) is a node;
* a module without children, or one that holds parameters or buffers of its own, is a node (it runs
  whole, replicated, unless registered);
* containers (``nn.Sequential``, and custom modules made of children: residual blocks, U-Net levels)
  are traced into; one whose forward cannot be traced is one node, which runs split by module
  swapping inside it, its shape reads answering with global extents as a traced graph's do
  (:mod:`hybridpar.pipeline.split_forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from hybridpar.call_keys import call_key, call_path
from hybridpar.nn import registry
from hybridpar.nn.meta import containers, message, meta_call, meta_state, meta_stop, put_back_contents
from hybridpar.planner import in_place, root_args, trace_state
from hybridpar.planner.layer_hooks import positional
from hybridpar.planner.terms import SpecError
from hybridpar.user_lines import caller, line_of

INPUT = "(input)"
OUTPUT = "(output)"  # the node that puts together a forward's tuple, list or dict of outputs
SUPPORTED = ("supported: a forward that torch.fx can trace (no branches or loops on tensor values), one "
             "tensor in (other arguments left at their defaults), and a tensor or a tuple, list or dict of "
             "tensors out; modules whose forward cannot be traced run whole as one layer")


def out_node(graph: ModelGraph) -> Node:
    """The node whose value the model returns."""
    return next(n for n in reversed(graph.nodes) if n.name == graph.output)


def pack_output(structure: Any) -> Any:
    """The forward's outputs in the structure it returned them in (fx's immutable containers made
    plain lists and dicts again)."""
    if isinstance(structure, tuple):
        return tuple(pack_output(v) for v in structure)
    if isinstance(structure, list):
        return [pack_output(v) for v in structure]
    if isinstance(structure, dict):
        return {k: pack_output(v) for k, v in structure.items()}
    return structure


class UntraceableError(SpecError):
    """torch.fx cannot follow the model's forward (without a pipeline it runs by module swapping)."""


def refuse_in_pipeline(err: UntraceableError, pipe: int) -> None:
    """Refuse a model torch.fx cannot trace (``err`` says why) in a pipeline of ``pipe`` stages: a pipeline
    cuts the traced graph; without one the model runs by module swapping."""
    if pipe != 1:
        raise SpecError(f"{err}. A pipeline cuts the traced graph; without one (pipe: 1) such a model "
                        f"runs by module swapping") from None


@dataclass(frozen=True)
class Node:
    """One call in forward order: a module (``op == "module"``, ``target`` its qualified name, and
    ``name`` too, with ``#k`` appended for its k-th further call: :mod:`hybridpar.call_keys`) or a
    function or tensor method (``name`` the fx node's name). ``inputs`` names the producers of its tensor
    arguments in argument order (:data:`INPUT` for the model input)."""

    name: str
    op: str
    target: Any
    module: nn.Module | None
    inputs: tuple[str, ...]
    fx_node: fx.Node

    @property
    def kind(self) -> str:
        """Type name for tables: the module's class, or the function's name."""
        if self.module is not None and self.op == "module":
            return type(self.module).__name__
        if isinstance(self.target, str):
            return self.target
        return getattr(self.target, "__name__", str(self.target))


@dataclass
class ModelGraph:
    """The traced model: ``nodes`` in forward order, the fx graph module they come from (sharing the
    model's submodules), the node whose value the model returns, and the first node of each container."""

    gm: fx.GraphModule
    nodes: list[Node]
    output: str
    containers: dict[str, int]
    faithful_for: set[tuple[int, ...]] = field(default_factory=set)  # input shapes checked (spec/faithful)
    values: set[str] = field(default_factory=set)  # nodes whose value is not a tensor (analysis.node_shapes)
    traced: dict[tuple[int, ...], dict[str, Any]] = field(default_factory=dict)  # trace_values per shape
    training: bool = True  # the mode the model was traced in
    mode_dependent: bool = False  # its forward traces otherwise in the other mode (``if self.training``)
    attributes: tuple[trace_state.TracedAttribute, ...] = ()  # plain attributes the graph holds (trace_state)
    kind: str = ""  # the model's class name, for messages

    @property
    def chain(self) -> bool:
        """Whether every node consumes exactly the previous node's output (a sequence)."""
        prevs = [INPUT, *(n.name for n in self.nodes)]
        return all(n.inputs == (p,) for n, p in zip(self.nodes, prevs)) and self.output == prevs[-1]

    def index(self) -> dict[str, int]:
        return {n.name: i for i, n in enumerate(self.nodes)}


class _Tracer(fx.Tracer):
    """fx tracer with the node rule of the module doc; remembers where tracing was when it failed."""

    def __init__(self, traceable: dict[int, bool] | None = None) -> None:
        super().__init__()
        self.stack: list[str] = []
        # whether each block of the user's traces, shared with the trial traces of blocks it holds:
        # each block tried once, not once more for every block around it
        self._traceable: dict[int, bool] = {} if traceable is None else traceable

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        """fx's node, with the user's line that made it (``meta["line"]``, for what the planner refuses
        there), read off the live stack: fx's ``record_stack_traces`` formats the whole stack per node."""
        node = super().create_node(*args, **kwargs)
        node.meta["line"] = caller()
        return node

    def path_of_module(self, mod: nn.Module) -> str:  # a name outside any parametrization, or none
        if "parametrizations" in (path := call_path(self.root, mod, super().path_of_module(mod))).split("."):
            raise UntraceableError(f"{path}: a layer called that only a parametrization holds")
        return path

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, nn.Sequential | nn.ModuleList | nn.ModuleDict):
            return False
        if registry.lookup(m) is not None or not any(True for _ in m.children()):
            return True
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            return True
        if type(m).__module__.startswith("torch.nn"):
            return super().is_leaf_module(m, qualname)
        if id(m) not in self._traceable:
            try:
                _Tracer(self._traceable).trace(m)
                self._traceable[id(m)] = True
            except Exception:  # a forward fx cannot trace: the module runs whole
                self._traceable[id(m)] = False
        return not self._traceable[id(m)]

    def trace(self, root: Any, concrete_args: dict[str, Any] | None = None) -> fx.Graph:
        """fx's trace, refused where the forward sets or reads grad mode or applies an autograd.Function
        of its own, which no graph records (:mod:`hybridpar.planner.trace_state`; a child's forward
        that does is kept whole), its in-place operations made explicit (:mod:`.in_place`)."""
        before = {(m, k): v for m in root.modules() for k, v in vars(m).items()} \
            if isinstance(root, nn.Module) else {}
        held = containers(root) if isinstance(root, nn.Module) else {}
        try:
            with trace_state.watched_trace() as seen:
                graph = super().trace(root, concrete_args)
        finally:
            kept = _put_back_proxies(root, before)
            kept = kept or next((k for _, k in put_back_contents(held)), None)  # self.terms.append(h)
        if kept:
            raise SpecError(f"its forward keeps a tensor in self.{kept}, which a traced graph cannot "
                            f"carry from one call to the next")
        trace_state.refuse_grad_mode(seen)
        in_place.make_explicit(graph, root)
        return graph

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        self.stack.append(self.path_of_module(m))
        if kwargs:  # conv(input=h) recorded as conv(h): a layer's split counterpart takes it by position
            args, kwargs = positional(type(m).forward, args, kwargs)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self.stack.pop()


def _put_back_proxies(root: Any, before: dict[tuple[nn.Module, str], Any]) -> str | None:
    """Undo what a trace stored in plain attributes (``self.prev = h``: an fx Proxy, which a later
    trace would read as a value of another graph); the first such attribute's name, or None."""
    if not isinstance(root, nn.Module):
        return None
    kept = None
    for m in root.modules():
        for k, v in list(vars(m).items()):
            if isinstance(v, fx.Proxy):
                kept = kept or k
            if (m, k) not in before:
                if isinstance(v, fx.Proxy):  # not the tracer's own (_tensor_constant0: the graph reads it)
                    delattr(m, k)
            elif v is not before[(m, k)]:  # a proxy, or a counter the trace bumped (self.calls += 1)
                setattr(m, k, before[(m, k)])
        for k in [k for mod, k in before if mod is m and k not in vars(m)]:
            setattr(m, k, before[(m, k)])  # deleted by the forward
    return kept


def trace(model: nn.Module) -> ModelGraph:
    """Trace ``model`` into a :class:`ModelGraph`; raises :class:`SpecError` naming where it failed."""
    for name, m in model.named_modules():
        if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params():
            becomes = type(m).cls_to_become.__name__
            raise SpecError(f"model: {name} ({type(m).__name__}) has parameters not yet materialised (a lazy "
                            f"module): run the model once on a small input of its channels first, e.g. "
                            f"model(torch.zeros(1, C, 8, 8, 8)), which makes it a {becomes}")
    tracer = _Tracer()
    fixed = root_args.defaults(model)
    before = set(vars(model))
    try:
        with trace_state.attribute_reads(model) as reads:
            graph = tracer.trace(model, fixed or None)
    except Exception as err:
        trace_state.forget_constants(model, before)
        where = tracer.stack[-1] if tracer.stack else "the model's own forward"
        raise UntraceableError(f"model ({type(model).__name__}): torch.fx cannot trace {where}: "
                        f"{type(err).__name__}: {err}; {SUPPORTED}") from None
    root_args.strip(graph, fixed)
    gm = fx.GraphModule(model, graph)
    trace_state.forget_constants(model, before)
    nodes: list[Node] = []
    produced: dict[fx.Node, str] = {}
    calls: dict[str, int] = {}  # a module without weights may be called more than once (a shared ReLU)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise SpecError(f"model ({type(model).__name__}): forward takes {len(placeholders)} inputs; "
                        f"{SUPPORTED}")
    produced[placeholders[0]] = INPUT
    output = None
    for n in graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr":
            # a parameter or buffer read between layers (``h * self.gamma``): the graph has no layer to
            # split it with, so the model's own forward runs split by module swapping, which follows it
            what = "a tensor it made while traced (a constant, or a buffer it rebinds)" \
                if str(n.target).startswith("_tensor_constant") else str(n.target)  # fx's own name
            raise UntraceableError(f"model ({type(model).__name__}): its forward reads {what} "
                                   f"directly, outside any layer; {SUPPORTED}")
        if n.op == "output":
            out = n.args[0]
            if isinstance(out, fx.Node):
                output = produced[out]
                continue
            leaves: list[Any] = []
            fx.node.map_aggregate(out, leaves.append)
            if not leaves or not all(isinstance(v, fx.Node) and v in produced for v in leaves):
                raise SpecError(f"model ({type(model).__name__}): forward returns {type(out).__name__} "
                                f"holding values other than the tensors it computed; {SUPPORTED}")
            nodes.append(Node(OUTPUT, "function", pack_output, None, tuple(produced[v] for v in leaves), n))
            output = OUTPUT
            continue
        inputs = tuple(produced[a] for a in n.all_input_nodes if a in produced)
        if n.op == "call_module":
            target, module = str(n.target), gm.get_submodule(str(n.target))
            if registry.users_own(module) and len(n.all_input_nodes) > 1:
                # a block of the user's kept whole (``up(h, skip)`` with a shape check inside) reads
                # several activations: the model's own forward runs split, the block's calls followed
                raise UntraceableError(f"model ({type(model).__name__}): {target} "
                                       f"({type(module).__name__}) is a block of its own that torch.fx "
                                       f"keeps whole and that reads {len(n.all_input_nodes)} values; "
                                       f"{SUPPORTED}")
            calls[target] = calls.get(target, 0) + 1
            if calls[target] > 1 and any(True for _ in module.parameters()):
                # a shared MLP (CBAM's, on the average- and the max-pooled features): the graph plans a
                # split per call, not weights shared between two; the model's own forward runs split
                # by module swapping, where the module is one layer called twice, as in torch
                raise UntraceableError(f"model ({type(model).__name__}): module {target} "
                                       f"({type(module).__name__}) is called more than once in forward, "
                                       f"its weights shared between the calls; {SUPPORTED}")
            name = call_key(target, calls[target] - 1)
            nodes.append(Node(name, "module", target, module, inputs, n))
        else:
            op = "method" if n.op == "call_method" else "function"
            nodes.append(Node(n.name, op, n.target, _stand_in(n) if op == "function" else None, inputs, n))
        produced[n] = nodes[-1].name
    if not nodes:
        raise SpecError("model: the model has no layers")
    containers: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.op != "module":
            continue
        parts = node.target.split(".")
        for k in range(1, len(parts)):
            containers.setdefault(".".join(parts[:k]), i)
    return ModelGraph(gm, nodes, output or nodes[-1].name, containers, training=model.training,
                      kind=type(model).__name__,
                      mode_dependent=_mode_dependent(model, graph),
                      attributes=trace_state.traced_attributes(model, reads))


def _mode_dependent(model: nn.Module, graph: fx.Graph) -> bool:
    """Whether ``model``'s forward traces to another graph with every module's ``training`` flipped (a
    forward that branches on ``self.training``: noise added in training, deep supervision's extra
    outputs); the flags are put back as they were, module by module."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        for m, t in flags:
            m.training = not t
        fixed = root_args.defaults(model)
        other = _Tracer().trace(model, fixed or None)
        root_args.strip(other, fixed)
    except Exception:  # the other mode does not trace: it cannot be the traced graph's
        return True
    finally:
        for m, t in flags:
            m.training = t
    return str(other) != str(graph)


def _stand_in(n: fx.Node) -> nn.Module | None:
    """The module a function call stands for (``F.interpolate`` -> ``nn.Upsample``), or None."""
    if _computed((tuple(n.args[1:]), dict(n.kwargs))):
        return None  # arguments computed in the forward: see stand_ins_from_values
    return _stand_in_of(n, tuple(n.args), dict(n.kwargs))


def _stand_in_of(n: fx.Node | Node, args: tuple, kwargs: dict) -> nn.Module | None:
    target = n.target
    try:
        return registry.function_module(target, args, kwargs)
    except (TypeError, ValueError, NotImplementedError) as err:
        raise SpecError(f"{n.name}: {getattr(target, '__name__', target)}{tuple(args[1:])}: {err}") from None


def stand_ins_from_values(graph: ModelGraph, values: dict[str, Any]) -> None:
    """Give a function call whose arguments were computed from shapes (``F.interpolate(x,
    size=skip.shape[2:])``) the module it stands for, those arguments taken at their global values
    (``values``, the trace on the global input): a shape read answers with global extents."""
    name_of = {n.fx_node: n.name for n in graph.nodes}

    def known(a: fx.Node) -> Any:
        name = name_of.get(a)
        return values[name] if name in graph.values else a

    for i, n in enumerate(graph.nodes):
        if n.op != "function" or not n.fx_node.args:  # a stand-in of another size's values is redone
            continue
        rest, kwargs = tuple(n.fx_node.args[1:]), dict(n.fx_node.kwargs)
        if not _computed((rest, kwargs)):
            continue  # fixed arguments: trace gave it its stand-in, if it has one
        rest, kwargs = fx.node.map_arg(rest, known), fx.node.map_arg(kwargs, known)
        if not _computed((rest, kwargs)):  # what is still computed comes from tensors' values
            module = _stand_in_of(n, (n.fx_node.args[0], *rest), kwargs)
            graph.nodes[i] = dataclasses.replace(n, module=module)


def shape_made_stand_ins(graph: ModelGraph) -> dict[str, nn.Module | None]:
    """The stand-ins of the calls whose arguments the forward computes from shapes (``F.interpolate(x,
    size=skip.shape[2:])``, an odd-size guard's ``F.pad``), by node name, as the last analysis of
    ``graph`` set them (:func:`stand_ins_from_values`): they differ from one input size to another."""
    return {n.name: n.module for n in graph.nodes if n.op == "function" and n.fx_node.args
            and _computed((tuple(n.fx_node.args[1:]), dict(n.fx_node.kwargs)))}


def _computed(args: Any) -> bool:
    """Whether ``args`` (nested) hold a value computed in the forward (an fx node)."""
    found: list[fx.Node] = []
    fx.node.map_arg(args, found.append)
    return bool(found)


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, names: dict[fx.Node, str]) -> None:
        super().__init__(gm)
        self.names, self.values, self.current = names, {}, INPUT

    def run_node(self, n: fx.Node) -> Any:
        self.current = self.names.get(n, n.name)
        out = super().run_node(n)
        self.values[self.current] = out
        return out


class _Run(nn.Module):
    """Runs ``gm`` through a recorder, so that ``functional_call`` can swap the meta state into ``gm``
    (its parameters are this module's ``gm.*``) while the recorder interprets the graph."""

    def __init__(self, gm: fx.GraphModule, rec: _Recorder) -> None:
        super().__init__()
        self.gm, self.rec = gm, rec

    def forward(self, x: torch.Tensor) -> Any:
        return self.rec.run(x)


class GraphRunError(SpecError):
    """The traced graph failed on the meta device at ``node`` (``cause``, its first line)."""

    def __init__(self, message: str, node: str, cause: str) -> None:
        super().__init__(message)
        self.node, self.cause = node, cause


Watch = Callable[[Callable[[], str]], AbstractContextManager]  # where -> a context the graph runs under


def trace_values(graph: ModelGraph, input_shape: tuple[int, ...],
                 watch: Watch | None = None) -> dict[str, Any]:
    """Every node's output on the meta device for a global input of ``input_shape``: tensors (meta,
    shapes only) and the non-tensor values computed from them. Nothing is allocated or copied.
    Memoised per input shape on the graph; ``watch(where)`` runs the graph (again) under a context
    (a dispatch mode, :mod:`hybridpar.planner.faithful`), ``where()`` naming the node that runs."""
    shape = tuple(input_shape)
    if watch is None and shape in graph.traced:
        return graph.traced[shape]
    gm = graph.gm
    state, dtype = meta_state(gm)
    names = {n.fx_node: n.name for n in graph.nodes}
    names.update({n: INPUT for n in gm.graph.nodes if n.op == "placeholder"})
    rec = _Recorder(gm, names)
    x = torch.empty(shape, device="meta", dtype=dtype)
    try:
        with watch(lambda: rec.current) if watch is not None else contextlib.nullcontext():
            meta_call(_Run(gm, rec), {f"gm.{k}": v for k, v in state.items()}, x)
    except SpecError:
        raise
    except Exception as err:  # the user's model failed on this shape: say where
        stop = meta_stop(err)  # the plan's limit, not the model's: why, and what to do
        head = f"the model does not run on input shape {list(shape)}" if stop is None else \
            f"the plan's run on the meta device (shapes, no values) cannot follow it at {list(shape)}"
        line = line_of(err)  # in the user's code the node ran (a block's forward), else the node's own
        line = next((n.fx_node.meta.get("line", "?") for n in graph.nodes if n.name == rec.current), line) \
            if line == "?" else line
        why = f"{type(err).__name__}: {message(err)}" if stop is None else f"{stop[0]}; {stop[1]}"
        raise GraphRunError(f"{head}: at layer {rec.current} ({line}): {why}", rec.current,
                            f"{type(err).__name__}: {str(err).splitlines()[0]}") from err
    graph.traced[shape] = rec.values
    return rec.values

