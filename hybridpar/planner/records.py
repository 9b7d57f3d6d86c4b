"""What a plan is made of: one :class:`LayerPlan` row per node, the most loaded rank's local shapes
and share of the work.

Why a module of its own: the planner of a traced graph (:mod:`.plan`) and that of a model run by module
swapping (:mod:`.swapped`) both write these rows, by the same rules; the runtime, ``explain`` and the
performance model read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from hybridpar.flops import work_shares
from hybridpar.geometry import shard_range
from hybridpar.nn import registry
from hybridpar.planner.analysis import REPLICATED, node_geometry
from hybridpar.planner.terms import Split

BYTES_PER_ELEMENT = 4  # activations are planned in float32


@dataclass(frozen=True)
class LayerPlan:
    """What one node (a layer, or a function such as ``+`` or ``torch.cat``) runs as. Local shapes are
    those of the most loaded rank (shard 0) for one micro-batch; ``halo`` is, per dim (d, h, w), the
    widest (low, high) halo any rank receives. ``split`` is the layout the node computes in (its inputs
    are redistributed to it where they differ: ``redistribute``), ``out_split`` that of its output
    (replicated after a whole-volume reduction). ``inputs`` names the nodes it reads (``"(input)"``:
    the model input); ``gather`` marks a replicated node that gathers a split input inside a split
    region; ``auto_replicated`` says why the planner replicated a node too small to split."""

    name: str
    kind: str
    stage: int
    split: Split
    rule: str | None
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    local_input_shape: tuple[int, ...]
    local_output_shape: tuple[int, ...]
    halo: tuple[tuple[int, int], ...]
    params: int
    flops: int
    activation_bytes: int
    redistribute: bool
    train_flops: int = 0  # forward + input gradient + weight gradient, whole global batch
    inputs: tuple[str, ...] = ()
    out_split: Split | None = None
    gather: bool = False
    transpose_bytes: int = 0  # what a spectral layer's FFT transposes bring the most loaded rank, forward
    # the most loaded rank's share of this node's work (whole global batch) in one micro-batch:
    # hybridpar.flops.work_shares, the rule count_sharded counts every rank by; the performance model
    # times it, explain prints it, automatic stages balance it
    rank_share: float = 0.0
    # why the planner replicated a node the grid would split (a shard thinner than its halo, an extent
    # smaller than the split, or an input so replicated): "" where it did not; ``strict`` refuses instead
    auto_replicated: str = ""

    @property
    def replicated(self) -> bool:
        return self.split == REPLICATED

    @property
    def output_split(self) -> Split:
        return self.split if self.out_split is None else self.out_split


def _shard(extent: int, parts: int) -> int:
    """Extent held by the most loaded rank: the first shard (the first shards take the remainder)."""
    lo, hi = shard_range(extent, parts, 0)
    return hi - lo


def local_shape(shape: tuple[int, ...], micro: int, split: Split) -> tuple[int, ...]:
    """The most loaded rank's shape of a value of global ``shape`` under ``split``, per micro-batch."""
    if len(shape) != 5:
        return (micro, *shape[1:])
    return (micro, shape[1], *(_shard(shape[2 + i], split[i]) for i in range(3)))


def rank_share(m: nn.Module | None, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
               local_out: tuple[int, ...], split: Split) -> float:
    """The most loaded rank's share of one node's work in one micro-batch: the micro-batch's share of
    the batch times the largest of :func:`hybridpar.flops.work_shares` (the layer's registered geometry
    decides: output voxels, a transposed conv's gathered input, a reduction's own input)."""
    batch = local_out[0] / out_shape[0] if out_shape and out_shape[0] else 0.0
    if split == REPLICATED or len(out_shape) != 5 or len(in_shape) != 5:
        whole = math.prod(out_shape)
        return math.prod(local_out) / whole if whole else 0.0
    return batch * max(work_shares(node_geometry(m, in_shape, out_shape), in_shape, out_shape, split))


def transpose_bytes(m: nn.Module | None, in_shape: tuple[int, ...], split: Split, micro: int) -> int:
    """Bytes the FFT transposes of a spectral layer bring its most loaded rank per micro-batch (its
    registry entry's ``transposes``; 0 for any other node)."""
    entry = registry.lookup(m) if m is not None else None
    fn = entry.transposes if entry is not None else None
    if fn is None or split == REPLICATED or len(in_shape) != 5:
        return 0
    return BYTES_PER_ELEMENT * micro * fn(m, in_shape, split)
