"""Marking work: the :class:`range` every part of the engine wraps its work in, and what reads it live.

Why apart from the timer: a range is entered millions of times per run and must cost next to nothing
when nobody listens; it emits NVTX, charges the active :class:`~hybridpar.profiling.timer.StepTimer` of
its thread (found through :func:`current_timer`), and, inside :func:`trace`, a torch.profiler annotation.
It also tags an exception that leaves it, so :func:`where` can say where an error came from. The
``nvtx`` package is optional: without it (a GPU image has its own Python and no registry) a range
emits no NVTX marker and does everything else.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

try:
    import nvtx
except ImportError:  # a GPU image without the wheel and no registry to fetch it: the ranges still time
    nvtx = None  # and trace; only Nsight's markers are missing

CATEGORIES: tuple[str, ...] = ("compute", "halo", "pipeline", "bubble", "grad_reduce", "data_wait",
                               "checkpoint")
_CATEGORY_SET = frozenset(CATEGORIES)
_COLORS = {"compute": "green", "halo": "orange", "pipeline": "blue", "bubble": "grey",
           "grad_reduce": "red", "data_wait": "yellow", "checkpoint": "purple", None: "white"}
_DOMAIN = nvtx.get_domain("hybridpar") if nvtx is not None else None
# a dummy domain: no tool listens (decided at start); no domain: no nvtx package
_NVTX_ON = _DOMAIN is not None and type(_DOMAIN).__name__ != "DummyDomain"
_ATTRIBUTES: dict[tuple[str, str | None], Any] = {}


class PendingStep:
    """A step being timed, or finished with timestamps that may still be CUDA events that have not
    completed. The ranges inside it append to ``marks`` (stamp, the category in force from then) and
    ``ranges`` (name, category, start stamp, end stamp); the timer resolves them into seconds."""

    __slots__ = ("step", "wall", "start", "end", "marks", "ranges")

    def __init__(self, step: int, wall: float, start: Any) -> None:
        self.step, self.wall, self.start, self.end = step, wall, start, None
        self.marks: list[tuple[Any, str | None]] = [(start, None)]
        self.ranges: list[tuple[str, str | None, Any, Any]] = []


class StepClock(Protocol):
    """What a range reads of the timer it charges (:class:`~hybridpar.profiling.timer.StepTimer`).

    Why a protocol: the timer makes itself the current one through :func:`set_current_timer`, so it
    depends on this module; the ranges depend only on these few members, not on the timer's module.
    """

    running: PendingStep | None
    """The step being timed, which the ranges inside it charge."""
    record_ranges: bool
    """Whether each range is kept (for the JSON-lines log), not only the categories' time."""
    now: Callable[[], Any]
    """The timer's clock: seconds, or a recorded CUDA event."""


class _ThreadState(threading.local):
    """Per-thread state with defaults, so that reads never take the (slow) missing-attribute path."""

    def __init__(self) -> None:
        self.timer: StepClock | None = None
        self.stack: list[tuple] = []  # (range, timer, pending step, start stamp, trace annotation)


_local = _ThreadState()
_tracing = 0  # how many trace() contexts are open: ranges then also emit torch.profiler annotations


def _attributes(name: str, category: str | None) -> Any:
    """NVTX event attributes, built once per (name, category): registration is the slow part."""
    key = (name, category)
    attrs = _ATTRIBUTES.get(key)
    if attrs is None:
        attrs = _DOMAIN.get_event_attributes(message=name, color=_COLORS[category])
        _ATTRIBUTES[key] = attrs
    return attrs


def tag_error(err: object, key: str, value: object) -> None:
    """Attach ``hybridpar_<what>`` to an exception on its way out, for :func:`where`."""
    try:
        setattr(err, key, value)
    except AttributeError:  # an exception type without a __dict__
        pass


def where(err: BaseException) -> str:
    """Where ``err`` was raised, as far as the ranges it left say: ``"in halo_exchange, step 5"`` (or "").

    Why: an error from deep inside a collective (a gloo timeout) names neither the operation nor the
    step; the range it passed through on its way out, and the timed step, do.
    """
    parts = []
    if getattr(err, "hybridpar_range", None):
        parts.append(f"in {err.hybridpar_range}")  # type: ignore[attr-defined]
    if getattr(err, "hybridpar_step", None) is not None:
        parts.append(f"step {err.hybridpar_step}")  # type: ignore[attr-defined]
    return ", ".join(parts)


