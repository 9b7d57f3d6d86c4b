"""Run functions on N local ranks (gloo on CPU) with a hard timeout: once (:func:`run`), or case after
case on ranks kept alive (:class:`Pool`, the ``pools`` fixture of conftest.py).

Why: a group's start costs ranks and a rendezvous, so a module's cases share one group per world size,
yet each case is its own pytest test, so that a failure names its case; a deadlock must fail the test
with the ranks' state rather than hang the suite. Ranks start from ``perf.ranks`` (the benchmarks'
launcher and its preloaded fork server).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from cosmoflow.generate import generate
from hybridpar.process.launchers import shutdown
from perf.ranks import context, free_port, launch, prepare_rank

from forked import run_python

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


def grid_ids(grids: list[tuple[int, tuple[int, int, int]]]) -> list[str]:
    """pytest ids of (world, spatial shape) pairs: "4-2x2x1"."""
    return [f"{world}-{'x'.join(map(str, shape))}" for world, shape in grids]


def flat_grids(grids: list[tuple[int, list[tuple[int, int, int]]]] = GRIDS) -> list[tuple[int, tuple]]:
    """(world, shape) pairs of :data:`GRIDS`-like lists, in world order (one pool at a time)."""
    return [(world, shape) for world, shapes in grids for shape in shapes]


def run(fn: Callable, world: int, *args, timeout: float = 300.0, env: dict | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks; raise if any rank fails or time runs out."""
    launch(fn, world, *args, threads=1, timeout=timeout, env=env, group_timeout_s=120,
           keep_results_of_exit_aborts=False, results=False)


def _serve(rank: int, world: int, port: int, conn: Connection, env: dict[str, str]) -> None:
    """A pool rank: join the group once, then run each case sent until told to stop (None)."""
    prepare_rank(rank, world, port, 1, True, False, env, 120)
    try:
        while (job := conn.recv()) is not None:
            fn, args = job
            try:
                conn.send(("ok", fn(rank, world, *args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        shutdown()


class Pool:
    """``world`` ranks in one gloo group that run case after case: one pytest test per case, each
    failure under its own test id, and the group's start paid once per module (see :func:`pools`).

    A case that fails on any rank may leave the ranks' collectives out of step, and one that does not
    finish in time is stuck: either way the pool is closed and the next case starts a fresh one.
    """

    def __init__(self, world: int) -> None:
        self.world = world
        self.procs: list[Any] = []
        self.conns: list[Connection] = []

    def _start(self) -> None:
        ctx = context()
        port, env = free_port(), dict(os.environ)
        for rank in range(self.world):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, self.world, port, there, env), daemon=True)
            proc.start()
            there.close()
            self.procs.append(proc)
            self.conns.append(here)

    def run(self, fn: Callable, *args, timeout: float = 300.0) -> list[Any]:
        """Every rank's ``fn(rank, world, *args)``; raises with the failing ranks' tracebacks."""
        if not self.procs:
            self._start()
        for conn in self.conns:
            conn.send((fn, args))
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world:
            waiting = [c for r, c in enumerate(self.conns) if r not in replies]
            ready = wait(waiting, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for conn in ready:
                rank = self.conns.index(conn)
                try:
                    replies[rank] = conn.recv()
                except EOFError:
                    replies[rank] = ("error", f"rank {rank} died (exit code {self.procs[rank].exitcode})")
                if replies[rank][0] == "error":  # its peers may wait for it in a collective: not for long
                    deadline = min(deadline, time.monotonic() + 5.0)
        errors = [f"rank {r}:\n{v}" for r, (kind, v) in sorted(replies.items()) if kind == "error"]
        silent = sorted(set(range(self.world)) - set(replies))
        if errors or silent:
            self.close(wait_s=0.0 if silent else 10.0)
            if silent and not errors:
                raise TimeoutError(f"case on {self.world} ranks did not finish in {timeout:.0f} s "
                                   f"(no answer from ranks {silent})")
            raise AssertionError("\n".join(errors) + (f"\n(ranks {silent} still waiting)" if silent else ""))
        return [replies[r][1] for r in range(self.world)]

    def close(self, wait_s: float = 10.0) -> None:
        """Stop the ranks: each leaves its group, or is killed after ``wait_s`` (at once where one is
        stuck in a collective)."""
        for conn in self.conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(timeout=wait_s)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self.procs, self.conns = [], []


class Pools:
    """One :class:`Pool` per world size, the last one asked for kept alive (so a module's cases, grouped
    by world size, start each group once and never hold two at a time)."""

    def __init__(self) -> None:
        self.current: Pool | None = None

    def __call__(self, world: int) -> Pool:
        if self.current is None or self.current.world != world:
            self.close()
            self.current = Pool(world)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


def train_script(args: list[str], nproc: int = 2, timeout: float = 240,
                 env: dict[str, str] | None = None, torchrun: bool = False,
                 **forked: Any) -> subprocess.CompletedProcess:
    """``launch/train.py`` on ``nproc`` local ranks, one thread each, started as torchrun starts them
    (:func:`forked.run_python`, which takes ``restarts`` and ``on_start``); output captured. ``env``:
    extra environment variables (a checkpoint fault to inject, say). ``torchrun``: under torchrun
    itself, for what tests its report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **(env or {})}
    script = [str(ROOT / "launch/train.py"), *args]
    if not torchrun:
        return run_python(script, env=env, timeout=timeout, ranks=nproc, **forked)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           *script]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def tiny_universes(d: Path, train: int = 4, val: int = 2, size: int = 16) -> Path:
    """``d/train`` and ``d/val``: synthetic universes as ``python -m cosmoflow.generate --out D
    --universes N --size S --seed 1`` (2 for validation) writes them."""
    for split, n, seed in (("train", train, 1), ("val", val, 2)):
        generate(d / split, universes=n, size=size, seed=seed, progress=False)
    return d
