"""``hybridpar.parallelize``: an ordinary model + a spec -> a hybrid-parallel engine.

Why: a scientist writes an ``nn.Module`` (a sequence, a residual network, a U-Net) and a YAML file;
the engine does the rest in a fixed order: (1) trace the model and resolve the spec against it and
the input shape (one plan every rank computes alike), (2) create every process group any rank will
use, in the same order everywhere, (3) build this rank's stage: Dist layers per the plan, weights
copied, Redistributes where splits change (a sequence's stage is a list of layers; a graph's runs
in :class:`~hybridpar.pipeline.stage_graph.StageGraph`), (4) run a training step as a pipeline
schedule over micro-batches, activations and gradients moving shard to shard between stages, (5)
reduce gradients once, bucketed and overlapped with the last backward, over the stage's data ×
spatial ranks, and average norm layers' running statistics over the data-parallel replicas
(:mod:`~hybridpar.pipeline.running_stats`), so that every rank holds the same state after a step.

The training step gives the same numbers as the single-process model on any layout: each
micro-batch's loss is weighted by its share of the replica batch, data-parallel replicas are
averaged, the loss a head computes on replicated ranks counts once, and on a split output (a volume
predicted voxel by voxel) each rank's loss is weighted by its share of the volume.

Reduced precision and layouts: ``train_step`` under ``torch.autocast`` runs the forward passes and
losses under it and every backward outside it (as torch recommends); activations crossing a pipeline
cut travel in the autocast dtype (what the convolutions after the cut compute in). A
``memory_format=torch.channels_last_3d`` engine hands out input shards, and receives activations
from the previous stage, in that format.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridpar import cpu_alloc, memfmt
from hybridpar.comm import devices
from hybridpar.comm.local_p2p import LocalP2P
from hybridpar.comm.redistribute import gather, local_box
from hybridpar.comm.reduce import no_grad_sync
from hybridpar.comm.transport import StagedP2P
from hybridpar.grid import ProcessGrid, require_group
from hybridpar.launch import collective_timeout
from hybridpar.nn.layout import Redistribute
from hybridpar.nn.norm import recomputing
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.pipeline import deferred
from hybridpar.pipeline.convert import to_distributed
from hybridpar.pipeline.reducer import GradReducer
from hybridpar.pipeline.running_stats import ReplicaStats
from hybridpar.pipeline.schedule import in_flight, schedule
from hybridpar.pipeline.stage_graph import StageGraph
from hybridpar.pipeline.swap import swap
from hybridpar.precision import autocast_state, no_autocast
from hybridpar.profiling import range as prange
from hybridpar.spec import ParallelSpec, load_spec
from hybridpar.spec.config import SpecError
from hybridpar.spec.graph import INPUT, ModelGraph, UntraceableError
from hybridpar.spec.graph import trace as trace_graph
from hybridpar.spec.plan import build_plan

_FWD, _BWD, _LOSS = 1 << 12, 1 << 13, 1 << 14
REPLICATED = (1, 1, 1)


def _split_sizes(batch: int, parts: int) -> list[int]:
    parts = min(parts, batch)
    return [len(c) for c in torch.arange(batch).tensor_split(parts)]


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own: a piece that stays a view would keep the whole global batch alive
    (and count as such in memory) after the caller lets it go. Dense in its own memory format."""
    t = memfmt.dense(t)
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


