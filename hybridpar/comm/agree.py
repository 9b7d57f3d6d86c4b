"""One starting point: every rank's copy of a model's parameters and buffers made equal, or checked equal.

Why: a split layer holds whole weights on every rank of its spatial group, and a data-parallel replica
holds them all again; the gradients are summed over those ranks on the assumption that every copy is
the same tensor. A rank that seeded itself apart (common before DDP) or loaded another file breaks that
assumption without a word: the shards of one volume are convolved with different kernels and replicas
never agree. :func:`broadcast_state` makes the copies equal from one rank, as DDP does at construction
(``hybridpar.parallelize`` calls it); :func:`check_agree` lets a split layer built directly find out on
its first forward, one small collective, and refuse in one line rather than train on mixed weights.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parameter import is_lazy

BUCKET_BYTES = 32 << 20  # broadcast in buckets of this size: one message per bucket, bounded extra memory


def _state_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The module's parameters and buffers, each tensor once (a tensor registered twice is one), meta
    and lazy tensors (no data yet) left out."""
    seen: set[int] = set()
    out = []
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen and t.device.type != "meta" and not is_lazy(t):
            seen.add(id(t))
            out.append(t)
    return out


@torch.no_grad()
def broadcast_state(module: nn.Module, src: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every rank's parameters and buffers of ``module`` with those of global rank ``src``.

    Tensors are packed by device and dtype into buckets of :data:`BUCKET_BYTES` (one collective per
    bucket, not per tensor), then copied back in place, so optimizers and views holding them see the
    new values.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in _state_tensors(module):
        by_kind.setdefault((t.device, t.dtype), []).append(t)
    for tensors in by_kind.values():
        for bucket in _buckets(tensors):
            flat = torch.cat([t.detach().reshape(-1) for t in bucket])
            dist.broadcast(flat, src, group=group)
            offset = 0
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n


def _buckets(tensors: list[torch.Tensor]) -> Iterable[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        if bucket and size + t.numel() * t.element_size() > BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def _fingerprint(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Two float64 numbers per tensor: its sum and a position-weighted sum (a permutation or a sign
    flip changes the second). Copies that are bit-identical give bit-identical numbers."""
    parts = []
    for t in tensors:
        v = (torch.view_as_real(t.detach()) if t.is_complex() else t.detach()).reshape(-1).double()
        weight = torch.arange(v.numel(), device=v.device, dtype=torch.float64).remainder_(7).add_(1)
        parts.append(torch.stack([v.sum(), (v * weight).sum()]))
    return torch.stack(parts).reshape(-1)


@torch.no_grad()
def check_agree(module: nn.Module, group: dist.ProcessGroup, who: str) -> bool:
    """Refuse, alike on every rank of ``group``, if their copies of ``module``'s parameters and buffers
    differ; ``who`` names the layer in the message.

    One all-reduce of two numbers per tensor (their maximum and negated minimum over the ranks) and one
    read of its result on the host: meant for a layer's first forward, not every step. Returns whether
    it checked: not while the tensors are on the meta device (a planning run), which holds no values.
    """
    if dist.get_world_size(group) == 1:
        return True
    if any(t.device.type == "meta" for t in [*module.parameters(), *module.buffers()]):
        return False
    tensors = _state_tensors(module)
    if not tensors:
        return True
    fp = _fingerprint(tensors)
    both = torch.cat([fp, -fp])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    hi, neg_lo = both.chunk(2)
    differ = (hi != -neg_lo).reshape(-1, 2).any(dim=1).cpu()
    if bool(differ.any()):
        names = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
        which = [names.get(id(t), "?") for t, d in zip(tensors, differ.tolist()) if d]
        ranks = dist.get_world_size(group)
        raise ValueError(f"{who}: its {', '.join(which)} differ between the {ranks} ranks that share it "
                         f"(each rank seeded or loaded its own weights); build it from one "
                         f"seed on every rank, or load the same state everywhere (hybridpar.parallelize "
                         f"broadcasts the first rank's)")
    return True
