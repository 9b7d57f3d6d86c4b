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

Configurations: all of them inside the same 2 fresh processes (gloo group), 1 thread each,
alternated ``--reps`` times per (schedule, M), since this VM's speed drifts by up to 1.5x within
minutes and a ratio is only meaningful between neighbours in time. Every process applies
``hybridpar.device.cpu_alloc`` (see perf/common.py).

* ``whole``: rank 0 alone (rank 1 waits in a barrier), the whole batch through plain ``torch.nn``;
* ``accum``: the same, the M micro-batches one after another with gradient accumulation;
* ``pipe``: both ranks, ``hp.parallelize(model, {grid: {pipe: 2}, pipeline: {microbatches: M}})``,
  ``engine.train_step``; a step lasts until its slower rank is done;
* ``stages``: both ranks at once, no communication: rank k runs stage k's share of a step of the
  same schedule (its M forwards and M backwards in the schedule's order: GPipe all forwards first,
  1F1B interleaved, so the activations held at once match) in plain ``torch.nn``: the pipeline's
  work as this machine runs it side by side, with no bubble and no communication;
* ``alone stage k``: rank 0 alone, stage k's forward + backward of one micro-batch (balance).

    bound          = sum_k t_k + (M - 1) max_k t_k, t_k = T_stage k / M: every stage once while the
                     pipeline fills and drains, the slowest M - 1 more times; for balanced stages
                     (M + S - 1) t, so bound / T_pipe is the pipeline's throughput against the ideal
                     M/(M+S-1) of the bubble-free throughput of the same stages on this machine
    pipeline eff.  = bound / T_pipe
    speedup        = T_whole / T_pipe             (same batch)
    ideal          = S * M / (M + S - 1)
    eff. vs 1 process = speedup / ideal           (also pays the stage balance and the machine's
                                                    two-process slowdown c)
    balance        = (t_0 + t_1) / (S * max t_k)  (per-stage fwd+bwd of one micro-batch, alone)
    c              = max_k T_stage k / (M * max t_k alone)  (side by side against alone; 1 on a
                                                    machine whose cores do not slow each other down)

The goal (>= 90 %) is on the pipeline efficiency: what the schedule, the sends and receives and the
engine lose against the ideal M/(M+S-1). Stage balance is the partitioner's (``stages: auto``), and
c the machine's.

``--rounds`` pairs of fresh processes; the order of (schedule, M) reverses every round, the order of
configurations every rep.

    python -m perf pipeline                   # V=24, C=16, micro 2, 3 rounds x 8 steps
    python -m perf pipeline --size 12 --rounds 1 --steps 3 --no-wait --out /tmp/pipeline.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.planner.schedule import makespan
from hybridpar.planner.schedule import schedule as schedule_ops
from perf import common

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


def _stage_work(cfg: dict, model: nn.Sequential, chunks, batch: int, stage: int, name: str = "gpipe"):
    """Pipeline stage ``stage``'s share of one step of schedule ``name`` (its forwards and backwards
    in that schedule's order: GPipe all M forwards then all M backwards, 1F1B interleaved, so the
    activations held at once match the pipeline's) in plain torch.nn, no communication; stage 1's
    input needs a gradient, as in the pipeline, and stage 0 backpropagates a fixed random gradient.
    Also the fwd+bwd of one micro-batch (balance)."""
    k = split_layer(cfg)
    first, second = model[:k], model[k:]
    with torch.no_grad():
        mids = [first(xc) for xc, _ in chunks]
    ops = schedule_ops(name, STAGES, len(chunks), stage)
    if stage == 0:
        params, grads = list(first.parameters()), [torch.randn_like(t) for t in mids]

        def fwd(m):
            return first(chunks[m][0])

        def bwd(m, out):
            out.backward(grads[m])

        def one():
            first(chunks[0][0]).backward(grads[0])
    else:
        params = list(second.parameters())

        def fwd(m):
            return F.mse_loss(second(mids[m].detach().requires_grad_()), chunks[m][1]) * \
                (len(chunks[m][1]) / batch)

        def bwd(m, out):
            out.backward()

        def one():
            F.mse_loss(second(mids[0].detach().requires_grad_()), chunks[0][1]).backward()

    def step():
        _zero(params)
        held, spent = {}, 0.0
        for op, m in ops:
            if op == "F":
                t0 = time.perf_counter()
                held[m] = fwd(m)
                spent += time.perf_counter() - t0
            else:
                bwd(m, held.pop(m))
        step.forward.append(spent)

    step.forward = []  # seconds of the forwards of each call (the rest is the backwards)
    return step, one


