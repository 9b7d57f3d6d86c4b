"""The compute term: each layer's forward and backward on the most loaded rank, per micro-batch.

Why a module of its own: it is where a layer's work (its FLOPs scaled by the rank's share of output
voxels, and the bytes it moves: input incl. halos, output, weights) meets the machine's per-op-class
costs (:class:`~hybridpar.perfmodel.machine.Cost`) or the layer's measured time at its exact
shape, and where the halo exchange and redistribution around each layer are attached to it
(:mod:`.comm`), so that the pipeline and memory terms read one record per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hybridpar.fft import group_count
from hybridpar.nn import registry
from hybridpar.perfmodel.comm_cost import allreduce_parts, halo_bytes, norm_stat_bytes, redistribution
from hybridpar.perfmodel.machine import Compute, Link, Machine
from hybridpar.perfmodel.workload import Leaf, Workload, input_grads, kernel_shape, layer_key
from hybridpar.planner.analysis import REPLICATED
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan
from hybridpar.planner.terms import Split

__all__ = ["LayerCost", "layer_costs"]


@dataclass
class LayerCost:
    """One layer on the most loaded rank of its stage, per micro-batch (seconds, bytes)."""

    name: str
    op: str
    stage: int
    split: Split
    forward: float
    backward: float
    halo_forward: float   # halo exchange, and a split norm layer's all-reduce of its statistics
    halo_backward: float
    redistribute_forward: float
    redistribute_backward: float
    flops: float
    halo_bytes: int
    saved_bytes: int
    latency: float = 0.0  # the message latencies inside the halo and redistribute times
    weight_backward: float = 0.0  # the weight-gradient part of ``backward`` (conv, linear)


def _kernel_times(leaf: Leaf, c: Compute, e: int, frac: float, in_n: int, ext_n: int, out_n: int,
                  needs_igrad: bool) -> tuple[float, float, float, float]:
    """(forward s, backward s, matmul FLOPs, weight-gradient share of the backward) from the fitted
    per-op-class costs."""
    f_fwd = leaf.forward * frac
    f_w = leaf.weight_grad * frac
    f_i = leaf.forward * frac if needs_igrad and leaf.op in ("conv", "linear") else 0.0
    fwd = bwd = w_share = 0.0
    if leaf.op in ("conv", "linear"):
        cost_f = c.conv_fwd if leaf.op == "conv" else c.linear
        cost_b = c.conv_bwd if leaf.op == "conv" else c.linear
        nbytes = e * (ext_n + out_n + leaf.params)
        fwd = cost_f.time(f_fwd, nbytes)
        bwd = cost_b.time(f_i + f_w, nbytes * (2 if f_i else 1))
        w_share = f_w / (f_i + f_w) if f_i + f_w > 0 else 0.0
    elif leaf.op == "pool":
        fwd = c.pool.time(leaf.other * frac, e * (ext_n + out_n))
        bwd = c.pool.time(0.0, e * (ext_n + 2 * out_n)) if needs_igrad else 0.0
    elif leaf.op in ("pointwise", "norm"):
        k = 4 if leaf.op == "norm" else 1
        fwd = c.pointwise.time(0.0, k * 2 * e * in_n)
        bwd = c.pointwise.time(0.0, k * 3 * e * in_n) if needs_igrad else 0.0
    return fwd, bwd, f_fwd + f_i + f_w, w_share


def _saved_bytes(leaf: Leaf, e: int, out_n: int, ext_n: int, hb: int) -> int:
    """Bytes autograd keeps for this layer's backward (its registry entry says which tensors)."""
    entry = registry.lookup(leaf.module) if leaf.module is not None else None
    if entry is not None:
        return entry.saved_bytes(leaf.module, e, out_n, ext_n if hb else 0)
    return e * out_n if leaf.op != "free" else 0


