"""What the core benchmarks share: machine facts, load checks, timing, a launcher, tables and JSON.

Why one module: the halo, scaling and DTensor benchmarks must measure the same way (warm-up, then
medians of several steps over several rounds; a distributed step counts as long as its slowest rank)
and record the same facts next to their figures (CPU, cores, torch, threads, load average), so that a
number in ``perf/results/*.json`` can be trusted and reproduced without reading three scripts.

Every configuration runs in a fresh process started here (``launch``): a distributed job gets a gloo
group over ``world`` local ranks, as ``tests/distributed.py`` does; a baseline gets one process and no
group at all. Each process sets its own thread count before doing any work, and every one, the
baselines included, keeps glibc from trimming its heap between steps (``hybridpar.cpu_alloc``, what
hybridpar's own ranks do; ``HYBRIDPAR_MALLOC_TUNING=0`` turns it off), so that a comparison is not
decided by the allocator.

``wait_for_quiet`` first takes a machine-wide lock (``/tmp/hybridpar-perf.lock``, held until the
process exits), so benchmarks built on this module run one at a time instead of all starting the
moment the load drops.
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
if str(ROOT) not in sys.path:  # run as ``python perf/bench_x.py`` from the checkout
    sys.path.insert(0, str(ROOT))


from hybridpar.hostinfo import cpu_model, machine_info  # noqa: E402,F401 (re-exported to the benchmarks)


# ---------------------------------------------------------------------------- machine and load
def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    with open("/proc/loadavg") as f:
        return [float(v) for v in f.read().split()[:3]]


LOCK_PATH = "/tmp/hybridpar-perf.lock"
_LOCK_FD: int | None = None


def _take_lock(deadline: float) -> bool:
    """Hold (until this process exits) the machine-wide lock that serializes benchmarks using this module.

    Without it every benchmark waiting for a quiet machine would start at the same moment.
    """
    global _LOCK_FD
    if _LOCK_FD is not None:
        return True
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o666)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            _LOCK_FD = fd
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return False
            time.sleep(5)


def wait_for_quiet(max_load: float, max_wait_s: float, every_s: float = 30.0) -> dict[str, Any]:
    """Take the benchmark lock, then sleep until the 1-minute load average is below ``max_load``.

    Gives up (and runs anyway, saying so in the returned record) after ``max_wait_s`` in all.
    """
    t0 = time.monotonic()
    first = loadavg()
    locked = _take_lock(t0 + max_wait_s)
    waited_lock = time.monotonic() - t0
    while loadavg()[0] >= max_load and time.monotonic() - t0 < max_wait_s:
        print(f"  load {loadavg()[0]:.2f} >= {max_load}: waiting ({time.monotonic() - t0:.0f} s so far)",
              flush=True)
        time.sleep(every_s)
    now = loadavg()
    return {"load_when_asked": first, "load_at_start": now, "waited_s": round(time.monotonic() - t0, 1),
            "waited_for_lock_s": round(waited_lock, 1), "lock": locked, "quiet": now[0] < max_load,
            "max_load": max_load}


def disturbed(loads: Sequence[float], own: int, slack: float = 1.0) -> bool:
    """True when a 1-minute load seen during a run exceeds what the run's own ``own`` busy processes
    explain (plus ``slack``): someone else was computing, and the figures are suspect."""
    return max(loads, default=0.0) > own + slack


# ---------------------------------------------------------------------------- timing
def summarize(samples: Sequence[float]) -> dict[str, float]:
    """Median and spread of step times (seconds in, milliseconds out)."""
    ms = sorted(s * 1e3 for s in samples)
    q = statistics.quantiles(ms, n=4) if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "min_ms": ms[0],
            "max_ms": ms[-1], "n": len(ms)}


def time_steps(step: Callable[[], Any], warmup: int, steps: int,
               before: Callable[[], Any] | None = None) -> list[float]:
    """Seconds per step of ``steps`` calls after ``warmup`` untimed ones.

    ``before`` runs untimed ahead of each step (a barrier, so that every rank starts together).
    """
    for _ in range(warmup):
        if before is not None:
            before()
        step()
    out = []
    for _ in range(steps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def slowest_rank(times: list[float]) -> list[float]:
    """Per-step maximum over the ranks of the default group: a step lasts until its last rank is done."""
    import torch.distributed as dist  # noqa: PLC0415

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return times
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def barrier() -> None:
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------- the CosmoFlow-like stack
def cosmo_stack(grid=None, overlap: bool = False, seed: int = 0, prepad: bool = False) -> nn.Sequential:
    """Conv3d 4->32 k3 p1, LeakyReLU(0.3), MaxPool3d(2), Conv3d 32->64 k3 p1, LeakyReLU(0.3), MaxPool3d(2).

    ``grid=None``: plain ``torch.nn`` layers; otherwise the hybridpar layers on ``grid``. The same
    seed gives the same weights either way (the Dist layers subclass the torch ones). ``prepad``
    (plain layers only): zero-pad explicitly and convolve with ``padding=0``, the torch kernel the
    overlapped DistConv3d runs on its halo-extended shard, to separate kernel choice from communication.
    """
    torch.manual_seed(seed)
    if grid is None:
        def conv(cin: int, cout: int) -> nn.Module:
            if prepad:
                return nn.Sequential(nn.ZeroPad3d(1), nn.Conv3d(cin, cout, 3, padding=0))
            return nn.Conv3d(cin, cout, 3, padding=1)

        return nn.Sequential(conv(4, 32), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                             conv(32, 64), nn.LeakyReLU(0.3), nn.MaxPool3d(2))
    from hybridpar.nn import DistConv3d, DistMaxPool3d  # noqa: PLC0415

    return nn.Sequential(DistConv3d(4, 32, 3, padding=1, grid=grid, overlap=overlap), nn.LeakyReLU(0.3),
                         DistMaxPool3d(2, grid=grid),
                         DistConv3d(32, 64, 3, padding=1, grid=grid, overlap=overlap), nn.LeakyReLU(0.3),
                         DistMaxPool3d(2, grid=grid))


def train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """Forward and backward of ``model`` on ``x`` (which needs no gradient, like a network's input)."""
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        model(x).sum().backward()

    return step


# ---------------------------------------------------------------------------- launching
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, threads: int, group: bool, pin: bool, out: str,
           fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    if pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[(rank * threads + i) % len(cores)] for i in range(threads)})
    import torch.distributed as dist  # noqa: PLC0415

    from hybridpar import cpu_alloc  # noqa: PLC0415

    cpu_alloc.tune()  # every job alike, baselines included (what hybridpar does in its own ranks)
    if group:
        import hybridpar as hp  # noqa: PLC0415

        hp.init_distributed(timeout_s=300)
    try:
        result = fn(rank, world, *args)
        with open(f"{out}.{rank}", "wb") as f:
            pickle.dump(result, f)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        if group and dist.is_initialized():
            # gloo work left in garbage and freed at finalization can abort a rank (tests/distributed.py);
            # not the only cause: ranks still abort at exit now and then, and launch() keeps their results
            gc.collect()
            dist.destroy_process_group()


