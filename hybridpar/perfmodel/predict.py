"""Predict one training step of a spec: compute, communication, pipeline and memory terms assembled.

Why a module of its own: :func:`predict` is the model's one entry point; it resolves the spec with
the one planner (:meth:`Workload.plan`), costs every layer (:mod:`.compute`, :mod:`.comm`), sums
them per stage and micro-batch, lays the stages out in time (:mod:`.pipeline`), adds the exposed
gradient all-reduce and fixed overheads, and takes each stage's memory (:mod:`.memory`).

Gradients: a ring all-reduce of the stage's parameters over its data x spatial ranks, overlapped
with the last backward by ``Machine.grad_overlap`` and the drain of the stages before it; the global
loss, one tiny all-reduce over the replicas at the step's end on the stages before the last. Shared
cores (CPU only): ``Machine.contention`` multiplies compute when two or more ranks share a node;
ranks beyond ``Machine.cores`` time-share the cores: a rank's compute stretches by the busy ranks
per core, and the step takes at least the node's busy time (compute and transfers, not waits)
divided by the cores. A message costs the calibrated latency even then: its receiver sleeps in the
receive, and a task waking from sleep runs ahead of those that used their slices.
``Machine.drift`` multiplies all compute (a shared host's speed now against at calibration).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from hybridpar.perfmodel.comm_cost import allreduce_parts, allreduce_time, link_between, redistribution
from hybridpar.perfmodel.compute import LayerCost, layer_costs
from hybridpar.perfmodel.machine import Link, Machine, get_machine
from hybridpar.perfmodel.memory_cost import stage_memory
from hybridpar.perfmodel.pipeline_cost import deferred_weights, drain_saving
from hybridpar.perfmodel.workload import Workload
from hybridpar.planner.analysis import REPLICATED
from hybridpar.planner.config import ParallelSpec
from hybridpar.planner.graph import INPUT, ModelGraph
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.schedule import bubble_fraction, fill_drain_time
from hybridpar.planner.stages import live_bytes

__all__ = ["Prediction", "StageCost", "predict"]


@dataclass
class StageCost:
    """Per micro-batch times of one stage on its most loaded rank, and its memory."""

    stage: int
    compute: float
    halo: float
    send: float
    grad_reduce: float
    params: int
    memory: dict[str, float]
    latency: float = 0.0  # message latencies inside halo and send
    grad_reduce_latency: float = 0.0
    send_latency: float = 0.0  # the latencies inside send: hidden once the pipeline is full

    @property
    def time(self) -> float:
        return self.compute + self.halo + self.send


@dataclass
class Prediction:
    """Predicted step of ``spec`` on ``machine``; ``breakdown`` sums to ``step_time``."""

    spec: ParallelSpec
    machine: str
    world: int
    batch: int
    step_time: float
    breakdown: dict[str, float]
    memory: dict[str, float]          # bytes per rank on the stage that needs most
    model_flops: int                  # matmul FLOPs of the step (the whole global batch)
    stages: list[StageCost]
    layers: list[LayerCost] = field(repr=False)
    bubble: float = 0.0
    oversubscribed: bool = False

    @property
    def samples_per_s(self) -> float:
        return self.batch / self.step_time

    @property
    def flops_per_s(self) -> float:
        return self.model_flops / self.step_time

    @property
    def peak_memory(self) -> float:
        return self.memory["total"]

    def summary(self) -> str:
        g, p = self.spec.grid, self.spec.pipeline
        parts = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in self.breakdown.items() if v > 0)
        return (f"{g.arithmetic}, M={p.microbatches}: {1e3 * self.step_time:.2f} ms/step "
                f"({self.samples_per_s:.1f} samples/s, {self.flops_per_s / 1e12:.3f} TFLOP/s; {parts} ms), "
                f"{self.memory['total'] / 2**30:.2f} GiB/rank")




def predict(workload: Workload | nn.Module, spec: ParallelSpec | Mapping[str, Any],
            machine: Machine | str, world_size: int | None = None, *,
            input_shape: Sequence[int] | None = None, plan: list[LayerPlan] | None = None,
            optimizer_states: int = 1) -> Prediction:
    """Predicted step time, breakdown and memory per rank of ``spec`` (see the package doc).

    ``workload`` is a :class:`Workload` or a model (then ``input_shape`` is required).
    ``optimizer_states``: tensors of optimizer state per parameter (1: SGD with momentum, 2: Adam).
    """
    if not isinstance(workload, Workload):
        if input_shape is None:
            raise ValueError("predict: pass input_shape=(N, C, D, H, W) with a model, or a Workload")
        workload = Workload(workload, input_shape)
    if not isinstance(spec, ParallelSpec):
        spec = ParallelSpec.from_dict(spec)
    machine = get_machine(machine)
    world = world_size or math.prod(spec.grid.sizes)
    spec = spec.resolve_grid(world)
    plan = plan if plan is not None else workload.plan(spec)
    pred = _predict(workload, spec, machine, world, plan, optimizer_states, 1.0)
    share = _core_share(pred, spec, machine, world)
    if share > 1.0:
        pred = _predict(workload, spec, machine, world, plan, optimizer_states, share)
    return pred


def _core_share(pred: Prediction, spec: ParallelSpec, machine: Machine, world: int) -> float:
    """How many busy ranks share a core on average, when a node has more ranks than cores (else 1).

    The node's compute divided by the compute's own critical path: every rank of data or spatial
    parallelism is busy, (1 - bubble) of the ranks of a pipeline of equal stages, fewer of one of
    unequal stages (most wait for their turn, asleep).
    """
    node_ranks = min(world, machine.ranks_per_node)
    if machine.cores is None or node_ranks <= machine.cores:
        return 1.0
    g, M = spec.grid, spec.pipeline.microbatches
    comp = [st.compute for st in pred.stages]
    path = sum(comp) + (M - 1) * max(comp)
    busy = g.data * g.stage_size * M * sum(comp) * min(node_ranks, world) / world
    return max(1.0, busy / (path * machine.cores)) if path > 0 else 1.0


def _handovers(plan: list[LayerPlan], graph: ModelGraph, stages: int, stage_size: int, e: int, link: Link,
               share: float) -> dict[int, tuple[tuple[float, float], float]]:
    """Per stage of a chain: the redistribution of its output to the next stage's split (or to
    replicated, for the loss), forward and backward seconds and their latencies. A graph's stages
    hand over every live value in its producer's layout (nothing to redistribute)."""
    handover: dict[int, tuple[tuple[float, float], float]] = {}
    if not graph.chain:
        return handover
    for s in range(stages):
        last = [r for r in plan if r.stage == s][-1]
        nxt = next((r for r in plan if r.stage == s + 1), None)
        target = nxt.split if nxt is not None else REPLICATED
        if target != last.split and len(last.output_shape) == 5:
            micro_shape = (last.local_output_shape[0], *last.output_shape[1:])
            handover[s] = redistribution(last.output_shape, micro_shape, last.split, target, stage_size, e,
                                         link, share)
    return handover


