"""hybridpar.profiling and its timeline: attribution rules, logs, traces and the critical path.

What is checked against what:
* nested ranges charge the innermost category and a breakdown sums to the step time, with a fake
  clock so that the expected seconds are exact (no timing assertion that could flake);
* the after-the-fact attribution of the timeline tool (``innermost``) equals the StepTimer's own;
* two ranks' JSON-lines logs merge into one trace with one process row per rank, and the report
  names the rank the other one waited for (the critical path) and the straggler gap;
* a torch.profiler chrome trace alone yields the same kind of breakdown;
* the range overhead is measured in the report, not asserted here.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from hybridpar import profiling
from hybridpar.profiling import CATEGORIES, StepTimer, timeline


class FakeClock:
    """A clock that only moves when told to: ``clock.tick(s)``."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def tick(self, seconds: float) -> None:
        self.now += seconds


def test_nested_ranges_charge_the_innermost_category():
    clock = FakeClock()
    timer = StepTimer(clock=clock, rank=0)
    with timer.step(7):
        clock.tick(0.5)  # other
        with profiling.range("forward", "compute"):
            clock.tick(1.0)
            with profiling.range("conv1"):  # no category: stays compute
                clock.tick(2.0)
                with profiling.range("exchange", "halo"):
                    clock.tick(0.25)
                clock.tick(1.0)
            with profiling.range("all_reduce", "grad_reduce"):
                clock.tick(0.75)
        with profiling.range("next_batch", "data_wait"):
            clock.tick(0.125)
        clock.tick(0.375)  # other
    got = timer.breakdown()
    assert set(got) == {*CATEGORIES, "other"}
    assert got["compute"] == pytest.approx(4.0)
    assert got["halo"] == pytest.approx(0.25)
    assert got["grad_reduce"] == pytest.approx(0.75)
    assert got["data_wait"] == pytest.approx(0.125)
    assert got["other"] == pytest.approx(0.875)
    record = timer.last
    assert record.step == 7 and record.duration == pytest.approx(6.0)
    assert sum(got.values()) == pytest.approx(record.duration)
    names = [name for name, *_ in record.ranges]
    assert names == ["exchange", "conv1", "all_reduce", "forward", "next_batch"]
    # the timeline tool's rule, applied to the recorded ranges, agrees with the timer's
    spans = [(a, b, cat) for _, cat, a, b in record.ranges if cat]
    assert timeline.innermost(spans, 0.0, record.duration) == pytest.approx(got)


def test_breakdown_sums_to_step_time_with_the_real_clock():
    timer = StepTimer(clock="cpu")
    for _ in range(3):
        with timer.step():
            with profiling.range("a", "compute"):
                sum(range(1000))
                with profiling.range("b", "checkpoint"):
                    sum(range(1000))
    assert [r.step for r in timer.records] == [0, 1, 2]
    for record in timer.records:
        assert sum(record.breakdown.values()) == pytest.approx(record.duration, rel=1e-9, abs=1e-12)
        assert all(v >= 0 for v in record.breakdown.values())
    assert timer.summary(skip=1)["step"] > 0


def test_decorator_errors_and_ranges_outside_steps():
    calls = []

    @profiling.range("work", "compute")
    def work(x: int) -> int:
        calls.append(x)
        return 2 * x

    assert work(3) == 6 and calls == [3]  # outside a step: NVTX only
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    with timer.step():
        clock.tick(1.0)
        work(1)
    assert timer.breakdown()["compute"] == 0.0 and timer.breakdown()["other"] == 1.0
    with pytest.raises(ValueError, match="unknown profiling category"):
        profiling.range("x", "communication")
    with pytest.raises(LookupError):
        StepTimer(clock="cpu").breakdown()
    with pytest.raises(ValueError, match="clock"):
        StepTimer(clock="tpu")


def test_ranges_in_other_threads_are_not_timed():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    seen = []

    def writer() -> None:
        with profiling.range("write", "checkpoint"):
            seen.append(profiling.current_timer())

    with timer.step():
        clock.tick(1.0)
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
        assert profiling.current_timer() is timer
    assert seen == [None] and timer.breakdown()["checkpoint"] == 0.0
    assert profiling.current_timer() is None


