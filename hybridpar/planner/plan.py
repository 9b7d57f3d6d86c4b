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
from typing import TYPE_CHECKING

import torch
from torch import nn

from hybridpar import globs
from hybridpar.nn import registry
from hybridpar.planner import calls
from hybridpar.planner.analysis import REPLICATED, Analysis, TooSmallToSplit, analyse, check_input_shape
from hybridpar.planner.graph import INPUT, OUTPUT, ModelGraph, Node, UntraceableError
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.space_maps import SpaceMap
from hybridpar.planner.stages import auto_stages, describe_layers, live_across, live_bytes, named_stages
from hybridpar.planner.swapped import nested_block, nested_output_split, swapped_plan
from hybridpar.planner.terms import SpecError, Split

if TYPE_CHECKING:  # the spec reader imports this module to plan
    from hybridpar.planner.config import GridSpec, LayerRule, ParallelSpec

__all__ = ["broadcasts", "build_plan", "resolve"]

def _batch(grid: GridSpec, microbatches: int, batch: int) -> int:
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


def _split_input(node: Node, out_split: dict[str, Split], input_split: Split | None) -> bool:
    """Whether some input of ``node`` is already split (the model input counts once a layer split it)."""
    return any((input_split or REPLICATED) != REPLICATED if n == INPUT else out_split[n] != REPLICATED
               for n in node.inputs)



