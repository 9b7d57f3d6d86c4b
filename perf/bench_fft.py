"""The distributed 3D FFT: forward + inverse of an S^3 x 4 field over P ranks against one process.

Why: a spectral layer on a split volume pays for its transposes; it only beats running the whole
field in one process where the split is what makes it fit. Each configuration runs ``hp.fft.rfftn``
then ``hp.fft.irfftn`` (float32, batch 1) on P ranks x 1 thread, split (P, 1, 1) for P = 2 and
(2, 2, 1) for P = 4, against one process x P threads running ``torch.fft.rfftn`` / ``irfftn`` on the
whole field (the same total threads). Bytes are what ``hp.fft.transpose_elements`` counts (the
plan's and the performance model's figure) against the least a transform of that split must move:
one transpose each way, every rank receiving all but its own share of its final block. The split
result is checked against ``torch.fft`` first. Memory: the peak heap of one transform there and back
on the worst rank over its shard of the complex modes (the allocator counter of ``perf/heapcount.py``;
goal <= 3, no full-volume copy). The channel groups (``hp.fft.GROUPS``) trade time for that memory:
the split ranks also step with them and with one group in turn, and report the time ratio and the
peak with one group.

Against mpi4py-fft (the usual reference for distributed FFT speed; the goal: hp.fft within
1.25x of it): where ``mpi4py_fft`` imports and ``mpiexec`` is found, each round also starts P ranks x 1
thread with ``mpiexec`` (``perf.ranks.launch(..., mpi=True)``) in which hp.fft and mpi4py-fft's
``PFFT`` take steps in turn (the order swapped every pair), so both see the same processes and the same
moment of the machine; reported: the median of the step-by-step ratios hp.fft / mpi4py-fft. PFFT is
planned on the same global (C, D, H, W) = (4, S, S, S), real-to-complex over the last three axes, the
channels batched and not split, float32, ``grid=(1, *split)``: slabs (P = 2) and 2 x 2 pencils (P = 4)
going through the layouts hp.fft's do, its spectrum D-whole as hp.fft's; FFTW, 1 thread, its default
planner effort (FFTW_MEASURE, untimed), the forward unnormalised and the backward normalised as in
``torch.fft``, and its own planned arrays (no copy in or out: its fastest use). hp.fft moves its
transposes over gloo (``point_to_point``: the layout changes ignore ``HYBRIDPAR_TRANSPORT``); as a
diagnostic only, a third variant swaps ``hybridpar.comm.redistribute.point_to_point`` for the MPI
transport (``MPIP2P``) in the same processes, to tell the transport's share from the rest. mpi4py-fft
is optional (the ``fftcompare`` extra) and needs FFTW's headers and libraries to build:

    apt-get install -y libfftw3-dev           # Debian/Ubuntu (FFTW 3.3.10 here)
    pip install -e '.[mpi,fftcompare]'        # mpi4py + MPICH's mpiexec, mpi4py-fft (builds against FFTW)

Where it is absent the comparison is skipped and the JSON and the table say "mpi4py-fft: not installed".

    python -m perf fft                 # S=128, 3 rounds x 5 steps
    python -m perf fft --size 32 --rounds 2 --steps 2 --no-wait --out /tmp/fft.json
"""

from __future__ import annotations

import importlib.util
import math
import statistics
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
    del spec
    shard = math.prod(hp.fft.rfftn(x_local, grid).data.shape) * 8  # complex64

    def peak() -> float:
        """Peak heap of one transform there and back over this rank's complex modes (the counter is
        preloaded where a C compiler exists; NaN otherwise), the worst rank's."""
        base = heapcount.current()
        heapcount.reset()
        step()
        ratio = torch.tensor([(heapcount.peak() - base) / shard if heapcount.active() else float("nan")],
                             dtype=torch.float64)
        torch.distributed.all_reduce(ratio, op=torch.distributed.ReduceOp.MAX)
        return ratio.item()

    # what the channel groups cost and save: steps with them and with one group, in turn (the order
    # swapped every pair), and the peak with one group
    grouped, ratios = hp.fft.GROUPS, []
    for i in range(cfg["steps"]):
        took = {}
        for count in ((1, grouped) if i % 2 else (grouped, 1)):
            hp.fft.GROUPS = count
            took[count] = common.slowest_rank(common.time_steps(step, 0, 1, before=common.barrier))[0]
        ratios.append(took[grouped] / took[1])
    hp.fft.GROUPS = 1
    one_group = peak()
    hp.fft.GROUPS = grouped
    return {"times": common.slowest_rank(times), "max_abs_err_modes": err, "max_abs_err_roundtrip": back,
            "peak_heap_over_complex_shard": peak(), "peak_heap_one_group": one_group,
            "grouped_over_one_group": ratios}


