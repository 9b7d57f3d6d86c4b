"""Spatially distributed upsampling: ``nn.Upsample`` and ``F.interpolate`` on split 5-D volumes.

Why not run ``F.interpolate`` on each shard: torch maps every output voxel to source coordinates of
the *whole* input (``in/out`` or ``1/scale_factor`` per dim, shifted by half a voxel unless
``align_corners``), so a shard interpolated on its own samples the wrong places at every shard face.
Here a rank works out, per dim and from torch's own coordinate mapping, which global input voxels its
output shard reads (the output is balanced-split over the *output* extent, like any other layer),
fetches the ones its neighbours hold as a halo (the differentiable halo exchange of the convolutions,
whose backward is the exact adjoint), and interpolates separably per dim with global source indices
and weights (``index_select`` and a weighted sum). In float64 that gives torch's numbers to ~1e-15.

Torch's mapping, per dim of input extent ``n`` and output extent ``m`` (``aten/src/ATen/native/
UpSample.h``): ``nearest`` takes ``floor(o * s)`` with ``s`` a *float32* scale (``1/scale_factor``
when a scale factor reaches the kernel, else ``n/m``; ``m == n`` and ``m == 2n`` are special-cased),
``nearest-exact`` ``floor((o + 0.5) * s)``; ``trilinear`` computes ``s`` in the input's opmath type
(``(n-1)/(m-1)`` with ``align_corners``), the source ``s*o`` or ``max(s*(o+0.5)-0.5, 0)``, index
``min(floorf(src), n-1)``, weight ``clamp(src - index, 0, 1)``. A scale factor reaches the kernel
unless ``size`` is given or ``recompute_scale_factor=True``. The nearest indices are taken from torch
itself (``F.interpolate`` of a 1-D ramp, exact in float64), the linear ones from the formula above.

Reduced precision: the weighted sum runs in the opmath type (float32 for bf16/fp16, as torch's
kernel) and is rounded once; under autocast the output has the dtype torch's interpolation gives
(:mod:`hybridpar.device.precision`). A ``channels_last_3d`` input gives a ``channels_last_3d`` output, as
torch's kernel does (the selections write into buffers of the input's format).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.axes import DIM_NAMES, SPATIAL_AXES
from hybridpar.comm.halo import HaloExchanger, exchange
from hybridpar.device import memfmt
from hybridpar.device.precision import narrowed, result_dtype, widened
from hybridpar.geometry import HaloError, HaloPlan, Range, check_split, plans_from_needs
from hybridpar.grid import ProcessGrid
from hybridpar.nn import formulas, registry
from hybridpar.nn.spatial import SpatialLayer

MODES = ("nearest", "nearest-exact", "trilinear")


@dataclass(frozen=True)
class DimTaps:
    """Torch's sources of every global output index along one dim: ``out = (1-w)*in[lo] + w*in[hi]``
    (nearest: ``lo == hi``, ``w == 0``). ``w`` is in the opmath type of the input's dtype."""

    lo: torch.Tensor      # int64 (m,)
    hi: torch.Tensor      # int64 (m,)
    w: torch.Tensor | None  # (m,) weight of ``hi``; None for nearest


def _opmath(dtype: torch.dtype) -> torch.dtype:
    """The type torch computes coordinates in: double for double, float otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _nearest_taps(n: int, m: int, scale: float | None, mode: str) -> DimTaps:
    """Indices from torch's own kernel: nearest of a float64 ramp (exact integers) is the index map."""
    ramp = torch.arange(n, dtype=torch.float64).view(1, 1, n)
    if scale is None:
        src = F.interpolate(ramp, size=m, mode=mode)
    else:
        src = F.interpolate(ramp, scale_factor=scale, mode=mode)
    idx = src.view(-1).to(torch.int64)
    if idx.numel() != m:
        raise AssertionError(f"nearest taps: torch gave {idx.numel()} outputs, expected {m}")
    return DimTaps(idx, idx, None)


def _linear_taps(n: int, m: int, scale: float | None, align_corners: bool, dtype: torch.dtype) -> DimTaps:
    """``compute_source_index_and_lambda`` of ATen, in ``dtype``'s opmath type."""
    op = _opmath(dtype)
    o = torch.arange(m, dtype=torch.int64)
    if m == n and not align_corners:  # torch copies
        return DimTaps(o, o, torch.zeros(m, dtype=op))
    if align_corners:
        s = torch.tensor(n - 1, dtype=op) / (m - 1) if m > 1 else torch.tensor(0.0, dtype=op)
        src = s * o.to(op)
    else:
        s = torch.tensor(1.0 / scale, dtype=op) if scale is not None and scale > 0 \
            else torch.tensor(n, dtype=op) / m
        src = (s * (o.to(op) + 0.5) - 0.5).clamp_min(0)
    lo = src.to(torch.float32).floor().to(torch.int64).clamp_max(n - 1)  # floorf, as ATen
    w = (src - lo.to(op)).clamp(0, 1)
    hi = lo + (lo < n - 1).to(torch.int64)
    return DimTaps(lo, hi, w)


