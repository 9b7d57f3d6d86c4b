"""The process grid: data-parallel replicas × pipeline stages × a 3D spatial grid.

Why: every other piece asks the same questions (which sub-volume do I own, who are my neighbours
along height, which ranks reduce my gradients, which rank of the next stage gets my activations),
and the answers must agree on every rank. Vocabulary: an *axis* is a grid axis (``data``, ``pipe``,
``d``, ``h``, ``w``); a *dim* is a tensor dimension.

Rank order is row-major over (data, pipe, d, h, w), so the ranks of one spatial group are adjacent
(one node) and halo traffic stays local while data-parallel traffic crosses nodes.

A layer may split its activations differently from its neighbours (``grid.with_spatial((1, 1, 4))``):
such a *layout* re-factors the same stage ranks. A layout that uses fewer ranks than the stage has
(``(2, 1, 1)`` on 4 ranks, or ``(1, 1, 1)`` for a replicated head) is held by several identical
replicas, each computing the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from functools import cached_property

import torch
import torch.distributed as dist

from hybridpar.axes import AXES, Axes, LeftoverError, fill_leftover
from hybridpar.process.lifetime import collective_timeout, on_shutdown

_GROUP_CACHE: dict[tuple, list[dist.ProcessGroup]] = {}


def _partition_groups(partition: list[list[int]], purpose: str = "") -> list[dist.ProcessGroup]:
    """Create (once) one process group per block of a partition of the world; every rank must call.

    Groups are created in the same order on every rank, as ``new_group`` requires. Groups of the
    same partition are shared unless their ``purpose`` differs: a communicator of its own is what
    keeps traffic issued from another thread or stream (halos) from interleaving with the main
    thread's on the same ranks.
    """
    if all(len(b) == 1 for b in partition):
        return [_self_group()] * len(partition)
    key = (purpose, tuple(tuple(b) for b in partition))
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = [dist.new_group(list(b), timeout=collective_timeout()) for b in partition]
    return _GROUP_CACHE[key]


def forget_groups() -> None:
    """Drop the cached groups (:func:`hybridpar.process.launchers.shutdown` calls it): they belong to a
    process group that is being destroyed, and a later ``init_distributed`` must create its own."""
    _GROUP_CACHE.clear()


on_shutdown(forget_groups)


def _self_group() -> dist.ProcessGroup:
    """This rank alone, created on first use by this rank only and shared by every purpose.

    Why: a group of one rank moves no data, so nothing can interleave on it, yet each communicator
    costs every member threads and buffers (gloo: 3 threads and ~0.07 MiB per rank; NCCL: device
    buffers), and layouts with a trivial axis (a pipeline without spatial splits, data parallelism
    alone) would otherwise create one per trivial group. Its name is hashed from the rank (local
    synchronization), so creating it lazily on some ranks leaves the order of every collective
    ``new_group`` alone.
    """
    key = ("self", dist.get_rank())
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = [dist.new_group([dist.get_rank()], use_local_synchronization=True,
                                             timeout=collective_timeout())]
    return _GROUP_CACHE[key][0]


def _resolve(data: int, pipe: int, spatial: Sequence[int], world: int) -> tuple[int, int, tuple[int, ...]]:
    if len(spatial) != 3:
        raise ValueError(f"ProcessGrid: spatial must have 3 entries (d, h, w), got {tuple(spatial)}")
    try:
        sizes = fill_leftover([data, pipe, *spatial], world)
    except LeftoverError as err:
        if err.several:
            raise ValueError("ProcessGrid: at most one size may be -1 (the ranks left over)") from None
        raise ValueError(f"ProcessGrid: world size {world} is not divisible by the fixed sizes "
                         f"(product {err.known})") from None
    if any(s < 1 for s in sizes):
        raise ValueError(f"ProcessGrid: sizes must be positive, got data={data} pipe={pipe} "
                         f"spatial={tuple(spatial)}")
    axes = Axes.of(sizes)
    if axes.world != world:
        d, p, (sd, sh, sw) = axes.data, axes.pipe, axes.spatial
        raise ValueError(
            f"ProcessGrid: data({d}) * pipe({p}) * spatial({sd}*{sh}*{sw}) = {axes.world} "
            f"!= world size {world}")
    return axes.data, axes.pipe, axes.spatial


def require_group(who: str) -> None:
    """Raise, naming ``who``, unless this process has joined the job's process group."""
    if not dist.is_initialized():
        raise RuntimeError(f"hybridpar.{who}: no process group yet; call hybridpar.init_distributed() first "
                           f"(a plain process gets a one-rank group) or start under a launcher "
                           f"(torchrun, mpirun, srun) whose script calls it")