VARIANTS = ("hp.fft", "hp.fft over MPIP2P", "mpi4py-fft")


def compare_job(rank: int, world: int, cfg: dict) -> dict:
    """P ranks x 1 thread started by mpiexec: hp.fft (gloo), hp.fft with its transposes over MPIP2P and
    mpi4py-fft's PFFT, each checked against torch.fft, then stepped in turn (order swapped each pair)."""
    import numpy as np  # noqa: PLC0415
    from mpi4py import MPI  # noqa: PLC0415
    from mpi4py_fft import PFFT  # noqa: PLC0415

    import hybridpar as hp  # noqa: PLC0415

    s, split = cfg["size"], CONFIGS[world]
    grid = hp.ProcessGrid(spatial=split)
    x = _field(s)
    x_local = hp.scatter(x, grid)
    whole = torch.fft.rfftn(x, dim=(-3, -2, -1))
    fft = PFFT(MPI.COMM_WORLD, (CHANNELS, s, s, s), axes=(1, 2, 3), dtype=np.float32, grid=(1, *split))
    real, modes = fft.forward.input_array, fft.forward.output_array  # = the backward's output and input
    mine = x[0].numpy()[fft.local_slice(False)]
    real[...] = mine
    fft.forward(normalize=False)
    theirs_err = np.abs(modes - whole[0].numpy()[fft.local_slice(True)]).max()
    err = {"mpi4py_fft_max_abs_err_modes": float(theirs_err)}
    fft.backward(normalize=True)
    err["mpi4py_fft_max_abs_err_roundtrip"] = float(np.abs(real - mine).max())

    def ours() -> None:
        hp.fft.irfftn(hp.fft.rfftn(x_local, grid), grid)

    def theirs() -> None:
        fft.forward(normalize=False)
        fft.backward(normalize=True)

    steps = {"hp.fft": ours, "hp.fft over MPIP2P": _over_mpi(ours), "mpi4py-fft": theirs}
    spec = _over_mpi(lambda: hp.fft.rfftn(x_local, grid))()  # the MPI-moved transform is the same one
    box = tuple(slice(a, b) for a, b in spec.box())
    err["mpip2p_max_abs_err_modes"] = (spec.data - whole[(Ellipsis, *box)]).abs().max().item()
    del whole, spec
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(cfg["warmup"] + cfg["steps"]):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            common.barrier()
            t0 = time.perf_counter()
            steps[v]()
            if i >= cfg["warmup"]:
                times[v].append(time.perf_counter() - t0)
    worst = {v: common.slowest_rank(t) for v, t in times.items()}
    e = torch.tensor(list(err.values()), dtype=torch.float64)
    torch.distributed.all_reduce(e, op=torch.distributed.ReduceOp.MAX)
    return {"times": worst, "errors": dict(zip(err, e.tolist()))}


def _over_mpi(fn):
    """``fn`` run with hybridpar's layout changes moved by the MPI transport (``MPIP2P``) instead of
    gloo: a diagnostic swap of ``hybridpar.comm.redistribute.point_to_point``, not a shipped option."""
    from hybridpar.comm.transport import MPIP2P  # noqa: PLC0415

    # the module: hybridpar.comm exports a function of its name
    redistribute = importlib.import_module("hybridpar.comm.redistribute")

    transport = MPIP2P()

    def run():
        saved = redistribute.point_to_point
        redistribute.point_to_point = lambda group: transport
        try:
            return fn()
        finally:
            redistribute.point_to_point = saved

    return run


def comparison_status() -> tuple[bool, str]:
    """Whether mpi4py-fft can be compared here, and what to say about it."""
    from perf.ranks import mpiexec  # noqa: PLC0415

    if importlib.util.find_spec("mpi4py_fft") is None:
        return False, ("mpi4py-fft: not installed (no comparison; apt-get install -y libfftw3-dev, then "
                       "pip install -e '.[mpi,fftcompare]')")
    if mpiexec() is None:
        return False, "mpi4py-fft: installed but no mpiexec beside this Python or on the PATH (no comparison)"
    from importlib.metadata import version  # noqa: PLC0415

    return True, f"mpi4py-fft {version('mpi4py-fft')} (FFTW {_fftw_version()}): compared"


def _fftw_version() -> str:
    """FFTW's version string (single precision: what the comparison plans), read from the library."""
    import ctypes  # noqa: PLC0415
    import ctypes.util  # noqa: PLC0415

    try:
        lib = ctypes.CDLL(ctypes.util.find_library("fftw3f") or "libfftw3f.so.3")
        return (ctypes.c_char * 64).in_dll(lib, "fftwf_version").value.decode().removeprefix("fftw-")
    except (OSError, ValueError, AttributeError):
        return "version unknown"