def resolve(spec: ParallelSpec, a: Analysis, world_size: int | None = None) -> list[LayerPlan]:
    """The plan of ``spec`` on an analysed model (see the module doc for the rules): the one planner,
    which :func:`build_plan`, the engine, ``explain`` and the performance model all read."""
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    elif not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
    grid, pipe = spec.grid, spec.pipeline
    micro = _batch(grid, pipe.microbatches, a.input_shape[0])
    nodes, leaves, shapes = a.graph.nodes, a.leaves, a.shapes
    for rule in spec.layers:
        if not any(globs.matches(n, rule.pattern) for n, _ in leaves):
            near = difflib.get_close_matches(rule.pattern, [n for n, _ in leaves], n=3, cutoff=0.5)
            hint = f" (close: {', '.join(near)})" if near else ""
            raise SpecError(f"layers[{rule.pattern!r}]: the glob matches no layer{hint}; layer names look "
                            f"like {describe_layers(leaves)}")
    patterns = [rule.pattern for rule in spec.layers]
    rule_of: dict[str, LayerRule] = {n: spec.layers[k] for n, _ in leaves
                                     if (k := globs.rule_for(n, patterns)) is not None}

    index = a.graph.index()
    chain_split: dict[str, Split | None] = {}  # a reshape chain's split, by its first node (space_maps)
    out_split: dict[str, Split] = {}
    input_split: Split | None = None  # the layout the model input is sharded in: its first reader's
    splits: list[Split] = []
    halo_list = []
    gathers: list[bool] = []
    auto: dict[str, str] = {}  # node -> why the planner replicated it (see _too_small)
    whole_out: set[str] = set()  # user modules run split whose output is replicated (a reduction)
    for i, node in enumerate(nodes):
        in_shape, out_shape = shapes[i]
        spatial_in = len(in_shape) == 5
        role, entry = _role(node, in_shape, a.graph.values)
        # the layout an elementwise node keeps: its first split input's (shards must agree)
        layouts = [(input_split or grid.spatial) if n == INPUT else out_split[n] for n in node.inputs]
        producer = next((s for s in layouts if s != REPLICATED), REPLICATED)
        space_map = a.space_maps.get(node.name)
        if space_map is not None and node.name == space_map.nodes[0]:
            chain_split[node.name] = _space_map_split(space_map, producer, rule_of)
        mapped = chain_split.get(space_map.nodes[0]) if space_map is not None else None
        if mapped is not None:  # a reshape between channels and space, on each shard
            split = mapped
        elif node.name in rule_of:
            split = rule_of[node.name].split
            if split != REPLICATED and not (spatial_in and role not in ("dense", "unregistered")):
                why = "its input is not N, C, D, H, W" if not spatial_in else \
                    "it is not a conv, pool, norm, resampling or elementwise layer"
                raise SpecError(f"layers[{rule_of[node.name].pattern!r}]: {node.name} ({node.kind}) cannot "
                                f"be split spatially ({why}); use spatial: replicate for it")
        elif not spatial_in:
            split = REPLICATED
        elif role in ("window", "transposed", "resample", "nested"):
            # split by the grid; a layer on an already replicated input too small to split (after a
            # global pooling) stays replicated. The model input is not such an input: a grid finer than
            # it is refused by the layer that would split it first, as any split that empties a shard
            small = any(in_shape[2 + k] < p for k, p in enumerate(grid.spatial))
            first_reader = INPUT in node.inputs and input_split is None
            replicate = small and not first_reader and not _split_input(node, out_split, input_split)
            split = REPLICATED if replicate else grid.spatial
        elif role in ("pointwise", "reduce", "shape", "volume_reduction"):  # a shape read: as it is
            split = producer
        elif role == "output":  # split outputs stay split where one share of the volume weighs them all
            extents = {shapes[index[n]][1][2:] if n != INPUT else a.input_shape[2:] for n in node.inputs}
            ranks = {len(shapes[index[n]][1]) if n != INPUT else 5 for n in node.inputs}
            split = producer if len(extents) == 1 and ranks == {5} else REPLICATED
        elif role == "unregistered" and _split_input(node, out_split, input_split):
            raise SpecError(f"{node.name} ({node.kind}): {registry.unregistered(node.module)} and its "
                            f"input is split {list(producer)}: register it (hybridpar.nn.register, see the "
                            f"README) so it can run split, or add a rule "
                            f"{{{node.name!r}: {{spatial: replicate}}}} to run it whole after a gather")
        else:
            split = REPLICATED
        if split != REPLICATED and not mapped and not spec.strict and node.name not in rule_of \
                and not (INPUT in node.inputs and input_split is None):
            try:  # too small to split here: replicated, and what reads it after it, until it is large again
                a.halos(i, entry, split)
                if role == "nested" and not _check_nested(node, in_shape, split, micro):  # its own layers,
                    whole_out.add(node.name)  # each on its own extents; its output replicated
            except TooSmallToSplit as err:
                auto[node.name] = _too_small(in_shape, out_shape, split, err)
                split = REPLICATED
        elif role == "nested" and split != REPLICATED:  # a rule's split, strict, or the first reader
            if not _check_nested(node, in_shape, split, micro):
                whole_out.add(node.name)
        if split == REPLICATED and len(out_shape) == 5 and node.name not in rule_of and node.name not in auto:
            from_auto = next((n for n in node.inputs if n in auto), None)
            if from_auto is not None:
                auto[node.name] = f"reads {from_auto}, replicated"
        if INPUT in node.inputs and input_split is None:
            input_split = split if spatial_in else REPLICATED
        replicated_out = node.name in whole_out or role == "volume_reduction" or \
            (entry is not None and entry.replicated_output(node.module))
        out_split[node.name] = split if mapped else \
            REPLICATED if (replicated_out or len(out_shape) != 5) else split
        splits.append(split)
        halo_list.append(((0, 0),) * 3 if mapped else a.halos(i, entry, split))
        gathers.append(split == REPLICATED and spatial_in and _split_input(node, out_split, input_split)
                       and node.name not in auto)
    # a gather is flagged where the activation is split again after it (inside a split region)
    split_later = [False] * len(nodes)
    later = False
    for i in range(len(nodes) - 1, -1, -1):
        split_later[i] = later
        later = later or splits[i] != REPLICATED
    gathers = [g and s for g, s in zip(gathers, split_later, strict=True)]

    input_split = input_split or REPLICATED
    local_out = [local_shape(o, micro, out_split[n.name]) for n, (_, o) in zip(nodes, shapes, strict=True)]
    local_in = [local_shape(shapes[i][0], micro, splits[i]) for i in range(len(nodes))]
    for i, n in enumerate(nodes):  # a reshape chain's values hold the shard's voxels in other dims
        sm = a.space_maps.get(n.name)
        if sm is not None and chain_split.get(sm.nodes[0]):
            local_out[i] = sm.loaded_shape(n.name, micro, splits[i])
            k = sm.nodes.index(n.name)
            local_in[i] = sm.loaded_shape(sm.nodes[k - 1], micro, splits[i]) if k else local_in[i]
    act = [0 if n.name in a.graph.values or n.name == OUTPUT else BYTES_PER_ELEMENT * math.prod(lo)
           for n, lo in zip(nodes, local_out, strict=True)]  # values and the outputs' structure hold none
    shares = [rank_share(n.module, shapes[i][0], shapes[i][1], local_out[i], splits[i])
              for i, n in enumerate(nodes)]
    if pipe.stages == "auto":
        in_bytes = BYTES_PER_ELEMENT * math.prod(local_shape(a.input_shape, micro, input_split))
        sends = live_bytes(a.graph, act, in_bytes)
        starts = auto_stages([f * sh for f, sh in zip(a.train_flops, shares, strict=True)], act, grid.pipe,
                             sends)
    else:
        starts = named_stages(pipe.stages, leaves, a.containers)  # count checked by ParallelSpec
    stage_of = [sum(1 for s in starts if s <= i) - 1 for i in range(len(nodes))]
    for first, split in chain_split.items():
        names = a.space_maps[first].nodes
        if split is not None and len({stage_of[index[n]] for n in names}) > 1:
            raise SpecError(f"pipeline: a stage cut falls inside the reshapes {', '.join(names)}, which run "
                            f"on each shard between channels and space; name stages (pipeline.stages) that "
                            f"begin before {names[0]} or after {names[-1]}")
    if grid.pipe > 1 and a.graph.values:  # a cut carries tensors: a size read before it is read again
        for i, live in enumerate(live_across(a.graph)[:-1]):
            crossing = [v for v in live if v in a.graph.values] if stage_of[i] != stage_of[i + 1] else []
            if crossing:
                raise SpecError(f"pipeline: the cut after {nodes[i].name} would carry {crossing[0]}, a value "
                                f"computed from shapes, not a tensor; name stages (pipeline.stages) that "
                                f"begin before the shape is read or after its last use")

    def redistributes(i: int) -> bool:
        node = nodes[i]
        if len(shapes[i][0]) != 5:
            return False
        srcs = [(input_split, a.input_shape) if n == INPUT else (out_split[n], shapes[index[n]][1])
                for n in node.inputs]
        return any(s != splits[i] and not broadcasts(s, shape) for s, shape in srcs if len(shape) == 5)

    return [LayerPlan(
        name=node.name, kind=node.kind, stage=stage_of[i], split=splits[i],
        rule=rule_of[node.name].pattern if node.name in rule_of else None,
        input_shape=shapes[i][0], output_shape=shapes[i][1],
        local_input_shape=local_in[i], local_output_shape=local_out[i],
        halo=halo_list[i], params=sum(p.numel() for p in node.module.parameters()) if node.module else 0,
        flops=a.flops[i], activation_bytes=act[i], redistribute=redistributes(i),
        train_flops=a.train_flops[i], inputs=node.inputs, out_split=out_split[node.name], gather=gathers[i],
        auto_replicated=auto.get(node.name, ""),
        transpose_bytes=transpose_bytes(node.module, shapes[i][0], splits[i], micro), rank_share=shares[i])
        for i, node in enumerate(nodes)]


def _space_map_split(space_map: SpaceMap, producer: Split, rule_of: dict[str, LayerRule]) -> Split | None:
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



def build_plan(spec: ParallelSpec, model: nn.Module, input_shape: Sequence[int],
               world_size: int | None = None, graph: ModelGraph | None = None) -> list[LayerPlan]:
    """Resolve ``spec`` for ``model`` (traced once more unless its ``graph`` is given) on a global
    input of ``input_shape`` (N, C, D, H, W). A caller resolving many specs for one model analyses
    it once (:func:`hybridpar.planner.analysis.analyse`) and calls :func:`resolve` per spec."""
    shape = check_input_shape(input_shape)
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    elif not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
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
