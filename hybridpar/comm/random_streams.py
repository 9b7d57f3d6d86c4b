"""The random streams of the ranks that hold one sample between them, made to agree before each step.

Why: the shards of a split volume are parts of one sample, and what a forward draws for that sample must
be one draw: a dropout's mask of the whole volume (each rank keeps its box), a ``Dropout3d``'s mask per
channel (alike on every shard), the latent sample a VAE draws from its replicated mean. Each rank draws
them from torch's default generators, so the draws agree only where the generators do. A script that
seeds each rank apart (``torch.manual_seed(seed + rank)``, usual for augmentation under DDP) would have
each shard drop other channels and each rank decode another latent: a sample no one process computes,
with nothing said. Before each step the ranks of a split compare their generators (one all-reduce of two
integers, CPU tensors: the gloo side of the group, no device synchronisation) and, where they differ,
all take the first rank's state, the stream one process running that rank's script would draw from.
Data-parallel replicas keep their own streams, as under DDP.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist


def _states(device: torch.device) -> list[torch.Tensor]:
    """The states (CPU byte tensors) of the generators a forward on ``device`` draws from."""
    states = [torch.get_rng_state()]
    if device.type == "cuda":
        states.append(torch.cuda.get_rng_state(device))
    return states


def agree(group: dist.ProcessGroup | None, device: torch.device) -> bool:
    """Make the default generators of ``group``'s ranks (the ranks of one split) those of its first
    rank where any differs; whether they differed. Every rank of ``group`` calls it."""
    if group is None or dist.get_world_size(group) == 1:
        return False
    states = _states(device)
    digest = 0
    for s in states:
        digest = zlib.crc32(s.numpy().tobytes(), digest)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    if int(extremes[0]) == digest == -int(extremes[1]):  # the greatest and the least: all alike
        return False
    first = dist.get_global_rank(group, 0)
    for s in states:
        dist.broadcast(s, src=first, group=group)
    torch.set_rng_state(states[0])
    if device.type == "cuda":
        torch.cuda.set_rng_state(states[1], device)
    return True
