"""The built engine at other input sizes: one plan per size, kept where it decides as the built one.

Why: an engine's groups, stages and split layers are built for one input shape, yet a fully
convolutional model accepts other extents, and inference on a whole box should need no second
engine. What changes with the size is shapes alone (every split layer's global input shape, whose
halo plans it memoises per shape; the Redistributes'; the stage's ends and receive buffers; the
settings of a call whose arguments the forward computes from shapes, ``F.interpolate(x,
size=skip.shape[2:])``, whose split layer is made again at that size), as long as the plan at the new
size decides as the built one did: every node in the same split, the same redistributes and gathers.
The plan at a size comes from the one planner (:func:`hybridpar.planner.plan.build_plan`) run on a
copy of the model on the meta device (its structure, no weights: the engine lets the model itself go
after the build), so every rank derives it alike, and refuses a size alike, before any collective.
:meth:`Stage.bind` then sets its shapes.

The size itself: ``shard_batch`` sees the global batch; ``predict`` sees only this rank's shard, from
which no rank can tell the whole volume's extent alone (a shard of 5 voxels of 2 is a part of 9 or of
10), so :func:`agree_size` gathers every rank's input shape once per call (a few integers over the
CPU side of the default group).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.axes import REPLICATED, SPATIAL_AXES
from hybridpar.call_keys import module_path
from hybridpar.flops.counter import meta_copy
from hybridpar.geometry import shard_range
from hybridpar.grid import ProcessGrid
from hybridpar.planner import ParallelSpec
from hybridpar.planner.analysis import KEPT_WHOLE, kept_whole
from hybridpar.planner.calls import module_key
from hybridpar.planner.config import REPLICATE, LayerRule
from hybridpar.planner.graph import shape_made_stand_ins, trace
from hybridpar.planner.plan import build_plan
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.swapped import refuse_parts
from hybridpar.planner.terms import SpecError


def _voxels(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def _differs(built: LayerPlan, other: LayerPlan) -> bool:
    keys = lambda lp: (lp.name, lp.kind, lp.split, lp.output_split, lp.redistribute, lp.gather,  # noqa: E731
                       len(lp.input_shape), len(lp.output_shape), lp.input_shape[1:2], lp.output_shape[1:2])
    return keys(built) != keys(other)


def _what_fits(row: LayerPlan, split: tuple[int, int, int]) -> str:
    """What a split layer whose input or output at the new size is too small would need (the largest
    split; the planner replicates such a layer, where the built engine splits it)."""
    extents = [min(shape[2 + k] for shape in (row.input_shape, row.output_shape) if len(shape) == 5)
               for k in range(3)] if len(row.input_shape) == 5 else []
    small = [(k, extent) for k, extent in enumerate(extents) if extent < split[k]]
    if small:
        return "; ".join(f"use a split of at most {extent} along {SPATIAL_AXES[k]}" for k, extent in small)
    return "build an engine for this size (parallelize(..., input_shape=...))"


class SizePlans:
    """Plans of the model at other input sizes, per (C, D, H, W), for the engine built on ``plan``
    (see the module doc). ``model``: the model at build time (copied to the meta device here);
    ``traced``: whether the engine runs its traced graph (else module swapping)."""

    def __init__(self, model: nn.Module, traced: bool, spec: ParallelSpec, world: int, plan: list[LayerPlan],
                 input_shape: tuple[int, ...]) -> None:
        self.spec, self.world, self.traced = spec, world, traced
        self.built, self.batch, self.build_volume = plan, input_shape[0], tuple(input_shape[2:])
        self.built_size = tuple(input_shape[1:])
        self.built_calls: dict[str, nn.Module | None] = {}  # the build size's calls of shape-made arguments
        # size -> the stand-ins of those calls that differ there from the build's, by node name (Stage.bind)
        self.made: dict[tuple[int, ...], dict[str, nn.Module]] = {}
        self.plans: dict[tuple[int, ...], list[LayerPlan]] = {tuple(input_shape[1:]): plan}
        self.refused: dict[tuple[int, ...], str] = {}  # size -> its line (a refusal is derived once too)
        self.checked: set[tuple] = set()  # (size, mode) the forward was planned in (check_mode)
        self.why_not = ""
        try:
            self.model: nn.Module | None = meta_copy(model)
        except Exception as err:  # noqa: BLE001 (a model deepcopy refuses: other sizes are refused too)
            self.model, self.why_not = None, f"the model cannot be copied to the meta device ({err})"
        if self.model is not None and not traced:  # its layers every call ran whole: whole at any size
            whole = kept_whole(plan)
            for name, m in self.model.named_modules():
                if name in whole:
                    setattr(m, KEPT_WHOLE, True)
        self.graph: Any = None

    def shape(self, size: tuple[int, ...]) -> tuple[int, ...]:
        """The global input shape the plan at ``size`` (C, D, H, W) is made for (the built batch)."""
        return (self.batch, *size)

    def at(self, size: tuple[int, ...], caller: str) -> list[LayerPlan]:
        """The plan at ``size`` (C, D, H, W), its rows in the built plan's stages; ValueError (one
        line naming the layer and what would fit) where the built plan's decisions do not hold."""
        size = tuple(int(s) for s in size)
        found = self.plans.get(size)
        if found is not None:
            return found
        where = f"{caller}: an input of {_voxels(size[1:])} voxels (C={size[0]})"
        if size not in self.refused:
            try:
                self.plans[size] = self._derive(size)
                return self.plans[size]
            except ValueError as err:
                self.refused[size] = str(err)
        raise ValueError(f"{where}: {self.refused[size]}")

    def check_mode(self, size: tuple[int, ...], caller: str) -> None:
        """Refuse, in one line, a forward that in the mode the meta copy is in now (not the built one)
        does what the engine cannot run as one process does (an eval branch reading the batch's extent
        as a value, a mean over a batch held in parts): the built mode's plan never followed that branch,
        and the run follows it without the plan's checks. Planned once per size and mode."""
        key = (tuple(size), self.model.training if self.model is not None else None)
        if self.model is None or self.traced or key in self.checked:
            return
        try:
            build_plan(self.spec, self.model, self.shape(size), self.world, None)
        except SpecError as err:
            mode = "training" if self.model.training else "eval"
            raise ValueError(f"{caller} in {mode} mode, which the engine was not built in: "
                             f"{str(err).strip().splitlines()[0]}") from None
        self.checked.add(key)

    def check_batch(self, size: tuple[int, ...], batch: int, parts: list[int], training: bool,
                    caller: str) -> None:
        """Refuse, in one line, a forward whose parts of a ``batch`` of another extent than the build's
        run other calls than the whole batch, in mode ``training`` (``if x.shape[0] == 1``: a part of one
        sample when predicting two, never met at the build's four and two). Once per size, batch, parts
        and mode: a predict at that batch again costs a set lookup."""
        key = (tuple(size), batch, tuple(parts), training)
        if self.model is None or self.traced or key in self.checked:
            return
        with self.in_mode(training):
            for part in parts:
                try:
                    refuse_parts(self.model, (batch, *size), self.spec.grid.spatial, part)
                except SpecError as err:
                    raise ValueError(f"{caller} on a batch of {batch} in parts of {part}: "
                                     f"{str(err).strip().splitlines()[0]}") from None
        self.checked.add(key)

    @contextlib.contextmanager
    def in_mode(self, training: bool) -> Iterator[None]:
        """The meta copy in mode ``training``, every module's flag put back after."""
        flags = [(m, m.training) for m in self.model.modules()]
        self.model.train(training)
        try:
            yield
        finally:
            for m, mode in flags:
                m.training = mode

    def _made_at(self, calls: dict[str, nn.Module | None]) -> dict[str, nn.Module]:
        """The calls whose arguments the forward computes from shapes (``F.interpolate(x,
        size=skip.shape[2:])``, an odd-size guard's ``F.pad``) that at another size stand for a layer
        of other settings than at the build size: the stage runs them with their own split layers there
        (:meth:`StageGraph.bind`). ValueError where such a call stands for another kind of layer."""
        made = {}
        for name, module in calls.items():
            built = self.built_calls.get(name)
            if type(module) is not type(built):
                kind = lambda m: "the call on the whole tensor" if m is None else type(m).__name__  # noqa: E731
                raise ValueError(f"{name}: its arguments, computed from shapes, make it {kind(module)} at "
                                 f"this size where the engine runs {kind(built)}; build an engine for "
                                 f"this size (parallelize(..., input_shape=...))")
            if module is not None and module_key(module) != module_key(built):
                made[name] = module
        return made

    def _derive(self, size: tuple[int, ...]) -> list[LayerPlan]:
        """The planner's plan at ``size``, checked against the built one; ValueError says why not."""
        if self.model is None:
            raise ValueError(f"the engine runs only its build size {_voxels(self.build_volume)}: "
                             f"{self.why_not}")
        try:
            if self.traced and self.graph is None:
                self.graph = trace(self.model)
                build_plan(self.spec, self.model, self.shape(self.built_size), self.world, self.graph)
                self.built_calls = shape_made_stand_ins(self.graph)
            plan = self._plan(size)
        except Exception as err:  # noqa: BLE001 (the model's own error at this size, in one line)
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(first) from None
        if not self.traced:
            self._same_layers(plan)
            return plan  # one stage (a pipeline needs a traced graph)
        made = self._made_at(shape_made_stand_ins(self.graph))
        if len(plan) != len(self.built):
            raise ValueError(f"the model makes {len(plan)} nodes at this size where the engine was built "
                             f"on {len(self.built)}; build an engine for this size")
        for built, row in zip(self.built, plan, strict=True):
            if _differs(built, row) and (built.split, built.output_split) == (row.split, row.output_split):
                raise ValueError(f"layers: {row.name} ({row.kind}, input {list(row.input_shape)}) at this "
                                 f"size stands where the engine runs {built.name} ({built.kind}, input "
                                 f"{list(built.input_shape)}): the forward takes another path at "
                                 f"this size (a branch on a shape); build an engine for this size "
                                 f"(parallelize(..., input_shape=...))")
            if _differs(built, row):
                raise ValueError(f"layers: {row.name} ({row.kind}) would run split "
                                 f"{list(row.split)} (output {list(row.output_split)}) at this size, where "
                                 f"the engine runs it split {list(built.split)} (output "
                                 f"{list(built.output_split)}); {_what_fits(row, built.split)}")
        self.made[size] = made
        return [dataclasses.replace(row, stage=built.stage)  # the built cuts, wherever auto balance would cut
                for built, row in zip(self.built, plan, strict=True)]

    def _plan(self, size: tuple[int, ...]) -> list[LayerPlan]:
        """The planner's plan at ``size``, a layer the built engine runs whole (replicated: too small to
        split at the build size, a U-Net's bottleneck) kept whole where the planner would split it at this
        size (a larger box): gathered as at the build, exact, where the built layers hold no split
        version of it. Each such layer is given a rule ``spatial: replicate``, and the plan derived again
        with them, since what follows it may then be placed otherwise too."""
        spec, kept = self.spec, set()
        while True:  # each round rules rows no rule named before: as many rounds as rows at most
            plan = build_plan(spec, self.model, self.shape(size), self.world, self.graph)
            if not self.traced or len(plan) != len(self.built):
                return plan
            whole = [row.name for built, row in zip(self.built, plan, strict=True) if built.name == row.name
                     and built.split == REPLICATED != row.split and not any(r.pattern == row.name
                                                                            for r in spec.layers)]
            if not whole:
                break
            kept.update(whole)
            spec = dataclasses.replace(spec, layers=(*spec.layers, *(LayerRule(n, REPLICATE) for n in whole)))
        # as the built rows say why they run whole (too small to split), not as the rules given here
        return [dataclasses.replace(row, rule=built.rule, gather=built.gather,
                                    auto_replicated=built.auto_replicated) if row.name in kept else row
                for built, row in zip(self.built, plan, strict=True)]

    def _same_layers(self, plan: list[LayerPlan]) -> None:
        """Refuse a plan at another size of a forward run by module swapping where one of the model's
        layers runs in another split than the built engine converted it for, or is one the build never
        met. Its run decides at each call what the calls between layers do (it follows the shapes they
        make, ``split_forward``), so a size may make other calls than the build's (an odd-size guard's
        ``F.pad`` taken or not) and call a layer more or less often."""
        built: dict[str, set[tuple]] = {}
        for r in self.built:
            built.setdefault(module_path(r.name), set()).add((r.split, r.output_split))
        modules = dict(self.model.named_modules()) if self.model is not None else {}
        for row in plan:
            path = module_path(row.name)
            if path not in modules or type(modules[path]).__name__ != row.kind:
                continue  # a call between the layers (a pad, an interpolate): followed at each call
            if path not in built:
                raise ValueError(f"layers: {row.name} ({row.kind}) runs at this size, where the engine "
                                 f"never met it (a branch on a shape); build an engine for this size "
                                 f"(parallelize(..., input_shape=...))")
            if (row.split, row.output_split) not in built[path]:
                split, out = next(iter(built[path]))
                raise ValueError(f"layers: {row.name} ({row.kind}) would run split {list(row.split)} (output "
                                 f"{list(row.output_split)}) at this size, where the engine runs it split "
                                 f"{list(split)} (output {list(out)}); {_what_fits(row, split)}")


