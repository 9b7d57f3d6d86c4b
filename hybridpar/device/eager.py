"""``torch.compiler.disable``, applied on first call instead of at import.

Why: communication (halo exchanges, reductions, redistributions) must run eagerly under
``torch.compile``, so its functions are compiler-disabled and a compiled model breaks its graph only
there. But ``torch.compiler.disable`` imports torch's whole compiler stack (dynamo, sympy), which
costs every process about a second and 70 MB at import, also the many that never compile (CPU ranks,
data workers, restarts after a fault). :func:`eager` marks a function the same way, lazily: called
while nothing has imported dynamo, it is the plain function; once dynamo is there (a model is being
compiled) or while dynamo traces it, the call goes through ``torch.compiler.disable(fn)``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    """``fn``, run eagerly (outside any compiled graph) under ``torch.compile``."""
    disabled: list[Callable] = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not disabled:
            if not torch.compiler.is_compiling() and "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    return call  # type: ignore[return-value]
