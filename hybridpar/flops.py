"""FLOPs, parameters and activation sizes of a model from shapes alone, whole and per rank.

Why a module of its own: the scaling harness reports achieved FLOP/s, the performance model predicts
step times from per-layer work, and the planner compares layouts before any allocation is spent.
All of them need the same per-layer numbers, computed once on the un-sharded model on the meta device
(nothing is allocated, so a 512^3 model costs no memory) and then divided among ranks by the same index
arithmetic the distributed layers use (:mod:`hybridpar.geometry`).

Conventions
-----------
* **2 FLOPs per multiply-add**, counted densely: padding taps are multiplied like any other, exactly as
  ``torch.utils.flop_counter.FlopCounterMode`` counts them.
* ``forward``, ``input_grad`` and ``weight_grad`` hold the **matmul-type work only** (convolutions,
  transposed convolutions, linear layers): the subset ``FlopCounterMode`` counts, so the totals agree
  with it. ``input_grad`` is zero when the layer's input does not require grad (the first layer:
  the model input needs no gradient), ``weight_grad`` is zero for frozen weights. Each equals the
  forward count when present (a conv's input gradient is a transposed conv of the same size, its
  weight gradient a conv of the same size).
* Grouped convolutions: the weight gradient is ``2 * N * out_voxels * C_out * (C_in / groups) * k``,
  like the forward. ``FlopCounterMode`` in torch 2.13 multiplies it by ``groups`` (it ignores groups
  in its weight-gradient formula); ours is the correct count.
* ``forward_other`` and ``backward_other`` hold **nominal** counts of the rest, which
  ``FlopCounterMode`` ignores: bias additions (1 per output element; 1 per element for the bias
  gradient), activations and dropout (1 per element each way), pooling (``prod(kernel)`` per output
  element; max pooling's backward 1 per input element), adaptive pooling (1 per input element each
  way), normalisation (4 per element each way). These layers are memory-bound: the numbers are for
  completeness, not for rate models (the performance model times them instead).
* Which modules are counted: the outermost module with an entry in the layer registry
  (:mod:`hybridpar.nn.registry`: convolutions incl. transposed and ``padding='same'``, ``Linear``,
  max/avg/adaptive pooling, batch/group/instance/layer norm, upsampling, pads, activations,
  ``Flatten``/``Unflatten``/``Identity``, dropout, and what users register), or one that wraps such a
  module in ``.local_module`` (the wrapper's observed shapes are used with the counterpart's
  hyperparameters). Each entry's ``flops`` gives the formula. The children of a counted module are
  not visited again. Leaves matching nothing are recorded with zero FLOPs and, when they hold
  parameters, listed in ``unsupported`` with a warning. Work done in ``forward`` by plain functions
  (``torch.flatten``, ``x * 1.2``) is not counted, nor by ``FlopCounterMode`` unless it is a matmul.
"""

from __future__ import annotations

import copy
import fnmatch
import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridpar.geometry import HaloPlan, shard_range, transposed_plans, window_plans
from hybridpar.nn import registry

__all__ = ["FlopCount", "LayerFlops", "RankFlops", "ShardedFlops", "ShardedLayer", "count", "count_sharded",
           "received_halo"]

_Geometry = registry.LayerGeometry  # window hyperparameters per spatial dim (kept per record)


@dataclass
class LayerFlops:
    """One call of one counted module. FLOPs are for the whole input batch; see the module conventions."""

    name: str
    type: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    forward: int
    input_grad: int
    weight_grad: int
    forward_other: int
    backward_other: int
    params: int
    activation_bytes: int  # bytes of the output activation
    input_requires_grad: bool = False  # whether the backward computes (and halo-exchanges) an input gradient
    geometry: _Geometry | None = field(default=None, repr=False, compare=False)

    @property
    def backward(self) -> int:
        return self.input_grad + self.weight_grad

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def spatial_dims(self) -> int:
        """Number of spatial dims of the output (0 for dense layers and (N, C) tensors)."""
        if self.geometry is None:
            return 0
        return len(self.geometry.kernel) if self.geometry.kernel else max(len(self.output_shape) - 2, 0)


