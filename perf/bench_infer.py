"""Whole-box inference three ways: one process, hybridpar split over 4 ranks, MONAI's sliding window.

Why: the engine's clearest advantage is an exact, split, periodic inference on a box larger than one
device holds; what users do instead is tile it (MONAI's ``sliding_window_inference``), which leaves
seams and never wraps around a periodic box. The reconstruction U-Net (``cosmoflow.unet.UNet3d`` as
``launch/configs/reconstruct.yaml`` builds it, one input channel, fixed random weights, circular
padding) runs on one periodic box read from HDF5 and written to HDF5:

* ``one process``: the whole box, ``model(x)``;
* ``hybridpar``: ``hp.infer`` on 4 ranks split (2, 2, 1): each rank reads its hyperslab and writes its
  shard (``hp.data.SplitHdf5``);
* ``MONAI``: ``sliding_window_inference`` with roi 64³, overlap 0.25 and 0.5, modes gaussian and constant.

Reported per way: max and RMS error against the one-process output, the voxels whose error exceeds
1e-5 of the output's scale (max |y|), the peak heap of the busiest rank above its level once the model
is built (``perf/heapcount.py``: glibc's allocator counted in every process alike; the one-process
and MONAI runs are one rank), and the wall time from reading the input to the output closed (for
hybridpar the engine's build too, shown apart: mostly torch's lazy imports on the first meta-device
forward of ``parallelize``, once per process, whatever the box). Every configuration gets the same
threads in all (4: the ranks × 1 thread, or one process × 4). Also measured at half the size, so
that the per-voxel growth of each peak gives the largest box 4 ranks could infer on this machine's
memory and the one-process peak that box would need (an estimate from the two measured sizes;
``--try-size N`` runs hybridpar at N for real).

    python -m perf infer --record                 # 256^3 (and 128^3 for the scaling) into perf/results/
    python -m perf infer --size 64 --no-wait       # a trial, in the scratch folder
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from perf import common, heapcount

ROI, THREADS, GRID = 64, 4, (2, 2, 1)
UNET = {"width": 8, "levels": 4, "max_width": 64, "groups": 4, "padding_mode": "circular"}
GOALS = {"exact": "float32 max error <= 1e-5 x the output's scale (max |y|), 0 voxels over it",
         "memory": "peak per rank <= 0.35 x one process's at P = 4",
         "wall": "wall time <= MONAI's at overlap 0.25 with the same total threads"}


def _model() -> torch.nn.Module:
    from cosmoflow.unet import UNet3d  # noqa: PLC0415

    torch.manual_seed(0)
    model = UNet3d(1, 1, **UNET).eval()
    with torch.no_grad():  # GroupNorm's affine away from 1/0, so that no layer is left at its default
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _write_input(path: Path, size: int) -> None:
    """A periodic random field: white noise smoothed by a Gaussian of 2 voxels (in Fourier space)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(size, size, size, generator=g, dtype=torch.float64)
    k = torch.fft.fftfreq(size, dtype=torch.float64) * 2 * math.pi
    kz = torch.fft.rfftfreq(size, dtype=torch.float64) * 2 * math.pi
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + kz[None, None, :] ** 2
    x = torch.fft.irfftn(torch.fft.rfftn(x) * torch.exp(-2.0 * k2), s=x.shape)
    with h5py.File(path, "w") as f:
        f["x"] = (x / x.std()).float().numpy()[None, None]


def one_process_job(rank: int, world: int, cfg: dict) -> dict:
    """The whole box in one process: read, ``model(x)``, write."""
    from monai.inferers import sliding_window_inference  # noqa: PLC0415 (a benchmark-only extra; untimed)

    model = _model()
    base = heapcount.current()
    heapcount.reset()
    t0 = time.perf_counter()
    with h5py.File(cfg["input"], "r") as f:
        x = torch.from_numpy(f["x"][...])
    with torch.no_grad():
        if cfg["way"] == "one process":
            y = model(x)
        else:
            roi = (cfg["roi"],) * 3
            y = sliding_window_inference(x, roi, 1, model, overlap=cfg["overlap"], mode=cfg["mode"])
    with h5py.File(cfg["output"], "w") as f:
        f["y"] = y.numpy()
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "peak_bytes": heapcount.peak() - base}


