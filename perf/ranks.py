"""Run a function on N fresh local processes, with a gloo group or without, and a hard timeout: the one
launcher of the benchmarks and of the distributed tests (``tests/distributed.py``).

Why fresh processes: a benchmark's configurations must not share allocator or kernel-cache state, and
a test's deadlock must fail with the ranks' state instead of hanging the suite. Each process sets its
thread count (and, asked to, its cores) before any work, and every one, one-process baselines
included, keeps glibc from trimming its heap between steps as hybridpar's own ranks do
(``hybridpar.device.cpu_alloc``; ``HYBRIDPAR_MALLOC_TUNING=0`` turns it off), so that a comparison is not
decided by the allocator. Every rank's return value comes back through a file.

``launch(..., mpi=True)`` starts the ranks with ``mpiexec`` instead (``python -m perf.ranks JOB``
in each), for jobs that use MPI next to their gloo group: MPI needs the processes its launcher
started. Ranks take the same set-up; the group comes from the MPI launcher's environment.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

# Ranks are forked from a server that has imported torch and hybridpar once (multiprocessing's
# "forkserver"): a fresh interpreter importing them costs seconds per rank, most of a small job. The
# server runs nothing else, so every rank still starts from a clean state: no allocator, thread pool,
# kernel cache or process group exists in it before the fork.
START_METHOD = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
# Imported on first use, in every rank otherwise: symbolic_shapes and sympy by the first operation on a
# meta tensor (every spec plan's trace), torch._dynamo by torch.optim's first step and by meta kernels
# written in Python (LeakyReLU's): a second or two of CPU per rank.
_PRELOAD = ["torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
            "hybridpar"]


_SERVER_LIBRARY: list[str | None] = []  # the LD_PRELOAD the fork server starts with: fixed by the first call


def context(library: str | None = None) -> Any:
    """The multiprocessing context ranks start from (its fork server preloads torch and hybridpar).

    ``library``: the shared library (``LD_PRELOAD``) the ranks need, heapcount's allocator counter.
    It takes effect only in a process that execs, so the fork server has it only when the first call
    (which starts the server) asked for it; the ranks of a later call that asks for another start as
    fresh interpreters (:func:`start_method`)."""
    if not _SERVER_LIBRARY:
        _SERVER_LIBRARY.append(library if library is not None else os.environ.get("LD_PRELOAD"))
    mp.set_forkserver_preload(_PRELOAD)
    return mp.get_context(START_METHOD)


FORK_ENV = "HYBRIDPAR_RANKS_FORK"
"""Set to 1 (the test suite does, for benchmarks' ``--tiny`` runs), ranks are forked from the launching
process itself while it has one thread: no server to start (seconds of CPU, most of a tiny run), at the
cost of what a fresh process guarantees (its heap, no state before the fork), which figures need and a
tiny run's are not. A process with a second thread (a pool, a compiler's workers) is never forked: a
lock that thread held would be held forever in the child."""


def _one_thread() -> bool:
    """Whether this process runs one OS thread (native ones counted: /proc, not ``threading``)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:")) == 1
    except (OSError, StopIteration, ValueError):
        return False


def start_method(library: str | None) -> str:
    """How ranks needing ``library`` (``LD_PRELOAD``) start: forked from the server where it runs with
    that library, else as fresh interpreters; under :data:`FORK_ENV`, forked from this process where it
    runs with that library and one thread."""
    if os.environ.get(FORK_ENV) == "1" and library == os.environ.get("LD_PRELOAD") and _one_thread():
        return "fork"
    context(library)
    return START_METHOD if _SERVER_LIBRARY[0] == library else "spawn"


