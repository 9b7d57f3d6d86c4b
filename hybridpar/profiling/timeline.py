"""Merge the per-rank traces of a run into one timeline and say, per step, who everyone waited for.

Why a module of its own: a slow step in synchronous training is as slow as its slowest rank, and no
single rank's trace shows which one that was. This tool reads a directory of per-rank outputs
(``rank{r}.jsonl`` from :class:`hybridpar.profiling.StepTimer` and/or ``*.json`` chrome traces from
:func:`hybridpar.profiling.trace` or any torch.profiler export), writes one chrome trace with one
process row per rank (open it in Perfetto or chrome://tracing), and reports per step:

* the breakdown of every rank (seconds per category and ``other``),
* the **critical path**: the rank with the most *busy* time, where busy = step time minus the time
  spent in communication (``halo``, ``pipeline``, ``bubble``, ``grad_reduce``). In a synchronous
  step the others wait for that rank inside their communication, so their step times look alike
  and only the busy time shows the straggler;
* the **straggler gap**: busiest minus least busy rank, the time the fastest rank spent waiting.

Usage: ``python -m hybridpar.profiling.timeline TRACE_DIR [--out merged.json] [--report report.json]``.
Timestamps are wall-clock (epoch) on every rank, so ranks on different hosts align to NTP accuracy.
Breakdowns from chrome traces alone need the ``category/name`` annotations that ranges emit while
``profiling.trace`` runs, inside ``hybridpar.step#N`` (or ``ProfilerStep#N``) spans.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hybridpar.profiling import CATEGORIES

__all__ = ["RankStep", "StepReport", "Timeline", "analyse", "format_report", "innermost", "load", "main"]

WAITING = ("halo", "pipeline", "bubble", "grad_reduce")
"""Categories in which a rank can be waiting for others; the rest of a step is its own work."""

_STEP_NAME = re.compile(r"^(?:hybridpar\.step#|ProfilerStep#)(\d+)$")
_CATEGORY_NAME = re.compile(rf"^({'|'.join(CATEGORIES)})/")
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")
_MERGED_MARK = "hybridpar.profiling.timeline"


@dataclass
class RankStep:
    """One rank's view of one step."""

    rank: int
    step: int
    start: float  # epoch seconds
    duration: float
    breakdown: dict[str, float]

    @property
    def waiting(self) -> float:
        return sum(self.breakdown.get(c, 0.0) for c in WAITING)

    @property
    def busy(self) -> float:
        return self.duration - self.waiting


@dataclass
class StepReport:
    """All ranks' views of one step and who was on its critical path."""

    step: int
    ranks: list[RankStep]
    wall: float  # first start to last end over the ranks
    critical: int  # rank with the most busy time
    gap: float  # busiest minus least busy rank


@dataclass
class Timeline:
    """What :func:`load` read: per-rank steps and the merged chrome trace events."""

    steps: list[RankStep] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)

    def chrome_trace(self) -> dict:
        return {"traceEvents": self.events, "displayTimeUnit": "ms",
                "otherData": {"producer": _MERGED_MARK, "sources": self.sources}}


def innermost(intervals: Iterable[tuple[float, float, str]], start: float, end: float) -> dict[str, float]:
    """Seconds per category in ``[start, end)``, each instant charged to the innermost interval.

    ``intervals`` are ``(start, end, category)`` of properly nested ranges of one thread (an interval
    poking out of its parent is clipped to it); time in none of them is ``other``. This is the
    :class:`~hybridpar.profiling.StepTimer` rule, applied after the fact to a trace.
    """
    totals = dict.fromkeys((*CATEGORIES, "other"), 0.0)
    cursor = start
    stack: list[tuple[float, str]] = []

    def charge(upto: float) -> None:
        nonlocal cursor
        upto = min(upto, end)
        if upto > cursor:
            totals[stack[-1][1] if stack else "other"] += upto - cursor
            cursor = upto

    for a, b, category in sorted(intervals, key=lambda iv: (iv[0], -iv[1])):
        if b <= start or a >= end:
            continue
        while stack and stack[-1][0] <= a:
            charge(stack[-1][0])
            stack.pop()
        charge(a)
        stack.append((min(b, stack[-1][0]) if stack else b, category))
    while stack:
        charge(stack[-1][0])
        stack.pop()
    charge(end)
    return totals


