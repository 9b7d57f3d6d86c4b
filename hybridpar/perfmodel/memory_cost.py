"""The memory term: bytes per rank of a stage, from the plan's local shapes and the layers' saved bytes.

Why a module of its own: which layouts fit a device is decided here (the advisor's memory limit),
apart from how long they take. Per rank: weights, gradients and optimizer state of the rank's
stage, plus the activations autograd keeps per micro-batch (layer outputs, halo-extended inputs of
window layers, max-pool indices: :attr:`LayerCost.saved_bytes`) times the micro-batches in flight
(GPipe: M; 1F1B: S - s; with recomputation, the stage inputs in flight plus one micro-batch's
activations), plus the rank's input shard.
:class:`hybridpar.profiling.saved_memory.SavedActivations` measures the activations exactly; the tests
compare the two.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridpar.perfmodel.compute import LayerCost
from hybridpar.planner.config import ParallelSpec
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.schedule import microbatches_in_flight

__all__ = ["stage_memory"]


def stage_memory(layers: Sequence[LayerCost], plan: Sequence[LayerPlan], stage: int, spec: ParallelSpec,
                 dtype_bytes: int, optimizer_states: int) -> dict[str, float]:
    """Bytes per rank of ``stage`` by kind (weights, gradients, optimizer, activations, workspace,
    inputs) and their ``total``."""
    recs = [r for r in plan if r.stage == stage]
    mine = [lc for lc in layers if lc.stage == stage]
    params = sum(r.params for r in recs)
    S, M = spec.grid.pipe, spec.pipeline.microbatches
    inflight = microbatches_in_flight(spec.pipeline.schedule, S, M, stage)
    per_micro = sum(lc.saved_bytes for lc in mine)
    first = recs[0]
    stage_in = math.prod(first.local_input_shape) * dtype_bytes
    if spec.pipeline.recompute:
        acts = inflight * stage_in + per_micro
    else:
        acts = inflight * per_micro
    biggest = max((math.prod(r.local_input_shape) + math.prod(r.local_output_shape)) * dtype_bytes
                  for r in recs)
    inputs = stage_in * M if stage == 0 else stage_in * inflight  # the rank's input shard / received
    weights = params * dtype_bytes
    mem = {"weights": weights, "gradients": weights, "optimizer": weights * optimizer_states,
           "activations": acts, "workspace": biggest, "inputs": inputs}
    mem["total"] = sum(mem.values())
    return mem