def pipeline_job(rank: int, world: int, cfg: dict, runs: list[tuple[str, int]]) -> dict:
    """Everything the table compares, in the same 2 processes, alternated ``reps`` times per
    (schedule, M) so that the machine's drift (here up to 1.5x within minutes) hits all alike:

    * ``whole`` / ``accum`` / ``alone stage k``: rank 0 alone (rank 1 waits in a barrier);
    * ``stages``: each rank its own stage's work, both at once, no communication;
    * the pipeline: ``engine.train_step`` on both ranks (a step lasts until the slower is done).
    """
    import torch.distributed as dist

    import hybridpar as hp

    out: dict = {"pipe_loss": {}, "single_loss": {}}
    warm, steps = cfg["warmup"], cfg["steps"]

    def alone(fn) -> list[float]:
        times = common.time_steps(fn, warm, steps) if rank == 0 else []
        common.barrier()
        return times

    def both(fn) -> list[list[float]]:
        mine = common.time_steps(fn, warm, steps, before=common.barrier)
        every: list = [None] * world
        dist.all_gather_object(every, mine)
        return every

    for schedule, m in runs:
        name, batch = f"{schedule} M={m}", batch_of(cfg, m)
        model, chunks, whole, accum = _steps(cfg, m)
        out["single_loss"][name] = whole().item()
        stage_step, _ = _stage_work(cfg, model, chunks, batch, rank, schedule)
        one = [_stage_work(cfg, model, chunks, batch, k)[1] for k in range(STAGES)]
        x, y = stack_data(cfg, batch)
        engine = hp.parallelize(make_stack(cfg["size"], cfg["channels"], cfg["depth"]),
                                pipe_spec(cfg, m, schedule), loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        params = engine.parameters()

        def pipe(engine=engine, params=params, x_local=x_local, y_local=y_local):
            _zero(params)
            return engine.train_step(x_local, y_local)

        out["pipe_loss"][name] = pipe().item()
        jobs = {f"whole M={m}": (alone, whole), f"accum M={m}": (alone, accum),
                **{f"alone stage {k} M={m}": (alone, one[k]) for k in range(STAGES)},
                f"stages {name}": (both, stage_step), name: (both, pipe)}
        for rep in range(cfg["reps"]):
            for key in (list(jobs) if rep % 2 == 0 else list(jobs)[::-1]):
                runner, fn = jobs[key]
                got = runner(fn)
                if key.startswith("stages"):
                    fwd: list = [None] * world
                    dist.all_gather_object(fwd, stage_step.forward[-steps:])
                    for k, t in enumerate(got):
                        out.setdefault(f"{key} rank {k}", []).extend(t)
                        out.setdefault(f"{key} rank {k} forward", []).extend(fwd[k])
                    got = [max(t) for t in zip(*got)]
                elif key == name:
                    got = [max(t) for t in zip(*got)]
                out.setdefault(key, []).extend(got)
    return out


# ---------------------------------------------------------------------------- report
def phases(samples: dict, name: str, m: int, k: int) -> tuple[float, float]:
    """Stage k's forward and backward of one micro-batch, ms, side by side (medians of the steps)."""
    step, fwd = samples[f"stages {name} rank {k}"], samples[f"stages {name} rank {k} forward"]
    f = statistics.median(fwd)
    return 1e3 * f / m, 1e3 * (statistics.median(step) - f) / m


TINY = {"size": 8, "channels": 4, "microbatches": "1,2", "rounds": 1, "reps": 1, "steps": 1,  # seconds
        "warmup": 1}


def add_model_args(ap: argparse.ArgumentParser) -> None:
    """The flags of the benchmark model and its micro-batch (shared by the pipeline benchmarks)."""
    ap.add_argument("--size", type=int, default=24, help="volume edge V (default 24)")
    ap.add_argument("--channels", type=int, default=16, help="conv channels C (default 16)")
    ap.add_argument("--depth", type=int, default=4, help="conv layers (default 4)")
    ap.add_argument("--split", type=int, default=None, help="conv where stage 1 starts (default depth//2)")
    ap.add_argument("--micro", type=int, default=2, help="samples per micro-batch (default 2)")


def model_config(args: argparse.Namespace) -> dict:
    """The job configuration those flags give (``split``: the conv where stage 1 starts)."""
    return {"size": args.size, "channels": args.channels, "depth": args.depth,
            "split": args.depth // 2 if args.split is None else args.split, "micro": args.micro}


# what the result's figures mean, written beside them in the JSON
DEFINITIONS = {
    "pipeline_efficiency": "bound / T_pipe, bound = sum_k t_k + (M-1) max_k t_k (for "
                           "balanced stages (M+S-1) t: throughput against the ideal "
                           "M/(M+S-1) of the bubble-free throughput of the same "
                           "stages on the same machine)",
    "schedule_efficiency": "schedule bound / T_pipe; schedule bound = "
                           "hybridpar.planner.schedule.makespan of the schedule with "
                           "f_k, b_k = stage k's forward / backward phase of "
                           "T_stage_k over M, no transfers: the same schedule's bubble "
                           "for these (possibly unbalanced) stages",
    "t_k": "T_stage_k / M; T_stage_k: process k of S running its stage's M forwards "
           "and M backwards in the schedule's order, all S at once, plain torch.nn, "
           "no communication",
    "speedup": "T_whole / T_pipe", "ideal": "S*M/(M+S-1)",
    "efficiency_vs_one_process": "speedup / ideal = pipe throughput / (whole "
                                 "throughput * ideal)",
    "efficiency_vs_accum": "(T_accum / T_pipe) / ideal",
    "stage_balance": "(t0 + t1) / (S * max(t0, t1)), per-stage fwd+bwd of one "
                     "micro-batch, one process alone",
    "c": "T_stages / (M * max(t0, t1)): how much slower the stages run side by side "
         "than alone"}


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], list[str], dict]:
    """The flags, and from them the M values, the schedules and the configuration every rank gets."""
    ap = common.parser("pipeline", __doc__, rounds=3, steps=8, warmup=2, max_load=0.6, pin=True)
    add_model_args(ap)
    ap.add_argument("--batch", type=int, default=0,
                    help="fix the per-replica batch instead of the micro-batch size (0: off)")
    ap.add_argument("--microbatches", default="1,2,4,8", help="M values (default 1,2,4,8)")
    ap.add_argument("--schedules", default="gpipe", help="engine schedules: gpipe and/or 1f1b (comma list)")
    ap.add_argument("--reps", type=int, default=2,
                    help="alternations of all configurations inside each pair of processes (default 2)")
    args = common.parse(ap, argv, TINY)
    ms = [int(v) for v in args.microbatches.split(",")]
    schedules = args.schedules.split(",")
    cfg = {**model_config(args), "batch": args.batch, "warmup": args.warmup, "steps": args.steps,
           "reps": args.reps}
    for m in ms:
        if args.batch and args.batch % m:
            ap.error(f"--batch {args.batch} is not divisible by M={m}")
    return args, ms, schedules, cfg


