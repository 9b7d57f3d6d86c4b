"""Section 1, ``tests``: every pytest test marked ``cuda``, in a subprocess killed at the budget's end.

Why a subprocess of its own session: a hung CUDA test, or a rank it started, must not outlive the
budget; killing the session stops them all, and the sections after it still run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from perf.gpu import ROOT
from perf.gpu.budget import Overrun, Run, Sizes


def cuda_files() -> list[str]:
    """The test files that mark a test ``cuda`` (``pytest.mark.cuda`` in their text): collecting only
    them spares the session importing every other test module."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.cuda" in p.read_text()]


def run_tests(timeout: float, log: Path) -> dict[str, Any]:
    """The ``cuda``-marked pytest tests in a subprocess of their own session, killed (with every rank
    it started) after ``timeout`` seconds; their summary line, failures and status; the log to ``log``."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *cuda_files()]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=max(timeout, 0.1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(output or "")
    lines = [ln for ln in (output or "").splitlines() if ln.strip()]
    return {"command": " ".join(cmd[2:]), "returncode": proc.returncode, "timed_out": timed_out,
            "summary": lines[-1] if lines else "", "log": log.name,
            "failures": [ln for ln in lines if ln.startswith("FAILED")]}


def section_tests(run: Run, sizes: Sizes, rows: list[tuple[str, float]], work: Path) -> None:
    run.results["tests"] = result = run_tests(run.left(), run.out / "gpu_check_tests.log")
    print(f"tests: {result['summary']}", flush=True)
    if result["timed_out"]:
        raise Overrun(f"pytest killed at the budget's end; {result['summary']!r}")
