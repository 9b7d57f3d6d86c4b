"""A model on a global input, analysed once: its traced graph, every node's shapes, FLOPs and halos.

Why a module of its own: the plan (:mod:`hybridpar.planner.plan`) resolves a spec against this analysis,
and a planner that tries thousands of specs for one model (the advisor, the performance model) must
not trace, run the meta forward or count FLOPs again for each. Everything here depends on the model
and the input shape only, never on a spec; halos depend on a split too, and are memoised per
(node, split). Shapes come from one forward pass on the meta device (no memory, no FLOPs spent),
FLOPs from :func:`hybridpar.flops.count` (one counting convention for the whole project), halos
from the layer registry (:mod:`hybridpar.nn.registry`), the arithmetic the distributed layers run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridpar import flops as flop_count
from hybridpar import geometry
from hybridpar.axes import REPLICATED
from hybridpar.call_keys import module_path
from hybridpar.nn import registry
from hybridpar.nn.formulas import LayerGeometry
from hybridpar.planner.faithful import check_faithful, shape_value, untraced_value
from hybridpar.planner.graph import OUTPUT, ModelGraph, stand_ins_from_values, trace, trace_values
from hybridpar.planner.space_maps import SpaceMap, find_space_maps
from hybridpar.planner.terms import SpecError, Split
from hybridpar.planner.untouched import left_as_found

if TYPE_CHECKING:  # records reads this module's geometry
    from hybridpar.planner.records import LayerPlan

Shapes = list[tuple[tuple[int, ...], tuple[int, ...]]]
Halos = tuple[tuple[int, int], ...]


class TooSmallToSplit(SpecError):
    """A layer's shard would be thinner than its halo, or its extent smaller than the split: the
    planner replicates such a layer unless the spec is ``strict``.

    Its fields hold what the message says, for a reader that words it otherwise (the planner's note on
    a layer it replicated reads them, never the text): ``layer``, ``kind`` (the module's type, or
    ``"function"``), ``split``, ``extents`` (its input's D, H, W) and ``reason`` (what fails, from the
    halo check's :class:`~hybridpar.geometry.HaloError`)."""

    def __init__(self, message: str, *, layer: str = "", kind: str = "", split: Split = (1, 1, 1),
                 extents: tuple[int, ...] = (), reason: str = "") -> None:
        super().__init__(message)
        self.layer, self.kind, self.split, self.extents, self.reason = layer, kind, split, extents, reason


def _cannot_split(name: str, m: nn.Module | None, in_shape: tuple[int, ...], split: Split, reason: str,
                  detail: str) -> TooSmallToSplit:
    """The error of layer ``name`` under a ``split`` too fine for it, its message ending in ``detail``."""
    extents = tuple(in_shape[2:])
    kind = type(m).__name__ if m is not None else "function"
    return TooSmallToSplit(f"layers: {name} ({kind}) cannot run split {list(split)} on its input of "
                           f"{'x'.join(map(str, extents))} voxels{detail}", layer=name, kind=kind,
                           split=split, extents=extents, reason=reason)


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """``input_shape`` as a tuple, if it is a global batch N, C, D, H, W."""
    shape = tuple(input_shape)
    if len(shape) != 5 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise SpecError(f"input shape must be 5 positive integers N, C, D, H, W (the global batch), got "
                        f"{list(shape)}")
    return shape


# ---------------------------------------------------------------------- the model's layers
def sequential_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module | None]], dict[str, int]]:
    """Nodes ``(name, module)`` in forward order (module None for a function), and each container's
    first node index. Any model torch.fx can trace (see :mod:`hybridpar.planner.graph`)."""
    graph = trace(model)
    return [(n.name, n.module) for n in graph.nodes], graph.containers


def trace_shapes(model: nn.Module, leaves: list[tuple[str, nn.Module | None]],
                 input_shape: tuple[int, ...]) -> Shapes:
    """(first tensor input, output) shape of every node from one forward on the meta device."""
    graph = trace(model)
    return node_shapes(graph, trace_values(graph, tuple(input_shape)))


