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

    # A code object of its own per marked function: dynamo caches compiled frames per code object, so
    # one shared ``call`` would be re-specialised for every marked function until its recompile limit.
    call.__code__ = call.__code__.replace(co_name=f"eager_{fn.__name__}")
    return call  # type: ignore[return-value]


def first_call_eager(eager_fn: F, compiled_fn: F) -> F:
    """``eager_fn`` on the first call, ``compiled_fn`` on every later one.

    Why: a model's first call builds what it memoises (halo plans, communicators); under the tracer
    that building is a graph break and each layer's lookup a frame specialised on its own shapes. Run
    once eagerly, the compiled function finds everything made and traces the layers as one graph.
    """
    calls = [0]

    @functools.wraps(eager_fn)
    def run(*args, **kwargs):
        if calls[0] == 0:
            calls[0] = 1
            return eager_fn(*args, **kwargs)
        return compiled_fn(*args, **kwargs)

    return run  # type: ignore[return-value]
