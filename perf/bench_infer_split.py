"""Inference at equal cores: a U-Net split over 2 ranks against one process and MONAI's sliding window.

Why: a user with a box that fits one process asks whether splitting it costs time. With the cores held
equal, the split run must pay for its halos, its imbalance and its output layout out of the same
compute. MONAI's BasicUNet (features 8, 8, 16, 32, 64, 8; BatchNorm in eval, float32) infers one
S^3 box three ways, each in fresh processes, in rounds whose order reverses every round (this VM's
speed drifts):

* ``one process``: 1 process x 2 threads, ``model(x)`` under ``torch.inference_mode``;
* ``hybridpar``: 2 ranks x 1 thread, split (2, 1, 1), ``Engine.predict(x_local, gather=False)`` (each
  rank keeps its shard of the output); the engine is built before the clock starts;
* ``MONAI``: 1 process x 2 threads, ``sliding_window_inference`` with roi 64^3, overlap 0.25, constant
  blending, batch 1 (what a user of MONAI runs; its output differs from the model's near the seams).

The split output is checked against the one-process output (gathered on the first rank, max abs error).

    python -m perf infer_split --record        # S = 128
    python -m perf infer_split --tiny
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from perf import common

WAYS = ("one process", "hybridpar", "MONAI")


def unet() -> nn.Module:
    from monai.networks.nets import BasicUNet  # noqa: PLC0415

    torch.manual_seed(0)
    return BasicUNet(3, 1, 1, features=(8, 8, 16, 32, 64, 8), norm=("batch", {"affine": True})).eval()


def volume(size: int) -> torch.Tensor:
    return torch.randn((1, 1, size, size, size), generator=torch.Generator().manual_seed(3))


def whole_job(rank: int, world: int, way: str, cfg: dict) -> dict:
    """One process: the model itself, or MONAI's sliding window over it."""
    from monai.inferers import sliding_window_inference  # noqa: PLC0415

    model, x = unet(), volume(cfg["size"])
    roi = (min(64, cfg["size"]),) * 3

    def run() -> torch.Tensor:
        with torch.inference_mode():
            if way == "MONAI":
                return sliding_window_inference(x, roi, 1, model, overlap=0.25, mode="constant")
            return model(x)

    times = common.time_steps(run, cfg["warmup"], cfg["steps"])
    return {"times": times, "output": run() if way == "one process" and cfg["check"] else None}


def split_job(rank: int, world: int, cfg: dict, want: torch.Tensor | None) -> dict:
    """2 ranks: the engine built, then predictions timed until the slowest rank is done."""
    import hybridpar as hp
    from hybridpar.comm.redistribute import gather

    x = volume(cfg["size"])
    t0 = time.perf_counter()
    engine = hp.parallelize(unet(), {"grid": {"spatial": [world, 1, 1]}}, input_shape=tuple(x.shape)).eval()
    x_local = engine.shard_batch(x)[0]
    build_s = time.perf_counter() - t0
    run = lambda: engine.predict(x_local, gather=False)  # noqa: E731
    times = common.slowest_rank(common.time_steps(run, cfg["warmup"], cfg["steps"], before=common.barrier))
    err = None
    if want is not None:
        whole = gather(run(), engine.layout.of(engine.output_split), tuple(x.shape[2:]))
        err = (whole - want).abs().max().item()
    return {"times": times, "build_s": build_s, "max_abs_err": err}


def _round(cfg: dict, order: list[str]) -> dict:
    out: dict = {}
    want = None
    for way in order:
        if way == "hybridpar":
            res = common.launch(split_job, 2, cfg, want, threads=1)
            out["build_s"], out["max_abs_err"] = res["build_s"], res["max_abs_err"]
        else:
            res = common.launch(whole_job, 1, way, cfg, threads=2, group=False)
            want = res["output"] if res["output"] is not None else want
        out[way] = res["times"]
    return out


TINY = {"size": 32, "rounds": 1, "steps": 1, "warmup": 1}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("infer_split", __doc__, rounds=4, steps=3, warmup=1, max_load=0.5)
    ap.add_argument("--size", type=int, default=128, help="box side S (a multiple of 16; default 128)")
    args = common.parse(ap, argv, TINY)
    cfg = {"size": args.size, "steps": args.steps, "warmup": args.warmup, "check": True}
    load = common.wait(args)
    t0 = time.monotonic()
    rounds = []
    for r in range(args.rounds):  # the one-process run first: the split run is checked against it
        order = ["one process", *(["hybridpar", "MONAI"] if r % 2 == 0 else ["MONAI", "hybridpar"])]
        rounds.append(_round(cfg, order))
        said = ", ".join(f"{w} {1e3 * statistics.median(rounds[-1][w]):.0f} ms" for w in WAYS)
        print(f"round {r + 1}/{args.rounds}: {said}", flush=True)
    med = {w: [statistics.median(rd[w]) for rd in rounds] for w in WAYS}
    ratio = {f"hybridpar / {w}": statistics.median(h / o for h, o in
                                                   zip(med["hybridpar"], med[w], strict=True))
             for w in ("one process", "MONAI")}
    stats = {w: common.summarize([t for rd in rounds for t in rd[w]]) for w in WAYS}
    rows = [[w, stats[w]["median_ms"], f"{stats[w]['q1_ms']:.0f}-{stats[w]['q3_ms']:.0f}",
             "" if w == "hybridpar" else f"{ratio[f'hybridpar / {w}']:.3f}"] for w in WAYS]
    err = max(rd["max_abs_err"] for rd in rounds)
    table = common.print_table(
        ["way (2 cores in all)", "median ms", "IQR ms", "hybridpar / this (median of rounds)"], rows,
        title=f"BasicUNet (BatchNorm, eval) on one {args.size}^3 box: 2 ranks x 1 thread split (2,1,1) "
              f"against 1 process x 2 threads and MONAI's sliding window (roi 64^3, overlap 0.25); split "
              f"output max abs error {err:.1e}; engine build "
              f"{statistics.median(rd['build_s'] for rd in rounds):.1f} s apart ({args.rounds} rounds x "
              f"{args.steps} steps; goals: <= 1.10 x one process, <= MONAI)")
    common.write_json(args, {"config": {**cfg, "rounds": args.rounds, "ranks": 2, "threads_in_all": 2,
                                        "model": "monai BasicUNet (8,8,16,32,64,8), BatchNorm, eval, float32",
                                        "monai": "sliding_window_inference roi 64^3 overlap 0.25 constant"},
                              "load_at_start": load["load_at_start"], "load_at_end": common.loadavg(),
                              "run_s": round(time.monotonic() - t0, 1), "ratios": ratio, "stats": stats,
                              "max_abs_err": err, "rounds": [{k: v for k, v in rd.items()} for rd in rounds],
                              "table": table})


if __name__ == "__main__":
    main()
