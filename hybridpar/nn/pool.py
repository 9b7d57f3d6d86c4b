"""Spatially distributed pooling: max, average (kernel != stride, padding, ceil mode), global and
adaptive.

Why: pooling windows cross shard faces exactly like convolution windows do, so the same halo plans
apply; only the boundary fill differs (-inf for max, zero for average) and average pooling's divisor,
which depends on where a window sits in the *global* volume, is computed from the geometry. Adaptive
pools reduce each of torch's bins over the parts of it every rank holds and combine them with an
all-reduce into a replicated output (see :class:`DistAdaptiveAvgPool3d` for why).

Under autocast, the window pools leave the dtype to torch's kernel (halos travel in the activation's
dtype); the global and adaptive pools give the dtype torch's adaptive pool gives (CPU autocast
promotes them to float32), found with :func:`hybridpar.device.precision.result_dtype`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hybridpar.comm.halo import HaloExchanger, exchange
from hybridpar.comm.redistribute import local_box
from hybridpar.comm.reduce import sum_to_replicated
from hybridpar.device.precision import no_autocast, result_dtype, widened
from hybridpar.geometry import Range, avg_pool_divisors, ntuple
from hybridpar.grid import ProcessGrid
from hybridpar.nn import registry
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.window import Windows


def _dims(ws: Windows, key: str) -> tuple[int, ...]:
    return tuple(getattr(w, key) for w in ws)


def window_divisors(shape, outs, w: Windows, like: torch.Tensor,
                    count_include_pad: bool = True) -> torch.Tensor:
    """torch's average-pool divisor of each of this rank's output windows (``outs`` per dim, of a global
    ``shape`` input, windows ``w``), a (d, h, w) tensor like ``like``: the outer product of the dims'."""
    per_dim = [torch.tensor(avg_pool_divisors(n, out, a.kernel, a.stride, a.pad_lo,
                                              count_include_pad), dtype=like.dtype)
               for n, out, a in zip(shape, outs, w)]
    div = per_dim[0].view(-1, 1, 1) * per_dim[1].view(1, -1, 1) * per_dim[2].view(1, 1, -1)
    return div.to(like.device)


