"""This rank's stage, built from the plan: its layers as Dist layers, the groups they use, and what
the engine needs to know about its ends (the input's split, the output's).

Why a module of its own: building a stage is done once and is pure bookkeeping over the plan (which
layers run here, in which split, where a Redistribute goes); running it is the runtime's business
(:mod:`hybridpar.pipeline.runtime`). A sequence's stage is a list of layers; a graph's runs in
:class:`~hybridpar.pipeline.stage_graph.StageGraph`; an untraceable model (no pipeline) runs by
module swapping (:mod:`hybridpar.pipeline.swap`).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten

from hybridpar.call_keys import module_path
from hybridpar.comm.redistribute import local_box
from hybridpar.grid import ProcessGrid
from hybridpar.job_layout import JobLayout
from hybridpar.nn.layout import Redistribute
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.pipeline import deferred
from hybridpar.pipeline.convert import to_distributed
from hybridpar.pipeline.model_state import Layers
from hybridpar.pipeline.split_forward import bind_nested, follow
from hybridpar.pipeline.stage_graph import StageGraph
from hybridpar.pipeline.swap import swap
from hybridpar.planner import ParallelSpec
from hybridpar.planner.analysis import KEPT_WHOLE, REPLICATED, kept_whole
from hybridpar.planner.graph import INPUT, OUTPUT, ModelGraph, out_node, pack_output
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.swapped import nested_block, returned
from hybridpar.planner.terms import SpecError, Split


@dataclass
class Stage:
    """This rank's part of the model (see module doc)."""

    layers: Layers  # the name is "" for one module that stands for a whole stage (graph, swapped)
    stage_graph: StageGraph | None
    defer: list[bool]  # per layer: may its weight gradients wait (deferred.deferrable)
    first_layer: LayerPlan  # the plan rows of the stage's first and last layers
    last_layer: LayerPlan
    input_split: tuple[int, int, int]  # the split of the model input (of its first reader)
    output_record: LayerPlan  # the plan row of the model's output
    output_split: tuple[int, int, int]
    outputs: list[LayerPlan]  # the plan rows of the outputs (one, or those of a returned tuple, list, dict)
    output_spec: TreeSpec | None  # the structure the outputs are returned in (None: one tensor)
    # Where the plan's shapes live in the built layers, each as (module, plan row index, "in" | "out"):
    # a split layer's global input shape, a Redistribute's global shape, a swapped block's input (see bind)
    sinks: list[tuple[nn.Module, int, str]] = dataclasses.field(default_factory=list)
    ends: tuple[int, int, int] = (0, 0, 0)  # the plan row indices of first_layer, last_layer, output_record
    output_rows: list[int] | None = None  # the plan row indices of outputs (None: rows of their own)

    def bind(self, plan: list[LayerPlan], input_shape: tuple[int, ...], outputs: list[LayerPlan],
             made: dict[str, nn.Module] | None = None) -> None:
        """Give every shape the built layers hold the value it has in ``plan``, a plan of the same
        decisions as the built one (every row in the same split) for the global ``input_shape``:
        the layers then run on inputs of that size, their halo plans memoised per shape. The one
        place a stage's shapes are set, at build and at any other size. ``made``: the stand-ins of
        calls whose arguments the forward computes from shapes, where they differ at this size
        (:attr:`hybridpar.pipeline.sizes.SizePlans.made`)."""
        if self.stage_graph is not None:  # first: it may refuse the size, before any shape is set
            self.stage_graph.bind(plan, input_shape, made or {})
        for m, row, end in self.sinks:
            if row < 0:  # a forward run by module swapping: the model's input
                bind_nested(m, input_shape)
                continue
            shape = tuple(plan[row].input_shape[2:] if end == "in" else plan[row].output_shape[2:])
            if isinstance(m, SpatialLayer):
                m.global_input_shape = shape
            elif not bind_nested(m, plan[row].input_shape):  # a Redistribute
                m.shape = shape
        first, last, out = self.ends
        self.first_layer, self.last_layer, self.output_record = plan[first], plan[last], plan[out]
        self.outputs = outputs

    def outputs_at(self, plan: list[LayerPlan], model: nn.Module, input_shape: tuple[int, ...]
                   ) -> list[LayerPlan]:
        """The rows of the outputs in ``plan`` (for the global ``input_shape``; ``model``: the model, or
        a copy of it on the meta device, for the rows a module-swapped model's structure makes)."""
        if self.output_rows is not None:
            return [plan[i] for i in self.output_rows]
        return swapped_outputs(model, plan[-1], self.input_split, input_shape)[0]

    @property
    def lead_output(self) -> LayerPlan:
        """The plan row of the first volume output (its split and extents are every split output's)."""
        return next((r for r in self.outputs if len(r.output_shape) == 5), self.outputs[0])

    def recv_shape(self, b: int, layout: Callable[[tuple[int, int, int]], ProcessGrid]) -> tuple[int, ...]:
        """The shape of the activation of ``b`` samples this stage receives (a stage after the first):
        a graph's cut carries its live values flat; a sequence's, its first layer's input shard."""
        if self.stage_graph is not None:
            return (self.stage_graph.recv_numel(b),)
        shape = self.first_layer.input_shape
        if len(shape) == 5:
            box = local_box(tuple(shape[2:]), layout(self.first_layer.split))
            return (b, shape[1], *(hi - lo for lo, hi in box))
        return (b, *shape[1:])


