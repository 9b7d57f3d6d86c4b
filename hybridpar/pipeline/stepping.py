"""Stepping an engine: one training step or one inference pass of this rank's stage.

Why a part of its own: a step is the schedule's action list over micro-batches
(:mod:`hybridpar.planner.schedule` says what, :mod:`hybridpar.pipeline.runtime` does it); what the
engine adds is the stage function (recomputed or not, compiled or not), the loss's weighting on a split
output, the action list worked out once per micro-batch count, and where inputs and activations live.
A new schedule (interleaved 1F1B, zero-bubble) changes this part and the schedule module only.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from hybridpar.comm.transport import Work
from hybridpar.device.eager import first_call_eager
from hybridpar.device.precision import autocast_state
from hybridpar.nn.norm import recomputing
from hybridpar.pipeline import deferred
from hybridpar.pipeline.batch import split_sizes
from hybridpar.pipeline.building import Built
from hybridpar.pipeline.reducer import GradReducer
from hybridpar.pipeline.running_stats import ReplicaStats
from hybridpar.pipeline.runtime import StepContext, StepRuntime
from hybridpar.pipeline.stage import REPLICATED
from hybridpar.planner import ParallelSpec
from hybridpar.planner.schedule import Action, actions, forward_actions, in_flight, schedule
from hybridpar.profiling import range as prange

Send = Callable[[torch.Tensor, int, int], Work]


class Stepper:
    """Runs steps of the stage ``built`` holds, per the ``spec``'s pipeline (see module doc)."""

    def __init__(self, built: Built, spec: ParallelSpec, loss_fn: Callable | None, defer_weight_grads: bool,
                 memory_format: torch.memory_format) -> None:
        self.built, self.spec, self.loss_fn = built, spec, loss_fn
        self.grid = built.layout.grid
        self.defer_weight_grads, self.memory_format = defer_weight_grads, memory_format
        self.modules = [m for _, m in built.stage.layers]
        self.defer = built.stage.defer
        self.run: Callable[[torch.Tensor], torch.Tensor] = self._run  # compile() replaces it
        # (micro-batches, grad mode, deferral) -> (split end, action list), for a built stage
        self.plans: dict[tuple[int, bool, bool], tuple[int | None, list[Action]]] = {}
        self.reducer: GradReducer | None = None
        self.replica_stats: ReplicaStats | None = None

    @property
    def first_stage(self) -> bool:
        return self.grid.pipe_index == 0

    def compile(self, **kwargs: Any) -> None:
        """``torch.compile`` the stage function (see :meth:`Engine.compile`); its first call runs
        eagerly, building every layer's halo plans outside the tracer."""
        self.run = first_call_eager(self._run, torch.compile(self._run, **kwargs))

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for m in self.modules:
            x = m(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The stage function, its activations recomputed in the backward where the spec says so."""
        with prange("stage_forward", "compute"):
            if self.spec.pipeline.recompute and torch.is_grad_enabled():
                return checkpoint(self.run, x, use_reentrant=False,
                                  context_fn=lambda: (contextlib.nullcontext(), recomputing()))
            return self.run(x)

    def loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on this rank's output (a tensor, or the tuple, list or dict the model returns);
        on a split output, its share of the whole volume's mean (``loss_fn`` must average over
        elements, as torch's losses do by default): summed over the output's ranks, the shares are the
        loss of the whole volume. Split outputs of one structure share one split and one extent (the
        plan gathers them otherwise), so one share weighs them all."""
        loss = self.loss_fn(out, y)
        stage = self.built.stage
        if stage.output_split == REPLICATED:
            return loss
        lead = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5)
        return loss * (math.prod(lead.shape[2:]) / math.prod(stage.lead_output.output_shape[2:]))

    def step_plan(self, microbatches: int) -> tuple[int | None, list[Action]]:
        """The split end (:meth:`split_upto`) and the action list of a step of ``microbatches``,
        worked out once per count (and per grad mode and deferral switch) instead of every step."""
        key = (microbatches, torch.is_grad_enabled(), self.defer_weight_grads)
        if key not in self.plans:
            name, stages, stage = self.spec.pipeline.schedule, self.grid.pipe, self.grid.pipe_index
            upto = self.split_upto(schedule(name, stages, microbatches, stage))
            steps = actions(name, stages, microbatches, stage, split_last=upto is not None)
            self.plans[key] = upto, steps
        return self.plans[key]

    def split_upto(self, ops: list[tuple[str, int]]) -> int | None:
        """End of the split part of the stage whose last backward runs in two passes
        (:func:`deferred.split_end`), or None: not the first stage (no one waits for its input
        gradient), not with recomputed activations, and only where deferrable layers exist."""
        if (not self.defer_weight_grads or self.first_stage or self.spec.pipeline.recompute
                or not torch.is_grad_enabled()):
            return None
        return deferred.split_end(self.modules, self.defer, in_flight(ops))

    def in_shape(self, b: int) -> tuple[int, ...]:
        """The shape of a received activation of ``b`` samples."""
        return self.built.stage.recv_shape(b, self.built.layout.of)

    def params(self, lo: int, hi: int | None, undeferred: bool = False) -> list[nn.Parameter]:
        """Trainable parameters of layers ``lo:hi`` (``undeferred``: of those not deferred only)."""
        return [p for m, d in list(zip(self.modules, self.defer))[lo:hi] if not (undeferred and d)
                for p in m.parameters() if p.requires_grad]

    def _first_param(self) -> nn.Parameter | None:
        return next((p for m in self.modules for p in m.parameters()), None)

    def placed(self, x: torch.Tensor) -> torch.Tensor:
        """An input on the stage's device (a loader's CPU batch onto the GPU) and in its format."""
        p = self._first_param()
        if p is not None and x.device != p.device:
            x = x.to(p.device, non_blocking=True)
        if x.dim() == 5:  # a loader's batch may come in another layout (stored channels-last counts)
            x = x.contiguous(memory_format=self.memory_format)
        return x

    def dtype_device(self, x: torch.Tensor | None) -> tuple[torch.dtype, torch.device]:
        """The dtype activations cross a pipeline cut in (under autocast: its dtype, what the
        convolutions after the cut compute in), and the stage's device."""
        p = self._first_param()
        ref = x if x is not None and x.is_floating_point() else p
        if ref is None:
            return torch.get_default_dtype(), torch.device("cpu")
        autocast, low = autocast_state(ref.device.type)
        return (low if autocast and ref.dtype == torch.float32 else ref.dtype), ref.device

    def _context(self, send: Send, training: bool, grads: bool) -> StepContext:
        stage, split_output = self.built.stage, False
        if grads:
            split_output = stage.output_split != REPLICATED and self.grid.pipe_index == self.grid.pipe - 1
        output_group = self.built.layout.of(stage.output_split).spatial_group if split_output else None
        return StepContext(self.grid, self.built.transport, self.modules, self.defer, self.forward, self.loss,
                           send, self.in_shape, self.params, self.reducer if grads else None,
                           self.replica_stats, training, output_group)

    def _inputs(self, x_local: Any, batch: int) -> tuple[list[int], list[Any], torch.dtype, torch.device]:
        sizes = split_sizes(batch, self.spec.pipeline.microbatches)
        x_local = self.placed(x_local) if self.first_stage else x_local
        xs = x_local.split(sizes) if self.first_stage else [None] * len(sizes)
        dtype, device = self.dtype_device(x_local)
        return sizes, xs, dtype, device

    def train(self, x_local: torch.Tensor, y_local: torch.Tensor, loss_scale: torch.Tensor | None,
              send: Send, training: bool) -> torch.Tensor:
        """One training step (see :meth:`Engine.train_step`): the global-batch mean loss."""
        sizes, xs, dtype, device = self._inputs(x_local, y_local.shape[0])
        upto, steps = self.step_plan(len(sizes))
        ctx = self._context(send, training, grads=True)
        return StepRuntime(ctx, steps, xs, y_local.split(sizes), sizes, dtype, device, loss_scale, upto).run()

    def forward_pass(self, x_local: Any, batch: int, send: Send, training: bool
                     ) -> tuple[list[Any], torch.dtype, torch.device]:
        """The forwards alone over the micro-batches: the last stage's outputs (flattened per
        micro-batch), and the dtype and device other stages receive them in."""
        sizes, xs, dtype, device = self._inputs(x_local, batch)
        steps = forward_actions(self.grid.pipe, len(sizes), self.grid.pipe_index)
        runtime = StepRuntime(self._context(send, training, grads=False), steps, xs, [], sizes, dtype, device,
                              None, None)
        runtime.run()
        return [tree_leaves(out) for out in runtime.outputs], dtype, device