def volume_of(shards: dict[tuple[int, int, int], tuple[int, ...]], parts: tuple[int, ...]) -> tuple[int, ...]:
    """The global (D, H, W) of a volume whose shards, by spatial coordinate under a split ``parts``,
    have the (D, H, W) extents ``shards``; ValueError where they are not the boxes the engine's
    layout (:func:`hybridpar.geometry.shard_range`) gives that volume."""
    every = {(i, j, k) for i in range(parts[0]) for j in range(parts[1]) for k in range(parts[2])}
    if set(shards) != every:
        missing = sorted(every - set(shards))
        raise ValueError(f"no input shard came from the ranks at {[list(c) for c in missing]} of the split "
                         f"{list(parts)} (each rank of the first stage passes its shard)")
    along = lambda axis, i: tuple(i if a == axis else 0 for a in range(3))  # noqa: E731
    extent = tuple(sum(shards[along(axis, i)][axis] for i in range(parts[axis])) for axis in range(3))
    for coord, local in sorted(shards.items()):
        want = tuple(hi - lo for lo, hi in (shard_range(extent[a], parts[a], coord[a]) for a in range(3)))
        if tuple(local) != want:
            raise ValueError(f"the shards do not tile one volume as shard_batch lays it out: the shard at "
                             f"{list(coord)} of a split {list(parts)} holds {_voxels(local)} voxels where a "
                             f"volume of {_voxels(extent)} gives it {_voxels(want)}")
    return extent


