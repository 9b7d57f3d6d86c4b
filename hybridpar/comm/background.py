"""Run communication beside computation: a helper thread on CPU, a side stream on CUDA.

Why: overlapping the halo exchange with the interior of a convolution needs the exchange to make
progress while the main thread is inside a long compute kernel. On CUDA, kernels and NCCL calls are
asynchronous, so issuing the exchange on a second stream suffices. On CPU, torch kernels release the
GIL, so one helper thread that drives the (blocking) exchange runs while the main thread computes.
One thread per process keeps the exchanges in the order they were started on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

_EXECUTOR: ThreadPoolExecutor | None = None
_STREAMS: dict[int, Any] = {}


def _executor() -> ThreadPoolExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hybridpar-comm")
    return _EXECUTOR


class _StreamFuture:
    """Result of work queued on a side stream; ``result()`` makes the current stream wait for it."""

    def __init__(self, value: Any, event: Any, stream: Any) -> None:
        self._value, self._event, self._stream = value, event, stream

    def result(self) -> Any:
        torch.cuda.current_stream().wait_event(self._event)
        for t in _tensors(self._value):
            t.record_stream(torch.cuda.current_stream())
        return self._value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def start(fn: Callable[..., Any], *args: torch.Tensor, device: torch.device) -> Future | _StreamFuture:
    """Start ``fn(*args)`` beside the caller's work; ``.result()`` returns its value when needed."""
    if device.type == "cuda":
        stream = _STREAMS.setdefault(device.index or 0, torch.cuda.Stream(device=device))
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for t in args:
                t.record_stream(stream)
            value = fn(*args)
            event = torch.cuda.Event()
            event.record(stream)
        return _StreamFuture(value, event, stream)
    return _executor().submit(fn, *args)
