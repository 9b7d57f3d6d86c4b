"""Autocast through split layers: which dtype torch's kernel gives, and where a layer casts.

Why: autocast decides per op *and per device*. On CPU ``conv3d`` computes in bfloat16 while
``max_pool3d``, ``avg_pool3d``, replication padding and the adaptive pools are promoted to float32;
on CUDA the pools keep their input's dtype. A split layer must return what torch returns on the whole
volume, so it asks torch: :func:`result_dtype` runs the layer's own torch op once on a tiny tensor of
the input's device and dtype under the ambient autocast state and remembers the dtype it gave.

Where to cast, relative to the halo exchange: a cast is elementwise, so casting a shard and then
exchanging halos gives bit for bit what casting the whole volume gives. A layer therefore casts
*before* exchanging when its kernel would narrow the input (a convolution under bf16 autocast: half
the halo bytes, and the kernel's own cast then does nothing) and *after* when it would widen it (the
halos travel in the activation's dtype). Layers that run no torch kernel of their own (pads, the
separable interpolation) cast explicitly; the others leave the cast to the kernel.

Backward passes run outside autocast, as torch recommends (:func:`no_autocast`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from hybridpar.device.eager import eager

_PROBES: dict[tuple, torch.dtype] = {}


def autocast_state(device_type: str) -> tuple[bool, torch.dtype | None]:
    """(enabled, dtype) of autocast for ``device_type`` in this thread (off for a device type autocast
    does not know, such as meta)."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return False, None
    except RuntimeError:
        return False, None
    return True, torch.get_autocast_dtype(device_type)


def result_dtype(op: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.dtype:
    """The dtype ``fn`` (a torch op, named ``op`` for the memo) gives for an input like ``x`` under
    the current autocast state: ``x.dtype`` without autocast, else found by running ``fn`` on a
    2x2x2 tensor once per (op, device type, dtype, autocast state)."""
    device = x.device.type
    on, dtype = autocast_state(device)
    if not on or not x.is_floating_point():
        return x.dtype
    key = (op, device, x.dtype, dtype)
    found = _PROBES.get(key)
    return found if found is not None else _probe(key, fn, x.dtype, x.device)


@eager  # once per key, eagerly (a compiled forward finds it memoised)
def _probe(key: tuple, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype,
           device: torch.device) -> torch.dtype:
    with torch.no_grad():
        _PROBES[key] = fn(torch.zeros((1, 1, 2, 2, 2), dtype=dtype, device=device)).dtype
    return _PROBES[key]


def narrowed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` cast to ``dtype`` if that is narrower (before a halo exchange), else ``x``."""
    return x.to(dtype) if dtype.itemsize < x.dtype.itemsize else x


def widened(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``y`` cast to ``dtype`` where they differ (after the exchange: what the kernel would give)."""
    return y if y.dtype == dtype else y.to(dtype)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off for ``device_type`` (backward passes; kernels given explicit dtypes)."""
    if not torch.is_autocast_enabled(device_type):
        return contextlib.nullcontext()
    return torch.autocast(device_type, enabled=False)