def hybridpar_job(rank: int, world: int, cfg: dict) -> dict:
    """``hp.infer`` split ``GRID``: each rank reads its hyperslab and writes its shard."""
    import hybridpar as hp  # noqa: PLC0415

    model = _model()
    size = cfg["size"]
    base = heapcount.current()
    heapcount.reset()
    common.barrier()
    t0 = time.perf_counter()
    engine = hp.parallelize(model, {"grid": {"spatial": list(GRID)}}, input_shape=(1, 1, size, size, size))
    t1 = time.perf_counter()
    with h5py.File(cfg["input"], "r") as f, \
            hp.data.SplitHdf5(cfg["output"], "y", (1, 1, size, size, size), overwrite=True) as out:
        hp.infer(engine, f["x"], out)
    wall = torch.tensor([time.perf_counter() - t0, t1 - t0, float(heapcount.peak() - base)],
                        dtype=torch.float64)
    torch.distributed.all_reduce(wall, op=torch.distributed.ReduceOp.MAX)
    return {"wall_s": wall[0].item(), "build_s": wall[1].item(), "peak_bytes": int(wall[2].item())}


def _errors(ref: np.ndarray, path: Path) -> dict:
    with h5py.File(path, "r") as f:
        y = f["y"][...].astype(np.float64)
    err = np.abs(y - ref)
    scale = float(np.abs(ref).max())
    return {"max_err": float(err.max()), "rms_err": float(np.sqrt((err ** 2).mean())),
            "over_tol": int((err > 1e-5 * scale).sum()), "scale": scale}


def _ways(overlaps: list[float], modes: list[str]) -> list[dict]:
    ways = [{"way": "one process"}, {"way": "hybridpar"}]
    ways += [{"way": "MONAI", "overlap": o, "mode": m} for o in overlaps for m in modes]
    return ways


def _name(w: dict) -> str:
    return w["way"] if w["way"] != "MONAI" else f"MONAI overlap {w['overlap']} {w['mode']}"