def node_shapes(graph: ModelGraph, values: dict) -> Shapes:
    """(first tensor input, output) shape of every node of ``graph`` from its traced ``values``; a node
    whose value is not a tensor (a shape read in the forward, and arithmetic on it) has output shape
    ``()`` and is named in ``graph.values``."""
    shapes = []
    for n in graph.nodes:
        out = values[n.name]
        tensors = [values[i] for i in n.inputs if isinstance(values.get(i), torch.Tensor)]
        first = tensors[0] if n.op == "module" and tensors else _lead_input(tensors, out)
        if isinstance(out, torch.Tensor):
            shapes.append((tuple(first.shape) if first is not None else tuple(out.shape), tuple(out.shape)))
            continue
        if n.name == OUTPUT:  # the outputs' structure: each has its own node's shape
            shapes.append((tuple(first.shape), ()))
            continue
        if not shape_value(out):
            raise untraced_value(graph.kind, n.name, n.kind, out)
        graph.values.add(n.name)
        shapes.append((tuple(first.shape) if first is not None else (), ()))
    return shapes


def _lead_input(inputs: list[torch.Tensor], out: object) -> torch.Tensor | None:
    """The input a function's work is laid out by: the first of the output's shape, else the first of
    its spatial extents, else the first. A gate broadcast into features (``gate * x``, the gate pooled
    to one voxel) is laid out by the features, whichever operand comes first."""
    if not isinstance(out, torch.Tensor):
        return inputs[0] if inputs else None
    same = [t for t in inputs if t.shape == out.shape]
    space = [t for t in inputs if t.dim() == out.dim() and t.shape[2:] == out.shape[2:]]
    return next(iter(same or space or inputs), None)


# ---------------------------------------------------------------------- per-layer arithmetic
def node_halos(name: str, m: nn.Module | None, entry: registry.LayerEntry | None, in_shape: tuple[int, ...],
               out_shape: tuple[int, ...], split: Split) -> Halos:
    """Widest (low, high) halo per dim; a split too fine for the layer raises what would fit."""
    if split == REPLICATED:
        return ((0, 0),) * 3
    try:
        if entry is not None and m is not None:
            return entry.halo_widths(m, name, in_shape, out_shape, split)
        for i, parts in enumerate(split):  # an elementwise function: every shard must be non-empty
            registry.check_extent(name, in_shape[2 + i], parts, i)
        return ((0, 0),) * 3
    except geometry.HaloError as err:
        raise _cannot_split(name, m, in_shape, split, err.reason, f": {err}") from None


def splits_under(m: nn.Module, entry: registry.LayerEntry, in_shape: tuple[int, ...],
                 out_shape: tuple[int, ...], split: Split) -> bool:
    """Whether layer ``m`` runs split under ``split`` (:func:`node_halos` without the search for what
    would fit, which a planner that replicates such a layer needs not pay for)."""
    try:
        entry.halo_widths(m, "", in_shape, out_shape, split)
        return True
    except geometry.HaloError:
        return False


def _terse_halos(name: str, m: nn.Module | None, entry: registry.LayerEntry | None,
                 in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: Split) -> Halos:
    """:func:`node_halos` without geometry's search for what would fit (O(extent^2) per call, which
    adds up at 512^3): a planner only needs to know that a split fails, so the message is shorter;
    :meth:`ParallelSpec.plan` gives the full one. Its ``reason`` is the full one's, so a layer the
    planner replicates is explained alike either way."""
    try:
        return node_halos("", m, entry, in_shape, out_shape, split)
    except TooSmallToSplit as err:
        short = " (spec.plan says what would fit)"
        raise _cannot_split(name, m, in_shape, split, err.reason, short) from None


