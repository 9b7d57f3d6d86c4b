"""Gradient-norm clipping over the whole model, when each pipeline stage holds only its own gradients.

Why: ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` after ``train_step`` on a pipeline
sees only this stage's gradients (the other stages' parameters have none here), so each stage computes
its own norm and clips by its own factor: the weights silently drift from one process's. The whole
model's norm needs one exchange over the pipeline: each stage's norm of its own parameters (counted
once: within a stage, every data and spatial rank holds the same reduced gradient after the step), as
a sum of ``p``-th powers (a maximum for the inf-norm), all-reduced over the pipeline group, so every
rank computes the same norm and the same factor. Without a pipeline it is torch's function.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn


def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, norm_type: float,
                    pipe_group: dist.ProcessGroup | None, pipe: int) -> torch.Tensor:
    """Scale this stage's gradients in place by ``max_norm / (total + 1e-6)`` where that is below 1,
    ``total`` the norm over every stage's gradients; returns ``total`` (torch's ``clip_grad_norm_``
    over the whole model). ``pipe_group``/``pipe``: the pipeline's ranks and their number."""
    unique = list({id(p): p for p in params}.values())  # a module reached twice holds one gradient
    if pipe == 1:
        return torch.nn.utils.clip_grad_norm_(unique, max_norm, norm_type)
    grads = [p.grad for p in unique if p.grad is not None]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cuda" if dist.get_backend(pipe_group) == "nccl"
                                                        else "cpu")
    dtype = torch.float64  # every stage alike (one may hold no gradient), and exact for float64 models
    norms = [torch.linalg.vector_norm(g.detach(), norm_type).to(device, dtype) for g in grads]
    if norm_type == float("inf"):
        local = torch.stack(norms).max() if norms else torch.zeros((), device=device, dtype=dtype)
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=pipe_group)
        total = local
    else:
        local = (torch.stack(norms).pow(norm_type).sum() if norms
                 else torch.zeros((), device=device, dtype=dtype))
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=pipe_group)
        total = local.pow(1.0 / norm_type)
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.detach().mul_(factor.to(g.device, g.dtype))
    return total