def dim_taps(n: int, m: int, scale: float | None, mode: str, align_corners: bool | None,
             dtype: torch.dtype = torch.float32) -> DimTaps:
    """Torch's source indices (and weights) along one dim of input extent ``n``, output extent ``m``.

    ``scale`` is the scale factor the kernel receives (None when it works from ``n/m``).
    """
    if mode == "trilinear":
        return _linear_taps(n, m, scale, bool(align_corners), dtype)
    return _nearest_taps(n, m, scale, mode)


@dataclass(frozen=True)
class Resampling:
    """What ``F.interpolate`` does to a global (D, H, W) volume: output extents and kernel scales."""

    out: tuple[int, int, int]
    scales: tuple[float | None, float | None, float | None]


def resampling(shape: tuple[int, int, int], size, scale_factor, mode: str, align_corners: bool | None,
               recompute_scale_factor: bool | None) -> Resampling:
    """Output extents from torch itself (a meta tensor: its argument checks and rounding) and the
    per-dim scale factor that reaches the kernel (F.interpolate's own rule). Memoised: a layer asks
    on every forward."""
    return _resampling(tuple(int(v) for v in shape), _hashable(size), _hashable(scale_factor), mode,
                       align_corners, recompute_scale_factor)


def _hashable(v):
    return tuple(v) if isinstance(v, list) else v


@functools.lru_cache(maxsize=1024)
def _resampling(shape: tuple[int, int, int], size, scale_factor, mode: str, align_corners: bool | None,
                recompute_scale_factor: bool | None) -> Resampling:
    # Every mode's output extent comes from the same rule (ATen's compute_output_size, or F.interpolate's
    # own when it recomputes the scale), but trilinear on a meta tensor runs torch's Python
    # decomposition (tens of ms); nearest has a meta kernel. align_corners, which only trilinear takes,
    # does not change the extent.
    probe = (mode, align_corners) if mode != "trilinear" else ("nearest", None)
    meta = torch.empty((1, 1, *shape), device="meta")
    out = F.interpolate(meta, size, scale_factor, *probe,
                        recompute_scale_factor=recompute_scale_factor).shape[2:]
    if size is not None or scale_factor is None or recompute_scale_factor:
        scales: tuple = (None, None, None)
    else:
        sf = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * 3
        scales = tuple(float(s) for s in sf)
    return Resampling(tuple(int(v) for v in out), scales)  # type: ignore[arg-type]


def _needs(taps: DimTaps, outs: list[Range]) -> list[Range]:
    """Global input range every output shard reads (indices are monotone in the output index)."""
    return [(int(taps.lo[a]), int(taps.hi[b - 1]) + 1) if b > a else (0, 0) for a, b in outs]


def resample_plans(n: int, m: int, parts: int, taps: DimTaps, layer: str = "layer",
                   dim: str = "dim") -> list[HaloPlan]:
    """Halo plans of every rank along one dim: input split ``parts`` ways over ``n``, output over ``m``.

    Raises :class:`HaloError` when an output shard reads beyond its rank's immediate neighbours (a
    strong downsampling split too finely), naming the largest split that fits.
    """
    check_split(n, m, parts, layer, dim)  # its own advice, not the reach's below
    try:
        return plans_from_needs(n, m, parts, lambda outs: _needs(taps, outs), layer, dim)
    except HaloError as err:
        raise HaloError(f"{err}use a split of at most {_max_parts(n, m, taps)} along {dim}", layer=err.layer,
                        reason=err.reason) from None


def _max_parts(n: int, m: int, taps: DimTaps) -> int:
    best = 1
    for parts in range(2, min(n, m) + 1):  # never an empty shard: only the reach can fail
        try:
            plans_from_needs(n, m, parts, lambda outs: _needs(taps, outs), "", "")
        except HaloError:
            continue
        best = parts
    return best


@dataclass(frozen=True)
class LocalTaps:
    """One dim of this rank's work: local indices into the extended input and weights (or None)."""

    lo: torch.Tensor
    hi: torch.Tensor
    w: torch.Tensor | None   # weight of ``hi``; ``lo``'s is ``1 - w`` (ATen's lambda0), kept as ``w0``
    w0: torch.Tensor | None
    identity: bool  # the extended input already is the output along this dim


