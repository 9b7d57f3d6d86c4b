"""Resolve a spec against a model and a global input shape: one record per graph node, in forward order.

Why: ``parallelize`` and ``explain`` must agree on every decision (which split each layer runs
under, where the stages begin, where activations are redistributed), and every check that needs
the model (globs, halos, batch arithmetic) must run before any process starts. The model is traced
into a graph (:mod:`hybridpar.planner.graph`); shapes come from one forward pass on the meta device (no
memory, no FLOPs spent); what each layer is comes from the layer registry
(:mod:`hybridpar.nn.registry`), halos from :mod:`hybridpar.geometry`, the same arithmetic the
distributed layers run.

Split rules, in order: a layer rule (its exact name, else the first matching glob) wins; window and
resampling layers (conv, pool, upsample) take the grid's spatial split; pointwise layers and
elementwise functions (norms, activations, ``+``, ``torch.cat`` along channels) keep the split of the
activation they receive, so they never add a redistribute; whole-volume reductions (global pooling)
run on their input's split and return a replicated output; a chain of ``view``/``permute``/``reshape``
between channels and space (a 3D pixel shuffle) keeps its input's split where every rank's box maps to
its own output box (:mod:`hybridpar.planner.space_maps`); everything else (Flatten, Linear) runs
replicated, after a gather. An elementwise node is laid out by the input of its output's extents, so
that a gate pooled to one voxel (replicated) broadcasts into split features from either side.
A layer the grid's split would leave with shards thinner than its halo, or an extent smaller than the
split (a ResNet's last level at 2^3), runs replicated instead, and so do the layers that read it until
a window layer's input is large enough to split again (Oyama et al.'s hybrid: a Redistribute to
replicated and back). ``LayerPlan.auto_replicated`` says why; ``strict: true`` refuses instead, as does
the first layer that would split the model input (a grid finer than the input is a mistake, not a
layout). A layer rule's split is never changed.
A gather inside a split region (a replicated node whose output is split again later) is what a
layer nobody registered would silently cost: it is flagged (``LayerPlan.gather``), warned about by
the engine and marked by ``explain``. A torch module nobody registered on a split input is an error;
a module of the user's own type runs its own forward split (:func:`~hybridpar.planner.swapped.nested_block`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from hybridpar import globs
from hybridpar.nn import registry
from hybridpar.planner import calls
from hybridpar.planner.analysis import REPLICATED, Analysis, TooSmallToSplit, analyse, check_input_shape
from hybridpar.planner.graph import INPUT, OUTPUT, ModelGraph, Node, UntraceableError
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.space_maps import SpaceMap
from hybridpar.planner.spec_view import GridView, RuleView, SpecView
from hybridpar.planner.stages import auto_stages, describe_layers, live_across, live_bytes, named_stages
from hybridpar.planner.swapped import nested_block, nested_output_split, swapped_plan
from hybridpar.planner.terms import SpecError, Split

__all__ = ["broadcasts", "build_plan", "resolve"]

def _batch(grid: GridView, microbatches: int, batch: int) -> int:
    """Micro-batch size, after the checks that make data parallelism and the pipeline well defined."""
    if batch % grid.data:
        fits = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        raise SpecError(f"global batch {batch} does not split evenly over data({grid.data}) replicas; use "
                        f"a global batch that is a multiple of {grid.data}, or data in {{{fits}}}")
    per = batch // grid.data
    if per == 1 and (grid.pipe > 1 or microbatches > 1):
        raise SpecError(
            f"a pipeline (pipe={grid.pipe}, microbatches={microbatches}) was asked of a per-replica batch "
            f"of 1 (global batch {batch} / data({grid.data})): one sample cannot be split into "
            f"micro-batches, so the stages would run one after another. Volumes this large often fit "
            f"one sample per device when split spatially: use spatial parallelism (e.g. grid.spatial "
            f"[{grid.pipe * grid.spatial[0]}, {grid.spatial[1]}, {grid.spatial[2]}], pipe 1) or data "
            f"parallelism, with microbatches: 1")
    if per % microbatches:
        fits = ", ".join(str(m) for m in range(1, per + 1) if per % m == 0)
        raise SpecError(f"pipeline.microbatches: {microbatches} does not divide the per-replica batch "
                        f"{per} (global batch {batch} / data({grid.data})); counts that would: {fits}")
    return per // microbatches



def _concat_dim(node: Node, ndim: int) -> int | None:
    dim = node.fx_node.kwargs.get("dim", node.fx_node.args[1] if len(node.fx_node.args) > 1 else 0)
    return dim % ndim if isinstance(dim, int) else None


def _keeps_space(node: Node) -> bool:
    """Whether a ``repeat``/``expand``/``tile`` of a 5-D tensor leaves its spatial dims alone (a
    channel repeat): then it is pointwise in space and runs on the shard."""
    sizes = node.fx_node.args[1:] if node.op == "method" else node.fx_node.args[1:2]
    if len(sizes) == 1 and isinstance(sizes[0], list | tuple):
        sizes = sizes[0]
    keep = -1 if node.target == "expand" else 1
    return len(sizes) >= 3 and all(isinstance(s, int) and s == keep for s in sizes[-3:])


def _role(node: Node, in_shape: tuple[int, ...], values: set[str]) -> tuple[str, registry.LayerEntry | None]:
    """How ``node`` meets a split input: a registry role, or ``"unregistered"``. ``values``: the nodes
    whose value is not a tensor (a ``getattr`` that returns a tensor, ``x.T``, is no shape read)."""
    if node.module is not None:
        entry = registry.lookup(node.module)
        if entry is None and nested_block(node.module):
            return "nested", None
        return (entry.role, entry) if entry is not None else ("unregistered", None)
    if node.name == OUTPUT:  # the outputs, each in its own layout: the split ones in one
        return "output", None
    if calls.volume_reduction(node.target, node.fx_node.args, dict(node.fx_node.kwargs), len(in_shape)):
        return "volume_reduction", None  # over D, H, W per sample: split, its value replicated
    role = registry.function_role(node.target)
    if role == "shape" and node.name not in values:
        role = "dense"
    if node.target in ("repeat", "expand", "tile", torch.tile) and len(in_shape) == 5:
        role = "pointwise" if _keeps_space(node) else "dense"
    if role == "concat":
        role = "pointwise" if _concat_dim(node, len(in_shape)) == 1 else "dense"
    return role or "dense", None


def _check_nested(node: Node, in_shape: tuple[int, ...], split: Split, micro: int) -> bool:
    """Refuse a module of the user's that the graph keeps whole unless it runs split by its own forward
    (every layer in it registered and wide enough, every call between them one that runs split:
    :mod:`hybridpar.planner.calls`); whether its output is split."""
    try:
        return nested_output_split(node.module, in_shape, split, micro)
    except TooSmallToSplit:
        raise
    except SpecError as err:
        raise SpecError(f"{node.name} ({node.kind}), run by module swapping inside as torch.fx cannot trace "
                        f"it: {err}; or add a rule {{{node.name!r}: {{spatial: replicate}}}} to run it "
                        f"whole") from None


def _too_small(in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: Split,
               err: TooSmallToSplit) -> str:
    """Why a node cannot run under ``split`` (``err``: its halo check's, or that of a layer inside it),
    in a few words for ``explain``: its own extents where they are fewer than the split, else the
    halo check's reason."""
    for what, shape in (("input", in_shape), ("output", out_shape)):
        for k, parts in enumerate(split):
            if len(shape) == 5 and shape[2 + k] < parts:
                size = "x".join(map(str, shape[2:]))
                return f"its {what} of {size} voxels is fewer than the split {list(split)} along {'dhw'[k]}"
    return f"split {list(split)} of its input of {'x'.join(map(str, in_shape[2:]))} voxels: {err.reason}"


def _on_world(spec: SpecView, world_size: int | None) -> SpecView:
    """``spec`` on ``world_size`` ranks (its -1 filled, its product checked); without a world size, a
    grid with no -1 as it is."""
    if world_size is not None:
        return spec.resolve_grid(world_size)
    if not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
    return spec


def _rules_by_node(rules: Sequence[RuleView], leaves: Sequence[tuple[str, nn.Module]]) -> dict[str, RuleView]:
    """The rule each leaf follows (its exact name, else the first matching glob), after refusing a rule
    that matches no leaf (a typo would otherwise be a rule silently not applied)."""
    names = [n for n, _ in leaves]
    for rule in rules:
        if not any(globs.matches(n, rule.pattern) for n in names):
            near = difflib.get_close_matches(rule.pattern, names, n=3, cutoff=0.5)
            hint = f" (close: {', '.join(near)})" if near else ""
            raise SpecError(f"layers[{rule.pattern!r}]: the glob matches no layer{hint}; layer names look "
                            f"like {describe_layers(leaves)}")
    patterns = [rule.pattern for rule in rules]
    return {n: rules[k] for n in names if (k := globs.rule_for(n, patterns)) is not None}


@dataclass
class _Walk:
    """The layouts decided so far, node by node in forward order (the rules: the module doc). Each node
    is placed from the layouts of the nodes it reads, so one pass decides them all."""

    spec: SpecView
    a: Analysis
    rule_of: dict[str, RuleView]
    micro: int
    index: dict[str, int] = field(init=False)
    input_split: Split | None = None  # the layout the model input is sharded in: its first reader's
    out_split: dict[str, Split] = field(default_factory=dict)
    chain_split: dict[str, Split | None] = field(default_factory=dict)  # a reshape chain's, by its first node
    splits: list[Split] = field(default_factory=list)
    halos: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    gathers: list[bool] = field(default_factory=list)
    auto: dict[str, str] = field(default_factory=dict)  # node -> why the planner replicated it (_too_small)
    whole_out: set[str] = field(default_factory=set)  # user modules run split whose output is replicated

    def __post_init__(self) -> None:
        self.index = self.a.graph.index()

    @property
    def input_layout(self) -> Split:
        """The layout the model input is sharded in (replicated where no node reads it split)."""
        return self.input_split or REPLICATED

    def place(self, i: int, node: Node) -> None:
        """Decide node ``i``'s layout and record it."""
        in_shape, out_shape = self.a.shapes[i]
        role, entry = _role(node, in_shape, self.a.graph.values)
        mapped = self._chain(node)
        split = mapped if mapped is not None else self._asked(node, role, in_shape)
        split = self._fitted(i, node, role, entry, split, mapped is not None)
        self._note_replicated_input(node, split, out_shape)
        self._record(i, node, role, entry, split, mapped is not None)

    def _value_shape(self, name: str) -> tuple[int, ...]:
        """The global shape of the value node ``name`` (or the model input) gives."""
        return self.a.input_shape if name == INPUT else self.a.shapes[self.index[name]][1]

    def _first_reader(self, node: Node) -> bool:
        """Whether ``node`` is the first to read the model input (whose layout it then decides)."""
        return INPUT in node.inputs and self.input_split is None

    def _split_input(self, node: Node) -> bool:
        """Whether some input of ``node`` is already split (the model input counts once a layer split it)."""
        return any(self.input_layout != REPLICATED if n == INPUT else self.out_split[n] != REPLICATED
                   for n in node.inputs)

    def _producer(self, node: Node) -> Split:
        """The layout an elementwise node keeps: its first split input's (shards must agree)."""
        layouts = [(self.input_split or self.spec.grid.spatial) if n == INPUT else self.out_split[n]
                   for n in node.inputs]
        return next((s for s in layouts if s != REPLICATED), REPLICATED)

    def _chain(self, node: Node) -> Split | None:
        """The split of the reshape chain between channels and space that ``node`` is part of (decided at
        its first node), or None: not in one, or one that runs as any dense node."""
        space_map = self.a.space_maps.get(node.name)
        if space_map is None:
            return None
        if node.name == space_map.nodes[0]:
            self.chain_split[node.name] = _space_map_split(space_map, self._producer(node), self.rule_of)
        return self.chain_split.get(space_map.nodes[0])

    def _asked(self, node: Node, role: str, in_shape: tuple[int, ...]) -> Split:
        """The split a layer rule or ``node``'s role asks for, before the check that it fits."""
        spatial_in = len(in_shape) == 5
        if node.name in self.rule_of:
            return self._ruled(node, role, spatial_in)
        if not spatial_in:
            return REPLICATED
        if role in ("window", "transposed", "resample", "nested"):
            return self._grid_split(node, in_shape)
        if role in ("pointwise", "reduce", "shape", "volume_reduction"):  # a shape read: as it is
            return self._producer(node)
        if role == "output":
            return self._output_split(node)
        if role == "unregistered" and self._split_input(node):
            raise SpecError(f"{node.name} ({node.kind}): {registry.unregistered(node.module)} and its "
                            f"input is split {list(self._producer(node))}: register it "
                            f"(hybridpar.nn.register, see the README) so it can run split, or add a rule "
                            f"{{{node.name!r}: {{spatial: replicate}}}} to run it whole after a gather")
        return REPLICATED

    def _ruled(self, node: Node, role: str, spatial_in: bool) -> Split:
        """A layer rule's split, refused where ``node`` cannot run split at all."""
        rule = self.rule_of[node.name]
        if rule.split != REPLICATED and not (spatial_in and role not in ("dense", "unregistered")):
            why = "its input is not N, C, D, H, W" if not spatial_in else \
                "it is not a conv, pool, norm, resampling or elementwise layer"
            raise SpecError(f"layers[{rule.pattern!r}]: {node.name} ({node.kind}) cannot "
                            f"be split spatially ({why}); use spatial: replicate for it")
        return rule.split

    def _grid_split(self, node: Node, in_shape: tuple[int, ...]) -> Split:
        """The grid's split; a layer on an already replicated input too small to split (after a global
        pooling) stays replicated. The model input is not such an input: a grid finer than it is
        refused by the layer that would split it first, as any split that empties a shard."""
        grid = self.spec.grid.spatial
        small = any(in_shape[2 + k] < p for k, p in enumerate(grid))
        replicate = small and not self._first_reader(node) and not self._split_input(node)
        return REPLICATED if replicate else grid

    def _output_split(self, node: Node) -> Split:
        """Split outputs stay split where one share of the volume weighs them all (5-D, same extents)."""
        extents = {self._value_shape(n)[2:] for n in node.inputs}
        ranks = {len(self._value_shape(n)) if n != INPUT else 5 for n in node.inputs}
        return self._producer(node) if len(extents) == 1 and ranks == {5} else REPLICATED

    def _fitted(self, i: int, node: Node, role: str, entry: registry.LayerEntry | None, split: Split,
                mapped: bool) -> Split:
        """``split``, or replicated where the node is too small to split there (its halos, or a layer
        inside a user's module run split); a rule's split, ``strict`` and the model input's first
        reader are never changed, only refused by the halo check that follows."""
        in_shape, out_shape = self.a.shapes[i]
        free = not mapped and not self.spec.strict and node.name not in self.rule_of \
            and not self._first_reader(node)
        if split != REPLICATED and free:
            try:
                self.a.halos(i, entry, split)
                if role == "nested":
                    self._nest(node, in_shape, split)
            except TooSmallToSplit as err:
                self.auto[node.name] = _too_small(in_shape, out_shape, split, err)
                return REPLICATED
        elif role == "nested" and split != REPLICATED:
            self._nest(node, in_shape, split)
        return split

    def _nest(self, node: Node, in_shape: tuple[int, ...], split: Split) -> None:
        """Check a user's module run split by its own forward, each layer in it on its own extents;
        note it where its output is replicated."""
        if not _check_nested(node, in_shape, split, self.micro):
            self.whole_out.add(node.name)

    def _note_replicated_input(self, node: Node, split: Split, out_shape: tuple[int, ...]) -> None:
        """A node replicated because what it reads was: say which (a region too small to split runs
        replicated until a window layer's input is large enough again)."""
        if split == REPLICATED and len(out_shape) == 5 and node.name not in self.rule_of \
                and node.name not in self.auto:
            from_auto = next((n for n in node.inputs if n in self.auto), None)
            if from_auto is not None:
                self.auto[node.name] = f"reads {from_auto}, replicated"

    def _record(self, i: int, node: Node, role: str, entry: registry.LayerEntry | None, split: Split,
                mapped: bool) -> None:
        """Keep node ``i``'s split, its output's layout, its halos and whether it gathers."""
        in_shape, out_shape = self.a.shapes[i]
        spatial_in = len(in_shape) == 5
        if self._first_reader(node):
            self.input_split = split if spatial_in else REPLICATED
        replicated_out = node.name in self.whole_out or role == "volume_reduction" or \
            (entry is not None and entry.replicated_output(node.module))
        self.out_split[node.name] = split if mapped else \
            REPLICATED if (replicated_out or len(out_shape) != 5) else split
        self.splits.append(split)
        self.halos.append(((0, 0),) * 3 if mapped else self.a.halos(i, entry, split))
        self.gathers.append(split == REPLICATED and spatial_in and self._split_input(node)
                            and node.name not in self.auto)

    def redistributes(self, i: int) -> bool:
        """Whether node ``i`` reads a 5-D value in another layout than its own (one that does not
        broadcast): its input is then redistributed."""
        if len(self.a.shapes[i][0]) != 5:
            return False
        srcs = [(self.input_layout if n == INPUT else self.out_split[n], self._value_shape(n))
                for n in self.a.graph.nodes[i].inputs]
        return any(s != self.splits[i] and not broadcasts(s, shape) for s, shape in srcs if len(shape) == 5)


def _inside_split_regions(gathers: list[bool], splits: list[Split]) -> list[bool]:
    """``gathers`` kept where the activation is split again after the node: a gather inside a split
    region, what a layer nobody registered would silently cost."""
    split_later = [False] * len(splits)
    later = False
    for i in range(len(splits) - 1, -1, -1):
        split_later[i] = later
        later = later or splits[i] != REPLICATED
    return [g and s for g, s in zip(gathers, split_later, strict=True)]


class _Sizes(NamedTuple):
    """The most loaded rank's sizes per node, for one micro-batch."""

    local_in: list[tuple[int, ...]]
    local_out: list[tuple[int, ...]]
    act: list[int]  # activation bytes
    shares: list[float]  # share of the node's work (records.rank_share)


def _sizes(a: Analysis, walk: _Walk) -> _Sizes:
    """Local shapes, activation bytes and work shares of every node under the layouts ``walk`` decided."""
    nodes, shapes, micro = a.graph.nodes, a.shapes, walk.micro
    local_out = [local_shape(o, micro, walk.out_split[n.name])
                 for n, (_, o) in zip(nodes, shapes, strict=True)]
    local_in = [local_shape(shapes[i][0], micro, walk.splits[i]) for i in range(len(nodes))]
    for i, n in enumerate(nodes):  # a reshape chain's values hold the shard's voxels in other dims
        sm = a.space_maps.get(n.name)
        if sm is not None and walk.chain_split.get(sm.nodes[0]):
            local_out[i] = sm.loaded_shape(n.name, micro, walk.splits[i])
            k = sm.nodes.index(n.name)
            local_in[i] = sm.loaded_shape(sm.nodes[k - 1], micro, walk.splits[i]) if k else local_in[i]
    act = [0 if n.name in a.graph.values or n.name == OUTPUT else BYTES_PER_ELEMENT * math.prod(lo)
           for n, lo in zip(nodes, local_out, strict=True)]  # values and the outputs' structure hold none
    shares = [rank_share(n.module, shapes[i][0], shapes[i][1], local_out[i], walk.splits[i])
              for i, n in enumerate(nodes)]
    return _Sizes(local_in, local_out, act, shares)


def _stage_of(spec: SpecView, a: Analysis, walk: _Walk, sizes: _Sizes) -> list[int]:
    """Each node's pipeline stage: balanced by the most loaded rank's work (``stages: auto``), or
    begun at the named layers."""
    if spec.pipeline.stages == "auto":
        in_bytes = BYTES_PER_ELEMENT * math.prod(local_shape(a.input_shape, walk.micro, walk.input_layout))
        sends = live_bytes(a.graph, sizes.act, in_bytes)
        work = [f * sh for f, sh in zip(a.train_flops, sizes.shares, strict=True)]
        starts = auto_stages(work, sizes.act, spec.grid.pipe, sends)
    else:
        starts = named_stages(spec.pipeline.stages, a.leaves, a.containers)  # count checked by ParallelSpec
    return [sum(1 for s in starts if s <= i) - 1 for i in range(len(a.graph.nodes))]


def _check_cuts(a: Analysis, walk: _Walk, stage_of: list[int], pipe: int) -> None:
    """Refuse a stage cut inside a reshape chain run on each shard, or one that would carry a value
    computed from shapes (what crosses a cut is a tensor)."""
    for first, split in walk.chain_split.items():
        names = a.space_maps[first].nodes
        if split is not None and len({stage_of[walk.index[n]] for n in names}) > 1:
            raise SpecError(f"pipeline: a stage cut falls inside the reshapes {', '.join(names)}, which run "
                            f"on each shard between channels and space; name stages (pipeline.stages) that "
                            f"begin before {names[0]} or after {names[-1]}")
    if pipe > 1 and a.graph.values:  # a size read before a cut is read again after it
        for i, live in enumerate(live_across(a.graph)[:-1]):
            crossing = [v for v in live if v in a.graph.values] if stage_of[i] != stage_of[i + 1] else []
            if crossing:
                raise SpecError(f"pipeline: the cut after {a.graph.nodes[i].name} would carry {crossing[0]}, "
                                f"a value computed from shapes, not a tensor; name stages (pipeline.stages) "
                                f"that begin before the shape is read or after its last use")


def _rows(a: Analysis, walk: _Walk, stage_of: list[int], sizes: _Sizes) -> list[LayerPlan]:
    """One :class:`LayerPlan` per node, from what the steps of :func:`resolve` decided."""
    gathers = _inside_split_regions(walk.gathers, walk.splits)
    shapes = a.shapes
    return [LayerPlan(
        name=node.name, kind=node.kind, stage=stage_of[i], split=walk.splits[i],
        rule=walk.rule_of[node.name].pattern if node.name in walk.rule_of else None,
        input_shape=shapes[i][0], output_shape=shapes[i][1],
        local_input_shape=sizes.local_in[i], local_output_shape=sizes.local_out[i],
        halo=walk.halos[i], params=sum(p.numel() for p in node.module.parameters()) if node.module else 0,
        flops=a.flops[i], activation_bytes=sizes.act[i], redistribute=walk.redistributes(i),
        train_flops=a.train_flops[i], inputs=node.inputs, out_split=walk.out_split[node.name],
        gather=gathers[i], auto_replicated=walk.auto.get(node.name, ""),
        transpose_bytes=transpose_bytes(node.module, shapes[i][0], walk.splits[i], walk.micro),
        rank_share=sizes.shares[i])
        for i, node in enumerate(a.graph.nodes)]


def resolve(spec: SpecView, a: Analysis, world_size: int | None = None) -> list[LayerPlan]:
    """The plan of ``spec`` on an analysed model (see the module doc for the rules): the one planner,
    which :func:`build_plan`, the engine, ``explain`` and the performance model all read."""
    spec = _on_world(spec, world_size)
    micro = _batch(spec.grid, spec.pipeline.microbatches, a.input_shape[0])
    walk = _Walk(spec, a, _rules_by_node(spec.layers, a.leaves), micro)
    for i, node in enumerate(a.graph.nodes):
        walk.place(i, node)
    sizes = _sizes(a, walk)
    stage_of = _stage_of(spec, a, walk, sizes)
    _check_cuts(a, walk, stage_of, spec.grid.pipe)
    return _rows(a, walk, stage_of, sizes)


def _space_map_split(space_map: SpaceMap, producer: Split, rule_of: dict[str, RuleView]) -> Split | None:
    """The split a chain of reshapes between channels and space runs in: its input's, where every
    rank's output box is then the one that split gives it (:meth:`SpaceMap.fits`) and no rule names
    a node of it; None where it runs as any other dense node (replicated, after a gather)."""
    if producer == REPLICATED or any(n in rule_of for n in space_map.nodes):
        return None
    return producer if space_map.fits(producer) else None


def broadcasts(split: Split, shape: Sequence[int]) -> bool:
    """Whether a value of global ``shape`` in layout ``split`` is read by split computations as it is:
    a replicated one-voxel operand (a pooled gate) broadcasts against any shard, no redistribute."""
    return split == REPLICATED and len(shape) == 5 and all(e == 1 for e in shape[2:])



def build_plan(spec: SpecView, model: nn.Module, input_shape: Sequence[int],
               world_size: int | None = None, graph: ModelGraph | None = None) -> list[LayerPlan]:
    """Resolve ``spec`` for ``model`` (traced once more unless its ``graph`` is given) on a global
    input of ``input_shape`` (N, C, D, H, W). A caller resolving many specs for one model analyses
    it once (:func:`hybridpar.planner.analysis.analyse`) and calls :func:`resolve` per spec."""
    shape = check_input_shape(input_shape)
    spec = _on_world(spec, world_size)
    micro = _batch(spec.grid, spec.pipeline.microbatches, shape[0])  # batch errors before any tracing
    try:
        return resolve(spec, analyse(model, shape, graph))
    except UntraceableError as err:
        if spec.grid.pipe != 1:
            raise SpecError(f"{err}. A pipeline cuts the traced graph; without one (pipe: 1) such a model "
                            f"runs by module swapping") from None
        if spec.layers:
            raise SpecError(f"{err}. Such a model runs by module swapping, every layer under the grid's "
                            f"split: per-layer rules (layers: {[r.pattern for r in spec.layers]}) need the "
                            f"traced graph") from None
    return swapped_plan(model, shape, spec.grid.spatial, micro)