def _rank_of(path: Path, data: dict | None, fallback: int) -> int:
    info = (data or {}).get("distributedInfo") or {}
    if isinstance(info.get("rank"), int):
        return info["rank"]
    found = _RANK_IN_NAME.search(path.name)
    return int(found.group(1)) if found else fallback


def _load_jsonl(path: Path, timeline: Timeline) -> set[int]:
    ranks = set()
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        rank = int(rec["rank"])
        ranks.add(rank)
        if rec["kind"] == "step":
            timeline.steps.append(RankStep(rank, int(rec["step"]), rec["ts"], rec["dur"], rec["breakdown"]))
            timeline.events.append({"ph": "X", "pid": rank, "tid": 0, "name": f"step {rec['step']}",
                                    "cat": "step", "ts": rec["ts"] * 1e6, "dur": rec["dur"] * 1e6,
                                    "args": rec["breakdown"]})
        elif rec["kind"] == "range":
            timeline.events.append({"ph": "X", "pid": rank, "tid": 1, "name": rec["name"],
                                    "cat": rec["cat"] or "range", "ts": rec["ts"] * 1e6,
                                    "dur": rec["dur"] * 1e6, "args": {"step": rec["step"]}})
    for rank in ranks:
        timeline.events += [_thread_name(rank, 0, "steps (StepTimer)"), _thread_name(rank, 1, "ranges")]
    return ranks


def _thread_name(pid: int, tid: int, name: str) -> dict:
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}


def _load_chrome(path: Path, data: dict, rank: int, timeline: Timeline, need_steps: bool) -> None:
    """Re-home a torch.profiler trace onto process ``rank``; derive steps if the rank has no log."""
    offset = data.get("baseTimeNanoseconds", 0) / 1e3  # kineto's ts are relative to this base
    threads: dict[tuple, int] = {}
    names: dict[tuple, str] = {}
    spans: list[tuple[tuple, int, float, float]] = []
    ranged: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
    for ev in data.get("traceEvents", []):
        key = (ev.get("pid"), ev.get("tid"))
        if ev.get("ph") == "M":
            if ev.get("name") == "thread_name":
                names[key] = str(ev.get("args", {}).get("name", key))
            continue
        tid = threads.setdefault(key, 10 + len(threads))
        out = dict(ev, pid=rank, tid=tid)
        if "ts" in ev:
            out["ts"] = float(ev["ts"]) + offset
        if "id" in ev:
            out["id"] = f"{rank}:{ev['id']}"
        timeline.events.append(out)
        if ev.get("ph") != "X" or not need_steps:
            continue
        ts, dur = out["ts"] / 1e6, float(ev.get("dur", 0)) / 1e6
        step = _STEP_NAME.match(str(ev.get("name", "")))
        if step:
            spans.append((key, int(step.group(1)), ts, ts + dur))
        category = _CATEGORY_NAME.match(str(ev.get("name", "")))
        if category:
            ranged[key].append((ts, ts + dur, category.group(1)))
    for key, tid in threads.items():
        label = names.get(key, f"pid {key[0]} tid {key[1]}")
        timeline.events.append(_thread_name(rank, tid, f"{label} [{path.name}]"))
    for key, step, a, b in spans:
        timeline.steps.append(RankStep(rank, step, a, b - a, innermost(ranged[key], a, b)))


