"""The layout advisor against measurement: every candidate it ranks, run, and its choice against the best.

Why: ``parallelize(model, "auto", ...)`` trusts :func:`hybridpar.advisor.advise` to pick the fastest
layout from the performance model's predictions; that trust is earned only by running what it ranked.
For each workload and world size this runs every layout the advisor kept (those that fit memory),
each in the same ranks, in rounds whose order alternates (this VM's speed drifts), and reports:

* the chosen layout's measured step against the fastest measured one (goal: within 10 %);
* each candidate's predicted step against its measured one (goal: within 15 % for 85 % of them).

Workloads: the harness's CosmoFlow network (3 conv blocks, 16-64 filters) on 4 x 4 x 32^3, and
cosmoflow's 3-level U-Net (width 8, GroupNorm) on 2 x 1 x 32^3 predicting a volume (the performance
model reads a traced graph: MONAI's BasicUNet runs by module swapping, which it cannot size);
mean-squared error, SGD, float32, 1 thread per rank; 2 and 4 ranks (4 oversubscribe a 2-core machine,
as the calibration knows from its contention probe). The machine: the harness's calibration of this host
(``python -m perf harness --calibrate-only``), ``--machine`` to name another, extended with every layer
shape the candidates run, measured here first as the harness measures its sweep's (the fitted costs
alone do not know a U-Net's norms and concatenations).

    python -m perf advisor --record
    python -m perf advisor --tiny
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from perf import common

CALIBRATION = Path(__file__).parent / "results" / "scaling" / "calibration.json"
WORKLOADS = {"cosmoflow": (4, 4, 32, 32, 32), "unet": (2, 1, 32, 32, 32)}


def build(name: str, shape: tuple[int, ...]) -> nn.Module:
    """The workload's model, seeded (every rank and the advisor build the same one)."""
    torch.manual_seed(0)
    if name == "cosmoflow":
        from perf.harness.models import build_model  # noqa: PLC0415

        return build_model("cosmoflow", shape)
    from cosmoflow.unet import UNet3d  # noqa: PLC0415

    return UNet3d(shape[1], 1, width=8, levels=3)