def layer_costs(workload: Workload, plan: list[LayerPlan], machine: Machine, slow: float, halo_link: Link,
                halo_share: float, stage_size: int) -> list[LayerCost]:
    """Every layer's times on the most loaded rank, its compute stretched ``slow`` times (contention,
    drift, time-shared cores), its messages over ``halo_link`` with ``halo_share`` of its bandwidth."""
    e, c = machine.compute.dtype_bytes, machine.compute
    layers: list[LayerCost] = []
    for i, (rec, leaf, needs_igrad) in enumerate(zip(plan, workload.layers, input_grads(plan, workload))):
        out_n = math.prod(rec.local_output_shape)
        frac = rec.rank_share
        in_n = math.prod(rec.local_input_shape)
        spatial = len(rec.local_input_shape) == 5
        hb, hmsg = halo_bytes(rec.local_input_shape, rec.halo, rec.split, e) \
            if spatial and rec.split != REPLICATED else (0, 0)
        ext_n = in_n + hb // e
        fwd, bwd, flops, w_share = _kernel_times(leaf, c, e, frac, in_n, ext_n, out_n, needs_igrad)
        key = layer_key(leaf.module, kernel_shape(leaf.module, rec), needs_igrad) \
            if machine.measured and leaf.op != "free" and leaf.module is not None else None
        entry = registry.lookup(leaf.module) if leaf.module is not None else None
        if key in machine.measured:
            fwd, bwd = machine.measured[key]  # includes assembling the extended input
        elif leaf.window and entry is not None and \
                (hb or any(w.pad_lo and not w.transposed for w in entry.windows_of(leaf.module) or ())):
            fwd += c.pointwise.time(0.0, 2 * e * ext_n)   # assembling the extended input
            bwd += c.pointwise.time(0.0, 2 * e * ext_n) if needs_igrad else 0.0
        fwd *= slow
        bwd *= slow
        h_f = halo_link.time(hb / halo_share, hmsg) if hb else 0.0
        h_b = h_f if hb and needs_igrad else 0.0
        latency = hmsg * halo_link.latency * (1 + (h_b > 0))
        if leaf.op == "norm" and spatial and math.prod(rec.split) > 1:
            # a split norm's statistics: one all-reduce forward, one backward (hybridpar.nn.norm)
            lat, xfer = allreduce_parts(norm_stat_bytes(rec.local_input_shape, math.prod(rec.split)),
                                        range(math.prod(rec.split)), machine, math.prod(rec.split))
            backward = needs_igrad or leaf.params > 0
            h_f, h_b = h_f + lat + xfer, h_b + (lat + xfer if backward else 0.0)
            latency += lat * (1 + backward)
        r_f = r_b = 0.0
        if rec.redistribute and spatial:
            prev = plan[i - 1]
            (r_f, r_b), lat = redistribution(rec.input_shape, rec.local_input_shape, prev.split, rec.split,
                                             stage_size, e, halo_link, halo_share)
            latency += lat
        if rec.transpose_bytes:  # a spectral layer's FFT transposes, as much again backward
            moved = rec.transpose_bytes // BYTES_PER_ELEMENT * e
            # up to every other rank, per transpose, direction and channel group
            messages = 6 * (stage_size - 1) * group_count(*rec.input_shape[:2], e * in_n)
            t = halo_link.time(moved / halo_share, messages)
            r_f, r_b = r_f + t, r_b + t
            latency += 2 * messages * halo_link.latency
        if hb and layers and layers[-1].stage == rec.stage:
            # a layer that exchanges halos saves its extended copy of the input, counted above; the
            # plain input (the layer before's output, counted there) is then kept by nobody
            layers[-1].saved_bytes = max(layers[-1].saved_bytes - e * in_n, 0)
        layers.append(LayerCost(rec.name, leaf.op, rec.stage, rec.split, fwd, bwd, h_f, h_b, r_f, r_b,
                                flops, hb, _saved_bytes(leaf, e, out_n, ext_n, hb), latency, bwd * w_share))
    return layers
