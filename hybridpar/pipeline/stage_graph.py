"""One pipeline stage of a model graph: its nodes run in forward order on this rank's shards.

Why: a model with skip connections (a residual block, a U-Net's encoder features concatenated into
its decoder) is not a chain of layers, and a pipeline cut through it is crossed by several tensors:
the activation *and* every skip still to be read later (torchgpipe stashes and pops them;
``torch.distributed.pipelining`` splits traced graphs). This module runs the nodes of one stage with
their distributed counterparts, redistributes an input where its layout differs from the one its
reader computes in (elementwise ops and channel concatenation need agreeing shards), frees each value
after its last reader, and packs every value live across the stage's end into one flat tensor, so
that the engine moves one message per micro-batch and direction whatever the graph (its gradient is
one flat tensor too, and autograd follows the views).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hybridpar.axes import REPLICATED
from hybridpar.comm.redistribute import local_box
from hybridpar.comm.reduce import replicated_into_shards
from hybridpar.grid import ProcessGrid
from hybridpar.nn.layout import Redistribute
from hybridpar.pipeline.split_forward import reduce_over_volume
from hybridpar.planner import calls
from hybridpar.planner.elementwise import elementwise
from hybridpar.planner.graph import INPUT, ModelGraph, trace_values
from hybridpar.planner.placement import broadcasts
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.space_maps import RESHAPES, Form, find_space_maps, form_shape
from hybridpar.planner.stages import live_across
from hybridpar.planner.terms import SpecError

Split = tuple[int, int, int]


def batch_dims(graph: ModelGraph, input_shape: tuple[int, ...], names: Sequence[str]
               ) -> dict[str, tuple[int, ...]]:
    """The dims of each value ``names`` that grow with the batch, from its shapes traced at two batch
    sizes: dim 0 of an activation, dim 1 after ``torch.stack(feats, 0)``, none of a mean over every
    dim. A stage that receives a value sizes it by these for each micro-batch. Empty where the model
    does not run on twice the batch (then dim 0 is taken)."""
    once = trace_values(graph, input_shape)
    try:
        twice = trace_values(graph, (2 * input_shape[0], *input_shape[1:]))
    except SpecError:
        return {}
    return {n: tuple(d for d, (a, b) in enumerate(zip(once[n].shape, twice[n].shape, strict=True)) if a != b)
            for n in names if n != INPUT and isinstance(once[n], torch.Tensor)}


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Place ``module`` at dotted ``path`` under ``root`` (creating empty parents), so that the stage's
    state dict keys are the original model's."""
    *parents, leaf = path.split(".")
    node = root
    for p in parents:
        if not hasattr(node, p):
            node.add_module(p, nn.Module())
        node = getattr(node, p)
    node.add_module(leaf, module)


def _has_submodule(root: nn.Module, path: str) -> bool:
    try:
        root.get_submodule(path)
        return True
    except AttributeError:
        return False


