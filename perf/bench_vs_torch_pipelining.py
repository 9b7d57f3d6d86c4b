"""hybridpar's GPipe against ``torch.distributed.pipelining.ScheduleGPipe``: speed, memory, numbers.

Why: the engine writes its own scheduler rather than building on torch's pipelining, so it is measured
against torch's: throughput ratio >= 1.0, peak memory per stage no worse.

Both run the same model (``bench_pipeline.make_stack``: depth x [Conv3d C->C k3 p1, LeakyReLU(0.3)],
MaxPool3d(2), Flatten, Linear -> 4; MSE loss; float32), the same weights, split (stage 1 starts at
conv depth // 2), batch (micro-batch ``--micro`` samples, batch micro * M) and micro-batch count, on
2 ranks x 1 thread over gloo on CPU:

* ``hybridpar``: ``hp.parallelize(model, {grid: {pipe: 2}, pipeline: {microbatches: M, stages:
  [...]}}, loss_fn=F.mse_loss)``; ``engine.train_step(x_local, y_local)``;
* ``torch``: the two halves as ``nn.Sequential`` modules (original layer names kept), one
  ``PipelineStage(half, rank, 2, cpu)`` per rank, ``ScheduleGPipe(stage, M, loss_fn=F.mse_loss)``
  (default ``scale_grads=True``); ``step(x)`` on stage 0 and ``step(target=y, losses=[...])`` on
  stage 1, ``return_outputs=False``.

Each step sets gradients to None first; no optimizer step. A step lasts until its slowest rank is done.
Timing: both implementations are built in the same 2 processes and alternated ``--reps`` times per M
(this VM's speed drifts by up to 1.5x within minutes), in ``--rounds`` fresh pairs of processes;
every process applies ``hybridpar.device.cpu_alloc`` (perf/common.py), torch's included.

Memory per stage, three ways, each rank in a fresh process per (implementation, M), after 2 warm-up
steps, glibc told to return every block >= 64 KiB to the OS (``MALLOC_MMAP_THRESHOLD_=65536``) so the
resident set follows live tensors:

* *peak heap*: the highest count of bytes malloc has handed out during one step, minus the count
  before the model was built (``heapcount``: ``heap_peak.c`` preloaded into the ranks): weights,
  gradients, activations, communication buffers and the library's own state, exactly, whatever the
  page layout. The CPU's ``torch.cuda.max_memory_allocated``, and the figure the goal is read on.
  Twice: as is, and with both implementations tracing the model once on the meta device before the
  base line: what torch caches on the first meta trace of a process (~0.1 MiB, measured) is paid
  once by whatever traces first (hybridpar's planner, torch.compile, DTensor), not by a stage;
* *peak RSS*: the kernel's high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``)
  during one step, minus the resident set before the model was built; and its anonymous part
  (file-backed pages, the libraries' code that each implementation happens to run, set aside):
  what the OS charges, which also moves with page-touch patterns and thread stacks;
* *saved activations*: the peak of the bytes of tensors autograd holds for backward (distinct
  storages, weights excluded), counted with ``torch.autograd.graph.saved_tensors_hooks``:
  independent of the allocator.

Numbers: one step in float64 from the same weights and batch, each stage's gradients against the
whole model on one process (the full-batch mean loss), for hybridpar, torch (``scale_grads=True``,
the default in torch 2.13), and torch with ``scale_grads=False`` (torch's behaviour before the flag).
(A batch that M does not divide is not compared: hybridpar's spec refuses it, and torch's stage 1
receives every micro-batch into buffers shaped like the first one, so its loss fails on the shape.)

    python -m perf vs_torch_pipelining                 # V=24, M = 2, 4, 8, 3 rounds
    python -m perf vs_torch_pipelining --size 12 --rounds 1 --steps 3 --no-wait \\
        --out /tmp/vs_torch_pipelining.json
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

from hybridpar.profiling.saved_memory import SavedActivations
from perf import common, heapcount
from perf.bench_pipeline import add_model_args, make_stack, model_config, split_layer, stack_data

RANKS = 2
IMPLS = ["hybridpar", "torch"]
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "HYBRIDPAR_MALLOC_TUNING": "0"}


# ---------------------------------------------------------------------------- memory probes
def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def rss_mib() -> float:
    """Resident set now."""
    return _status_kib("VmRSS") / 1024


def reset_peak_rss() -> None:
    """Set the kernel's high-water mark of the resident set to the resident set now (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mib() -> float:
    """Highest resident set since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") / 1024


def rss_parts_mib() -> dict[str, float]:
    """The resident set now by kind: anonymous (heap, stacks), file-backed (code of the libraries,
    shared with every process that maps them), shared memory."""
    return {k: _status_kib(k) / 1024 for k in ("RssAnon", "RssFile", "RssShmem")}


# ---------------------------------------------------------------------------- the two pipelines
def halves(model: nn.Sequential, k: int) -> list[nn.Sequential]:
    """Stage modules with the original layer names ("0", "1", ...), so state-dict keys agree."""
    named = list(model.named_children())
    return [nn.Sequential(OrderedDict(named[:k])), nn.Sequential(OrderedDict(named[k:]))]


def build(impl: str, rank: int, cfg: dict, m: int, x: torch.Tensor, y: torch.Tensor, dtype=torch.float32,
          scale_grads: bool = True):
    """(step() -> loss or None, this rank's named parameters) for ``impl`` with M micro-batches."""
    model = make_stack(cfg["size"], cfg["channels"], cfg["depth"]).to(dtype)
    k = split_layer(cfg)
    if impl == "hybridpar":
        import hybridpar as hp

        spec = {"grid": {"pipe": RANKS},
                "pipeline": {"schedule": "gpipe", "microbatches": m, "stages": ["0", str(k)]}}
        engine = hp.parallelize(model, spec, loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        named = dict(engine.named_parameters())

        def step():
            for p in named.values():
                p.grad = None
            return engine.train_step(x_local, y_local)

        return step, named
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    half = halves(model, k)[rank]
    stage = PipelineStage(half, rank, RANKS, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, m, loss_fn=F.mse_loss, scale_grads=scale_grads)
    named = dict(half.named_parameters())

    def step():
        for p in named.values():
            p.grad = None
        if rank == 0:
            schedule.step(x, return_outputs=False)
            return None
        losses: list[torch.Tensor] = []
        schedule.step(target=y, losses=losses, return_outputs=False)
        return losses

    return step, named


# ---------------------------------------------------------------------------- jobs
def time_job(rank: int, world: int, cfg: dict, ms: list[int]) -> dict:
    """Step times of both implementations for each M, in the same 2 processes, alternated ``reps``
    times (order swapped every rep): this VM's speed drifts within minutes, so a ratio is measured
    between neighbours in time."""
    out: dict = {}
    for m in ms:
        x, y = stack_data(cfg, cfg["micro"] * m)
        steps = {impl: build(impl, rank, cfg, m, x, y)[0] for impl in IMPLS}
        for rep in range(cfg["reps"]):
            for impl in (IMPLS if rep % 2 == 0 else IMPLS[::-1]):
                times = common.time_steps(steps[impl], cfg["warmup"], cfg["steps"], before=common.barrier)
                out.setdefault(f"{impl} M={m}", []).extend(common.slowest_rank(times))
    return out


def memory_job(rank: int, world: int, cfg: dict, impl: str, m: int, warm_meta: bool = False) -> list[dict]:
    """Peak RSS over a step and peak saved activations, per rank (fresh process, one configuration).

    ``warm_meta``: before the base line, both implementations trace the model once on the meta
    device (as hybridpar's planner does when it builds): what that loads the first time (torch's
    meta kernels and decompositions) is a one-time cost of the process, not memory of a stage."""
    import torch.distributed as dist
    from torch.distributed import pipelining  # noqa: F401 (imported before the base line, as in timing)

    import hybridpar  # noqa: F401

    if warm_meta:
        with torch.device("meta"):
            model = make_stack(cfg["size"], cfg["channels"], cfg["depth"])
            F.mse_loss(model(torch.empty(cfg["micro"], cfg["channels"], *[cfg["size"]] * 3)),
                       torch.empty(cfg["micro"], 4))
    base, base_parts, heap_base = rss_mib(), rss_parts_mib(), heapcount.current()
    x, y = stack_data(cfg, cfg["micro"] * m)
    step, named = build(impl, rank, cfg, m, x, y)
    for _ in range(2):
        step()
    common.barrier()
    before = rss_mib()
    reset_peak_rss()
    heapcount.reset()
    step()
    peak, heap_peak, parts = peak_rss_mib(), heapcount.peak(), rss_parts_mib()
    common.barrier()
    with SavedActivations(named.values()) as saved:
        step()
    # The anonymous part of the peak, assuming the file-backed pages (touched during the warm-up
    # steps) stayed resident through the step, as they do with memory to spare.
    anon = peak - parts["RssFile"] - parts["RssShmem"] - base_parts["RssAnon"]
    mine = {"rank": rank, "stage": rank, "rss_base_mib": base, "rss_before_step_mib": before,
            "peak_rss_step_mib": peak, "peak_over_base_mib": peak - base,
            "peak_over_prestep_mib": peak - before, "rss_parts_base_mib": base_parts,
            "rss_parts_after_step_mib": parts, "peak_anon_over_base_mib": anon,
            "heap_counted": heapcount.active(),
            "peak_heap_over_base_mib": (heap_peak - heap_base) / 2 ** 20 if heapcount.active() else None,
            "saved_activations_peak_mib": saved.peak_bytes / 2 ** 20,
            "params_mib": sum(p.numel() * p.element_size() for p in named.values()) / 2 ** 20}
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check_job(rank: int, world: int, cfg: dict, m: int) -> list[dict]:
    """One float64 step of each variant against the whole model on one process, per rank."""
    import torch.distributed as dist

    batch = cfg["micro"] * m
    g = torch.Generator().manual_seed(3)
    v = cfg["size"]

    def data(b: int):
        return (torch.randn(b, cfg["channels"], v, v, v, generator=g, dtype=torch.float64),
                torch.randn(b, 4, generator=g, dtype=torch.float64))

    x, y = data(batch)
    model = make_stack(v, cfg["channels"], cfg["depth"]).double()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    ref_loss, ref_grads = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    mine: dict = {"rank": rank, "M": m, "batch": batch, "reference_loss": ref_loss}
    for name, impl, scale in [("hybridpar", "hybridpar", True),
                              ("torch scale_grads=True (default)", "torch", True),
                              ("torch scale_grads=False", "torch", False)]:
        step, named = build(impl, rank, cfg, m, x, y, torch.float64, scale)
        out = step()
        grads = {n: p.grad for n, p in named.items()}
        ratio = statistics.median((grads[n].norm() / ref_grads[n].norm()).item() for n in grads)
        rec = {"grad_rel_err": max(_rel(grads[n], ref_grads[n]) for n in grads), "grad_norm_ratio": ratio}
        if isinstance(out, torch.Tensor):
            rec["loss"], rec["loss_rel_err"] = out.item(), abs(out.item() - ref_loss) / abs(ref_loss)
        elif out is not None:  # torch's per-micro-batch losses (last stage)
            mean = torch.stack(out).mean().item()
            rec["loss_mean_of_microbatches"] = mean
            rec["loss_rel_err"] = abs(mean - ref_loss) / abs(ref_loss)
        mine[name] = rec
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    return everyone


# ---------------------------------------------------------------------------- report
def _per_stage(records: list[dict] | None, key: str) -> list[float] | None:
    """One figure per stage from a memory job's records (None where it was not measured)."""
    return [r[key] for r in records] if records and records[0][key] is not None else None


def _fmt_stages(values: list[float] | None, digits: int = 1) -> str:
    return " / ".join(f"{v:.{digits}f}" for v in values) if values else ""


def _no_worse(ours: dict, theirs: dict, key: str, rel: float, slack: float) -> list[bool] | None:
    """Per stage: ours <= theirs * (1 + rel) + slack."""
    if not ours[key]:
        return None
    return [a <= t * (1 + rel) + slack for a, t in zip(ours[key], theirs[key])]


TINY = {"size": 8, "channels": 4, "microbatches": "2", "rounds": 1, "reps": 1, "steps": 1, "warmup": 1,
        "memory": False}  # --tiny: seconds


# how the memory figures are measured, written beside them in the JSON
MEMORY_METHOD = ("fresh processes per (impl, M), MALLOC_MMAP_THRESHOLD_=65536; peak heap = highest bytes "
                 "handed out by malloc over one step (perf/heap_peak.c, LD_PRELOAD) minus those before "
                 "the model was built; peak RSS = VmHWM over one step (reset via /proc/self/clear_refs) "
                 "minus VmRSS before the model was built, and its anonymous part (VmHWM - RssFile - "
                 "RssShmem after the step - RssAnon at base); saved activations = peak distinct storage "
                 "bytes held by autograd (saved_tensors_hooks), weights excluded; third step after 2 "
                 "warm-ups; 'meta warmed': peak heap after both implementations traced the model once on "
                 "the meta device before the base line (what torch caches on its first meta trace is a "
                 "one-time cost of the process, ~0.1 MiB)")


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[int], dict]:
    """The flags, the M values and the configuration every rank gets."""
    ap = common.parser("vs_torch_pipelining", __doc__, rounds=3, steps=8, warmup=2, max_load=0.6, pin=True)
    add_model_args(ap)
    ap.add_argument("--microbatches", default="2,4,8", help="M values (default 2,4,8)")
    ap.add_argument("--reps", type=int, default=2,
                    help="hybridpar/torch alternations inside each pair of processes (default 2)")
    ap.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory runs")
    ap.add_argument("--no-warm-meta", dest="warm_meta", action="store_false",
                    help="skip the memory runs that trace the model on the meta device in both first")
    ap.add_argument("--no-check", dest="check", action="store_false", help="skip the float64 check")
    args = common.parse(ap, argv, TINY)
    ms = [int(v) for v in args.microbatches.split(",")]
    cfg = {**model_config(args), "batch": 0, "warmup": args.warmup, "steps": args.steps, "reps": args.reps}
    return args, ms, cfg


def _memory_runs(args: argparse.Namespace, cfg: dict, ms: list[int]) -> tuple[dict, dict]:
    """Peak memory of each implementation at each M, in fresh ranks with the heap counter preloaded
    (``--no-memory``: none), and again after a meta-device trace of the model (``--no-warm-meta``: not)."""
    memory: dict = {}
    memory_warm: dict = {}
    if args.memory:
        env = {**MALLOC_ENV, **heapcount.preload_env()}
        os.environ.update(env)  # read by glibc and the loader at start-up of the spawned ranks
        try:
            for m in ms:
                for impl in IMPLS:
                    memory[f"{impl} M={m}"] = common.launch(memory_job, RANKS, cfg, impl, m, threads=1)
                    if args.warm_meta:
                        memory_warm[f"{impl} M={m}"] = common.launch(memory_job, RANKS, cfg, impl, m, True,
                                                                     threads=1)
        finally:
            for k in env:
                os.environ.pop(k, None)
    return memory, memory_warm


def _results(ms: list[int], cfg: dict, stats: dict, rounds: list[dict], memory: dict,
             memory_warm: dict) -> tuple[list[list], dict]:
    """Per M: throughput of ours against torch's (over all rounds and per round), each implementation's
    step and memory per stage, whether ours is no worse; and the table's rows."""
    med = {n: s["median_ms"] for n, s in stats.items()}
    rows, result = [], {}
    for m in ms:
        b = cfg["micro"] * m
        per_round = [statistics.median(rd[f"torch M={m}"]) / statistics.median(rd[f"hybridpar M={m}"])
                     for rd in rounds]
        ratio = med[f"torch M={m}"] / med[f"hybridpar M={m}"]
        result[m] = {"batch": b, "throughput_ratio": ratio, "throughput_ratio_per_round": per_round,
                     "meets_throughput_goal": ratio >= 1.0}
        for impl in IMPLS:
            name = f"{impl} M={m}"
            mem, warm = memory.get(name), memory_warm.get(name)
            heap = _per_stage(mem, "peak_heap_over_base_mib")
            peak, anon = _per_stage(mem, "peak_over_base_mib"), _per_stage(mem, "peak_anon_over_base_mib")
            saved = _per_stage(mem, "saved_activations_peak_mib")
            heap_warm = _per_stage(warm, "peak_heap_over_base_mib")
            result[m][impl] = {"step_ms": med[name], "samples_s": 1e3 * b / med[name],
                               "peak_heap_over_base_mib": heap, "peak_rss_over_base_mib": peak,
                               "peak_rss_anon_over_base_mib": anon, "saved_activations_peak_mib": saved,
                               "peak_heap_over_base_meta_warmed_mib": heap_warm}
            rows.append([m, b, impl, med[name], f"{stats[name]['q1_ms']:.1f}-{stats[name]['q3_ms']:.1f}",
                         1e3 * b / med[name], f"{ratio:.3f}" if impl == "hybridpar" else "",
                         _fmt_stages(heap, 3), _fmt_stages(heap_warm, 3), _fmt_stages(peak),
                         _fmt_stages(anon), _fmt_stages(saved, 2)])
        if memory:
            ours, theirs = result[m]["hybridpar"], result[m]["torch"]
            # heap: exact counts, 0.1 % for allocation timing between threads; RSS: page-level
            result[m]["memory_no_worse"] = {
                "peak_heap": _no_worse(ours, theirs, "peak_heap_over_base_mib", 1e-3, 0.0),
                "peak_heap_meta_warmed": _no_worse(ours, theirs, "peak_heap_over_base_meta_warmed_mib",
                                                   1e-3, 0.0) if memory_warm else None,
                "peak_rss": _no_worse(ours, theirs, "peak_rss_over_base_mib", 0.02, 1.0),
                "saved_activations": _no_worse(ours, theirs, "saved_activations_peak_mib", 1e-9, 0.0)}
    return rows, result


def _check_table(check: list[dict] | None, cfg: dict, ms: list[int]) -> str:
    """The float64 check's table: each stage's gradients and loss against the whole model in one process."""
    check_rows = []
    if check:
        for rec in check:
            for variant, v in rec.items():
                if isinstance(v, dict):
                    check_rows.append([rec["rank"], variant, f"{v['grad_rel_err']:.1e}",
                                       f"{v['grad_norm_ratio']:.4f}",
                                       f"{v['loss_rel_err']:.1e}" if "loss_rel_err" in v else ""])
        return common.print_table(
            ["stage", "variant", "grad rel. err vs 1 process", "grad norm ratio", "loss rel. err"],
            check_rows, title=f"One float64 step, M={max(ms)}, batch {cfg['micro'] * max(ms)}, against the "
                              f"whole model in one process")
    return ""


def main(argv: list[str] | None = None) -> None:
    args, ms, cfg = _parse(argv)
    load = common.wait(args)
    print(f"load average at start: {load['load_at_start']}", flush=True)
    check = common.launch(check_job, RANKS, cfg, max(ms), threads=1) if args.check else None
    # Both implementations every round, in swapped order every other round.
    samples, rounds = common.alternate(args.rounds, [
        lambda r: common.launch(time_job, RANKS, cfg, ms if r % 2 == 0 else ms[::-1], threads=1,
                                pin=args.pin)])
    memory, memory_warm = _memory_runs(args, cfg, ms)
    load_end = common.loadavg()

    stats = {n: common.summarize(t) for n, t in samples.items()}
    rows, result = _results(ms, cfg, stats, rounds, memory, memory_warm)
    table = common.print_table(
        ["M", "batch", "impl", "median ms", "IQR ms", "samples/s", "ratio (torch ms / ours)",
         "peak heap over base MiB (stage 0 / 1)", "same, meta trace warmed first (0 / 1)",
         "peak RSS over base MiB (0 / 1)", "of which anonymous (0 / 1)", "saved activations MiB (0 / 1)"],
        rows,
        title=f"hybridpar GPipe vs torch.distributed.pipelining.ScheduleGPipe: 2 ranks x 1 thread, gloo, "
              f"{args.depth} x Conv3d {args.channels}->{args.channels} k3 at {args.size}^3, micro-batch "
              f"{args.micro}, float32 ({args.rounds} rounds x {args.steps} steps; 1-min load "
              f"{load['load_at_start'][0]:.2f} -> {load_end[0]:.2f})")
    check_table = _check_table(check, cfg, ms)
    common.write_json(args, {
        "config": {**cfg, "microbatches": ms, "rounds": args.rounds, "ranks": RANKS,
                   "stage_starts": ["0", str(split_layer(cfg))], "batch": "micro * M",
                   "model": repr(make_stack(args.size, args.channels, args.depth)).splitlines(),
                   "dtype": "float32", "threads_per_process": 1, "pin": args.pin, "backend": "gloo",
                   "torch_schedule": "ScheduleGPipe(PipelineStage(half, rank, 2, cpu), M, loss_fn=mse_loss), "
                                     "scale_grads default (True), step(..., return_outputs=False)",
                   "memory_method": MEMORY_METHOD},
        "load": {**load, "load_at_end": load_end},
        "stats": stats, "result": result, "memory": memory, "memory_meta_warmed": memory_warm,
        "check": check, "rounds": rounds,
        "table": table, "check_table": check_table})


if __name__ == "__main__":
    main()