def current_timer() -> StepClock | None:
    """The timer whose step is running in this thread, if any."""
    return _local.timer


def set_current_timer(timer: StepClock | None) -> StepClock | None:
    """Make ``timer`` the one the ranges of this thread charge; returns the one it replaces."""
    previous, _local.timer = _local.timer, timer
    return previous


def tracing() -> bool:
    """Whether a :func:`trace` is open (then steps and ranges also annotate the torch.profiler trace)."""
    return _tracing > 0


class range:  # named like the builtin on purpose: ``with profiling.range("conv1"):``
    """Mark a region: an NVTX range, time for the active :class:`StepTimer`, a chrome-trace annotation.

    Use as ``with range("conv1", "compute"):`` or as a decorator ``@range("all_reduce", "grad_reduce")``.
    ``category`` is one of :data:`CATEGORIES` or None (inherit the enclosing range's category).
    """

    __slots__ = ("name", "category")

    def __init__(self, name: str, category: str | None = None) -> None:
        if category is not None and category not in _CATEGORY_SET:
            raise ValueError(f"unknown profiling category {category!r}; use one of {', '.join(CATEGORIES)}")
        self.name = name
        self.category = category

    def __enter__(self) -> range:
        if _NVTX_ON:
            _DOMAIN.push_range(_attributes(self.name, self.category))
        annotation = None
        if _tracing:
            label = f"{self.category}/{self.name}" if self.category else self.name
            annotation = torch.autograd.profiler.record_function(label)
            annotation.__enter__()
        timer = _local.timer
        if timer is None:
            _local.stack.append((self, None, None, None, None, annotation))
            return self
        pending = timer.running
        category = self.category
        if category is None and not timer.record_ranges:  # nothing to charge or log: no clock read
            _local.stack.append((self, timer, pending, None, None, annotation))
            return self
        now = timer.now()
        parent = pending.marks[-1][1]  # the category in force until now
        if category is not None:
            pending.marks.append((now, category))
        _local.stack.append((self, timer, pending, now, parent, annotation))
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[1] is not None and not hasattr(exc[1], "hybridpar_range"):
            tag_error(exc[1], "hybridpar_range", self.name)  # the innermost range an error left
        stack = _local.stack
        frame = stack.pop()
        while frame[0] is not self and stack:  # a range left open by an exception: close it too
            frame = stack.pop()
        _, timer, pending, start, parent, annotation = frame
        if start is not None and timer.running is pending:  # the same step is still running
            now = timer.now()
            if self.category is not None:
                pending.marks.append((now, parent))
            if timer.record_ranges:
                pending.ranges.append((self.name, self.category, start, now))
        if annotation is not None:
            annotation.__exit__(None, None, None)
        if _NVTX_ON:
            _DOMAIN.pop_range()

    def __call__(self, fn: Callable) -> Callable:
        name, category = self.name, self.category

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with range(name, category):
                return fn(*args, **kwargs)

        return wrapper


def default_rank() -> int:
    """This process's rank: the process group's, else the launcher's ``RANK``, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def trace(path: str | os.PathLike, *, rank: int | None = None, activities: list | None = None,
          **profiler_kwargs: Any) -> Iterator[torch.profiler.profile]:
    """Run torch.profiler inside the block and export a chrome trace on exit.

    ``path`` is a ``.json`` file, or a directory that receives ``rank{rank}.trace.json`` (the layout
    ``python -m hybridpar.profiling.timeline`` reads). While it runs, :class:`range` and :class:`StepTimer`
    also emit ``record_function`` annotations (``category/name``, ``hybridpar.step#N``), so the trace
    alone is enough for the timeline's breakdown. Extra keyword arguments go to
    ``torch.profiler.profile`` (``schedule``, ``record_shapes``, ``with_stack``...).
    """
    global _tracing
    rank = default_rank() if rank is None else rank
    target = Path(path)
    if target.suffix != ".json":
        target.mkdir(parents=True, exist_ok=True)
        target = target / f"rank{rank}.trace.json"
    if activities is None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
    _tracing += 1
    try:
        with torch.profiler.profile(activities=activities, **profiler_kwargs) as prof:
            yield prof
    finally:
        _tracing -= 1
    prof.export_chrome_trace(str(target))