class _Ref:
    """A node's value in an argument template."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _fill(template: Any, value: Callable[[_Ref], Any]) -> Any:
    """``template`` with every :class:`_Ref` replaced by ``value(ref)`` (in tuples, lists, dicts and
    slices, nested)."""
    if isinstance(template, _Ref):
        return value(template)
    if isinstance(template, tuple | list):
        return type(template)(_fill(t, value) for t in template)
    if isinstance(template, dict):
        return {k: _fill(v, value) for k, v in template.items()}
    if isinstance(template, slice):  # a bound read from a shape: ``h[:, :, :h.shape[2] // 2]``
        return slice(_fill(template.start, value), _fill(template.stop, value), _fill(template.step, value))
    return template


class StageGraph(nn.Module):
    """The nodes ``plan[lo:hi]`` of ``graph`` as this rank runs them (see the module doc).

    ``forward`` takes the model input (first stage) or the flat tensor the previous stage sent, and
    returns the flat tensor of the values live after ``hi`` or, on the last stage, the model output.
    """

    def __init__(self, graph: ModelGraph, plan: Sequence[LayerPlan], lo: int, hi: int,
                 input_shape: tuple[int, ...], input_split: Split, layout: Callable[[Split], ProcessGrid],
                 to_dist: Callable[[str, nn.Module, LayerPlan], nn.Module],
                 remake: Callable[[str, nn.Module, LayerPlan], nn.Module] | None = None) -> None:
        super().__init__()
        # the built stand-ins of calls (below), and per other size those whose shape-made arguments differ
        # there, each split by ``remake`` (which, unlike ``to_dist``, holds no reference to the model)
        self.built_stand_ins: dict[str, nn.Module] = {}
        self._remake, self._sized_stand_ins = remake, {}
        self.graph, self.lo, self.hi = graph, lo, hi
        self.n_nodes = len(graph.nodes)
        self.nodes = graph.nodes[lo:hi]
        self.layout = layout
        live = live_across(graph)
        self.recv = [INPUT] if lo == 0 else live[lo - 1]
        self.send = [graph.output] if hi == len(graph.nodes) else live[hi - 1]
        self.last = hi == self.n_nodes
        self.batch_dims = batch_dims(graph, tuple(input_shape), self.recv) if lo else {}
        self._recv_line: tuple[Any, int, int] = (None, 0, 1)  # bound size, elements fixed, per sample
        self.value_split: dict[str, Split] = {INPUT: input_split}
        for r in plan:
            self.value_split[r.name] = r.output_split
        # reshapes between channels and space that run on the shard: each node's form, its chain's input
        self.local_reshapes: dict[str, tuple[Form, str]] = {}
        self.bind(plan, input_shape)
        # Calls with their arguments' nodes replaced by names: no reference to the traced graph (and
        # through it to every stage's weights) is kept.
        name_of = {n.fx_node: n.name for n in graph.nodes}
        name_of.update({n: INPUT for n in graph.gm.graph.nodes if n.op == "placeholder"})
        ref = lambda a: _Ref(name_of[a])  # noqa: E731
        self.calls = [(n.name, n.op, n.target, n.inputs, fx.node.map_arg(n.fx_node.args, ref),
                       fx.node.map_arg(n.fx_node.kwargs, ref)) for n in self.nodes]
        self.pointwise = {n.name for n in self.nodes if elementwise(n.target)}  # operands broadcast
        # shape reads of split values answer with global extents (plan role "shape")
        self.shape_reads = {r.name for r in self.records if r.name in graph.values}
        maps = find_space_maps(graph, trace_values(graph, tuple(input_shape)))
        for node, rec in zip(self.nodes, self.records, strict=True):
            if node.name in maps and rec.split != (1, 1, 1) and node.target in RESHAPES:
                self.local_reshapes[node.name] = (maps[node.name].form(node.name), maps[node.name].source)
        self._bind_reshapes(plan, input_shape)
        # reductions over the volume of a split value: its global value on every rank (the plan's role)
        self.reductions: dict[str, calls.CallKind] = {}
        for node, rec in zip(self.nodes, self.records, strict=True):
            kind = calls.volume_reduction(node.target, node.fx_node.args, dict(node.fx_node.kwargs),
                                          len(rec.input_shape)) if node.module is None else None
            if kind is not None and rec.split != (1, 1, 1):
                self.reductions[node.name] = kind
        self.stand_ins = nn.ModuleDict()  # functions that run as layers (F.interpolate: an Upsample)
        for node, rec in zip(self.nodes, self.records, strict=True):
            if node.op == "module":
                if not _has_submodule(self, node.target):  # once per module, however often called
                    _set_submodule(self, node.target, to_dist(node.name, node.module, rec))
            elif node.module is not None and len(rec.input_shape) == 5:  # else the function itself
                self.stand_ins[node.name] = to_dist(node.name, node.module, rec)
        self.built_stand_ins = dict(self.stand_ins.items())
        del self.nodes, self.graph
        self._redistributes: dict[tuple, Redistribute] = {}
        # the last reader of every value within this stage (values sent on are never freed here)
        self.last_use: dict[str, int] = {}
        for i, call in enumerate(self.calls):
            for src in call[3]:
                self.last_use[src] = i

    def bind(self, plan: Sequence[LayerPlan], input_shape: tuple[int, ...],
             made: dict[str, nn.Module] | None = None) -> None:
        """Take every value's global shape from ``plan`` (for a global input of ``input_shape``), a plan
        of the built one's decisions: what the stage receives, sends and reads as shapes follows.
        ``made``: the stand-ins, at this size, of calls whose arguments the forward computes from
        shapes (an ``F.interpolate`` to a skip's size), where they differ from the built ones."""
        self._bind_reshapes(plan, input_shape)  # first: it may refuse the size
        self.records = list(plan[self.lo:self.hi])
        self.value_shape: dict[str, tuple[int, ...]] = {INPUT: tuple(input_shape)}
        for r in plan:
            self.value_shape[r.name] = tuple(r.output_shape)
        size = tuple(input_shape[1:])
        mine = {name: m for name, m in (made or {}).items() if name in self.built_stand_ins}
        if mine and size not in self._sized_stand_ins:
            assert self._remake is not None, "a stage graph bound at other sizes remakes its calls' layers"
            rows = {r.name: r for r in plan}
            self._sized_stand_ins[size] = {n: self._remake(n, m, rows[n]) for n, m in mine.items()}
        for name, built in self.built_stand_ins.items():
            self.stand_ins[name] = self._sized_stand_ins.get(size, {}).get(name, built)

    def _bind_reshapes(self, plan: Sequence[LayerPlan], input_shape: tuple[int, ...]) -> None:
        """This rank's extents of every local reshape's chain input at ``plan``'s size; ValueError
        where a reshape's form (taken at the build size) does not give its shape at this size."""
        rows = {r.name: r for r in plan}
        extents: dict[str, tuple[int, ...]] = {}
        for name, (form, source) in self.local_reshapes.items():
            shape = tuple(input_shape) if source == INPUT else tuple(rows[source].output_shape)
            if form_shape(form, shape[0], shape[2:]) != tuple(rows[name].output_shape):
                raise ValueError(f"{name}: the reshape between channels and space gives "
                                 f"{list(rows[name].output_shape)} at this size, not what it gave at the "
                                 f"build size in the same form; build an engine for this size")
            box = local_box(shape[2:], self.layout(self.value_split[source]))  # type: ignore[arg-type]
            extents[name] = tuple(hi - lo for lo, hi in box)
        self.reshape_extents = extents

    # ------------------------------------------------------------------ packing
    def local_shape(self, name: str, batch: int) -> tuple[int, ...]:
        """This rank's shape of value ``name`` for a micro-batch of ``batch`` samples: the dims that hold
        the samples (:func:`batch_dims`; dim 0 where not known) scaled from the bound size's batch."""
        shape = list(self.value_shape[name])
        for d in self.batch_dims.get(name, (0,) if shape else ()):
            shape[d] = shape[d] * batch // self.value_shape[INPUT][0]
        if len(shape) != 5 or self.value_split[name] == (1, 1, 1):
            return tuple(shape)
        box = local_box(tuple(shape[2:]), self.layout(self.value_split[name]))  # type: ignore[arg-type]
        return (shape[0], shape[1], *(b - a for a, b in box))

    def recv_numel(self, batch: int) -> int:
        """Elements of the flat tensor this stage receives for a micro-batch of ``batch`` samples."""
        return sum(math.prod(self.local_shape(n, batch)) for n in self.recv)

    def recv_batch(self, numel: int) -> int:
        """The micro-batch a received flat tensor of ``numel`` elements holds (values that do not carry
        the batch, a mean over everything, take the same elements whatever it is); the two sizes it
        solves from are kept per bound size, as each micro-batch asks."""
        size = self.value_shape[INPUT]
        if self._recv_line[0] != size:
            fixed = self.recv_numel(0)
            self._recv_line = (size, fixed, max(self.recv_numel(1) - fixed, 1))
        _, fixed, per_sample = self._recv_line
        return (numel - fixed) // per_sample

    def _unpack(self, flat: torch.Tensor, batch: int) -> dict[str, torch.Tensor]:
        shapes = [self.local_shape(n, batch) for n in self.recv]
        pieces = flat.split([math.prod(s) for s in shapes])
        return {n: p.view(s) for n, p, s in zip(self.recv, pieces, shapes, strict=True)}

    # ------------------------------------------------------------------ running
    def _global(self, out: Any, target: Any, src: str, args: tuple, kwargs: dict) -> Any:
        """A shape read (``target``) of value ``src`` as one process reads it: its spatial extents
        global (the batch this micro-batch's, the channels as they are)."""
        shape = self.value_shape.get(src, ())
        if len(shape) != 5 or self.value_split[src] == (1, 1, 1) or not isinstance(args[0], torch.Tensor):
            return out
        size = torch.Size((args[0].shape[0], args[0].shape[1], *shape[2:]))
        name = args[1] if target is getattr else calls.name_of(target)
        if name in ("shape", "nbytes", *calls.SHAPE_READS):  # x.shape, x.nbytes: getattr(x, name) in a graph
            return calls.answer_shape_read(name, args[:1] if target is getattr else args, kwargs, size)
        return out  # x.dim(), x.dtype: the same on every shard

    def _convert(self, value: Any, src: Split, dst: Split, shape: tuple[int, ...], pointwise: bool) -> Any:
        """``value`` (layout ``src``) in the layout ``dst`` its reader computes in (``pointwise``: an
        elementwise call, which broadcasts its operands against each other from their last dims)."""
        if not isinstance(value, torch.Tensor) or src == dst:
            return value
        if src == REPLICATED and (value.dim() != 5 or broadcasts(src, shape, dst)):
            # a whole value read by a split computation (a mean over every dim, a pooled gate, one slice):
            # its gradient the shards' parts summed; a volume cut to the shard's box where it spans it, as
            # is an operand of fewer dims an elementwise call lines up with D, H, W (a (D, 1, 1) coordinate)
            layout = self.layout(dst)
            value = replicated_into_shards(value, layout.spatial_group if layout.spatial_size > 1 else None)
            if value.dim() != 5 and not (pointwise and value.dim() > 0):
                return value
            extents = (1, 1, 1, *shape)[-3:]  # those of the dims lined up with D, H, W, 1 where it has none
            box = local_box(extents, layout)
            for k, ((lo, hi), extent, parts) in enumerate(zip(box, extents, dst, strict=True)):
                if parts > 1 and extent != 1 and hi - lo != extent:
                    value = value.narrow(value.dim() - 3 + k, lo, hi - lo)
            return value
        if value.dim() != 5:
            return value
        key = (src, dst, shape)
        if key not in self._redistributes:
            self._redistributes[key] = Redistribute(self.layout(src), self.layout(dst), shape[2:])
        return self._redistributes[key](value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lo == 0:
            env: dict[str, Any] = {INPUT: x}
            batch = x.shape[0]
        else:
            batch = self.recv_batch(x.numel())
            env = self._unpack(x.reshape(-1), batch)
        for i, ((name, op, target, inputs, args_t, kwargs_t), rec) in enumerate(
                zip(self.calls, self.records, strict=True)):
            def arg(ref: _Ref, rec: LayerPlan = rec, pointwise: bool = name in self.pointwise) -> Any:
                return self._convert(env[ref.name], self.value_split[ref.name], rec.split,
                                     self.value_shape[ref.name], pointwise)

            args, kwargs = _fill(args_t, arg), _fill(kwargs_t, arg)
            if op == "module":
                out = self.get_submodule(target)(*args, **kwargs)
            elif name in self.stand_ins:
                out = self.stand_ins[name](args[0])
            elif name in self.reductions:
                grid = self.layout(rec.split)
                out = reduce_over_volume(self.reductions[name], args[0], self.value_shape[inputs[0]][2:],
                                         grid.spatial_group if grid.spatial_size > 1 else None)
            elif name in self.local_reshapes:  # the shard's shape, not the global one the forward read
                shape = form_shape(self.local_reshapes[name][0], batch, self.reshape_extents[name])
                out = getattr(args[0], target)(shape) if op == "method" else target(args[0], shape)
            elif op == "method":
                out = getattr(args[0], target)(*args[1:], **kwargs)
            else:
                out = target(*args, **kwargs)
            if name in self.shape_reads and inputs:
                out = self._global(out, target, inputs[0], args, kwargs)
            env[name] = out
            for src in set(inputs):
                if self.last_use.get(src) == i and src not in self.send:
                    env.pop(src, None)
        if self.last:
            return env[self.send[0]]
        return torch.cat([env[n].reshape(-1) for n in self.send])
