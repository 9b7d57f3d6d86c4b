"""``torch.autograd.Function.apply``, offered first to what watches a forward on this thread.

Why: a Function of the user's own (a straight-through estimator, a gradient scaled or reversed, a
backward that normalises by the gradient's norm) is the one call a ``TorchFunctionMode`` does not see:
``apply`` does not dispatch through ``__torch_function__``, only the operations inside its forward do.
Its backward then runs later, on whatever the forward handed it. A trace must refuse it (fx would keep
the derivative of its forward, not its backward: :mod:`hybridpar.planner.trace_state`), and a forward
run by module swapping must run it on the gathered volume (its backward on a shard's gradient would
reduce over the shard: :class:`hybridpar.planner.layout_watch.LayoutWatch`). Both watch ``apply`` through
this one wrapper, installed while any of them is open on any thread and put back after; each offer
goes to the watchers of the applying thread, innermost first.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

PASS = object()
"""What a watcher returns to let the Function be applied as it would be without it."""

Watcher = Callable[[type, Callable[..., Any], tuple, dict], Any]
"""``watcher(cls, apply, args, kwargs)``: the result of the application, or :data:`PASS`; ``apply(*args,
**kwargs)`` applies ``cls`` unwatched."""

_local = threading.local()  # .watchers: this thread's, innermost last
_lock = threading.Lock()
_open = 0  # watchers open on any thread: ``apply`` is wrapped while there are some
_original: list[Any] = []  # the classmethod put back when the last closes


def _applying(original: classmethod) -> classmethod:
    def apply(cls: type, *args: Any, **kwargs: Any) -> Any:
        watchers = getattr(_local, "watchers", None)
        if watchers and not cls.__module__.startswith("hybridpar."):  # a halo exchange: the layers'
            unwatched = lambda *a, **k: original.__func__(cls, *a, **k)  # noqa: E731
            for watcher in reversed(watchers):
                out = watcher(cls, unwatched, args, kwargs)
                if out is not PASS:
                    return out
        return original.__func__(cls, *args, **kwargs)

    return classmethod(apply)


@contextlib.contextmanager
def watching(watcher: Watcher) -> Iterator[None]:
    """Offer every Function applied on this thread, but this package's own, to ``watcher`` while open."""
    global _open
    with _lock:
        if _open == 0:
            _original[:] = [torch.autograd.Function.__dict__["apply"]]
            torch.autograd.Function.apply = _applying(_original[0])
        _open += 1
    if not hasattr(_local, "watchers"):
        _local.watchers = []
    _local.watchers.append(watcher)
    try:
        yield
    finally:
        _local.watchers.remove(watcher)
        with _lock:
            _open -= 1
            if _open == 0:
                torch.autograd.Function.apply = _original.pop()
