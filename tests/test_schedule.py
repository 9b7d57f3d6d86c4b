"""Pipeline schedules: the op lists each stage runs, and the step length they imply (``makespan``)."""

from __future__ import annotations

import itertools
import random

import pytest

from hybridpar.pipeline.schedule import SCHEDULES, bubble_fraction, in_flight, makespan, schedule

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