@dataclass
class FlopCount:
    """Per-layer records in execution order, and their sums."""

    input_shape: tuple[int, ...]
    per_layer: list[LayerFlops]
    unsupported: list[str] = field(default_factory=list)

    def _sum(self, attr: str) -> int:
        return sum(getattr(layer, attr) for layer in self.per_layer)

    @property
    def forward(self) -> int:
        """Matmul-type forward FLOPs (what ``FlopCounterMode`` counts in the forward)."""
        return self._sum("forward")

    @property
    def input_grad(self) -> int:
        return self._sum("input_grad")

    @property
    def weight_grad(self) -> int:
        return self._sum("weight_grad")

    @property
    def backward(self) -> int:
        """Matmul-type backward FLOPs: input plus weight gradients."""
        return self.input_grad + self.weight_grad

    @property
    def total(self) -> int:
        """Matmul-type FLOPs of one training step on this input (forward + backward)."""
        return self.forward + self.backward

    @property
    def forward_other(self) -> int:
        return self._sum("forward_other")

    @property
    def backward_other(self) -> int:
        return self._sum("backward_other")

    @property
    def total_other(self) -> int:
        return self.forward_other + self.backward_other

    @property
    def params(self) -> int:
        return self._sum("params")

    @property
    def activation_bytes(self) -> int:
        return self._sum("activation_bytes")

    def by_name(self) -> dict[str, LayerFlops]:
        return {layer.name: layer for layer in self.per_layer}

    def table(self) -> str:
        """A fixed-width table of the per-layer records, in GFLOP and MiB."""
        head = (f"{'layer':<16}{'type':<18}{'output':<24}{'fwd':>9}{'igrad':>9}{'wgrad':>9}{'other':>9}"
                f"{'params':>11}{'act MiB':>9}")
        rows = [head]
        for r in self.per_layer:
            rows.append(f"{r.name:<16}{r.type:<18}{str(tuple(r.output_shape)):<24}{r.forward / 1e9:>9.3f}"
                        f"{r.input_grad / 1e9:>9.3f}{r.weight_grad / 1e9:>9.3f}"
                        f"{(r.forward_other + r.backward_other) / 1e9:>9.3f}{r.params:>11,}"
                        f"{r.activation_bytes / 2**20:>9.1f}")
        rows.append(f"{'total':<58}{self.forward / 1e9:>9.3f}{self.input_grad / 1e9:>9.3f}"
                    f"{self.weight_grad / 1e9:>9.3f}{self.total_other / 1e9:>9.3f}{self.params:>11,}"
                    f"{self.activation_bytes / 2**20:>9.1f}")
        return "\n".join(rows)


def _counterpart(module: nn.Module) -> nn.Module | None:
    """The module whose hyperparameters define ``module``'s work (it, or its ``local_module``), or None
    if no registry entry knows either."""
    if registry.lookup(module) is not None:
        return module
    local = getattr(module, "local_module", None)
    return local if local is not None and registry.lookup(local) is not None else None


