"""Pipeline stage-to-stage transfers over MPI (``HYBRIDPAR_TRANSPORT=mpi``) against gloo, between CPU
ranks of one host.

Why: gloo moves each activation and gradient through TCP loopback (two kernel copies, I/O threads waking
per segment, on the cores the stages compute on); MPI copies between ranks of a host through shared
memory (MPICH by cross-memory attach above a size threshold), once. The ranks are started by mpiexec
and two engines, one per transport, take turns in the same 2 processes, as ``bench_deferred`` measures
the B/W split: the figure is the median of step-by-step ratios gloo / mpi over fresh pairs of processes.
Each engine is checked to move its tensors by the transport it stands for.

    python -m perf transports                       # M = 1, 2, 4, 8; 3 rounds
    python -m perf transports --size 12 --rounds 1 --pairs 4 --no-wait --out /tmp/transports.json
"""

from __future__ import annotations

import os
import statistics

from perf import bench_deferred, common
from perf import bench_pipeline as bp
from perf.ranks import mpiexec

TRANSPORTS = ("mpi", "gloo")  # stepped in turn in the same processes


def _engine(cfg: dict, m: int, transport: str):
    """A step of the engine whose stage-to-stage tensors move by ``transport``."""
    from hybridpar.comm.transport import ENV  # noqa: PLC0415

    os.environ.pop(ENV, None)
    if transport == "mpi":
        os.environ[ENV] = "mpi"  # read when the engine is built (by its first batch, in make_step)
    try:
        engine, step = bench_deferred.make_step(cfg, m)
    finally:
        os.environ.pop(ENV, None)
    used = "mpi" if engine.transport.mpi is not None else "gloo"
    if used != transport:
        raise RuntimeError(f"bench_transports: the {transport} engine moves its tensors by {used}")
    return step


def _mpi_library() -> str:
    """The MPI library's name and version, without initialising MPI in this process."""
    import mpi4py  # noqa: PLC0415

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI  # noqa: PLC0415

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def main(argv: list[str] | None = None) -> None:
    ap = bench_deferred.parser("transports", __doc__)
    args = common.parse(ap, argv, bench_deferred.TINY)
    if mpiexec() is None:
        raise SystemExit("bench_transports: no mpiexec on PATH or beside this Python (pip install mpich)")
    ms, cfg = bench_deferred.job_config(args, "transport")
    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    samples: dict = {}
    for r in range(args.rounds):
        order = ms if r % 2 == 0 else ms[::-1]
        for k, v in common.launch(bench_deferred.time_job, 2, cfg, order, args.pairs, TRANSPORTS, _engine,
                                  threads=1, mpi=True).items():
            samples.setdefault(k, []).append(v)
        print(f"round {r + 1}/{args.rounds} done (load {common.loadavg()[0]:.2f})", flush=True)
    load_end = common.loadavg()
    library = _mpi_library()

    rows, result = [], {}
    for m in ms:
        step_ms = {v: 1e3 * statistics.median(t for rd in samples[f"{v} M={m}"] for t in rd)
                   for v in TRANSPORTS}
        over = bench_deferred.ratios(samples[f"mpi M={m}"], samples[f"gloo M={m}"])
        result[m] = {**{f"{v}_ms": step_ms[v] for v in TRANSPORTS}, "gloo_over_mpi": over}
        rows.append([m, bp.batch_of(cfg, m), step_ms["mpi"], step_ms["gloo"], f"{over['median']:.3f}",
                     "-".join(f"{q:.3f}" for q in over["iqr"]),
                     " ".join(f"{q:.3f}" for q in over["per_round"])])
    table = common.print_table(
        ["M", "batch", "mpi ms", "gloo ms", "gloo / mpi", "IQR", "per round"], rows,
        title=f"Same-host stage-to-stage transfers, MPI ({library}) vs gloo, stepped in turn in the same 2 "
              f"processes started by mpiexec: {args.schedule}, S = 2, 2 ranks x 1 thread, {args.depth} x "
              f"Conv3d {args.channels} k3 at {args.size}^3, micro-batch {args.micro} ({args.rounds} rounds x "
              f"{args.pairs} turns; ratios: medians of step-by-step ratios; 1-min load "
              f"{load['load_at_start'][0]:.2f} -> {load_end[0]:.2f})")
    config = {**cfg, "microbatches": ms, "rounds": args.rounds, "pairs": args.pairs, "threads_per_process": 1,
              "transports": TRANSPORTS, "launcher": "mpiexec", "mpi_library": library, "dtype": "float32",
              "mpich_settings": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}}
    common.write_json(args, {"config": config, "load": {**load, "load_at_end": load_end}, "result": result,
                             "samples_s": samples, "table": table})


if __name__ == "__main__":
    main()
