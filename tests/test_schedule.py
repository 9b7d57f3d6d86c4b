"""Pipeline schedules: the op lists each stage runs, and the step length they imply (``makespan``)."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridpar.planner.schedule import (
    SCHEDULES,
    actions,
    bubble_fraction,
    fill_drain_time,
    forward_actions,
    in_flight,
    makespan,
    schedule,
)

GRID = list(itertools.product(SCHEDULES, range(1, 5), range(1, 9)))


@pytest.mark.parametrize("name,stages,micro", GRID)
def test_every_micro_batch_forward_then_backward_once(name, stages, micro):
    for k in range(stages):
        ops = schedule(name, stages, micro, k)
        assert sorted(ops) == sorted([("F", m) for m in range(micro)] + [("B", m) for m in range(micro)])
        assert all(ops.index(("F", m)) < ops.index(("B", m)) for m in range(micro))
        in_flight = peak = 0
        for op, _ in ops:
            in_flight += 1 if op == "F" else -1
            peak = max(peak, in_flight)
        assert peak == (micro if name == "gpipe" else min(stages - k, micro))


@pytest.mark.parametrize("name,stages,micro", GRID)
def test_balanced_stages_take_m_plus_s_minus_1_ticks(name, stages, micro):
    f, b = 1.25, 2.5
    t = makespan(name, stages, micro, [f] * stages, [b] * stages)
    assert t == pytest.approx((micro + stages - 1) * (f + b))
    busy = micro * (f + b)
    assert 1 - busy / t == pytest.approx(bubble_fraction(stages, micro))


@pytest.mark.parametrize("stages,micro", list(itertools.product(range(1, 5), range(1, 9))))
def test_gpipe_runs_each_phase_at_its_slowest_stage(stages, micro):
    rng = random.Random(stages * 100 + micro)
    f = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    b = [rng.uniform(0.5, 4.0) for _ in range(stages)]
    expect = sum(f) + (micro - 1) * max(f) + sum(b) + (micro - 1) * max(b)
    assert makespan("gpipe", stages, micro, f, b) == pytest.approx(expect)


@pytest.mark.parametrize("name,stages,micro", GRID)
def test_unbalanced_lower_bounds_and_transfers(name, stages, micro):
    rng = random.Random(f"{name}-{stages}-{micro}")
    f = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    b = [rng.uniform(0.5, 4.0) for _ in range(stages)]
    t = makespan(name, stages, micro, f, b)
    # no stage can finish before its own work, nor a micro-batch before its chain through all stages
    assert t >= max(micro * (fk + bk) for fk, bk in zip(f, b)) - 1e-9
    assert t >= sum(f) + sum(b) - 1e-9
    # the fill/drain formula is the exact answer only for balanced stages; never above GPipe's
    assert makespan("gpipe", stages, micro, f, b) >= sum(fk + bk for fk, bk in zip(f, b)) + \
        (micro - 1) * max(fk + bk for fk, bk in zip(f, b)) - 1e-9
    # one micro-batch crosses 2 (S - 1) hand-overs, each on the critical path
    if micro == 1:
        assert makespan(name, stages, 1, f, b, transfer=0.3) == pytest.approx(t + 2 * (stages - 1) * 0.3)
    assert makespan(name, stages, micro, f, b, transfer=0.3) >= t


def test_makespan_checks_its_inputs():
    with pytest.raises(ValueError, match="need 3 forward and backward times"):
        makespan("gpipe", 3, 2, [1.0, 1.0], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        makespan("zb", 2, 2, [1.0, 1.0], [1.0, 1.0])


def test_in_flight_is_the_micro_batches_a_stage_holds():
    for s in range(1, 5):
        for m in range(1, 7):
            for k in range(s):
                assert in_flight(schedule("gpipe", s, m, k)) == m
                assert in_flight(schedule("1f1b", s, m, k)) == min(m, s - k)


def _run_all(lists: list[list[tuple[str, int]]]) -> None:
    """Run every stage's action list with the runtime's rules: a receive completes once the peer's
    send was posted, a compute waits for the receive of its micro-batch; sends never block. Fails
    on a deadlock or on a compute whose receive was never posted."""
    pos, sent, posted = [0] * len(lists), set(), [set() for _ in lists]
    needs = {"F": ("RECV_F", "SEND_F", -1), "B": ("RECV_B", "SEND_B", 1), "I": ("RECV_B", "SEND_B", 1)}
    while any(p < len(a) for p, a in zip(pos, lists)):
        moved = False
        for k, a in enumerate(lists):
            while pos[k] < len(a):
                kind, m = a[pos[k]]
                if kind in needs and 0 <= k + needs[kind][2] < len(lists):
                    recv, send, step = needs[kind]
                    assert (recv, m) in posted[k], f"stage {k}: {kind} {m} before its receive was posted"
                    if (k + step, send, m) not in sent:
                        break
                if kind.startswith("RECV"):
                    posted[k].add((kind, m))
                if kind.startswith("SEND"):
                    sent.add((k, kind, m))
                pos[k] += 1
                moved = True
        assert moved, f"deadlock at {pos}"


@pytest.mark.parametrize("name,stages,micro", GRID)
@pytest.mark.parametrize("split", [False, True])
def test_action_lists_run_every_op_once_and_never_deadlock(name, stages, micro, split):
    """Each stage's actions: its op list in order, a receive before each compute that needs one, a
    send after each that feeds another stage, the loss on the last stage, the step events once;
    with the B/W split the last backward becomes input pass, send, weight pass, at the very end."""
    lists = [actions(name, stages, micro, k, split_last=split and k > 0) for k in range(stages)]
    for k, a in enumerate(lists):
        first, last = k == 0, k == stages - 1
        compute = [(kind, m) for kind, m in a if kind in ("F", "B", "I")]
        assert [("B" if kind == "I" else kind, m) for kind, m in compute] == schedule(name, stages, micro, k)
        kinds = ("RECV_F", "SEND_F", "RECV_B", "SEND_B", "LOSS", "W", "SHARE_LOSS", "SYNC_STATS",
                 "ARM_REDUCE")
        count = {kind: sum(1 for x, _ in a if x == kind) for kind in kinds}
        assert count == {"RECV_F": 0 if first else micro, "SEND_F": 0 if last else micro,
                         "RECV_B": 0 if last else micro, "SEND_B": 0 if first else micro,
                         "LOSS": micro if last else 0, "W": 1 if split and k > 0 else 0,
                         "SHARE_LOSS": 1 if last else 0, "SYNC_STATS": 1, "ARM_REDUCE": 1}
        if split and k > 0:
            m = compute[-1][1]
            assert a[-4:] == [("ARM_REDUCE", -1), ("I", m), ("SEND_B", m), ("W", m)]
    _run_all(lists)


def test_actions_example_in_docstring():
    """The action list drawn in ``actions``' docstring is the one it returns."""
    doc = " ".join(actions.__doc__.split("::")[1].split())
    got = actions("gpipe", 2, 2, 1, split_last=True)
    got = ", ".join(f"{kind} {m}" if m >= 0 else kind for kind, m in got)
    assert doc == got


