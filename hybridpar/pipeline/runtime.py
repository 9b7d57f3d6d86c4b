"""The runtime of one training step on one stage: it interprets the stage's action list.

Why a module of its own: the schedule says what a stage does and in which order
(:func:`hybridpar.planner.schedule.actions`: forwards, backwards, the B/W split, where receives are
posted, when the loss is complete); this module does each action and nothing else, as
``torch.distributed.pipelining`` interprets its action lists and torchgpipe runs its clock cycles.
Deferring weight gradients is thus a schedule (an input pass, a send, a weight pass) rather than a
branch here; so is the posting of receives ahead of the compute that needs them.

Numbers: each micro-batch's loss is weighted by its share of the replica batch; on a split output
(a volume predicted voxel by voxel) the output's ranks sum their shares (``loss`` does the
weighting); the replica losses are averaged by :class:`LossExchange`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.reduce import no_grad_sync
from hybridpar.comm.transport import Work
from hybridpar.device.precision import no_autocast
from hybridpar.grid import ProcessGrid
from hybridpar.pipeline import deferred
from hybridpar.pipeline.reducer import GradReducer
from hybridpar.pipeline.running_stats import ReplicaStats
from hybridpar.pipeline.stage_transport import BWD_TAG, FWD_TAG, LOSS_TAG, StageTransport
from hybridpar.planner import schedule as sched
from hybridpar.profiling import range as prange


@dataclass
class StepContext:
    """What a step runs on, handed over by the engine. ``forward``, ``loss`` and ``send`` are the
    engine's own callables, so that a compiled or wrapped stage function is the one that runs."""

    grid: ProcessGrid
    transport: StageTransport
    modules: list[nn.Module]
    defer: list[bool]  # per module: may its weight gradients wait (deferred.deferrable)
    forward: Callable[[torch.Tensor], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # weighted by the output share
    send: Callable[[torch.Tensor, int, int], Work]  # (tensor, destination stage, tag)
    in_shape: Callable[[int], tuple[int, ...]]  # shape of a received activation of b samples
    params: Callable[[int, int | None, bool], list[nn.Parameter]]  # (lo, hi, undeferred only)
    reducer: GradReducer | None
    replica_stats: ReplicaStats | None
    training: bool
    output_group: dist.ProcessGroup | None  # the split output's ranks (sum of loss shares), or None


class StepRuntime:
    """One step of one stage: ``run`` does the actions in order and returns the loss (a training
    step) or None (an inference pass, :func:`~hybridpar.planner.schedule.forward_actions`, whose last
    stage's outputs are ``outputs``)."""

    def __init__(self, ctx: StepContext, actions: Sequence[sched.Action], xs: Sequence[Any],
                 ys: Sequence[torch.Tensor], sizes: Sequence[int], dtype: torch.dtype,
                 device: torch.device, loss_scale: torch.Tensor | None, split_upto: int | None) -> None:
        self.ctx, self.actions = ctx, list(actions)
        self.xs, self.ys, self.sizes, self.batch = xs, ys, sizes, sum(sizes)
        self.dtype, self.device, self.loss_scale = dtype, device, loss_scale
        self.stage = ctx.grid.pipe_index
        self.first, self.last = self.stage == 0, self.stage == ctx.grid.pipe - 1
        self.split = {m for kind, m in self.actions if kind == sched.BACKWARD_INPUT}
        self.upto = split_upto
        self.posted: dict[tuple[str, int], tuple[torch.Tensor, Work]] = {}
        self.held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}  # m -> (input, output)
        self.inputs: dict[int, torch.Tensor | None] = {}  # m -> input whose gradient is to be sent
        self.sent: dict[int, tuple[Work, torch.Tensor]] = {}  # m -> (gradient send, its input)
        self.sends: list[Work] = []
        self.kept: deferred.Kept = []
        self.prefix: deferred.Prefix | None = None
        # the loss stays on the device: a .cpu() per micro-batch would stall a GPU pipeline
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        backward = (sched.FULL_BACKWARD, sched.BACKWARD_INPUT)
        self.inference = not any(kind in backward for kind, _ in self.actions)
        self.loss_x = LossExchange(ctx.grid, ctx.transport, device) if not self.inference else None
        self.outputs: list[Any] = []  # what KEEP kept (inference), in micro-batch order

    def run(self) -> torch.Tensor:
        """Every action, then the step's ends: sends, gradient reduction, running statistics, loss.

        The reducer's step begins before the first backward: it reduces only what this step's
        backward adds (gradients from before the step are taken aside, and put back if it fails)."""
        reducer = self.ctx.reducer
        if reducer is not None:
            reducer.begin()
        try:
            with no_grad_sync():
                for kind, m in self.actions:
                    _HANDLERS[kind](self, m)
        except BaseException:
            if reducer is not None:
                reducer.abandon()
            raise
        for w in self.sends:
            w.wait()
        if self.ctx.reducer is not None:
            self.ctx.reducer.finish()
        if self.ctx.replica_stats is not None:
            self.ctx.replica_stats.finish()
        return self.loss_x.finish() if self.loss_x is not None else None

    # ------------------------------------------------------------------ transfers
    def recv_f(self, m: int) -> None:
        self.posted[(sched.FORWARD, m)] = self.ctx.transport.irecv(
            self.ctx.in_shape(self.sizes[m]), self.dtype, self.device, self.stage - 1, FWD_TAG + m)

    def recv_b(self, m: int) -> None:
        out = self.held[m][1]  # the gradient has the shape and dtype of the output sent
        self.posted[(sched.FULL_BACKWARD, m)] = self.ctx.transport.irecv(
            out.shape, out.dtype, out.device, self.stage + 1, BWD_TAG + m)

    def _take(self, key: tuple[str, int]) -> torch.Tensor:
        t, work = self.posted.pop(key)
        with prange("pipeline_recv", "pipeline"):
            work.wait()
        return t

    def send_f(self, m: int) -> None:
        inp, out = self.held[m]
        out = out.to(self.dtype) if out.is_floating_point() else out  # a cut carries the autocast dtype
        if self.inference:
            del self.held[m]
        else:
            self.held[m] = (inp, out)  # the gradient that comes back is of what was sent
        self.sends.append(self.ctx.send(out, self.stage + 1, FWD_TAG + m))

    def send_b(self, m: int) -> None:
        inp = self.inputs.pop(m)
        g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
        work = self.ctx.send(g, self.stage - 1, BWD_TAG + m)
        self.sends.append(work)
        if m in self.split:
            self.sent[m] = (work, inp)

    # ------------------------------------------------------------------ compute
    def forward(self, m: int) -> None:
        inp = self.xs[m] if self.first else self._take((sched.FORWARD, m)).requires_grad_()
        if m in self.split:  # keep the deferred layers' outputs for the weight pass
            with prange("stage_forward", "compute"):
                out, self.kept, self.prefix = deferred.run_keeping(self.ctx.modules, self.ctx.defer, inp,
                                                                   self.upto)
        else:
            out = self.ctx.forward(inp)
        self.held[m] = (None if self.first else inp, out)

    def loss(self, m: int) -> None:
        inp, out = self.held[m]
        loss = self.ctx.loss(out, self.ys[m].to(self.device)) * (self.sizes[m] / self.batch)
        self.loss_sum += loss.detach().double().reshape(())  # 0-d or one element (loss_check)
        self.held[m] = (inp, loss)

    def keep(self, m: int) -> None:
        self.outputs.append(self.held.pop(m)[1])

    def _grad(self, m: int) -> torch.Tensor | None:
        return self.loss_scale if self.last else self._take((sched.FULL_BACKWARD, m))

    def full_backward(self, m: int) -> None:
        with no_autocast(self.device.type):  # backward passes run outside autocast
            grad = self._grad(m)
            inp, out = self.held.pop(m)
            if out.requires_grad:
                with prange("stage_backward", "compute"):
                    out.backward(grad)
        if inp is not None:
            self.inputs[m] = inp

    def backward_input(self, m: int) -> None:
        """Pass 1 (and 0) of the B/W split: the input gradient, the deferred layers' output gradients."""
        with no_autocast(self.device.type):
            grad = self._grad(m)
            inp, out = self.held.pop(m)
            if out.requires_grad:
                with prange("stage_backward_input", "compute"):
                    root = out
                    if self.prefix is not None:  # the layers after the split prefix first
                        root, grad = deferred.rest_pass(out, grad, self.prefix,
                                                        self.ctx.params(self.upto, None, False))
                    deferred.input_pass(root, grad, inp, self.kept, self.ctx.params(0, self.upto, True))
        self.inputs[m] = inp

    def backward_weight(self, m: int) -> None:
        """Pass 2: once the input gradient has left (and is freed), the deferred weight gradients."""
        if m in self.sent:
            work, inp = self.sent.pop(m)
            work.wait()  # gloo holds the gradient until then (NCCL: stream order)
            self.sends.remove(work)
            inp.grad = None
            del work, inp  # gloo's work object holds the gradient it sent until it goes
        # a deferrable layer frozen after the build has no weight gradient to wait for (kept with none)
        kept = [(y, params) for y, params in self.kept if params]
        with no_autocast(self.device.type), prange("stage_backward_weight", "compute"):
            deferred.weight_pass(kept)
        self.kept, self.prefix = [], None

    # ------------------------------------------------------------------ step events
    def share_loss(self, m: int) -> None:
        if self.ctx.output_group is not None:  # the shares of the split output's ranks
            dist.all_reduce(self.loss_sum, group=self.ctx.output_group)
        self.loss_x.start(self.loss_sum)  # known now: off the step's critical path from here

    def sync_stats(self, m: int) -> None:
        if self.ctx.replica_stats is not None and self.ctx.training:
            self.ctx.replica_stats.start()  # the step's last update of running statistics

    def arm_reduce(self, m: int) -> None:
        if self.ctx.reducer is not None:
            self.ctx.reducer.arm()