def agree_size(x_local: Any, grid: ProcessGrid, input_grid: ProcessGrid, caller: str
               ) -> tuple[tuple[int, ...], int]:
    """(C, D, H, W) of the global volume whose shards the first stage's ranks hold in ``x_local``, and
    this replica's batch: one all-gather of a few integers over the job, then the same arithmetic
    on every rank, so that a refusal is raised alike everywhere. Every replica predicts at one size."""
    first = grid.pipe_index == 0 and isinstance(x_local, torch.Tensor)
    shape = list(x_local.shape) if first else []
    ndim = len(shape)
    shape = (shape + [0] * 5)[:5]
    mine = torch.tensor([int(first), ndim, *shape, grid.data_index, *input_grid.spatial_coord],
                        dtype=torch.int64)
    if dist.get_world_size() == 1:
        rows = [mine.tolist()]
    else:
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        rows = [t.tolist() for t in everyone]
    replicas: dict[int, dict[tuple[int, int, int], tuple[int, ...]]] = {}
    for rank, (has, nd, *rest) in enumerate(rows):
        if not has:
            continue
        full, data, coord = tuple(rest[:5]), rest[5], tuple(rest[6:9])
        if nd != 5:
            raise ValueError(f"{caller}: rank {rank}'s input is {nd}-D; the model takes N, C, D, H, W shards")
        seen = replicas.setdefault(data, {}).setdefault(coord, full)
        if seen != full:
            raise ValueError(f"{caller}: two ranks of replica {data} hold the input shard at {list(coord)} "
                             f"with shapes {list(seen)} and {list(full)}")
    for data in range(grid.data):
        replicas.setdefault(data, {})
    sizes: dict[int, tuple[int, ...]] = {}
    batches: dict[int, int] = {}
    for data, shards in sorted(replicas.items()):
        heads = {s[:2] for s in shards.values()}
        if len(heads) > 1:
            raise ValueError(f"{caller}: the input shards of replica {data} disagree on N, C: "
                             f"{sorted(heads)}")
        try:
            dhw = volume_of({c: s[2:] for c, s in shards.items()}, input_grid.spatial_shape)
        except ValueError as err:
            raise ValueError(f"{caller}: replica {data}: {err}") from None
        (n, c), = heads or {(0, 0)}
        sizes[data], batches[data] = (c, *dhw), n
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{caller}: every data-parallel replica predicts at one size; got "
                         + ", ".join(f"replica {d}: {_voxels(s[1:])}" for d, s in sorted(sizes.items())))
    return next(iter(sizes.values())), batches[grid.data_index]
