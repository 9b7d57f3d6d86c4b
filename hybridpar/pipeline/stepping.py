"""Stepping an engine: one training step or one inference pass of this rank's stage.

Why a part of its own: a step is the schedule's action list over micro-batches
(:mod:`hybridpar.planner.schedule` says what, :mod:`hybridpar.pipeline.runtime` does it); what the
engine adds is the stage function (recomputed or not, compiled or not), the loss's weighting on a split
output, the action list worked out once per micro-batch count, and where inputs and activations live.
A new schedule (interleaved 1F1B, zero-bubble) changes this part and the schedule module only.

The loss's weighting is right only for a loss that splits as the engine combines it: that is checked
on every step, on its values (:mod:`hybridpar.pipeline.loss_check`; a masked loss may mask nothing in
its first batches) and by what it computes (:mod:`hybridpar.pipeline.loss_form`), which also finds a
sum (summed over shards, micro-batches and replicas then), after checking that the loss is a scalar
tensor at all; one that does not split over the output's shards (Dice) is
evaluated on the whole output, gathered (:mod:`hybridpar.pipeline.loss_whole`). A recomputed forward
runs on the buffers the forward found and leaves them as they were (:func:`_recompute_contexts`): a
model's own buffer updates (an EMA, a step counter) count once, as in one process.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint

from hybridpar.comm import random_streams
from hybridpar.comm.redistribute import local_box
from hybridpar.comm.transport import Work
from hybridpar.device.cuda_graphs import capturing
from hybridpar.device.eager import first_call_eager
from hybridpar.device.precision import autocast_state
from hybridpar.grid import ProcessGrid
from hybridpar.nn.buffer_state import Snapshot, put
from hybridpar.nn.norm import recomputing
from hybridpar.nn.sharing import return_rebound
from hybridpar.pipeline import deferred, loss_across, loss_check, loss_whole
from hybridpar.pipeline.batch import split_sizes
from hybridpar.pipeline.building import Built
from hybridpar.pipeline.loss_form import LossForm
from hybridpar.pipeline.loss_params import LossReads
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
                 memory_format: torch.memory_format, model_params: list[tuple[str, nn.Parameter]]) -> None:
        self.built, self.spec, self.loss_fn = built, spec, loss_fn
        self.loss_reads = LossReads(model_params)  # the model's parameters loss_fn reads itself
        self.grid = built.layout.grid
        self.defer_weight_grads, self.memory_format = defer_weight_grads, memory_format
        self.modules = [m for _, m in built.stage.layers]
        self.defer = built.stage.defer
        self.run: Callable[[torch.Tensor], torch.Tensor] = self._run  # compile() replaces it
        # (micro-batches, grad mode, deferral) -> (split end, action list), for a built stage
        self.plans: dict[tuple[int, bool, bool], tuple[int | None, list[Action]]] = {}
        self.reducer: GradReducer | None = None
        self.replica_stats: ReplicaStats | None = None
        self.verdict = loss_check.Verdict()  # how the loss's parts combine (checked: see loss)
        self._pending = False  # the step's first loss is still to come (the one a check reads)
        self._refused: tuple[int, loss_check.Finding] | None = None  # a pipeline's, told after the step
        self._returned: list[float] | None = None  # a pipeline's loss that is no scalar, told alike
        self._batch, self._cut_batch = 1, False  # the replica batch; whether micro-batches or replicas cut it
        self._targets: list[torch.Tensor] = []  # the step's micro-batches' targets (the check reads them)
        self._whole = False  # the loss is evaluated on the whole output, gathered (see loss_whole)

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
                                  context_fn=lambda: _recompute_contexts(self.modules))
            return self.run(x)

    def loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on this rank's output (a tensor, or the tuple, list or dict the model returns),
        weighted so that the values of the output's shards, the micro-batches and the replicas combine
        into the whole batch's loss: for a mean (torch's losses by default), a split output's share of
        the whole volume, a micro-batch's of the batch (the runtime's), replicas averaged (the loss
        exchange's); for a sum, shards summed, micro-batches and replicas too (the share of the batch
        and the replicas' average undone). Split outputs of one structure share one split and one
        extent (the plan gathers them otherwise), so one share weighs them all. Which of the two the
        loss is is checked on every step (:meth:`_check`), and first whether it is a scalar tensor
        (:func:`loss_check.returned`): one line on every rank where it is not. A loss that is neither
        over the output's shards is evaluated on the whole output from then on (:mod:`.loss_whole`),
        each rank's weighed by the share of the ranks that gather it."""
        if self._whole:
            out, y = loss_whole.gathered(out, y, *self._output_place())
        rng = _rng(y) if self._pending and not self._whole else None  # where one process draws its loss
        loss, form = self._evaluate(out, y, self._pending)
        bad = loss_check.returned(loss) if self._returned is None else None
        if bad is not None:
            if self.grid.pipe == 1:
                raise ValueError(loss_check.returned_line(self.loss_fn, bad))
            self._returned = bad  # the other stages wait for a gradient: told after the step
        if self._refused is not None or self._returned is not None:  # no gradient, the step ends, the error
            return self._nothing(out, y)
        if self._pending:
            self._pending = False
            loss = self._check(out, y, loss, form, rng)
        stage, weight = self.built.stage, 1.0
        if self._whole:  # the same whole loss on each rank that shares the output (see loss_whole)
            weight = 1.0 / self._output_shards
        elif stage.output_split != REPLICATED and self.verdict.space == loss_check.MEAN:
            lead = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5)
            weight = math.prod(lead.shape[2:]) / math.prod(stage.lead_output.output_shape[2:])
        if self.verdict.batch == loss_check.SUM:
            weight *= self._batch / y.shape[0] * self.grid.data
        return loss if weight == 1.0 else loss * weight

    @staticmethod
    def _nothing(out: Any, y: torch.Tensor) -> torch.Tensor:
        """A zero loss without a gradient, in the output's dtype (a loss that gave no tensor has none)."""
        ref = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()), y)
        dtype = ref.dtype if ref.is_floating_point() else torch.get_default_dtype()
        return torch.zeros((), dtype=dtype, device=ref.device)

    def _evaluate(self, out: Any, y: Any, followed: bool) -> tuple[Any, LossForm | None]:
        """``loss_fn(out, y)``, its parameter reads watched, and where ``followed`` its form along the
        dims the engine cuts (:class:`~hybridpar.pipeline.loss_form.LossForm`)."""
        form = LossForm(out, y, self._cut_dims(), self._cut_batch) if followed else None
        with self.loss_reads.watch(), form if form is not None else contextlib.nullcontext():
            loss = self.loss_fn(out, y)
        return loss, form

    def _check(self, out: Any, y: torch.Tensor, loss: torch.Tensor, form: LossForm | None,
               rng: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Whether ``loss_fn`` is a mean or a sum along the dims the engine cuts (see
        :mod:`~hybridpar.pipeline.loss_check`), agreed over the stage's ranks. Neither along the
        output's shards: the loss anew on the whole output, gathered (:mod:`.loss_whole`), and checked
        along the samples alone, this step and every later one. Neither along the samples raises the
        same line on every rank before any backward, or on a pipeline (whose other stages wait for a
        gradient) gives no gradient and raises after the step (:meth:`_tell_stages`). The check's own
        evaluations leave the random generators as the step's loss left them, and the loss anew on
        the whole output draws from the state ``rng`` (:func:`_rng`) the step's loss drew from: a loss
        that samples voxels draws what one process draws."""
        dims = self._cut_dims()
        space, batch = loss_check.findings(self.loss_fn, out, y, loss, dims, self._cut_batch)  # forks its own
        group = self._stage_group
        if loss.numel() == 1:
            others = self._other_targets(y)
            if form is not None:  # by the form of the computation: exact where the values leave it open
                shaped = form.findings(loss, others)
                space, batch = space + shaped[0], batch + shaped[1]
            if self._whole:  # the other micro-batches' targets gathered as this one's
                grid, volume = self._output_place()
                box = tuple(hi - lo for lo, hi in local_box(volume, grid))
                others = [loss_whole.target(t, box, grid, volume) for t in others]
            with torch.random.fork_rng(devices=_devices(y)):
                across = loss_across.findings(self.loss_fn, out, y, others, self._piece(), dims, group,
                                              *self._peers())
            space, batch = space + across[0], batch + across[1]
        self.verdict, refused = loss_check.agree(space, batch, loss_check.rtol_of(loss.dtype), group,
                                                 loss.device)
        if refused is not None and refused[0] == loss_check.SPACE:  # the loss on the whole output instead
            self._whole = True
            out, y = loss_whole.gathered(out, y, *self._output_place())
            if dist.get_rank() == 0:
                warnings.warn(loss_check.whole_notice(self.loss_fn, refused[1], self._output_shards,
                                                      loss_whole.mebibytes(out, y)), stacklevel=6)
            if rng is not None:
                _set_rng(y, rng)
            loss, form = self._evaluate(out, y, True)
            return self._check(out, y, loss, form)
        if refused is None:
            return loss
        if self.grid.pipe == 1:
            self.verdict = loss_check.Verdict()
            raise ValueError(loss_check.refusal(self.loss_fn, *refused))
        self._refused = refused
        return torch.zeros((), dtype=loss.dtype, device=loss.device)

    def _cut_dims(self) -> list[int]:
        """The spatial dims (0-2) along which the loss sees a part of the output: none once it is
        evaluated on the whole output."""
        split = self.built.stage.output_split
        return [d for d in range(3) if split[d] > 1] if split != REPLICATED and not self._whole else []

    def _output_place(self) -> tuple[ProcessGrid, tuple[int, int, int]]:
        """The grid the output is split over and its global (D, H, W)."""
        stage = self.built.stage
        return self.built.layout.of(stage.output_split), tuple(stage.lead_output.output_shape[2:])

    @property
    def _stage_group(self) -> dist.ProcessGroup | None:
        """The stage's data x spatial ranks, where the loss's parts are combined (None: this rank alone)."""
        return self.grid.stage_group if self.grid.data * self.grid.stage_size > 1 else None

    @property
    def _output_shards(self) -> int:
        """How many ranks share one replica's output (1: it is whole on each)."""
        return self.built.layout.of(self.built.stage.output_split).spatial_size

    def _other_targets(self, y: Any) -> list[torch.Tensor]:
        """The step's other micro-batches' targets of as many samples as the first's (``y``)."""
        return [t for t in self._targets[1:] if t.shape[0] == getattr(y, "shape", (0,))[0]]

    def _piece(self) -> tuple[int, int, int]:
        """A loss-check piece's voxels along D, H, W (see :mod:`~hybridpar.pipeline.loss_across`)."""
        stage = self.built.stage
        if len(stage.lead_output.output_shape) != 5:
            return (1, 1, 1)
        return loss_across.counts(stage.lead_output.output_shape, stage.output_split)

    def _peers(self) -> tuple[list[int], list[int]]:
        """Ranks of the stage group (ordered by replica, then place in the stage) that hold shards of this
        rank's samples, and those at its place in the other replicas."""
        size, per = self.grid.stage_size, self._output_shards
        me_d, me_s = self.grid.data_index, self.grid.spatial_index
        space = [me_d * size + s for s in range(size) if s // per == me_s // per]
        return space, [d * size + me_s for d in range(self.grid.data)]

    def _tell_stages(self, device: torch.device) -> None:
        """After a pipeline's step: the loss stage's refusal, if any, on every rank (one all-reduce of 18
        numbers over the job, every step: the check is), raised alike everywhere; a loss that was no
        scalar tensor first."""
        told = torch.cat([loss_check.encode(self._refused), loss_check.told(self._returned)]).to(device)
        dist.all_reduce(told, op=dist.ReduceOp.MAX)
        told = told.cpu()
        self._refused, self._returned = None, None
        refused, returned = loss_check.decode(told[:6]), loss_check.untold(told[6:])
        if returned is not None:
            raise ValueError(loss_check.returned_line(self.loss_fn, returned))
        if refused is not None:
            self.verdict = loss_check.Verdict()
            raise ValueError(loss_check.refusal(self.loss_fn, *refused))

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
        if self.grid.spatial_size > 1 and not capturing(device):  # the split's shards draw as one sample
            with prange("random_streams"):  # named where a silent peer times it out
                random_streams.agree(self.grid.spatial_group, device)
        return sizes, xs, dtype, device

    def train(self, x_local: torch.Tensor, y_local: torch.Tensor, loss_scale: torch.Tensor | None,
              send: Send, training: bool) -> torch.Tensor:
        """One training step (see :meth:`Engine.train_step`): the global-batch mean loss."""
        sizes, xs, dtype, device = self._inputs(x_local, y_local.shape[0])
        upto, steps = self.step_plan(len(sizes))
        ctx = self._context(send, training, grads=True)
        self._batch, self._cut_batch = sum(sizes), len(sizes) > 1 or self.grid.data > 1
        self._targets = list(y_local.split(sizes))
        checking = not capturing(device)  # a captured CUDA graph replays the step without its Python
        self._pending, self._refused, self._returned = checking, None, None
        self.loss_reads.start()
        loss = StepRuntime(ctx, steps, xs, y_local.split(sizes), sizes, dtype, device, loss_scale, upto).run()
        return_rebound()  # the model's own buffer slots hold what its forward rebound
        self._targets = []
        if self.grid.pipe > 1 and checking:  # every stage learns the loss stage's check
            self._tell_stages(device)
        if checking:
            self.loss_reads.finish(self._stage_group, self._output_shards, device, self.grid.pipe > 1,
                                   "Engine.train_step")
        else:
            self.loss_reads.refuse_captured("Engine.train_step")
        return loss

    def forward_pass(self, x_local: Any, batch: int, send: Send, training: bool
                     ) -> tuple[list[Any], torch.dtype, torch.device]:
        """The forwards alone over the micro-batches: the last stage's outputs (flattened per
        micro-batch), and the dtype and device other stages receive them in."""
        sizes, xs, dtype, device = self._inputs(x_local, batch)
        steps = forward_actions(self.grid.pipe, len(sizes), self.grid.pipe_index)
        runtime = StepRuntime(self._context(send, training, grads=False), steps, xs, [], sizes, dtype, device,
                              None, None)
        runtime.run()
        return_rebound()
        return [tree_leaves(out) for out in runtime.outputs], dtype, device


def _recompute_contexts(modules: list[nn.Module]) -> tuple[AbstractContextManager[None],
                                                              AbstractContextManager[None]]:
    """The contexts of a checkpointed forward and of its recomputation (``checkpoint``'s
    ``context_fn``): the first keeps a copy of every buffer of ``modules`` as the forward finds them,
    the second runs the recomputation on fresh copies of those and puts the forward's own buffers
    back when it ends.

    Why: a recomputation is the forward again. A buffer the forward updates (a user's EMA of
    statistics, a step counter) was updated a second time, from the already updated value, and the
    recomputed activations read that value, not the one the forward read: wrong state and wrong
    gradients, silently. Only hybridpar's own norms knew (:func:`recomputing`, still set). Fresh copies
    rather than writing the values back: tensors the recomputation saves for the backward may be those
    buffers, and must keep the values it computed with. Costs one copy of the buffers per micro-batch in
    flight, and one more per recomputation (buffers are statistics: small)."""
    taken: list[Snapshot] = []

    @contextlib.contextmanager
    def forward() -> Iterator[None]:
        taken.append(Snapshot(("", m) for root in modules for m in root.modules()))
        yield

    @contextlib.contextmanager
    def recompute() -> Iterator[None]:
        held = taken[0].rebind(taken[0].fresh())  # fresh: a second recomputation starts alike
        try:
            with recomputing():
                yield
        finally:
            put(held)

    return forward(), recompute()


def _devices(values: Any) -> list[torch.device]:
    """The accelerator whose generator a loss on ``values`` may draw from, besides the CPU's."""
    t = next((t for t in tree_leaves(values) if isinstance(t, torch.Tensor)), None)
    return [t.device] if t is not None and t.device.type == "cuda" else []


def _rng(values: Any) -> list[torch.Tensor]:
    """The random generators' states a loss on ``values`` draws from: the CPU's, and their device's."""
    return [torch.random.get_rng_state(), *(torch.cuda.get_rng_state(d) for d in _devices(values))]


def _set_rng(values: Any, states: list[torch.Tensor]) -> None:
    """Put back the states :func:`_rng` took."""
    torch.random.set_rng_state(states[0])
    for d, state in zip(_devices(values), states[1:], strict=True):
        torch.cuda.set_rng_state(state, d)
