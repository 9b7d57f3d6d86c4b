"""The machine's calibration (``calibration.json``): fitted compute costs, the layer kernels at the sweep's
exact local shapes, the slowdown of two ranks computing at once and the gloo link over loopback.

Why cached and extended rather than re-measured: it takes minutes; a later sweep measures only the
layer shapes the file lacks (``--calibrate`` measures everything again).
"""

from __future__ import annotations

import json
import statistics
import time
from collections import OrderedDict
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.configs import Config, parallel_spec


def calibrate_job(rank: int, world: int, entries: list, repeats: int, fit: bool) -> dict[str, Any]:
    """One rank, one thread: fitted compute costs, engine overheads, the layer table at the sweep's shapes
    (window layers as their distributed counterparts on a one-rank grid)."""
    out: dict[str, Any] = {}
    if fit:
        compute, samples = pm.calibrate_compute(repeats=repeats)
        out["compute"] = asdict(compute)
        out["samples"] = samples
        out["engine_overhead"] = pm.measure_engine_overhead()
    out["table"] = pm.measure_layers(entries, repeats=repeats)
    return out


def network_job(rank: int, world: int, probe: list, repeats: int) -> dict[str, Any]:
    """Two ranks: gloo ping-pong over loopback, then the slowdown of computing at the same time."""
    import torch.distributed as dist  # noqa: PLC0415

    samples = pm.pingpong(1 - rank)
    exchange = pm.exchange_after_compute(1 - rank)
    ratios = []
    for _key, m, shape, needs in probe:
        alone = None
        if rank == 0:
            alone = sum(pm.measure_layer(m, shape, needs, repeats, wrap=False))
        dist.barrier()
        together = sum(pm.measure_layer(m, shape, needs, repeats, wrap=False))
        dist.barrier()
        if rank == 0:
            ratios.append(together / alone)
    both = [None, None]
    dist.all_gather_object(both, exchange)
    mean = [(n, (t0 + t1) / 2) for (n, t0), (_, t1) in zip(*both)]
    return {"pingpong": samples, "exchange": mean, "contention": ratios}


def calibrate(cfgs: list[Config], workloads: dict, path: Path, refresh: bool, repeats: int) -> pm.Machine:
    """Load ``path`` and measure whatever the sweep needs that it lacks (everything if ``refresh``)."""
    data = json.loads(path.read_text()) if path.is_file() and not refresh else None
    entries: OrderedDict[str, tuple] = OrderedDict()
    for cfg in cfgs:
        w = workloads[(cfg.model, cfg.input_shape)]
        for e in pm.layer_entries(w, w.plan(parallel_spec(cfg))):
            entries.setdefault(e[0], e)
    if data is None:
        print(f"calibrating this machine ({len(entries)} layer shapes, compute fit, gloo ping-pong)...",
              flush=True)
        job = common.launch(calibrate_job, 1, list(entries.values()), repeats, True)
        compute = pm.Compute(**{k: pm.Cost(**v) for k, v in job["compute"].items() if k != "dtype_bytes"})
        probe = sorted(entries.values(), key=lambda e: -sum(job["table"][e[0]]))[:3]
        net = common.launch(network_job, 2, probe, repeats)
        link = pm.link_from_samples(net["exchange"])  # what a halo exchange between layers costs
        contention = statistics.median(net["contention"]) if net["contention"] else 1.0
        step_oh, micro_oh = job["engine_overhead"]
        machine = pm.local_machine(compute, link, max(contention, 1.0), step_oh, micro_oh)
        machine = machine.with_measured(job["table"])
        extra = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load": common.loadavg(),
                 "host": common.machine_info(), "compute_samples": job["samples"],
                 "pingpong": net["pingpong"], "pingpong_fit": asdict(pm.fit_link(net["pingpong"])),
                 "exchange_after_compute": net["exchange"], "contention_samples": net["contention"]}
        pm.save_machine(machine, path, extra)
        pm.save_machine(machine, pm.default_cache(), extra)
        return machine
    machine = pm.Machine.from_dict(data["machine"])
    missing = [e for k, e in entries.items() if k not in machine.measured]
    if missing:
        print(f"measuring {len(missing)} layer shapes not in {path.name}...", flush=True)
        job = common.launch(calibrate_job, 1, missing, repeats, False)
        machine = machine.with_measured(job["table"])
        data["machine"] = machine.to_dict()
        path.write_text(json.dumps(data, indent=1) + "\n")
    return machine
