"""``hybridpar.parallelize``: an ordinary model + a spec -> a hybrid-parallel engine.

Why: a scientist writes an ``nn.Module`` (a sequence, a residual network, a U-Net) and a YAML file;
the engine does the rest in a fixed order: (1) trace the model and resolve the spec against it and
the input shape (one plan every rank computes alike, :mod:`hybridpar.planner.plan`; a traced graph is
run only once it is shown to make the forward's own operations, :mod:`hybridpar.planner.faithful`),
(2) create every process group any rank will use, in the same order everywhere, and the stage
transport (:mod:`~hybridpar.pipeline.stage_transport`), (3) build this rank's stage: Dist layers per
the plan holding the model's own parameters and buffers (an optimizer over ``model.parameters()``
trains it, as with FSDP2), Redistributes where splits change (:mod:`~hybridpar.pipeline.stage`), (4) run a
training step as the schedule's action list over micro-batches (:mod:`~hybridpar.planner.schedule`
says what, :mod:`~hybridpar.pipeline.runtime` does it), activations and gradients moving shard to
shard between stages, (5) reduce gradients once, bucketed and overlapped with the last backward,
over the stage's data × spatial ranks, and average norm layers' running statistics over the
data-parallel replicas (:mod:`~hybridpar.pipeline.running_stats`), so that every rank holds the same
state after a step. This module holds the user's API over those parts.

The training step gives the same numbers as the single-process model on any layout: each
micro-batch's loss is weighted by its share of the replica batch, data-parallel replicas are
averaged, the loss a head computes on replicated ranks counts once, and on a split output (a volume
predicted voxel by voxel) each rank's loss is weighted by its share of the volume. One exception,
as with DDP: a ``BatchNorm`` normalises over each data-parallel replica's batch (and each
micro-batch's), not the global batch; a model converted with
``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` normalises over the replicas too and gives the
single-process numbers. A forward may return a tuple, list or dict of tensors: ``loss_fn`` and
``predict`` see that structure (its split volumes stay split when they share one extent; the plan
gathers them otherwise).

Inference: ``predict`` runs the forwards alone, on inputs of any extent the model and the built
split accept (:mod:`~hybridpar.pipeline.sizes`: the plan at each size, derived once from a copy of the
model on the meta device and kept where it makes the built plan's decisions; a size the split cannot
take is one line naming the layer and the largest split that fits), its split volume outputs whole on
every rank or, with ``gather=False``, left split as ``shard_batch`` lays out a target (on the last
stage), so that no rank holds a whole volume. ``shard_batch`` takes any such size too; training runs
at the build size (its shapes are bound back before a step).

Reduced precision and layouts: ``train_step`` under ``torch.autocast`` runs the forward passes and
losses under it and every backward outside it (as torch recommends); activations crossing a pipeline
cut travel in the autocast dtype (what the convolutions after the cut compute in). A
``memory_format=torch.channels_last_3d`` engine hands out input shards, and receives activations
from the previous stage, in that format.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_unflatten
from torch.utils.checkpoint import checkpoint

from hybridpar.comm.agree import broadcast_state
from hybridpar.comm.redistribute import gather as gather_volume
from hybridpar.comm.redistribute import local_box
from hybridpar.comm.transport import Work
from hybridpar.device import cpu_alloc
from hybridpar.device.eager import first_call_eager
from hybridpar.device.precision import autocast_state
from hybridpar.grid import ProcessGrid, require_group
from hybridpar.nn.norm import recomputing
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.pipeline import deferred
from hybridpar.pipeline import model_state as state
from hybridpar.pipeline.batch import shard, split_sizes
from hybridpar.pipeline.reducer import GradReducer
from hybridpar.pipeline.running_stats import ReplicaStats
from hybridpar.pipeline.runtime import StepContext, StepRuntime
from hybridpar.pipeline.sizes import SizePlans, agree_size
from hybridpar.pipeline.stage import REPLICATED, StageBuilder, make_groups
from hybridpar.pipeline.stage_transport import BWD_TAG, FWD_TAG, LOSS_TAG, StageTransport
from hybridpar.planner import ParallelSpec, load_spec
from hybridpar.planner.explain import banner, format_plan
from hybridpar.planner.faithful import check_faithful
from hybridpar.planner.graph import ModelGraph, UntraceableError
from hybridpar.planner.graph import trace as trace_graph
from hybridpar.planner.plan import build_plan
from hybridpar.planner.schedule import Action, actions, forward_actions, in_flight, schedule
from hybridpar.planner.terms import SpecError
from hybridpar.profiling import range as prange

_FWD, _BWD, _LOSS = FWD_TAG, BWD_TAG, LOSS_TAG  # the tags of pipeline traffic (tests read them here)


class Engine:
    """A model parallelized per a spec (see module doc). Build with :func:`parallelize` after
    joining the job's process group (``hybridpar.init_distributed()``, or a launcher's script that
    calls it)."""

    def __init__(self, model: nn.Module, spec: ParallelSpec, loss_fn: Callable | None = None,
                 input_shape: Sequence[int] | None = None, overlap: bool = False,
                 bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        require_group("parallelize")
        self.memory_format = memory_format
        self._untraced = ""
        self.graph: ModelGraph | None = None
        try:
            self.graph = trace_graph(model)  # an untraceable model fails here
        except UntraceableError as err:
            self._untraced_by(err, spec)
        if all(p.device.type == "cpu" for p in model.parameters()):
            cpu_alloc.tune()  # GPipe frees all micro-batches' activations at once: keep that memory
        self.world = dist.get_world_size()
        broadcast_state(model)  # one starting point: every rank trains the first rank's weights (as DDP)
        self.spec = spec.resolve_grid(self.world)
        g = self.spec.grid
        self.grid = ProcessGrid(data=g.data, pipe=g.pipe, spatial=g.spatial)
        self.model: nn.Module | None = model  # released once built (see _build)
        self.loss_fn = loss_fn
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.defer_weight_grads = defer_weight_grads
        self.transport: StageTransport | None = None
        self.layers: list[tuple[str | None, nn.Module]] = []
        self.plan: list[Any] | None = None
        self.reducer: GradReducer | None = None
        self.replica_stats: ReplicaStats | None = None
        self._training = model.training
        if input_shape is not None:
            self._build(tuple(input_shape))

    # ------------------------------------------------------------------ build
    @property
    def built(self) -> bool:
        return self.plan is not None

    def _require_built(self, what: str) -> None:
        if not self.built:
            raise RuntimeError(f"Engine.{what}: the engine is built from the first batch's shape; call "
                               f"shard_batch(x, y) first, or pass input_shape=(N, C, D, H, W) to "
                               f"parallelize")

    @property
    def first_stage(self) -> bool:
        return self.grid.pipe_index == 0

    @property
    def last_stage(self) -> bool:
        return self.grid.pipe_index == self.grid.pipe - 1

    @property
    def p2p_groups(self) -> dict[str, dist.ProcessGroup | None]:
        """The communicators of activations ("F") and gradients ("B"); None: the default group."""
        return self.transport.p2p_groups

    @property
    def loss_group(self) -> dist.ProcessGroup:
        return self.transport.loss_group

    def _layout(self, split: tuple[int, int, int]) -> ProcessGrid:
        return self.grid.with_spatial(split)

    def _untraced_by(self, err: UntraceableError, spec: ParallelSpec) -> None:
        """No traced graph to run (``err`` says why): the model runs by module swapping, which a
        pipeline cannot."""
        if spec.grid.pipe != 1:
            raise SpecError(f"{err}. A pipeline cuts the traced graph; without one (pipe: 1) such a "
                            f"model runs by module swapping") from None
        self.graph, self._untraced = None, str(err)  # run by module swapping (pipeline/swap.py)

    def _build(self, input_shape: tuple[int, ...]) -> None:
        """Plan, groups (in one order on every rank), the stage transport, then this rank's stage."""
        self.input_shape = input_shape
        if self.graph is not None:
            try:  # never train on a graph that computes something other than the model's forward
                check_faithful(self.graph, self.model, tuple(input_shape))
            except UntraceableError as err:
                self._untraced_by(err, self.spec)
        self.plan = build_plan(self.spec, self.model, input_shape, self.world, self.graph)
        make_groups(self.plan, self.grid)
        self.transport = StageTransport(self.grid, self.memory_format)
        stage = StageBuilder(self.model, self.graph, self.spec, self.grid, self.overlap,
                             self._untraced).build(self.plan, input_shape)  # no builder left to hold it
        self.stage = stage
        # the plans at other sizes (predict, shard_batch), from the model's structure kept on the meta device
        self._sizes = SizePlans(self.model, self.graph is not None, self.spec, self.world, self.plan,
                                input_shape)
        self._size = tuple(input_shape[1:])  # (C, D, H, W) the stage's shapes are bound to
        self.layers, self.stage_graph, self._defer = stage.layers, stage.stage_graph, stage.defer
        # (micro-batches, grad mode, deferral) -> (split end, action list), for a built stage
        self._step_plans: dict[tuple[int, bool, bool], tuple[int | None, list[Action]]] = {}
        for _, layer in self.layers:  # their weights are the first rank's (broadcast above)
            for m in layer.modules():
                if isinstance(m, SpatialLayer):
                    m.weights_agreed()
        self._ends()
        self.input_split, self.output_split = stage.input_split, stage.output_split
        self.input_grid = self._layout(self.input_split)
        self.train(self._training)
        # Keep only what the original model is still needed for (its state-dict keys, in order): every
        # rank holding all stages' weights would defeat a pipeline of a model too big for one (the
        # stages share the model's tensors; a user who drops the model lets the other stages' go).
        run = None if self.graph is None else {n.target for n in self.graph.nodes if n.op == "module"}
        self._state_keys = state.ModelKeys(self.model, run)  # module swapping runs the whole model
        self.model = self.graph = None  # the traced graph holds the model's modules too
        # What still reaches the model's layers is reference cycles, freed only when Python's cycle
        # collector next runs (until then this rank holds every stage's weights): the traced graph (fx's
        # GraphModule and its Graph refer to each other), fx's tracer (its closures refer to it, it to
        # the model), and, in a process's first build, the frames of the build, pinned by a frame that
        # refers to itself (torch.fx.wrap, run by torch._dynamo's import on the first meta forward).
        gc.collect()
        if self.grid.data * self.grid.stage_size > 1:
            self.reducer = GradReducer(self.parameters(), self.grid.stage_group, self.bucket_bytes)
        if self.grid.data > 1:  # norm layers' running statistics, the same on every replica
            self.replica_stats = ReplicaStats([m for _, m in self.layers], self.grid.data_group)

    def _ends(self) -> None:
        """The plan rows of the stage's ends at the size its shapes are bound to."""
        self.first_layer, self.last_layer = self.stage.first_layer, self.stage.last_layer
        self.output_record = self.stage.output_record

    def _at_size(self, size: tuple[int, ...], caller: str) -> None:
        """Bind the stage's shapes to a global input of ``size`` (C, D, H, W): the plan at that size
        (derived once, refused alike on every rank where the built split cannot take it), applied to
        every split layer, Redistribute and stage end. The build size restores the built shapes."""
        size = tuple(int(s) for s in size)
        if size == self._size:
            return
        plan = self._sizes.at(size, caller)
        shape = self._sizes.shape(size)
        self.stage.bind(plan, shape, self.stage.outputs_at(plan, self._sizes.model, shape))
        self._size = size
        self._ends()

    def bind(self, input_shape: Sequence[int], caller: str = "Engine.bind") -> Engine:
        """Ready the engine for a global input of ``input_shape`` (N, C, D, H, W): built at it the first
        time, afterwards its shapes bound to (C, D, H, W), any size the built split takes (refused in one
        line, alike on every rank, naming ``caller``, where it cannot). :meth:`shard_batch` and
        :meth:`predict` do this themselves; a caller that needs the output's shape before it has a batch
        (``hp.infer`` sizing its writer) calls it first. Returns the engine."""
        shape = tuple(int(s) for s in input_shape)
        if not self.built:
            self._build(shape)
        elif len(self.input_shape) == 5 and len(shape) == 5:
            self._at_size(shape[1:], caller)
        return self

    @property
    def input_size(self) -> tuple[int, ...]:
        """(C, D, H, W) of the global input the stage's shapes are bound to now (the build size, or the
        last size ``shard_batch`` or ``predict`` ran at)."""
        self._require_built("input_size")
        return self._size

    # ------------------------------------------------------------------ user API
    def explain(self, echo: bool = True) -> str:
        """The plan table this engine runs (``python -m hybridpar.planner explain`` prints the same one
        from a YAML file): printed by the job's first rank where ``echo``, returned on every rank."""
        self._require_built("explain")
        table = format_plan(self.spec, self.plan, self.input_shape)
        if echo and dist.get_rank() == 0:
            print(table, flush=True)
        return table

    def banner(self) -> str:
        """Three lines on the layout: grid, stages, split layers (``!``: replicated as too small)."""
        self._require_built("banner")
        return banner(self.spec, self.plan)

    def parameters(self) -> list[nn.Parameter]:
        """This rank's parameters (its stage's layers).

        Empty on a pipeline stage of pooling and activations alone; torch's optimizers refuse an
        empty list, so build one as ``SGD(engine.parameters() or [{"params": []}], ...)``.
        """
        self._require_built("parameters")
        return [p for _, m in self.layers for p in m.parameters()]

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        self._require_built("named_parameters")
        for name, m in self.layers:
            if name is not None:
                for k, p in m.named_parameters():
                    yield (f"{name}.{k}" if name else k), p

    def train(self, mode: bool = True) -> Engine:
        self._training = mode
        for _, m in self.layers:
            m.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor | None = None):
        """Global batch (the same on every rank) -> this rank's piece: its replica's samples, and of the
        input only the shard its first reader computes on. Targets are this replica's: whole, or, for a
        volume target (N, C', D, H, W) of a model whose output stays split, split like the output.

        A volume batch of another extent than the build size is cut as the plan at that size says (its
        target as the model's output there), for :meth:`predict`; a size the built split cannot take is
        refused in one line, alike on every rank."""
        self.bind(x.shape, "Engine.shard_batch")
        out = self.stage.lead_output.output_shape
        return shard(x, y, self.grid, self.input_grid, self._layout(self.output_split),
                     tuple(out[2:]) if len(out) == 5 else None, self.memory_format)

    def _loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on this rank's output (a tensor, or the tuple, list or dict the model returns);
        on a split output, its share of the whole volume's mean (``loss_fn`` must average over
        elements, as torch's losses do by default): summed over the output's ranks, the shares are the
        loss of the whole volume. Split outputs of one structure share one split and one extent (the
        plan gathers them otherwise), so one share weighs them all."""
        loss = self.loss_fn(out, y)
        if self.output_split == REPLICATED:
            return loss
        lead = next(t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 5)
        return loss * (math.prod(lead.shape[2:]) / math.prod(self.stage.lead_output.output_shape[2:]))

    # ------------------------------------------------------------------ stage execution
    def _run(self, x: torch.Tensor) -> torch.Tensor:
        for _, m in self.layers:
            x = m(x)
        return x

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        with prange("stage_forward", "compute"):
            if self.spec.pipeline.recompute and torch.is_grad_enabled():
                return checkpoint(self._run, x, use_reentrant=False,
                                  context_fn=lambda: (contextlib.nullcontext(), recomputing()))
            return self._run(x)

    def _step_plan(self, microbatches: int) -> tuple[int | None, list[Action]]:
        """The split end (:meth:`_split_upto`) and the action list of a step of ``microbatches``,
        worked out once per count (and per grad mode and deferral switch) instead of every step."""
        key = (microbatches, torch.is_grad_enabled(), self.defer_weight_grads)
        if key not in self._step_plans:
            name, stages, stage = self.spec.pipeline.schedule, self.grid.pipe, self.grid.pipe_index
            upto = self._split_upto(schedule(name, stages, microbatches, stage))
            steps = actions(name, stages, microbatches, stage, split_last=upto is not None)
            self._step_plans[key] = upto, steps
        return self._step_plans[key]

    def _split_upto(self, ops: list[tuple[str, int]]) -> int | None:
        """End of the split part of the stage whose last backward runs in two passes
        (:func:`deferred.split_end`), or None: not the first stage (no one waits for its input
        gradient), not with recomputed activations, and only where deferrable layers exist."""
        if (not self.defer_weight_grads or self.first_stage or self.spec.pipeline.recompute
                or not torch.is_grad_enabled()):
            return None
        return deferred.split_end([m for _, m in self.layers], self._defer, in_flight(ops))

    def _in_shape(self, b: int) -> tuple[int, ...]:
        return self.stage.recv_shape(b, self._layout)

    def post_recv(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Work:
        """Receive into ``t`` from global rank ``peer`` (:meth:`StageTransport.post_recv`)."""
        return self.transport.post_recv(t, peer, group, tag)

    def post_send(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Work:
        """Send the dense ``t`` to global rank ``peer`` (the counterpart of :meth:`post_recv`)."""
        return self.transport.post_send(t, peer, group, tag)

    def _send(self, t: torch.Tensor, dst_stage: int, tag: int) -> Work:
        """Every send of a step goes through here (a test wraps it to see the order)."""
        return self.transport.send(t, dst_stage, tag)

    def _params(self, lo: int, hi: int | None, undeferred: bool = False) -> list[nn.Parameter]:
        """Trainable parameters of layers ``lo:hi`` (``undeferred``: of those not deferred only)."""
        return [p for (_, m), d in list(zip(self.layers, self._defer))[lo:hi] if not (undeferred and d)
                for p in m.parameters() if p.requires_grad]

    def _placed(self, x: torch.Tensor) -> torch.Tensor:
        """An input on the stage's device (a loader's CPU batch onto the GPU) and in its format."""
        p = next(iter(self.parameters()), None)
        if p is not None and x.device != p.device:
            x = x.to(p.device, non_blocking=True)
        if x.dim() == 5:  # a loader's batch may come in another layout (stored channels-last counts)
            x = x.contiguous(memory_format=self.memory_format)
        return x

    def compile(self, **kwargs: Any) -> Engine:
        """``torch.compile`` this stage's forward (``kwargs`` to ``torch.compile``).

        The function that runs the stage's layers is compiled, not each layer: the layers between two
        communications form one graph (a convolution fused with its activation and pooling), and the
        modules, hence state-dict keys, stay as they are. Communication (halo exchange, gradient
        synchronisation, redistribution) runs eagerly between the graphs: it is their only break (see
        ``tests/test_compile.py``). The first call runs eagerly: it builds every layer's halo plans, so
        that the compiled function finds them made (building one under the tracer would break the
        graph and specialise a frame per layer).
        """
        self._require_built("compile")
        self._run = first_call_eager(self._run, torch.compile(self._run, **kwargs))  # type: ignore[method-assign]
        return self

    def _dtype_device(self, x: torch.Tensor | None) -> tuple[torch.dtype, torch.device]:
        """The dtype activations cross a pipeline cut in (under autocast: its dtype, what the
        convolutions after the cut compute in), and the stage's device."""
        p = next(iter(self.parameters()), None)
        ref = x if x is not None and x.is_floating_point() else p
        if ref is None:
            return torch.get_default_dtype(), torch.device("cpu")
        autocast, low = autocast_state(ref.device.type)
        return (low if autocast and ref.dtype == torch.float32 else ref.dtype), ref.device

    def train_step(self, x_local: torch.Tensor, y_local: torch.Tensor,
                   loss_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward over the micro-batches; gradients end reduced in ``.grad``.

        Returns the global-batch mean loss (unscaled), on every rank. ``loss_scale``: a 0-d tensor the
        loss is multiplied by before backward (fp16 training: ``scaler.scale(torch.ones(()))`` of a
        ``torch.amp.GradScaler``, so the scale stays on the device). Under ``torch.autocast`` the
        forward passes run under it and the backward passes outside it.
        """
        self._require_built("train_step")
        if self.loss_fn is None:
            raise ValueError("Engine.train_step: parallelize(..., loss_fn=...) was not given a loss")
        self._at_build_size(x_local)
        sizes = split_sizes(y_local.shape[0], self.spec.pipeline.microbatches)
        x_local = self._placed(x_local) if self.first_stage else x_local
        xs = x_local.split(sizes) if self.first_stage else [None] * len(sizes)
        dtype, device = self._dtype_device(x_local)
        upto, steps = self._step_plan(len(sizes))
        split_output = self.output_split != REPLICATED and self.last_stage
        ctx = StepContext(self.grid, self.transport, [m for _, m in self.layers], self._defer, self._forward,
                          self._loss, self._send, self._in_shape, self._params, self.reducer,
                          self.replica_stats, self._training,
                          self._layout(self.output_split).spatial_group if split_output else None)
        return StepRuntime(ctx, steps, xs, y_local.split(sizes), sizes, dtype, device, loss_scale, upto).run()

    def _at_build_size(self, x_local: torch.Tensor) -> None:
        """Training runs at the build size: its shapes are bound back (after a prediction at another
        size), and a first stage's input shard of another size is refused before any collective."""
        if len(self.input_shape) != 5:
            return
        self._at_size(self.input_shape[1:], "Engine.train_step")
        if self.first_stage and isinstance(x_local, torch.Tensor) and x_local.dim() == 5:
            box = local_box(tuple(self.input_shape[2:]), self.input_grid)
            want, got = tuple(hi - lo for lo, hi in box), tuple(x_local.shape[2:])
            if got != want:
                voxels = lambda s: "x".join(map(str, s))  # noqa: E731
                raise ValueError(f"Engine.train_step: trains at the build size "
                                 f"{voxels(self.input_shape[2:])}, whose shard on this rank is "
                                 f"{voxels(want)} voxels; got {voxels(got)} "
                                 f"(predict and shard_batch take other sizes)")

    @torch.no_grad()
    def predict(self, x_local: torch.Tensor | None, batch: int | None = None, gather: bool = True) -> Any:
        """Model outputs for this replica's samples, in the structure the model returns them in.

        ``x_local``: this rank's input shard (``shard_batch(x)[0]``, or a shard read as it lays one out)
        of a global volume of any extent the model and the built split accept (the plan at each size is
        derived once and cached; a size the split cannot take is refused in one line naming the layer
        and the largest split that fits, alike on every rank). Finding that extent costs one
        all-gather of a few integers over the job per call. On a pipeline's later stages ``x_local``
        may be None (the batch is the first stage's, or ``batch``).

        ``gather=True``: every output whole, on every rank of the replica (all stages). ``gather=False``:
        a volume output the model leaves split is this rank's shard of it, laid out exactly as
        ``shard_batch(x, y)`` lays out a target ``y`` of its shape; only the last pipeline stage holds
        those shards, the other stages return None in their place (outputs that are not split volumes
        are whole on every stage, as with ``gather=True``).

        In training mode the forward updates running statistics, which are then averaged over the
        data-parallel replicas: call it on every replica alike."""
        self._require_built("predict")
        if len(self.input_shape) == 5:
            size, first_batch = agree_size(x_local, self.grid, self.input_grid, "Engine.predict")
            self._at_size(size, "Engine.predict")
            batch = first_batch if batch is None else batch
        batch = x_local.shape[0] if batch is None else batch
        sizes = split_sizes(batch, self.spec.pipeline.microbatches)
        x_local = self._placed(x_local) if self.first_stage else x_local
        xs = x_local.split(sizes) if self.first_stage else [None] * len(sizes)
        dtype, device = self._dtype_device(x_local)
        ctx = StepContext(self.grid, self.transport, [m for _, m in self.layers], self._defer, self._forward,
                          self._loss, self._send, self._in_shape, self._params, None, self.replica_stats,
                          self._training, None)
        steps = forward_actions(self.grid.pipe, len(sizes), self.grid.pipe_index)
        runtime = StepRuntime(ctx, steps, xs, [], sizes, dtype, device, None, None)
        runtime.run()
        outs = [tree_leaves(out) for out in runtime.outputs]
        ys = []
        for k, rec in enumerate(self.stage.outputs):
            split = self.output_split != REPLICATED and len(rec.output_shape) == 5
            if self.last_stage:
                y = torch.cat([leaves[k] for leaves in outs])
                if split and gather:  # whole volumes
                    y = gather_volume(y, self._layout(self.output_split), tuple(rec.output_shape[2:]))
            elif split and not gather:
                y = None  # the last stage holds the shards
            else:
                y = torch.empty((batch, *rec.output_shape[1:]), dtype=dtype, device=device)
            if self.grid.pipe > 1 and (gather or not split):
                dist.broadcast(y, self.transport.peer(self.grid.pipe - 1), group=self.grid.pipe_group)
            ys.append(y)
        return ys[0] if self.stage.output_spec is None else tree_unflatten(ys, self.stage.output_spec)

    # ------------------------------------------------------------------ state
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the original model's state dict."""
        self._require_built("local_state_dict")
        return state.local_state(self.layers, self._state_keys, self.first_stage)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (keys, shapes, order), assembled from all stages, on every rank."""
        return state.full_state(self.layers, self.grid, self._state_keys)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict into this rank's layers (any layout saved it)."""
        self._require_built("load_full_state_dict")
        state.load_state(self.layers, state_dict)


def parallelize(model: nn.Module, spec: ParallelSpec | dict | str | Path, loss_fn: Callable | None = None,
                *, input_shape: Sequence[int] | None = None, overlap: bool = False,
                bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                memory_format: torch.memory_format = torch.contiguous_format) -> Engine:
    """Make ``model`` (any module whose forward torch.fx can trace) hybrid-parallel per ``spec``.

    ``spec`` is a :class:`ParallelSpec`, a dict of the YAML's shape, or a path to the YAML file. The
    engine is built from ``input_shape`` (global N, C, D, H, W) or from the first batch it sees.
    ``defer_weight_grads``: a stage's last backward sends its input gradient before computing its
    weight gradients, where that costs no peak memory (:mod:`hybridpar.pipeline.deferred`); False
    runs every backward in one pass.
    ``HYBRIDPAR_TRANSPORT=mpi`` selects MPI for stage-to-stage traffic as it does for halos (ranks
    started by mpirun; between CPU ranks of one host it copies through shared memory, where gloo goes
    through TCP loopback). The job's process group must exist:
    ``hybridpar.init_distributed()`` first (a plain process gets a one-rank group).
    ``memory_format``: ``torch.channels_last_3d`` runs the activations NDHWC (input shards and
    activations received from the previous stage are in it; the layers keep it).

    Every rank's parameters and buffers of ``model`` become those of rank 0 (a broadcast, as DDP does at
    construction), so ranks that seeded or loaded their own weights still train one model; load a
    checkpoint into the engine (``load_full_state_dict``) or into the model on every rank before this call.
    """
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif isinstance(spec, dict):
        spec = ParallelSpec.from_dict(spec)
    return Engine(model, spec, loss_fn, input_shape, overlap, bucket_bytes, defer_weight_grads, memory_format)
