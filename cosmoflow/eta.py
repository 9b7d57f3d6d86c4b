"""How long a run has left: the progress line's ETA.

Why apart from the reporter: it is arithmetic on times and step counts, checked without a run. The
estimate is the steps left at this run's own pace plus the validations left at the last one's length.
The pace is taken from this process's steps only (a resumed run's earlier steps ran elsewhere, maybe
on other hardware), from its first step on: the first step's warm-up (allocations, compilation) would
otherwise weigh on every later estimate. Time spent validating is kept out of the pace, since it comes
once per epoch, not once per step, and is added back per validation left.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class Eta:
    """Seconds left in a run of ``total`` steps, ``steps_per_epoch`` to an epoch, validated at each
    epoch's end and after the last step."""

    def __init__(self, total: int, steps_per_epoch: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.per_epoch = total, max(steps_per_epoch, 1)
        self.clock = clock
        self.first: tuple[int, float] | None = None  # (step, time) of this process's first step row
        self.validating_s = 0.0                        # validation time since then
        self.validation_s: float | None = None         # the last validation's length
        self._started: float | None = None

    def step(self, step: int) -> float | None:
        """Record that ``step`` is done; the seconds left, or None before a pace is known."""
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
            return None
        done = step - self.first[0]
        if done <= 0:
            return None
        pace = max(now - self.first[1] - self.validating_s, 0.0) / done
        return pace * max(self.total - step, 0) + (self.validation_s or 0.0) * self.validations_left(step)

    def validations_left(self, step: int) -> int:
        """Validations still to run once ``step`` is done: one per epoch end from ``step`` on (the current
        epoch's included), and one after the last step if that ends no epoch."""
        if step > self.total:
            return 0
        ends = self.total // self.per_epoch - (step - 1) // self.per_epoch
        return max(ends, 0) + (1 if self.total % self.per_epoch else 0)

    def validation_started(self) -> None:
        self._started = self.clock()

    def validation_ended(self) -> float:
        """The validation's length, in seconds (kept for the estimate)."""
        if self._started is None:
            return 0.0
        length = self.clock() - self._started
        self._started = None
        self.validation_s = length
        if self.first is not None:
            self.validating_s += length
        return length


def duration(seconds: float) -> str:
    """``1:02:03`` (hours), ``2:03`` (minutes), ``5s``: short enough for a progress line."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, m, sec = s // 3600, s // 60 % 60, s % 60
    if h:
        return f"{h}:{m:02d}:{sec:02d}"
    return f"{m}:{sec:02d}" if m else f"{sec}s"
