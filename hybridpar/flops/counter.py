"""Counting one forward and backward of a whole model on the meta device (conventions: the package doc).

Why apart from the per-rank division (:mod:`.sharded`): counting needs the model and one meta
forward; dividing needs only the records this produces.
"""

from __future__ import annotations

import copy
import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridpar.call_keys import call_key
from hybridpar.nn import registry
from hybridpar.nn.families import uses_batch_statistics
from hybridpar.nn.meta import OnMeta, keeps_value

__all__ = ["FlopCount", "LayerFlops", "TrainingTotals", "count", "meta_copy"]

_Geometry = registry.LayerGeometry  # window hyperparameters per spatial dim (kept per record)


class TrainingTotals:
    """``backward`` and ``total`` of a record holding ``forward``, ``input_grad`` and ``weight_grad``
    (matmul FLOPs of a layer, a model, or one rank)."""

    forward: int
    input_grad: int
    weight_grad: int

    @property
    def backward(self) -> int:
        """Matmul-type backward FLOPs: input plus weight gradients."""
        return self.input_grad + self.weight_grad

    @property
    def total(self) -> int:
        """Matmul-type FLOPs of one training step (forward + backward)."""
        return self.forward + self.backward


def _summed(attr: str, doc: str) -> property:
    """A property of :class:`FlopCount`: ``attr`` summed over its per-layer records."""
    return property(lambda self: sum(getattr(layer, attr) for layer in self.per_layer), doc=doc)


@dataclass
class LayerFlops(TrainingTotals):
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
    def spatial_dims(self) -> int:
        """Number of spatial dims of the output (0 for dense layers and (N, C) tensors)."""
        if self.geometry is None:
            return 0
        return len(self.geometry.windows) if self.geometry.windows else max(len(self.output_shape) - 2, 0)


@dataclass
class FlopCount(TrainingTotals):
    """Per-layer records in execution order, and their sums."""

    input_shape: tuple[int, ...]
    per_layer: list[LayerFlops]
    unsupported: list[str] = field(default_factory=list)

    forward = _summed("forward", "Matmul-type forward FLOPs (what ``FlopCounterMode`` counts forward).")
    input_grad = _summed("input_grad", "Matmul-type input-gradient FLOPs.")
    weight_grad = _summed("weight_grad", "Matmul-type weight-gradient FLOPs.")
    forward_other = _summed("forward_other", "Nominal FLOPs of the forward's other (memory-bound) work.")
    backward_other = _summed("backward_other", "Nominal FLOPs of the backward's other work.")
    params = _summed("params", "Parameters of the counted modules.")
    activation_bytes = _summed("activation_bytes", "Bytes of every counted output activation.")

    @property
    def total_other(self) -> int:
        return self.forward_other + self.backward_other

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


def meta_copy(model: nn.Module, *, reuse_meta: bool = False) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (shapes, dtypes and ties as
    the model's; nothing allocated), but for the counters and flags a forward reads the value of
    (:func:`~hybridpar.nn.meta.keeps_value`): what counting FLOPs and planning the model at another
    size read of it. ``reuse_meta``: a model already wholly on the meta device is returned as it is
    (a reader that only runs it need not copy it, and a model built under ``with torch.device('meta'):``
    need not be deep-copyable). Whatever ``copy.deepcopy`` raises (a module holding a process group)
    propagates: each caller says what it means for it."""
    if reuse_meta and all(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
        return model
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().clone() if keeps_value(b) else torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


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
        work, geom = registry.lookup(m).work(m, x, y)
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
    try:
        meta = meta_copy(model, reuse_meta=True)
    except Exception as err:  # e.g. a module holding a process group
        raise TypeError(f"cannot copy {type(model).__name__} to the meta device ({err}); build the model "
                        "under `with torch.device('meta'):` and pass that instead") from err
    for mod in meta.modules():  # same FLOPs either way, and training mode refuses a batch of one
        if uses_batch_statistics(mod):
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
        if calls[name] > 1:  # numbered from 1 here (the second call is #2, the plan's #1): only the
            name = call_key(name, calls[name])  # module's path is read back (call_keys.module_path)
        records.append(_layer(name, module, x, y))

    handles = [m.register_forward_hook(hook) for m in chosen]
    try:
        with torch.enable_grad(), OnMeta():
            x = torch.empty(tuple(input_shape), device="meta", dtype=dtype, requires_grad=input_requires_grad)
            meta(x)
    finally:
        for h in handles:
            h.remove()
    if unsupported:
        warnings.warn(f"hybridpar.flops: no FLOP formula for modules with parameters: {unsupported}; "
                      "their work is not counted", stacklevel=2)
    return FlopCount(tuple(input_shape), records, unsupported)