def swapped_outputs(model: nn.Module, last: LayerPlan, split: Split, input_shape: tuple[int, ...]
                    ) -> tuple[list[LayerPlan], TreeSpec | None, Split]:
    """What a model run by module swapping returns (a meta forward of ``model``, or of its copy on the
    meta device, its layouts followed as the run follows them: :func:`returned`): one row per output,
    each the last layer's row with that output's shape and layout, the structure (None: one tensor),
    and the outputs' split. Split outputs share one extent and are not mixed with replicated ones."""
    leaves, splits, spec = returned(model, input_shape, split)
    split_out = [t for t, s in zip(leaves, splits, strict=True) if s]
    if split_out and (len(split_out) != len(leaves) or len({tuple(t.shape[2:]) for t in split_out}) > 1):
        raise SpecError(f"model ({type(model).__name__}): run by module swapping, it returns "
                        f"{[list(getattr(t, 'shape', [])) for t in leaves]}, of which the volumes "
                        f"{[list(t.shape) for t in split_out]} are split {list(split)}; returned volumes "
                        f"must be split alike (one extent) or all whole (a traced forward gathers them)")
    out_split = split if split_out else REPLICATED
    rows = [dataclasses.replace(last, name=f"{OUTPUT}[{k}]" if len(leaves) > 1 else last.name,
                                output_shape=tuple(getattr(t, "shape", ())), out_split=out_split)
            for k, t in enumerate(leaves)]
    return rows, None if len(leaves) == 1 and spec.is_leaf() else spec, out_split


def split_layer(layout: Callable[[Split], ProcessGrid], overlap: bool, name: str, module: nn.Module,
                lp: LayerPlan) -> nn.Module:
    """The layer ``name`` (``module``) as this rank runs it under ``lp``'s split, its global input shape
    ``lp``'s: a function of the layout alone, so that a stage graph that remakes a call's layer at
    another size (:meth:`StageGraph.bind`) holds no reference to the model it was built from."""
    m = to_distributed(module, layout(lp.split), overlap, name)
    if isinstance(m, SpatialLayer):
        m.layer_name = f"{type(m).__name__}({name})"
        m.global_input_shape = tuple(lp.input_shape[2:])
    return m