def _select(model: nn.Module) -> tuple[dict[nn.Module, str], list[str]]:
    """Modules to hook (outermost supported ones and unsupported leaves) and unsupported names."""
    chosen: dict[nn.Module, str] = {}
    unsupported: list[str] = []

    def visit(name: str, module: nn.Module) -> None:
        if module in chosen:
            return
        children = list(module.named_children())
        if _counterpart(module) is not None or not children:
            chosen[module] = name or type(module).__name__
            if _counterpart(module) is None and any(True for _ in module.parameters(recurse=False)):
                unsupported.append(chosen[module])
            return
        if any(True for _ in module.parameters(recurse=False)):
            unsupported.append(name or type(module).__name__)
        for child_name, child in children:
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", model)
    return chosen, unsupported


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers live on the meta device (nothing allocated)."""
    tensors = list(itertools.chain(model.parameters(), model.buffers()))
    if all(t.is_meta for t in tensors):
        return model
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    try:
        return copy.deepcopy(model, memo)
    except Exception as err:  # e.g. a module holding a process group
        raise TypeError(f"cannot copy {type(model).__name__} to the meta device ({err}); build the model "
                        "under `with torch.device('meta'):` and pass that instead") from err


def _first_tensor(value: object) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _layer(name: str, module: nn.Module, x: torch.Tensor, y: torch.Tensor) -> LayerFlops:
    """The record of one call, dispatching on the torch counterpart of ``module``."""
    m = _counterpart(module)
    work: dict[str, int] = {}
    geom: _Geometry | None = None
    if m is not None:
        work, geom = registry.lookup(m).flops(m, x, y)
    needs_grad = x.requires_grad
    return LayerFlops(
        name=name, type=type(module).__name__, input_shape=tuple(x.shape), output_shape=tuple(y.shape),
        forward=work.get("forward", 0), input_grad=work.get("input_grad", 0),
        weight_grad=work.get("weight_grad", 0), forward_other=work.get("forward_other", 0),
        backward_other=work.get("backward_other", 0), params=sum(p.numel() for p in module.parameters()),
        activation_bytes=y.numel() * y.element_size(), input_requires_grad=needs_grad, geometry=geom)


def count(model: nn.Module, input_shape: Sequence[int], *, dtype: torch.dtype | None = None,
          input_requires_grad: bool = False) -> FlopCount:
    """Count the FLOPs of one forward and backward of ``model`` on an input of ``input_shape``.

    ``input_shape`` includes the batch dim, e.g. ``(1, 4, 128, 128, 128)``. The model is copied to the
    meta device (its parameters are not duplicated in memory) and run once with forward hooks that
    record shapes; its train/eval mode is kept (dropout counts only in training). ``dtype`` sets the
    input and activation element type (default: the model's first floating parameter, else float32).
    """
    if dtype is None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    meta = _meta_copy(model)
    for mod in meta.modules():  # same FLOPs either way, and training mode refuses a batch of one
        if isinstance(mod, nn.modules.batchnorm._BatchNorm):
            mod.eval()
    chosen, unsupported = _select(meta)
    records: list[LayerFlops] = []
    calls: dict[str, int] = {}

    def hook(module: nn.Module, args: tuple, output: object) -> None:
        x, y = _first_tensor(args), _first_tensor(output)
        if x is None or y is None:
            return
        name = chosen[module]
        calls[name] = calls.get(name, 0) + 1
        if calls[name] > 1:
            name = f"{name}#{calls[name]}"
        records.append(_layer(name, module, x, y))

    handles = [m.register_forward_hook(hook) for m in chosen]
    try:
        with torch.enable_grad():
            x = torch.empty(tuple(input_shape), device="meta", dtype=dtype, requires_grad=input_requires_grad)
            meta(x)
    finally:
        for h in handles:
            h.remove()
    if unsupported:
        warnings.warn(f"hybridpar.flops: no FLOP formula for modules with parameters: {unsupported}; "
                      "their work is not counted", stacklevel=2)
    return FlopCount(tuple(input_shape), records, unsupported)


# ---------------------------------------------------------------------------------------------------
# Per-rank work under spatial splits


@dataclass
class RankFlops:
    """What one rank of the spatial group does in one step (FLOPs and received halo bytes)."""

    rank: int
    forward: int = 0
    input_grad: int = 0
    weight_grad: int = 0
    forward_other: int = 0
    backward_other: int = 0
    halo_bytes_forward: int = 0   # activation halos received in the forward
    halo_bytes_backward: int = 0  # halo gradients sent back to their owners in the backward

    @property
    def backward(self) -> int:
        return self.input_grad + self.weight_grad

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def halo_bytes(self) -> int:
        return self.halo_bytes_forward + self.halo_bytes_backward

    def add(self, other: RankFlops) -> None:
        for attr in ("forward", "input_grad", "weight_grad", "forward_other", "backward_other",
                     "halo_bytes_forward", "halo_bytes_backward"):
            setattr(self, attr, getattr(self, attr) + getattr(other, attr))


@dataclass
class ShardedLayer:
    """One layer's record, its split and what each rank of the group does for it."""

    layer: LayerFlops
    split: tuple[int, ...]
    ranks: list[RankFlops]


@dataclass
class ShardedFlops:
    """Per-rank work of a spatial group; the headline figures are the most loaded rank's."""

    world: int
    per_rank: list[RankFlops]
    per_layer: list[ShardedLayer]
    unsharded: FlopCount

    @property
    def most_loaded(self) -> RankFlops:
        return max(self.per_rank, key=lambda r: (r.total, r.forward_other + r.backward_other, -r.rank))

    @property
    def forward(self) -> int:
        return self.most_loaded.forward

    @property
    def backward(self) -> int:
        return self.most_loaded.backward

    @property
    def total(self) -> int:
        return self.most_loaded.total

    @property
    def halo_bytes(self) -> int:
        """Largest halo traffic (forward activations plus backward gradients) of any rank."""
        return max(r.halo_bytes for r in self.per_rank)

    @property
    def imbalance(self) -> float:
        """Most loaded rank's matmul FLOPs over the mean (1.0 = perfectly balanced)."""
        mean = sum(r.total for r in self.per_rank) / len(self.per_rank)
        return self.most_loaded.total / mean if mean else 1.0


def _match(name: str, splits: Mapping[str, Sequence[int]]) -> tuple[tuple[int, ...] | None, bool]:
    """The split for a layer (exact name first, then the first matching glob) and whether exact."""
    base = name.split("#", 1)[0]
    if base in splits:
        return tuple(splits[base]), True
    for pattern, split in splits.items():
        if fnmatch.fnmatchcase(base, pattern):
            return tuple(split), False
    return None, False


def _halo_plans(layer: LayerFlops, dim: int, parts: int) -> list[HaloPlan] | None:
    g = layer.geometry
    n = len(g.kernel)
    extent = layer.input_shape[-n + dim]
    label = "DHW"[dim - n + 3] if n <= 3 else str(dim)
    if g.kind == "conv_transposed":
        return transposed_plans(extent, parts, g.kernel[dim], g.stride[dim], g.pad_lo[dim], g.dilation[dim],
                                g.output_padding[dim], layer=layer.name, dim=label)[0]
    return window_plans(extent, parts, g.kernel[dim], g.stride[dim], g.pad_lo[dim], g.pad_hi[dim],
                        g.dilation[dim], g.ceil_mode, out_extent=layer.output_shape[-n + dim],
                        layer=layer.name, dim=label, mode=g.mode)


def _scale(value: int, part: int, whole: int) -> int:
    return value * part // whole if whole else 0


def _width(rng: tuple[int, int]) -> int:
    return rng[1] - rng[0]


def _shard_layer(layer: LayerFlops, split: tuple[int, ...], world: int, elem: int) -> list[RankFlops]:
    """Per-rank work of one layer; ranks beyond the split's size repeat it (``rank % parts``)."""
    g = layer.geometry
    n = len(split)
    out_sp, in_sp = layer.output_shape[-n:], layer.input_shape[-n:]
    batch_ch = math.prod(layer.input_shape[:-n])  # N * C_in (and any leading dims)
    window = g.kind in ("conv", "conv_transposed", "window")
    plans = [_halo_plans(layer, d, split[d]) if window and split[d] > 1 else None for d in range(n)]
    per_coord: dict[tuple[int, ...], RankFlops] = {}
    for coord in itertools.product(*(range(s) for s in split)):
        own_in = [_width(shard_range(in_sp[d], split[d], coord[d])) for d in range(n)]
        local_out = math.prod(_width(shard_range(out_sp[d], split[d], coord[d])) for d in range(n))
        r = RankFlops(-1)
        if g.kind == "conv_transposed":  # the rank runs the transposed conv on its gathered input
            ext = [plans[d][coord[d]].extended if plans[d] else in_sp[d] for d in range(n)]
            part, whole = math.prod(ext), math.prod(in_sp)
        elif g.kind == "adaptive":
            part, whole = math.prod(own_in), math.prod(in_sp)
        else:
            part, whole = local_out, math.prod(out_sp)
        r.forward, r.input_grad = _scale(layer.forward, part, whole), _scale(layer.input_grad, part, whole)
        r.weight_grad = _scale(layer.weight_grad, part, whole)
        r.forward_other = _scale(layer.forward_other, part, whole)
        r.backward_other = _scale(layer.backward_other, part, whole)
        widths = [(plans[d][coord[d]].recv_lo, plans[d][coord[d]].recv_hi) if plans[d] else None
                  for d in range(n)]
        r.halo_bytes_forward = received_halo(own_in, widths, batch_ch * elem, corners=False)[0]
        r.halo_bytes_backward = r.halo_bytes_forward if layer.input_requires_grad else 0
        per_coord[coord] = r
    coords = list(per_coord)
    ranks = []
    for rank in range(world):
        r = copy.copy(per_coord[coords[rank % len(coords)]])
        r.rank = rank
        ranks.append(r)
    return ranks


def received_halo(extents: Sequence[int], widths: Sequence[tuple[int, int] | None], bytes_per_voxel: int,
                  corners: bool) -> tuple[int, int]:
    """Bytes and messages a rank receives to extend its shard of spatial ``extents`` by ``widths``
    (low, high) per dim (None: not exchanged; negative widths receive nothing); ``bytes_per_voxel``
    counts the batch and channels. Dims are exchanged in order; with ``corners`` each later face
    includes the halos already received (as :class:`hybridpar.comm.halo.HaloExchanger` sends
    them), without it each face is the shard's own."""
    ext = list(extents)
    total = msgs = 0
    for d, width in enumerate(widths):
        if width is None:
            continue
        lo, hi = max(width[0], 0), max(width[1], 0)
        total += (lo + hi) * math.prod(ext[e] for e in range(len(ext)) if e != d) * bytes_per_voxel
        msgs += (lo > 0) + (hi > 0)
        if corners:
            ext[d] += lo + hi
    return total, msgs


def count_sharded(model: nn.Module, input_shape: Sequence[int], splits: Mapping[str, Sequence[int]], *,
                  world: int | None = None, dtype: torch.dtype | None = None) -> ShardedFlops:
    """Per-rank FLOPs and halo bytes of a spatial group running ``model`` with per-layer ``splits``.

    ``splits`` maps a layer name (as in ``model.named_modules()``) or a glob (``"features.*"``) to a
    split ``(sd, sh, sw)`` of its output's spatial dims (one entry per spatial dim); an exact name wins
    over globs, then the first matching glob in order. Globs skip layers without spatial dims
    (linear layers, (N, C) tensors); naming one exactly is an error.

    Rules: a layer's local work is its share of output voxels (``geometry.shard_range`` of each output
    extent) times the per-voxel cost; a transposed conv's is its gathered input (own shard plus
    halo) times the per-input-voxel cost, so its redundant work shows. A rank receives, per split dim,
    ``(recv_lo + recv_hi) x (the other local input extents) x N x C_in x element size`` bytes
    (``geometry.window_plans``; corner regions of multi-dim splits not counted); the backward sends the
    same volume of halo gradients back when the layer's input needs a gradient. The group has
    ``world`` ranks (default: the largest split's size); a layer split over fewer ranks, or not split,
    is repeated on the others (rank ``r`` does the work of split rank ``r % parts``) -- the honest cost
    of a replicated layer. Gathers and reshuffles between differently split layers are not counted.
    """
    whole = count(model, input_shape, dtype=dtype)
    resolved: list[tuple[LayerFlops, tuple[int, ...]]] = []
    for layer in whole.per_layer:
        split, exact = _match(layer.name, splits)
        dims = layer.spatial_dims
        if split is not None and dims == 0:
            if exact:
                raise ValueError(f"layer {layer.name} ({layer.type}, output {layer.output_shape}) has no "
                                 f"spatial dims to split {split} over; remove it from the splits")
            split = None
        if split is not None and len(split) != dims:
            raise ValueError(f"layer {layer.name} ({layer.type}) has {dims} spatial dims but its split "
                             f"{split} has {len(split)} entries")
        if split is not None and min(split) < 1:
            raise ValueError(f"layer {layer.name}: split {split} must be positive")
        resolved.append((layer, split if split is not None else (1,) * dims))
    sizes = [math.prod(s) for _, s in resolved] or [1]
    world = world or max(sizes)
    for (layer, split), size in zip(resolved, sizes, strict=False):
        if world % size:
            raise ValueError(f"layer {layer.name}: split {split} uses {size} ranks, which does not divide "
                             f"the spatial group of {world} ranks; use splits whose product divides {world}")
    per_rank = [RankFlops(r) for r in range(world)]
    per_layer = []
    for layer, split in resolved:
        elem = layer.activation_bytes // max(math.prod(layer.output_shape), 1)
        ranks = _shard_layer(layer, split, world, elem) if split else _replicate(layer, world)
        for total, mine in zip(per_rank, ranks, strict=True):
            total.add(mine)
        per_layer.append(ShardedLayer(layer, split, ranks))
    return ShardedFlops(world, per_rank, per_layer, whole)


def _replicate(layer: LayerFlops, world: int) -> list[RankFlops]:
    return [RankFlops(r, layer.forward, layer.input_grad, layer.weight_grad, layer.forward_other,
                      layer.backward_other) for r in range(world)]
