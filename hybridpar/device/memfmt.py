"""Memory formats: keep an activation in the layout it arrived in (``channels_last_3d`` or not).

Why: on GPUs convolutions run fastest on NDHWC (``torch.channels_last_3d``) activations, and a layer
that hands back NCDHW, or packs a halo with ``.contiguous()``, costs a copy of the whole activation
per layer, more than the halo exchange itself. Every buffer a split layer allocates (halo messages,
the extended input, gradients, redistributed pieces) is allocated in the format of the tensor it
comes from, and a tensor is made dense in *its own* format (no copy when it already is).

A 5-D tensor is in ``channels_last_3d`` when its channel stride is smaller than its width stride
(views such as a slab of a batch keep that, although they are dense in neither format); a tensor with
one channel is the same bytes either way and counts as contiguous.
"""

from __future__ import annotations

import torch

CL = torch.channels_last_3d


def memory_format(t: torch.Tensor) -> torch.memory_format:
    """``channels_last_3d`` for a 5-D tensor laid out NDHWC (a view of one too), else contiguous."""
    if t.dim() == 5 and t.shape[1] > 1 and t.stride(1) < t.stride(4):
        return CL
    return torch.contiguous_format


def dense(t: torch.Tensor) -> torch.Tensor:
    """``t`` dense in its own memory format: ``t`` itself when it already is, else one copy."""
    return t.contiguous(memory_format=memory_format(t))


def _fmt(shape, like: torch.Tensor) -> torch.memory_format:
    return memory_format(like) if len(shape) == 5 else torch.contiguous_format


def empty(shape, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` with ``like``'s dtype, device and memory format."""
    return torch.empty(shape, dtype=like.dtype, device=like.device, memory_format=_fmt(shape, like))


def full(shape, value: float, like: torch.Tensor) -> torch.Tensor:
    """``empty(shape, like)`` filled with ``value``."""
    return empty(shape, like).fill_(value)


def zeros(shape, like: torch.Tensor) -> torch.Tensor:
    """``empty(shape, like)`` filled with zeros."""
    return empty(shape, like).zero_()


def as_format(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in ``like``'s memory format (a copy only where they differ: small pieces such as the
    edge copies of a replicate pad, which ``index_select`` returns contiguous)."""
    return t.contiguous(memory_format=_fmt(t.shape, like))


def wire(t: torch.Tensor) -> torch.Tensor:
    """A plainly contiguous view of the dense ``t`` (same storage) for transports that insist on one:
    NDHWC bytes are sent as an (N, D, H, W, C) tensor and land in a receive buffer of the same format."""
    return t.permute(0, 2, 3, 4, 1) if memory_format(t) is CL else t
