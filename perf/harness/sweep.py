"""The sweep itself: every configuration of a world size run in one spawned gloo group, each after a state
probe, timed from a barrier to the slowest rank's end.

Why one group per world size: starting ranks costs seconds, and the configurations of one size share
them one after another; the parent waits for a quiet machine between sizes, not between layouts.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.configs import CATEGORIES, Config
from perf.harness.models import build_model
from perf.harness.probe import calibration_reference, probe_problem, state_probe


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _run_config(rank: int, cfg: Config, warmup: int, steps: int, timeline: str | None) -> dict[str, Any]:
    import torch.distributed as dist  # noqa: PLC0415
    import torch.nn.functional as F  # noqa: PLC0415

    import hybridpar as hp  # noqa: PLC0415
    from hybridpar.profiling import StepTimer  # noqa: PLC0415
    from hybridpar.profiling import range as prange  # noqa: PLC0415

    model = build_model(cfg.model, cfg.input_shape)
    engine = hp.parallelize(model, hp.ParallelSpec.from_dict(cfg.spec), loss_fn=F.mse_loss,
                            input_shape=cfg.input_shape)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(cfg.input_shape, generator=gen)
    y = torch.randn(cfg.input_shape[0], 4, generator=gen)
    params = engine.parameters()  # a stage of pooling and activations has none
    opt = torch.optim.SGD(params, lr=1e-4, momentum=0.9) if params else None
    log = None if timeline is None else Path(timeline) / cfg.key.replace("/", "_")
    timer = StepTimer(rank=rank, record_ranges=log is not None, log=log)
    for i in range(warmup + steps):
        dist.barrier()
        with timer.step(i):
            with prange("shard_batch", "data_wait"):
                x_local, y_local = engine.shard_batch(x, y)
            engine.train_step(x_local, y_local)
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    timer.close()
    records = [r for r in timer.records if r.step >= warmup]
    mine = torch.tensor([r.duration for r in records], dtype=torch.float64)
    slowest = mine.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    breakdown = {k: statistics.fmean(r.breakdown.get(k, 0.0) for r in records) for k in CATEGORIES}
    breakdown["pipeline"] += statistics.fmean(r.breakdown.get("bubble", 0.0) for r in records)
    breakdown["other"] += statistics.fmean(r.breakdown.get("checkpoint", 0.0) for r in records)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rank": rank, "breakdown": breakdown, "step_s": mine.tolist(),
                                      "rss_mib": _rss_mib()})
    del engine, opt
    return {"steps_s": slowest.tolist(), "ranks": everyone}


def group_job(rank: int, world: int, cfgs: list[Config], warmup: int, steps: int,
              timeline: str | None = None, probe: tuple | None = None,
              reference_s: float | None = None, probe_window: float = 0.5) -> list[dict[str, Any]]:
    """All configs of one world size, one after another, in one spawned group, each after a state
    probe (the drift is the probe's time alone against ``reference_s``, the calibration's)."""
    out = []
    for cfg in cfgs:
        state = state_probe(rank, world, probe, probe_window) if probe is not None else None
        if state is not None:
            state["drift"] = state["alone_s"] / reference_s if reference_s else 1.0
            if rank == 0:
                link = "" if state["exchange"] is None else \
                    f", exchange alpha {1e6 * pm.link_from_samples(state['exchange']).latency:.0f} us"
                contention = "" if state["contention"] is None else f", contention x{state['contention']:.2f}"
                print(f"  state: drift x{state['drift']:.2f}{contention}{link}", flush=True)
        t0 = time.time()
        res = _run_config(rank, cfg, warmup, steps, timeline)
        res["wall_s"] = time.time() - t0
        res["load_after"] = common.loadavg()
        res["state"] = state
        out.append(res)
        if rank == 0:
            print(f"  {cfg.key:<34} median {1e3 * statistics.median(res['steps_s']):8.1f} ms  "
                  f"(load {res['load_after'][0]:.2f})", flush=True)
    return out


def run_sweep(args: argparse.Namespace, cfgs: list[Config], calib: Path,
              cores: int) -> tuple[dict[str, dict], dict[int, dict]]:
    """Every world size of the sweep, smallest first, each after the load has dropped (up to
    ``--group-wait``): the raw results per configuration, and the load around each world size."""
    raw: dict[str, dict] = {}
    loads = {}
    probe = probe_problem(cfgs)
    reference = calibration_reference(calib, probe, args.probe_window)
    for world in sorted({c.world for c in cfgs}):
        group = [c for c in cfgs if c.world == world]
        note = f" (oversubscribed: {world} ranks on {cores} cores)" if world > cores else ""
        waited = 0.0
        while not args.no_wait and common.loadavg()[0] >= args.max_load and waited < args.group_wait:
            time.sleep(15)  # the previous group's own load decays in a minute or two; others' may not
            waited += 15
        print(f"{world} rank(s): {len(group)} configs{note}; load {common.loadavg()[0]:.2f} after waiting "
              f"{waited:.0f} s", flush=True)
        loads[world] = {"before": common.loadavg(), "waited_s": waited}
        results = common.launch(group_job, world, group, args.warmup, args.steps,
                                None if args.timeline is None else str(args.timeline), probe, reference,
                                args.probe_window, timeout=1800)
        loads[world]["after"] = common.loadavg()
        for cfg, res in zip(group, results):
            raw[cfg.key] = res
    return raw, loads
