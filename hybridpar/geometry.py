"""Pure index arithmetic for spatially split tensors: no communication, no torch.

Why a module of its own: every distributed layer, the loader and the planner need the same answers
(who owns which voxels, which input voxels an output shard needs, how wide the halos are), and these
answers must be testable without spawning a single process. Everything here works on one tensor
dimension ("dim") split over one grid axis ("axis") of ``parts`` ranks; 3D layers apply it per dim.

Conventions
-----------
* Balanced split, first shards take the remainder, exactly as ``torch.tensor_split``.
* Ranges are half-open ``(start, stop)`` in global voxel coordinates.
* A window-based layer (conv, pool) with kernel ``k``, stride ``s``, left padding ``pl`` and dilation
  ``d`` computes global output ``o`` from global inputs ``o*s - pl + j*d`` for ``j`` in ``0..k-1``;
  inputs outside ``[0, n)`` are padding: a fill (zero for conv, -inf for max pooling), or with a
  padding *mode* copies of voxels inside: ``circular`` wraps around (a periodic box: the neighbours of
  the first and last shards are each other), ``replicate`` and ``reflect`` copy edge voxels.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Range = tuple[int, int]


def ntuple(value: int | Sequence[int], n: int = 3, *, what: str | None = None,
           layer: str = "layer") -> tuple[int, ...]:
    """A per-dim layer argument (kernel size, stride...) given as one int or ``n``, as ``n`` ints (a
    numpy integer too, as torch takes it: MONAI computes strides with numpy); with
    ``what`` (its name) checked, a bad value raising one line naming ``layer``."""
    t = tuple(value) if isinstance(value, (tuple, list)) else (value,) * n
    t = tuple(int(i) if isinstance(i, numbers.Integral) else i for i in t)
    if what is not None and (len(t) != n or not all(isinstance(i, int) for i in t)):
        raise ValueError(f"{layer}: {what} must be an int or {n} ints, got {value!r}")
    return t


def shard_range(extent: int, parts: int, index: int) -> Range:
    """The ``index``-th of ``parts`` balanced shards of ``range(extent)`` (``torch.tensor_split`` order)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if not 0 <= index < parts:
        raise ValueError(f"shard index {index} outside 0..{parts - 1}")
    base, rem = divmod(extent, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


def shard_box(extents: Sequence[int], parts: Sequence[int], coord: Sequence[int]) -> tuple[Range, ...]:
    """The ranges held at grid coordinate ``coord`` of a volume of ``extents`` split ``parts`` ways per
    dim (a dim split once is held whole, whatever the coordinate)."""
    return tuple(shard_range(n, p, c if p > 1 else 0) for n, p, c in zip(extents, parts, coord, strict=True))


def shard_ranges(extent: int, parts: int) -> list[Range]:
    """All shards of ``range(extent)`` over ``parts`` ranks."""
    return [shard_range(extent, parts, i) for i in range(parts)]


def conv_output_extent(extent: int, kernel: int, stride: int = 1, pad_lo: int = 0, pad_hi: int = 0,
                       dilation: int = 1, ceil_mode: bool = False) -> int:
    """Global output extent of a window layer, as ``torch.nn.Conv3d`` / ``MaxPool3d`` compute it.

    With ``ceil_mode`` (pooling) the last window may run past the padded input, but it must start
    inside the input or the left padding, as in PyTorch.
    """
    span = dilation * (kernel - 1) + 1
    room = extent + pad_lo + pad_hi - span
    if not ceil_mode:
        return 0 if room < 0 else room // stride + 1
    out = (room + stride - 1) // stride + 1  # a window may overhang: an extent 1 pooled by 2 gives 1
    if out > 0 and (out - 1) * stride >= extent + pad_lo:
        out -= 1
    return max(out, 0)


def transposed_output_extent(extent: int, kernel: int, stride: int = 1, padding: int = 0,
                             dilation: int = 1, output_padding: int = 0) -> int:
    """Global output extent of ``ConvTranspose3d`` along one dim."""
    return (extent - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def same_padding(kernel: int, dilation: int = 1) -> tuple[int, int]:
    """PyTorch's ``padding='same'``: total ``d*(k-1)``, the odd voxel on the right."""
    total = dilation * (kernel - 1)
    return total // 2, total - total // 2


def avg_pool_divisors(extent: int, out: Range, kernel: int, stride: int, pad: int,
                      count_include_pad: bool = True) -> list[int]:
    """torch's average-pool divisor of each output ``out`` along one dim of ``extent`` voxels: the
    window clipped to the padded extent, or to the volume without ``count_include_pad``."""
    counts = []
    for o in range(*out):
        start = o * stride - pad
        end = min(start + kernel, extent + pad)
        counts.append(min(end, extent) - max(start, 0) if not count_include_pad else end - start)
    return counts


MODES = ("zeros", "circular", "replicate", "reflect")


def padding_mode(mode: str | None = None, periodic: bool = False) -> str:
    """The geometry's name of a padding mode, checked.

    ``None`` means ``"zeros"``, or ``"circular"`` with ``periodic=True`` (how the registry describes a
    periodic conv); torch's ``"constant"`` is ``"zeros"`` here, since the fill value is no index
    arithmetic (the exchanger fills with it).
    """
    name = ("circular" if periodic else "zeros") if mode is None else {"constant": "zeros"}.get(mode, mode)
    if name not in MODES:
        raise ValueError(f"padding mode {mode!r} is not one of {', '.join(MODES)} (or 'constant')")
    if periodic and name != "circular":
        raise ValueError(f"periodic=True contradicts padding mode {mode!r}")
    return name


def source(v: int, extent: int, mode: str, period: int | None = None) -> int | None:
    """Global voxel that position ``v`` of the padded input reads (None: the fill of ``"zeros"``).

    As ``torch.nn.functional.pad`` computes it: ``"replicate"`` clamps to the edge voxel,
    ``"reflect"`` mirrors about it (the edge itself not repeated), ``"circular"`` wraps with
    ``period`` (the extent, or less where a negative pad crops first, as torch does).
    """
    if 0 <= v < extent:
        return v
    if mode == "zeros":
        return None
    if mode == "circular":
        period = extent if period is None else period
        return v + period if v < 0 else v - period
    if mode == "replicate":
        return 0 if v < 0 else extent - 1
    return -v if v < 0 else 2 * (extent - 1) - v


@dataclass(frozen=True)
class HaloPlan:
    """What one rank does along one dim before running a window layer locally with no padding.

    The local extended input is, in order along the dim::

        [pad_lo fill] [recv_lo from left neighbour] [own[trim_lo : n_own - trim_hi]]
        [recv_hi from right neighbour] [pad_hi fill]

    ``send_lo``/``send_hi`` are the slices of this rank's own (untrimmed) shard that the left/right
    neighbours need, in local coordinates. ``need`` is the global input range the local output needs.

    ``mode`` says what lies beyond the volume's faces. ``"zeros"``: the fill above. ``"circular"``:
    no fill; the first shard's left neighbour is the last shard and vice versa (a periodic box), so
    halos arrive across the wrap-around like any other. ``"replicate"``/``"reflect"``: the voxels
    received and kept, ``fetched = [recv_lo][own kept][recv_hi]``, are contiguous, and the extended
    input is ``fetched[index]``: ``pad_lo``/``pad_hi`` of its voxels lie beyond the faces and copy edge
    voxels, those in between are one contiguous run of ``fetched``.
    """

    own: Range
    out: Range
    need: Range
    pad_lo: int
    pad_hi: int
    recv_lo: int
    recv_hi: int
    trim_lo: int
    trim_hi: int
    send_lo: Range
    send_hi: Range
    mode: str = "zeros"
    index: tuple[int, ...] | None = None

    @property
    def kept(self) -> int:
        """Voxels of the own shard kept (not trimmed)."""
        return max(self.own[1] - self.own[0] - self.trim_lo - self.trim_hi, 0)

    @property
    def fetched(self) -> int:
        """Extent of the received and kept voxels, ``recv_lo + kept + recv_hi``."""
        return self.recv_lo + self.kept + self.recv_hi

    @property
    def extended(self) -> int:
        """Extent of the local extended input."""
        if self.index is not None:
            return len(self.index)
        return self.pad_lo + self.fetched + self.pad_hi

    @property
    def halo(self) -> tuple[int, int]:
        """Signed halo widths (negative: surplus own input trimmed)."""
        return (self.recv_lo - self.trim_lo, self.recv_hi - self.trim_hi)

    @property
    def periodic(self) -> bool:
        """Whether the neighbours wrap around (the first shard's left neighbour is the last)."""
        return self.mode == "circular"


class HaloError(ValueError):
    """A split too fine for a layer: a halo needs more than the neighbouring shard holds.

    Besides its message it carries ``layer`` (the name it was given, possibly empty) and ``reason``:
    what fails in a few words, without the layer's name or the advice on what would fit, which the
    planner prints for a layer it replicated. A layer's own halo function (one a user registered) may
    raise it with a message alone: ``reason`` is then the message's first clause, a leading name taken
    off, as the messages here are written (``"name: what fails; what fits"``).
    """

    def __init__(self, message: str, *, layer: str = "", reason: str | None = None) -> None:
        super().__init__(message)
        self.layer = layer
        self.reason = _first_clause(message) if reason is None else reason


def _first_clause(message: str) -> str:
    """``"name: what fails; what fits"`` -> ``"what fails"`` (a head with a space is no layer name)."""
    why = message.split(";")[0]
    head, _, rest = why.partition(": ")
    return rest if rest and " " not in head else why


def _need(out: Range, kernel: int, stride: int, pad_lo: int, dilation: int) -> Range:
    """Global input range (padding included, may leave ``[0, n)``) that outputs ``out`` read."""
    if out[1] <= out[0]:
        return (0, 0)
    return out[0] * stride - pad_lo, (out[1] - 1) * stride - pad_lo + dilation * (kernel - 1) + 1


def _period(extent: int, pads: tuple[int, int]) -> int:
    """Period of a circular dim: torch crops a negative pad before it wraps."""
    return extent - max(0, -pads[0]) - max(0, -pads[1])


def _fetch(need: Range, extent: int, mode: str) -> tuple[Range, tuple[int, int], tuple[int, ...] | None]:
    """Global voxels a rank assembles for ``need`` (unwrapped coordinates when circular), the fill
    (or mapped) voxels beyond the faces on each side, and the map of ``replicate``/``reflect``."""
    a, b = need
    if mode == "zeros":
        lo, hi = max(a, 0), min(b, extent)
        if hi <= lo:  # the outputs read padding only
            return (0, 0), (b - a, 0), None
        return (lo, hi), (max(0, -a), max(0, b - extent)), None
    if mode == "circular":  # across the faces the neighbours stand shifted by the period
        return (a, b), (0, 0), None
    srcs = [source(v, extent, mode) for v in range(a, b)]
    if not srcs:
        return (0, 0), (0, 0), ()
    lo = min(srcs)  # type: ignore[type-var]
    outside = (max(0, min(b, 0) - a), max(0, b - max(a, extent)))
    return (lo, max(srcs) + 1), outside, tuple(s - lo for s in srcs)  # type: ignore[operator]


def _local_plan(own: Range, out: Range, need: Range, extent: int,
                mode: str = "zeros") -> tuple[HaloPlan, Range, Range]:
    """This rank's plan (sends still empty) and the ranges it receives from left and right (global
    coordinates, unwrapped: across a periodic face they leave ``[0, extent)``)."""
    n_own = own[1] - own[0]
    (f0, f1), (fill_lo, fill_hi), index = _fetch(need, extent, mode)
    if f1 <= f0:  # nothing to receive or keep
        return (HaloPlan(own, out, need, fill_lo, fill_hi, 0, 0, n_own, 0, (0, 0), (0, 0), mode, index),
                (0, 0), (0, 0))
    lo_rng = (f0, min(own[0], f1)) if f0 < own[0] else (0, 0)
    hi_rng = (max(own[1], f0), f1) if f1 > own[1] else (0, 0)
    trim_lo = min(max(0, f0 - own[0]), n_own)
    trim_hi = min(max(0, own[1] - f1), n_own - trim_lo)
    plan = HaloPlan(own, out, need, fill_lo, fill_hi, lo_rng[1] - lo_rng[0], hi_rng[1] - hi_rng[0],
                    trim_lo, trim_hi, (0, 0), (0, 0), mode, index)
    return plan, lo_rng, hi_rng


def _neighbour(ins: list[Range], i: int, step: int, shift: int | None) -> tuple[int, int] | None:
    """(rank, offset) of rank ``i``'s neighbour ``step`` (-1 left, +1 right): ``offset`` turns ``i``'s
    unwrapped coordinates into the neighbour's global ones (nonzero across a periodic face; ``shift``
    None: not periodic, no neighbour beyond the faces)."""
    j = i + step
    if 0 <= j < len(ins):
        return j, 0
    if shift is None:
        return None
    return j % len(ins), shift if step < 0 else -shift


def _link(extent: int, ins: list[Range], outs: list[Range], needs: list[Range], layer: str,
          dim: str, fits: str, mode: str = "zeros", pads: tuple[int, int] = (0, 0)) -> list[HaloPlan]:
    """Plans of all ranks with sends set to what the neighbours receive, checked to be neighbourly.

    With ``mode="circular"`` the neighbours wrap around: rank 0's left neighbour is the last rank
    (one rank: itself; two ranks: the same rank on both sides), standing shifted by the period, which
    ``pads`` (the layer's low and high padding) shortens where a negative pad crops before the wrap.
    """
    parts = len(ins)
    shift = _period(extent, pads) if mode == "circular" else None
    local = [_local_plan(ins[i], outs[i], needs[i], extent, mode) for i in range(parts)]
    sends: list[list[Range]] = [[(0, 0), (0, 0)] for _ in range(parts)]
    for i, (_, lo_rng, hi_rng) in enumerate(local):
        for side, rng, step in (("left", lo_rng, -1), ("right", hi_rng, 1)):
            width = rng[1] - rng[0]
            if not width:
                continue
            nb = _neighbour(ins, i, step, shift)
            j, off = nb if nb is not None else (i, 0)
            a, b = rng[0] + off, rng[1] + off
            if nb is None or not (ins[j][0] <= a and b <= ins[j][1]):
                across = " (across the periodic boundary)" if off else ""
                held = ins[j][1] - ins[j][0] if nb is not None else 0
                wrap = ", periodic" if shift is not None else ""
                reason = (f"dim {dim}: a halo of {width} voxels from the {side} neighbour{across} is "
                          f"wider than its shard of {held} voxels (input extent {extent} split {parts} "
                          f"ways{wrap})")
                raise HaloError(f"{layer}: {reason}; {fits}", layer=layer, reason=reason)
            sends[j][1 if step < 0 else 0] = (a - ins[j][0], b - ins[j][0])
    return [HaloPlan(p.own, p.out, p.need, p.pad_lo, p.pad_hi, p.recv_lo, p.recv_hi, p.trim_lo, p.trim_hi,
                     sends[i][0], sends[i][1], p.mode, p.index) for i, (p, _, _) in enumerate(local)]


def plans_from_needs(extent: int, n_out: int, parts: int, needs: Callable[[list[Range]], list[Range]],
                     layer: str = "layer", dim: str = "dim", fits: str = "") -> list[HaloPlan]:
    """Halo plans of every rank for a layer known only by what it reads (an interpolation's taps):
    ``needs(outs)`` is the global input range each balanced output shard in ``outs`` reads, inside the
    volume. Raises :class:`HaloError` (``fits`` appended) when a shard would read beyond its neighbours,
    or would be empty (:func:`check_split`)."""
    check_split(extent, n_out, parts, layer, dim)
    outs = shard_ranges(n_out, parts)
    return _link(extent, shard_ranges(extent, parts), outs, needs(outs), layer, dim, fits)


def check_split(extent: int, n_out: int, parts: int, layer: str, dim: str) -> None:
    """Every shard of the input and of the output needs a voxel: raises :class:`HaloError` naming the
    largest split that fits."""
    if parts > 1 and (extent < parts or n_out < parts):
        reason = (f"dim {dim} has input extent {extent} and output extent {n_out}, too small to split "
                  f"over {parts} ranks (every shard needs at least one voxel)")
        raise HaloError(f"{layer}: {reason}; use a split of at most {max(1, min(extent, n_out))} along {dim}",
                        layer=layer, reason=reason)


def _check_reach(extent: int, mode: str, pads: tuple[int, int], layer: str, dim: str) -> None:
    """torch's own limits, whatever the split: a circular pad wraps at most once, a reflection
    stays inside the volume (padding < extent). Checked on the padding as declared, as torch pads
    before its kernel runs, even where the windows read less of it."""
    if mode == "circular":
        limit, what = _period(extent, pads), "wrap around the volume more than once"
    elif mode == "reflect":
        limit, what = extent - 1, "reflect beyond the volume (padding must be < extent)"
    else:
        return
    if max(pads) > limit:
        raise ValueError(f"{layer}: dim {dim}: {mode} padding of {pads[0]}/{pads[1]} voxels on an input "
                         f"extent of {extent} would {what}; torch refuses it too")


def window_plans(extent: int, parts: int, kernel: int, stride: int = 1, pad_lo: int = 0,
                 pad_hi: int = 0, dilation: int = 1, ceil_mode: bool = False,
                 out_extent: int | None = None, layer: str = "layer", dim: str = "dim",
                 periodic: bool = False, mode: str | None = None) -> list[HaloPlan]:
    """Halo plans of every rank along one dim for a window layer whose output is balanced-split.

    ``mode`` (see :class:`HaloPlan`): ``"zeros"`` (default; fill), ``"circular"`` (also
    ``periodic=True``: halos wrap around), ``"replicate"`` or ``"reflect"`` (edge voxels copied, as
    ``torch.nn.functional.pad`` does). A pad layer is a window of kernel 1 with (possibly negative)
    ``pad_lo``/``pad_hi``.

    Raises :class:`HaloError` when a rank needs input beyond its immediate neighbours, naming the
    layer, the dim, the neighbour's shard extent and the halo width, and what would fit; ValueError
    for padding torch refuses on any split.
    """
    mode = padding_mode(mode, periodic)
    n_out = conv_output_extent(extent, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode) \
        if out_extent is None else out_extent
    check_split(extent, n_out, parts, layer, dim)
    _check_reach(extent, mode, (pad_lo, pad_hi), layer, dim)
    ins, outs = shard_ranges(extent, parts), shard_ranges(n_out, parts)
    needs = [_need(o, kernel, stride, pad_lo, dilation) for o in outs]
    try:
        return _link(extent, ins, outs, needs, layer, dim, "", mode, (pad_lo, pad_hi))
    except HaloError as err:
        fits = "use a smaller split along " + dim
        if layer:  # the search for what fits calls this function; only a real layer's error pays for it
            fits = (f"use a split of at most "
                    f"{max_parts(extent, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode, mode=mode)} "
                    f"along {dim}")
        raise HaloError(f"{err}{fits}", layer=err.layer, reason=err.reason) from None


def max_parts(extent: int, kernel: int, stride: int = 1, pad_lo: int = 0, pad_hi: int = 0,
              dilation: int = 1, ceil_mode: bool = False, periodic: bool = False,
              mode: str | None = None) -> int:
    """Largest split of this dim for which every halo comes from the immediate neighbours."""
    best = 1
    for parts in range(2, extent + 1):
        try:
            window_plans(extent, parts, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode,
                         layer="", dim="", periodic=periodic, mode=mode)
        except HaloError:
            continue
        best = parts
    return best


def transposed_plans(extent: int, parts: int, kernel: int, stride: int = 1, padding: int = 0,
                     dilation: int = 1, output_padding: int = 0, layer: str = "layer",
                     dim: str = "dim") -> tuple[list[HaloPlan], list[int]]:
    """Halo plans for ``ConvTranspose3d`` and, per rank, the global output index of the local result.

    Transposed output ``o`` receives input ``i`` through tap ``j`` when ``o = i*s - p + j*d``. A rank
    gathers the inputs its output shard touches, runs the transposed conv with no padding (whose
    output starts at global ``i0*s - p``) and crops. In the window vocabulary the inputs touched by
    outputs ``[a, b)`` are ``[ceil((a + p - d(k-1))/s), floor((b - 1 + p)/s) + 1)``.
    """
    n_out = transposed_output_extent(extent, kernel, stride, padding, dilation, output_padding)
    check_split(extent, n_out, parts, layer, dim)
    ins, outs = shard_ranges(extent, parts), shard_ranges(n_out, parts)
    span = dilation * (kernel - 1)
    needs, origins = [], []
    for i, (a, b) in enumerate(outs):
        lo = max(-(-(a + padding - span) // stride), 0)
        hi = min((b - 1 + padding) // stride + 1, extent)
        if hi <= lo:  # no input reaches this output shard (output_padding, or stride gaps)
            lo = hi = ins[i][0]
        needs.append((lo, hi))
        origins.append(lo * stride - padding)
    return _link(extent, ins, outs, needs, layer, dim, f"use a smaller split along {dim}"), origins


def interior(plan: HaloPlan, n_out_local: int, kernel: int, stride: int, dilation: int) -> Range:
    """Local output range computable from locally held data alone (own shard and boundary fill).

    Used to overlap the interior computation with the halo exchange: outputs outside it read at
    least one received halo voxel. Empty for ``replicate``/``reflect`` plans, whose extended input is
    mapped from what was received (nothing of it is local before the exchange ends).
    """
    if plan.index is not None:
        return (0, 0)
    left_recv_end = plan.pad_lo + plan.recv_lo
    lo_avail = 0 if plan.recv_lo == 0 else left_recv_end
    own = max(plan.own[1] - plan.own[0] - plan.trim_lo - plan.trim_hi, 0)
    hi_avail = plan.extended if plan.recv_hi == 0 else left_recv_end + own
    span = dilation * (kernel - 1) + 1
    lo = -(-lo_avail // stride)
    hi = (hi_avail - span) // stride + 1 if hi_avail >= span else 0
    lo, hi = min(max(lo, 0), n_out_local), min(max(hi, 0), n_out_local)
    return (lo, hi) if hi > lo else (lo, lo)