class Engine:
    """A model parallelized per a spec (see module doc). Build with :func:`parallelize`."""

    def __init__(self, model: nn.Module, spec: ParallelSpec, loss_fn: Callable | None = None,
                 input_shape: Sequence[int] | None = None, overlap: bool = False,
                 bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                 local_p2p: bool | None = None,
                 memory_format: torch.memory_format = torch.contiguous_format) -> None:
        require_group("parallelize")
        self.memory_format = memory_format
        try:
            self.graph: ModelGraph | None = trace_graph(model)  # an untraceable model fails here
        except UntraceableError as err:
            if spec.grid.pipe != 1:
                raise SpecError(f"{err}. A pipeline cuts the traced graph; without one (pipe: 1) such a "
                                f"model runs by module swapping") from None
            self.graph, self._untraced = None, str(err)  # run by module swapping (pipeline/swap.py)
        self._chain = self.graph is not None and self.graph.chain and \
            all(n.op == "module" for n in self.graph.nodes)
        if all(p.device.type == "cpu" for p in model.parameters()):
            cpu_alloc.tune()  # GPipe frees all micro-batches' activations at once: keep that memory
        self.world = dist.get_world_size()
        self.spec = spec.resolve_grid(self.world)
        g = self.spec.grid
        self.grid = ProcessGrid(data=g.data, pipe=g.pipe, spatial=g.spatial)
        self.model: nn.Module | None = model  # released once built (see _build)
        self.loss_fn = loss_fn
        self.overlap, self.bucket_bytes = overlap, bucket_bytes
        self.defer_weight_grads = defer_weight_grads
        self.local_p2p = local_p2p
        self.local: LocalP2P | None = None  # stage-to-stage transfers between CPU ranks of one host
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

    def _layout(self, split: tuple[int, int, int]) -> ProcessGrid:
        return self.grid.with_spatial(split)

    def _make_groups(self) -> None:
        """Every group any rank may use, created on every rank in one order (new_group requires it)."""
        # Groups of one rank are not created here: they are local and lazy (grid._self_group).
        for split in sorted({lp.split for lp in self.plan} | {self.grid.stage_spatial}):
            layout = self._layout(split)
            if layout.spatial_size > 1:
                layout.spatial_group, layout.halo_group  # noqa: B018 (creates the groups)
        g = self.grid
        for size, name in ((g.data * g.stage_size, "stage_group"), (g.data, "data_group"),
                           (g.pipe, "pipe_group")):
            if size > 1:
                getattr(g, name)
        # Point-to-point traffic between stages: gloo matches messages by tag, so the default group
        # carries activations and gradients and the pipe group (or the default) the loss. NCCL runs
        # a pair's sends and receives in issue order on one stream, and this engine posts receives
        # ahead of its sends: a receive of a gradient queued before the send of the next activation
        # would wait for a peer that waits for that send. Under NCCL each kind of traffic therefore
        # gets a communicator of its own, in which both sides issue it in the same order
        # (activations forward, gradients backward, the loss).
        nccl = "nccl" in str(dist.get_backend()).lower()
        pipeline = lambda r: (r % self.grid.stage_size, r // (self.grid.stage_size * self.grid.pipe))  # noqa: E731
        self.loss_group = self.grid.group_of(pipeline, world_ok=not nccl, purpose="loss" if nccl else "")
        self.p2p_groups: dict[str, dist.ProcessGroup | None] = {"F": None, "B": None}
        if nccl and self.grid.pipe > 1:
            self.p2p_groups = {d: self.grid.group_of(pipeline, purpose=f"pipeline-{d}") for d in "FB"}
        on_cpu = all(p.device.type == "cpu" for p in self.model.parameters())
        if (self.grid.pipe > 1 and not nccl and (on_cpu if self.local_p2p is None else self.local_p2p)
                and os.environ.get("HYBRIDPAR_LOCAL_P2P", "1") != "0"):
            # Every rank takes part (the option and the variable are the same everywhere); pairs that
            # cannot use it keep torch.distributed.
            self.local = LocalP2P.create({self._peer(k) for k in range(self.grid.pipe)} - {dist.get_rank()},
                                         timeout=collective_timeout().total_seconds())

    def _build(self, input_shape: tuple[int, ...]) -> None:
        self.input_shape = input_shape
        self.plan = build_plan(self.spec, self.model, input_shape, self.world, self.graph)
        self._make_groups()
        stage = self.grid.pipe_index
        rows = [i for i, lp in enumerate(self.plan) if lp.stage == stage]
        lo, hi = rows[0], rows[-1] + 1
        mine = self.plan[lo:hi]
        reader = next(lp for lp in self.plan if INPUT in lp.inputs)
        self.input_split = reader.split if len(reader.input_shape) == 5 else REPLICATED
        out = self.plan[-1] if self.graph is None else next(lp for lp in self.plan
                                                             if lp.name == self.graph.output)
        self.output_record = out
        self.output_split = out.output_split if len(out.output_shape) == 5 else REPLICATED
        self.stage_graph: StageGraph | None = None
        if self.graph is None:
            self.layers = [("", self._swapped())]
        elif self._chain:
            self.layers = self._chain_layers(mine, stage)
        else:  # a graph: this stage's nodes run by one module, every live value carried across cuts
            self.stage_graph = StageGraph(self.graph, self.plan, lo, hi, input_shape, self.input_split,
                                          self._layout, self._convert)
            self.layers = [("", self.stage_graph)]
        self._defer = deferred.deferrable([m for _, m in self.layers])
        self.first_layer, self.last_layer = mine[0], mine[-1]
        self.input_grid = self._layout(self.input_split)
        self._warn_gathers()
        self.train(self._training)
        # Keep only what the original model is still needed for (its state-dict keys, in order):
        # every rank holding all stages' weights would defeat a pipeline of a model too big for one.
        self._state_keys = list(self.model.state_dict())
        self.model = self.graph = None  # the traced graph holds the model's modules too
        if self.grid.data * self.grid.stage_size > 1:
            self.reducer = GradReducer(self.parameters(), self.grid.stage_group, self.bucket_bytes)
        if self.grid.data > 1:  # norm layers' running statistics, the same on every replica
            self.replica_stats = ReplicaStats([m for _, m in self.layers], self.grid.data_group)

    def _convert(self, name: str, module: nn.Module, lp: Any) -> nn.Module:
        """The layer ``name`` (``module``) as this rank runs it under ``lp``'s split."""
        m = to_distributed(module, self._layout(lp.split), self.overlap)
        if isinstance(m, SpatialLayer):
            m.global_input_shape = tuple(lp.input_shape[2:])
            m.layer_name = f"{type(m).__name__}({name})"
        return m

    def _swapped(self) -> nn.Module:
        """The untraceable model with its layers swapped for their split versions (said once)."""
        if dist.get_rank() == 0:
            warnings.warn(f"hybridpar.parallelize: {self._untraced}. Running it by module swapping: its "
                          f"own forward on shards, every registered layer split "
                          f"{list(self.spec.grid.spatial)}", stacklevel=4)
        first = {lp.name: lp for lp in reversed(self.plan)}

        def convert(name: str, m: nn.Module, grid: ProcessGrid) -> nn.Module:
            if name in first:
                return self._convert(name, m, first[name])
            return to_distributed(m, grid, self.overlap)  # never called on this input

        return swap(self.model, self._layout(self.spec.grid.spatial), convert)

    def _chain_layers(self, mine: list[Any], stage: int) -> list[tuple[str | None, nn.Module]]:
        """A sequence's stage: its layers in order, Redistributes where the split changes, and one at
        the end into the next stage's split (the last stage keeps the output's)."""
        layers: list[tuple[str | None, nn.Module]] = []
        for i, lp in enumerate(mine):
            if i > 0 and mine[i - 1].output_split != lp.split:
                layers.append((None, Redistribute(self._layout(mine[i - 1].output_split),
                                                  self._layout(lp.split), tuple(lp.input_shape[2:]))))
            path = lp.name.split("#")[0]  # a module without weights called again: "act#1"
            layers.append((None if path != lp.name else lp.name,
                           self._convert(lp.name, self.model.get_submodule(path), lp)))
        following = [lp for lp in self.plan if lp.stage == stage + 1]
        out_split = mine[-1].output_split
        target = following[0].split if following else self.output_split
        if target != out_split:  # hand over in the next stage's split (or the output's for the loss)
            layers.append((None, Redistribute(self._layout(out_split), self._layout(target),
                                              tuple(mine[-1].output_shape[2:]))))
        return layers

    def _warn_gathers(self) -> None:
        """Never replicate silently: a gather inside a split region is said once per job (rank 0)."""
        gathers = [lp for lp in self.plan if lp.gather]
        if gathers and dist.get_rank() == 0:
            names = ", ".join(f"{lp.name} ({lp.kind})" for lp in gathers[:6])
            warnings.warn(f"hybridpar.parallelize: {len(gathers)} layer(s) gather a split activation onto "
                          f"every rank inside a split region: {names}; each holds the whole volume. Register "
                          f"the layer type (hybridpar.nn.register) to run it split, or say spatial: "
                          f"replicate for it in the spec to silence this", stacklevel=3)

    # ------------------------------------------------------------------ user API
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
        volume target (N, C', D, H, W) of a model whose output stays split, split like the output."""
        if not self.built:
            self._build(tuple(x.shape))
        n = x.shape[0]
        if n % self.grid.data:
            raise ValueError(f"Engine.shard_batch: global batch {n} does not split over "
                             f"data({self.grid.data}) replicas; use a multiple of {self.grid.data}")
        per = n // self.grid.data
        rows = slice(self.grid.data_index * per, (self.grid.data_index + 1) * per)
        x_rep = x[rows]
        if x.dim() == 5 and self.input_split != REPLICATED:
            box = local_box(tuple(x.shape[2:]), self.input_grid)
            x_rep = x_rep[(Ellipsis, *(slice(a, b) for a, b in box))]
        x_rep = x_rep.contiguous(memory_format=self.memory_format) if x_rep.dim() == 5 else x_rep
        if y is None:
            return _own(x_rep), None
        y_rep = y[rows]
        if self.output_split != REPLICATED:
            if y.dim() != 5 or tuple(y.shape[2:]) != tuple(self.output_record.output_shape[2:]):
                raise ValueError(f"Engine.shard_batch: the model's output is a split volume of "
                                 f"{'x'.join(map(str, self.output_record.output_shape[2:]))} voxels; the "
                                 f"target must be N, C, D, H, W of that size, got {tuple(y.shape)}")
            box = local_box(tuple(y.shape[2:]), self._layout(self.output_split))
            y_rep = y_rep[(Ellipsis, *(slice(a, b) for a, b in box))]
        return _own(x_rep), _own(y_rep)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``loss_fn`` on this rank's output; on a split output, its share of the whole volume's mean
        (``loss_fn`` must average over elements, as torch's losses do by default): summed over the
        output's ranks, the shares are the loss of the whole volume."""
        loss = self.loss_fn(out, y)
        if self.output_split == REPLICATED:
            return loss
        whole = math.prod(self.output_record.output_shape[1:]) * out.shape[0]
        return loss * (out.numel() / whole)

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

    def _split_backward(self, ops: list[tuple[str, int]]) -> tuple[int, int] | None:
        """(micro-batch, end of the split prefix) of the backward that runs in two passes
        (:mod:`deferred`), or None.

        A stage's last backward, when a previous stage waits for its input gradient, the stage has
        deferrable layers and activations are not recomputed. The whole stage is split where the
        schedule holds two or more micro-batches here at once (the gradients kept between the passes
        fit in memory freed by then), a prefix up to the first deferrable layer where it holds one."""
        if (not self.defer_weight_grads or self.first_stage or self.spec.pipeline.recompute
                or not any(self._defer) or not torch.is_grad_enabled()):
            return None
        modules = [m for _, m in self.layers]
        upto = len(modules) if in_flight(ops) >= 2 else deferred.prefix_end(modules, self._defer)
        if upto is None:
            return None
        return ops[max(i for i, (op, _) in enumerate(ops) if op == "B")][1], upto

    def _in_shape(self, b: int) -> tuple[int, ...]:
        if self.stage_graph is not None and not self.first_stage:
            return (self.stage_graph.recv_numel(b),)
        lp = self.first_layer
        shape = lp.input_shape
        if len(shape) == 5:
            box = local_box(tuple(shape[2:]), self._layout(lp.split))
            return (b, shape[1], *(hi - lo for lo, hi in box))
        return (b, *shape[1:])

    def _peer(self, stage: int) -> int:
        return self.grid.global_rank(self.grid.data_index, stage, self.grid.spatial_index)

    def _p2p_group(self, other_stage: int, sending: bool) -> dist.ProcessGroup | None:
        """The communicator of an activation (forward) or gradient (backward) transfer."""
        forward = (other_stage > self.grid.pipe_index) == sending
        return self.p2p_groups["F" if forward else "B"]

    def post_recv(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Any:
        """Receive into ``t`` from global rank ``peer``: same-host CPU ranks copy directly
        (:mod:`hybridpar.comm.local_p2p`), the rest through torch.distributed on ``group``."""
        t = memfmt.wire(t)  # a channels_last_3d buffer as the contiguous NDHWC view of its storage
        if self.local is not None and self.local.handles(t, peer):
            return self.local.irecv(t, peer, tag)
        if t.is_cuda and devices.shares_device():  # ranks sharing a GPU: through pinned host memory
            return StagedP2P().irecv(t, peer, group, tag)
        return dist.irecv(t, peer, group=group, tag=tag)

    def post_send(self, t: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int) -> Any:
        """Send the dense ``t`` to global rank ``peer`` (the counterpart of :meth:`post_recv`)."""
        t = memfmt.wire(t)
        if self.local is not None and self.local.handles(t, peer):
            return self.local.isend(t, peer, tag)
        if t.is_cuda and devices.shares_device():
            return StagedP2P().isend(t, peer, group, tag)
        return dist.isend(t, peer, group=group, tag=tag)

    def _recv(self, shape, dtype, device, src_stage: int, tag: int) -> torch.Tensor:
        t, work = self._irecv(shape, dtype, device, src_stage, tag)
        with prange("pipeline_recv", "pipeline"):
            work.wait()
        return t

    def _irecv(self, shape, dtype, device, src_stage: int, tag: int) -> tuple[torch.Tensor, Any]:
        fmt = self.memory_format if len(shape) == 5 else torch.contiguous_format
        t = torch.empty(shape, dtype=dtype, device=device, memory_format=fmt)
        with prange("pipeline_post_recv", "pipeline"):
            return t, self.post_recv(t, self._peer(src_stage), self._p2p_group(src_stage, False), tag)

    def _send(self, t: torch.Tensor, dst_stage: int, tag: int):
        with prange("pipeline_send", "pipeline"):
            fmt = self.memory_format if t.dim() == 5 else torch.contiguous_format  # the receiver's
            return self.post_send(t.detach().contiguous(memory_format=fmt), self._peer(dst_stage),
                                  self._p2p_group(dst_stage, True), tag)

    def _params(self, lo: int, hi: int | None, undeferred: bool = False) -> list[nn.Parameter]:
        """Trainable parameters of layers ``lo:hi`` (``undeferred``: of those not deferred only)."""
        return [p for (_, m), d in list(zip(self.layers, self._defer))[lo:hi] if not (undeferred and d)
                for p in m.parameters() if p.requires_grad]

    def _placed(self, x: torch.Tensor) -> torch.Tensor:
        """An input on the stage's device (a loader's CPU batch onto the GPU) and in its format."""
        p = next(iter(self.parameters()), None)
        if p is not None and x.device != p.device:
            x = x.to(p.device, non_blocking=True)
        if x.dim() == 5 and self.memory_format is not torch.contiguous_format:
            x = x.contiguous(memory_format=self.memory_format)
        return x

    def compile(self, **kwargs: Any) -> Engine:
        """``torch.compile`` this stage's forward (``kwargs`` to ``torch.compile``).

        The function that runs the stage's layers is compiled, not each layer: the layers between two
        communications form one graph (a convolution fused with its activation and pooling), and the
        modules, hence state-dict keys, stay as they are. Communication (halo exchange, gradient
        synchronisation, redistribution) runs eagerly between the graphs: it is their only break (see
        ``tests/test_compile.py``).
        """
        self._require_built("compile")
        self._run = torch.compile(self._run, **kwargs)  # type: ignore[method-assign]
        return self

    def _dtype_device(self, x: torch.Tensor | None) -> tuple[torch.dtype, torch.device]:
        p = next(iter(self.parameters()), None)
        ref = x if x is not None and x.is_floating_point() else p
        if ref is None:
            return torch.get_default_dtype(), torch.device("cpu")
        return ref.dtype, ref.device

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
        batch = y_local.shape[0]
        sizes = _split_sizes(batch, self.spec.pipeline.microbatches)
        x_local = self._placed(x_local) if self.first_stage else x_local
        xs = x_local.split(sizes) if self.first_stage else [None] * len(sizes)
        ys = y_local.split(sizes)
        dtype, device = self._dtype_device(x_local)
        autocast, low = autocast_state(device.type)
        if autocast and dtype == torch.float32:  # a pipeline cut carries the autocast dtype
            dtype = low
        ops = schedule(self.spec.pipeline.schedule, self.grid.pipe, len(sizes), self.grid.pipe_index)
        last_backward = max(i for i, (op, _) in enumerate(ops) if op == "B")
        held: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        # the loss stays on the device: a .cpu() per micro-batch would stall a GPU pipeline
        sends, loss_sum = [], torch.zeros((), dtype=torch.float64, device=device)
        stage = self.grid.pipe_index
        # Receives are posted one op ahead, so that an activation or gradient moves while this stage
        # computes (a point-to-point transfer starts only once its receive is posted).
        posted: dict[tuple[str, int], tuple[torch.Tensor, Any]] = {}
        last_forward = max(i for i, (op, _) in enumerate(ops) if op == "F")
        loss_x = _LossExchange(self, device)
        split_m, upto = self._split_backward(ops) or (None, 0)
        kept: deferred.Kept = []
        prefix: deferred.Prefix | None = None

        def post(j: int) -> None:
            if j >= len(ops) or ops[j] in posted:
                return
            op, m = ops[j]
            if op == "F" and not self.first_stage:
                posted[ops[j]] = self._irecv(self._in_shape(sizes[m]), dtype, device, stage - 1, _FWD + m)
            elif op == "B" and not self.last_stage and m in held:  # its shape is known once F(m) ran
                out = held[m][1]
                posted[ops[j]] = self._irecv(out.shape, out.dtype, out.device, stage + 1, _BWD + m)

        def take(key: tuple[str, int]) -> torch.Tensor:
            t, work = posted.pop(key)
            with prange("pipeline_recv", "pipeline"):
                work.wait()
            return t

        with no_grad_sync():
            for i, (op, m) in enumerate(ops):
                post(i)
                post(i + 1)
                if op == "F":
                    if self.first_stage:
                        inp = xs[m]
                    else:
                        inp = take(ops[i]).requires_grad_()
                    if m == split_m:
                        with prange("stage_forward", "compute"):
                            out, kept, prefix = deferred.run_keeping([lm for _, lm in self.layers],
                                                                     self._defer, inp, upto)
                    else:
                        out = self._forward(inp)
                    if self.last_stage:
                        out = self._loss(out, ys[m].to(device)) * (sizes[m] / batch)
                        loss_sum += out.detach().double()
                    else:
                        out = out.to(dtype) if out.is_floating_point() else out
                        sends.append(self._send(out, stage + 1, _FWD + m))
                    held[m] = (None if self.first_stage else inp, out)
                    if i == last_forward and self.last_stage:
                        if self.output_split != REPLICATED:  # the shares of the split output's ranks
                            group = self._layout(self.output_split).spatial_group
                            dist.all_reduce(loss_sum, group=group)
                        loss_x.start(loss_sum)  # known now: off the step's critical path from here
                    if i == last_forward and self.replica_stats is not None and self._training:
                        self.replica_stats.start()  # the step's last update of running statistics
                else:
                    with no_autocast(device.type):  # backward passes run outside autocast
                        if i == last_backward and self.reducer is not None:
                            self.reducer.arm()
                        grad = (loss_scale if self.last_stage else take(ops[i]))
                        inp, out = held.pop(m)
                        split = m == split_m and out.requires_grad
                        if split:  # input gradient first, sent below, then the weights'
                            with prange("stage_backward_input", "compute"):
                                root = out
                                if prefix is not None:  # the layers after the split prefix first
                                    root, grad = deferred.rest_pass(out, grad, prefix,
                                                                    self._params(upto, None))
                                deferred.input_pass(root, grad, inp, kept, self._params(0, upto, True))
                        elif out.requires_grad:
                            with prange("stage_backward", "compute"):
                                out.backward(grad)
                        if inp is not None:
                            g = inp.grad if inp.grad is not None else torch.zeros_like(inp)
                            sends.append(self._send(g, stage - 1, _BWD + m))
                        if split:
                            if inp is not None:  # free the sent gradient before the weight pass
                                sends.pop().wait()  # gloo holds it until then (NCCL: stream order)
                                g = inp.grad = None
                            with prange("stage_backward_weight", "compute"):
                                deferred.weight_pass(kept)
                            kept, inp, out, prefix, root = [], None, None, None, None  # what pass 1 kept
                post(i + 1)
        for w in sends:
            w.wait()
        if self.reducer is not None:
            self.reducer.finish()
        if self.replica_stats is not None:
            self.replica_stats.finish()
        return loss_x.finish()

    @torch.no_grad()
    def predict(self, x_local: torch.Tensor, batch: int | None = None) -> torch.Tensor:
        """Model outputs for this replica's samples, on every rank of the replica (all stages).

        In training mode the forward updates running statistics, which are then averaged over the
        data-parallel replicas: call it on every replica alike."""
        self._require_built("predict")
        batch = x_local.shape[0] if batch is None else batch
        sizes = _split_sizes(batch, self.spec.pipeline.microbatches)
        x_local = self._placed(x_local) if self.first_stage else x_local
        xs = x_local.split(sizes) if self.first_stage else [None] * len(sizes)
        dtype, device = self._dtype_device(x_local)
        autocast, low = autocast_state(device.type)
        if autocast and dtype == torch.float32:  # as train_step: a cut carries the autocast dtype
            dtype = low
        stage, outs, sends = self.grid.pipe_index, [], []
        for m, b in enumerate(sizes):
            inp = xs[m] if self.first_stage else self._recv(self._in_shape(b), dtype, device, stage - 1,
                                                           _FWD + m)
            out = self._run(inp)
            if self.last_stage:
                if self.output_split != REPLICATED:  # predictions are whole volumes
                    out = gather(out, self._layout(self.output_split),
                                 tuple(self.output_record.output_shape[2:]))
                outs.append(out)
            else:
                sends.append(self._send(out.to(dtype) if out.is_floating_point() else out, stage + 1,
                                        _FWD + m))
        for w in sends:
            w.wait()
        if self.replica_stats is not None and self._training:  # it updated running statistics
            self.replica_stats.sync()
        final = (batch, *self.output_record.output_shape[1:])
        y = torch.cat(outs) if self.last_stage else torch.empty(final, dtype=dtype, device=device)
        if self.grid.pipe > 1:
            dist.broadcast(y, self._peer(self.grid.pipe - 1), group=self.grid.pipe_group)
        return y

    # ------------------------------------------------------------------ state
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's entries of the original model's state dict."""
        self._require_built("local_state_dict")
        return {f"{name}.{k}" if name else k: v for name, m in self.layers if name is not None
                for k, v in m.state_dict().items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The original model's state dict (keys, shapes, order), assembled from all stages, on every rank."""
        local = {k: v.detach().cpu().clone() for k, v in self.local_state_dict().items()}
        parts = [local]
        if self.grid.pipe > 1:
            parts = [None] * self.grid.pipe
            dist.all_gather_object(parts, local, group=self.grid.pipe_group)
        merged = {k: v for p in parts for k, v in p.items()}
        return {k: merged[k] for k in self._state_keys if k in merged}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load the original model's state dict into this rank's layers (any layout saved it)."""
        self._require_built("load_full_state_dict")
        for name, m in self.layers:
            if name is None:
                continue
            prefix = f"{name}." if name else ""
            sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
            if not name:  # a graph stage holds only its own stage's layers
                sub = {k: v for k, v in sub.items() if k in m.state_dict()}
            m.load_state_dict(sub)


class _LossExchange:
    """The global-batch mean loss of one step, on every rank, without a collective at the step's end.

    Why: the last stage knows its replica's loss after its last forward, long before the step ends.
    It sends it to the replica's other stages then (their receives are posted when the step starts)
    and launches the average over data-parallel replicas, so that at the end of the step no rank
    waits on a rank that may have gone to sleep (on a GPU, an all-reduce over every stage would
    also tie the last stage's end to the first stage's last backward).
    """

    def __init__(self, engine: Engine, device: torch.device) -> None:
        self.engine, self.grid = engine, engine.grid
        self.sends: list[Any] = []
        self.reduce: Any = None
        self.value = torch.zeros(1, dtype=torch.float64, device=device)
        self.recv: Any = None
        if not engine.last_stage:
            self.recv = engine.post_recv(self.value, engine._peer(self.grid.pipe - 1), engine.loss_group,
                                         _LOSS)

    def start(self, loss_sum: torch.Tensor) -> None:
        """On the last stage, once its replica loss is complete: send it on, start the average."""
        self.value.copy_(loss_sum.reshape(1))
        if self.grid.pipe > 1:
            out = self.value.clone()  # the all-reduce below works in place while these are in flight
            self.sends = [self.engine.post_send(out, self.engine._peer(k), self.engine.loss_group, _LOSS)
                          for k in range(self.grid.pipe - 1)]
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


def parallelize(model: nn.Module, spec: ParallelSpec | dict | str | Path, loss_fn: Callable | None = None,
                *, input_shape: Sequence[int] | None = None, overlap: bool = False,
                bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                local_p2p: bool | None = None,
                memory_format: torch.memory_format = torch.contiguous_format) -> Engine:
    """Make ``model`` (any module whose forward torch.fx can trace) hybrid-parallel per ``spec``.

    ``spec`` is a :class:`ParallelSpec`, a dict of the YAML's shape, or a path to the YAML file. The
    engine is built from ``input_shape`` (global N, C, D, H, W) or from the first batch it sees.
    ``defer_weight_grads``: a stage's last backward sends its input gradient before computing its
    weight gradients, where that costs no peak memory (:mod:`hybridpar.pipeline.deferred`); False
    runs every backward in one pass.
    ``local_p2p``: stage-to-stage transfers between CPU ranks of one host copy the sender's tensor
    directly (:mod:`hybridpar.comm.local_p2p`) instead of through gloo's TCP loopback; None (the
    default) does so for a CPU model, False never (``HYBRIDPAR_LOCAL_P2P=0`` too).
    ``memory_format``: ``torch.channels_last_3d`` runs the activations NDHWC (input shards and
    activations received from the previous stage are in it; the layers keep it).
    """
    if isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif isinstance(spec, dict):
        spec = ParallelSpec.from_dict(spec)
    return Engine(model, spec, loss_fn, input_shape, overlap, bucket_bytes, defer_weight_grads, local_p2p,
                  memory_format)
