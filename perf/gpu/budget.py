"""What a run does within its time budget: the sections in their order of value, each one's estimated
seconds per mode, the sizes each mode runs at, the plan (``--dry-run``), and :class:`Run`, the clock and
the results every section writes through.

Why estimates decide: a GPU is lent for minutes, so a section or a row starts only if its estimate fits
in the time left, and the rest is skipped with its reason rather than cut off unrecorded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from perf.gpu.report import write

# Seconds each section is expected to take, as (set-up, [(row, seconds), ...]) in the order the rows
# run: "gpu" on one H200 at the full sizes, "smoke" on a 2-core CPU at the --cpu-smoke sizes.
# ESTIMATES FOR PLANNING THE BUDGET, NOT MEASUREMENTS. The "gpu" figures are the first H200 run's
# section times (perf/results/gpu/, 2026-11-28: tests 28 s, cosmoflow 52 s for five variants, memory
# 29 s, checkpoint 12 s for one save, U-Net 18 s), split over their rows and rounded up by about half,
# so that a slower node or a cold inductor cache still fits. Every run records what each section
# really took (gpu_check.json: sections.NAME.seconds): correct this table from those. The "smoke"
# figures are a 2-core VM's, rounded up, and no smaller than 2 s, so that a 1-second budget skips
# every section.
ESTIMATES: dict[str, dict[str, tuple[float, list[tuple[str, float]]]]] = {
    "gpu": {
        "tests": (0, [("pytest -m cuda", 45)]),
        "cosmoflow": (10, [("torch bf16+cl", 8), ("fp32", 10), ("bf16", 8), ("bf16+cl", 8),
                           ("bf16+cl+compile", 40), ("bf16+cl+graphs", 10)]),
        "memory": (0, [("1 rank", 12), ("2 ranks", 15), ("4 ranks", 20)]),
        "checkpoint": (0, [("2 GiB", 35)]),
        "unet": (0, [("1 rank", 12), ("2 ranks", 16)]),
        "scaling": (0, [("run 1", 900), ("run 2", 900)]),
    },
    "smoke": {
        "tests": (0, [("pytest -m cuda", 8)]),
        "cosmoflow": (3, [("torch bf16+cl", 2), ("fp32", 4), ("bf16", 2), ("bf16+cl", 2),
                          ("bf16+cl+compile", 5)]),
        "memory": (0, [("1 rank", 4), ("2 ranks", 5)]),
        "checkpoint": (0, [("1 MiB", 2)]),
        "unet": (0, [("1 rank", 5), ("2 ranks", 7)]),
        "scaling": (0, [("run 1", 900), ("run 2", 900)]),
    },
}
SECTIONS = ("tests", "cosmoflow", "memory", "checkpoint", "unet", "scaling")  # the order of value


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: the GPU run and ``--cpu-smoke`` run the same code at these sizes."""

    cosmoflow: int  # CosmoFlow reference model's input side
    cosmoflow_n_conv: int
    cosmoflow_steps: int  # timed steps per variant (after 3 warm-up steps)
    compile_backend: str
    memory: int  # LBANN variant's input side
    checkpoint_bytes: int
    checkpoint_step_ms: float
    unet: int  # U-Net input side
    unet_steps: int  # timed steps per rank count (after 2 warm-up steps)


GPU = Sizes(128, 5, 30, "inductor", 256, 2 << 30, 200.0, 128, 10)
SMOKE = Sizes(16, 2, 2, "aot_eager", 16, 1 << 20, 20.0, 16, 2)  # CPU autocast, channels-last, aot_eager


class Overrun(Exception):
    """A section ran past the budget: stop it, keep its rows, mark it ``timed_out``."""


