"""Every benchmark in perf/ runs at its tiny size (``python -m perf NAME --tiny``) and writes its JSON
with the keys its perf/README.md line is read from, so that none rots between the runs that produce
the figures. A tiny configuration measures nothing worth keeping: what is checked is that the
benchmark completes, prints its table and reports what it reports at full size."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from perf.__main__ import BENCHMARKS
from perf.ranks import FORK_ENV, mpiexec

from distributed import ROOT
from forked import run_python

# What each benchmark's JSON must hold besides the writer's own keys (benchmark, date, command,
# machine, args).
KEYS: dict[str, set[str]] = {
    "halo": {"config", "load", "result", "stats", "table"},
    "scaling": {"config", "load", "result", "stats", "table"},
    "dtensor": {"config", "timing", "cases", "tables"},
    "pipeline": {"config", "load", "result", "stats", "table"},
    "pipeline_breakdown": {"config", "load", "result", "table"},
    "deferred": {"config", "load", "result", "samples_s", "table"},
    "transports": {"config", "load", "result", "samples_s", "table"},
    "p2p_latency": {"load", "result", "samples_s", "table"},
    "vs_torch_pipelining": {"config", "load", "result", "stats", "table"},
    "hybrid_vs_dp": {"config", "load", "result", "stats", "table"},
    "unet": {"config", "load", "results", "table"},
    "fft": {"config", "load", "result", "stats", "table", "mpi4py_fft"},
    "infer": {"config", "load", "results", "largest", "goals", "table"},
    "loader": {"config", "rows", "augment", "wait"},
    "generator": {"config", "seconds_per_universe", "stages_median_s"},
    "checkpoint": {"config", "modes", "goals", "restart_s"},
    "recovery": {"medians_s", "samples_s"},
    "harness": {"measured", "results", "validation", "table"},
    "profile": {"config", "result", "tables"},
    "advisor": {"config", "results", "table", "details"},
    "infer_split": {"config", "ratios", "stats", "table"},
}
AT_ONCE = 2  # tiny runs side by side (tiny_runs)
NEEDS_MPIEXEC = {"transports"}  # its ranks are started by mpiexec
SKIP = {
    "recovery": "kills and restarts 4 torchrun workers twice (a minute on 2 cores); run `python -m perf "
                "recovery --tiny` by hand",
    "gpu_check": "its CPU parts run in tests/test_gpu_check.py (--cpu-smoke, the same as --tiny)",
    "shardtensor": "installs nvidia-physicsnemo into a throwaway venv first (~0.5 GB), then ~15 s; run "
                   "`python -m perf shardtensor --tiny` by hand",
}


def _perf(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m perf ARGS`` (forked, :mod:`forked`); on a timeout its ranks go with it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", FORK_ENV: "1"}
    try:
        return run_python(["-m", "perf", *args], env=env, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"python -m perf {' '.join(args)} did not finish in {timeout:.0f} s:\n"
                    f"{err.output[-2000:]}")


def test_every_benchmark_has_its_checks():
    assert set(BENCHMARKS) == set(KEYS) | set(SKIP)


def test_list_and_an_unknown_name():
    res = _perf("list")
    assert res.returncode == 0 and all(f"  {name} " in res.stdout for name in BENCHMARKS)
    res = _perf("no_such_bench")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "no benchmark 'no_such_bench'" in res.stderr


def _runnable(name: str) -> str | None:
    """Why ``name`` is not run here, or None."""
    if name in SKIP:
        return SKIP[name]
    if name in NEEDS_MPIEXEC and mpiexec() is None:
        return "needs mpiexec (pip install mpich)"
    return None


def _tiny(name: str, out: Path) -> tuple[subprocess.CompletedProcess, Path]:
    """``python -m perf NAME --tiny`` writing into the folder ``out``; its result and its JSON's path."""
    if name == "harness":  # writes a folder: scaling.json, calibration.json, scaling.csv
        return _perf(name, "--tiny", "--out-dir", str(out)), out / "scaling.json"
    return _perf(name, "--tiny", "--out", str(out / f"{name}.json")), out / f"{name}.json"


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Every runnable benchmark's tiny run, :data:`AT_ONCE` at a time, started when the first test asks.

    Why: a tiny run spends most of its seconds on one core (its launcher's start, its table, one rank
    waiting for another), so two side by side take little more than one; their figures mean nothing
    at this size anyway. Each test then waits for its own run and names it when it fails.
    """
    with ThreadPoolExecutor(max_workers=AT_ONCE) as pool:
        yield {name: pool.submit(_tiny, name, tmp_path_factory.mktemp(name))
               for name in BENCHMARKS if _runnable(name) is None}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_tiny_run_writes_its_json(name, tiny_runs):
    if _runnable(name):
        pytest.skip(_runnable(name))
    res, out = tiny_runs[name].result()
    assert res.returncode == 0, f"python -m perf {name} --tiny:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    data = json.loads(out.read_text())
    missing = ({"benchmark", "date", "command", "machine", "args"} | KEYS[name]) - set(data)
    assert not missing, f"{name}: {sorted(missing)} missing from {out.name}"
    assert data["args"]["tiny"] is True and data["machine"]["logical_cores"] >= 1
    assert data["command"].startswith(f"python -m perf {name} --tiny")
    if "table" in KEYS[name]:
        lines = data["table"].splitlines()
        assert len(lines) >= 3 and all(line in res.stdout for line in lines)  # printed: header, rule, rows


@pytest.mark.skipif(mpiexec() is None, reason="no mpiexec")
@pytest.mark.parametrize("name", ["p2p_latency"])
def test_tiny_run_with_mpi(name, tmp_path):
    """A benchmark's ``--mpi`` form: ranks started by mpiexec, MPI timed too."""
    pytest.importorskip("mpi4py")
    out = tmp_path / f"{name}.json"
    res = _perf(name, "--tiny", "--mpi", "--out", str(out))
    assert res.returncode == 0, f"{name} --tiny --mpi:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    data = json.loads(out.read_text())
    assert KEYS[name] <= set(data) and "mpi" in data["table"]
    assert all("mpi_ms" in r or "mpi_us" in r for r in data["result"].values())


