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
  inputs outside ``[0, n)`` are padding (zero for conv, -inf for max pooling).
"""

from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]


def shard_range(extent: int, parts: int, index: int) -> Range:
    """The ``index``-th of ``parts`` balanced shards of ``range(extent)`` (``torch.tensor_split`` order)."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts")
    if not 0 <= index < parts:
        raise ValueError(f"shard index {index} outside 0..{parts - 1}")
    base, rem = divmod(extent, parts)
    start = index * base + min(index, rem)
    return start, start + base + (1 if index < rem else 0)


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
    if room < 0:
        return 0
    if not ceil_mode:
        return room // stride + 1
    out = -(-room // stride) + 1
    if (out - 1) * stride >= extent + pad_lo:
        out -= 1
    return out


def transposed_output_extent(extent: int, kernel: int, stride: int = 1, padding: int = 0,
                             dilation: int = 1, output_padding: int = 0) -> int:
    """Global output extent of ``ConvTranspose3d`` along one dim."""
    return (extent - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1


def same_padding(kernel: int, dilation: int = 1) -> tuple[int, int]:
    """PyTorch's ``padding='same'``: total ``d*(k-1)``, the odd voxel on the right."""
    total = dilation * (kernel - 1)
    return total // 2, total - total // 2


@dataclass(frozen=True)
class HaloPlan:
    """What one rank does along one dim before running a window layer locally with no padding.

    The local extended input is, in order along the dim::

        [pad_lo fill] [recv_lo from left neighbour] [own[trim_lo : n_own - trim_hi]]
        [recv_hi from right neighbour] [pad_hi fill]

    ``send_lo``/``send_hi`` are the slices of this rank's own (untrimmed) shard that the left/right
    neighbours need, in local coordinates. ``need`` is the global input range the local output needs.
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

    @property
    def extended(self) -> int:
        """Extent of the local extended input."""
        own = self.own[1] - self.own[0] - self.trim_lo - self.trim_hi
        return self.pad_lo + self.recv_lo + max(own, 0) + self.recv_hi + self.pad_hi

    @property
    def halo(self) -> tuple[int, int]:
        """Signed halo widths (negative: surplus own input trimmed)."""
        return (self.recv_lo - self.trim_lo, self.recv_hi - self.trim_hi)


class HaloError(ValueError):
    """A split too fine for a layer: a halo needs more than the neighbouring shard holds."""


def _need(out: Range, kernel: int, stride: int, pad_lo: int, dilation: int) -> Range:
    """Global input range (padding included, may leave ``[0, n)``) that outputs ``out`` read."""
    if out[1] <= out[0]:
        return (0, 0)
    return out[0] * stride - pad_lo, (out[1] - 1) * stride - pad_lo + dilation * (kernel - 1) + 1


def _local_plan(own: Range, out: Range, need: Range, extent: int) -> tuple[HaloPlan, Range, Range]:
    """This rank's plan (sends still empty) and the global ranges it receives from left and right."""
    a, b = need
    n_own = own[1] - own[0]
    ca, cb = max(a, 0), min(b, extent)
    if cb <= ca:  # the outputs read padding only
        return HaloPlan(own, out, need, b - a, 0, 0, 0, n_own, 0, (0, 0), (0, 0)), (0, 0), (0, 0)
    lo_rng = (ca, min(own[0], cb)) if ca < own[0] else (0, 0)
    hi_rng = (max(own[1], ca), cb) if cb > own[1] else (0, 0)
    trim_lo = min(max(0, ca - own[0]), n_own)
    trim_hi = min(max(0, own[1] - cb), n_own - trim_lo)
    plan = HaloPlan(own, out, need, max(0, -a), max(0, b - extent), lo_rng[1] - lo_rng[0],
                    hi_rng[1] - hi_rng[0], trim_lo, trim_hi, (0, 0), (0, 0))
    return plan, lo_rng, hi_rng


def _link(extent: int, ins: list[Range], outs: list[Range], needs: list[Range], layer: str,
          dim: str, fits: str) -> list[HaloPlan]:
    """Plans of all ranks with sends set to what the neighbours receive, checked to be neighbourly."""
    parts = len(ins)
    local = [_local_plan(ins[i], outs[i], needs[i], extent) for i in range(parts)]
    for i, (_, lo_rng, hi_rng) in enumerate(local):
        for side, rng, j in (("left", lo_rng, i - 1), ("right", hi_rng, i + 1)):
            width = rng[1] - rng[0]
            if not width:
                continue
            nb = ins[j][1] - ins[j][0] if 0 <= j < parts else 0
            if not (0 <= j < parts and ins[j][0] <= rng[0] and rng[1] <= ins[j][1]):
                raise HaloError(
                    f"{layer}: dim {dim}: a halo of {width} voxels from the {side} neighbour is wider "
                    f"than its shard of {nb} voxels (input extent {extent} split {parts} ways); {fits}")
    plans = []
    for i, (plan, _, _) in enumerate(local):
        own0 = plan.own[0]
        send_lo = send_hi = (0, 0)
        if i > 0 and local[i - 1][2][1] > local[i - 1][2][0]:
            r = local[i - 1][2]
            send_lo = (r[0] - own0, r[1] - own0)
        if i + 1 < parts and local[i + 1][1][1] > local[i + 1][1][0]:
            r = local[i + 1][1]
            send_hi = (r[0] - own0, r[1] - own0)
        plans.append(HaloPlan(plan.own, plan.out, plan.need, plan.pad_lo, plan.pad_hi, plan.recv_lo,
                              plan.recv_hi, plan.trim_lo, plan.trim_hi, send_lo, send_hi))
    return plans


def _check_nonempty(extent: int, n_out: int, parts: int, layer: str, dim: str) -> None:
    if parts > 1 and (extent < parts or n_out < parts):
        raise HaloError(
            f"{layer}: dim {dim} has input extent {extent} and output extent {n_out}, too small to split "
            f"over {parts} ranks (every shard needs at least one voxel); use a split of at most "
            f"{max(1, min(extent, n_out))} along {dim}")


def window_plans(extent: int, parts: int, kernel: int, stride: int = 1, pad_lo: int = 0,
                 pad_hi: int = 0, dilation: int = 1, ceil_mode: bool = False,
                 out_extent: int | None = None, layer: str = "layer", dim: str = "dim") -> list[HaloPlan]:
    """Halo plans of every rank along one dim for a window layer whose output is balanced-split.

    Raises :class:`HaloError` when a rank needs input beyond its immediate neighbours, naming the
    layer, the dim, the neighbour's shard extent and the halo width, and what would fit.
    """
    n_out = conv_output_extent(extent, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode) \
        if out_extent is None else out_extent
    _check_nonempty(extent, n_out, parts, layer, dim)
    ins, outs = shard_ranges(extent, parts), shard_ranges(n_out, parts)
    needs = [_need(o, kernel, stride, pad_lo, dilation) for o in outs]
    try:
        return _link(extent, ins, outs, needs, layer, dim, "")
    except HaloError as err:
        fits = "use a smaller split along " + dim
        if layer:  # the search for what fits calls this function; only a real layer's error pays for it
            fits = (f"use a split of at most "
                    f"{max_parts(extent, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode)} along {dim}")
        raise HaloError(f"{err}{fits}") from None


def max_parts(extent: int, kernel: int, stride: int = 1, pad_lo: int = 0, pad_hi: int = 0,
              dilation: int = 1, ceil_mode: bool = False) -> int:
    """Largest split of this dim for which every halo comes from the immediate neighbours."""
    best = 1
    for parts in range(2, extent + 1):
        try:
            window_plans(extent, parts, kernel, stride, pad_lo, pad_hi, dilation, ceil_mode,
                         layer="", dim="")
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
    _check_nonempty(extent, n_out, parts, layer, dim)
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
    least one received halo voxel.
    """
    left_recv_end = plan.pad_lo + plan.recv_lo
    lo_avail = 0 if plan.recv_lo == 0 else left_recv_end
    own = max(plan.own[1] - plan.own[0] - plan.trim_lo - plan.trim_hi, 0)
    hi_avail = plan.extended if plan.recv_hi == 0 else left_recv_end + own
    span = dilation * (kernel - 1) + 1
    lo = -(-lo_avail // stride)
    hi = (hi_avail - span) // stride + 1 if hi_avail >= span else 0
    lo, hi = min(max(lo, 0), n_out_local), min(max(hi, 0), n_out_local)
    return (lo, hi) if hi > lo else (lo, lo)
