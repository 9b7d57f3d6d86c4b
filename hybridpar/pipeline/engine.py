"""The Engine :func:`hybridpar.parallelize` returns: an ordinary model + a spec, hybrid-parallel.

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

Mode and state: ``model.train()``/``model.eval()`` on the model given to ``parallelize`` govern the
engine as ``engine.train()``/``engine.eval()`` do (:mod:`~hybridpar.pipeline.model_mode`), and
planning leaves the model's buffers as it found them (:mod:`hybridpar.planner.untouched`): only real
steps move a counter or an EMA the forward keeps.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.agree import broadcast_state
from hybridpar.comm.redistribute import local_box
from hybridpar.comm.transport import Work
from hybridpar.device import cpu_alloc
from hybridpar.grid import ProcessGrid, require_group
from hybridpar.nn.sharing import follow_originals
from hybridpar.pipeline import model_state as state
from hybridpar.pipeline import predicting
from hybridpar.pipeline.batch import one_target, shard
from hybridpar.pipeline.building import Source, build, reducers
from hybridpar.pipeline.clipping import clip_grad_norm_
from hybridpar.pipeline.layer_settings import LayerSettings
from hybridpar.pipeline.model_mode import ModelMode
from hybridpar.pipeline.sizes import agree_size
from hybridpar.pipeline.stage_transport import BWD_TAG, FWD_TAG, LOSS_TAG
from hybridpar.pipeline.step_state import BufferWatch, micro_batch_norms, refuse_micro_batch_norms
from hybridpar.pipeline.stepping import Stepper
from hybridpar.pipeline.user_hooks import HookWatch, refuse_unfollowed_forwards
from hybridpar.planner import ParallelSpec
from hybridpar.planner.explain import banner, format_plan
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.terms import SpecError
from hybridpar.planner.trace_state import refuse_changed

_FWD, _BWD, _LOSS = FWD_TAG, BWD_TAG, LOSS_TAG  # the tags of pipeline traffic (tests read them here)


class Engine:
    """A model parallelized per a spec (see module doc). Build with :func:`parallelize` after
    joining the job's process group (``hybridpar.init_distributed()``, or a launcher's script that
    calls it). Its parts: building (:mod:`~hybridpar.pipeline.building`), stepping
    (:mod:`~hybridpar.pipeline.stepping`), predicting (:mod:`~hybridpar.pipeline.predicting`) and
    state (:mod:`~hybridpar.pipeline.model_state`); this class holds the user's API over them."""

    def __init__(self, model: nn.Module, spec: ParallelSpec, loss_fn: Callable | None = None,
                 input_shape: Sequence[int] | None = None, overlap: bool = False,
                 bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        require_group("parallelize")
        refuse_unfollowed_forwards(model, "hp.parallelize")
        self._hooks = HookWatch(model)
        self._hooks.check("hp.parallelize")
        self.memory_format = memory_format
        self._source: Source | None = Source.trace(model, spec)  # released once built (see _build)
        if all(p.device.type == "cpu" for p in model.parameters()):
            cpu_alloc.tune()  # GPipe frees all micro-batches' activations at once: keep that memory
        self.world = dist.get_world_size()
        broadcast_state(model)  # one starting point: every rank trains the first rank's weights (as DDP)
        self.spec = spec.resolve_grid(self.world)
        g = self.spec.grid
        self.grid = ProcessGrid(data=g.data, pipe=g.pipe, spatial=g.spatial)
        self.loss_fn = loss_fn
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.defer_weight_grads = defer_weight_grads
        self.layers: list[tuple[str | None, nn.Module]] = []
        self.plan: list[LayerPlan] | None = None
        self._mode = ModelMode(model)  # model.train()/model.eval() govern it, as engine.train()/eval() do
        self._batch_norms: list[tuple[str, nn.Module]] | None = None
        self._buffer_watch = BufferWatch()
        if input_shape is not None:
            self._build(tuple(input_shape))

    # ------------------------------------------------------------------ build
    @property
    def built(self) -> bool:
        return self.plan is not None

    def _check_mode(self, what: str) -> None:
        """Refuse to run a graph traced in one mode in the other where the forward differs between
        them (``if self.training:``): the graph holds the traced mode's branch only; nor one whose
        forward read a plain attribute (``self.tau``) that has changed since: it holds the old value."""
        refuse_changed(self._traced_attrs, f"Engine.{what}")
        bound, model = self._traced_mode
        if moved := self._mode.moved_branches():
            raise SpecError(f"Engine.{what}: model ({model})'s forward differs between training and eval, "
                            f"and {moved[0]}'s mode has changed since the engine traced it (the graph holds "
                            f"the branch of its mode then); put it back, or parallelize the model anew")
        if bound is not None and bound != self._mode.training:
            traced, now = ("training", "eval") if bound else ("eval", "training")
            raise SpecError(f"Engine.{what}: model ({model})'s forward differs between training and eval "
                            f"(it reads self.training), and the engine traced it in {traced} mode; for "
                            f"{now}, parallelize a copy in that mode (hp.parallelize(copy.deepcopy(model)"
                            f".{now.replace('ing', '')}(), ...)), or put this engine back with "
                            f"model.train({bound}) or engine.train({bound})")

    def _check_batch_stats(self, training: bool) -> bool:
        """Refuse state that micro-batches would move more often than one process does
        (:mod:`~hybridpar.pipeline.step_state`): norms' statistics unless the spec accepts them, and,
        on every micro-batched training step, any other buffer the forward changes. True: that step's
        buffers are being watched (``_buffer_watch.finish`` after it)."""
        pl = self.spec.pipeline
        if pl.microbatches == 1:
            return False
        if self._batch_norms is None:  # this stage's, found once
            self._batch_norms = micro_batch_norms(self.layers)
        if not pl.micro_batch_stats:  # every stage's norms (the model's), so that every rank refuses
            model = self._mode.model()
            refuse_micro_batch_norms(micro_batch_norms([("", model)]) if model is not None else
                                     self._batch_norms, pl.microbatches, "Engine.train_step")
        if not training:
            return False
        self._buffer_watch.start(self.layers, [s for _, s in self._batch_norms])
        return True

    def _require_built(self, what: str) -> None:
        if not self.built:
            raise RuntimeError(f"Engine.{what}: the engine is built from the first batch's shape; call "
                               f"shard_batch(x, y) first, or pass input_shape=(N, C, D, H, W) to parallelize")

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

    def _build(self, input_shape: tuple[int, ...]) -> None:
        """The build (:func:`~hybridpar.pipeline.building.build`), then what this engine reads of it."""
        self.input_shape = input_shape
        self._built = built = build(self._source, self.spec, self.grid, self.world, input_shape, self.overlap,
                                    self.memory_format)
        self.plan, self.layout, self.transport = built.plan, built.layout, built.transport
        self.stage = built.stage
        self.layers, self.stage_graph = built.stage.layers, built.stage.stage_graph
        self._batch_norms = None
        self._size = tuple(input_shape[1:])  # (C, D, H, W) the stage's shapes are bound to
        self.input_split, self.output_split = built.stage.input_split, built.stage.output_split
        self.input_grid = self.layout.of(self.input_split)
        self._mode.follow()  # the model's mode now (model.eval() before the first batch)
        self._settings = LayerSettings(self._source.model, self.plan)  # what the split layers are built from
        self._set_layers()
        self._stepper = Stepper(built, self.spec, self.loss_fn, self.defer_weight_grads, self.memory_format,
                                list(self._source.model.named_parameters()))
        # The stages share the model's tensors: a user who drops the model lets the other stages' go.
        # What still reaches the model's layers is reference cycles, freed only when Python's cycle
        # collector next runs (until then this rank holds every stage's weights): the traced graph (fx's
        # GraphModule and its Graph refer to each other), fx's tracer (its closures refer to it, it to
        # the model), and, in a process's first build, the frames of the build, pinned by a frame that
        # refers to itself (torch.fx.wrap, run by torch._dynamo's import on the first meta forward).
        # Without a pipeline this stage is the whole model: nothing to free, and a full collection costs
        # a build most of its time.
        graph = self._source.graph  # the mode a graph holds the branch of, where the forward has two
        self._traced_mode = (graph.training if graph is not None and graph.mode_dependent else None,
                             type(self._source.model).__name__)
        if graph is not None and graph.mode_dependent:
            self._mode.bind_branches(self._source.model, {n.target for n in graph.nodes if n.op == "module"})
        self._traced_attrs = graph.attributes if graph is not None else ()  # plain values the graph holds
        self._source = None
        if self.grid.pipe > 1:
            gc.collect()
        self.reducer, self.replica_stats = reducers(built, self.parameters(), self.bucket_bytes)
        self._stepper.reducer, self._stepper.replica_stats = self.reducer, self.replica_stats

    def _at_size(self, size: tuple[int, ...], caller: str) -> None:
        """Bind the stage's shapes to a global input of ``size`` (C, D, H, W): the plan at that size
        (derived once, refused alike on every rank where the built split cannot take it), applied to
        every split layer, Redistribute and stage end. The build size restores the built shapes."""
        size = tuple(int(s) for s in size)
        if size == self._size:
            return
        sizes = self._built.sizes
        plan, shape = sizes.at(size, caller), sizes.shape(size)
        outputs = self.stage.outputs_at(plan, sizes.model, shape)
        self.stage.bind(plan, shape, outputs, sizes.made.get(size, {}))
        self._size = size

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
        from a YAML file) and whether its split convolutions overlap their halos: printed by the job's
        first rank where ``echo``, returned on every rank."""
        self._require_built("explain")
        overlap = ("on: each split convolution computes its interior while its halos travel" if self.overlap
                   else "off (the default; overlap=True computes each split convolution's interior while its "
                        "halos travel, for a second buffer of the shard: whether that pays depends on the "
                        "device and transport, `python -m perf halo` measures both)")
        table = f"{format_plan(self.spec, self.plan, self.input_shape)}\nhalo overlap: {overlap}"
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

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model, after ``train_step``; call on every
        rank. torch's over ``model.parameters()`` would see one pipeline stage's gradients alone and
        clip each stage by its own factor (:mod:`~hybridpar.pipeline.clipping`). Returns the norm."""
        self._require_built("clip_grad_norm_")
        return clip_grad_norm_(self.parameters(), max_norm, norm_type, self.grid.pipe_group, self.grid.pipe)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under the original model's names."""
        self._require_built("named_parameters")
        for name, m in self.layers:
            if name is not None:
                for k, p in m.named_parameters():
                    yield (f"{name}.{k}" if name else k), p

    def train(self, mode: bool = True) -> Engine:
        """Training mode (``False``: eval) for the engine and the model given to ``parallelize`` alike,
        as ``model.train(mode)`` is, which the engine follows too (:class:`ModelMode`)."""
        self._mode.set(mode)
        self._set_layers()
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def _set_layers(self) -> None:
        self._mode.apply(self.layers)  # every module's flag as the model's module of its name has it

    def _follow_user(self, what: str) -> bool:
        """What the user changed on the model since the last call, followed or refused before any work
        of ``Engine.what``, in one place: its mode (``model.train()``/``model.eval()`` reach this stage's
        layers, which hold the model's tensors in modules of their own), the plain attributes its
        forward reads (copied to module swapping's copies of its modules, :func:`follow_originals`;
        refused where a traced graph holds their old values, :meth:`_check_mode`). Returns the mode
        the call runs in."""
        if self._mode.follow():
            self._set_layers()
        self._hooks.check(f"Engine.{what}")
        self._settings.check(f"Engine.{what}")
        self._check_mode(what)
        follow_originals()
        return self._mode.training

    def shard_batch(self, x: torch.Tensor, y: torch.Tensor | None = None):
        """Global batch (the same on every rank) -> this rank's piece: its replica's samples, and of the
        input only the shard its first reader computes on. Targets are this replica's: whole, or, for a
        volume target (N, C', D, H, W, or class indices N, D, H, W) of a model whose output stays split,
        split like the output.

        A volume batch of another extent than the build size is cut as the plan at that size says (its
        target as the model's output there), for :meth:`predict`; a size the built split cannot take is
        refused in one line, alike on every rank."""
        self.bind(x.shape, "Engine.shard_batch")
        out = self.stage.lead_output.output_shape
        return shard(x, y, self.grid, self.input_grid, self.layout.of(self.output_split),
                     tuple(out[2:]) if len(out) == 5 else None, self.memory_format)

    def _send(self, t: torch.Tensor, dst_stage: int, tag: int) -> Work:
        """Every send of a step goes through here (a test wraps it to see the order)."""
        return self.transport.send(t, dst_stage, tag)

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
        self._stepper.compile(**kwargs)
        return self

    def train_step(self, x_local: torch.Tensor, y_local: torch.Tensor,
                   loss_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Forward and backward over the micro-batches; gradients end reduced in ``.grad``.

        Returns the global-batch mean loss (unscaled), on every rank. ``loss_scale``: a 0-d tensor the
        loss is multiplied by before backward (fp16 training: ``scaler.scale(torch.ones(()))`` of a
        ``torch.amp.GradScaler``, so the scale stays on the device). Under ``torch.autocast`` the
        forward passes run under it and the backward passes outside it.

        Training runs at the build size: its shapes are bound back (after a prediction at another
        size), and a first stage's input shard of another size is refused before any collective.
        """
        self._require_built("train_step")
        training = self._follow_user("train_step")  # False: trains in eval mode (frozen BN statistics)
        watching = self._check_batch_stats(training)
        if self.loss_fn is None:
            raise ValueError("Engine.train_step: parallelize(..., loss_fn=...) was not given a loss")
        one_target(y_local, "Engine.train_step", x_local)
        if len(self.input_shape) == 5:
            self._at_size(self.input_shape[1:], "Engine.train_step")
            predicting.refuse_other_returns(self._built, self._size, training, len(y_local), self._mode)
            if self.grid.pipe > 1:  # the later stages wait on the first: every rank learns its size
                _check_build_size(agree_size(x_local, self.grid, self.input_grid, "Engine.train_step")[0],
                                  self.input_shape)
            elif self.first_stage and isinstance(x_local, torch.Tensor) and x_local.dim() == 5:
                _check_build_size(x_local, self.input_shape, local_box(self.input_shape[2:], self.input_grid))
        loss = self._stepper.train(x_local, y_local, loss_scale, self._send, training)
        if watching:
            self._buffer_watch.finish("Engine.train_step", self.spec.pipeline.microbatches)
        return loss

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

        The mode is the model's: after ``model.eval()`` (or ``engine.eval()``) a BatchNorm normalises
        with its running statistics and leaves them as they are. In training mode the forward updates
        running statistics, which are then averaged over the data-parallel replicas: call it on every
        replica alike."""
        self._require_built("predict")
        training = self._follow_user("predict")
        if len(self.input_shape) == 5:
            size, first_batch = agree_size(x_local, self.grid, self.input_grid, "Engine.predict")
            self._at_size(size, "Engine.predict")
            batch = first_batch if batch is None else batch
        batch = x_local.shape[0] if batch is None else batch
        returned = predicting.returned_in(self._built, self._size, training, "Engine.predict", batch)
        outs, dtype, device = self._stepper.forward_pass(x_local, batch, self._send, training)
        return predicting.outputs(self._built, returned, outs, batch, gather, dtype, device)

    # ------------------------------------------------------------------ state
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the original model's state dict."""
        self._require_built("local_state_dict")
        return state.local_state(self.layers, self._built.state_keys, self.first_stage)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (keys, shapes, order), assembled from all stages, on every rank."""
        self._require_built("full_state_dict")
        return state.full_state(self.layers, self.grid, self._built.state_keys)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict into this rank's layers (any layout saved it)."""
        self._require_built("load_full_state_dict")
        state.load_state(self.layers, state_dict)


def _check_build_size(x: torch.Tensor | tuple[int, ...], input_shape: tuple[int, ...],
                      box: list[tuple[int, int]] | None = None) -> None:
    """Refuse a first stage's input shard ``x`` that is not this rank's ``box`` of the build size, or an
    input of global (C, D, H, W) ``x`` (every rank of a pipeline learns it) other than the build size."""
    voxels = lambda s: "x".join(map(str, s))  # noqa: E731
    if box is None:
        if tuple(x[1:]) != tuple(input_shape[2:]):
            raise ValueError(f"Engine.train_step: trains at the build size {voxels(input_shape[2:])}; got "
                             f"{voxels(x[1:])} (predict and shard_batch take other sizes)")
        return
    want, got = tuple(hi - lo for lo, hi in box), tuple(x.shape[2:])
    if got != want:
        raise ValueError(f"Engine.train_step: trains at the build size {voxels(input_shape[2:])}, whose "
                         f"shard on this rank is {voxels(want)} voxels; got {voxels(got)} "
                         f"(predict and shard_batch take other sizes)")