def test_a_preloaded_allocator_counter_reaches_the_ranks():
    """heapcount's counter is an LD_PRELOAD library: ranks forked from a server started without it
    would not load it (this process's, started by the tests before), so they start as fresh
    interpreters and count a 50 MiB block."""
    from perf import heapcount
    from perf.ranks import launch

    if heapcount.library() is None:
        pytest.skip("no C compiler to build the counter")
    before = os.environ.get("LD_PRELOAD")
    peak = launch(_allocate, 1, group=False, env=heapcount.preload_env())
    assert peak >= 50 << 20
    assert os.environ.get("LD_PRELOAD") == before  # the launcher's environment is restored


def _allocate(rank: int, world: int) -> int:
    from perf import heapcount

    heapcount.reset()
    bytearray(50 << 20)  # freed at once; the peak keeps it
    return heapcount.peak()


def test_results_go_to_scratch_unless_recorded():
    """Without ``--record`` a benchmark writes to the scratch folder, never over a tracked figure in
    perf/results/; with it, to perf/results/; ``--tiny`` cannot be recorded."""
    from perf import common

    ap = common.parser("unet", "doc", rounds=2)
    assert common.parse(ap, [], {}).out == common.SCRATCH / "unet.json"
    assert common.parse(ap, ["--record"], {}).out == common.RESULTS / "unet.json"
    assert common.parse(ap, ["--tiny"], {}).out == common.TINY_RESULTS / "unet.json"
    assert not common.SCRATCH.is_relative_to(common.RESULTS)
    with pytest.raises(SystemExit):
        common.parse(ap, ["--tiny", "--record"], {})
    folder = common.parser("harness", "doc", out=False)
    assert common.results_dir(common.parse(folder, [], {})) == common.SCRATCH
