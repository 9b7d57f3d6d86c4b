"""Communication costs: halo exchange, redistribution between splits, all-reduce, and which link.

Why a module of its own: these are alpha-beta costs (``latency + bytes / bandwidth`` per message,
:class:`~hybridpar.perfmodel.machine.Link`) of the traffic the distributed layers and the engine
produce, computed from the plan's shapes with the same index arithmetic they run
(:mod:`hybridpar.geometry`); none of it depends on how a step is scheduled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hybridpar.flops import received_halo
from hybridpar.perfmodel.machine import Link, Machine
from hybridpar.planner.terms import Split
from hybridpar.relayout import redistribute_volume

__all__ = ["allreduce_parts", "allreduce_time", "halo_bytes", "link_between", "norm_stat_bytes",
           "redistribute_volume", "redistribution"]


def halo_bytes(local_input: Sequence[int], halo: Sequence[tuple[int, int]], split: Split,
               dtype_bytes: int = 4) -> tuple[int, int]:
    """Bytes and messages the most loaded rank receives to extend its ``local_input`` (N, C, D, H, W).

    ``halo`` is the plan's widest (low, high) halo per dim; an interior rank receives both (one
    message each), a rank of a 2-way split only one. Dims are exchanged in order (d, then h on the
    d-extended shard, then w), as :class:`hybridpar.comm.halo.HaloExchanger` does, so later faces
    include earlier halos (the corners).
    """
    widths: list[tuple[int, int] | None] = []
    for d in range(3):
        if split[d] == 1:
            widths.append(None)
            continue
        lo, hi = max(halo[d][0], 0), max(halo[d][1], 0)
        # each of the two ranks of a 2-way split has one neighbour: the wider side is the worst
        widths.append((max(lo, hi), 0) if split[d] == 2 else (lo, hi))
    return received_halo(local_input[2:], widths, local_input[0] * local_input[1] * dtype_bytes, corners=True)


def allreduce_time(nbytes: float, ranks: Sequence[int], machine: Machine, world: int) -> float:
    """Ring all-reduce of ``nbytes`` over global ``ranks``; hierarchical when they span nodes.

    Within a node: ``2 (g-1)/g`` of the bytes over the intra link and ``2 (g-1)`` latencies. Across
    ``k`` nodes: ``2 (k-1)/k`` of the bytes through each node's NIC, which every group with members
    on that node shares (``G / g`` of them, G ranks per node, g of this group), and
    ``2 ceil(log2 k)`` latencies (tree-like latency at scale).
    """
    return sum(allreduce_parts(nbytes, ranks, machine, world))


def allreduce_parts(nbytes: float, ranks: Sequence[int], machine: Machine,
                     world: int) -> tuple[float, float]:
    """(latency, transfer) seconds of :func:`allreduce_time`."""
    n = len(ranks)
    if n <= 1 or nbytes <= 0:
        return 0.0, 0.0
    per = machine.ranks_per_node
    nodes: dict[int, int] = {}
    for r in ranks:
        nodes[r // per] = nodes.get(r // per, 0) + 1
    k, g = len(nodes), max(nodes.values())
    lat = xfer = 0.0
    if g > 1:
        lat += 2 * (g - 1) * machine.intra.latency
        xfer += 2 * (g - 1) / g * nbytes / machine.intra.bandwidth
    if k > 1:
        share = max(min(per, world) / g, 1.0)
        lat += 2 * math.ceil(math.log2(k)) * machine.inter.latency
        xfer += 2 * (k - 1) / k * nbytes * share / machine.inter.bandwidth
    return lat, xfer


def norm_stat_bytes(local_input: Sequence[int], ranks: int) -> int:
    """Bytes of a split norm layer's all-reduce at most: a float64 count, sum and centred squares per
    sample and channel in every rank's slot (:func:`hybridpar.nn.norm._moments`; fewer for BatchNorm
    or groups, and latency-bound either way)."""
    return 3 * 8 * ranks * local_input[0] * local_input[1]


def link_between(machine: Machine, span: int, world: int) -> tuple[Link, float]:
    """The link for point-to-point traffic inside blocks of ``span`` consecutive ranks, and the share
    of its bandwidth one flow gets: the intra-node link when a block fits a node, else the node's NIC
    shared by all of the node's ranks (they exchange at the same time)."""
    per = machine.ranks_per_node
    if world <= per or span <= per:
        return machine.intra, 1.0
    return machine.inter, 1.0 / per


def redistribution(shape: Sequence[int], local_shape: Sequence[int], src: Split, dst: Split, stage: int,
                   e: int, link: Link, share: float) -> tuple[tuple[float, float], float]:
    """Forward and backward seconds of moving one micro-batch's activation from ``src`` to ``dst``,
    and the latencies among them."""
    nc = local_shape[0] * shape[1]
    sp = (shape[2], shape[3], shape[4])
    vox, msgs = redistribute_volume(sp, src, dst, stage)
    back, bmsgs = redistribute_volume(sp, dst, src, stage)
    times = (link.time(vox * nc * e / share, msgs), link.time(back * nc * e / share, bmsgs))
    return times, (msgs + bmsgs) * link.latency