class Run:
    """One gpu_check run: the budget's clock, the results so far, and the writer called after each row.

    Why one object: every section asks the same two questions (does the next row fit in the time left?
    is the budget spent?) and every answer must land in the JSON at once, so that a run killed from
    outside still says what it measured and why the rest is missing.
    """

    def __init__(self, budget_s: float, out: Path, mode: str, results: dict[str, Any]) -> None:
        self.budget_s = budget_s
        self.out = out
        self.mode = mode
        self.results = results
        self.started = time.monotonic()
        self.deadline = self.started + budget_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, section: str, label: str, seconds: float) -> bool:
        """Whether a row estimated at ``seconds`` fits in the time left; if not, say so and record it."""
        left = self.left()
        if seconds <= left:
            return True
        reason = f"estimated {seconds:.0f} s > {max(left, 0):.0f} s left of the {self.budget_s:.0f} s budget"
        self.results["sections"][section].setdefault("skipped_rows", {})[label] = reason
        print(f"gpu_check: {section} {label} skipped: {reason}", flush=True)
        return False

    def add(self, section: str, row: dict[str, Any]) -> None:
        """A measured row: printed, kept, written."""
        self.results.setdefault(section, []).append(row)
        print(f"{section}: {row}", flush=True)
        self.save()

    def check_deadline(self) -> None:
        """Stop the section (:class:`Overrun`) once the budget is spent."""
        if self.left() < 0:
            spent = time.monotonic() - self.started
            raise Overrun(f"past the {self.budget_s:.0f} s budget after {spent:.0f} s")

    def save(self) -> Path:
        self.results["wall_s"] = round(time.monotonic() - self.started, 1)
        return write(self.results, self.out)


def estimate_s(mode: str, name: str) -> float:
    """A section's whole estimate: its set-up and every row."""
    setup, rows = ESTIMATES[mode][name]
    return setup + sum(s for _, s in rows)


def plan(mode: str, budget_s: float, off: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], float]:
    """What a run would do at ``budget_s`` if every row took its estimate: per section, run or skip (why),
    and the rows it would skip; and the seconds it would take. The real run decides the same way, on
    the time really left."""
    out, used = [], 0.0
    for name in SECTIONS:
        setup, rows = ESTIMATES[mode][name]
        entry: dict[str, Any] = {"section": name, "estimate_s": estimate_s(mode, name), "starts_at_s": used,
                                 "skipped_rows": {}}
        reason = (off if off is not None else sections_off()).get(name)
        first, left = setup + rows[0][1], budget_s - used
        if reason is None and first > left:
            reason = f"estimated {first:.0f} s to its first row > {max(left, 0):.0f} s left"
        if reason is None:
            used += setup
            for label, s in rows:
                left = budget_s - used
                if s > left:
                    entry["skipped_rows"][label] = f"estimated {s:.0f} s > {max(left, 0):.0f} s left"
                else:
                    used += s
        entry["skip"] = reason
        out.append(entry)
    return out, used


def sections_off(skip_tests: bool = False, scaling: bool = False, only: str | None = None) -> dict[str, str]:
    """The sections a run's flags turn off, each with why, before any budget is counted."""
    off = {}
    if only is not None:
        wanted = {n.strip() for n in only.split(",") if n.strip()}
        unknown = wanted - set(SECTIONS)
        if unknown:
            raise ValueError(f"--only: no section {', '.join(sorted(unknown))}; one of {', '.join(SECTIONS)}")
        off.update({n: "not in --only" for n in SECTIONS if n not in wanted})
    if skip_tests:
        off["tests"] = "--skip-tests"
    if not scaling and "scaling" not in off:
        off["scaling"] = "off unless --scaling"
    return off


def print_plan(mode: str, budget_s: float, off: dict[str, str]) -> None:
    """``--dry-run``: the plan, one line per section and per skipped row; runs nothing."""
    where = "one H200 at the full sizes" if mode == "gpu" else "a 2-core CPU at the --cpu-smoke sizes"
    print(f"gpu_check plan at --budget {budget_s:.0f} s ({mode}; seconds are estimates for {where}, for "
          f"planning, not measurements):")
    entries, total = plan(mode, budget_s, off)
    for i, e in enumerate(entries, 1):
        setup, rows = ESTIMATES[mode][e["section"]]
        parts = ", ".join(f"{label} {s:.0f}" for label, s in rows)
        parts = f"set-up {setup:.0f}, {parts}" if setup else parts
        status = f"skip: {e['skip']}" if e["skip"] else f"run from ~{e['starts_at_s']:.0f} s"
        print(f"  {i}. {e['section']:<10} {e['estimate_s']:>5.0f} s  ({parts})  {status}")
        if not e["skip"]:
            for label, why in e["skipped_rows"].items():
                print(f"       {label} skipped: {why}")
    skipped = [e["section"] for e in entries if e["skip"]]
    rows = [f"{e['section']} {lb}" for e in entries if not e["skip"] for lb in e["skipped_rows"]]
    print(f"estimated {total:.0f} s of the {budget_s:.0f} s budget; skipped sections: "
          f"{', '.join(skipped) or 'none'}; skipped rows: {', '.join(rows) or 'none'}")