def _result(s: str, m: int, cfg: dict, samples: dict, rounds: list[dict],
            med: dict[str, float]) -> tuple[dict, list]:
    """One schedule at one M: its efficiencies against the bubble bound and the schedule bound (over
    all rounds and per round), and its table row."""
    b, name = batch_of(cfg, m), f"{s} M={m}"
    ideal = STAGES * m / (m + STAGES - 1)
    speedup = med[f"whole M={m}"] / med[name]
    vs_accum = med[f"accum M={m}"] / med[name]
    # the same stages, both at once, no pipeline: the best a pipeline of them can do here is
    # to run every stage once while filling and draining, and the slowest M - 1 more times
    per_stage = [med[f"stages {name} rank {k}"] / m for k in range(STAGES)]
    bound = sum(per_stage) + (m - 1) * max(per_stage)
    pipe_eff = bound / med[name]
    # the same, but the schedule's own step with each stage's forward and backward apart
    fb = [phases(samples, name, m, k) for k in range(STAGES)]
    sched = makespan(s, STAGES, m, [f for f, _ in fb], [b for _, b in fb])
    sched_eff = sched / med[name]
    stage = [med[f"alone stage {k} M={m}"] for k in range(STAGES)]
    balance = sum(stage) / (STAGES * max(stage))
    conc = med[f"stages {name}"] / (m * max(stage))
    per_round, sched_round = [], []
    for rd in rounds:
        t = [statistics.median(rd[f"stages {name} rank {k}"]) / m for k in range(STAGES)]
        per_round.append((sum(t) + (m - 1) * max(t)) / statistics.median(rd[name]))
        fb_r = [phases(rd, name, m, k) for k in range(STAGES)]
        sched_round.append(makespan(s, STAGES, m, [f for f, _ in fb_r], [b for _, b in fb_r])
                           / (1e3 * statistics.median(rd[name])))
    losses = [rd["pipe_loss"][name] for rd in rounds]
    ref = [rd["single_loss"][name] for rd in rounds]
    result = {
        "schedule": s, "M": m, "batch": b, "micro_batch": b // m,
        "ideal_bubble": (STAGES - 1) / (m + STAGES - 1),
        "ideal_speedup": ideal, "speedup": speedup,
        "pipeline_efficiency": pipe_eff, "pipeline_efficiency_per_round": per_round,
        "schedule_bound_ms": sched, "schedule_efficiency": sched_eff,
        "schedule_efficiency_per_round": sched_round,
        "stage_forward_backward_ms_per_micro_batch": fb,
        "efficiency_vs_one_process": speedup / ideal, "efficiency_vs_accum": vs_accum / ideal,
        "throughput_samples_s": 1e3 * b / med[name],
        "whole_throughput_samples_s": 1e3 * b / med[f"whole M={m}"],
        "bound_ms": bound, "stages_concurrent_ms": med[f"stages {name}"],
        "stage_concurrent_ms_per_micro_batch": per_stage,
        "stage_fwd_bwd_ms": stage, "stage_balance": balance, "concurrency_slowdown_c": conc,
        "loss_rel_err_vs_single": max(abs(a - r) / abs(r) for a, r in zip(losses, ref)),
        "meets_goal": pipe_eff >= GOAL, "meets_goal_schedule_bound": sched_eff >= GOAL}
    row = [s, m, b, med[f"whole M={m}"], med[f"accum M={m}"], med[name],
           result["throughput_samples_s"], f"{bound:.1f}",
           f"**{100 * pipe_eff:.1f} %**",
           f"{100 * min(per_round):.0f}-{100 * max(per_round):.0f} %",
           f"{sched:.1f}", f"**{100 * sched_eff:.1f} %**",
           f"{100 * min(sched_round):.0f}-{100 * max(sched_round):.0f} %",
           f"{ideal:.3f}", f"{speedup:.3f}", f"{100 * speedup / ideal:.1f} %",
           f"{100 * balance:.1f} %", f"{conc:.2f}"]
    return result, row


