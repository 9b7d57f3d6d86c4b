"""Which complete versions to keep: the newest few, every n-th for later study, and the best.

Why a pure function: "retention keeps exactly what it says" is checked on plain records, and the same
rule runs on every level directory. Versions are ordered by the time their save was taken (a run resumed
from an older step continues the newest lineage, not the highest step number), and a step has one version:
a later save of the same step replaces the earlier.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Policy:
    """``keep_last`` newest versions (None: all); every version whose ``keep_every_on`` value (the step,
    or a metadata entry such as ``"epoch"``) is a multiple of ``keep_every`` (for a metadata entry, the
    newest version of each such value); and the version with the best ``best = (metric, "min"|"max")``,
    looked up in ``metadata["metrics"]`` then in ``metadata``."""

    keep_last: int | None = 3
    keep_every: int | None = None
    keep_every_on: str = "step"
    best: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1 or None (keep all), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise ValueError(f"keep_every must be >= 1 or None, got {self.keep_every}")
        if self.best is not None and (len(self.best) != 2 or self.best[1] not in ("min", "max")):
            raise ValueError(f"best must be (metric name, 'min' or 'max'), got {self.best!r}")


@dataclass(frozen=True)
class Record:
    """What retention needs to know about a complete version."""

    name: str
    step: int
    time: float
    metadata: dict[str, Any]


def metric(metadata: dict[str, Any], name: str) -> float | None:
    value = metadata.get("metrics", {}).get(name, metadata.get(name))
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def newest_per_step(versions: Sequence[Record]) -> list[Record]:
    """``versions`` in the order they were taken, less every one a later save of the same step replaced.

    Why: two saves can land on one step (a training loop's periodic save on an epoch's last step, then
    the epoch's save after its validation, which adds the metrics; or a run resumed from that step
    saving it again). Both describe the same training state, the later one more completely: keeping
    both would show two versions of one step and spend a ``keep_last`` slot on a copy.
    """
    ordered = sorted(versions, key=lambda v: (v.time, v.name))
    last = {v.step: i for i, v in enumerate(ordered)}
    return [v for i, v in enumerate(ordered) if last[v.step] == i]


def keep(policy: Policy, versions: Sequence[Record]) -> set[str]:
    """Names of the versions ``policy`` keeps among ``versions`` (all complete); of several versions of
    one step, only the newest (:func:`newest_per_step`)."""
    ordered = newest_per_step(versions)
    kept: set[str] = set()
    if policy.keep_last is None:
        kept.update(v.name for v in ordered)
    else:
        kept.update(v.name for v in ordered[-policy.keep_last:])
    if policy.keep_every:
        n, on = policy.keep_every, policy.keep_every_on
        newest: dict[int, str] = {}
        for v in ordered:
            value = v.step if on == "step" else v.metadata.get(on)
            if isinstance(value, int) and not isinstance(value, bool) and value % n == 0:
                if on == "step":
                    kept.add(v.name)
                else:
                    newest[value] = v.name
        kept.update(newest.values())
    if policy.best:
        name, mode = policy.best
        scored = [(metric(v.metadata, name), i, v.name) for i, v in enumerate(ordered)]
        scored = [s for s in scored if s[0] is not None]
        if scored:
            # Ties go to the newest: larger index wins in both modes.
            pick = min(scored, key=lambda s: (s[0], -s[1])) if mode == "min" else max(scored)
            kept.add(pick[2])
    return kept