# Action -> what does it. A table of plain functions, not of bound methods kept on the runtime: such
# a reference cycle would keep the step's gloo work objects alive until a garbage collection, and
# gloo work freed while the interpreter exits can abort the process (pytorch/pytorch#179291).
_HANDLERS: dict[str, Callable[[StepRuntime, int], None]] = {
    sched.RECV_F: StepRuntime.recv_f, sched.RECV_B: StepRuntime.recv_b, sched.FORWARD: StepRuntime.forward,
    sched.LOSS: StepRuntime.loss, sched.SEND_F: StepRuntime.send_f, sched.SHARE_LOSS: StepRuntime.share_loss,
    sched.SYNC_STATS: StepRuntime.sync_stats, sched.ARM_REDUCE: StepRuntime.arm_reduce,
    sched.FULL_BACKWARD: StepRuntime.full_backward, sched.BACKWARD_INPUT: StepRuntime.backward_input,
    sched.SEND_B: StepRuntime.send_b, sched.BACKWARD_WEIGHT: StepRuntime.backward_weight,
    sched.KEEP: StepRuntime.keep}


class LossExchange:
    """The global-batch mean loss of one step, on every rank, without a collective at the step's end.

    Why: the last stage knows its replica's loss after its last forward, long before the step ends.
    It sends it to the replica's other stages then (their receives are posted when the step starts)
    and launches the average over data-parallel replicas, so that at the end of the step no rank
    waits on a rank that may have gone to sleep (on a GPU, an all-reduce over every stage would
    also tie the last stage's end to the first stage's last backward).
    """

    def __init__(self, grid: ProcessGrid, transport: StageTransport, device: torch.device) -> None:
        self.grid, self.transport = grid, transport
        self.sends: list[Work] = []
        self.reduce: Any = None
        self.value = torch.zeros(1, dtype=torch.float64, device=device)
        self.recv: Work | None = None
        if grid.pipe_index != grid.pipe - 1:
            self.recv = transport.post_recv(self.value, transport.peer(grid.pipe - 1), transport.loss_group,
                                            LOSS_TAG)

    def start(self, loss_sum: torch.Tensor) -> None:
        """On the last stage, once its replica loss is complete: send it on, start the average."""
        self.value.copy_(loss_sum.reshape(1))
        if self.grid.pipe > 1:
            out = self.value.clone()  # the all-reduce below works in place while these are in flight
            self.sends = [self.transport.post_send(out, self.transport.peer(k), self.transport.loss_group,
                                                   LOSS_TAG) for k in range(self.grid.pipe - 1)]
        if self.grid.data > 1:
            self.reduce = dist.all_reduce(self.value, group=self.grid.data_group, async_op=True)

    def finish(self) -> torch.Tensor:
        with prange("loss_wait", "pipeline"):
            if self.recv is not None:
                self.recv.wait()
                if self.grid.data > 1:
                    dist.all_reduce(self.value, group=self.grid.data_group)
            elif self.reduce is not None:
                self.reduce.wait()
            for w in self.sends:
                w.wait()
        return self.value[0] / self.grid.data