def test_range_left_open_by_an_exception_and_ranges_spanning_the_step_end():
    clock = FakeClock()
    timer = StepTimer(clock=clock)
    outer = profiling.range("epoch", "compute")
    with timer.step():
        outer.__enter__()  # left open past the step's end: charged until the end
        clock.tick(2.0)
    outer.__exit__(None, None, None)
    assert timer.breakdown()["compute"] == 2.0
    with pytest.raises(RuntimeError), timer.step():
        with profiling.range("fails", "halo"):
            clock.tick(1.0)
            raise RuntimeError("boom")
    assert timer.breakdown()["halo"] == 1.0


def test_record_ranges_off_keeps_categories_only():
    clock = FakeClock()
    timer = StepTimer(clock=clock, record_ranges=False)
    with timer.step(), profiling.range("f", "compute"):
        with profiling.range("layer"):
            clock.tick(1.0)
    assert timer.last.ranges == [] and timer.breakdown()["compute"] == 1.0


def _fake_rank(tmp_path, rank: int, compute: float, wait: float, data: float) -> None:
    """Two steps of one rank: compute, then gradient reduction in which it waits for the other rank."""
    clock = FakeClock()
    with StepTimer(clock=clock, rank=rank, log=tmp_path) as timer:
        for step in range(2):
            with timer.step(step):
                with profiling.range("next_batch", "data_wait"):
                    clock.tick(data)
                with profiling.range("forward_backward", "compute"):
                    clock.tick(compute)
                with profiling.range("all_reduce", "grad_reduce"):
                    clock.tick(wait + 0.1)  # 0.1 s of transfer, the rest waiting
    assert (tmp_path / f"rank{rank}.jsonl").exists()


def test_timeline_merges_two_ranks_and_finds_the_critical_path(tmp_path, capsys):
    # rank 1 computes 0.5 s longer; rank 0 spends those 0.5 s waiting in the all-reduce: equal step
    # times, but rank 1 is on the critical path and the straggler gap is 0.5 s
    _fake_rank(tmp_path, 0, compute=1.0, wait=0.5, data=0.25)
    _fake_rank(tmp_path, 1, compute=1.5, wait=0.0, data=0.25)
    loaded = timeline.load(tmp_path)
    reports = timeline.analyse(loaded.steps)
    assert [rep.step for rep in reports] == [0, 1]
    for rep in reports:
        assert [r.rank for r in rep.ranks] == [0, 1]
        assert [r.duration for r in rep.ranks] == pytest.approx([1.85, 1.85])
        assert rep.critical == 1 and rep.gap == pytest.approx(0.5)
        assert rep.ranks[1].breakdown["compute"] == pytest.approx(1.5)
    assert timeline.main([str(tmp_path), "--report", str(tmp_path / "report.json")]) == 0
    printed = capsys.readouterr().out
    assert "critical path rank 1" in printed and "straggler gap 0.5000 s" in printed
    merged = json.loads((tmp_path / "merged.trace.json").read_text())
    processes = {e["pid"]: e["args"]["name"] for e in merged["traceEvents"] if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    assert {e["name"] for e in merged["traceEvents"] if e.get("ph") == "X"} >= {"all_reduce", "step 0"}
    assert json.loads((tmp_path / "report.json").read_text())[0]["critical"] == 1
    # the merged output is not read back as a rank's trace
    assert len(timeline.load(tmp_path).steps) == 4


def test_chrome_trace_alone_gives_a_breakdown(tmp_path):
    timer = StepTimer(clock="cpu", rank=3)
    with profiling.trace(tmp_path, rank=3):
        for _ in range(2):
            with timer.step():
                with profiling.range("matmul", "compute"):
                    torch.ones(64, 64) @ torch.ones(64, 64)
                with profiling.range("wait", "data_wait"):
                    sum(range(2000))
    assert (tmp_path / "rank3.trace.json").exists()
    loaded = timeline.load(tmp_path)
    steps = sorted(loaded.steps, key=lambda s: s.step)
    assert [(s.rank, s.step) for s in steps] == [(3, 0), (3, 1)]
    for s in steps:
        assert s.breakdown["compute"] > 0 and s.breakdown["data_wait"] > 0
        assert sum(s.breakdown.values()) == pytest.approx(s.duration)
    assert {e["pid"] for e in loaded.events if e.get("ph") == "X"} == {3}


def test_timeline_cli_rejects_a_missing_directory(tmp_path, capsys):
    assert timeline.main([str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