class DistMaxPool3d(SpatialLayer, nn.MaxPool3d):
    """``torch.nn.MaxPool3d`` on a spatially split input (padding and ceil mode included)."""

    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices: bool = False,
                 ceil_mode: bool = False, *, grid: ProcessGrid | None = None,
                 transport: str | None = None) -> None:
        nn.MaxPool3d.__init__(self, kernel_size, stride, padding, dilation, return_indices, ceil_mode)
        self.init_spatial(grid, transport)
        if return_indices:
            raise NotImplementedError("DistMaxPool3d: return_indices=True is not supported: the indices "
                                      "number the whole volume's voxels and MaxUnpool3d has no split "
                                      "counterpart; upsample with ConvTranspose3d or F.interpolate")
        self.window()  # checks the arguments, one line naming the layer

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator (boundary fill -inf) for a global (D, H, W) = ``shape`` input."""
        return self.window_exchanger(shape, fill=float("-inf"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ex, w = self.halo_exchanger(self.global_shape(x)), self.window()
        return F.max_pool3d(exchange(x, ex), _dims(w, "kernel"), _dims(w, "stride"), 0, _dims(w, "dilation"))


class DistAvgPool3d(SpatialLayer, nn.AvgPool3d):
    """``torch.nn.AvgPool3d`` on a spatially split input, divisors as torch computes them."""

    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode: bool = False,
                 count_include_pad: bool = True, divisor_override: int | None = None, *,
                 grid: ProcessGrid | None = None, transport: str | None = None) -> None:
        nn.AvgPool3d.__init__(self, kernel_size, stride, padding, ceil_mode, count_include_pad,
                              divisor_override)
        self.init_spatial(grid, transport)
        self.window()  # checks the arguments, one line naming the layer
        self._divisors: dict[tuple, torch.Tensor] = {}

    def halo_exchanger(self, shape: tuple[int, int, int]) -> HaloExchanger:
        """The halo operator (boundary fill 0) for a global (D, H, W) = ``shape`` input."""
        return self.window_exchanger(shape)

    def window_sums(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each output window's sum over ``x`` (global volume, split) and torch's divisor of it."""
        shape, w = self.global_shape(x), self.window()
        ex = self.halo_exchanger(shape)
        sums = F.avg_pool3d(exchange(x, ex), _dims(w, "kernel"), _dims(w, "stride"), 0, divisor_override=1)
        outs = tuple(d.plan.out for d in ex.all_dims)
        key = (tuple(shape), outs, sums.dtype, sums.device)
        if key not in self._divisors:
            self._divisors[key] = self._new_divisor(shape, outs, w, sums)
        return sums, self._divisors[key]

    def _new_divisor(self, shape, outs, w: Windows, like: torch.Tensor) -> torch.Tensor:
        if self.divisor_override:
            return torch.tensor(float(self.divisor_override), dtype=like.dtype, device=like.device)
        return window_divisors(shape, outs, w, like, self.count_include_pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sums, divisor = self.window_sums(x)
        return sums / divisor


class DistGlobalAvgPool3d(SpatialLayer):
    """``nn.AdaptiveAvgPool3d(1)`` over the whole split volume: (N, C, 1, 1, 1), replicated."""

    def __init__(self, *, grid: ProcessGrid | None = None) -> None:
        super().__init__()
        self.init_spatial(grid, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d, h, w = self.global_shape(x)
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        return _mean(x, group, d * h * w)


def _mean(x: torch.Tensor, group, count: int) -> torch.Tensor:
    """The mean over the whole split volume, replicated, in the dtype torch's adaptive pool gives;
    partial sums travel in float32 for bf16/fp16 (one rounding, as torch's kernel)."""
    dtype = result_dtype("adaptive_avg_pool3d", _adaptive_avg_probe, x)
    acc = torch.float32 if dtype.itemsize < 4 else dtype
    return (sum_to_replicated(x.sum(dim=(2, 3, 4), keepdim=True, dtype=acc), group) / count).to(dtype)


def _adaptive_avg_probe(t: torch.Tensor) -> torch.Tensor:
    return F.adaptive_avg_pool3d(t, 1)


def _adaptive_max_probe(t: torch.Tensor) -> torch.Tensor:
    return F.adaptive_max_pool3d(t, 1)


# ---------------------------------------------------------------------- adaptive pooling
def adaptive_bins(n: int, k: int) -> list[Range]:
    """Torch's bins of an adaptive pool of ``n`` voxels to ``k``: ``[floor(o*n/k), ceil((o+1)*n/k))``."""
    return [((o * n) // k, -(-((o + 1) * n) // k)) for o in range(k)]


def _local_bins(n: int, k: int, own: Range) -> list[Range]:
    """Each bin's part inside this rank's ``own`` range, in local coordinates (``(0, 0)``: none)."""
    out = []
    for s, e in adaptive_bins(n, k):
        lo, hi = max(s, own[0]), min(e, own[1])
        out.append((lo - own[0], hi - own[0]) if hi > lo else (0, 0))
    return out


class _AdaptivePool(SpatialLayer):
    """What both adaptive pools share: output extents, this rank's box and its parts of the bins."""

    output_size: object

    def out_extents(self, shape: tuple[int, int, int]) -> tuple[int, int, int]:
        """The output (D, H, W) for a global input ``shape`` (None in ``output_size``: kept)."""
        ks = ntuple(self.output_size)
        return tuple(shape[i] if ks[i] is None else int(ks[i]) for i in range(3))  # type: ignore[return-value]

    def _geometry(self, shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], list, list]:
        key = ("geometry", tuple(shape))
        if key not in self._memo:
            ks, box = self.out_extents(shape), local_box(shape, self.grid)
            self._memo[key] = (ks, box, [_local_bins(shape[i], ks[i], box[i]) for i in range(3)])
        return self._memo[key]

    def _spatial_group(self):
        return self.grid.spatial_group if self.grid.spatial_size > 1 else None


class DistAdaptiveAvgPool3d(_AdaptivePool, nn.AdaptiveAvgPool3d):
    """``torch.nn.AdaptiveAvgPool3d`` (any output size) of a split input; the output is *replicated*.

    Each rank sums the part of every bin it holds (per dim a 0/1 bin-membership matrix, so the three
    contractions are matrix products), an all-reduce adds the parts and the global bin sizes divide.
    Why replicated rather than a split output fed by halos: adaptive pools serve as heads that reduce
    a volume to a few voxels, fewer than the ranks along a dim, and then a bin spans several shards
    (a split output would leave ranks empty and need halos wider than a neighbour); the output is
    small, so the all-reduce costs no more than gathering it, and the dense layers after it want it
    whole. An output nearly as large as the input (``None`` extents) is correct but costs an
    all-reduce of that size: use pooling or interpolation layers there. Output size 1 is a plain sum.
    """

    def __init__(self, output_size, *, grid: ProcessGrid | None = None) -> None:
        nn.AdaptiveAvgPool3d.__init__(self, output_size)
        self.init_spatial(grid, None)
        self._memo: dict[tuple, object] = {}

    def _weights(self, shape: tuple[int, int, int], like: torch.Tensor):
        """Bin-membership matrices per dim (None: identity) and the global bin sizes."""
        key = ("weights", tuple(shape), like.dtype, like.device)
        if key not in self._memo:
            ks, box, bins = self._geometry(shape)
            mats = []
            for i in range(3):
                width = box[i][1] - box[i][0]
                if ks[i] == shape[i] == width:  # unsplit and kept: nothing to pool along this dim
                    mats.append(None)
                    continue
                m = torch.zeros(ks[i], width, dtype=like.dtype)
                for o, (lo, hi) in enumerate(bins[i]):
                    m[o, lo:hi] = 1
                mats.append(m.to(like.device))
            sizes = [torch.tensor([e - s for s, e in adaptive_bins(shape[i], ks[i])], dtype=like.dtype)
                     for i in range(3)]
            counts = sizes[0].view(-1, 1, 1) * sizes[1].view(1, -1, 1) * sizes[2].view(1, 1, -1)
            self._memo[key] = (mats, counts.to(like.device))
        return self._memo[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = self.global_shape(x)
        ks = self.out_extents(shape)
        if ks == (1, 1, 1):
            return _mean(x, self._spatial_group(), math.prod(shape))
        s = widened(x, result_dtype("adaptive_avg_pool3d", _adaptive_avg_probe, x))
        mats, counts = self._weights(shape, s)
        with no_autocast(x.device.type):  # the products in the pool's dtype, not autocast's
            for d, m in ((4, mats[2]), (3, mats[1]), (2, mats[0])):
                if m is not None:
                    s = torch.movedim(torch.movedim(s, d, -1) @ m.t(), -1, d)
        return sum_to_replicated(s, self._spatial_group()) / counts


def _bin_argmax(x: torch.Tensor, bins: list[list[Range]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bin, the local maximum and the local flat index of its first occurrence in (d, h, w)
    order (-1 where this rank holds none of the bin).

    Separable: W, then H, then D, each ``max`` taking the first maximal entry along its dim; the last
    dim reduced decides ties first, so the result is the lexicographically first maximal voxel.
    """
    lidx = torch.arange(math.prod(x.shape[2:]), device=x.device).view(1, 1, *x.shape[2:]).expand_as(x)
    v = x
    for i in (2, 1, 0):
        d, rows, size = 2 + i, bins[i], v.shape[2 + i]
        if rows == [(0, size)]:
            v, arg = v.max(dim=d, keepdim=True)
            lidx = lidx.gather(d, arg)
            continue
        width = max(1, max(hi - lo for lo, hi in rows))
        index = torch.tensor([[lo + j if lo + j < hi else size for j in range(width)] for lo, hi in rows],
                             device=x.device).view(-1)
        pad = list(v.shape)
        pad[d] = 1
        vp = torch.cat([v, v.new_full(pad, float("-inf"))], d).index_select(d, index)
        ip = torch.cat([lidx, lidx.new_full(pad, -1)], d).index_select(d, index)
        split = [*v.shape[:d], len(rows), width, *v.shape[d + 1:]]
        v, arg = vp.view(split).max(dim=d + 1)
        lidx = ip.view(split).gather(d + 1, arg.unsqueeze(d + 1)).squeeze(d + 1)
    return v, lidx


class DistAdaptiveMaxPool3d(_AdaptivePool, nn.AdaptiveMaxPool3d):
    """``torch.nn.AdaptiveMaxPool3d`` (any output size, ``return_indices`` too) of a split input; the
    output (and the indices: flat global ones, as torch's) is *replicated*, for the reasons given at
    :class:`DistAdaptiveAvgPool3d`.

    Each rank finds, per bin, its part's maximum and that value's first voxel in (d, h, w) order; a MAX
    all-reduce gives the bin's maximum and a MIN all-reduce of the global flat indices of the ranks
    that reach it gives the first such voxel, the one torch picks, so ties across shards send the
    gradient where torch sends it. The rank owning that voxel takes the output from it (autograd
    routes the gradient); the others hold a constant copy. NaN inputs give NaN outputs but no gradient.
    """

    def __init__(self, output_size, return_indices: bool = False, *, grid: ProcessGrid | None = None) -> None:
        nn.AdaptiveMaxPool3d.__init__(self, output_size, return_indices)
        self.init_spatial(grid, None)
        self._memo: dict[tuple, object] = {}

    def forward(self, x: torch.Tensor):
        shape = self.global_shape(x)
        x = widened(x, result_dtype("adaptive_max_pool3d", _adaptive_max_probe, x))
        _, box, bins = self._geometry(shape)
        group = self._spatial_group()
        n, c = x.shape[:2]
        with torch.no_grad():
            vals, lidx = _bin_argmax(x.detach(), bins)
            best = vals.clone()
            if group is not None:
                dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
            lh, lw = x.shape[3], x.shape[4]
            gidx = (((lidx // (lh * lw) + box[0][0]) * shape[1] + (lidx // lw) % lh + box[1][0]) * shape[2]
                    + lidx % lw + box[2][0])
            none = torch.iinfo(torch.int64).max
            mine = torch.where((vals == best) & (lidx >= 0), gidx, none)
            first = mine.clone()
            if group is not None:
                dist.all_reduce(first, op=dist.ReduceOp.MIN, group=group)
            owned = (mine == first) & (mine != none)
        picked = x.reshape(n, c, -1).gather(2, lidx.clamp_min(0).reshape(n, c, -1)).view(vals.shape)
        y = torch.where(owned, picked, best)
        return (y, first) if self.return_indices else y


def _adaptive_avg_pool3d(m: nn.AdaptiveAvgPool3d, grid: ProcessGrid,
                         overlap: bool = False) -> DistAdaptiveAvgPool3d:
    return DistAdaptiveAvgPool3d(m.output_size, grid=grid)


def _adaptive_max_pool3d(m: nn.AdaptiveMaxPool3d, grid: ProcessGrid,
                         overlap: bool = False) -> DistAdaptiveMaxPool3d:
    return DistAdaptiveMaxPool3d(m.output_size, m.return_indices, grid=grid)


def _replicated(m: nn.Module) -> bool:
    """Adaptive pools of a split input give a replicated output, whatever their output size."""
    return True


def _max_pool3d(m: nn.MaxPool3d, grid: ProcessGrid, overlap: bool = False) -> DistMaxPool3d:
    return DistMaxPool3d(m.kernel_size, m.stride, m.padding, m.dilation, m.return_indices, m.ceil_mode,
                         grid=grid)


def _avg_pool3d(m: nn.AvgPool3d, grid: ProcessGrid, overlap: bool = False) -> DistAvgPool3d:
    return DistAvgPool3d(m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad,
                         m.divisor_override, grid=grid)


registry.register(nn.MaxPool3d, role="window", op="pool", flops=registry.pool_flops, to_dist=_max_pool3d,
                  window=registry.pool_window, saved=registry.saved_window)
registry.register(nn.AvgPool3d, role="window", op="pool", flops=registry.pool_flops, to_dist=_avg_pool3d,
                  window=registry.pool_window, saved=registry.saved_window)
registry.register(nn.AdaptiveAvgPool3d, role="reduce", op="pool", flops=registry.per_input_flops,
                  to_dist=_adaptive_avg_pool3d, replicates=_replicated)
registry.register(nn.AdaptiveMaxPool3d, role="reduce", op="pool", flops=registry.per_input_flops,
                  to_dist=_adaptive_max_pool3d, replicates=_replicated)
