"""Per-rank work of a spatial group: each layer's FLOPs divided by the distributed layers' index
arithmetic (:mod:`hybridpar.geometry`), and the halo bytes each rank receives.

Why apart from counting (:mod:`.counter`): this reads only the records of a count and a split per
layer, so the planner's questions (how balanced is a split, how much halo does it move) cost no
model run.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridpar import globs
from hybridpar.call_keys import module_path
from hybridpar.flops.counter import FlopCount, LayerFlops, TrainingTotals, count
from hybridpar.geometry import HaloPlan, shard_range
from hybridpar.nn.formulas import LayerGeometry

__all__ = ["RankFlops", "ShardedFlops", "ShardedLayer", "count_sharded", "received_halo"]


@dataclass
class RankFlops(TrainingTotals):
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
    base, patterns = module_path(name), list(splits)
    k = globs.rule_for(base, patterns)
    return (tuple(splits[patterns[k]]), patterns[k] == base) if k is not None else (None, False)


def _halo_plans(g: LayerGeometry, name: str, input_shape: Sequence[int], output_shape: Sequence[int],
                dim: int, parts: int) -> list[HaloPlan]:
    n = len(g.windows)
    label = "DHW"[dim - n + 3] if n <= 3 else str(dim)
    return g.windows[dim].plans(input_shape[-n + dim], parts, layer=name, dim=label,
                                out_extent=output_shape[-n + dim])


def _scale(value: int, part: int, whole: int) -> int:
    return value * part // whole if whole else 0


def _width(rng: tuple[int, int]) -> int:
    return rng[1] - rng[0]


def work_shares(geometry: LayerGeometry | None, input_shape: Sequence[int], output_shape: Sequence[int],
                split: Sequence[int], name: str = "layer") -> list[float]:
    """The fraction of one call's work each rank of ``split`` does, per coordinate (row-major): the
    library's one rule of per-rank work, read by ``count_sharded``, the planner (``LayerPlan.rank_share``:
    the most loaded rank's), ``explain``, automatic stages and the performance model.

    A rank does its share of output voxels (``geometry.shard_range`` of each output extent) times the
    per-voxel cost; a transposed conv, its gathered input (own shard plus halo) times the
    per-input-voxel cost, so its redundant work shows; an adaptive or reducing layer, its own input.
    Without a geometry the layer works voxel by voxel (output share).
    """
    return [part / whole if whole else 0.0 for part, whole in _parts(geometry, input_shape, output_shape,
                                                                      tuple(split), name)[0].values()]


def _parts(g: LayerGeometry | None, input_shape: Sequence[int], output_shape: Sequence[int],
           split: tuple[int, ...], name: str) -> tuple[dict[tuple[int, ...], tuple[int, int]], list]:
    """Per coordinate (part, whole) of :func:`work_shares`, and the halo plans per dim (None: none)."""
    n = len(split)
    out_sp, in_sp = tuple(output_shape[-n:]), tuple(input_shape[-n:])
    window = g is not None and g.kind in ("conv", "conv_transposed", "window")
    plans = [_halo_plans(g, name, input_shape, output_shape, d, split[d]) if window and split[d] > 1 else None
             for d in range(n)]
    kind = g.kind if g is not None else "pointwise"
    parts = {}
    for coord in itertools.product(*(range(s) for s in split)):
        if kind == "conv_transposed":
            ext = [plans[d][coord[d]].extended if plans[d] else in_sp[d] for d in range(n)]
            parts[coord] = (math.prod(ext), math.prod(in_sp))
        elif kind == "adaptive":
            parts[coord] = (math.prod(_width(shard_range(in_sp[d], split[d], coord[d])) for d in range(n)),
                            math.prod(in_sp))
        else:
            parts[coord] = (math.prod(_width(shard_range(out_sp[d], split[d], coord[d])) for d in range(n)),
                            math.prod(out_sp))
    return parts, plans


def _shard_layer(layer: LayerFlops, split: tuple[int, ...], world: int, elem: int) -> list[RankFlops]:
    """Per-rank work of one layer; ranks beyond the split's size repeat it (``rank % parts``)."""
    n = len(split)
    in_sp = layer.input_shape[-n:]
    batch_ch = math.prod(layer.input_shape[:-n])  # N * C_in (and any leading dims)
    parts, plans = _parts(layer.geometry, layer.input_shape, layer.output_shape, split, layer.name)
    per_coord: dict[tuple[int, ...], RankFlops] = {}
    for coord, (part, whole) in parts.items():
        own_in = [_width(shard_range(in_sp[d], split[d], coord[d])) for d in range(n)]
        r = RankFlops(-1)
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

    Rules: a rank's work is its :func:`work_shares` of the layer's. A rank receives, per split dim,
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
