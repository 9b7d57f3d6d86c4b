"""Stage-to-stage transfers by cross-memory attach (``parallelize(..., local_p2p=...)``) against gloo,
and with ``--mpi`` against MPI too.

Why: on a CPU host gloo moves each activation and gradient through TCP loopback (two kernel copies,
I/O threads waking per segment, on the cores the stages compute on); ``hybridpar.comm.local_p2p``
lets the receiver copy the sender's tensor once. MPI does the same between ranks of one host (MPICH
copies through shared memory, by cross-memory attach above a size threshold), so our own transport
is worth keeping only where it beats MPI too. Measured exactly as ``bench_deferred`` measures the
B/W split: engines in the same 2 processes, stepped in turn, the median of step-by-step ratios
over fresh pairs of processes. Without ``--mpi``: local p2p on and off, then each variant's peak
heap per stage over one step, in fresh processes. With ``--mpi``: the ranks are started by mpiexec
and three engines take turns (local p2p; MPI, ``HYBRIDPAR_TRANSPORT=mpi``; gloo); the figures are
gloo / local and mpi / local; no memory part.

    python -m perf local_p2p                       # M = 1, 2, 4, 8; 3 rounds
    python -m perf local_p2p --mpi                 # local p2p, MPI and gloo: results/local_p2p_mpi.json
    python -m perf local_p2p --size 12 --rounds 1 --pairs 4 --no-wait --out /tmp/local_p2p.json
"""

from __future__ import annotations

import argparse
import os
import statistics

from perf import bench_deferred, common
from perf import bench_pipeline as bp

WHAT = "Same-host transfers by cross-memory attach (local p2p)"
TRANSPORTS = ("local", "mpi", "gloo")  # with --mpi, stepped in turn in the same processes


def _engine(cfg: dict, m: int, transport: str):
    """A step of the engine whose stage-to-stage tensors move by ``transport`` (checked, so that a
    pair that could not form does not pass for it)."""
    from hybridpar.comm.transport import ENV  # noqa: PLC0415

    os.environ.pop(ENV, None)
    if transport == "mpi":
        os.environ[ENV] = "mpi"  # read when the engine is built (by its first batch, in make_step)
    try:
        engine, step = bench_deferred.make_step(cfg, m, local_p2p=transport == "local")
    finally:
        os.environ.pop(ENV, None)
    st = engine.transport
    used = "local" if st.local is not None and st.local.peers else "mpi" if st.mpi is not None else "gloo"
    if used != transport:
        raise RuntimeError(f"bench_local_p2p: the {transport} engine moves its tensors by {used}")
    return step


def _mpi_library() -> str:
    """The MPI library's name and version, without initialising MPI in this process."""
    import mpi4py  # noqa: PLC0415

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI  # noqa: PLC0415

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


def three_way(args: argparse.Namespace) -> None:
    """Local p2p, MPI and gloo in turn, under mpiexec (see module doc)."""
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
        base = samples[f"local M={m}"]
        over = {v: bench_deferred.ratios(base, samples[f"{v} M={m}"]) for v in ("gloo", "mpi")}
        result[m] = {**{f"{v}_ms": step_ms[v] for v in TRANSPORTS},
                     **{f"{v}_over_local": over[v] for v in over}}
        rows.append([m, bp.batch_of(cfg, m), step_ms["local"], step_ms["mpi"], step_ms["gloo"],
                     *(x for v in ("gloo", "mpi") for x in (
                         f"{over[v]['median']:.3f}", "-".join(f"{q:.3f}" for q in over[v]["iqr"]),
                         " ".join(f"{q:.3f}" for q in over[v]["per_round"])))])
    table = common.print_table(
        ["M", "batch", "local ms", "mpi ms", "gloo ms", "gloo / local", "IQR", "per round", "mpi / local",
         "IQR", "per round"], rows,
        title=f"Same-host stage-to-stage transfers, local p2p vs MPI ({library}) vs gloo, stepped in turn in "
              f"the same 2 processes started by mpiexec: {args.schedule}, S = 2, 2 ranks x 1 thread, "
              f"{args.depth} x Conv3d {args.channels} k3 at {args.size}^3, micro-batch {args.micro} "
              f"({args.rounds} rounds x {args.pairs} turns; ratios: medians of step-by-step ratios; "
              f"1-min load {load['load_at_start'][0]:.2f} -> {load_end[0]:.2f})")
    config = {**cfg, "microbatches": ms, "rounds": args.rounds, "pairs": args.pairs, "threads_per_process": 1,
              "transports": TRANSPORTS, "launcher": "mpiexec", "mpi_library": library, "dtype": "float32",
              "mpich_settings": {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}}
    common.write_json(args, {"config": config, "load": {**load, "load_at_end": load_end}, "result": result,
                             "samples_s": samples, "table": table})


def main(argv: list[str] | None = None) -> None:
    ap = bench_deferred.parser("local_p2p", __doc__)
    ap.add_argument("--mpi", action="store_true",
                    help="start the ranks with mpiexec; time local p2p, MPI and gloo in turn (no memory)")
    args = common.parse(ap, argv, bench_deferred.TINY)
    if not args.mpi:
        bench_deferred.run(args, "local_p2p", WHAT)
        return
    if args.out == (common.TINY_RESULTS if args.tiny else common.RESULTS) / "local_p2p.json":
        args.out = args.out.with_name("local_p2p_mpi.json")  # the default: beside the on/off figures
    three_way(args)


if __name__ == "__main__":
    main()
