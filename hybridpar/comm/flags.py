"""Whether any rank found something: the one small collective before ranks raise alike.

Why one place: a refusal one rank meets must stop every rank, or the others wait in the next collective
until the transport's timeout. Each such check tells the others with one all-reduce of a flag, on the CPU
side of the group (no device synchronisation), and exchanges its words only where a flag is up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def any_rank(found: bool, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``found`` holds on any rank of ``group`` (the job's by default); every rank calls it."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return found
    flag = torch.tensor([int(found)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag[0])
