"""The workload: a model on a global input, analysed once, and what each of its layers runs as.

Why a module of its own: the performance model, the advisor and the harness predict thousands of
layouts of one model; the model is traced, its shapes and FLOPs counted once
(:func:`hybridpar.planner.analysis.analyse`), and every layout resolved against that analysis by the
one planner (:func:`hybridpar.planner.plan.resolve`). Each layer is classed for timing (the registry
entry's ``op``: conv, linear, pool, pointwise, norm, free) and keyed for measured times
(:func:`layer_key`) by the input shape its kernel runs on (:func:`kernel_shape`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from hybridpar import flops as flop_count
from hybridpar.nn import registry
from hybridpar.planner.analysis import analyse, leaf_flop_sums
from hybridpar.planner.config import ParallelSpec
from hybridpar.planner.plan import resolve
from hybridpar.planner.records import LayerPlan

__all__ = ["Leaf", "Workload", "input_grads", "kernel_shape", "layer_entries", "layer_key"]


def _op_class(m: nn.Module | None, fwd_flops: int) -> str:
    """The kernel class a layer is timed as (its registry entry's ``op``)."""
    entry = registry.lookup(m) if m is not None else None
    if entry is not None:
        return entry.op
    return "conv" if fwd_flops else "free"


@dataclass(frozen=True)
class Leaf:
    """One node of the workload's graph as the model times it (FLOPs for the whole global batch)."""

    name: str
    module: nn.Module | None
    op: str
    forward: int       # matmul FLOPs
    input_grad: int
    weight_grad: int
    other: int         # forward_other (pool taps)
    params: int
    window: bool       # a conv/pool whose halos the plan computes


class Workload:
    """``model`` on a global input of ``input_shape``: leaves, shapes and per-leaf FLOPs, computed once.

    :meth:`plan` resolves a spec with the one planner on the cached analysis, whose halos are
    memoised and whose errors are terse (a planner only needs to know that a split fails;
    :meth:`ParallelSpec.plan` says what would fit), so a planner can resolve thousands of specs.
    """

    def __init__(self, model: nn.Module, input_shape: Sequence[int]) -> None:
        self.analysis = analyse(model, tuple(int(s) for s in input_shape), terse=True)
        self.model, self.input_shape = model, self.analysis.input_shape
        self.leaves, self.containers = self.analysis.leaves, self.analysis.containers
        self.shapes = self.analysis.shapes
        self.count = self.analysis.count or flop_count.count(model, self.input_shape)
        sums = leaf_flop_sums(self.count, self.leaves)
        self.layers: list[Leaf] = []
        for node, s in zip(self.analysis.graph.nodes, sums, strict=True):
            m = node.module
            entry = registry.lookup(m) if m is not None else None
            op = _op_class(m, s[0]) if m is not None else \
                ("pointwise" if registry.function_role(node.target) in ("pointwise", "concat") else "free")
            self.layers.append(Leaf(node.name, m, op, s[0], s[1], s[2], s[3],
                                    sum(p.numel() for p in m.parameters()) if m is not None else 0,
                                    entry is not None and entry.role in ("window", "transposed")))
        self.fwd_flops = [lf.forward for lf in self.layers]
        self.train_flops = [s[0] + s[1] + s[2] for s in sums]

    @property
    def batch(self) -> int:
        return self.input_shape[0]

    @property
    def total_flops(self) -> int:
        """Matmul FLOPs of one training step on the global batch (forward + backward)."""
        return self.count.total

    @property
    def params(self) -> int:
        return sum(lf.params for lf in self.layers)

    def plan(self, spec: ParallelSpec, world_size: int | None = None) -> list[LayerPlan]:
        """:func:`hybridpar.planner.plan.resolve` of ``spec`` on this workload's analysis."""
        return resolve(spec, self.analysis, world_size)


def input_grads(plan: list[LayerPlan], workload: Workload) -> list[bool]:
    """Whether each layer's input needs a gradient: not before the first parameter of stage 0."""
    out, flows, stage = [], False, -1
    for rec, leaf in zip(plan, workload.layers):
        if rec.stage != stage:
            stage = rec.stage
            flows = flows or stage > 0
        out.append(flows)
        flows = flows or leaf.params > 0
    return out


# ---------------------------------------------------------------------------------------------------
# Keys of measured layer times


def _signature(m: nn.Module) -> str:
    """The hyperparameters that decide a layer's kernel, from its registry entry: its window (kernel,
    stride, dilation: the padding is in the kernel's input shape) and, for matmul kernels, the shapes
    of its parameters (channels, groups, bias); not their values."""
    entry = registry.lookup(m)
    parts = []
    ws = entry.windows_of(m) if entry is not None else None
    if ws is not None:
        parts += [key[0] + "x".join(str(getattr(w, key)) for w in ws)
                  for key in ("kernel", "stride", "dilation")]
    if entry is not None and entry.op in ("conv", "linear"):
        parts += ["w" + "x".join(map(str, p.shape)) for p in m.parameters(recurse=False)]
    return f"{type(m).__name__}({','.join(parts)})" if parts else type(m).__name__


def kernel_shape(m: nn.Module, rec: LayerPlan) -> tuple[int, ...]:
    """The input shape the torch kernel of ``rec`` runs on, on the most loaded rank, per micro-batch.

    Window layers run unpadded on their halo- and padding-extended shard (as the distributed layers
    do): per dim ``(out - 1) * stride + dilation * (kernel - 1) + 1``; other layers on their shard.
    """
    entry = registry.lookup(m) if m is not None else None
    if entry is not None and entry.role == "window" and len(rec.local_output_shape) == 5:
        out = rec.local_output_shape[2:]
        ext = tuple(w.extended(o) for o, w in zip(out, entry.windows_of(m)))
        return (rec.local_input_shape[0], rec.local_input_shape[1], *ext)
    return tuple(rec.local_input_shape)


def layer_key(m: nn.Module, shape: Sequence[int], input_grad: bool) -> str:
    """Key of a measured layer time: signature, kernel input shape, whether the input needs a gradient."""
    return f"{_signature(m)}|{'x'.join(map(str, shape))}|{'g' if input_grad else 'n'}"



def layer_entries(workload: Workload,
                  plan: list[LayerPlan]) -> list[tuple[str, nn.Module, tuple[int, ...], bool]]:
    """``(key, module, kernel shape, input_grad)`` of every layer of ``plan`` whose time matters."""
    out = []
    for rec, leaf, needs in zip(plan, workload.layers, input_grads(plan, workload)):
        if leaf.op == "free" or leaf.module is None:
            continue
        shape = kernel_shape(leaf.module, rec)
        out.append((layer_key(leaf.module, shape, needs), leaf.module, shape, needs))
    return out