def _local(taps: DimTaps, plan: HaloPlan, dtype: torch.dtype, device: torch.device) -> LocalTaps:
    """This rank's slice of the global taps, shifted to the extended input (which starts at the
    first global voxel the rank needs), weights cast to the input's dtype."""
    a, b = plan.out
    start = max(plan.need[0], 0)
    lo, hi = taps.lo[a:b] - start, taps.hi[a:b] - start
    w = None if taps.w is None else taps.w[a:b]
    ext = plan.extended
    identity = (b - a == ext and bool((lo == torch.arange(ext)).all())
                and (w is None or bool((w == 0).all())))
    if w is not None and bool((w == 0).all()) and bool((lo == hi).all()):
        w = None  # lo == hi with weight 0: a plain selection
    if w is None:
        return LocalTaps(lo.to(device), hi.to(device), None, None, identity)
    w = w.to(dtype if dtype.itemsize >= 4 else _opmath(dtype))  # bf16/fp16: summed in float32
    return LocalTaps(lo.to(device), hi.to(device), w.to(device), (1 - w).to(device), identity)


def _select(x: torch.Tensor, d: int, index: torch.Tensor) -> torch.Tensor:
    """``x.index_select(d, index)`` in ``x``'s memory format (index_select alone returns NCDHW)."""
    if memfmt.memory_format(x) is torch.contiguous_format:
        return x.index_select(d, index)
    shape = list(x.shape)
    shape[d] = index.numel()
    return torch.index_select(x, d, index, out=memfmt.empty(shape, x)) if not x.requires_grad \
        else _Select.apply(x, d, index)


class _Select(torch.autograd.Function):
    """``index_select`` into a buffer of the input's format; backward ``index_add`` into one."""

    @staticmethod
    def forward(ctx, x, d, index):
        ctx.meta = (x.shape, d, index)
        shape = list(x.shape)
        shape[d] = index.numel()
        return torch.index_select(x, d, index, out=memfmt.empty(shape, x))

    @staticmethod
    def backward(ctx, g):
        shape, d, index = ctx.meta
        return memfmt.zeros(shape, g).index_add_(d, index, g), None, None


def _apply(x: torch.Tensor, taps: list[LocalTaps]) -> torch.Tensor:
    """Separable interpolation of the extended input along D, H, W (autograd does the adjoint);
    in the weights' dtype (float32 for a bf16/fp16 input), rounded back once at the end."""
    dtype = x.dtype
    for i, t in enumerate(taps):
        if t.identity:
            continue
        d = 2 + i
        lo = _select(x, d, t.lo)
        if t.w is None:
            x = lo
            continue
        shape = [1] * x.dim()
        shape[d] = -1
        x = lo * t.w0.view(shape) + _select(x, d, t.hi) * t.w.view(shape)
    return widened(x, dtype)