def _send_bytes(plan: list[LayerPlan], graph: ModelGraph, stage: int, e: int) -> int:
    """Bytes per micro-batch stage ``stage`` sends on: a chain's next input, or every value of a graph
    live across the stage's end (skips too)."""
    nxt = next(r for r in plan if r.stage == stage + 1)
    if graph.chain:
        return math.prod(nxt.local_input_shape) * e
    end = max(i for i, r in enumerate(plan) if r.stage == stage)
    reader = next(r for r in plan if INPUT in r.inputs)
    return live_bytes(graph, [math.prod(r.local_output_shape) * e for r in plan],
                      math.prod(reader.local_input_shape) * e)[end]


def _stage_costs(workload: Workload, spec: ParallelSpec, machine: Machine, world: int, plan: list[LayerPlan],
                 layers: list[LayerCost], handover: dict[int, tuple[tuple[float, float], float]],
                 optimizer_states: int) -> list[StageCost]:
    """Per stage, per micro-batch: compute, halo and redistribution, sends, gradient all-reduce, memory."""
    g, pl = spec.grid, spec.pipeline
    S, stage_size, e = g.pipe, g.stage_size, machine.compute.dtype_bytes
    graph = workload.analysis.graph
    p2p_link, p2p_share = link_between(machine, stage_size * S, world)
    stages: list[StageCost] = []
    for s in range(S):
        mine = [lc for lc in layers if lc.stage == s]
        comp = sum(lc.forward + lc.backward for lc in mine) + machine.micro_overhead
        (hf, hb_), hlat = handover.get(s, ((0.0, 0.0), 0.0))
        halo = sum(lc.halo_forward + lc.halo_backward + lc.redistribute_forward + lc.redistribute_backward
                   for lc in mine) + hf + hb_
        latency = sum(lc.latency for lc in mine) + hlat
        if pl.recompute:  # the backward runs the stage's forward again, halo exchanges included
            comp += sum(lc.forward for lc in mine)
            halo += sum(lc.halo_forward + lc.redistribute_forward for lc in mine) + hf
        send = send_lat = 0.0
        if s + 1 < S:
            nbytes = _send_bytes(plan, graph, s, e)
            send += 2 * p2p_link.time(nbytes / p2p_share)  # the activation forward, its gradient back
            send_lat = 2 * p2p_link.latency
            latency += send_lat
        params = sum(r.params for r in plan if r.stage == s)
        group = [(d * S + s) * stage_size + i for d in range(g.data) for i in range(stage_size)]
        ar_lat, ar_xfer = allreduce_parts(params * e, group, machine, world)
        mem = stage_memory(layers, plan, s, spec, e, optimizer_states)
        stages.append(StageCost(s, comp, halo, send, ar_lat + ar_xfer, params, mem, latency, ar_lat,
                                send_lat))
    return stages


