"""Run a function on N local ranks (gloo on CPU) inside one spawned group, with a hard timeout.

Why: spawning processes costs seconds, so a test spawns one group and runs many cases in it; a
deadlock must fail the test with the ranks' state rather than hang the suite.
"""

from __future__ import annotations

import gc
import os
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.multiprocessing as mp

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, env: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), **env)
    torch.set_num_threads(1)
    import torch.distributed as dist

    import hybridpar as hp

    hp.init_distributed(timeout_s=120)
    try:
        fn(rank, world, *args)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        # Garbage (an engine's reference cycles, say) holding gloo work goes while the interpreter
        # and the groups are alive: freed at interpreter exit, a tensor's release may take the GIL
        # from a gloo thread during finalization and abort the process (pytorch/pytorch#179291).
        gc.collect()
        dist.destroy_process_group()


def run(fn: Callable, world: int, *args, timeout: float = 300.0, env: dict | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; raise if any rank fails or time runs out."""
    ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, env or {}), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"distributed test on {world} ranks did not finish in {timeout:.0f} s "
                               f"(deadlock?)")


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
