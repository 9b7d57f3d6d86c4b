"""The pipeline term: how stage times per micro-batch add up to a step, and what the drain saves.

Why a module of its own: with per-micro-batch stage times ``t_s`` and ``M`` micro-batches a step
takes ``sum_s t_s + (M - 1) max_s t'_s``; for equal stages that is GPipe's ``(M + S - 1) t``, whose
idle share is the bubble ``(S - 1) / (M + S - 1)``. ``t'_s`` leaves out the sends' latencies: the
engine posts receives ahead, so once the pipeline is full a message travels while its receiver
computes the micro-batch before. The engine's last backward of a stage after the first sends its
input gradient before computing its weight gradients (all of them where the schedule holds two or
more micro-batches there, those of its first conv or linear layer where it holds one;
:mod:`hybridpar.pipeline.deferred`): the drain then runs the stages' input gradients back to back
and each stage's deferred weight gradients beside it (:func:`drain_saving`).

The schedules' facts (in flight, bubble, fill-drain step, which weights wait) are
:mod:`hybridpar.planner.schedule`'s, the runtime's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.perfmodel.compute import LayerCost
from hybridpar.planner.schedule import all_weights_wait, microbatches_in_flight

__all__ = ["deferred_weights", "drain_saving"]


def deferred_weights(layers: Sequence[LayerCost], schedule: str, stages: int,
                     microbatches: int) -> list[float]:
    """Per stage, the weight-gradient seconds its last backward computes after sending its input
    gradient: all of them where >= 2 micro-batches are in flight, those of the first conv or linear
    layer where one is (the engine's prefix), none on stage 0."""
    weights = [0.0] * stages
    for s in range(1, stages):
        w = [lc.weight_backward for lc in layers if lc.stage == s and lc.weight_backward > 0]
        whole = all_weights_wait(microbatches_in_flight(schedule, stages, microbatches, s))
        weights[s] = sum(w) if whole else (w[0] if w else 0.0)
    return weights


def drain_saving(backward: Sequence[float], weights: Sequence[float], transfers: Sequence[float]) -> float:
    """Time the drain saves when stages send their input gradient before their weight gradients.

    ``backward[s]``: stage s's backward of one micro-batch; ``weights[s]``: the part of it that
    waits (0 where the stage does not split); ``transfers[s - 1]``: the gradient's trip from stage s
    to s - 1. Without the split the drain is every backward and transfer in a chain; with it the
    chain runs the input parts only and each stage's weight part beside the rest of the chain, so
    it ends when the slower of (the chain down to stage 0) and (the chain down to stage s, then
    s's weights) does.
    """
    S = len(backward)
    whole = sum(backward) + sum(transfers)
    chain = [b - w for b, w in zip(backward, weights)]
    ends = [sum(chain[s:]) + sum(transfers[s:]) + weights[s] for s in range(S)]
    return max(whole - max(ends), 0.0)
