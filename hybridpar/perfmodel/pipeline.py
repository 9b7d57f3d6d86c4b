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

The schedules' facts used here are closed forms of :mod:`hybridpar.pipeline.schedule`'s op lists
(tested against them), so that the model does not import the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridpar.perfmodel.compute import LayerCost

__all__ = ["bubble_fraction", "deferred_weights", "drain_saving", "fill_drain_time", "microbatches_in_flight"]


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a synchronous pipeline step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def microbatches_in_flight(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Most micro-batches whose forward has run and backward has not, at once, on ``stage``: how many
    micro-batches' activations it holds at its peak (GPipe: M; 1F1B: min(M, S - stage))."""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    raise ValueError(f"unknown pipeline schedule {schedule!r}; use gpipe or 1f1b")


def fill_drain_time(stage_times: Sequence[float], send_latencies: Sequence[float],
                    microbatches: int) -> float:
    """``sum_s t_s + (M - 1) max_s (t_s - send latency_s)``: a step of ``M`` micro-batches through
    stages taking ``stage_times`` each per micro-batch (receives posted ahead hide the latencies once
    the pipeline is full)."""
    steady = [t - lat for t, lat in zip(stage_times, send_latencies, strict=True)]
    return sum(stage_times) + (microbatches - 1) * max(steady)


def deferred_weights(layers: Sequence[LayerCost], schedule: str, stages: int,
                     microbatches: int) -> list[float]:
    """Per stage, the weight-gradient seconds its last backward computes after sending its input
    gradient: all of them where >= 2 micro-batches are in flight, those of the first conv or linear
    layer where one is (the engine's prefix), none on stage 0."""
    weights = [0.0] * stages
    for s in range(1, stages):
        w = [lc.weight_backward for lc in layers if lc.stage == s and lc.weight_backward > 0]
        whole = microbatches_in_flight(schedule, stages, microbatches, s) >= 2
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