def load(trace_dir: str | Path) -> Timeline:
    """Read every ``*.jsonl`` log and ``*.json`` chrome trace in ``trace_dir`` (not our merged output)."""
    root = Path(trace_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory of per-rank traces")
    timeline = Timeline()
    logged: set[int] = set()
    for path in sorted(root.glob("*.jsonl")):
        logged |= _load_jsonl(path, timeline)
        timeline.sources.append(path.name)
    for index, path in enumerate(sorted(root.glob("*.json"))):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("otherData", {}).get("producer") == _MERGED_MARK:
            continue
        rank = _rank_of(path, data, index)
        _load_chrome(path, data, rank, timeline, need_steps=rank not in logged)
        timeline.sources.append(path.name)
    for rank in sorted({s.rank for s in timeline.steps} | {e["pid"] for e in timeline.events}):
        timeline.events += [
            {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}]
    if not timeline.sources:
        raise FileNotFoundError(f"no *.jsonl or *.json traces in {root}")
    return timeline


def analyse(steps: Iterable[RankStep]) -> list[StepReport]:
    """Group rank steps by step number and find each step's critical path and straggler gap."""
    by_step: dict[int, list[RankStep]] = defaultdict(list)
    for rs in steps:
        by_step[rs.step].append(rs)
    reports = []
    for step in sorted(by_step):
        ranks = sorted(by_step[step], key=lambda r: r.rank)
        wall = max(r.start + r.duration for r in ranks) - min(r.start for r in ranks)
        critical = max(ranks, key=lambda r: (r.busy, r.duration, -r.rank))
        gap = critical.busy - min(r.busy for r in ranks)
        reports.append(StepReport(step, ranks, wall, critical.rank, gap))
    return reports


def format_report(reports: Sequence[StepReport], last: int | None = 10) -> str:
    """Per-step tables (the ``last`` steps; all if None) and a summary over all steps."""
    columns = (*CATEGORIES, "other")
    lines = []
    for rep in reports[-last:] if last else reports:
        crit = next(r for r in rep.ranks if r.rank == rep.critical)
        top = max(columns, key=lambda c: crit.breakdown.get(c, 0.0) if c not in WAITING else -1.0)
        lines.append(f"step {rep.step}: wall {rep.wall:.4f} s, critical path rank {rep.critical} (busy "
                     f"{crit.busy:.4f} s, mostly {top} {crit.breakdown.get(top, 0.0):.4f} s), "
                     f"straggler gap {rep.gap:.4f} s")
        header = "".join(f"{c:>12}" for c in columns)
        lines.append(f"  {'rank':>5}{'step_s':>9}{header}{'busy':>9}")
        for r in rep.ranks:
            mark = "*" if r.rank == rep.critical else " "
            lines.append(f"  {mark}{r.rank:>4}{r.duration:>9.4f}"
                         + "".join(f"{r.breakdown.get(c, 0.0):>12.4f}" for c in columns) + f"{r.busy:>9.4f}")
    if reports:
        counts: dict[int, int] = defaultdict(int)
        for rep in reports:
            counts[rep.critical] += 1
        mean_wall = sum(rep.wall for rep in reports) / len(reports)
        mean_gap = sum(rep.gap for rep in reports) / len(reports)
        often = ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        lines.append(f"summary over {len(reports)} steps: mean wall {mean_wall:.4f} s, mean straggler gap "
                     f"{mean_gap:.4f} s ({100 * mean_gap / mean_wall if mean_wall else 0:.1f} % of the wall "
                     f"time); critical path on {often}")
    else:
        lines.append("no steps found (StepTimer logs or hybridpar.step#N / ProfilerStep#N spans)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridpar.profiling.timeline",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("trace_dir", help="directory of rank*.jsonl logs and/or *.json chrome traces")
    parser.add_argument("--out", help="merged chrome trace (default: TRACE_DIR/merged.trace.json)")
    parser.add_argument("--report", help="also write the per-step report as JSON here")
    parser.add_argument("--last", type=int, default=10, help="print the last N steps in detail (0: all)")
    args = parser.parse_args(argv)
    try:
        timeline = load(args.trace_dir)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.trace_dir) / "merged.trace.json"
    out.write_text(json.dumps(timeline.chrome_trace()))
    reports = analyse(timeline.steps)
    print(format_report(reports, args.last or None))
    print(f"merged trace of {len(timeline.sources)} files: {out}")
    if args.report:
        Path(args.report).write_text(json.dumps([asdict(rep) for rep in reports], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