class StageBuilder:
    """Builds :class:`Stage` from ``model`` (traced as ``graph``, or None: untraceable, for the
    reason ``untraced``) under the resolved ``spec``, in the job's ``layout``."""

    def __init__(self, model: nn.Module, graph: ModelGraph | None, spec: ParallelSpec, layout: JobLayout,
                 overlap: bool, untraced: str = "") -> None:
        self.model, self.graph, self.spec, self.job = model, graph, spec, layout
        self.grid = layout.grid
        self.overlap, self.untraced = overlap, untraced

    def layout(self, split: tuple[int, int, int]) -> ProcessGrid:
        """The grid of a split the plan uses (resolved once, :class:`JobLayout`)."""
        return self.job.of(split)

    def build(self, plan: list[LayerPlan], input_shape: tuple[int, ...]) -> Stage:
        stage = self.grid.pipe_index
        rows = [i for i, lp in enumerate(plan) if lp.stage == stage]
        lo, hi = rows[0], rows[-1] + 1
        mine = plan[lo:hi]
        self.index = {id(lp): i for i, lp in enumerate(plan)}  # a row's index (names repeat when swapped)
        self.sinks: list[tuple[nn.Module, int, str]] = []
        reader = next(lp for lp in plan if INPUT in lp.inputs)
        input_split = reader.split if len(reader.input_shape) == 5 else REPLICATED
        graph = self.graph
        out_row = len(plan) - 1 if graph is None else next(i for i, lp in enumerate(plan)
                                                            if lp.name == graph.output)
        out = plan[out_row]
        output_split = out.output_split if len(out.output_shape) == 5 else REPLICATED
        output_rows: list[int] | None = [out_row]
        outputs, spec = [out], None
        if graph is not None and graph.output == OUTPUT:  # a structure: its volumes in one split
            index = {lp.name: i for i, lp in enumerate(plan)}
            output_rows, output_split = [index[n] for n in out.inputs], out.split
            outputs = [plan[i] for i in output_rows]
            spec = tree_flatten(pack_output(out_node(graph).fx_node.args[0]))[1]
        elif graph is None:
            input_split = self.spec.grid.spatial if len(input_shape) == 5 else REPLICATED  # the plan's
            outputs, spec, output_split = swapped_outputs(self.model, out, input_split, input_shape)
            output_rows = None
        stage_graph = None
        if graph is None:
            layers: Layers = [("", self._swapped(plan, input_shape))]
        elif graph.chain and all(n.op == "module" for n in graph.nodes):
            layers = self._chain_layers(plan, mine, stage, output_split)
        else:  # a graph: this stage's nodes run by one module, every live value carried across cuts
            stage_graph = StageGraph(graph, plan, lo, hi, input_shape, input_split, self.layout, self.convert,
                                     functools.partial(split_layer, self.job.of, self.overlap))
            layers = [("", stage_graph)]
        self._warn_gathers(plan)
        self._warn_replicated(plan)
        built = Stage(layers, stage_graph, deferred.deferrable([m for _, m in layers]), mine[0], mine[-1],
                      input_split, out, output_split, [], spec, self.sinks,
                      (lo, hi - 1, out_row) if graph is not None else (0, -1, -1),  # swapped: any length
                      output_rows)
        built.bind(plan, input_shape, outputs)
        return built

    def convert(self, name: str, module: nn.Module, lp: LayerPlan) -> nn.Module:
        """The layer ``name`` (``module``) as this rank runs it under ``lp``'s split (its global input
        shape is set by :meth:`Stage.bind`); a block torch.fx could not trace into runs by module
        swapping inside it (:mod:`hybridpar.pipeline.split_forward`)."""
        if lp.split != REPLICATED and nested_block(module):
            def inner(path: str, m: nn.Module, grid: ProcessGrid) -> nn.Module:
                d = to_distributed(m, grid, self.overlap, f"{name}.{path}")
                if isinstance(d, SpatialLayer):
                    d.layer_name = f"{type(d).__name__}({name}.{path})"
                return d

            grid = self.layout(lp.split)
            block, whole = swap(module, grid, inner)
            follow(block, grid, whole, self._to_dist, lp.input_shape)
            self.sinks.append((block, self.index[id(lp)], "in"))
            return block
        m = split_layer(self.job.of, self.overlap, name, module, lp)
        if isinstance(m, SpatialLayer):
            self.sinks.append((m, self.index[id(lp)], "in"))
        return m

    def _redistribute(self, src: tuple[int, int, int], dst: tuple[int, int, int], lp: LayerPlan,
                      end: str) -> Redistribute:
        """A Redistribute of ``lp``'s input (``end`` "in") or output ("out") from ``src`` to ``dst``."""
        r = Redistribute(self.layout(src), self.layout(dst))
        self.sinks.append((r, self.index[id(lp)], end))
        return r

    def _swapped(self, plan: list[LayerPlan], input_shape: tuple[int, ...]) -> nn.Module:
        """The untraceable model with its layers swapped for their split versions (said once)."""
        if dist.get_rank() == 0:
            warnings.warn(f"hybridpar.parallelize: {self.untraced}. Running it by module swapping: its "
                          f"own forward on shards, every registered layer split "
                          f"{list(self.spec.grid.spatial)}", stacklevel=5)
        # a layer is converted by its first call on the split volume (one called on a pooled value
        # too runs whole there: split_forward's _whole_on_replicated), else by its first call
        first = {module_path(lp.name): lp
                 for lp in sorted(reversed(plan), key=lambda lp: lp.split != REPLICATED)}
        whole_run = kept_whole(plan)  # made for a whole run: read whole at every size

        def convert(name: str, m: nn.Module, grid: ProcessGrid) -> nn.Module:
            # no sinks: the forward's run gives each split layer its input's global shape as it calls it
            # (split_forward's before_layer), whatever calls the forward makes at a size
            if name in first:
                d = split_layer(self.job.of, self.overlap, name, m, first[name])
                if name in whole_run:
                    setattr(d, KEPT_WHOLE, True)
                return d
            return to_distributed(m, grid, self.overlap, name)  # never called on this input

        grid = self.layout(self.spec.grid.spatial)
        swapped, whole = swap(self.model, grid, convert)
        if grid.spatial_size > 1:
            follow(swapped, grid, whole, self._to_dist, input_shape)
            self.sinks.append((swapped, -1, "in"))
        return swapped

    def _to_dist(self, m: nn.Module, grid: ProcessGrid) -> nn.Module:
        """The split counterpart of a layer a call in a forward stands for (``F.interpolate``)."""
        return to_distributed(m, grid, self.overlap)

    def _chain_layers(self, plan: list[LayerPlan], mine: list[LayerPlan], stage: int,
                      output_split: tuple[int, int, int]) -> Layers:
        """A sequence's stage: its layers in order, Redistributes where the split changes, and one at
        the end into the next stage's split (the last stage keeps the output's)."""
        layers: Layers = []
        for i, lp in enumerate(mine):
            if i > 0 and mine[i - 1].output_split != lp.split:
                layers.append((None, self._redistribute(mine[i - 1].output_split, lp.split, lp, "in")))
            path = module_path(lp.name)  # a module without weights called again: "act#1"
            layers.append((None if path != lp.name else lp.name,
                           self.convert(lp.name, self.model.get_submodule(path), lp)))
        following = [lp for lp in plan if lp.stage == stage + 1]
        out_split = mine[-1].output_split
        target = following[0].split if following else output_split
        if target != out_split:  # hand over in the next stage's split (or the output's for the loss)
            layers.append((None, self._redistribute(out_split, target, mine[-1], "out")))
        return layers

    @staticmethod
    def _warn_replicated(plan: list[LayerPlan]) -> None:
        """Never replicate silently: layers the planner runs whole because their volume is too small to
        split (auto-replication; ``strict: true`` refuses instead) are said once per job (rank 0)."""
        auto = [lp for lp in plan if lp.auto_replicated]
        if auto and dist.get_rank() == 0:
            names = ", ".join(lp.name for lp in auto[:6]) + (", ..." if len(auto) > 6 else "")
            warnings.warn(f"hybridpar.parallelize: {len(auto)} layer(s) run replicated, their volume too "
                          f"small to split ({auto[0].auto_replicated}): {names}; engine.explain() marks "
                          f"them '!', and strict: true in the spec refuses instead", stacklevel=4)

    @staticmethod
    def _warn_gathers(plan: list[LayerPlan]) -> None:
        """Never replicate silently: a gather inside a split region is said once per job (rank 0)."""
        gathers = [lp for lp in plan if lp.gather]
        if gathers and dist.get_rank() == 0:
            names = ", ".join(f"{lp.name} ({lp.kind})" for lp in gathers[:6])
            warnings.warn(f"hybridpar.parallelize: {len(gathers)} layer(s) gather a split activation onto "
                          f"every rank inside a split region: {names}; each holds the whole volume. Register "
                          f"the layer type (hybridpar.nn.register) to run it split, or say spatial: "
                          f"replicate for it in the spec to silence this", stacklevel=4)
