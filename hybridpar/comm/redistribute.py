"""Changing how an activation is split: scatter, gather and redistribution between layouts.

Why: layers want different splits (a 2×2×2 split early, 1×1×8 deeper, replicated before a dense
head), and moving between them must be exact and differentiable. One mechanism covers all cases:
each rank sends every other rank the intersection of the box it holds with the box that rank needs.
Under the convention of :mod:`hybridpar.comm.reduce` (replicated tensors count once), the adjoint of
a redistribution is the redistribution back, so backward is the same code with the layouts swapped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridpar.comm.transport import point_to_point
from hybridpar.device import memfmt
from hybridpar.device.eager import eager
from hybridpar.geometry import Range, shard_box
from hybridpar.grid import ProcessGrid
from hybridpar.profiling import range as prange

Box = tuple[Range, Range, Range]
_TAG = 300


def local_box(shape: tuple[int, int, int], grid: ProcessGrid, coord: tuple[int, ...] | None = None) -> Box:
    """The global (D, H, W) ranges held at spatial ``coord`` (default: this rank's) of ``grid``."""
    return shard_box(shape, grid.spatial_shape, grid.spatial_coord if coord is None else coord)  # type: ignore


def _coords(grid: ProcessGrid) -> list[tuple[int, int, int]]:
    sd, sh, sw = grid.spatial_shape
    return [(i // (sh * sw), (i // sw) % sh, i % sw) for i in range(grid.spatial_size)]


@eager
def infer_global_shape(x_local: torch.Tensor, grid: ProcessGrid) -> tuple[int, int, int]:
    """Global (D, H, W) of a split activation from every rank's local extents (one small collective).

    The metadata travels as a CPU tensor, i.e. over the gloo side of the group even next to NCCL.
    """
    if grid.spatial_size == 1:
        return tuple(x_local.shape[-3:])  # type: ignore[return-value]
    mine = torch.tensor(list(x_local.shape), dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(grid.spatial_size)]
    dist.all_gather(everyone, mine, group=grid.spatial_group)
    shapes = [tuple(t.tolist()) for t in everyone]
    if any(s[:-3] != shapes[0][:-3] for s in shapes):
        raise ValueError(f"hybridpar: ranks of one spatial group disagree on the non-spatial dims of "
                         f"an activation: {sorted(set(s[:-3] for s in shapes))}")
    coords = _coords(grid)
    out = []
    for axis in range(3):
        out.append(sum(shapes[i][-3 + axis] for i, c in enumerate(coords)
                       if all(c[a] == 0 for a in range(3) if a != axis)))
    return tuple(out)  # type: ignore[return-value]


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
    return None if any(lo >= hi for lo, hi in box) else box  # type: ignore[return-value]


def _slices(box: Box, origin: Box, trailing: int = 0) -> tuple[slice, ...]:
    """The index of ``box`` in a tensor holding ``origin`` in its spatial dims, which come before
    ``trailing`` further dims."""
    return (Ellipsis, *(slice(lo - o[0], hi - o[0]) for (lo, hi), o in zip(box, origin)),
            *(slice(None),) * trailing)


def _source(src: ProcessGrid, dst: ProcessGrid, q_index: int, coord: tuple[int, int, int]) -> int:
    """Stage position of the rank that sends ``coord``'s src shard to the rank at stage position q."""
    replicas = src.stage_size // src.spatial_size
    sd, sh, sw = src.spatial_shape
    within = (coord[0] * sh + coord[1]) * sw + coord[2]
    if q_index % src.spatial_size == within:   # q holds that shard itself: no traffic
        return q_index
    return (q_index % replicas) * src.spatial_size + within


def redistribute_tensor(x: torch.Tensor, shape: tuple[int, int, int], src: ProcessGrid,
                        dst: ProcessGrid, trailing: int = 0) -> torch.Tensor:
    """Move ``x`` (this rank's piece under ``src``) to this rank's piece under ``dst`` (no autograd).
    The spatial dims are the last three, or the three before ``trailing`` dims that travel whole (the
    real and imaginary parts of a complex field viewed as real)."""
    if (src.stage_size, src.data_index, src.pipe_index) != (dst.stage_size, dst.data_index, dst.pipe_index):
        raise ValueError("hybridpar: Redistribute works between layouts of the same stage ranks")
    if src.spatial_shape == dst.spatial_shape:
        return x
    me, t = src.spatial_index, trailing
    lead, tail = x.shape[:x.dim() - 3 - t], x.shape[x.dim() - t:]
    rank_of = lambda i: src.global_rank(src.data_index, src.pipe_index, i)  # noqa: E731
    my_src = local_box(shape, src)
    my_dst = local_box(shape, dst)
    src_coords = _coords(src)
    sends, recvs, local, received = [], [], [], []
    for q in range(src.stage_size):
        q_dst = local_box(shape, dst, _coords(dst)[q % dst.spatial_size])
        for c in src_coords:
            piece = _intersect(local_box(shape, src, c), q_dst)
            if piece is None:
                continue
            sender = _source(src, dst, q, c)
            if sender == me and q == me:
                local.append(piece)
            elif sender == me:
                sends.append((rank_of(q), memfmt.dense(x[_slices(piece, my_src, t)]), _TAG))
            elif q == me:
                buf = memfmt.empty((*lead, *(hi - lo for lo, hi in piece), *tail), x)
                recvs.append((rank_of(sender), buf, _TAG))
                received.append((piece, buf))
    # The world group: a layout's own group may hold a single replica, and this runs on the main thread.
    with prange("redistribute", "halo"):
        point_to_point(None).exchange(sends, recvs)
    # the output is made once the packed sends are freed, and each receive buffer goes once copied:
    # at most the input, the received pieces and the output live at once
    sends.clear()
    recvs.clear()
    out = memfmt.empty((*lead, *(hi - lo for lo, hi in my_dst), *tail), x)  # x's dtype and format
    for piece in local:
        out[_slices(piece, my_dst, t)] = x[_slices(piece, my_src, t)]
    while received:
        piece, buf = received.pop()
        out[_slices(piece, my_dst, t)] = buf
        del buf
    return out


class Redistribution(torch.autograd.Function):
    """Differentiable :func:`redistribute_tensor`; backward moves gradients back the other way, as
    this function again (so that it differentiates twice)."""

    @staticmethod
    def forward(ctx, x, shape, src, dst, trailing=0):
        ctx.meta = (shape, src, dst, trailing)
        return redistribute_tensor(x, shape, src, dst, trailing)

    @staticmethod
    def backward(ctx, g):
        shape, src, dst, trailing = ctx.meta
        return Redistribution.apply(memfmt.dense(g), shape, dst, src, trailing), None, None, None, None


def redistribute(x: torch.Tensor, src: ProcessGrid, dst: ProcessGrid,
                 shape: tuple[int, int, int] | None = None, trailing: int = 0) -> torch.Tensor:
    """``x`` split as ``src`` -> the same global tensor split as ``dst`` (differentiable). The spatial
    dims are the last three, or the three before ``trailing`` whole dims (``shape`` then required).

    Communication runs eagerly under ``torch.compile`` (a graph break); between equal splits there
    is none, and no break."""
    same = lambda g: (g.spatial_shape, g.stage_size, g.data_index, g.pipe_index)  # noqa: E731
    if same(src) == same(dst):
        return x
    if trailing and shape is None:
        raise ValueError("hybridpar.redistribute: with trailing dims, give the global (D, H, W) shape; it "
                         "cannot be inferred from the shards' last three dims")
    return _redistribute(x, src, dst, shape, trailing)


@eager
def _redistribute(x: torch.Tensor, src: ProcessGrid, dst: ProcessGrid,
                  shape: tuple[int, int, int] | None, trailing: int = 0) -> torch.Tensor:
    shape = infer_global_shape(x, src) if shape is None else tuple(shape)
    return Redistribution.apply(x, shape, src, dst, trailing)


@eager
def scatter(x: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """A global (N, C, D, H, W) tensor, the same on every rank -> this rank's shard (differentiable).

    The gradient of ``x`` is assembled from every shard's gradient, so it equals what the whole-volume
    computation would give, on every rank.
    """
    if x.dim() < 3:
        raise ValueError(f"hybridpar.scatter: expected (..., D, H, W), got shape {tuple(x.shape)}")
    return Redistribution.apply(x, tuple(x.shape[-3:]), grid.with_spatial(None), grid)


def gather(x_local: torch.Tensor, grid: ProcessGrid,
           shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """This rank's shard -> the global tensor on every rank of the spatial group (differentiable)."""
    return redistribute(x_local, grid, grid.with_spatial(None), shape)  # (compiler-disabled)
