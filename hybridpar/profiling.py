"""Where the time of a training step goes: NVTX ranges, light per-category timers and chrome traces.

Why a module of its own: every part of the engine (layers, halo exchange, pipeline schedule, gradient
reduction, data loader, checkpointer) marks its work with the same :class:`range`, and three consumers
read those marks: Nsight Systems (through NVTX, the ``nvtx`` package: ~0.1 us a range when no tool
listens, and unlike ``torch.cuda.nvtx`` it works on CPU-only builds), the per-step breakdown of a
:class:`StepTimer` (cheap enough to leave on), and torch.profiler chrome traces (:func:`trace`, on
request). ``python -m hybridpar.timeline`` merges the per-rank outputs.

Accounting rules
----------------
* A range has a name and optionally one of :data:`CATEGORIES`. Time goes to the **innermost**
  category: entering ``halo`` inside ``compute`` pauses ``compute``; nothing is counted twice. A
  range without a category (e.g. one per layer) inherits the enclosing one.
* ``other`` is the step time not inside any categorised range, so a breakdown always sums to the
  step time.
* A timer is active in the thread that runs its step only; ranges on other threads (an async
  checkpoint writer) emit NVTX but are not timed, since their time overlaps the step's.
* Clocks: ``"cpu"`` reads ``time.perf_counter`` (host time: on a GPU it measures launches unless the
  code synchronises or ``sync=True``); ``"cuda"`` records a ``torch.cuda.Event`` at each category change
  and reads the device stream's timeline when the step is resolved: without ``sync`` that happens
  at a later step, when the events have completed (``poll``), or when :meth:`StepTimer.breakdown` is
  asked, which waits. ``"auto"`` picks ``"cuda"`` when CUDA is initialised.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nvtx
import torch

__all__ = ["CATEGORIES", "StepRecord", "StepTimer", "range", "trace", "current_timer", "where"]

CATEGORIES: tuple[str, ...] = ("compute", "halo", "pipeline", "bubble", "grad_reduce", "data_wait",
                               "checkpoint")
_CATEGORY_SET = frozenset(CATEGORIES)
_COLORS = {"compute": "green", "halo": "orange", "pipeline": "blue", "bubble": "grey",
           "grad_reduce": "red", "data_wait": "yellow", "checkpoint": "purple", None: "white"}
_DOMAIN = nvtx.get_domain("hybridpar")
_NVTX_ON = type(_DOMAIN).__name__ != "DummyDomain"  # a dummy domain: no tool listens (decided at start)
_ATTRIBUTES: dict[tuple[str, str | None], Any] = {}


class _ThreadState(threading.local):
    """Per-thread state with defaults, so that reads never take the (slow) missing-attribute path."""

    def __init__(self) -> None:
        self.timer: StepTimer | None = None
        self.stack: list[tuple] = []  # (range, timer, pending step, start stamp, trace annotation)


_local = _ThreadState()
_tracing = 0  # how many trace() contexts are open: ranges then also emit torch.profiler annotations
_irange = builtins.range


def _attributes(name: str, category: str | None) -> Any:
    """NVTX event attributes, built once per (name, category): registration is the slow part."""
    key = (name, category)
    attrs = _ATTRIBUTES.get(key)
    if attrs is None:
        attrs = _DOMAIN.get_event_attributes(message=name, color=_COLORS[category])
        _ATTRIBUTES[key] = attrs
    return attrs


def _tag(err: object, key: str, value: object) -> None:
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


def current_timer() -> StepTimer | None:
    """The timer whose step is running in this thread, if any."""
    return _local.timer


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
        pending = timer._current
        category = self.category
        if category is None and not timer.record_ranges:  # nothing to charge or log: no clock read
            _local.stack.append((self, timer, pending, None, None, annotation))
            return self
        now = timer._now()
        parent = pending.marks[-1][1]  # the category in force until now
        if category is not None:
            pending.marks.append((now, category))
        _local.stack.append((self, timer, pending, now, parent, annotation))
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[1] is not None and not hasattr(exc[1], "hybridpar_range"):
            _tag(exc[1], "hybridpar_range", self.name)  # the innermost range an error left
        stack = _local.stack
        frame = stack.pop()
        while frame[0] is not self and stack:  # a range left open by an exception: close it too
            frame = stack.pop()
        _, timer, pending, start, parent, annotation = frame
        if start is not None and timer._current is pending:  # the same step is still running
            now = timer._now()
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


@dataclass
class StepRecord:
    """One resolved step: when it started (epoch seconds), how long it took, and where the time went."""

    step: int
    rank: int
    start: float
    duration: float
    breakdown: dict[str, float]
    ranges: list[tuple[str, str | None, float, float]] = field(default_factory=list, repr=False)
    """(name, category, start, end) of each range, in seconds since the step started."""


class _Pending:
    """A finished step whose timestamps may still be CUDA events that have not completed."""

    __slots__ = ("step", "wall", "start", "end", "marks", "ranges")

    def __init__(self, step: int, wall: float, start: Any) -> None:
        self.step, self.wall, self.start, self.end = step, wall, start, None
        self.marks: list[tuple[Any, str | None]] = [(start, None)]
        self.ranges: list[tuple[str, str | None, Any, Any]] = []


class StepTimer:
    """Per-step time breakdown by category, optionally logged as JSON lines for the timeline tool.

    ``with timer.step(i): ...`` times one step; ranges inside it charge their categories.
    :meth:`breakdown` returns ``{category: seconds, ..., "other": seconds}`` summing to the step
    time. ``log`` is a ``.jsonl`` file, or a directory that receives ``rank{rank}.jsonl``: one line
    per range ``{"kind": "range", "rank", "step", "name", "cat", "ts", "dur"}`` and one per step
    ``{"kind": "step", "rank", "step", "ts", "dur", "breakdown"}`` (epoch seconds).
    """

    def __init__(self, *, clock: str | Callable[[], float] = "auto", sync: bool = False,
                 log: str | os.PathLike | None = None, rank: int | None = None, history: int = 10_000,
                 record_ranges: bool = True) -> None:
        now: Callable[[], Any] = clock if callable(clock) else time.perf_counter
        if callable(clock):  # any monotonic seconds counter (tests use a fake one)
            clock = "cpu"
        elif clock == "auto":
            clock = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
        if clock not in ("cpu", "cuda"):
            raise ValueError(f"clock must be 'auto', 'cpu', 'cuda' or a callable, not {clock!r}")
        self.clock = clock
        self._now = self._cuda_now if clock == "cuda" else now
        self.sync = sync
        self.rank = _default_rank() if rank is None else rank
        self.record_ranges = record_ranges
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._current: _Pending | None = None
        self._active = False
        self._previous: StepTimer | None = None
        self._next_step = 0
        self._annotation: Any = None
        self._log = None
        if log is not None:
            path = Path(log)
            if path.suffix != ".jsonl":
                path.mkdir(parents=True, exist_ok=True)
                path = path / f"rank{self.rank}.jsonl"
            self.log_path: Path | None = path
            self._log = open(path, "a", buffering=1 << 16)  # closed by close()
        else:
            self.log_path = None

    # -- clock ---------------------------------------------------------------------------------------
    @staticmethod
    def _cuda_now() -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _seconds(self, pending: _Pending, stamp: Any) -> float:
        if self.clock == "cpu":
            return stamp - pending.start
        return pending.start.elapsed_time(stamp) / 1e3

    # -- steps --------------------------------------------------------------------------------------
    def start(self, step: int | None = None) -> None:
        """Begin timing a step (``step`` defaults to one more than the last)."""
        if self._active:
            raise RuntimeError("StepTimer.start: a step is already running; call stop() first")
        self.poll()
        step = self._next_step if step is None else step
        self._next_step = step + 1
        if self.sync:
            _synchronize()
        if _tracing:
            self._annotation = torch.autograd.profiler.record_function(f"hybridpar.step#{step}")
            self._annotation.__enter__()
        self._current = _Pending(step, time.time(), self._now())
        self._previous, _local.timer = _local.timer, self
        self._active = True

    def stop(self) -> StepRecord | None:
        """End the step; returns its record when it can be resolved now (CPU clock or ``sync``)."""
        if not self._active:
            raise RuntimeError("StepTimer.stop: no step is running")
        pending = self._current
        pending.end = self._now()
        self._active = False
        _local.timer, self._previous = self._previous, None
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        self._current = None
        self._pending.append(pending)
        if self.clock == "cpu" or self.sync:
            if self.sync:
                _synchronize()
            self.poll()
            return self.records[-1] if self.records and self.records[-1].step == pending.step else None
        return None

    @contextlib.contextmanager
    def step(self, step: int | None = None) -> Iterator[StepTimer]:
        """Time one step: ``with timer.step(i):``."""
        self.start(step)
        try:
            yield self
        except BaseException as err:
            _tag(err, "hybridpar_step", step)
            raise
        finally:
            self.stop()

    def poll(self, block: bool = False) -> None:
        """Resolve finished steps whose clocks can be read (all of them if ``block``, waiting on CUDA)."""
        while self._pending:
            pending = self._pending[0]
            if self.clock == "cuda" and not block and not pending.end.query():
                return
            self._pending.popleft()
            self._resolve(pending)

    def _resolve(self, pending: _Pending) -> None:
        if self.clock == "cuda":  # events recorded on other streams may finish after the last one
            for event in (pending.end, *(m[0] for m in pending.marks),
                          *(e for r in pending.ranges for e in r[2:])):
                event.synchronize()
        duration = self._seconds(pending, pending.end)
        totals = dict.fromkeys(CATEGORIES, 0.0)
        totals["other"] = 0.0
        marks = pending.marks
        for i in _irange(len(marks)):
            t0 = self._seconds(pending, marks[i][0])
            t1 = self._seconds(pending, marks[i + 1][0]) if i + 1 < len(marks) else duration
            totals[marks[i][1] or "other"] += max(t1 - t0, 0.0)
        ranges = [(name, cat, self._seconds(pending, a), self._seconds(pending, b))
                  for name, cat, a, b in pending.ranges]
        record = StepRecord(pending.step, self.rank, pending.wall, duration, totals, ranges)
        self.records.append(record)
        if self._log is not None:
            self._write(record)

    def _write(self, record: StepRecord) -> None:
        lines = [json.dumps({"kind": "range", "rank": record.rank, "step": record.step, "name": name,
                             "cat": cat, "ts": record.start + a, "dur": b - a})
                 for name, cat, a, b in record.ranges]
        lines.append(json.dumps({"kind": "step", "rank": record.rank, "step": record.step, "ts": record.start,
                                 "dur": record.duration, "breakdown": record.breakdown}))
        self._log.write("\n".join(lines) + "\n")

    # -- results -----------------------------------------------------------------------------------
    def breakdown(self, step: int | None = None) -> dict[str, float]:
        """Seconds per category and ``other`` for ``step`` (default: the last finished one); may wait."""
        self.poll(block=True)
        if not self.records:
            raise LookupError("StepTimer.breakdown: no step has finished yet")
        if step is None:
            return dict(self.records[-1].breakdown)
        for record in reversed(self.records):
            if record.step == step:
                return dict(record.breakdown)
        raise LookupError(f"StepTimer.breakdown: step {step} is not in the last {len(self.records)} steps")

    @property
    def last(self) -> StepRecord | None:
        """The latest resolved step, without waiting."""
        self.poll()
        return self.records[-1] if self.records else None

    def summary(self, skip: int = 0) -> dict[str, float]:
        """Mean seconds per category (and ``step``) over the recorded steps after the first ``skip``."""
        self.poll(block=True)
        chosen = list(self.records)[skip:]
        out = dict.fromkeys((*CATEGORIES, "other", "step"), 0.0)
        for record in chosen:
            for key, value in record.breakdown.items():
                out[key] += value
            out["step"] += record.duration
        return {key: value / len(chosen) for key, value in out.items()} if chosen else out

    def close(self) -> None:
        """Resolve pending steps and close the log."""
        self.poll(block=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> StepTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _default_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))


@contextlib.contextmanager
def trace(path: str | os.PathLike, *, rank: int | None = None, activities: list | None = None,
          **profiler_kwargs: Any) -> Iterator[torch.profiler.profile]:
    """Run torch.profiler inside the block and export a chrome trace on exit.

    ``path`` is a ``.json`` file, or a directory that receives ``rank{rank}.trace.json`` (the layout
    ``python -m hybridpar.timeline`` reads). While it runs, :class:`range` and :class:`StepTimer`
    also emit ``record_function`` annotations (``category/name``, ``hybridpar.step#N``), so the trace
    alone is enough for the timeline's breakdown. Extra keyword arguments go to
    ``torch.profiler.profile`` (``schedule``, ``record_shapes``, ``with_stack``...).
    """
    global _tracing
    rank = _default_rank() if rank is None else rank
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
