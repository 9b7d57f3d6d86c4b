"""What the benchmarks share: one argument parser, machine facts, load checks, timing, a launcher,
tables and one JSON writer.

Why one module: the halo, scaling and DTensor benchmarks must measure the same way (warm-up, then
medians of several steps over several rounds; a distributed step counts as long as its slowest rank)
and record the same facts next to their figures (CPU, cores, torch, threads, load average), so that a
number in ``perf/results/*.json`` can be trusted and reproduced without reading three scripts.

Every configuration runs in fresh processes started by ``launch`` (``perf.ranks``, the launcher the
distributed tests use too): a distributed job gets a gloo group over ``world`` local ranks; a baseline
gets one process and no group at all.

``wait_for_quiet`` first takes a machine-wide lock (``/tmp/hybridpar-perf.lock``, held until the
process exits), so benchmarks built on this module run one at a time instead of all starting the
moment the load drops.

``parser``/``parse`` give every benchmark the same flags (``--out``, ``--tiny``, the load wait, rounds,
steps, warm-up, pinning) with each benchmark's own defaults; ``--tiny`` swaps in the benchmark's
smallest configuration (seconds, no wait for a quiet machine, output to a temporary folder), which
``tests/test_perf_suite.py`` runs so that no benchmark rots. Results go to a scratch folder
(:data:`SCRATCH`) unless ``--record`` names them figures for ``perf/results/``. ``write_json`` is the one
result writer.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from hybridpar.profiling.hostinfo import cpu_model, machine_info  # noqa: F401 (re-exported to the benchmarks)
from perf.ranks import launch  # noqa: F401 (re-exported to the benchmarks)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
"""The recorded figures (tracked): written only with ``--record``."""
SCRATCH = Path(tempfile.gettempdir()) / "hybridpar-perf"
"""Where a run without ``--record`` writes: a trial run must not overwrite a recorded figure."""
TINY_RESULTS = Path(tempfile.gettempdir()) / "hybridpar-perf-tiny"  # --tiny never overwrites a figure


# ---------------------------------------------------------------------------- command line
def parser(name: str, doc: str | None, *, rounds: int | None = None, steps: int | None = None,
           warmup: int | None = None, max_load: float | None = None, max_wait: float = 1200,
           pin: bool = False, out: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark shares, with its own defaults; a flag whose default is None is left out.

    ``name`` is the benchmark's name (``python -m perf NAME``) and its JSON's default file name;
    ``out=False``: the benchmark writes a folder of its own (``--out-dir``), not one JSON.
    """
    ap = argparse.ArgumentParser(prog=f"python -m perf {name}", description=(doc or "").split("\n\n")[0],
                                 allow_abbrev=False)
    ap.set_defaults(benchmark=name)
    if out:
        ap.add_argument("--out", type=Path, default=None,
                        help=f"the JSON file (default {SCRATCH}/{name}.json; with --record "
                             f"perf/results/{name}.json)")
    ap.add_argument("--record", action="store_true",
                    help="write the result under perf/results/ (tracked: the figures the READMEs quote); "
                         f"without it, under {SCRATCH}")
    ap.add_argument("--tiny", action="store_true",
                    help="the smallest configuration, no wait for a quiet machine (what CI runs)")
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds, help="rounds (fresh processes each)")
    if steps is not None:
        ap.add_argument("--steps", type=int, default=steps, help="timed steps per config and round")
    if warmup is not None:
        ap.add_argument("--warmup", type=int, default=warmup, help="untimed steps first")
    if pin:
        ap.add_argument("--pin", action="store_true", help="bind rank r (and the baseline) to core r")
    if max_load is not None:
        ap.add_argument("--max-load", type=float, default=max_load, help="wait for a 1-min load below this")
        ap.add_argument("--max-wait", type=float, default=max_wait, help="give up waiting after this many s")
        ap.add_argument("--no-wait", action="store_true", help="start at once, whatever the load")
    return ap


def parse(ap: argparse.ArgumentParser, argv: Sequence[str] | None,
          tiny: dict[str, Any]) -> argparse.Namespace:
    """Parse ``argv``; with ``--tiny``, ``tiny``'s values replace the defaults (flags given still win)."""
    args = ap.parse_args(argv)
    if args.tiny:
        ap.set_defaults(**tiny, **({"no_wait": True} if "no_wait" in vars(args) else {}))
        args = ap.parse_args(argv)
    if args.tiny and args.record:
        ap.error("--tiny measures nothing worth keeping: it cannot be recorded (drop --record)")
    if getattr(args, "out", "") is None:
        args.out = results_dir(args) / f"{args.benchmark}.json"
    return args


