"""Run a function on N local ranks (gloo on CPU) inside one spawned group, with a hard timeout.

Why: spawning processes costs seconds, so a test spawns one group and runs many cases in it; a
deadlock must fail the test with the ranks' state rather than hang the suite. The processes are
started by ``perf.ranks.launch``, the benchmarks' launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from perf.ranks import free_port, launch  # noqa: F401 (free_port: the tests take it from here)

ROOT = Path(__file__).resolve().parents[1]

# World sizes and their spatial grids that layer suites run on: every axis split alone, two axes,
# three ways, and all three axes.
GRIDS = [
    (1, [(1, 1, 1)]),
    (2, [(2, 1, 1), (1, 1, 2)]),
    (3, [(3, 1, 1)]),
    (4, [(2, 2, 1), (1, 2, 2)]),
    (8, [(2, 2, 2)]),
]


def run(fn: Callable, world: int, *args, timeout: float = 300.0, env: dict | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; raise if any rank fails or time runs out."""
    launch(fn, world, *args, threads=1, timeout=timeout, env=env, group_timeout_s=120,
           keep_results_of_exit_aborts=False)


def train_script(args: list[str], nproc: int = 2, timeout: float = 240,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``launch/train.py`` under torchrun on ``nproc`` local ranks, one thread each; output captured.
    ``env``: extra environment variables (a checkpoint fault to inject, say)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "launch/train.py"), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def tiny_universes(d: Path, train: int = 4, val: int = 2, size: int = 16) -> Path:
    """``d/train`` and ``d/val``: synthetic universes from ``cosmoflow.generate`` (seeds 1 and 2)."""
    for split, n, seed in (("train", train, 1), ("val", val, 2)):
        subprocess.run([sys.executable, "-m", "cosmoflow.generate", "--out", str(d / split), "--universes",
                        str(n), "--size", str(size), "--seed", str(seed)],
                       check=True, capture_output=True, cwd=ROOT)
    return d
