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

This module is the one home of the pipeline's facts (micro-batches in flight, the bubble, the step's
length, which weight gradients wait): torch-free, read by the runtime, the performance model and
``explain`` alike.
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


def microbatches_in_flight(name: str, stages: int, microbatches: int, stage: int) -> int:
    """:func:`in_flight` of ``stage``'s op list under schedule ``name``."""
    return in_flight(schedule(name, stages, microbatches, stage))


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a synchronous pipeline step of balanced stages: (S - 1) / (M + S - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def all_weights_wait(in_flight_count: int) -> bool:
    """Whether a stage's last backward defers *all* its weight gradients until its input gradient is
    sent: where the schedule holds two or more micro-batches on it (their activations are kept
    anyway), or only those of its first deferrable layer where it holds one
    (:mod:`hybridpar.pipeline.deferred`)."""
    return in_flight_count >= 2


def fill_drain_time(stage_times: Sequence[float], send_latencies: Sequence[float],
                    microbatches: int) -> float:
    """``sum_s t_s + (M - 1) max_s (t_s - send latency_s)``: a step of ``M`` micro-batches through
    stages taking ``stage_times`` (forward plus backward) each per micro-batch; receives posted ahead
    hide the latencies once the pipeline is full. With no latency it is :func:`makespan` of GPipe
    where one stage is the slowest both forward and backward, and of balanced 1F1B; of unbalanced
    1F1B, which interleaves, it is an upper bound (tested against the simulation)."""
    steady = [t - lat for t, lat in zip(stage_times, send_latencies, strict=True)]
    return sum(stage_times) + (microbatches - 1) * max(steady)


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


# ---------------------------------------------------------------------- actions
# What a stage's runtime (:mod:`hybridpar.pipeline.runtime`) does, in order. Compute: FORWARD, LOSS
# (last stage), FULL_BACKWARD, or BACKWARD_INPUT then BACKWARD_WEIGHT (the B/W split of
# :mod:`hybridpar.pipeline.deferred`). Transfers: RECV_F / RECV_B post a receive (they run ahead of
# the compute that needs it, so that data moves while the stage computes), SEND_F / SEND_B post a
# send. Step events: SHARE_LOSS (the last stage's replica loss is complete), SYNC_STATS (the last
# update of running statistics is done), ARM_REDUCE (the next backward is the last: start reducing
# gradients as they are accumulated). Events carry micro-batch -1. Inference keeps the last stage's
# outputs instead of a loss: KEEP.
FORWARD, LOSS, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, KEEP = "F", "LOSS", "B", "I", "W", "KEEP"
RECV_F, SEND_F, RECV_B, SEND_B = "RECV_F", "SEND_F", "RECV_B", "SEND_B"
SHARE_LOSS, SYNC_STATS, ARM_REDUCE = "SHARE_LOSS", "SYNC_STATS", "ARM_REDUCE"
Action = tuple[str, int]


def actions(name: str, stages: int, microbatches: int, stage: int, split_last: bool = False) -> list[Action]:
    """The action list of ``stage``: its op list (:func:`schedule`) with the transfers and step
    events in place, and, with ``split_last``, its last backward as input pass, send, weight pass.

    A receive is posted one op ahead (before the op before the one that needs it), except a
    gradient's, which can be posted only once the forward of its micro-batch has run (its shape is
    known then). GPipe, the second of 2 stages, M = 2, ``split_last``::

        RECV_F 0, RECV_F 1, F 0, LOSS 0, F 1, LOSS 1, SHARE_LOSS, SYNC_STATS,
        B 1, SEND_B 1, ARM_REDUCE, I 0, SEND_B 0, W 0
    """
    ops = schedule(name, stages, microbatches, stage)
    first, last = stage == 0, stage == stages - 1
    last_f = max(i for i, (op, _) in enumerate(ops) if op == "F")
    last_b = max(i for i, (op, _) in enumerate(ops) if op == "B")
    forward_at = {m: i for i, (op, m) in enumerate(ops) if op == "F"}

    def recv(j: int) -> list[Action]:
        op, m = ops[j]
        if op == "F":
            return [] if first else [(RECV_F, m)]
        return [] if last else [(RECV_B, m)]

    def early(j: int) -> bool:  # may op j's receive be posted before op j - 1 runs?
        op, m = ops[j]
        return op == "F" or forward_at[m] < j - 1

    out: list[Action] = recv(0) if ops else []
    for i, (op, m) in enumerate(ops):
        ahead = i + 1 < len(ops)
        if ahead and early(i + 1):
            out += recv(i + 1)
        if op == "F":
            out += [(FORWARD, m), (LOSS, m) if last else (SEND_F, m)]
            if i == last_f:
                out += [(SHARE_LOSS, -1)] if last else []
                out.append((SYNC_STATS, -1))
        else:
            send = [] if first else [(SEND_B, m)]
            if i == last_b:
                out.append((ARM_REDUCE, -1))
            if i == last_b and split_last:
                out += [(BACKWARD_INPUT, m), *send, (BACKWARD_WEIGHT, m)]
            else:
                out += [(FULL_BACKWARD, m), *send]
        if ahead and not early(i + 1):
            out += recv(i + 1)
    return out


def forward_actions(stages: int, microbatches: int, stage: int) -> list[Action]:
    """The action list of an inference pass (``Engine.predict``) on ``stage``: each micro-batch's
    forward in order, its receive posted one forward ahead, its output sent on (or kept, on the last
    stage), then the update of running statistics. Stages 2 of 2, M = 2::

        RECV_F 0, RECV_F 1, F 0, KEEP 0, F 1, KEEP 1, SYNC_STATS
    """
    first, last = stage == 0, stage == stages - 1
    out: list[Action] = [] if first else [(RECV_F, 0)]
    for m in range(microbatches):
        if not first and m + 1 < microbatches:
            out.append((RECV_F, m + 1))
        out += [(FORWARD, m), (KEEP, m) if last else (SEND_F, m)]
    return [*out, (SYNC_STATS, -1)]
