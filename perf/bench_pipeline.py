"""Pipeline efficiency: GPipe over S = 2 stages against the ideal S * M / (M + S - 1), M = 1, 2, 4, 8.

Why: a synchronous pipeline of S stages and M micro-batches idles for (S - 1) of its M + S - 1 clock
ticks (the bubble), so its best possible speedup over one rank running the whole model is
S * M / (M + S - 1). What is lost beyond that (sends and receives, stage imbalance, the engine's own
bookkeeping, smaller kernels) is what this measures.

Model (``make_stack``): ``depth`` x [Conv3d C->C k3 p1, LeakyReLU(0.3)], MaxPool3d(2), Flatten,
Linear(C (V/2)^3 -> 4); MSE loss; float32. The pipeline's second stage starts at conv ``depth // 2``
(``--split``). Input and target are random, the same on every rank.

Batch: by default the *micro-batch size is fixed* (``--micro``, 2 samples) and the batch is
``micro * M``, so every configuration runs the same kernels. ``--batch B`` instead fixes the
per-replica batch and splits it into M micro-batches. Conv3d on CPU with a batch of 1 falls off
oneDNN onto ``slow_conv3d`` when N*C*D*H <= 20480 (6-10x slower per sample, see PIPELINE.md); the
default keeps every kernel on oneDNN.

Configurations, each in fresh processes, 1 thread per process:

* ``whole``: 1 process, no process group, the whole batch through plain ``torch.nn`` at once;
* ``accum``: the same, but the M micro-batches one after another with gradient accumulation (the
  work a pipeline stage does, without the pipeline);
* ``pipe``: 2 ranks (gloo), ``hp.parallelize(model, {grid: {pipe: 2}, pipeline: {microbatches: M}})``,
  ``engine.train_step``; a step lasts until its slowest rank is done;
* ``concurrent`` (diagnostic): 2 processes at once, no group, each running ``accum``: what two busy
  processes cost each other on this machine without any communication (``c = T_concurrent /
  T_accum``; on a machine whose cores do not slow each other down, c = 1).

    speedup     = T_whole / T_pipe            (same batch)
    ideal       = S * M / (M + S - 1)
    efficiency  = speedup / ideal             = throughput / (ideal throughput = whole throughput * ideal)
    eff. vs accum = (T_accum / T_pipe) / ideal  (pipeline losses only; micro-batching excluded)
    balance     = (t_0 + t_1) / (S * max t_k) (per-stage fwd+bwd times on one rank: an upper bound)
    eff. x c    = efficiency * c              (against what 2 concurrent processes can reach here)

The jobs alternate for ``--rounds`` rounds; inside each job the M order reverses every round.

    .venv/bin/python perf/bench_pipeline.py                   # V=24, C=16, micro 2, 3 rounds x 8 steps
    .venv/bin/python perf/bench_pipeline.py --size 12 --rounds 1 --steps 3 --no-wait --out-dir /tmp
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import common
import torch
import torch.nn.functional as F
from torch import nn

STAGES = 2
GOAL = 0.90


# ---------------------------------------------------------------------------- the model and data
def make_stack(size: int, channels: int = 16, depth: int = 4, seed: int = 0) -> nn.Sequential:
    """``depth`` x [Conv3d C->C k3 p1, LeakyReLU(0.3)], MaxPool3d(2), Flatten, Linear(C (V/2)^3 -> 4)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Conv3d(channels, channels, 3, padding=1), nn.LeakyReLU(0.3)]
    layers += [nn.MaxPool3d(2), nn.Flatten(), nn.Linear(channels * (size // 2) ** 3, 4)]
    return nn.Sequential(*layers)


def split_layer(cfg: dict) -> int:
    """Index of the first layer of stage 1 (the conv number ``cfg['split']``)."""
    return 2 * cfg["split"]


def stack_data(cfg: dict, batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    v = cfg["size"]
    return (torch.randn(batch, cfg["channels"], v, v, v, generator=g), torch.randn(batch, 4, generator=g))


def batch_of(cfg: dict, m: int) -> int:
    return cfg["batch"] if cfg["batch"] else cfg["micro"] * m


def pipe_spec(cfg: dict, m: int, schedule: str = "gpipe") -> dict:
    return {"grid": {"pipe": STAGES},
            "pipeline": {"schedule": schedule, "microbatches": m, "stages": ["0", str(split_layer(cfg))]}}


def _zero(params) -> None:
    for p in params:
        p.grad = None


# ---------------------------------------------------------------------------- jobs
def _steps(cfg: dict, m: int):
    """(model, micro-batches, whole step, accum step) for M micro-batches, plain torch.nn."""
    batch = batch_of(cfg, m)
    model = make_stack(cfg["size"], cfg["channels"], cfg["depth"])
    params = list(model.parameters())
    x, y = stack_data(cfg, batch)
    chunks = list(zip(x.chunk(m), y.chunk(m)))

    def whole():
        _zero(params)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    def accum():
        _zero(params)
        for xc, yc in chunks:
            (F.mse_loss(model(xc), yc) * (len(xc) / batch)).backward()

    return model, chunks, whole, accum


def single_job(rank: int, world: int, cfg: dict, ms: list[int]) -> dict:
    """One process, no group: ``whole`` and ``accum`` per M, and the per-stage times (balance)."""
    out: dict = {"single_loss": {}, "stage_ms": {}}
    for m in ms:
        model, chunks, whole, accum = _steps(cfg, m)
        out["single_loss"][m] = whole().item()
        out[f"whole M={m}"] = common.time_steps(whole, cfg["warmup"], cfg["steps"])
        out[f"accum M={m}"] = common.time_steps(accum, cfg["warmup"], cfg["steps"])
        # Each stage's forward + backward on one micro-batch, alone (stage 1's input needs a gradient).
        k = split_layer(cfg)
        first, second = model[:k], model[k:]
        xc, yc = chunks[0]
        mid = first(xc).detach().requires_grad_()

        def stage0(first=first, xc=xc):
            first(xc).sum().backward()

        def stage1(second=second, mid=mid, yc=yc):
            F.mse_loss(second(mid), yc).backward()

        out["stage_ms"][m] = [1e3 * statistics.median(common.time_steps(f, cfg["warmup"], cfg["steps"]))
                              for f in (stage0, stage1)]
    return out


def concurrent_job(rank: int, world: int, cfg: dict, ms: list[int]) -> dict:
    """``accum`` in each of ``world`` processes at once, no group (diagnostic)."""
    return {f"concurrent M={m}": common.time_steps(_steps(cfg, m)[3], cfg["warmup"], cfg["steps"])
            for m in ms}


def _slowest_of(results: list[dict]) -> dict:
    """Per-step maximum over processes that ran without a group."""
    return {k: [max(t) for t in zip(*(r[k] for r in results))] for k in results[0]}


def pipe_job(rank: int, world: int, cfg: dict, runs: list[tuple[str, int]]) -> dict:
    """2 ranks: the hybridpar engine, pipe = 2, for each (schedule, M)."""
    import hybridpar as hp

    out: dict = {"pipe_loss": {}}
    for schedule, m in runs:
        x, y = stack_data(cfg, batch_of(cfg, m))
        engine = hp.parallelize(make_stack(cfg["size"], cfg["channels"], cfg["depth"]),
                                pipe_spec(cfg, m, schedule), loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        params = engine.parameters()

        def step(engine=engine, params=params, x_local=x_local, y_local=y_local):
            _zero(params)
            return engine.train_step(x_local, y_local)

        out["pipe_loss"][f"{schedule} M={m}"] = step().item()
        times = common.time_steps(step, cfg["warmup"], cfg["steps"], before=common.barrier)
        out[f"{schedule} M={m}"] = common.slowest_rank(times)
    return out


# ---------------------------------------------------------------------------- report
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=24, help="volume edge V (default 24)")
    ap.add_argument("--channels", type=int, default=16, help="conv channels C (default 16)")
    ap.add_argument("--depth", type=int, default=4, help="conv layers (default 4)")
    ap.add_argument("--split", type=int, default=None, help="conv where stage 1 starts (default depth//2)")
    ap.add_argument("--micro", type=int, default=2, help="samples per micro-batch (default 2)")
    ap.add_argument("--batch", type=int, default=0,
                    help="fix the per-replica batch instead of the micro-batch size (0: off)")
    ap.add_argument("--microbatches", default="1,2,4,8", help="M values (default 1,2,4,8)")
    ap.add_argument("--schedules", default="gpipe", help="engine schedules: gpipe and/or 1f1b (comma list)")
    ap.add_argument("--rounds", type=int, default=3, help="single/pipe alternations (default 3)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per config and round (default 8)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    ap.add_argument("--pin", action="store_true", help="bind rank r (and the single process) to core r")
    ap.add_argument("--max-load", type=float, default=0.6, help="wait for a 1-min load below this")
    ap.add_argument("--max-wait", type=float, default=1200, help="give up waiting after this many s")
    ap.add_argument("--no-wait", action="store_true", help="start at once, whatever the load")
    ap.add_argument("--out", default="pipeline", help="name of the JSON file (default pipeline)")
    ap.add_argument("--out-dir", type=Path, default=common.RESULTS, help="its folder (perf/results)")
    args = ap.parse_args()
    ms = [int(v) for v in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    cfg = {"size": args.size, "channels": args.channels, "depth": args.depth,
           "split": args.depth // 2 if args.split is None else args.split, "micro": args.micro,
           "batch": args.batch, "warmup": args.warmup, "steps": args.steps}
    for m in ms:
        if args.batch and args.batch % m:
            ap.error(f"--batch {args.batch} is not divisible by M={m}")

    load = common.wait_for_quiet(args.max_load, 0 if args.no_wait else args.max_wait)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    runs = [(s, m) for s in schedules for m in ms]
    samples, rounds = common.alternate(args.rounds, [
        lambda r: common.launch(single_job, 1, cfg, ms if r % 2 == 0 else ms[::-1], threads=1, group=False,
                                pin=args.pin),
        lambda r: common.launch(pipe_job, STAGES, cfg, runs if r % 2 == 0 else runs[::-1], threads=1,
                                pin=args.pin),
        lambda r: _slowest_of(common.launch(concurrent_job, STAGES, cfg, ms if r % 2 == 0 else ms[::-1],
                                            threads=1, group=False, pin=args.pin, every_rank=True))])
    load_end = common.loadavg()

    stats = {n: common.summarize(t) for n, t in samples.items()}
    med = {n: s["median_ms"] for n, s in stats.items()}
    rows, result = [], {}
    for s in schedules:
        for m in ms:
            b, name = batch_of(cfg, m), f"{s} M={m}"
            ideal = STAGES * m / (m + STAGES - 1)
            speedup = med[f"whole M={m}"] / med[name]
            vs_accum = med[f"accum M={m}"] / med[name]
            conc = med[f"concurrent M={m}"] / med[f"accum M={m}"]
            stage = [statistics.median(rd["stage_ms"][m][k] for rd in rounds) for k in range(STAGES)]
            balance = sum(stage) / (STAGES * max(stage))
            per_round = [statistics.median(rd[f"whole M={m}"]) / statistics.median(rd[name]) / ideal
                         for rd in rounds]
            losses = [rd["pipe_loss"][name] for rd in rounds]
            ref = [rd["single_loss"][m] for rd in rounds]
            result[name] = {
                "schedule": s, "M": m, "batch": b, "micro_batch": b // m,
                "ideal_bubble": (STAGES - 1) / (m + STAGES - 1),
                "ideal_speedup": ideal, "speedup": speedup, "efficiency": speedup / ideal,
                "efficiency_per_round": per_round, "efficiency_vs_accum": vs_accum / ideal,
                "throughput_samples_s": 1e3 * b / med[name],
                "whole_throughput_samples_s": 1e3 * b / med[f"whole M={m}"],
                "ideal_throughput_samples_s": 1e3 * b / med[f"whole M={m}"] * ideal,
                "stage_fwd_bwd_ms": stage, "stage_balance": balance, "concurrency_slowdown_c": conc,
                "efficiency_times_c": speedup / ideal * conc,
                "loss_rel_err_vs_single": max(abs(a - r) / abs(r) for a, r in zip(losses, ref)),
                "meets_goal": speedup / ideal >= GOAL}
            rows.append([s, m, b, med[f"whole M={m}"], med[f"accum M={m}"], med[name],
                         result[name]["throughput_samples_s"], f"{ideal:.3f}", f"{speedup:.3f}",
                         f"{100 * speedup / ideal:.1f} %",
                         f"{100 * min(per_round):.0f}-{100 * max(per_round):.0f} %",
                         f"{100 * vs_accum / ideal:.1f} %", f"{100 * balance:.1f} %", f"{conc:.2f}",
                         f"{100 * speedup / ideal * conc:.1f} %"])
    v = args.size
    what = f"batch {args.batch} in M parts" if args.batch else \
        f"micro-batch {args.micro}, batch {args.micro}*M"
    table = common.print_table(
        ["schedule", "M", "batch", "whole ms", "accum ms", "pipe ms", "pipe samples/s", "ideal speedup",
         "speedup", "efficiency", "per round", "eff. vs accum", "stage balance", "c", "eff. x c"], rows,
        title=f"Pipeline efficiency, S=2 (2 ranks x 1 thread, gloo) vs 1 rank x 1 thread: "
              f"{args.depth} x Conv3d {args.channels}->{args.channels} k3 at {v}^3, {what}, float32 "
              f"({args.rounds} rounds x {args.steps} steps; 1-min load {load['load_at_start'][0]:.2f} -> "
              f"{load_end[0]:.2f}); goal efficiency >= {100 * GOAL:.0f} %")
    common.write_json(args.out, {
        "config": {**cfg, "microbatches": ms, "schedules": schedules, "rounds": args.rounds,
                   "stages": STAGES, "stage_starts": ["0", str(split_layer(cfg))],
                   "batch_mode": "fixed per-replica batch" if args.batch else "fixed micro-batch size",
                   "model": repr(make_stack(v, args.channels, args.depth)).splitlines(),
                   "dtype": "float32", "threads_per_process": 1, "pin": args.pin, "backend": "gloo",
                   "step": "grads set to None, forward, MSE loss, backward (no optimizer step)",
                   "definitions": {"speedup": "T_whole / T_pipe", "ideal": "S*M/(M+S-1)",
                                   "efficiency": "speedup / ideal = pipe throughput / (whole throughput * "
                                                 "ideal)",
                                   "efficiency_vs_accum": "(T_accum / T_pipe) / ideal",
                                   "stage_balance": "(t0 + t1) / (S * max(t0, t1)), per-stage fwd+bwd of "
                                                    "one micro-batch on one rank",
                                   "c": "T_concurrent / T_accum: 2 processes running accum at once, no "
                                        "communication, against 1 alone"}},
        "load": {**load, "load_at_end": load_end,
                 "disturbed_rounds": [i for i, rd in enumerate(rounds)
                                      if common.disturbed([rd["load"][0]], STAGES)]},
        "stats": stats, "result": result, "rounds": rounds, "table": table}, args.out_dir)


if __name__ == "__main__":
    main()