class DistUpsample(SpatialLayer, nn.Upsample):
    """``torch.nn.Upsample`` (modes ``nearest``, ``nearest-exact``, ``trilinear``) on a split input.

    The output is balanced-split over the output extent; each rank fetches the input voxels its
    output shard reads from its neighbours (see the module doc). Unsplit grids and inputs that are
    not 5-D run ``F.interpolate`` itself.
    """

    def __init__(self, size=None, scale_factor=None, mode: str = "nearest", align_corners: bool | None = None,
                 recompute_scale_factor: bool | None = None, *, grid: ProcessGrid | None = None,
                 transport: str | None = None) -> None:
        nn.Upsample.__init__(self, size, scale_factor, mode, align_corners, recompute_scale_factor)
        self.init_spatial(grid, transport)
        if mode not in MODES and self.grid.spatial_size > 1:  # a layout that splits nothing runs any mode
            raise NotImplementedError(f"DistUpsample: mode={mode!r} is not supported on split volumes; use "
                                      f"one of {MODES}")
        self._taps: dict[tuple, list[LocalTaps]] = {}

    def resampling(self, shape: tuple[int, int, int]) -> Resampling:
        """Output extents and kernel scales for a global (D, H, W) = ``shape`` input."""
        return resampling(shape, self.size, self.scale_factor, self.mode, self.align_corners,
                          self.recompute_scale_factor)

    def halo_exchanger(self, shape: tuple[int, int, int],
                       dtype: torch.dtype = torch.float32) -> HaloExchanger:
        """The halo operator that gives this rank the global input its output shard reads."""
        r = self.resampling(shape)
        op = _opmath(dtype)
        return self.exchanger(shape, lambda n, parts, dim: resample_plans(
            n, r.out[DIM_NAMES.index(dim)], parts, self._dim_taps(n, r, DIM_NAMES.index(dim), op),
            layer=self.layer_name, dim=dim), key=("resample", op))

    def _dim_taps(self, n: int, r: Resampling, i: int, op: torch.dtype) -> DimTaps:
        return dim_taps(n, r.out[i], r.scales[i], self.mode, self.align_corners, op)

    def _local_taps(self, shape: tuple[int, int, int], ex: HaloExchanger, x: torch.Tensor) -> list[LocalTaps]:
        key = (tuple(shape), x.dtype, x.device)
        if key not in self._taps:
            r = self.resampling(shape)
            op = _opmath(x.dtype)
            plans = [d.plan for d in ex.all_dims]
            self._taps[key] = [_local(self._dim_taps(shape[i], r, i, op), plans[i], x.dtype, x.device)
                               for i in range(3)]
        return self._taps[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5 or self.grid.spatial_size == 1:
            if x.dim() != 5 and self.grid.spatial_size > 1:
                self._check_input(x)
            return nn.Upsample.forward(self, x)
        shape = self.global_shape(x)
        dtype = result_dtype(f"interpolate-{self.mode}", self._torch_probe, x)
        x = narrowed(x, dtype)
        ex = self.halo_exchanger(shape, x.dtype)
        ext = exchange(x, ex)
        return widened(_apply(ext, self._local_taps(shape, ex, ext)), dtype)

    def _torch_probe(self, t: torch.Tensor) -> torch.Tensor:
        return F.interpolate(t, scale_factor=2, mode=self.mode)


# ---------------------------------------------------------------------- functional form
_FUNCTIONAL: weakref.WeakKeyDictionary[ProcessGrid, dict[tuple, DistUpsample]] = weakref.WeakKeyDictionary()


def dist_interpolate(x: torch.Tensor, grid: ProcessGrid, size=None, scale_factor=None, mode: str = "nearest",
                     align_corners: bool | None = None, recompute_scale_factor: bool | None = None, *,
                     global_shape: tuple[int, int, int] | None = None) -> torch.Tensor:
    """``F.interpolate`` of the volume whose shard under ``grid`` is ``x``; returns the output shard.

    Meant for a graph runner that meets ``F.interpolate`` on a split activation: same arguments plus
    the grid (and, when known, the global (D, H, W) of ``x`` to spare the per-call shape all-gather).
    The layer behind it (and its halo plans) is memoised per grid and arguments.
    """
    key = (_hashable(size), _hashable(scale_factor), mode, align_corners, recompute_scale_factor)
    layers = _FUNCTIONAL.setdefault(grid, {})
    if key not in layers:
        layers[key] = DistUpsample(size, scale_factor, mode, align_corners, recompute_scale_factor, grid=grid)
    layer = layers[key]
    layer.global_input_shape = None if global_shape is None else tuple(global_shape)
    return layer(x)


# ---------------------------------------------------------------------- registry
def _upsample(m: nn.Upsample, grid: ProcessGrid, overlap: bool = False) -> DistUpsample:
    return DistUpsample(m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor, grid=grid)


def _upsample_halos(m: nn.Upsample, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                    split: tuple[int, int, int]) -> registry.Halos:
    """Widest (low, high) halo per dim (float32 coordinates); HaloError when a split is too fine."""
    if len(in_shape) != 5:
        return ((0, 0),) * 3
    shape = tuple(int(v) for v in in_shape[2:])
    r = resampling(shape, m.size, m.scale_factor, m.mode, m.align_corners, m.recompute_scale_factor)
    halos = []
    for i, parts in enumerate(split):
        if parts == 1:
            halos.append((0, 0))
            continue
        if m.mode not in MODES:
            reason = f"Upsample mode {m.mode!r} cannot run split"
            raise HaloError(f"{name}: {reason}; use one of {MODES}", layer=name, reason=reason)
        taps = dim_taps(shape[i], r.out[i], r.scales[i], m.mode, m.align_corners, torch.float32)
        plans = resample_plans(shape[i], r.out[i], parts, taps, layer=name, dim=SPATIAL_AXES[i])
        halos.append((max(p.halo[0] for p in plans), max(p.halo[1] for p in plans)))
    return tuple(halos)


registry.register(nn.Upsample, role="resample", op="pointwise", flops=formulas.resample_flops,
                  to_dist=_upsample, halos=_upsample_halos)

__all__ = ["DistUpsample", "dist_interpolate", "dim_taps", "resample_plans", "resampling"]