def free_port() -> int:
    """A TCP port free on this host right now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_rank(rank: int, world: int, port: int, threads: int, group: bool, pin: bool,
                 env: dict[str, str], group_timeout_s: float) -> None:
    """A fresh rank's set-up before any work: the caller's environment (not the fork server's from
    when it started) plus the rendezvous variables, its threads and cores, glibc's heap kept, and the
    gloo group if asked for."""
    freeze_inherited()
    os.environ.clear()
    os.environ.update(env, **rendezvous_env(rank, world, port))
    _settle(rank, threads, group, pin, group_timeout_s)


def freeze_inherited() -> None:
    """Take what this process was forked with out of Python's cycle collector (``gc.freeze``): the
    ~300k objects of torch, sympy and hybridpar its parent imported, which live as long as it does.
    Otherwise each full collection walks them all, about a third of a second of CPU each (Python's own
    as a job allocates, and :func:`hybridpar.process.launchers.shutdown`'s two at the end): on a small
    job, more than its work. What the process makes itself is collected as before."""
    gc.freeze()


def rendezvous_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables of the env:// rendezvous for local rank ``rank`` of ``world`` on ``port``."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank)}


def _settle(rank: int, threads: int, group: bool, pin: bool, group_timeout_s: float) -> None:
    """Threads, cores, glibc's heap kept, and the group if asked for (the environment is in place)."""
    torch.set_num_threads(threads)
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[(rank * threads + i) % len(cores)] for i in range(threads)})
    import hybridpar as hp  # noqa: PLC0415
    from hybridpar.device import cpu_alloc  # noqa: PLC0415

    cpu_alloc.tune()  # every job alike, baselines included (what hybridpar does in its own CPU ranks)
    if group:
        hp.init_distributed(timeout_s=group_timeout_s)


def _entry(rank: int, world: int, port: int, threads: int, group: bool, pin: bool, env: dict[str, str],
           group_timeout_s: float, out: str, fn: Callable, args: tuple) -> None:
    prepare_rank(rank, world, port, threads, group, pin, env, group_timeout_s)
    _run(rank, world, out, fn, args)