def _table(args: argparse.Namespace, rows: list[list], load: dict, load_end: tuple) -> str:
    """The printed table, titled with the model, the rounds and the load around them."""
    v = args.size
    what = f"batch {args.batch} in M parts" if args.batch else \
        f"micro-batch {args.micro}, batch {args.micro}*M"
    return common.print_table(
        ["schedule", "M", "batch", "whole ms", "accum ms", "pipe ms", "pipe samples/s", "bound ms",
         "pipeline efficiency", "per round", "schedule bound ms", "schedule efficiency", "per round",
         "ideal speedup", "speedup", "eff. vs 1 process", "stage balance",
         "c"], rows,
        title=f"Pipeline efficiency, S=2 (2 ranks x 1 thread, gloo) vs 1 rank x 1 thread: "
              f"{args.depth} x Conv3d {args.channels}->{args.channels} k3 at {v}^3, {what}, float32 "
              f"({args.rounds} rounds x {args.steps} steps; 1-min load {load['load_at_start'][0]:.2f} -> "
              f"{load_end[0]:.2f}); goal pipeline efficiency >= {100 * GOAL:.0f} %")


def main(argv: list[str] | None = None) -> None:
    args, ms, schedules, cfg = _parse(argv)
    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    runs = [(s, m) for s in schedules for m in ms]
    samples, rounds = common.alternate(args.rounds, [
        lambda r: common.launch(pipeline_job, STAGES, cfg, runs if r % 2 == 0 else runs[::-1], threads=1,
                                pin=args.pin)])
    load_end = common.loadavg()

    stats = {n: common.summarize(t) for n, t in samples.items()}
    med = {n: s["median_ms"] for n, s in stats.items()}
    rows, result = [], {}
    for s in schedules:
        for m in ms:
            result[f"{s} M={m}"], row = _result(s, m, cfg, samples, rounds, med)
            rows.append(row)
    table = _table(args, rows, load, load_end)
    v = args.size
    common.write_json(args, {
        "config": {**cfg, "microbatches": ms, "schedules": schedules, "rounds": args.rounds,
                   "stages": STAGES, "stage_starts": ["0", str(split_layer(cfg))],
                   "batch_mode": "fixed per-replica batch" if args.batch else "fixed micro-batch size",
                   "model": repr(make_stack(v, args.channels, args.depth)).splitlines(),
                   "dtype": "float32", "threads_per_process": 1, "pin": args.pin, "backend": "gloo",
                   "step": "grads set to None, forward, MSE loss, backward (no optimizer step)",
                   "definitions": DEFINITIONS},
        "load": {**load, "load_at_end": load_end,
                 "disturbed_rounds": [i for i, rd in enumerate(rounds)
                                      if common.disturbed([rd["load"][0]], STAGES)]},
        "stats": stats, "result": result, "rounds": rounds, "table": table})


if __name__ == "__main__":
    main()
