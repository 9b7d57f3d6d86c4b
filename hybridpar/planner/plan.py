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
from typing import NamedTuple

from torch import nn

from hybridpar import globs
from hybridpar.nn import samples
from hybridpar.planner.analysis import REPLICATED, Analysis, analyse, check_input_shape
from hybridpar.planner.graph import OUTPUT, ModelGraph, UntraceableError, refuse_in_pipeline
from hybridpar.planner.placement import Walk
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.spec_view import GridView, RuleView, SpecView
from hybridpar.planner.stages import auto_stages, describe_layers, live_across, live_bytes, named_stages
from hybridpar.planner.swapped import judge_registered, swapped_plan
from hybridpar.planner.terms import SpecError, Split

__all__ = ["build_plan", "resolve"]

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


def _sizes(a: Analysis, walk: Walk) -> _Sizes:
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


def _stage_of(spec: SpecView, a: Analysis, walk: Walk, sizes: _Sizes, blocked: dict[int, str]) -> list[int]:
    """Each node's pipeline stage: balanced by the most loaded rank's work (``stages: auto``, never at
    a cut in ``blocked``, :func:`_cut_faults`), or begun at the named layers."""
    if spec.pipeline.stages == "auto":
        in_bytes = BYTES_PER_ELEMENT * math.prod(local_shape(a.input_shape, walk.micro, walk.input_layout))
        sends = live_bytes(a.graph, sizes.act, in_bytes)
        work = [f * sh for f, sh in zip(a.train_flops, sizes.shares, strict=True)]
        try:
            starts = auto_stages(work, sizes.act, spec.grid.pipe, sends, blocked=set(blocked))
        except SpecError as err:  # no cut left: say why the first refused one is
            raise SpecError(f"{err}; e.g. {next(iter(blocked.values()))}" if blocked else str(err)) from None
    else:
        starts = named_stages(spec.pipeline.stages, a.leaves, a.containers)  # count checked by ParallelSpec
    return [sum(1 for s in starts if s <= i) - 1 for i in range(len(a.graph.nodes))]


def _cut_faults(a: Analysis, walk: Walk) -> dict[int, str]:
    """Per node index ``j``, why a stage may not begin there: the cut before it falls inside a reshape
    chain run on each shard, or would carry a value computed from shapes (what crosses a cut is a
    tensor)."""
    faults: dict[int, str] = {}
    for first, split in walk.chain_split.items():
        if split is None:
            continue
        names = a.space_maps[first].nodes
        why = (f"a stage cut falls inside the reshapes {', '.join(names)}, which run on each shard between "
               f"channels and space; name stages (pipeline.stages) that begin before {names[0]} or after "
               f"{names[-1]}")
        at = sorted(walk.index[n] for n in names)  # every start from its second node to its last
        faults.update(dict.fromkeys(range(at[0] + 1, at[-1] + 1), why))
    if a.graph.values:  # a size read before a cut is read again after it
        for i, live in enumerate(live_across(a.graph)[:-1]):
            crossing = [v for v in live if v in a.graph.values]
            if crossing:
                faults.setdefault(i + 1, f"the cut after {a.graph.nodes[i].name} would carry {crossing[0]}, "
                                         f"a value computed from shapes, not a tensor; name stages "
                                         f"(pipeline.stages) that begin before the shape is read or after "
                                         f"its last use")
    return faults


def _check_cuts(a: Analysis, faults: dict[int, str], stage_of: list[int], pipe: int) -> None:
    """Refuse a stage cut ``faults`` names (:func:`_cut_faults`), or one that parts tied weights."""
    if pipe == 1:
        return
    for j in range(1, len(stage_of)):
        if stage_of[j] != stage_of[j - 1] and j in faults:
            raise SpecError(f"pipeline: {faults[j]}")
    _check_shared(a, stage_of)


def _check_shared(a: Analysis, stage_of: list[int]) -> None:
    """Refuse a parameter that layers of two stages apply (tied weights): each stage's ranks reduce
    their own gradients, so each copy would move by its own stage's part alone."""
    first: dict[int, tuple[str, int]] = {}
    for i, node in enumerate(a.graph.nodes):
        for name, p in node.module.named_parameters() if node.module is not None else ():
            where, stage = first.setdefault(id(p), (f"{node.name}.{name}", stage_of[i]))
            if stage != stage_of[i]:
                raise SpecError(f"pipeline: {where} (stage {stage}) and {node.name}.{name} (stage "
                                f"{stage_of[i]}) are one parameter, whose gradient each stage would reduce "
                                f"apart; name stages (pipeline.stages) that keep the layers sharing it "
                                f"together, or untie it")


def _rows(a: Analysis, walk: Walk, stage_of: list[int], sizes: _Sizes) -> list[LayerPlan]:
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
    walk = Walk(spec, a, _rules_by_node(spec.layers, a.leaves), micro)
    for i, node in enumerate(a.graph.nodes):
        walk.place(i, node)
    sizes = _sizes(a, walk)
    faults = _cut_faults(a, walk) if spec.grid.pipe > 1 else {}
    stage_of = _stage_of(spec, a, walk, sizes, faults)
    _check_cuts(a, faults, stage_of, spec.grid.pipe)
    return _rows(a, walk, stage_of, sizes)


def build_plan(spec: SpecView, model: nn.Module, input_shape: Sequence[int],
               world_size: int | None = None, graph: ModelGraph | None = None) -> list[LayerPlan]:
    """Resolve ``spec`` for ``model`` (traced once more unless its ``graph`` is given) on a global
    input of ``input_shape`` (N, C, D, H, W). A caller resolving many specs for one model analyses
    it once (:func:`hybridpar.planner.analysis.analyse`) and calls :func:`resolve` per spec."""
    shape = check_input_shape(input_shape)
    spec = _on_world(spec, world_size)
    micro = _batch(spec.grid, spec.pipeline.microbatches, shape[0])  # batch errors before any tracing
    try:
        rows = resolve(spec, analyse(model, shape, graph))
    except UntraceableError as err:
        refuse_in_pipeline(err, spec.grid.pipe)
        if spec.layers:
            raise SpecError(f"{err}. Such a model runs by module swapping, every layer under the grid's "
                            f"split: per-layer rules (layers: {[r.pattern for r in spec.layers]}) need the "
                            f"traced graph") from None
        rows = swapped_plan(model, shape, spec.grid.spatial, micro, strict=spec.strict)
    if spec.pipeline.microbatches > 1 and not spec.pipeline.micro_batch_stats:
        _judge_registered(model, rows, micro)
    return rows


def _judge_registered(model: nn.Module, rows: list[LayerPlan], micro: int) -> None:
    """Refuse a registered layer of the user's own whose forward works across the samples of the batch
    that micro-batches hold apart (:func:`hybridpar.planner.swapped.judge_registered`)."""
    for r in rows:
        try:
            m = model.get_submodule(r.name.split("#")[0])
        except AttributeError:  # a function's row (interpolate)
            continue
        if samples.judged_by_forward(m):
            judge_registered(m, r.input_shape, micro, r.name)