def _target(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn((shape[0], 4) if name == "cosmoflow" else (shape[0], 1, *shape[2:]), generator=g)


def candidates_job(rank: int, world: int, name: str, shape: tuple[int, ...], specs: list[dict],
                   cfg: dict) -> dict[str, list[float]]:
    """Every candidate spec in these ranks: ``rounds`` rounds, the order reversed every other round, each
    a warm-up step and ``steps`` timed ones (a step lasts until its slowest rank is done)."""
    import hybridpar as hp

    torch.manual_seed(1)
    x, y = torch.randn(shape), _target(name, shape)
    steps: dict[str, Any] = {}
    for k, spec in enumerate(specs):
        engine = hp.parallelize(build(name, shape), spec, loss_fn=F.mse_loss, input_shape=shape)
        opt = torch.optim.SGD(engine.parameters() or [{"params": []}], lr=1e-4)
        local = engine.shard_batch(x, y)

        def step(engine=engine, opt=opt, local=local) -> None:
            engine.train_step(*local)
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[str(k)] = step
    out: dict[str, list[float]] = {}
    order = list(steps)
    for r in range(cfg["rounds"]):
        for key in (order if r % 2 == 0 else order[::-1]):
            times = common.time_steps(steps[key], cfg["warmup"], cfg["steps"], before=common.barrier)
            out.setdefault(key, []).extend(common.slowest_rank(times))
    return out


def _calibrated(machine: Any, advice: Any, cfg: dict) -> tuple[Any, int]:
    """``machine`` with every layer shape the candidates run measured on this host (one rank, one
    thread, as the harness calibrates its sweep's), and how many were measured anew."""
    from hybridpar import perfmodel as pm  # noqa: PLC0415
    from perf.harness.calibrate import calibrate_job  # noqa: PLC0415

    w, entries = advice.workload, {}
    for c in advice.fits:
        for e in pm.layer_entries(w, w.plan(c.spec)):
            entries.setdefault(e[0], e)
    missing = [e for key, e in entries.items() if key not in machine.measured]
    if not missing:
        return machine, 0
    table = common.launch(calibrate_job, 1, missing, cfg["repeats"], False, threads=1)["table"]
    return machine.with_measured(table), len(missing)


def _measure(name: str, world: int, machine: Any, cfg: dict) -> dict[str, Any]:
    """Advise (its layer shapes measured on this host first), run every candidate, compare."""
    from hybridpar.advisor import advise  # noqa: PLC0415

    shape = WORKLOADS[name]
    advice = advise(build(name, shape), shape, world, machine.memory / world, machine, recompute="off")
    machine, calibrated = _calibrated(machine, advice, cfg)
    advice = advise(advice.workload, None, world, machine.memory / world, machine, recompute="off")
    cands = advice.fits[:cfg["max_candidates"]]
    samples = common.launch(candidates_job, world, name, shape, [c.spec.to_dict() for c in cands], cfg,
                            threads=1)
    rows = []
    for k, c in enumerate(cands):
        measured = statistics.median(samples[str(k)])
        rows.append({"layout": c.describe(), "spec": c.spec.to_dict(), "predicted_s": c.time,
                     "measured_s": measured, "error": c.time / measured - 1, "samples_s": samples[str(k)]})
    best = min(rows, key=lambda r: r["measured_s"])
    within = sum(abs(r["error"]) <= 0.15 for r in rows) / len(rows)
    return {"workload": name, "world": world, "input_shape": list(shape), "considered": advice.evaluated,
            "layer_shapes_calibrated": calibrated,
            "candidates": rows, "chosen": rows[0]["layout"], "best_measured": best["layout"],
            "chosen_over_best": rows[0]["measured_s"] / best["measured_s"], "share_within_15pct": within}


TINY = {"rounds": 1, "steps": 1, "warmup": 1}


def main(argv: list[str] | None = None) -> None:
    ap = common.parser("advisor", __doc__, rounds=2, steps=3, warmup=1, max_load=0.5)
    ap.add_argument("--machine", type=Path, default=CALIBRATION,
                    help="the calibration to predict with (default: the harness's, perf/results/scaling/)")
    ap.add_argument("--worlds", default="2,4", help="rank counts (default 2,4)")
    ap.add_argument("--max-candidates", type=int, default=40,
                    help="run at most this many, the best predicted first")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="of " + ", ".join(WORKLOADS))
    args = common.parse(ap, argv, {**TINY, "worlds": "2", "max_candidates": 1, "workloads": "cosmoflow"})
    from hybridpar import perfmodel as pm  # noqa: PLC0415

    machine = pm.load_machine(args.machine)
    cfg = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny,
           "max_candidates": args.max_candidates, "repeats": 1 if args.tiny else 5}
    load = common.wait(args)
    t0 = time.monotonic()
    results = [_measure(name, int(w), machine, cfg) for w in args.worlds.split(",")
               for name in args.workloads.split(",")]
    rows = [[r["workload"], r["world"], len(r["candidates"]), r["chosen"], r["best_measured"],
             f"{r['chosen_over_best']:.3f}", f"{100 * r['share_within_15pct']:.0f} %"] for r in results]
    table = common.print_table(
        ["workload", "ranks", "run", "chosen (predicted fastest)", "fastest measured", "chosen / best",
         "predicted within 15 %"], rows,
        title=f"The advisor's choice against every candidate measured ({args.rounds} rounds x {args.steps} "
              f"steps; machine {machine.name}; goals: chosen / best <= 1.10, >= 85 % within 15 %)")
    detail = [[r["workload"], r["world"], c["layout"], 1e3 * c["predicted_s"], 1e3 * c["measured_s"],
               f"{100 * c['error']:+.0f} %"] for r in results for c in r["candidates"]]
    details = common.print_table(["workload", "ranks", "layout", "predicted ms", "measured ms", "error"],
                                 detail)
    common.write_json(args, {"config": {**cfg, "workloads": {k: list(v) for k, v in WORKLOADS.items()},
                                        "machine_file": str(args.machine), "threads_per_process": 1},
                             "load_at_start": load["load_at_start"], "load_at_end": common.loadavg(),
                             "run_s": round(time.monotonic() - t0, 1), "results": results,
                             "table": table, "details": details})


if __name__ == "__main__":
    main()
