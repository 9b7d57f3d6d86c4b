"""Where a 2-stage pipeline step goes beyond its schedule's bound: per rank, compute inside the
pipeline against the same stage's work with no communication, and the time spent waiting.

Why: ``bench_pipeline`` says how far the pipeline is from the bubble-only bound; this says whether
the rest is the stages computing slower while transfers run (their copies take the same cores) or
waiting for a transfer. Same model and split as ``bench_pipeline``.

    python -m perf pipeline_breakdown --microbatches 1,8
"""

from __future__ import annotations

import contextlib
import statistics
import time

import torch.nn.functional as F

from perf import bench_pipeline as bp
from perf import common

CATS = ("compute", "pipeline", "other")


def job(rank: int, world: int, cfg: dict, ms: list[int], steps: int, name: str) -> dict:
    import torch.distributed as dist

    import hybridpar as hp
    from hybridpar.profiling import StepTimer

    out = {}
    for m in ms:
        batch = bp.batch_of(cfg, m)
        x, y = bp.stack_data(cfg, batch)
        engine = hp.parallelize(bp.make_stack(cfg["size"], cfg["channels"], cfg["depth"]),
                                bp.pipe_spec(cfg, m, name), loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        model, chunks, _, _ = bp._steps(cfg, m)
        stage_step, _ = bp._stage_work(cfg, model, chunks, batch, rank, name)
        timer = StepTimer(clock="cpu")
        pipe, alone = [], []
        for _rep in range(3):  # alternated, as in bench_pipeline; the first step of each untimed
            for i in range(steps + 1):
                common.barrier()
                t0 = time.perf_counter()
                with timer.step() if i else contextlib.nullcontext():
                    engine.train_step(x_local, y_local)
                if i:
                    pipe.append(time.perf_counter() - t0)
            for i in range(steps + 1):
                common.barrier()
                t0 = time.perf_counter()
                stage_step()
                if i:
                    alone.append(time.perf_counter() - t0)
        s = timer.summary()
        mine = {"pipe_ms": 1e3 * statistics.median(pipe), "stage_no_comm_ms": 1e3 * statistics.median(alone),
                **{f"{c}_ms": 1e3 * s.get(c, 0.0) for c in CATS}}
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        out[m] = every
    return out


TINY = {"microbatches": "2", "size": 8, "steps": 1}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("pipeline_breakdown", __doc__, steps=6, max_load=0.6)
    ap.add_argument("--microbatches", default="1,8")
    ap.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    ap.add_argument("--size", type=int, default=24)
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "channels": 16, "depth": 4, "split": 2, "micro": 2, "batch": 0}
    ms = [int(v) for v in args.microbatches.split(",")]
    load = common.wait(args)
    res = common.launch(job, 2, cfg, ms, args.steps, args.schedule, threads=1)
    rows = []
    for m in ms:
        for k, r in enumerate(res[m]):
            rows.append([m, k, r["pipe_ms"], r["stage_no_comm_ms"], r["compute_ms"],
                         f"{100 * (r['compute_ms'] / r['stage_no_comm_ms'] - 1):+.1f} %", r["pipeline_ms"],
                         r["other_ms"]])
    table = common.print_table(
        ["M", "stage", "pipe step ms", "stage alone, no comm ms", "compute in pipe ms", "compute vs no comm",
         "waiting (pipeline) ms", "other ms"], rows,
        title=f"{args.schedule} S=2 at {args.size}^3, micro-batch 2: where the step goes, per stage "
              "(steps: medians; compute and waiting: means)")
    if args.schedule != "gpipe" and args.out.name == "pipeline_breakdown.json":  # the default name
        args.out = args.out.with_name(f"pipeline_breakdown_{args.schedule}.json")
    config = {**cfg, "microbatches": ms, "steps": args.steps, "schedule": args.schedule}
    common.write_json(args, {"config": config, "load": load, "result": res, "table": table})


if __name__ == "__main__":
    main()
