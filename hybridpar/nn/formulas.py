"""What one call of a torch layer costs: its FLOPs, the window geometry that splits them, and the bytes
it keeps for backward.

Why apart from the registry: these formulas are layer facts that the FLOP counter, the performance
model and the memory estimate read through the registry's entries; the registry itself only says which
fact belongs to which layer type. Conventions (what ``forward``, ``input_grad``, ``weight_grad`` and the
``*_other`` counts mean) are :mod:`hybridpar.flops`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from hybridpar.geometry import ntuple
from hybridpar.nn import families
from hybridpar.nn.window import Windows

NORM_FLOPS = 4  # nominal per element and direction: statistics, normalise, scale, shift

Work = dict[str, int]


@dataclass(frozen=True)
class LayerGeometry:
    """How one call's work splits per rank: its kind and, for a window layer, its window per spatial
    dim (the registry entry's :class:`~hybridpar.nn.window.Window` records, kept with the FLOP record)."""

    kind: str  # "conv", "conv_transposed", "window" (pooling), "pointwise", "adaptive"
    windows: Windows = ()

    @property
    def kernel(self) -> tuple[int, ...]:
        """The kernel per spatial dim (empty without a window)."""
        return tuple(w.kernel for w in self.windows)

    @property
    def ceil_mode(self) -> bool:
        """Whether a window rounds its output extent up (pooling's ``ceil_mode``)."""
        return any(w.ceil_mode for w in self.windows)


# ---------------------------------------------------------------------- FLOP formulas (see hybridpar.flops)
def conv_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    """Multiply-adds of a (transposed) convolution; its geometry is its registry entry's window."""
    n = len(m.kernel_size)
    batch = math.prod(x.shape[:-(n + 1)])
    spatial = x.shape[-n:] if m.transposed else y.shape[-n:]
    fwd = 2 * batch * math.prod(spatial) * math.prod(m.weight.shape)
    bias = m.bias is not None
    work = {"forward": fwd, "input_grad": fwd if x.requires_grad else 0,
            "weight_grad": fwd if m.weight.requires_grad else 0,
            "forward_other": y.numel() if bias else 0,
            "backward_other": y.numel() if bias and m.bias.requires_grad else 0}
    return work, None


def linear_flops(m: nn.Linear, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    fwd = 2 * (x.numel() // m.in_features) * m.in_features * m.out_features
    bias = m.bias is not None
    return {"forward": fwd, "input_grad": fwd if x.requires_grad else 0,
            "weight_grad": fwd if m.weight.requires_grad else 0,
            "forward_other": y.numel() if bias else 0,
            "backward_other": y.numel() if bias and m.bias.requires_grad else 0}, None


_POOL_DIMS = {"1d": 1, "2d": 2, "3d": 3}  # by class name suffix: unbatched inputs lack the N dim


def pool_dims(m: nn.Module) -> int:
    """Spatial dims of a pooling module, from its class name (``MaxPool2d``: 2; otherwise 3)."""
    return _POOL_DIMS.get(type(m).__name__[-2:].lower(), 3)


def pool_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    """Window taps of a pooling layer; its geometry is its registry entry's window."""
    taps = math.prod(ntuple(m.kernel_size, pool_dims(m)))
    is_max = isinstance(m, families.MAX_POOL_ND)
    back = (x.numel() if is_max else y.numel() * taps) if x.requires_grad else 0
    return {"forward_other": y.numel() * taps, "backward_other": back}, None


def _spatial(kind: str, x: torch.Tensor) -> LayerGeometry | None:
    return LayerGeometry(kind) if x.dim() > 2 else None  # (N, C) tensors have no spatial dims to split


def per_input_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    """One nominal FLOP per input element each way (adaptive pooling)."""
    return {"forward_other": x.numel(), "backward_other": x.numel() if x.requires_grad else 0}, \
        _spatial("adaptive", x)


def norm_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    trainable = any(p.requires_grad for p in m.parameters())
    back = NORM_FLOPS * x.numel() if (x.requires_grad or trainable) else 0
    return {"forward_other": NORM_FLOPS * x.numel(), "backward_other": back}, _spatial("pointwise", x)


def elementwise_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    """One nominal FLOP per output element each way (activations; dropout while training)."""
    if isinstance(m, families.DROPOUT_ND) and not m.training:
        return {}, _spatial("pointwise", x)
    trainable = any(p.requires_grad for p in m.parameters())
    back = y.numel() if (x.requires_grad or trainable) else 0
    return {"forward_other": y.numel(), "backward_other": back}, _spatial("pointwise", x)


def no_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    return {}, None


def no_flops_pointwise(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    return {}, _spatial("pointwise", x)


def resample_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    """Interpolation: nominal FLOPs per output element, ``2**dims`` taps for (tri)linear, 1 for nearest."""
    taps = 1 if getattr(m, "mode", "nearest").startswith("nearest") else 2 ** max(x.dim() - 2, 1)
    back = y.numel() * taps if x.requires_grad else 0
    return {"forward_other": y.numel() * taps, "backward_other": back}, _spatial("adaptive", x)


# ---------------------------------------------------------------------- saved-for-backward estimates
def saved_window(m: nn.Module, elem: int, out_n: int, ext_n: int) -> int:
    """A conv keeps its (extended) input and passes its output on; pooling its output, and max
    pooling its indices (int64)."""
    indices = 8 * out_n if isinstance(m, families.MAX_POOL_ND) else 0
    return elem * ext_n + elem * out_n + indices
