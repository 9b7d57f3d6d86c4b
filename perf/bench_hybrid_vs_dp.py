"""Spatial and pipeline parallelism against pure data parallelism at equal rank count (2 ranks).

Why: spatial and pipeline parallelism exist for volumes that do not fit one device; where data
parallelism *does* fit, it is the baseline they must be compared with: same ranks, same global
batch, same model, each layout's throughput, and where each wins.

Model: the CosmoFlow network resized (``cosmoflow.model.build_model(V, n_conv=4, base_filters=16,
dropout=0)``: 4 x [Conv3d k3 p1 -> LeakyReLU(0.3) -> MaxPool3d(2)], 16-32-64-128 channels, 4 input
channels, dense 128 -> 64 -> 4, tanh x 1.2); MSE loss; float32; random input and target, the same on
every rank. Dropout is off so that every layout computes the same numbers (checked: the first step's
loss against one process).

Layouts (all 2 ranks x 1 thread, gloo, except the reference), same global batch B:

* ``1 rank``: plain torch.nn in one process, whole batch (the reference for speedups);
* ``data=2``: 2 replicas of B/2 samples, gradients all-reduced (bucketed, overlapped);
* ``spatial (2,1,1)``: B samples, the volume split in depth; the dense head runs replicated;
* ``pipe=2, M``: 2 stages (``stages: auto``, balanced by training FLOPs), GPipe, M micro-batches.

Reported per layout: step time (median, slowest rank), samples/s, speedup over 1 rank, and the peak of
activations autograd holds per rank (``SavedActivations``, one extra untimed step).

    python -m perf hybrid_vs_dp                    # V = 32, 64; B = 4, 8; 2 rounds
    python -m perf hybrid_vs_dp --sizes 32 --batches 4 --rounds 1 --steps 2 --no-wait \\
        --out /tmp/hybrid_vs_dp.json
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from hybridpar.profiling.saved_memory import SavedActivations
from perf import common

RANKS = 2


def make_model(size: int, seed: int = 0):
    from cosmoflow.model import build_model

    torch.manual_seed(seed)
    return build_model(size, n_conv=4, base_filters=16, dropout=0.0)


def make_data(size: int, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 4, size, size, size, generator=g), torch.rand(batch, 4, generator=g) * 2 - 1


def layouts(batch: int, ms: list[int]) -> dict[str, dict]:
    """The 2-rank layouts that fit ``batch``, by name."""
    out = {"data=2": {"grid": {"data": RANKS}},
           "spatial (2,1,1)": {"grid": {"spatial": [RANKS, 1, 1]}}}
    for m in ms:
        if batch % m == 0:
            out[f"pipe=2 M={m}"] = {"grid": {"pipe": RANKS},
                                    "pipeline": {"schedule": "gpipe", "microbatches": m, "stages": "auto"}}
    return out


def single_job(rank: int, world: int, cfg: dict, runs: list[tuple[int, int]]) -> dict:
    """The reference: one process, plain torch.nn, whole batch."""
    out: dict = {"single_loss": {}, "single_saved_mib": {}}
    for size, batch in runs:
        model = make_model(size)
        params = list(model.parameters())
        x, y = make_data(size, batch)

        def step(model=model, params=params, x=x, y=y):
            for p in params:
                p.grad = None
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss

        key = f"V={size} B={batch}"
        out["single_loss"][key] = step().item()
        out[f"{key} 1 rank"] = common.time_steps(step, cfg["warmup"], cfg["steps"])
        with SavedActivations(params) as saved:
            step()
        out["single_saved_mib"][key] = saved.peak_bytes / 2 ** 20
    return out


def dist_job(rank: int, world: int, cfg: dict, runs: list[tuple[int, int, str, dict]]) -> dict:
    """Every 2-rank layout of every (V, B), one after another in one process group."""
    import torch.distributed as dist

    import hybridpar as hp

    out: dict = {"dist_loss": {}, "dist_saved_mib": {}, "stage_starts": {}}
    for size, batch, name, spec in runs:
        x, y = make_data(size, batch)
        engine = hp.parallelize(make_model(size), spec, loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        params = engine.parameters()

        def step(engine=engine, params=params, x_local=x_local, y_local=y_local):
            for p in params:
                p.grad = None
            return engine.train_step(x_local, y_local)

        key = f"V={size} B={batch} {name}"
        out["dist_loss"][key] = step().item()
        times = common.time_steps(step, cfg["warmup"], cfg["steps"], before=common.barrier)
        out[key] = common.slowest_rank(times)
        with SavedActivations(params) as saved:
            step()
        per_rank: list = [None] * world
        dist.all_gather_object(per_rank, saved.peak_bytes / 2 ** 20)
        out["dist_saved_mib"][key] = per_rank
        plan = engine.plan
        out["stage_starts"][key] = [lp.name for i, lp in enumerate(plan)
                                    if i and lp.stage != plan[i - 1].stage]
    return out


TINY = {"sizes": "32", "batches": "4", "microbatches": "2", "rounds": 1, "steps": 1, "warmup": 1}  # seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("hybrid_vs_dp", __doc__, rounds=2, steps=4, warmup=1, max_load=0.6, pin=True)
    ap.add_argument("--sizes", default="32,64", help="volume edges V (default 32,64)")
    ap.add_argument("--batches", default="4,8", help="global batches B (default 4,8)")
    ap.add_argument("--microbatches", default="2,4", help="pipeline M values (default 2,4)")
    args = common.parse(ap, argv, TINY)
    sizes = [int(v) for v in args.sizes.split(",")]
    batches = [int(v) for v in args.batches.split(",")]
    ms = [int(v) for v in args.microbatches.split(",")]
    cfg = {"warmup": args.warmup, "steps": args.steps}
    single_runs = [(v, b) for v in sizes for b in batches]
    dist_runs = [(v, b, name, spec) for v, b in single_runs for name, spec in layouts(b, ms).items()]

    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    samples, rounds = common.alternate(args.rounds, [
        lambda r: common.launch(single_job, 1, cfg, single_runs if r % 2 == 0 else single_runs[::-1],
                                threads=1, group=False, pin=args.pin),
        lambda r: common.launch(dist_job, RANKS, cfg, dist_runs if r % 2 == 0 else dist_runs[::-1],
                                threads=1, pin=args.pin)])
    load_end = common.loadavg()

    stats = {n: common.summarize(t) for n, t in samples.items()}
    med = {n: s["median_ms"] for n, s in stats.items()}
    rows, result = [], {}
    for v, b in single_runs:
        key = f"V={v} B={b}"
        ref = med[f"{key} 1 rank"]
        names = ["1 rank", *layouts(b, ms)]
        best = min(names[1:], key=lambda n: med[f"{key} {n}"])
        result[key] = {"best_2_rank_layout": best}
        for name in names:
            k = f"{key} {name}"
            if name == "1 rank":
                saved = [rounds[0]["single_saved_mib"][key]]
                err = 0.0
            else:
                saved = rounds[0]["dist_saved_mib"][k]
                err = max(abs(rd["dist_loss"][k] - rd["single_loss"][key]) / abs(rd["single_loss"][key])
                          for rd in rounds)
            per_round = [statistics.median(rd[f"{key} 1 rank"]) / statistics.median(rd[k]) for rd in rounds]
            result[key][name] = {"step_ms": med[k], "samples_s": 1e3 * b / med[k], "speedup": ref / med[k],
                                 "speedup_per_round": per_round, "saved_activations_peak_mib_per_rank": saved,
                                 "loss_rel_err_vs_1_rank": err,
                                 "stage_starts": rounds[0]["stage_starts"].get(k)}
            rows.append([v, b, name + (" *" if name == best else ""), med[k],
                         f"{stats[k]['q1_ms']:.0f}-{stats[k]['q3_ms']:.0f}", 1e3 * b / med[k],
                         f"{ref / med[k]:.2f}", f"{min(per_round):.2f}-{max(per_round):.2f}",
                         " / ".join(f"{s:.0f}" for s in saved), f"{err:.0e}"])
    table = common.print_table(
        ["V", "B", "layout", "median ms", "IQR ms", "samples/s", "speedup vs 1 rank", "per round",
         "saved act. MiB per rank", "loss rel. err"], rows,
        title=f"2 ranks x 1 thread (gloo): data / spatial / pipeline on CosmoFlow-like "
              f"(4 conv, 16-128 ch, dense 128-64-4), float32, global batch B; * = fastest 2-rank layout "
              f"({args.rounds} rounds x {args.steps} steps; 1-min load {load['load_at_start'][0]:.2f} -> "
              f"{load_end[0]:.2f})")
    common.write_json(args, {
        "config": {**cfg, "sizes": sizes, "batches": batches, "microbatches": ms, "rounds": args.rounds,
                   "ranks": RANKS,
                   "layouts": {n: s for _, b in single_runs for n, s in layouts(b, ms).items()},
                   "model": "cosmoflow.model.build_model(V, n_conv=4, base_filters=16, dropout=0.0)",
                   "dtype": "float32", "threads_per_process": 1, "pin": args.pin, "backend": "gloo",
                   "step": "grads set to None, forward, MSE loss, backward (no optimizer step)",
                   "saved_activations": "peak distinct storage bytes held by autograd for backward "
                                        "(saved_tensors_hooks), weights excluded, per rank"},
        "load": {**load, "load_at_end": load_end},
        "stats": stats, "result": result, "rounds": rounds, "table": table})


if __name__ == "__main__":
    main()