def _run(way: dict, size: int, folder: Path, env: dict) -> dict:
    cfg = {**way, "size": size, "roi": min(ROI, size // 2), "input": str(folder / f"in{size}.h5"),
           "output": str(folder / f"out{size}_{_name(way).replace(' ', '_')}.h5")}
    if way["way"] == "hybridpar":
        res = common.launch(hybridpar_job, math.prod(GRID), cfg, env=env, timeout=3600)
    else:
        res = common.launch(one_process_job, 1, cfg, threads=THREADS, group=False, env=env, timeout=3600)
    return {**res, "output": cfg["output"]}


def measure(size: int, ways: list[dict], rounds: int, folder: Path, env: dict) -> dict[str, dict]:
    """Each way at ``size``, alternated over ``rounds``; errors against the one-process output."""
    _write_input(folder / f"in{size}.h5", size)
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for way in ways:
            res = _run(way, size, folder, env)
            runs.setdefault(_name(way), []).append(res)
            print(f"  {size}^3 round {r + 1}: {_name(way)}: {res['wall_s']:.1f} s, peak "
                  f"{res['peak_bytes'] / 2**20:.0f} MiB", flush=True)
    with h5py.File(runs["one process"][0]["output"], "r") as f:
        ref = f["y"][...].astype(np.float64)
    out = {}
    for name, rs in runs.items():
        out[name] = {"wall_s": statistics.median(r["wall_s"] for r in rs),
                     "walls_s": [r["wall_s"] for r in rs],
                     "peak_bytes": max(r["peak_bytes"] for r in rs),
                     **({"build_s": statistics.median(r["build_s"] for r in rs)} if "build_s" in rs[0]
                        else {}),
                     **_errors(ref, Path(rs[0]["output"]))}
    for p in folder.glob(f"out{size}_*"):
        p.unlink()
    return out


def largest(small: dict, big: dict, s_small: int, s_big: int, memory: int) -> dict:
    """From peaks at two sizes (a + b·voxels each way), the largest cube (a multiple of 16, as the
    U-Net split (2, 2, 1) needs) whose 4 ranks' peaks fit ``memory`` less a 10 % margin, and the
    one-process peak that cube would need."""
    def fit(name: str) -> tuple[float, float]:
        v0, v1 = s_small ** 3, s_big ** 3
        p0, p1 = small[name]["peak_bytes"], big[name]["peak_bytes"]
        slope = (p1 - p0) / (v1 - v0)
        return p1 - slope * v1, slope

    a_h, b_h = fit("hybridpar")
    a_1, b_1 = fit("one process")
    budget = 0.9 * memory
    side = 16
    while (side + 16) ** 3 * b_h + a_h <= budget / math.prod(GRID):
        side += 16
    return {"side": side, "per_rank_bytes_estimated": a_h + b_h * side ** 3,
            "one_process_bytes_estimated": a_1 + b_1 * side ** 3, "memory_bytes": memory,
            "bytes_per_voxel": {"hybridpar per rank": b_h, "one process": b_1},
            "how": f"linear fit of the measured peaks at {s_small}^3 and {s_big}^3 (a + b x voxels), "
                   "4 ranks within 90 % of the machine's memory"}


TINY = {"size": 32, "rounds": 1, "overlaps": [0.25], "modes": ["gaussian"], "no_scaling": True}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("infer", __doc__, rounds=1, max_load=1.0, max_wait=600)
    ap.add_argument("--size", type=int, default=256, help="box side (a multiple of 16); 256 in the issue")
    ap.add_argument("--overlaps", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--modes", nargs="+", default=["gaussian", "constant"])
    ap.add_argument("--try-size", type=int, default=None, help="also run hybridpar alone at this side")
    ap.add_argument("--no-scaling", action="store_true",
                    help="skip the half-size runs (and so the largest-box estimate)")
    args = common.parse(ap, argv, TINY)
    if args.size % 16 or args.size < 32:
        ap.error(f"--size {args.size}: the 4-level U-Net split (2, 2, 1) needs a multiple of 16, at least 32")
    load = common.wait(args)
    env = heapcount.preload_env()
    if not env:
        raise SystemExit("python -m perf infer: no C compiler for perf/heap_peak.c; the peaks need it")
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    work = common.ROOT / "perf" / "out"  # the files of the runs, removed at the end
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        folder = Path(tmp)
        ways = _ways(args.overlaps, args.modes)
        half = None if args.no_scaling else measure(args.size // 2, ways[:2], args.rounds, folder, env)
        full = measure(args.size, ways, args.rounds, folder, env)
        tried = None
        if args.try_size:
            _write_input(folder / f"in{args.try_size}.h5", args.try_size)
            tried = {"size": args.try_size, **_run({"way": "hybridpar"}, args.try_size, folder, env)}
            tried.pop("output")
    one = full["one process"]
    rows = []
    for name, r in full.items():
        rows.append([name, f"{r['max_err']:.2e}", f"{r['rms_err']:.2e}", r["over_tol"],
                     f"{r['peak_bytes'] / 2**20:.0f}", f"{r['peak_bytes'] / one['peak_bytes']:.3f}",
                     f"{r['wall_s']:.1f}" + (f" ({r['build_s']:.1f} build)" if "build_s" in r else "")])
    table = common.print_table(
        ["way", "max err", "RMS err", "voxels > 1e-5 scale", "peak MiB/rank", "vs one process", "wall s"],
        rows, title=f"U-Net ({UNET['levels']} levels, width {UNET['width']}) on a periodic {args.size}^3 "
                    f"box, float32, {THREADS} threads in all; output scale {one['scale']:.3f}")
    fit = None if half is None else largest(half, full, args.size // 2, args.size, memory)
    hp_ = full["hybridpar"]
    monai = full.get("MONAI overlap 0.25 gaussian") or next((v for k, v in full.items() if "0.25" in k), None)
    goals = {
        "exact": {"goal": GOALS["exact"], "max_err": hp_["max_err"], "tolerance": 1e-5 * one["scale"],
                  "over_tol": hp_["over_tol"],
                  "met": hp_["max_err"] <= 1e-5 * one["scale"] and hp_["over_tol"] == 0},
        "memory": {"goal": GOALS["memory"], "ratio": hp_["peak_bytes"] / one["peak_bytes"],
                   "met": hp_["peak_bytes"] <= 0.35 * one["peak_bytes"]},
        "wall": {"goal": GOALS["wall"], "hybridpar_s": hp_["wall_s"],
                 "hybridpar_without_build_s": hp_["wall_s"] - hp_["build_s"],
                 "monai_0.25_s": None if monai is None else monai["wall_s"],
                 "met": None if monai is None else hp_["wall_s"] <= monai["wall_s"],
                 "met_without_build": None if monai is None
                 else hp_["wall_s"] - hp_["build_s"] <= monai["wall_s"]},
    }
    for k, g in goals.items():
        extra = "" if "met_without_build" not in g else \
            f" (without the engine's build: {'met' if g['met_without_build'] else 'NOT met'})"
        print(f"goal {k}: {g['goal']}: {'met' if g['met'] else 'NOT met'}{extra}", flush=True)
    if fit is not None:
        print(f"largest box on 4 ranks ({memory / 2**30:.1f} GiB): {fit['side']}^3, "
              f"{fit['per_rank_bytes_estimated'] / 2**30:.2f} GiB per rank; one process would need "
              f"{fit['one_process_bytes_estimated'] / 2**30:.2f} GiB (estimated: {fit['how']})", flush=True)
    common.write_json(args, {
        "config": {"unet": UNET, "roi": min(ROI, args.size // 2), "threads": THREADS, "grid": GRID,
                   "size": args.size,
                   "memory": "peak heap above the level after the model is built (perf/heapcount.py)"},
        "load": {**load, "end": common.loadavg()}, "results": {"half": half, "full": full},
        "largest": fit, "tried": tried, "goals": goals, "table": table})


if __name__ == "__main__":
    main()