def test_fill_drain_time_is_the_closed_form_of_makespan():
    """The performance model's closed form equals the simulated op lists for GPipe when one stage is
    the slowest both ways and for balanced 1F1B, and bounds unbalanced 1F1B from above."""
    rng = random.Random(4)
    for _ in range(200):
        stages, micro = rng.randint(1, 4), rng.randint(1, 6)
        fwd = [rng.uniform(1, 2) for _ in range(stages)]
        bwd = [rng.uniform(2, 4) for _ in range(stages)]
        k = rng.randrange(stages)
        fwd[k], bwd[k] = 3.0, 5.0
        closed = fill_drain_time([f + b for f, b in zip(fwd, bwd)], [0.0] * stages, micro)
        assert makespan("gpipe", stages, micro, fwd, bwd) == pytest.approx(closed)
        assert makespan("1f1b", stages, micro, fwd, bwd) <= closed + 1e-9
        assert makespan("1f1b", stages, micro, [1.0] * stages, [2.0] * stages) == pytest.approx(
            fill_drain_time([3.0] * stages, [0.0] * stages, micro))


def test_forward_actions_run_every_forward_once_in_order():
    """The inference list: each micro-batch received (after the first stage) before its forward, its
    output sent (kept on the last stage), running statistics synced once at the end."""
    for stages in range(1, 5):
        for micro in range(1, 6):
            for stage in range(stages):
                acts = forward_actions(stages, micro, stage)
                assert [m for k, m in acts if k == "F"] == list(range(micro))
                out = "KEEP" if stage == stages - 1 else "SEND_F"
                assert [m for k, m in acts if k == out] == list(range(micro))
                for m in range(micro):
                    if stage:
                        assert acts.index(("RECV_F", m)) < acts.index(("F", m))
                    assert acts.index(("F", m)) < acts.index((out, m))
                assert acts[-1] == ("SYNC_STATS", -1)
