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

from collections.abc import Sequence

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


def in_flight(ops: Sequence[Op]) -> int:
    """Most micro-batches whose forward has run and backward has not, at once, in an op list: how
    many micro-batches' activations the stage holds at its peak (GPipe: M; 1F1B: min(M, S - k))."""
    live = most = 0
    for op, _ in ops:
        live += 1 if op == "F" else -1
        most = max(most, live)
    return most


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a synchronous pipeline step: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def makespan(name: str, stages: int, microbatches: int, forward: Sequence[float],
             backward: Sequence[float], transfer: float = 0.0) -> float:
    """Length of one step of schedule ``name`` when stage k's forward of a micro-batch takes
    ``forward[k]``, its backward ``backward[k]``, and a hand-over between stages ``transfer``.

    Why: (M + S - 1) t is the step of balanced stages only. With stages whose forward and backward
    are unbalanced in different directions GPipe's bubble is larger (its forward phase runs at the
    pace of the slowest forward, its backward phase at that of the slowest backward), and 1F1B's
    differs again; an efficiency measured against (M + S - 1) max t would charge the partition's
    imbalance to the schedule. This simulates the op lists of :func:`schedule`: a stage runs its ops
    in order, a forward once the previous stage's forward of that micro-batch has arrived, a backward
    once the next stage's backward of it has.
    """
    if len(forward) != stages or len(backward) != stages:
        raise ValueError(f"makespan: need {stages} forward and backward times, got "
                         f"{len(forward)} and {len(backward)}")
    ops = [schedule(name, stages, microbatches, k) for k in range(stages)]
    done: dict[tuple[int, str, int], float] = {}
    free = [0.0] * stages
    nxt = [0] * stages
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for k in range(stages):
            while nxt[k] < len(ops[k]):
                op, m = ops[k][nxt[k]]
                dep = (k - 1, "F", m) if op == "F" else (k + 1, "B", m)
                if 0 <= dep[0] < stages:
                    if dep not in done:
                        break
                    ready = done[dep] + transfer
                else:
                    ready = 0.0
                start = max(free[k], ready)
                free[k] = done[(k, op, m)] = start + (forward[k] if op == "F" else backward[k])
                nxt[k] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover (the schedules above never deadlock)
            raise RuntimeError(f"makespan: schedule {name!r} deadlocks at S={stages}, M={microbatches}")
    return max(free)