def least_elements(size: int, parts: int) -> int:
    """Real numbers per sample a rank must receive in a forward + inverse transform of a field split
    ``parts`` ways: one transpose each way of its 1/parts share of the complex modes, all but the
    1/parts of it it already holds."""
    modes = size * size * (size // 2 + 1) * 2 * CHANNELS
    return 2 * math.ceil(modes / parts * (parts - 1) / parts)


TINY = {"size": 16, "rounds": 1, "steps": 1, "warmup": 1, "ranks": "2"}  # --tiny: one split, seconds


def main(argv: list[str] | None = None) -> None:
    from hybridpar.fft import GROUPS, transpose_elements

    ap = common.parser("fft", __doc__, rounds=3, steps=5, warmup=1, max_load=0.5, pin=True)
    ap.add_argument("--size", type=int, default=128, help="edge S of the cubic field (default 128)")
    ap.add_argument("--ranks", default="2,4", help="rank counts to run, of 2 and 4 (default 2,4)")
    args = common.parse(ap, argv, TINY)
    configs = {p: CONFIGS[p] for p in map(int, args.ranks.split(","))}
    cfg = {"size": args.size, "warmup": args.warmup, "steps": args.steps}
    compare, m4f = comparison_status()
    print(m4f, flush=True)
    load = common.wait(args)
    t0 = time.monotonic()
    jobs = []
    for p in configs:
        jobs.append(lambda r, p=p: {f"1 proc x {p} threads": common.launch(
            whole_job, 1, cfg, threads=p, group=False, pin=args.pin)["times"]})
        jobs.append(lambda r, p=p: {f"{p} ranks": _split(p, cfg, args.pin)})
        if compare:
            jobs.append(lambda r, p=p: _compare(p, cfg, args.pin))
    samples, rounds = common.alternate(args.rounds, jobs)
    load_end, run_s = common.loadavg(), round(time.monotonic() - t0, 1)
    round_loads = [rd["load"][0] for rd in rounds]
    noisy = common.disturbed(round_loads, max(configs))
    stats = {n: common.summarize(v) for n, v in samples.items()}
    s, rows, rows_m4f, result = args.size, [], [], {}
    for p, split in configs.items():
        base, ours = stats[f"1 proc x {p} threads"]["median_ms"], stats[f"{p} ranks"]["median_ms"]
        moved = transpose_elements((s, s, s), split, CHANNELS, CHANNELS)
        least = least_elements(s, p)
        errs = _ERRORS.get(p, {})
        result[str(p)] = {"split": list(split), "median_ms": ours, "baseline_median_ms": base,
                          "speedup": base / ours, "bytes_per_rank": 4 * moved,
                          "least_bytes_per_rank": 4 * least, "bytes_over_least": moved / least, **errs}
        if p in _GROUPED:
            r = sorted(_GROUPED[p])
            result[str(p)]["channel_groups"] = {
                "groups": GROUPS, "time_over_one_group_median": statistics.median(r),
                "iqr": [r[len(r) // 4], r[(3 * len(r)) // 4]], "n": len(r)}
            grouped = result[str(p)].get("channel_groups", {}).get("time_over_one_group_median", float("nan"))
        rows.append([f"{p} ranks x 1 thread, split {split}", ours, base, base / ours,
                     f"{4 * moved / 2**20:.1f}", f"{4 * least / 2**20:.1f}", moved / least,
                     errs.get("peak_heap_over_complex_shard", float("nan")),
                     errs.get("peak_heap_one_group", float("nan")), grouped])
        if compare:
            result[str(p)].update(_comparison(p, rounds, stats))
            c = result[str(p)]
            over, mpi_over = c["hp_fft_over_mpi4py_fft"], c["hp_fft_mpip2p_over_mpi4py_fft"]
            rows_m4f.append([f"{p} ranks x 1 thread, split {split}", *c["mpiexec_median_ms"].values(),
                             f"{over['median']:.3f}", "-".join(f"{q:.3f}" for q in over["iqr"]),
                             " ".join(f"{q:.3f}" for q in over["per_round"]), f"{mpi_over['median']:.3f}",
                             "yes" if c["goal_within_1_25x_met"] else "no"])
    table = common.print_table(
        ["config", "median ms", "1 proc x P threads ms", "speedup", "MiB in per rank", "least MiB",
         "bytes / least", "peak heap / complex shard (goal <= 3)", "peak, one group",
         "time / one group's"], rows,
        title=f"Distributed 3D FFT: rfftn + irfftn of {s}^3 x {CHANNELS}, float32, batch 1 "
              f"({args.rounds} rounds x {args.steps} steps){'; DISTURBED by other work' if noisy else ''}")
    if compare:
        table += "\n\n" + common.print_table(
            ["config", *(f"{v} ms" for v in VARIANTS), "hp.fft / mpi4py-fft", "IQR", "per round",
             "hp.fft over MPIP2P / mpi4py-fft", "within 1.25x"], rows_m4f,
            title=f"Against {m4f.removesuffix(': compared')}, stepped in turn in the same P processes "
                  f"started by mpiexec ({_mpi_library()}); hp.fft's transposes over gloo as shipped, over "
                  f"MPIP2P as a diagnostic; ratios: medians of step-by-step ratios")
    else:
        print(m4f, flush=True)
        table += f"\n\n{m4f}"
    common.write_json(args, {
        "config": {**cfg, "rounds": args.rounds, "channels": CHANNELS, "dtype": "float32", "batch": 1,
                   "splits": {str(p): list(v) for p, v in configs.items()}, "threads_per_rank": 1},
        "mpi4py_fft": m4f,
        **({"mpi4py_fft_config": M4F_CONFIG, "mpi_library": _mpi_library()} if compare else {}),
        **common.round_record(load, load_end, run_s, round_loads, noisy),
        "stats": stats, "result": result, "rounds": rounds, "table": table})


_ERRORS: dict[int, dict] = {}
_GROUPED: dict[int, list[float]] = {}
_M4F_ERRORS: dict[int, dict] = {}
_GROUPED: dict[int, list[float]] = {}
M4F_CONFIG = {
    "launcher": "mpiexec (perf.ranks.launch(..., mpi=True)); the three variants stepped in turn in the same "
                "processes, the order swapped every step",
    "pfft": "PFFT(COMM_WORLD, (4, S, S, S), axes=(1, 2, 3), dtype=float32, grid=(1, *split)); FFTW backend, "
            "1 thread, planner FFTW_MEASURE (untimed); forward(normalize=False) + backward(normalize=True) "
            "on its planned arrays",
    "hp_fft": "hp.fft.irfftn(hp.fft.rfftn(x_local, grid), grid), transposes over gloo (point_to_point)",
    "hp_fft_over_mpip2p": "the same with hybridpar.comm.redistribute.point_to_point swapped for MPIP2P "
                          "(diagnostic, not a shipped option)",
    "goal": "hp.fft / mpi4py-fft <= 1.25",
}


def _split(p: int, cfg: dict, pin: bool) -> list[float]:
    out = common.launch(split_job, p, cfg, threads=1, pin=pin, env=heapcount.preload_env())
    _ERRORS[p] = {k: out[k] for k in ("max_abs_err_modes", "max_abs_err_roundtrip",
                                      "peak_heap_over_complex_shard", "peak_heap_one_group")}
    _GROUPED.setdefault(p, []).extend(out["grouped_over_one_group"])
    return out["times"]


def _compare(p: int, cfg: dict, pin: bool) -> dict[str, list[float]]:
    out = common.launch(compare_job, p, cfg, threads=1, pin=pin, mpi=True)
    _M4F_ERRORS[p] = out["errors"]
    return {f"{p} ranks {v} (mpiexec)": t for v, t in out["times"].items()}


def _ratios(base: list[list[float]], other: list[list[float]]) -> dict:
    """``other / base`` step by step (per round, the steps taken in turn): the median, the interquartile
    range and each round's median."""
    pooled = sorted(b / a for ra, rb in zip(base, other) for a, b in zip(ra, rb))
    return {"median": statistics.median(pooled),
            "iqr": [pooled[int(q * (len(pooled) - 1))] for q in (0.25, 0.75)],
            "per_round": [statistics.median(b / a for a, b in zip(ra, rb)) for ra, rb in zip(base, other)]}


def _comparison(p: int, rounds: list[dict], stats: dict) -> dict:
    """The JSON keys of the comparison against mpi4py-fft on ``p`` ranks."""
    name = {v: f"{p} ranks {v} (mpiexec)" for v in VARIANTS}
    per_round = {v: [rd[n] for rd in rounds] for v, n in name.items()}
    over = _ratios(per_round["mpi4py-fft"], per_round["hp.fft"])
    return {"mpiexec_median_ms": {v: stats[n]["median_ms"] for v, n in name.items()},
            "hp_fft_over_mpi4py_fft": over,
            "hp_fft_mpip2p_over_mpi4py_fft": _ratios(per_round["mpi4py-fft"],
                                                     per_round["hp.fft over MPIP2P"]),
            "goal_within_1_25x_met": over["median"] <= 1.25, **_M4F_ERRORS.get(p, {})}


def _mpi_library() -> str:
    """The MPI library's name and version (MPI is not initialised in this process)."""
    import mpi4py  # noqa: PLC0415

    mpi4py.rc.initialize = mpi4py.rc.finalize = False
    from mpi4py import MPI  # noqa: PLC0415

    return " ".join(MPI.Get_library_version().splitlines()[0].split())


if __name__ == "__main__":
    main()
