"""The per-step time breakdown: a :class:`StepTimer` charges each category the time its ranges held.

Why apart from the ranges: the accounting (which category holds the clock, CUDA events resolved when
they complete, the JSON-lines log) is needed only where a step is timed, while ranges are everywhere.
The rules it follows are in :mod:`hybridpar.profiling`.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridpar.profiling.ranges import (
    CATEGORIES,
    PendingStep,
    StepClock,
    default_rank,
    set_current_timer,
    tag_error,
    tracing,
)

_irange = builtins.range


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
        self.now: Callable[[], Any] = self._cuda_now if clock == "cuda" else now
        """The timer's clock: seconds (``cpu``) or a recorded CUDA event; ranges stamp with it."""
        self.sync = sync
        self.rank = default_rank() if rank is None else rank
        self.record_ranges = record_ranges
        self.records: collections.deque[StepRecord] = collections.deque(maxlen=history)
        self._pending: collections.deque[PendingStep] = collections.deque()
        self.running: PendingStep | None = None
        """The step being timed, which the ranges inside it charge."""
        self._active = False
        self._previous: StepClock | None = None
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

    def _seconds(self, pending: PendingStep, stamp: Any) -> float:
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
        if tracing():
            self._annotation = torch.autograd.profiler.record_function(f"hybridpar.step#{step}")
            self._annotation.__enter__()
        self.running = PendingStep(step, time.time(), self.now())
        self._previous = set_current_timer(self)
        self._active = True

    def stop(self) -> StepRecord | None:
        """End the step; returns its record when it can be resolved now (CPU clock or ``sync``)."""
        if not self._active:
            raise RuntimeError("StepTimer.stop: no step is running")
        pending = self.running
        pending.end = self.now()
        self._active = False
        set_current_timer(self._previous)
        self._previous = None
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None
        self.running = None
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
            tag_error(err, "hybridpar_step", step)
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

    def _resolve(self, pending: PendingStep) -> None:
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
