"""Section 6, ``scaling`` (``--scaling`` only): the scaling harness (:mod:`perf.harness`) on the host's
cores, twice.

Why only on request: it takes every CPU of the machine for a quarter of an hour a run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from perf.gpu import ROOT
from perf.gpu.budget import Overrun, Run, Sizes


def section_scaling(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    """The scaling harness on this host's cores (1..8 ranks), once per row, each into its own folder."""
    for i, (label, estimate) in enumerate(rows):
        if not run.fits("scaling", label, estimate):
            continue
        dest = run.out / f"scaling-{i + 1}"
        cmd = [sys.executable, "-m", "perf", "harness", "--ranks", "1,2,4,8", "--no-wait",
               "--out-dir", str(dest)]
        try:
            res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                                 capture_output=True, text=True, timeout=max(run.left(), 1.0))
        except subprocess.TimeoutExpired as err:
            raise Overrun(f"harness run {i + 1} killed at the budget's end") from err
        run.add("scaling", {"out": str(dest), "returncode": res.returncode, "tail": res.stdout[-500:]})