def launch(fn: Callable, world: int, *args, threads: int = 1, group: bool = True, pin: bool = False,
           timeout: float = 600.0, every_rank: bool = False) -> Any:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes; rank 0's result (or every rank's).

    ``group``: join a gloo process group over the ``world`` ranks (``hp.init_distributed``); a
    baseline passes ``group=False`` and runs with no communication at all. ``threads``: intra-op
    threads of each process. ``pin``: bind rank r to core(s) ``r*threads ...`` (modulo the cores).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pkl")
        ctx = mp.start_processes(_entry, args=(world, _free_port(), threads, group, pin, out, fn, args),
                                 nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        wanted = [f"{out}.{r}" for r in range(world)]  # every rank writes its result
        while True:
            try:
                if ctx.join(timeout=1.0):
                    break
            except mp.ProcessExitedException as err:
                # A rank that aborts at interpreter exit, after its result is on disk, has measured
                # everything (seen in ~1 of 10 two-rank engine jobs: "terminate called without an
                # active exception" with no Python frame left); anything earlier is a failure.
                if not all(os.path.exists(w) for w in wanted):
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
                raise TimeoutError(f"benchmark job on {world} ranks did not finish in {timeout:.0f} s")
        results = []
        for r in range(world if every_rank else 1):
            with open(f"{out}.{r}", "rb") as f:
                results.append(pickle.load(f))
        return results if every_rank else results[0]


def alternate(rounds: int, jobs: Sequence[Callable[[int], dict[str, list[float]]]]
              ) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """Run ``jobs`` (each ``job(round) -> {config: step seconds}``) one after another, ``rounds`` times.

    Alternating the baseline and the distributed job spreads slow drifts of the machine over both.
    Returns the samples pooled over rounds and, per round, the samples and the load after it.
    """
    pooled: dict[str, list[float]] = {}
    per_round = []
    for r in range(rounds):
        rnd: dict[str, Any] = {}
        for job in jobs:
            rnd.update(job(r))
        rnd["load"] = loadavg()
        for name, times in rnd.items():
            if name != "load" and isinstance(times, list):
                pooled.setdefault(name, []).extend(times)
        per_round.append(rnd)
        meds = ", ".join(f"{n} {1e3 * statistics.median(t):.1f} ms" for n, t in rnd.items()
                         if n != "load" and isinstance(t, list))
        print(f"round {r + 1}/{rounds}: {meds}  (load {rnd['load'][0]:.2f})", flush=True)
    return pooled, per_round


# ---------------------------------------------------------------------------- reporting
def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A markdown table (also what perf/README.md shows); printed and returned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    text = "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])
    if title:
        text = f"{title}\n\n{text}"
    print(text, flush=True)
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Write ``payload`` (plus machine facts) to ``perf/results/<name>.json``."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    body = {"benchmark": name, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join([os.path.relpath(sys.executable, ROOT), *sys.argv]),
            "machine": machine_info(), **payload}
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}", flush=True)
    return path
