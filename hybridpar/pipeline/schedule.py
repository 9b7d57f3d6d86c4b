"""Pipeline schedules: the order in which one stage runs forward (F) and backward (B) micro-batches.

Why a module of its own: the schedule is the whole difference between GPipe and 1F1B; the engine
just executes the list. Both give the same gradients (backward of every micro-batch, accumulated);
they differ in how many micro-batches' activations a stage holds at once (GPipe: M, 1F1B: S - k).

GPipe, S = 3 stages, M = 4 micro-batches (a column per clock tick, Fm/Bm = micro-batch m)::

    stage 0 | F0 F1 F2 F3 .. .. .. .. .. .. B3 B2 B1 B0
    stage 1 | .. F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0 ..
    stage 2 | .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. .. .. ..

1F1B (PipeDream-flush): S - k - 1 warm-up forwards, then alternate, then drain::

    stage 0 | F0 F1 F2 .. .. B0 F3 .. B1 .. B2 .. B3
    stage 1 | .. F0 F1 .. B0 F2 .. B1 F3 B2 .. B3 ..
    stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. .. ..

Bubble fraction, both: (S - 1) / (M + S - 1).
"""

from __future__ import annotations

Op = tuple[str, int]

SCHEDULES = ("gpipe", "1f1b")


def gpipe(stages: int, microbatches: int, stage: int) -> list[Op]:
    """All forwards, then all backwards in reverse order."""
    del stages, stage
    return [("F", m) for m in range(microbatches)] + [("B", m) for m in reversed(range(microbatches))]


def one_f_one_b(stages: int, microbatches: int, stage: int) -> list[Op]:
    """Warm-up forwards, then one forward and one backward in turn, then the remaining backwards."""
    warm = min(stages - stage - 1, microbatches)
    ops: list[Op] = [("F", m) for m in range(warm)]
    for i in range(microbatches - warm):
        ops += [("F", warm + i), ("B", i)]
    ops += [("B", m) for m in range(microbatches - warm, microbatches)]
    return ops


def schedule(name: str, stages: int, microbatches: int, stage: int) -> list[Op]:
    """The op list of ``stage`` under schedule ``name`` (``gpipe`` or ``1f1b``)."""
    if name == "gpipe":
        return gpipe(stages, microbatches, stage)
    if name == "1f1b":
        return one_f_one_b(stages, microbatches, stage)
    raise ValueError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}")


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a synchronous pipeline step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