def _run(rank: int, world: int, out: str, fn: Callable, args: tuple) -> None:
    """``fn``'s result to ``out.RANK``; the group left whatever happens."""
    try:
        result = fn(rank, world, *args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:  # while the interpreter is whole: a thread back for the GIL at finalization aborts
        from hybridpar.process.launchers import shutdown  # noqa: PLC0415

        shutdown()


def launch(fn: Callable, world: int, *args, threads: int = 1, group: bool = True, pin: bool = False,
           timeout: float = 600.0, every_rank: bool = False, env: dict[str, str] | None = None,
           group_timeout_s: float = 300.0, keep_results_of_exit_aborts: bool = True,
           results: bool = True, mpi: bool = False) -> Any:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; rank 0's result (or every rank's).

    ``group``: join a gloo process group over the ``world`` ranks (``hp.init_distributed``); a
    baseline passes ``group=False`` and runs with no communication at all. ``threads``: intra-op
    threads of each process. ``pin``: bind rank r to core(s) ``r*threads ...`` (modulo the cores).
    ``env``: variables set in every rank before anything runs. ``keep_results_of_exit_aborts``: a rank
    that aborts at interpreter exit after its result is on disk has measured everything (a benchmark
    keeps the results; a test, which must see every failure, passes False). ``results``: False where
    ``fn`` returns nothing worth reading (a test whose rank may leave on purpose, writing none); then
    None comes back. ``mpi``: start the ranks with ``mpiexec`` (see module doc). Raises if a rank
    fails or ``timeout`` seconds pass (the ranks are killed).
    """
    rank_env = {**os.environ, **(env or {})}
    if mpi:
        return _launch_mpiexec(fn, world, args, threads, group, pin, timeout, every_rank, rank_env,
                               group_timeout_s, keep_results_of_exit_aborts, results)
    method = start_method(rank_env.get("LD_PRELOAD"))
    with tempfile.TemporaryDirectory() as tmp, _environ(LD_PRELOAD=rank_env.get("LD_PRELOAD")):
        out = os.path.join(tmp, "result.pkl")
        ctx = mp.start_processes(_entry, args=(world, free_port(), threads, group, pin, rank_env,
                                               group_timeout_s, out, fn, args),
                                 nprocs=world, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        wanted = [f"{out}.{r}" for r in range(world)]  # every rank that returns writes its result
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except mp.ProcessExitedException as err:
                # seen in ~1 of 10 two-rank engine jobs: "terminate called without an active exception"
                # with no Python frame left; anything before the results are written is a failure
                if not keep_results_of_exit_aborts or not all(os.path.exists(w) for w in wanted):
                    raise
                print(f"warning: {err} after writing its result (abort at exit); results kept",
                      file=sys.stderr, flush=True)
                for p in ctx.processes:
                    p.join(timeout=30)
                break
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                raise TimeoutError(f"job on {world} ranks did not finish in {timeout:.0f} s (deadlock?)")
        return _results(out, world, every_rank) if results else None


def _results(out: str, world: int, every_rank: bool) -> Any:
    """Rank 0's return value (every rank's, in rank order) from the files the ranks wrote."""
    values = []
    for r in range(world if every_rank else 1):
        with open(f"{out}.{r}", "rb") as f:
            values.append(pickle.load(f))
    return values if every_rank else values[0]


@contextlib.contextmanager
def _environ(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: left as it is) for the block, then restored."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update({k: v for k, v in values.items() if v is not None})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this interpreter (a virtual environment's MPICH), else on the PATH."""
    return shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def _launch_mpiexec(fn: Callable, world: int, args: tuple, threads: int, group: bool, pin: bool,
                    timeout: float, every_rank: bool, env: dict[str, str], group_timeout_s: float,
                    keep_results_of_exit_aborts: bool, results: bool) -> Any:
    """:func:`launch` with ``mpi=True``: ``mpiexec -n WORLD python -m perf.ranks JOB``, in a session of
    its own, so that a timeout kills every rank with it."""
    exe = mpiexec()
    if exe is None:
        raise RuntimeError("perf.ranks: launch(..., mpi=True) needs mpiexec (MPICH or Open MPI) beside "
                           f"{sys.executable} or on the PATH")
    with tempfile.TemporaryDirectory() as tmp:
        out, job = os.path.join(tmp, "result.pkl"), os.path.join(tmp, "job.pkl")
        with open(job, "wb") as f:
            pickle.dump((threads, group, pin, group_timeout_s, out, fn, args), f)
        root = str(Path(__file__).resolve().parent.parent)
        env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
        with subprocess.Popen([exe, "-n", str(world), sys.executable, "-m", "perf.ranks", job], env=env,
                              start_new_session=True) as proc:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TimeoutError(f"mpiexec job on {world} ranks did not finish in {timeout:.0f} s "
                                   f"(deadlock?)") from None
        wanted = [f"{out}.{r}" for r in range(world)]
        if rc != 0:
            if not keep_results_of_exit_aborts or not all(os.path.exists(w) for w in wanted):
                raise RuntimeError(f"mpiexec job on {world} ranks failed (exit status {rc})")
            print(f"warning: mpiexec exit status {rc} after every rank wrote its result; results kept",
                  file=sys.stderr, flush=True)
        return _results(out, world, every_rank) if results else None


def _mpi_rank(job: str) -> None:
    """One rank started by :func:`_launch_mpiexec`: its place from the MPI launcher's environment."""
    from hybridpar.process.launchers import detect_launcher  # noqa: PLC0415

    found = detect_launcher()
    if found is None:
        raise RuntimeError("perf.ranks: no MPI launcher variables (PMI_RANK, OMPI_COMM_WORLD_RANK); "
                           "start this with mpiexec")
    _, rank, world, _ = found
    with open(job, "rb") as f:
        threads, group, pin, group_timeout_s, out, fn, args = pickle.load(f)
    _settle(rank, threads, group, pin, group_timeout_s)
    _run(rank, world, out, fn, args)


if __name__ == "__main__":
    _mpi_rank(sys.argv[1])