def forward_flops(m: nn.Module | None, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int:
    """Forward matmul FLOPs of one call, from the layer's registry entry (2 per multiply-accumulate, as
    FlopCounterMode counts); for a model that cannot be copied to the meta device."""
    entry = registry.lookup(m) if m is not None else None
    if entry is None:
        return 0
    x, y = torch.empty(in_shape, device="meta"), torch.empty(out_shape, device="meta")
    return entry.flops(m, x, y)[0].get("forward", 0)


def node_geometry(m: nn.Module | None, in_shape: tuple[int, ...],
                  out_shape: tuple[int, ...]) -> LayerGeometry | None:
    """The geometry that splits a node's work (its registry entry's; None for a function or an
    unregistered module: voxel by voxel)."""
    entry = registry.lookup(m) if m is not None else None
    if entry is None:
        return None
    x, y = torch.empty(in_shape, device="meta"), torch.empty(out_shape, device="meta")
    return entry.work(m, x, y)[1]


def leaf_flop_sums(counted: flop_count.FlopCount,
                   leaves: Sequence[tuple[str, nn.Module | None]]) -> list[list[int]]:
    """``[forward, input_grad, weight_grad, forward_other]`` per leaf, from one
    :func:`hybridpar.flops.count`: a conv inside a custom module is credited to that module's leaf."""
    index = {name: i for i, (name, _) in enumerate(leaves)}
    sums = [[0, 0, 0, 0] for _ in leaves]
    for rec in counted.per_layer:
        parts = module_path(rec.name).split(".")
        for k in range(len(parts), 0, -1):
            leaf = index.get(".".join(parts[:k]))
            if leaf is not None:
                s = sums[leaf]
                s[0] += rec.forward
                s[1] += rec.input_grad
                s[2] += rec.weight_grad
                s[3] += rec.forward_other
                break
    return sums


def _flop_costs(model: nn.Module, leaves: list[tuple[str, nn.Module | None]], input_shape: tuple[int, ...],
                shapes: Shapes) -> tuple[list[int], list[int], flop_count.FlopCount | None]:
    """Forward and training FLOPs per leaf, and the count they come from (None when the model
    cannot be copied to or run on the meta device: a training step then counts as 3x forward, 2x for
    the first layer, which computes no input gradient)."""
    try:
        counted: flop_count.FlopCount | None = flop_count.count(model, input_shape)
    except (TypeError, RuntimeError):  # a forward that reads a value (torch.rand(()) < p) on the meta device
        counted = None
    if counted is None:
        fwd = [forward_flops(m, i, o) for (_, m), (i, o) in zip(leaves, shapes, strict=True)]
        return fwd, [f * (2 if i == 0 else 3) for i, f in enumerate(fwd)], None
    sums = leaf_flop_sums(counted, leaves)
    return [s[0] for s in sums], [s[0] + s[1] + s[2] for s in sums], counted


def layer_flops(model: nn.Module, leaves: list[tuple[str, nn.Module | None]], input_shape: tuple[int, ...],
                shapes: Shapes) -> list[int]:
    """Forward matmul FLOPs per leaf (see :func:`layer_flop_costs`)."""
    return layer_flop_costs(model, leaves, input_shape, shapes)[0]


def layer_flop_costs(model: nn.Module, leaves: list[tuple[str, nn.Module | None]],
                     input_shape: tuple[int, ...], shapes: Shapes) -> tuple[list[int], list[int]]:
    """Per leaf: forward matmul FLOPs, and training FLOPs (forward + input gradient + weight
    gradient), from :func:`hybridpar.flops.count`.

    Stages are balanced on the training FLOPs, since that is what a stage spends per micro-batch:
    the first layer computes no input gradient, so balancing forward FLOPs leaves the first stage
    light. Falls back to :func:`forward_flops` when the model cannot be copied to the meta device.
    """
    fwd, train, _ = _flop_costs(model, leaves, input_shape, shapes)
    return fwd, train


# ---------------------------------------------------------------------- the analysis
@dataclass
class Analysis:
    """A model on a global input, analysed once: its graph, every node's shapes and FLOPs, and a
    memo of halo widths per (node, split). Resolving a spec against it
    (:func:`hybridpar.planner.plan.resolve`) costs no tracing, so a planner can try thousands of specs.
    ``terse``: a split too fine for a layer raises a short error instead of searching for what
    would fit (see :func:`node_halos`)."""

    model: nn.Module
    input_shape: tuple[int, ...]
    graph: ModelGraph
    leaves: list[tuple[str, nn.Module | None]]
    shapes: Shapes
    flops: list[int]
    train_flops: list[int]
    count: flop_count.FlopCount | None
    terse: bool = False
    halo_memo: dict[tuple[str, Split], Halos | SpecError] = field(default_factory=dict, repr=False)
    # chains of reshapes between channels and space that run on shards, by node (planner.space_maps)
    space_maps: dict[str, SpaceMap] = field(default_factory=dict, repr=False)

    @property
    def containers(self) -> dict[str, int]:
        return self.graph.containers

    def halos(self, index: int, entry: registry.LayerEntry | None, split: Split) -> Halos:
        """The widest (low, high) halo per dim of node ``index`` under ``split`` (memoised, errors
        included)."""
        node = self.graph.nodes[index]
        key = (node.name, split)
        if key not in self.halo_memo:
            widths = _terse_halos if self.terse else node_halos
            try:
                self.halo_memo[key] = widths(node.name, node.module, entry, *self.shapes[index], split)
            except SpecError as err:
                self.halo_memo[key] = err
        found = self.halo_memo[key]
        if isinstance(found, SpecError):
            raise found
        return found


def analyse(model: nn.Module, input_shape: Sequence[int], graph: ModelGraph | None = None, *,
            terse: bool = False) -> Analysis:
    """Trace ``model`` (unless its ``graph`` is given), its shapes on a global input of
    ``input_shape`` (N, C, D, H, W) and its FLOPs."""
    shape = check_input_shape(input_shape)
    with left_as_found(model):  # a trace runs the forward's Python: a buffer it moves is put back
        graph = trace(model) if graph is None else graph
    check_faithful(graph, model, shape)  # first: an unfaithful graph may not even run
    values = trace_values(graph, shape)
    shapes = node_shapes(graph, values)
    stand_ins_from_values(graph, values)
    leaves = [(n.name, n.module) for n in graph.nodes]
    fwd, train, counted = _flop_costs(model, leaves, shape, shapes)
    return Analysis(model, shape, graph, leaves, shapes, fwd, train, counted, terse,
                    space_maps=find_space_maps(graph, values))


KEPT_WHOLE = "_hybridpar_kept_whole"
"""The attribute marking a layer of a forward run by module swapping that every call of the built engine
ran whole (a bottleneck too small to split at the build size): its split version was made for that
whole run, so the plan at another size (on :class:`hybridpar.pipeline.sizes.SizePlans`' meta copy) and
the run (on the split version) read its input whole at every size, gathered, exact."""


def kept_whole(plan: Sequence[LayerPlan]) -> set[str]:
    """The layers (by module path) that every call of ``plan`` runs whole: those to mark
    :data:`KEPT_WHOLE` in a forward run by module swapping."""
    splits: dict[str, set[Split]] = {}
    for r in plan:
        splits.setdefault(module_path(r.name), set()).add(tuple(r.split))
    return {name for name, s in splits.items() if s == {REPLICATED}}


def dense_on_split(m: nn.Module, entry: registry.LayerEntry | None) -> bool:
    """Whether a registered layer that does not split (``nn.Linear``, ``nn.Softmax`` over a dim of the
    volume) would read a split volume: it needs the whole volume, so the forward is refused (a
    ``Flatten`` gathers its input first, a softmax over channels works voxel by voxel)."""
    if entry is None or entry.splittable or entry.flattens:
        return False
    dim = getattr(m, "dim", None)  # a softmax's or a GLU's
    return not (entry.op == "pointwise" and isinstance(dim, int) and dim % 5 < 2)
