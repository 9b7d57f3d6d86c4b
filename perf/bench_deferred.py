"""The B/W split of a stage's last backward (``parallelize(..., defer_weight_grads=...)``), on and off.

Why: the split is meant to shorten the pipeline's drain by the weight gradients of the last stage's
last backward (the previous stage starts its last backward that much earlier) without raising any
stage's peak memory. Both are measured here against the same engine with the split off:

* time: two engines (on, off) built in the same 2 processes, stepped **alternately, one step each**
  (this VM's speed drifts within seconds), every step's time the slowest rank's; the figure is the
  median of the per-pair ratios off / on over ``--rounds`` fresh pairs of processes. Where the
  stage holds two or more micro-batches (GPipe, M >= 2) the whole stage's last backward is split;
  where it holds one (GPipe M = 1, 1F1B's last stage), a prefix up to its first convolution;
* memory: peak heap over one step (``heapcount``: malloc's own count), fresh processes per
  (variant, M), as in ``bench_vs_torch_pipelining``.

Same model, split and data as ``bench_pipeline`` (S = 2, GPipe, micro-batches of 2 samples).
``bench_transports`` times MPI against gloo the same way.

    python -m perf deferred                       # M = 1, 2, 4, 8; 3 rounds
    python -m perf deferred --size 12 --rounds 1 --pairs 4 --no-wait --out /tmp/deferred.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch.nn.functional as F

from perf import bench_pipeline as bp
from perf import common, heapcount

VARIANTS = ("on", "off")


def _engine(cfg: dict, m: int, variant: str):
    return make_step(cfg, m, **{cfg["option"]: variant == "on"})[1]


def make_step(cfg: dict, m: int, **options):
    """The benchmark's engine, built with ``parallelize(..., **options)``, and a train-step callable."""
    import hybridpar as hp

    engine = hp.parallelize(bp.make_stack(cfg["size"], cfg["channels"], cfg["depth"]),
                            bp.pipe_spec(cfg, m, cfg["schedule"]), loss_fn=F.mse_loss, **options)
    x, y = bp.stack_data(cfg, bp.batch_of(cfg, m))
    x_local, y_local = engine.shard_batch(x, y)
    params = engine.parameters()

    def step():
        for p in params:
            p.grad = None
        return engine.train_step(x_local, y_local)

    return engine, step


def time_job(rank: int, world: int, cfg: dict, ms: list[int], pairs: int,
             variants: tuple[str, ...] = VARIANTS, engine=_engine) -> dict:
    """Per variant and M, the slowest rank's time of each step; ``engine(cfg, m, variant)`` builds a
    step. The variants take turns, the first of each turn rotating, so that none always goes first."""
    out: dict = {}
    for m in ms:
        steps = {v: engine(cfg, m, v) for v in variants}
        for v in variants:
            common.time_steps(steps[v], 2, 0, before=common.barrier)  # warm-up
        for i in range(pairs):
            for v in variants[i % len(variants):] + variants[:i % len(variants)]:
                common.barrier()
                t0 = time.perf_counter()
                steps[v]()
                out.setdefault(f"{v} M={m}", []).append(time.perf_counter() - t0)
    return {k: common.slowest_rank(v) for k, v in out.items()}


def memory_job(rank: int, world: int, cfg: dict, m: int, variant: str) -> list[dict]:
    import torch.distributed as dist

    import hybridpar  # noqa: F401 (imported before the base line)

    base = heapcount.current()
    step = _engine(cfg, m, variant)
    for _ in range(2):
        step()
    common.barrier()
    heapcount.reset()
    step()
    mine = {"stage": rank, "peak_heap_over_base_mib": (heapcount.peak() - base) / 2 ** 20}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


TINY = {"size": 8, "channels": 4, "microbatches": "2", "rounds": 1, "pairs": 2, "memory": False}  # seconds


def ratios(base: list[list[float]], other: list[list[float]]) -> dict:
    """``other / base`` step by step (both: per round, the times of the steps taken in turn): the
    median of those ratios, their interquartile range, and each round's median."""
    pooled = sorted(b / a for ra, rb in zip(base, other) for a, b in zip(ra, rb))
    q1, q3 = (pooled[int(q * (len(pooled) - 1))] for q in (0.25, 0.75))
    return {"median": statistics.median(pooled), "iqr": [q1, q3],
            "per_round": [statistics.median(b / a for a, b in zip(ra, rb)) for ra, rb in zip(base, other)]}


