"""``python ARGS`` as the suite's end-to-end tests run it: in processes forked from the preloaded fork
server (:func:`perf.ranks.context`) instead of fresh interpreters, with ``subprocess.run``'s result.

Why: a fresh interpreter spends seconds of CPU importing torch before the first line of the program
runs, and the end-to-end tests start a few hundred of them (a benchmark's process, each rank of a
training run, torchrun itself): on a small machine that was most of the suite's time. A child of the
fork server has imported torch and hybridpar once, runs nothing else, and so starts as clean as a
fresh interpreter does. What a fresh interpreter would do is done by hand: the given environment,
working directory and ``sys.path``, ``sys.argv``, unbuffered output to the captured files, the
``atexit`` handlers at the end, and the exit status of ``SystemExit`` or of a signal.

``ranks=N`` starts N such processes as torchrun's workers are started (the rendezvous variables, one
thread each unless ``OMP_NUM_THREADS`` says otherwise), and stops the rest once one fails, as
torchrun does; tests of torchrun itself (its report, its restarts) still run torchrun.
"""

from __future__ import annotations

import atexit
import io
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from perf.ranks import context, free_port, freeze_inherited, rendezvous_env

ROOT = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 30.0  # torchrun's wait between SIGTERM and SIGKILL for the workers left after a failure


class Finished(subprocess.CompletedProcess):
    """``subprocess.run``'s result, and ``codes``: each process's own exit status (-N where signal N
    ended it), which torchrun's report lists and its status (1) does not tell."""

    def __init__(self, args: list[str], codes: list[int], stdout: str, stderr: str, ranks: bool) -> None:
        super().__init__(args, int(any(codes)) if ranks else codes[0], stdout, stderr)
        self.codes = codes


def run_python(args: list[str], env: dict[str, str] | None = None, cwd: Path = ROOT,
               timeout: float = 300.0, ranks: int | None = None, restarts: int = 0,
               on_start: Callable[[int, list[int]], None] | None = None) -> Finished:
    """``subprocess.run([sys.executable, *args], capture_output=True, text=True, ...)`` in forked
    processes: ``args`` is ``["-m", module, ...]`` or ``[script, ...]``. ``ranks=N``: N workers, as
    ``torchrun --standalone --nproc-per-node N`` would start them; the output is theirs in rank order
    and the status is 1 if any failed (torchrun's). ``restarts=K``: as ``torchrun --max-restarts K``,
    after a failure every worker is stopped and a new set started, ``TORCHELASTIC_RESTART_COUNT`` one
    higher (each attempt a fresh rendezvous); the output is every attempt's, the status the last's.
    ``on_start(attempt, pids)`` is told each attempt's worker pids, in rank order. Raises
    ``subprocess.TimeoutExpired`` after ``timeout`` seconds in all, every process killed."""
    assert ranks or not restarts, "restarts are torchrun's: they need ranks"
    deadline, stdout, stderr = time.monotonic() + timeout, "", ""
    for attempt in range(restarts + 1):
        try:
            codes, out, err = _attempt(args, env, cwd, deadline, ranks, attempt, on_start)
        except subprocess.TimeoutExpired as expired:
            expired.timeout, expired.output = timeout, stdout + expired.output
            raise
        stdout, stderr = stdout + out, stderr + err
        if not any(codes):
            break
    return Finished([sys.executable, *args], codes, stdout, stderr, ranks is not None)


def _attempt(args: list[str], env: dict[str, str] | None, cwd: Path, deadline: float, ranks: int | None,
             attempt: int, on_start: Callable[[int, list[int]], None] | None) -> tuple[list[int], str, str]:
    """One start of :func:`run_python`'s processes, until they end: their codes and output."""
    env = dict(os.environ if env is None else env)
    world = ranks or 1
    port = free_port()
    envs = [env] if ranks is None else [_worker_env(env, r, world, port, attempt) for r in range(world)]
    ctx = context()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [(os.path.join(tmp, f"out.{r}"), os.path.join(tmp, f"err.{r}")) for r in range(world)]
        procs = [ctx.Process(target=_main, args=(list(args), e, str(cwd), *o), daemon=False)
                 for e, o in zip(envs, outs)]
        for p in procs:
            p.start()
        if on_start is not None:
            on_start(attempt, [p.pid for p in procs])
        try:
            _wait(procs, deadline, stop_on_failure=ranks is not None)
        except subprocess.TimeoutExpired as err:
            err.cmd, err.output, err.stderr = [sys.executable, *args], *_read(outs)
            raise
        return [p.exitcode for p in procs], *_read(outs)


def _worker_env(env: dict[str, str], rank: int, world: int, port: int, attempt: int) -> dict[str, str]:
    """What torchrun's agent sets for worker ``rank`` of a one-node job (what hybridpar reads)."""
    return {"OMP_NUM_THREADS": "1", **env, **rendezvous_env(rank, world, port),
            "LOCAL_WORLD_SIZE": str(world), "TORCHELASTIC_RESTART_COUNT": str(attempt)}


def _wait(procs: list, deadline: float, stop_on_failure: bool) -> None:
    """Until every process has ended (or SIGKILL at ``deadline``, a ``time.monotonic()``); after a
    failure (``stop_on_failure``) the others get SIGTERM, then SIGKILL after :data:`STOP_GRACE_S`."""
    kill_at = None
    while any(p.exitcode is None for p in procs):
        now = time.monotonic()
        if now > deadline:
            _signal(procs, signal.SIGKILL)
            raise subprocess.TimeoutExpired([], 0.0)
        if kill_at is None and stop_on_failure and any(p.exitcode for p in procs):
            _signal(procs, signal.SIGTERM)
            kill_at = now + STOP_GRACE_S
        if kill_at is not None and now > kill_at:
            _signal(procs, signal.SIGKILL)
        for p in procs:
            p.join(timeout=0.02)


def _signal(procs: list, sig: int) -> None:
    for p in procs:
        if p.exitcode is None:
            try:
                (os.killpg if sig == signal.SIGKILL else os.kill)(p.pid, sig)
            except ProcessLookupError:
                pass
    if sig == signal.SIGKILL:
        for p in procs:
            p.join()


def _read(outs: list[tuple[str, str]]) -> tuple[str, str]:
    """Every process's stdout and stderr, in order (a file never written reads as empty)."""
    def text(path: str) -> str:
        return Path(path).read_text(errors="replace") if os.path.exists(path) else ""
    return "".join(text(o) for o, _ in outs), "".join(text(e) for _, e in outs)


def _main(args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """A forked process made to look like ``python ARGS`` from its first line to its exit, in a session
    of its own (so that a timeout's SIGKILL takes its children with it)."""
    freeze_inherited()
    os.setsid()
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8",
                                               line_buffering=True, write_through=True) for fd in (1, 2))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    if "OMP_NUM_THREADS" in env:  # the fork server read its own environment when it imported torch
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    module = args[1] if args[0] == "-m" else None
    first = cwd if module else str(Path(args[0]).resolve().parent)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *(p for p in sys.path if p not in ("", first, *extra))]
    code: int = 0
    try:
        if module:
            sys.argv = ["-m", *args[2:]]
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