def _exposed_grad_reduce(stages: list[StageCost], layers: list[LayerCost], overlap: float) -> float:
    """The gradient all-reduce left after hiding: a stage's starts after its last backward and hides
    under ``overlap`` of that backward plus the drain of the stages before it (stage 0 ends last)."""
    exposed = 0.0
    for s, st in enumerate(stages):
        last_bwd = sum(lc.backward for lc in layers if lc.stage == s)
        drain = sum(sum(lc.backward + lc.halo_backward for lc in layers if lc.stage == k) for k in range(s))
        exposed = max(exposed, st.grad_reduce - overlap * last_bwd - drain)
    return max(exposed, 0.0)


def _predict(workload: Workload, spec: ParallelSpec, machine: Machine, world: int, plan: list[LayerPlan],
             optimizer_states: int, share: float) -> Prediction:
    """:func:`predict` with a rank's compute stretched ``share`` times by ranks sharing its core."""
    g, pl = spec.grid, spec.pipeline
    S, M, stage_size = g.pipe, pl.microbatches, g.stage_size
    e, c = machine.compute.dtype_bytes, machine.compute
    node_ranks = min(world, machine.ranks_per_node)
    slow = machine.drift * (machine.contention if node_ranks >= 2 else 1.0) * share
    halo_link, halo_share = link_between(machine, stage_size, world)
    layers = layer_costs(workload, plan, machine, slow, halo_link, halo_share, stage_size)
    handover = _handovers(plan, workload.analysis.graph, S, stage_size, e, halo_link, halo_share)
    stages = _stage_costs(workload, spec, machine, world, plan, layers, handover, optimizer_states)

    pipe_time = fill_drain_time([st.time for st in stages], [st.send_latency for st in stages], M)
    if S > 1 and not pl.recompute:
        backward = [sum(lc.backward + lc.halo_backward + lc.redistribute_backward for lc in layers
                        if lc.stage == s) for s in range(S)]
        pipe_time -= drain_saving(backward, deferred_weights(layers, pl.schedule, S, M),
                                  [stages[s - 1].send / 2 for s in range(1, S)])
    crit = max(stages, key=lambda st: st.time - st.send_latency)
    exposed = _exposed_grad_reduce(stages, layers, machine.grad_overlap)
    # optimizer step (memory-bound, 4 passes over params) and slicing the rank's input shard
    own = c.pointwise.time(0.0, 4 * e * max(st.params for st in stages)) + machine.step_overhead
    # the global loss leaves the last stage after its last forward (its replica average overlaps the
    # backward); the other stages average what they received over the replicas at the step's end
    replicas = [d * S * stage_size for d in range(g.data)]
    other = own + (allreduce_time(8, replicas, machine, world) if S > 1 and g.data > 1 else 0.0)
    data_wait = c.pointwise.time(0.0, 2 * math.prod(plan[0].local_input_shape) * M * e)
    compute, halo = M * crit.compute, M * crit.halo
    breakdown = {"compute": compute, "halo": halo, "pipeline": pipe_time - compute - halo,
                 "grad_reduce": exposed, "data_wait": data_wait, "other": other}
    step = sum(breakdown.values())
    floor = _busy_floor(stages, spec, machine, world, share, own, data_wait)
    oversubscribed = floor > step
    if oversubscribed:
        breakdown["other"] += floor - step
        step = floor
    memory = max((st.memory for st in stages), key=lambda m: m["total"])
    return Prediction(spec, machine.name, world, workload.batch, step, breakdown, memory,
                      workload.total_flops, stages, layers, bubble_fraction(S, M), oversubscribed)


def _busy_floor(stages: list[StageCost], spec: ParallelSpec, machine: Machine, world: int, share: float,
                own: float, data_wait: float) -> float:
    """The least a step takes when a node's ranks time-share its cores (0 when each has a core):
    every rank is busy for its own compute and communication, and the cores share that work.
    Latencies are waits, not work, and a rank's compute counts at its own length, not at the length
    it takes on its share of a core."""
    node_ranks = min(world, machine.ranks_per_node)
    if machine.cores is None or node_ranks <= machine.cores:
        return 0.0
    g, M = spec.grid, spec.pipeline.microbatches
    busy = 0.0
    for s, st in enumerate(stages):
        ar_xfer = st.grad_reduce - st.grad_reduce_latency
        work = st.time - st.latency - st.compute * (1 - 1 / share)
        busy += g.data * g.stage_size * (M * work + ar_xfer + own + (data_wait if s == 0 else 0.0))
    return busy * min(node_ranks, world) / world / machine.cores