def results_dir(args: argparse.Namespace) -> Path:
    """Where a benchmark's results go unless named: perf/results/ with ``--record``, a scratch folder
    otherwise (``--tiny``: its own)."""
    return RESULTS if args.record else TINY_RESULTS if args.tiny else SCRATCH


def test_module(name: str) -> ModuleType:
    """``tests/<name>.py`` (a model the tests check, benchmarked here), loaded by path: the tests are
    not a package."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def wait(args: argparse.Namespace) -> dict[str, Any]:
    """``wait_for_quiet`` as the shared flags say (``--no-wait``: take the lock if free, start at once)."""
    return wait_for_quiet(args.max_load, 0 if args.no_wait else args.max_wait)


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


COSMO_STACK = ("Conv3d(4,32,3,p1) LeakyReLU(0.3) MaxPool3d(2) Conv3d(32,64,3,p1) LeakyReLU(0.3) "
               "MaxPool3d(2)")
""":func:`cosmo_stack` in one line, for the result files of the benchmarks that time it."""
TRAIN_STEP = "zero grads, forward, sum of outputs, backward; input needs no gradient"
""":func:`train_step` in one line, likewise."""


def check_against_torch(models: dict[str, nn.Module], x: torch.Tensor, x_local: torch.Tensor, grid) -> dict:
    """Each split stack's gathered output against :func:`cosmo_stack` on the whole volume ``x``; the
    largest absolute error per model, raising where one exceeds 1e-4 of the output's scale."""
    import hybridpar as hp  # noqa: PLC0415

    errors = {}
    with torch.no_grad():
        ref = cosmo_stack(None)(x)
        for name, m in models.items():
            errors[name] = (hp.gather(m(x_local), grid) - ref).abs().max().item()
            if errors[name] > 1e-4 * ref.abs().max().item():
                raise AssertionError(f"{name}: output differs from torch.nn by {errors[name]:g}")
    return errors


def round_record(load: dict, load_end: list[float], run_s: float, round_loads: list[float],
                 noisy: bool) -> dict:
    """The ``"load"`` entry of a result run in rounds: the load before, after and per round, and
    whether other work disturbed it."""
    return {"load": {**load, "load_at_end": load_end, "run_s": run_s, "max_round_load": max(round_loads),
                     "disturbed": noisy}}


def swap(names: list[str], r: int) -> list[str]:
    """``names`` in round ``r``'s order: reversed every other round, so that none always goes first."""
    return names if r % 2 == 0 else names[::-1]


def train_step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    """Forward and backward of ``model`` on ``x`` (which needs no gradient, like a network's input)."""
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        model(x).sum().backward()

    return step


def engine_step(engine: Any, x_local: torch.Tensor, y_local: torch.Tensor) -> Callable[[], None]:
    """One ``Engine.train_step`` on this rank's batch, its gradients cleared first (no optimizer)."""
    params = engine.parameters()

    def step() -> None:
        for p in params:
            p.grad = None
        engine.train_step(x_local, y_local)

    return step


# ---------------------------------------------------------------------------- rounds
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
def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "",
                echo: bool = True) -> str:
    """A markdown table (also what perf/README.md shows); printed (unless ``echo`` is False) and returned."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    text = "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells)])
    if title:
        text = f"{title}\n\n{text}"
    if echo:
        print(text, flush=True)
    return text


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def command() -> str:
    """How this process was started, as a user would type it (``python -m perf NAME ...``)."""
    argv = list(sys.argv)
    if argv and Path(argv[0]).name == "__main__.py" and Path(argv[0]).parent.name == "perf":
        return " ".join(["python -m perf", *argv[1:]])
    return " ".join([os.path.relpath(sys.executable, ROOT), *argv])


def write_json(where: argparse.Namespace | Path, payload: dict[str, Any],
               args: argparse.Namespace | None = None) -> Path:
    """Write ``payload`` with the machine facts, the date, the command and every parsed argument, to
    ``where.out`` (``where`` the parsed arguments) or to the path ``where`` (``args`` beside it)."""
    if isinstance(where, argparse.Namespace):
        path, args = Path(where.out), where
    else:
        path = Path(where)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"benchmark": path.stem, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": command(),
            "machine": machine_info(), **({"args": _jsonable(vars(args))} if args is not None else {}),
            **payload}
    path.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT) if path.is_relative_to(ROOT) else path}", flush=True)
    return path
