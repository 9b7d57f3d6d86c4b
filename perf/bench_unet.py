"""A small 3D U-Net, parallelized whole by ``hp.parallelize``: step time and activation memory per rank
on 1, 2 and 4 ranks against one process running the plain torch model.

Why: the U-Net (``tests/graph_models.UNet3d``: 3 levels, skip concatenations, GroupNorm, trilinear
upsampling, periodic padding) keeps a full-resolution activation in every level, which is why such
networks need spatial parallelism most. The figure that matters is the activation memory each rank
keeps for backward: it must fall as ~1/P of the whole model's, plus halos; a layer silently gathered
onto every rank would hold the whole volume and show here at once. Memory is measured exactly with
:class:`hybridpar.profiling.saved_memory.SavedActivations` (the distinct storages autograd holds, peak
over the step), the same counter for the baseline and the ranks. Times are step-time medians; a
distributed step lasts as long as its slowest rank. The jobs alternate, round after round, so that
the VM's drift spreads over all of them.

    python -m perf unet                       # 64^3 and 128^3, 1/2/4 ranks
    python -m perf unet --sizes 32 --rounds 1 --steps 1 --no-wait --out /tmp/unet.json
"""

from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from perf import common

graph_models = common.test_module("graph_models")  # the U-Net the graph tests check against torch

WIDTH = 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return graph_models.UNet3d(c_in=1, c_out=1, width=WIDTH, levels=3)


def _inputs(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(1, 1, size, size, size, generator=g), torch.randn(1, 1, size, size, size, generator=g)


def baseline_job(rank: int, world: int, cfg: dict) -> dict:
    """One process, the plain torch model on the whole volume (no process group)."""
    from hybridpar.profiling.saved_memory import SavedActivations

    model = _model()
    x, y = _inputs(cfg["size"])

    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()

    times = common.time_steps(step, cfg["warmup"], cfg["steps"])
    with SavedActivations(model.parameters()) as saved:
        step()
    return {"1 process": times, "mem 1 process": saved.peak_bytes}


def dist_job(rank: int, world: int, cfg: dict) -> dict:
    """hp.parallelize on ``world`` ranks, the volume split along depth."""
    import hybridpar as hp
    from hybridpar.profiling.saved_memory import SavedActivations

    x, y = _inputs(cfg["size"])
    engine = hp.parallelize(_model(), {"grid": {"spatial": [world, 1, 1]}}, loss_fn=F.mse_loss)
    x_local, y_local = engine.shard_batch(x, y)
    params = engine.parameters()
    step = common.engine_step(engine, x_local, y_local)

    times = common.slowest_rank(common.time_steps(step, cfg["warmup"], cfg["steps"], before=common.barrier))
    with SavedActivations(params) as saved:
        step()
    peak = torch.tensor([float(saved.peak_bytes)])
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    # layers that hold the whole volume on every rank (a tuple: alternate() pools only lists)
    gathers = tuple(lp.name for lp in engine.plan if len(lp.input_shape) == 5 and lp.split == (1, 1, 1)
                    and world > 1)
    return {f"{world} ranks": times, f"mem {world} ranks": int(peak.item()), f"gathers {world}": gathers}


TINY = {"sizes": [16], "ranks": [2], "rounds": 1, "steps": 1, "warmup": 1}  # --tiny: seconds


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("unet", __doc__, rounds=2, steps=3, warmup=1, max_load=0.5, max_wait=600)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = common.parse(ap, argv, TINY)
    load = common.wait(args)
    rows, results = [], {}
    for size in args.sizes:
        cfg = {"size": size, "steps": args.steps, "warmup": args.warmup}
        jobs = [lambda r, cfg=cfg: common.launch(baseline_job, 1, cfg, group=False)]
        jobs += [lambda r, cfg=cfg, n=n: common.launch(dist_job, n, cfg) for n in args.ranks]
        pooled, per_round = common.alternate(args.rounds, jobs)
        mem = {k: v for rnd in per_round for k, v in rnd.items() if k.startswith("mem ")}
        base_t = statistics.median(pooled["1 process"])
        base_m = mem["mem 1 process"]
        rows.append([f"{size}^3", 1, f"{1e3 * base_t:.0f}", "1.00", f"{base_m / 2**20:.1f}", "1.000",
                     "1.000", "-"])
        for n in args.ranks:
            t = statistics.median(pooled[f"{n} ranks"])
            m = mem[f"mem {n} ranks"]
            gathers = next(rnd[f"gathers {n}"] for rnd in per_round)
            rows.append([f"{size}^3", n, f"{1e3 * t:.0f}", f"{base_t / t:.2f}", f"{m / 2**20:.1f}",
                         f"{m / base_m:.3f}", f"{1 / n:.3f}", ", ".join(gathers) or "none"])
        results[str(size)] = {"pooled_ms": {k: common.summarize(v) for k, v in pooled.items()},
                              "activation_bytes": mem, "per_round": per_round}
    table = common.print_table(["volume", "ranks", "step ms (median)", "speedup", "act MiB/rank (peak)",
                                "act vs 1 proc", "1/P", "gathers"], rows,
                               title=f"3D U-Net (width {WIDTH}, 3 levels), batch 1, fwd+bwd, float32")
    common.write_json(args, {"config": {"width": WIDTH}, "load": load, "results": results, "table": table})


if __name__ == "__main__":
    main()
