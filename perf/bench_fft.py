"""The distributed 3D FFT: forward + inverse of an S^3 x 4 field over P ranks against one process.

Why: a spectral layer on a split volume pays for its transposes; it only beats running the whole
field in one process where the split is what makes it fit. Each configuration runs ``hp.fft.rfftn``
then ``hp.fft.irfftn`` (float32, batch 1) on P ranks x 1 thread, split (P, 1, 1) for P = 2 and
(2, 2, 1) for P = 4, against one process x P threads running ``torch.fft.rfftn`` / ``irfftn`` on the
whole field (the same total threads). Bytes are what ``hp.fft.transpose_elements`` counts (the
plan's and the performance model's figure) against the least a transform of that split must move:
one transpose each way, every rank receiving all but its own share of its final block. The split
result is checked against ``torch.fft`` first. mpi4py-fft, the usual reference for distributed FFT
speed, needs FFTW built from source; where it is not importable the JSON says so. Memory: the peak
heap of one transform there and back on the worst rank over its shard of the complex modes (the
allocator counter of ``perf/heapcount.py``; goal <= 3, no full-volume copy).

    python -m perf fft                 # S=128, 3 rounds x 5 steps
    python -m perf fft --size 32 --rounds 2 --steps 2 --no-wait --out /tmp/fft.json
"""

from __future__ import annotations

import importlib.util
import math
import time

import torch

from perf import common, heapcount

CONFIGS = {2: (2, 1, 1), 4: (2, 2, 1)}
CHANNELS = 4


def _field(size: int) -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(1, CHANNELS, size, size, size)


def whole_job(rank: int, world: int, cfg: dict) -> dict:
    """One process, all threads: torch.fft on the whole field."""
    x = _field(cfg["size"])

    def step() -> None:
        torch.fft.irfftn(torch.fft.rfftn(x, dim=(-3, -2, -1)), s=x.shape[2:], dim=(-3, -2, -1))

    return {"times": common.time_steps(step, cfg["warmup"], cfg["steps"]), "threads": torch.get_num_threads()}


def split_job(rank: int, world: int, cfg: dict) -> dict:
    """P ranks x 1 thread: hp.fft on the shards, checked against torch.fft on the whole."""
    import hybridpar as hp

    grid = hp.ProcessGrid(spatial=CONFIGS[world])
    x = _field(cfg["size"])
    x_local = hp.scatter(x, grid)
    spec = hp.fft.rfftn(x_local, grid)
    box = tuple(slice(a, b) for a, b in spec.box())
    err = (spec.data - torch.fft.rfftn(x, dim=(-3, -2, -1))[(Ellipsis, *box)]).abs().max().item()
    back = (hp.gather(hp.fft.irfftn(spec, grid), grid) - x).abs().max().item()

    def step() -> None:
        hp.fft.irfftn(hp.fft.rfftn(x_local, grid), grid)

    times = common.time_steps(step, cfg["warmup"], cfg["steps"], before=common.barrier)
    # peak heap of one transform there and back over this rank's complex modes (the counter is
    # preloaded where a C compiler exists; 0 otherwise), the worst rank's
    del spec
    base = heapcount.current()
    heapcount.reset()
    step()
    shard = math.prod(hp.fft.rfftn(x_local, grid).data.shape) * 8  # complex64
    ratio = torch.tensor([(heapcount.peak() - base) / shard if heapcount.active() else float("nan")],
                         dtype=torch.float64)
    torch.distributed.all_reduce(ratio, op=torch.distributed.ReduceOp.MAX)
    return {"times": common.slowest_rank(times), "max_abs_err_modes": err, "max_abs_err_roundtrip": back,
            "peak_heap_over_complex_shard": ratio.item()}


def least_elements(size: int, parts: int) -> int:
    """Real numbers per sample a rank must receive in a forward + inverse transform of a field split
    ``parts`` ways: one transpose each way of its 1/parts share of the complex modes, all but the
    1/parts of it it already holds."""
    modes = size * size * (size // 2 + 1) * 2 * CHANNELS
    return 2 * math.ceil(modes / parts * (parts - 1) / parts)


TINY = {"size": 16, "rounds": 1, "steps": 1, "warmup": 1}


def main(argv: list[str] | None = None) -> None:
    from hybridpar.fft import transpose_elements

    ap = common.parser("fft", __doc__, rounds=3, steps=5, warmup=1, max_load=0.5, pin=True)
    ap.add_argument("--size", type=int, default=128, help="edge S of the cubic field (default 128)")
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "warmup": args.warmup, "steps": args.steps}
    load = common.wait(args)
    t0 = time.monotonic()
    jobs = []
    for p in CONFIGS:
        jobs.append(lambda r, p=p: {f"1 proc x {p} threads": common.launch(
            whole_job, 1, cfg, threads=p, group=False, pin=args.pin)["times"]})
        jobs.append(lambda r, p=p: {f"{p} ranks": _split(p, cfg, args.pin)})
    samples, rounds = common.alternate(args.rounds, jobs)
    load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
    round_loads = [rd["load"][0] for rd in rounds]
    noisy = common.disturbed(round_loads, max(CONFIGS))
    stats = {n: common.summarize(v) for n, v in samples.items()}
    s, rows, result = args.size, [], {}
    for p, split in CONFIGS.items():
        base, ours = stats[f"1 proc x {p} threads"]["median_ms"], stats[f"{p} ranks"]["median_ms"]
        moved = transpose_elements((s, s, s), split, CHANNELS, CHANNELS)
        least = least_elements(s, p)
        errs = _ERRORS.get(p, {})
        result[str(p)] = {"split": list(split), "median_ms": ours, "baseline_median_ms": base,
                          "speedup": base / ours, "bytes_per_rank": 4 * moved,
                          "least_bytes_per_rank": 4 * least, "bytes_over_least": moved / least, **errs}
        rows.append([f"{p} ranks x 1 thread, split {split}", ours, base, base / ours,
                     f"{4 * moved / 2**20:.1f}", f"{4 * least / 2**20:.1f}", moved / least,
                     errs.get("peak_heap_over_complex_shard", float("nan"))])
    table = common.print_table(
        ["config", "median ms", "1 proc x P threads ms", "speedup", "MiB in per rank", "least MiB",
         "bytes / least", "peak heap / complex shard (goal <= 3)"], rows,
        title=f"Distributed 3D FFT: rfftn + irfftn of {s}^3 x {CHANNELS}, float32, batch 1 "
              f"({args.rounds} rounds x {args.steps} steps){'; DISTURBED by other work' if noisy else ''}")
    m4f = importlib.util.find_spec("mpi4py_fft") is not None
    common.write_json(args, {
        "config": {**cfg, "rounds": args.rounds, "channels": CHANNELS, "dtype": "float32", "batch": 1,
                   "splits": {str(p): list(v) for p, v in CONFIGS.items()}, "threads_per_rank": 1},
        "mpi4py_fft": "importable, not yet compared" if m4f else
                      "not installed (needs FFTW built from source; no comparison)",
        **common.round_record(load, load_end, run_s, round_loads, noisy),
        "stats": stats, "result": result, "rounds": rounds, "table": table})


_ERRORS: dict[int, dict] = {}


def _split(p: int, cfg: dict, pin: bool) -> list[float]:
    out = common.launch(split_job, p, cfg, threads=1, pin=pin, env=heapcount.preload_env())
    _ERRORS[p] = {k: out[k] for k in ("max_abs_err_modes", "max_abs_err_roundtrip",
                                      "peak_heap_over_complex_shard")}
    return out["times"]


if __name__ == "__main__":
    main()
