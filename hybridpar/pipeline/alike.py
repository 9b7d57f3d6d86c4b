"""An error one rank meets, raised on every rank: for work whose outcome may differ between ranks.

Why: a pipeline's ranks build different stages. A stage that refuses a layer (a parametrized conv, an
unsupported resampling mode) raised on its own ranks while the other stages went on into the first step
and waited for them until the transport's timeout (two minutes), then failed with a message about a
receive. Wrapped in :func:`raised_alike`, every rank learns after the block whether any failed and
raises the same line: the lowest failing rank's, in its error's type where that is one of ours or
Python's usual ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridpar.comm.flags import any_rank
from hybridpar.planner.graph import UntraceableError
from hybridpar.planner.terms import SpecError

_KINDS: tuple[type[Exception], ...] = (UntraceableError, SpecError, NotImplementedError, ValueError,
                                       TypeError, KeyError, RuntimeError)
_BYTES = 4096  # of a line told to the other ranks (a longer one is cut)


@contextlib.contextmanager
def raised_alike() -> Iterator[None]:
    """Run the block; if it raises on any rank of the job, raise on every rank after it (one all-reduce
    of a flag over the job, on the CPU side of the group; where one failed, one all-gather of the
    lines). The failing rank raises its own error (its traceback kept)."""
    error: Exception | None = None
    try:
        yield
    except Exception as err:  # every kind: the other ranks must not wait for a collective
        error = err
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    if not any_rank(error is not None):
        return
    mine = torch.zeros(_BYTES + 1, dtype=torch.uint8)
    if error is not None:
        kind = next((i for i, k in enumerate(_KINDS) if isinstance(error, k)), len(_KINDS) - 1)
        text = str(error.args[0] if isinstance(error, KeyError) and error.args else error).encode()[:_BYTES]
        mine[0] = kind + 1
        mine[1:1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if error is not None:
        raise error
    first = next(t for t in every if t[0] > 0)
    line = bytes(first[1:].tolist()).rstrip(b"\0").decode(errors="replace")
    raise _KINDS[int(first[0]) - 1](line)
