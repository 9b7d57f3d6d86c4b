"""One-way time of a point-to-point message between 2 ranks of one host: gloo, and MPI with ``--mpi``.

Why: the pipeline hands each activation and gradient to the next stage; this isolates what one
hand-over costs (a ping-pong, half the round trip), without the compute around it: gloo's TCP
loopback, and with ``--mpi`` (the pair started by mpiexec) the MPI transport
(:class:`hybridpar.comm.transport.MPIP2P`, shared memory between ranks of a host) in turns with it.

    python -m perf p2p_latency --mpi    # 8 B and 1.7 MiB (2 x 16 x 24^3 float32)
    python -m perf p2p_latency          # gloo alone (no mpiexec needed)
"""

from __future__ import annotations

import statistics
import time

from perf import common


def job(rank: int, world: int, sizes: list[int], reps: int, rounds: int, mpi: bool = False) -> dict:
    import torch
    import torch.distributed as dist

    from hybridpar.comm.transport import MPIP2P

    ways = {"gloo": (lambda t, p: dist.isend(t, p, tag=1), lambda t, p: dist.irecv(t, p, tag=1))}
    if mpi:
        over = MPIP2P()
        ways["mpi"] = (lambda t, p: over.isend(t, p, 1), lambda t, p: over.irecv(t, p, 1))
    out: dict = {}
    for n in sizes:
        t = torch.zeros(max(n // 4, 1))
        names = list(ways)
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                send, recv = ways[name]
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    if rank == 0:
                        send(t, 1).wait()
                        recv(t, 1).wait()
                    else:
                        recv(t, 0).wait()
                        send(t, 0).wait()
                out.setdefault(f"{name} {n}", []).append((time.perf_counter() - t0) / (2 * reps))
    return out


TINY = {"sizes": "8,4096", "reps": 5, "rounds": 2}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("p2p_latency", __doc__, rounds=6, max_load=1.0)
    ap.add_argument("--sizes", default="8,1769472", help="message bytes (comma list)")
    ap.add_argument("--reps", type=int, default=200, help="round trips per sample")
    ap.add_argument("--mpi", action="store_true", help="start the pair with mpiexec and time MPI too")
    args = common.parse(ap, argv, TINY)
    sizes = [int(v) for v in args.sizes.split(",")]
    load = common.wait(args)
    samples = common.launch(job, 2, sizes, args.reps, args.rounds, args.mpi, threads=1, mpi=args.mpi)
    rows, result = [], {}
    for n in sizes:
        gloo = statistics.median(samples[f"gloo {n}"]) * 1e6
        result[n] = {"gloo_us": gloo}
        rows.append([n, f"{gloo:.1f}"])
        if args.mpi:
            mpi = statistics.median(samples[f"mpi {n}"]) * 1e6
            result[n].update(mpi_us=mpi, gloo_over_mpi=gloo / mpi)
            rows[-1] += [f"{mpi:.1f}", f"{gloo / mpi:.2f}"]
    table = common.print_table(["bytes", "gloo us"] + (["mpi us", "gloo / mpi"] if args.mpi else []), rows,
                               title=f"One-way message time, 2 ranks of one host, ping-pong ({args.rounds} "
                                     f"alternated samples x {args.reps} round trips, medians)")
    common.write_json(args, {"load": load, "result": result, "samples_s": samples, "table": table})


if __name__ == "__main__":
    main()
