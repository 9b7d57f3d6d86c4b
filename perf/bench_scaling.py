"""Strong scaling on this machine: one volume, 2 ranks x 1 thread against 1 process x 2 threads.

Why: on a node, the alternative to spatial parallelism is to give one process all the cores and let
torch's intra-op threads share the work. Splitting the volume over ranks only pays if it beats that.
The CosmoFlow-like stack (Conv3d 4->32 k3 p1, LeakyReLU(0.3), MaxPool3d(2), Conv3d 32->64 k3 p1,
LeakyReLU(0.3), MaxPool3d(2); batch 1; forward + backward; float32) runs on an S^3 x 4 volume:

* ``threads``: 1 process x 2 threads, plain ``torch.nn`` on the whole volume (what a user would run),
  and the same with each conv zero-padding explicitly and running with ``padding=0`` (the torch
  kernel the overlapped DistConv3d runs; torch's CPU conv speed depends on the padding argument);
* ``dist``: 2 ranks x 1 thread, split (2, 1, 1), with ``overlap=False`` and ``overlap=True``.

speedup = T(1 process x 2 threads) / T(2 ranks) on step-time medians; goal: >= 1.0.
"fastest steps" is the same ratio of the minima, which interference from other work on a shared
machine (it only ever adds time) distorts least. The jobs run one after another (never at the same
time) and alternate for ``--rounds`` rounds.

    python -m perf scaling                      # S=128, 3 rounds x 4 steps
    python -m perf scaling --size 32 --rounds 2 --steps 2 --no-wait --out /tmp/scaling.json
"""

from __future__ import annotations

import statistics
import time

import torch

from perf import common

RANKS = 2
BASE = ["1 proc x 2 threads", "1 proc x 2 threads pre-padded"]
DIST = ["dist overlap=False", "dist overlap=True"]
NAMES = BASE + DIST


def threads_job(rank: int, world: int, cfg: dict, order: list[str]) -> dict:
    """Baselines: plain torch.nn on the whole volume, all cores as intra-op threads, no process group."""
    s = cfg["size"]
    torch.manual_seed(1)
    x = torch.randn(1, 4, s, s, s)
    out: dict = {"threads": torch.get_num_threads()}
    for name in order:
        step = common.train_step(common.cosmo_stack(None, prepad=name.endswith("pre-padded")), x)
        out[name] = common.time_steps(step, cfg["warmup"], cfg["steps"])
    return out


def dist_job(rank: int, world: int, cfg: dict, order: list[str]) -> dict:
    """hybridpar on the same volume split (world, 1, 1), one thread per rank, both overlap settings."""
    import hybridpar as hp

    s = cfg["size"]
    grid = hp.ProcessGrid(spatial=(world, 1, 1))
    torch.manual_seed(1)
    x = torch.randn(1, 4, s, s, s)
    x_local = hp.scatter(x, grid).detach()
    models = {n: common.cosmo_stack(grid, overlap=n.endswith("True")) for n in DIST}
    # the split stack gives what torch.nn gives on the whole volume
    errors = common.check_against_torch(models, x, x_local, grid) if cfg["check"] else {}
    out: dict = {"max_abs_err_vs_torch": errors, "threads": torch.get_num_threads()}
    for name in order:
        times = common.time_steps(common.train_step(models[name], x_local), cfg["warmup"], cfg["steps"],
                                  before=common.barrier)
        out[name] = common.slowest_rank(times)
    return out


TINY = {"size": 16, "rounds": 1, "steps": 1, "warmup": 1}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("scaling", __doc__, rounds=3, steps=4, warmup=1, max_load=0.5, pin=True)
    ap.add_argument("--size", type=int, default=128, help="edge S of the cubic volume (default 128)")
    ap.add_argument("--threads", type=int, default=2, help="threads of the 1-process baseline (default 2)")
    ap.add_argument("--no-check", dest="check", action="store_false",
                    help="skip the check of the split stack against torch.nn")
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "warmup": args.warmup, "steps": args.steps, "check": args.check}

    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    t0 = time.monotonic()
    samples, rounds = common.alternate(args.rounds, [
        lambda r: common.launch(threads_job, 1, cfg, common.swap(BASE, r), threads=args.threads, group=False,
                                pin=args.pin),
        lambda r: common.launch(dist_job, RANKS, cfg, common.swap(DIST, r), threads=1, pin=args.pin)])
    load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
    round_loads = [rd["load"][0] for rd in rounds]
    noisy = common.disturbed(round_loads, max(RANKS, args.threads))

    for rnd in rounds:
        med = {n: statistics.median(rnd[n]) for n in NAMES}
        rnd["speedup"] = {n: med[BASE[0]] / med[n] for n in DIST}
        rnd["speedup_same_kernels"] = {n: med[BASE[1]] / med[n] for n in DIST}
    stats = {n: common.summarize(samples[n]) for n in NAMES}
    med = {n: stats[n]["median_ms"] for n in NAMES}
    iqr = lambda n: f"{stats[n]['q1_ms']:.0f}-{stats[n]['q3_ms']:.0f}"  # noqa: E731
    rows = [[f"1 process x {args.threads} threads, torch.nn (padding=1), whole volume", med[BASE[0]],
             iqr(BASE[0]), 1.0, "", "", "", ""],
            [f"1 process x {args.threads} threads, F.pad + conv padding=0 (overlapped kernel)",
             med[BASE[1]], iqr(BASE[1]), med[BASE[0]] / med[BASE[1]], "", "", "", ""]]
    result = {}
    for n in DIST:
        speedup, same = med[BASE[0]] / med[n], med[BASE[1]] / med[n]
        per_round = [rd["speedup"][n] for rd in rounds]
        best = stats[BASE[0]]["min_ms"] / stats[n]["min_ms"]
        result[n] = {"speedup": speedup, "speedup_per_round": per_round, "goal": 1.0,
                     "speedup_of_fastest_steps": best,
                     "meets_goal": speedup >= 1.0, "speedup_same_kernels": same,
                     "speedup_same_kernels_per_round": [rd["speedup_same_kernels"][n] for rd in rounds]}
        rows.append([f"{n}: 2 ranks x 1 thread, split (2,1,1)", med[n], iqr(n), speedup,
                     f"{min(per_round):.3f} .. {max(per_round):.3f}", best, same, ">= 1.0"])
    s = args.size
    table = common.print_table(
        ["config", "median ms", "IQR ms", "speedup", "per-round speedup", "fastest steps", "vs pre-padded",
         "goal"], rows,
        title=f"Strong scaling: CosmoFlow-like stack, {s}^3 x 4, batch 1, fwd+bwd, float32 "
              f"({args.rounds} rounds x {args.steps} steps; 1-min load {load['load_at_start'][0]:.2f} -> "
              f"{load_end[0]:.2f}, the benchmark's own processes included)"
              f"{'; DISTURBED by other work' if noisy else ''}")
    common.write_json(args, {
        "config": {**cfg, "rounds": args.rounds, "ranks": RANKS, "split": [RANKS, 1, 1],
                   "global_volume": [s, s, s], "local_volume": [s // RANKS, s, s], "channels": 4,
                   "batch": 1, "dtype": "float32", "threads_per_rank": 1,
                   "baseline_threads": args.threads, "pin": args.pin,
                   "stack": common.COSMO_STACK, "step": common.TRAIN_STEP},
        **common.round_record(load, load_end, run_s, round_loads, noisy),
        "stats": stats, "result": result, "rounds": rounds, "table": table})


if __name__ == "__main__":
    main()