def parser(name: str, doc: str) -> argparse.ArgumentParser:
    """The flags of this benchmark (and of those measured its way, ``bench_transports``)."""
    ap = common.parser(name, doc, rounds=3, max_load=0.6)
    bp.add_model_args(ap)
    ap.add_argument("--microbatches", default="1,2,4,8")
    ap.add_argument("--schedule", default="gpipe", choices=("gpipe", "1f1b"))
    ap.add_argument("--pairs", type=int, default=16, help="on/off step pairs per M and round (default 16)")
    ap.add_argument("--no-memory", dest="memory", action="store_false")
    return ap


def job_config(args: argparse.Namespace, option: str) -> tuple[list[int], dict]:
    """The micro-batch counts and the job's configuration from the parsed flags."""
    ms = [int(v) for v in args.microbatches.split(",")]
    return ms, {**bp.model_config(args), "batch": 0, "schedule": args.schedule, "option": option}


def main(argv: list[str] | None = None) -> None:
    run(common.parse(parser("deferred", __doc__), argv, TINY), "defer_weight_grads",
        "B/W split of the last backward")


def run(args: argparse.Namespace, option: str, what: str) -> None:
    """Time (and, unless ``--no-memory``, weigh) ``option`` on against off, as the module doc says."""
    ms, cfg = job_config(args, option)
    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    samples: dict = {}
    for r in range(args.rounds):
        order = ms if r % 2 == 0 else ms[::-1]
        for k, v in common.launch(time_job, 2, cfg, order, args.pairs, threads=1).items():
            samples.setdefault(k, []).append(v)
        print(f"round {r + 1}/{args.rounds} done (load {common.loadavg()[0]:.2f})", flush=True)
    memory: dict = {}
    if args.memory:
        env = {"MALLOC_MMAP_THRESHOLD_": "65536", "HYBRIDPAR_MALLOC_TUNING": "0", **heapcount.preload_env()}
        os.environ.update(env)
        try:
            for m in ms:
                for v in VARIANTS:
                    memory[f"{v} M={m}"] = common.launch(memory_job, 2, cfg, m, v, threads=1)
        finally:
            for k in env:
                os.environ.pop(k, None)
    load_end = common.loadavg()

    rows, result = [], {}
    for m in ms:
        on = [t for rd in samples[f"on M={m}"] for t in rd]
        off = [t for rd in samples[f"off M={m}"] for t in rd]
        speedup = ratios(samples[f"on M={m}"], samples[f"off M={m}"])
        (q1, q3), per_round = speedup["iqr"], speedup["per_round"]
        heap = {v: [r["peak_heap_over_base_mib"] for r in memory[f"{v} M={m}"]] for v in VARIANTS} \
            if memory and heapcount.library() else None
        result[m] = {"on_ms": 1e3 * statistics.median(on), "off_ms": 1e3 * statistics.median(off),
                     "speedup_median_of_pairs": speedup["median"], "speedup_iqr": [q1, q3],
                     "speedup_per_round": per_round, "peak_heap_over_base_mib": heap,
                     "split": "whole stage" if m >= 2 and cfg["schedule"] == "gpipe" else "prefix"}
        fmt = (lambda v: " / ".join(f"{x:.3f}" for x in v)) if heap else (lambda v: "")  # noqa: E731
        rows.append([m, bp.batch_of(cfg, m), result[m]["split"],
                     result[m]["off_ms"], result[m]["on_ms"], f"{speedup['median']:.3f}",
                     f"{q1:.3f}-{q3:.3f}", " ".join(f"{x:.3f}" for x in per_round),
                     fmt(heap["off"]) if heap else "", fmt(heap["on"]) if heap else ""])
    table = common.print_table(
        ["M", "batch", "split (stage 1)", "off ms", "on ms", "speedup off/on (median of pairs)", "IQR",
         "per round", "peak heap off MiB (stage 0 / 1)", "peak heap on MiB (0 / 1)"], rows,
        title=f"{what}, on vs off: {args.schedule}, S = 2, 2 ranks x 1 thread, gloo, "
              f"{args.depth} x Conv3d {args.channels} k3 at {args.size}^3, micro-batch {args.micro} "
              f"({args.rounds} rounds x {args.pairs} alternated pairs; 1-min load "
              f"{load['load_at_start'][0]:.2f} -> {load_end[0]:.2f})")
    config = {**cfg, "microbatches": ms, "rounds": args.rounds, "pairs": args.pairs, "threads_per_process": 1,
              "backend": "gloo", "dtype": "float32"}
    common.write_json(args, {"config": config, "load": {**load, "load_at_end": load_end},
                                 "result": result, "samples_s": samples, "memory": memory, "table": table})


if __name__ == "__main__":
    main()
