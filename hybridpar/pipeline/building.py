"""Building an engine: a model and a spec -> the plan, the job's layout, and this rank's stage.

Why a part of its own: the build runs once, in a fixed order every rank follows alike (trace, check
the trace, plan, resolve the layouts and create every group in one order, open the stage transport,
build this rank's stage, derive the plans at other sizes), and what it leaves (:class:`Built`) is
all the stepping and predicting parts read. A new parallel axis changes this part and the layout
record (:mod:`hybridpar.job_layout`), not how a step runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from hybridpar.grid import ProcessGrid
from hybridpar.job_layout import JobLayout
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.pipeline import model_state as state
from hybridpar.pipeline.alike import raised_alike
from hybridpar.pipeline.convert import one_build
from hybridpar.pipeline.reducer import GradReducer
from hybridpar.pipeline.running_stats import ReplicaStats
from hybridpar.pipeline.sizes import SizePlans
from hybridpar.pipeline.stage import Stage, StageBuilder
from hybridpar.pipeline.stage_transport import StageTransport
from hybridpar.planner import ParallelSpec
from hybridpar.planner.faithful import check_faithful
from hybridpar.planner.graph import ModelGraph, UntraceableError, refuse_in_pipeline
from hybridpar.planner.graph import trace as trace_graph
from hybridpar.planner.plan import build_plan
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.swapped import one_plan
from hybridpar.planner.untouched import left_as_found


@dataclass
class Source:
    """What a build starts from: the model, its traced graph (None: it runs by module swapping, for
    the reason ``untraced``). The engine lets go of it once built (see :meth:`Engine._build`)."""

    model: nn.Module
    graph: ModelGraph | None
    untraced: str = ""

    @classmethod
    def trace(cls, model: nn.Module, spec: ParallelSpec) -> Source:
        """The model traced, or marked to run by module swapping where torch.fx cannot trace it."""
        try:
            with left_as_found(model):  # the trace runs the forward's Python: what it moves is put back
                graph = trace_graph(model)
        except UntraceableError as err:
            return cls(model, None, untraced_by(err, spec))
        if graph.mode_dependent and spec.grid.pipe == 1 and not spec.layers:
            # ``if self.training:`` (deep supervision's extra outputs): a graph holds one branch, the
            # forward's own Python both, so it runs by module swapping and validates as it trains;
            # a pipeline or per-layer rules need the graph, which then runs in its traced mode only
            return cls(model, None, f"model ({type(model).__name__}): its forward differs between training "
                                    f"and eval (it reads self.training), and a traced graph holds one branch")
        return cls(model, graph)

    def checked(self, spec: ParallelSpec, input_shape: tuple[int, ...]) -> None:
        """Never train on a graph that computes something other than the model's forward: a graph that
        does not make the forward's own operations at ``input_shape`` gives way to module swapping."""
        if self.graph is not None:
            try:
                check_faithful(self.graph, self.model, input_shape)
            except UntraceableError as err:
                self.graph, self.untraced = None, untraced_by(err, spec)


def untraced_by(err: UntraceableError, spec: ParallelSpec) -> str:
    """The reason a model runs by module swapping (``err``), which a pipeline cannot."""
    refuse_in_pipeline(err, spec.grid.pipe)
    return str(err)


@dataclass
class Built:
    """What a build leaves: the plan, the job's layout, the stage transport, this rank's stage, the
    plans at other sizes and the original model's state-dict keys."""

    plan: list[LayerPlan]
    layout: JobLayout
    transport: StageTransport
    stage: Stage
    sizes: SizePlans
    state_keys: state.ModelKeys
    returns: dict = field(default_factory=dict)  # predicting.returned_in's, per size and mode


def build(source: Source, spec: ParallelSpec, grid: ProcessGrid, world: int, input_shape: tuple[int, ...],
          overlap: bool, memory_format: torch.memory_format) -> Built:
    """Plan, layouts and groups (in one order on every rank), the stage transport, then this rank's
    stage, its split layers' weights marked agreed (they are the first rank's, broadcast before). The
    random generators are left as the build found them: a split layer made draws its own weights
    before it takes the model's, which would move the stream a loss or a dropout draws from next."""
    source.checked(spec, input_shape)
    model, graph = source.model, source.graph
    # the forward run by module swapping followed once for the plan and the stage
    with one_plan(), torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        plan = build_plan(spec, model, input_shape, world, graph)
        layout = JobLayout.resolve(grid, [lp.split for lp in plan])
        transport = StageTransport(grid, memory_format)
        with raised_alike(), one_build():  # a stage's refusal is every stage's; so is a parameter two
            # layers apply with gradients counted apart
            stage = StageBuilder(model, graph, spec, layout, overlap, source.untraced).build(plan,
                                                                                             input_shape)
        # the plans at other sizes (predict, shard_batch), from the model's structure on the meta device
        sizes = SizePlans(model, graph is not None, spec, world, plan, input_shape)
    for _, layer in stage.layers:
        for m in layer.modules():
            if isinstance(m, SpatialLayer):
                m.weights_agreed()
    # Keep only what the original model is still needed for (its state-dict keys, in order): every
    # rank holding all stages' weights would defeat a pipeline of a model too big for one.
    run = None if graph is None else {n.target for n in graph.nodes if n.op == "module"}
    keys = state.ModelKeys(model, run)  # module swapping runs the whole model
    return Built(plan, layout, transport, stage, sizes, keys)


def reducers(built: Built, params: list[nn.Parameter], bucket_bytes: int
             ) -> tuple[GradReducer | None, ReplicaStats | None]:
    """The gradient reducer over the stage's data × spatial ranks, and the norm layers' running
    statistics averaged over the data-parallel replicas (None where one rank or replica alone)."""
    grid = built.layout.grid
    reducer = GradReducer(params, grid.stage_group, bucket_bytes) if grid.data * grid.stage_size > 1 else None
    stats = ReplicaStats([m for _, m in built.stage.layers], grid.data_group) if grid.data > 1 else None
    return reducer, stats