class ProcessGrid:
    """data × pipe × (d, h, w) ranks, with the groups and neighbours each rank needs.

    ``ProcessGrid(spatial=(2, 2, 1))`` on 4 ranks splits every activation in two along depth and
    height. Sizes may hold one ``-1``: the ranks left over. The job's process group must exist first
    (:func:`require_group`): joining it is the program's decision, made once, not a side effect of
    building a grid.
    """

    def __init__(self, data: int = 1, pipe: int = 1, spatial: Sequence[int] = (1, 1, 1)) -> None:
        require_group("ProcessGrid")
        axes = Axes.of(_resolve(data, pipe, spatial, dist.get_world_size()))
        self._place(axes, dist.get_rank(), axes.spatial, {})

    # ------------------------------------------------------------------ layouts
    def _place(self, axes: Axes, rank: int, split: tuple[int, int, int],
               layouts: dict[tuple[int, ...], ProcessGrid]) -> None:
        """This grid as ``rank``'s view of the job's ``axes`` under the spatial ``split``, entered in
        ``layouts``: the layouts of one job, shared by all of them, so that each is made (and its
        groups created) once however many parts ask for it."""
        self.axes = axes
        self.world_size, self.rank = axes.world, rank
        self.data, self.pipe, self.stage_spatial = axes.data, axes.pipe, axes.spatial
        self.stage_size = axes.stage_size
        self.spatial_index = rank % self.stage_size          # position within the stage's ranks
        self.pipe_index = (rank // self.stage_size) % self.pipe
        self.data_index = rank // (self.stage_size * self.pipe)
        self._layout(split)
        self._layouts = layouts
        layouts[self.spatial_shape] = self

    def _layout(self, spatial: tuple[int, int, int]) -> None:
        self.spatial_shape = tuple(int(s) for s in spatial)
        self.spatial_size = math.prod(self.spatial_shape)
        if self.stage_size % self.spatial_size:
            raise ValueError(
                f"ProcessGrid: a spatial split {self.spatial_shape} ({self.spatial_size} ranks) must "
                f"divide the {self.stage_size} ranks of a stage {self.stage_spatial}")
        self.replica = self.spatial_index // self.spatial_size
        rest = self.spatial_index % self.spatial_size
        sd, sh, sw = self.spatial_shape
        self.spatial_coord = (rest // (sh * sw), (rest // sw) % sh, rest % sw)

    def with_spatial(self, spatial: Sequence[int] | None) -> ProcessGrid:
        """The same ranks with another spatial split (``None`` or ``(1, 1, 1)``: replicated)."""
        spatial = (1, 1, 1) if spatial is None else tuple(int(s) for s in spatial)
        if len(spatial) != 3:
            raise ValueError(f"ProcessGrid.with_spatial: need 3 sizes (d, h, w), got {spatial}")
        other = self._layouts.get(spatial)
        if other is None:
            other = object.__new__(ProcessGrid)
            other._place(self.axes, self.rank, spatial, self._layouts)
        return other

    @property
    def root(self) -> ProcessGrid:
        """The grid with the stage's own spatial split."""
        return self.with_spatial(self.stage_spatial)

    # ------------------------------------------------------------------ rank arithmetic
    def global_rank(self, data: int, pipe: int, spatial_index: int) -> int:
        """Global rank of position ``spatial_index`` within the stage ranks of (data, pipe)."""
        return (data * self.pipe + pipe) * self.stage_size + spatial_index

    def rank_at(self, coord: Sequence[int], replica: int | None = None) -> int:
        """Global rank holding spatial ``coord`` of this layout, in this rank's replica and stage."""
        sd, sh, sw = self.spatial_shape
        rep = self.replica if replica is None else replica
        idx = rep * self.spatial_size + (coord[0] * sh + coord[1]) * sw + coord[2]
        return self.global_rank(self.data_index, self.pipe_index, idx)

    def neighbours(self, axis: int, periodic: bool = False) -> tuple[int | None, int | None]:
        """Global ranks of the lower and upper neighbours along spatial axis 0, 1 or 2 (None at edges).

        ``periodic``: the axis wraps around (a periodic box): the first rank's lower neighbour is the
        last rank, with two ranks both neighbours are the other one, and with one it is itself.
        """
        out: list[int | None] = []
        n = self.spatial_shape[axis]
        for step in (-1, 1):
            c = list(self.spatial_coord)
            c[axis] += step
            if periodic:
                c[axis] %= n
            out.append(self.rank_at(c) if 0 <= c[axis] < n else None)
        return out[0], out[1]

    @property
    def spatial_ranks(self) -> list[int]:
        """Global ranks of this rank's spatial group (its replica of this layout), in coordinate order."""
        base = self.replica * self.spatial_size
        return [self.global_rank(self.data_index, self.pipe_index, base + i)
                for i in range(self.spatial_size)]

    @property
    def is_replicated(self) -> bool:
        """True when this layout does not split activations at all."""
        return self.spatial_size == 1

    # ------------------------------------------------------------------ groups
    def group_of(self, key_of: Callable[[int], Hashable], world_ok: bool = False,
                 purpose: str = "") -> dist.ProcessGroup:
        """The group of ranks sharing ``key_of(rank)`` (a global rank), created on every rank in the
        same order: every rank must call it with the same ``key_of``.

        ``world_ok``: when that group is every rank, use the default group instead of a new one (a
        communicator costs each rank threads and buffers, ~0.75 MiB with gloo). Only for groups whose
        operations the main thread issues one at a time, so they cannot interleave with others'.
        ``purpose``: a communicator distinct from other groups of the same ranks (see
        :func:`_partition_groups`).
        """
        blocks: dict[Hashable, list[int]] = {}
        for r in range(self.world_size):
            blocks.setdefault(key_of(r), []).append(r)
        partition = sorted(blocks.values())
        if world_ok and len(partition) == 1:
            return dist.group.WORLD
        groups = _partition_groups(partition, purpose)
        return groups[next(i for i, b in enumerate(partition) if self.rank in b)]

    def _pos(self, r: int) -> tuple[int, int, int, int]:
        """(data, pipe, replica, index in replica) of global rank r under this layout."""
        s = r % self.stage_size
        return (r // (self.stage_size * self.pipe), (r // self.stage_size) % self.pipe,
                s // self.spatial_size, s % self.spatial_size)

    @cached_property
    def spatial_group(self) -> dist.ProcessGroup:
        """Ranks that split one activation together (same data replica, stage and layout replica)."""
        return self.group_of(lambda r: self._pos(r)[:3])

    @cached_property
    def halo_group(self) -> dist.ProcessGroup:
        """A second communicator over the spatial group, so halo traffic on a helper thread or stream
        never interleaves with collectives issued by the main thread."""
        return self.group_of(lambda r: self._pos(r)[:3], purpose="halo")

    @cached_property
    def stage_group(self) -> dist.ProcessGroup:
        """All ranks of this pipeline stage (data × spatial): where weight gradients are reduced."""
        return self.group_of(lambda r: self._pos(r)[1])

    @cached_property
    def batch_group(self) -> dist.ProcessGroup:
        """Ranks that hold the stage's global batch once under this layout: this layout replica's
        spatial ranks in every data-parallel replica (the stage group where the layout has no
        replicas). Global-batch statistics reduce over it: a layout replica holds copies of the same
        values, which the stage group would count again."""
        return self.group_of(lambda r: self._pos(r)[1:3])

    @cached_property
    def data_group(self) -> dist.ProcessGroup:
        """Ranks at the same stage and spatial position in every data-parallel replica."""
        return self.group_of(lambda r: (r % self.stage_size, self._pos(r)[1]))

    @cached_property
    def pipe_group(self) -> dist.ProcessGroup:
        """Ranks at the same spatial position of one replica, one per stage: a pipeline (its
        broadcasts and gathers run on the main thread, between steps)."""
        return self.group_of(lambda r: (r % self.stage_size, self._pos(r)[0]), world_ok=True)

    @cached_property
    def mesh(self):
        """The grid as a torch ``DeviceMesh`` with axes ("data", "pipe", "d", "h", "w")."""
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        if self.spatial_shape != self.stage_spatial:
            return self.root.mesh
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(dev, tuple(self.axes.sizes.values()), mesh_dim_names=AXES)

    def __repr__(self) -> str:
        return (f"ProcessGrid(data={self.data}, pipe={self.pipe}, spatial={self.spatial_shape}, "
                f"rank={self.rank}, coord=(data={self.data_index}, pipe={self.pipe_index}, "
                f"spatial={self.spatial_coord}, replica={self.replica}))")
