"""Scaling harness: strong and weak scaling over ranks and layouts, measured and predicted.

Why: "it scales" is a curve, a table and a model that explains both. One command runs every
(sweep, world size, layout) of a model on gloo CPU ranks with one thread each, reports samples/s,
achieved FLOP/s (total and per rank, matmul FLOPs from :func:`hybridpar.flops.count`), efficiency
(strong: T(N0)·N0 / (T(N)·N); weak: T(N0) / T(N); N0 = 1), where the time went (the engine's
profiling ranges through :class:`hybridpar.profiling.StepTimer`: compute, halo, pipeline,
grad_reduce, data_wait, other), and what :mod:`hybridpar.perfmodel` predicted for each config.
It writes JSON, CSV and plots with the machine, versions, load and full config beside the results.

* strong: a fixed global problem (``--batch`` samples of ``--size``^3) on 1..N ranks.
* weak: a fixed problem per rank (``--weak-batch`` samples of ``--size``^3 per rank): data and
  pipeline layouts grow the batch, spatial layouts grow the volume along the split dims.
* layouts: ``data`` (data = N), ``spatial`` (a 3D split of N, head replicated), ``pipe``
  (N stages, GPipe), ``hybrid`` (data x spatial and data x pipe x spatial mixes).

Every world size runs in one freshly spawned gloo group (all its layouts and sweeps one after
another); a step is timed from a barrier to its end on every rank and counts as long as its slowest
rank. Before the sweep, the machine is calibrated once (cached in ``calibration.json``): fitted
compute costs, the layer kernels at the exact local shapes of the sweep (one thread), the slowdown
of two ranks computing at once, gloo ping-pong latency/bandwidth over loopback, and the one-rank
step of a probe problem. Right before every configuration a state probe (~3 s) times that probe
step again (the host's drift against the calibration), two ranks running it at once (contention)
and a halo-like exchange after computing (the link); the prediction for that configuration uses
the machine in that state: its drift and contention, and the calibration's link (``--state``).

On a machine with fewer cores than ranks the ranks time-share the cores: the results say so
(``oversubscribed``) and the model accounts for it; this is a demonstration and a validation of the
harness and the model, not a measurement of the library's scalability.

    python -m perf harness --record                         # both sweeps, synthetic, 1-8 ranks
    python -m perf harness --model cosmoflow --sweep strong --ranks 1,2,4
    python -m perf harness --size 16 --steps 2 --no-wait --out-dir /tmp/scaling   # smoke test
    python -m perf harness --calibrate-only                 # refresh calibration.json only
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import resource
import shutil
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hybridpar import perfmodel as pm
from perf import common

OUT = common.RESULTS / "scaling"
CATEGORIES = ("compute", "halo", "pipeline", "grad_reduce", "data_wait", "other")
FAMILIES = ("data", "spatial", "pipe", "hybrid")


# ---------------------------------------------------------------------------------------------- models
def _resize_head(model: nn.Sequential, shape: tuple[int, ...]) -> nn.Sequential:
    """Replace the first Linear after Flatten so that it takes this input shape's flattened features."""
    layers = list(model)
    i = next(k for k, m in enumerate(layers) if isinstance(m, nn.Flatten))
    with torch.device("meta"):
        feats = nn.Sequential(*layers[:i + 1])(torch.empty(shape, device="meta")).shape[1]
    j = next(k for k in range(i, len(layers)) if isinstance(layers[k], nn.Linear))
    if layers[j].in_features != feats:
        torch.manual_seed(1)
        layers[j] = nn.Linear(feats, layers[j].out_features)
    return nn.Sequential(*layers)


def build_model(name: str, shape: tuple[int, ...], seed: int = 0) -> nn.Sequential:
    """``synthetic``: 3 x [Conv3d k3 p1 -> LeakyReLU(0.3) -> MaxPool3d(2)], channels 8, 16, 32, then
    Flatten -> Linear 32 -> LeakyReLU -> Linear 4. ``cosmoflow``: the MLPerf CosmoFlow network resized
    (3 conv blocks, 16-64 filters, dense 64 -> 32, dropout 0.5). The first dense layer is sized for the
    flattened features of ``shape`` (weak spatial scaling elongates the volume)."""
    torch.manual_seed(seed)
    c_in = shape[1]
    if name == "synthetic":
        layers: list[nn.Module] = []
        for c_out in (8, 16, 32):
            layers += [nn.Conv3d(c_in, c_out, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            c_in = c_out
        layers += [nn.Flatten(), nn.Linear(1, 32), nn.LeakyReLU(0.3), nn.Linear(32, 4)]
        model = nn.Sequential(*layers)
    elif name == "cosmoflow":
        from cosmoflow.model import build_model as cosmo  # noqa: PLC0415

        size = min(shape[2:])
        model = cosmo(size, c_in, n_conv=3, base_filters=16, max_filters=64, dense=(64, 32))
    else:
        raise ValueError(f"unknown model {name!r}; use synthetic or cosmoflow")
    return _resize_head(model, shape)


# ---------------------------------------------------------------------------------------------- configs
@dataclass
class Config:
    sweep: str           # strong | weak
    family: str          # single | data | spatial | pipe | hybrid
    label: str           # d2.p1.s2x1x1
    world: int
    spec: dict[str, Any]
    input_shape: tuple[int, ...]
    model: str

    @property
    def key(self) -> str:
        return f"{self.sweep}/{self.world}/{self.label}"


def _split3(n: int) -> tuple[int, int, int]:
    """A balanced 3D split of n ranks (powers of two): 2 -> 2x1x1, 4 -> 2x2x1, 8 -> 2x2x2."""
    s = [1, 1, 1]
    i = 0
    while n > 1:
        if n % 2:
            s[i % 3] *= n
            break
        s[i % 3] *= 2
        n //= 2
        i += 1
    return tuple(s)  # type: ignore[return-value]


def layouts(world: int, families: list[str]) -> list[tuple[str, int, int, tuple[int, int, int]]]:
    """(family, data, pipe, spatial) of each layout of ``world`` ranks."""
    if world == 1:
        return [("single", 1, 1, (1, 1, 1))]
    out = []
    for fam in families:
        if fam == "data":
            out.append(("data", world, 1, (1, 1, 1)))
        elif fam == "spatial":
            out.append(("spatial", 1, 1, _split3(world)))
        elif fam == "pipe":
            out.append(("pipe", 1, world, (1, 1, 1)))
        elif fam == "hybrid":
            if world == 4:
                out += [("hybrid", 2, 1, (2, 1, 1)), ("hybrid", 2, 2, (1, 1, 1))]
            elif world >= 8:
                out += [("hybrid", 2, 2, _split3(world // 4)), ("hybrid", world // 4, 1, _split3(4))]
        else:
            raise ValueError(f"unknown layout family {fam!r}; use {', '.join(FAMILIES)}")
    return out


def make_configs(args: argparse.Namespace) -> list[Config]:
    out = []
    s = args.size
    for sweep in (["strong", "weak"] if args.sweep == "both" else [args.sweep]):
        for world in args.ranks:
            for fam, d, p, sp in layouts(world, args.layouts):
                if sweep == "strong":
                    batch, shape3 = args.batch, (s, s, s)
                else:  # the per-rank problem stays fixed
                    batch = args.weak_batch * d * p
                    shape3 = tuple(s * k for k in sp)
                per_replica = batch // d
                m = 1
                if p > 1:  # micro-batches: up to 2 per stage, dividing the replica batch
                    m = max(k for k in range(1, min(per_replica, 2 * p) + 1) if per_replica % k == 0)
                spec = {"grid": {"data": d, "pipe": p, "spatial": list(sp)},
                        "pipeline": {"schedule": "gpipe", "microbatches": m}}
                label = f"d{d}.p{p}.s{'x'.join(map(str, sp))}" + (f".m{m}" if p > 1 else "")
                out.append(Config(sweep, fam, label, world, spec, (batch, 4, *shape3), args.model))
    return out


# ---------------------------------------------------------------------------------------------- workers
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


def state_probe(rank: int, world: int, probe: tuple, window: float = 0.5) -> dict[str, Any]:
    """The machine's state right before a configuration, from ranks 0 and 1 (the others sleep, and a
    sleeping rank costs nothing): the plain model's training step on the per-rank problem on rank 0
    alone (``alone_s``: the host's speed now, against the calibration's, is the drift), its slowdown
    when two ranks run it at once (contention), and the cost of a halo-like exchange right after
    computing (the link the model uses). A world of one measures the first only."""
    import torch.distributed as dist  # noqa: PLC0415

    name, shape = probe
    model = build_model(name, shape)
    x = torch.randn(shape)

    def both() -> None:  # a whole training step's memory traffic, not one kernel's
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    if world == 1:
        both()
        return {"alone_s": statistics.median(pm.time_loop(both, window) for _ in range(2)),
                "contention": None, "contention_samples": [], "exchange": None}
    pair = _pair_group()
    ratios, alones = [], []
    for _ in range(2):
        alone = pm.time_loop(both, window) if rank == 0 else time.sleep(window + 0.3)
        dist.barrier()
        together = pm.time_loop(both, window) if rank <= 1 else time.sleep(window + 0.3)
        dist.barrier()
        if rank == 0:
            ratios.append(together / alone)
            alones.append(alone)
    exchange = pm.exchange_after_compute(1 - rank, repeats=16, group=pair) if rank <= 1 else None
    everyone = [None] * world
    dist.all_gather_object(everyone, (exchange, ratios, alones))
    (ex0, ratios, alones), (ex1, _, _) = everyone[0], everyone[1]
    mean = [(n, (a + b) / 2) for (n, a), (_, b) in zip(ex0, ex1)]
    dist.barrier()
    return {"alone_s": statistics.median(alones), "contention": statistics.median(ratios),
            "contention_samples": ratios, "exchange": mean}


_PAIR: list = []


def _pair_group():
    """Ranks 0 and 1 (created once per process: every rank must take part in creating it)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not _PAIR:
        _PAIR.append(dist.new_group([0, 1]))
    return _PAIR[0]


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


def reference_job(rank: int, world: int, probe: tuple, window: float) -> float:
    """The probe problem's step on one rank: the reference its later timings are compared with (timed
    over twice a state probe's window: every later drift is a ratio against it)."""
    return state_probe(rank, 1, probe, window=2 * window)["alone_s"]


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


# ---------------------------------------------------------------------------------------------- calibration
def calibrate(cfgs: list[Config], workloads: dict, path: Path, refresh: bool, repeats: int) -> pm.Machine:
    """Load ``path`` and measure whatever the sweep needs that it lacks (everything if ``refresh``)."""
    data = json.loads(path.read_text()) if path.is_file() and not refresh else None
    entries: OrderedDict[str, tuple] = OrderedDict()
    for cfg in cfgs:
        w = workloads[(cfg.model, cfg.input_shape)]
        for e in pm.layer_entries(w, w.plan(_spec(cfg))):
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


def calibration_reference(path: Path, probe: tuple, window: float) -> float:
    """The probe problem's one-rank step time stored with the calibration (measured now and stored
    when missing, i.e. right after a fresh calibration): what the drift of later runs is against."""
    data = json.loads(path.read_text())
    ref = data.get("probe_reference")
    key = [probe[0], list(probe[1])]
    if ref is None or ref.get("problem") != key:
        alone = common.launch(reference_job, 1, probe, window)
        ref = {"problem": key, "alone_s": alone, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "load": common.loadavg()}
        data["probe_reference"] = ref
        path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"reference: the probe problem {key} takes {1e3 * ref['alone_s']:.1f} ms a step on one rank",
          flush=True)
    return ref["alone_s"]


def probe_problem(cfgs: list[Config]) -> tuple[str, tuple[int, ...]]:
    """What the state probe runs: the smallest one-rank problem of the sweep (the weak per-rank one)."""
    ones = [c for c in cfgs if c.world == 1] or cfgs
    small = min(ones, key=lambda c: c.input_shape[0] * c.input_shape[2] * c.input_shape[3] * c.input_shape[4])
    return small.model, small.input_shape


def _spec(cfg: Config):
    from hybridpar.planner import ParallelSpec  # noqa: PLC0415

    return ParallelSpec.from_dict(cfg.spec)


# ---------------------------------------------------------------------------------------------- analysis
STATE_USES = ("drift", "contention", "link")


def analyse(cfgs: list[Config], raw: dict[str, dict], workloads: dict, machine: pm.Machine,
            cores: int, uses: tuple[str, ...] = ("drift", "contention")) -> list[dict[str, Any]]:
    """One row per configuration: measured, efficiency, breakdown, and the model's prediction with the
    machine as calibrated, updated by the probed state's ``uses`` (see ``--state``)."""
    rows = []
    base = {}
    for cfg in cfgs:
        if cfg.world == 1 and cfg.key in raw:
            base[cfg.sweep] = statistics.median(raw[cfg.key]["steps_s"])
    for cfg in cfgs:
        if cfg.key not in raw:
            continue
        r = raw[cfg.key]
        steps = r["steps_s"]
        t = statistics.median(steps)
        w = workloads[(cfg.model, cfg.input_shape)]
        n = cfg.world
        ranks = r["ranks"]
        bd = {k: statistics.fmean(x["breakdown"][k] for x in ranks) for k in CATEGORIES}
        t0 = base.get(cfg.sweep)
        eff = None
        if t0 is not None:
            eff = t0 / (t * n) if cfg.sweep == "strong" else t0 / t
        here = machine
        state = r.get("state")
        if state:  # the machine as the probe found it right before this configuration
            if "drift" in uses:
                here = replace(here, drift=state.get("drift", 1.0))
            if "contention" in uses and state.get("contention") is not None:
                here = replace(here, contention=max(state["contention"], 1.0))
            if "link" in uses and state.get("exchange"):
                link = pm.link_from_samples(state["exchange"])
                here = replace(here, intra=link, inter=link)
        pred = pm.predict(w, _spec(cfg), here, n)
        fit_only = pm.predict(w, _spec(cfg), replace(here, measured={}), n)
        q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [t, t, t]
        rows.append({
            "sweep": cfg.sweep, "family": cfg.family, "layout": cfg.label, "ranks": n, "spec": cfg.spec,
            "input_shape": list(cfg.input_shape), "global_batch": cfg.input_shape[0],
            "oversubscribed": n > cores, "step_s": t, "step_q1_s": q[0], "step_q3_s": q[2], "steps_s": steps,
            "samples_per_s": cfg.input_shape[0] / t, "model_flops": w.total_flops,
            "flops_per_s": w.total_flops / t, "flops_per_s_per_rank": w.total_flops / t / n,
            "efficiency": eff, "breakdown_s": bd,
            "breakdown_slowest_rank_s": max(ranks, key=lambda x: sum(x["step_s"]))["breakdown"],
            "rss_mib_max": max(x["rss_mib"] for x in ranks), "wall_s": r["wall_s"],
            "load_after": r["load_after"],
            "machine_state": None if not state else {"contention": here.contention, "drift": here.drift,
                                                     "link_latency_s": here.intra.latency,
                                                     "link_bandwidth": here.intra.bandwidth},
            "predicted": {"step_s": pred.step_time, "breakdown_s": pred.breakdown,
                          "ratio": pred.step_time / t,
                          "memory_bytes_per_rank": pred.memory, "bubble": pred.bubble,
                          "oversubscribed": pred.oversubscribed, "fit_only_step_s": fit_only.step_time,
                          "fit_only_ratio": fit_only.step_time / t},
        })
    return rows


def _fmt_ms(s: float) -> str:
    return f"{1e3 * s:.1f}"


def tables(rows: list[dict]) -> str:
    head = ["sweep", "ranks", "layout", "family", "input", "step ms", "samples/s", "GFLOP/s", "GFLOP/s/rank",
            "eff", *[f"{c} ms" for c in CATEGORIES]]
    body = []
    for r in rows:
        body.append([r["sweep"], r["ranks"], r["layout"], r["family"], "x".join(map(str, r["input_shape"])),
                     _fmt_ms(r["step_s"]), f"{r['samples_per_s']:.2f}", f"{r['flops_per_s'] / 1e9:.2f}",
                     f"{r['flops_per_s_per_rank'] / 1e9:.2f}",
                     "-" if r["efficiency"] is None else f"{r['efficiency']:.2f}",
                     *[_fmt_ms(r["breakdown_s"][c]) for c in CATEGORIES]])
    text = common.print_table(head, body, "Measured (median step, slowest rank; breakdown = mean over ranks)")
    head = ["sweep", "ranks", "layout", "measured ms", "predicted ms", "pred/meas", "within 15%",
            "fit-only pred/meas", "note"]
    body = []
    for r in rows:
        p = r["predicted"]
        note = "oversubscribed" if r["oversubscribed"] else ""
        body.append([r["sweep"], r["ranks"], r["layout"], _fmt_ms(r["step_s"]), _fmt_ms(p["step_s"]),
                     f"{p['ratio']:.2f}", "yes" if abs(p["ratio"] - 1) <= 0.15 else "NO",
                     f"{p['fit_only_ratio']:.2f}", note])
    text += "\n\n" + common.print_table(head, body, "Performance model against the measurement")
    return text


def write_csv(rows: list[dict], path: Path) -> None:
    cols = ["sweep", "family", "layout", "ranks", "input_shape", "global_batch", "oversubscribed", "step_s",
            "step_q1_s", "step_q3_s", "samples_per_s", "model_flops", "flops_per_s", "flops_per_s_per_rank",
            "efficiency", *[f"{c}_s" for c in CATEGORIES], "predicted_step_s", "predicted_over_measured",
            *[f"predicted_{c}_s" for c in CATEGORIES], "predicted_memory_bytes", "rss_mib_max"]
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(cols)
        for r in rows:
            out.writerow([r["sweep"], r["family"], r["layout"], r["ranks"],
                          "x".join(map(str, r["input_shape"])), r["global_batch"], r["oversubscribed"],
                          f"{r['step_s']:.6f}", f"{r['step_q1_s']:.6f}",
                          f"{r['step_q3_s']:.6f}", f"{r['samples_per_s']:.4f}", r["model_flops"],
                          f"{r['flops_per_s']:.4e}", f"{r['flops_per_s_per_rank']:.4e}",
                          "" if r["efficiency"] is None else f"{r['efficiency']:.4f}",
                          *[f"{r['breakdown_s'][c]:.6f}" for c in CATEGORIES],
                          f"{r['predicted']['step_s']:.6f}", f"{r['predicted']['ratio']:.4f}",
                          *[f"{r['predicted']['breakdown_s'][c]:.6f}" for c in CATEGORIES],
                          int(r["predicted"]["memory_bytes_per_rank"]["total"]), f"{r['rss_mib_max']:.0f}"])


def plots(rows: list[dict], out: Path, title: str) -> list[str]:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'hybridpar[plots]')", flush=True)
        return []
    written = []
    sweeps = [s for s in ("strong", "weak") if any(r["sweep"] == s for r in rows)]
    colors = {"data": "tab:blue", "spatial": "tab:orange", "pipe": "tab:green", "hybrid": "tab:red"}
    fig, axes = plt.subplots(2, len(sweeps), figsize=(5.5 * len(sweeps), 7.5), squeeze=False)
    for j, sweep in enumerate(sweeps):
        rs = [r for r in rows if r["sweep"] == sweep]
        single = [r for r in rs if r["family"] == "single"]
        for fam in FAMILIES:
            fr = sorted([r for r in rs if r["family"] == fam] + single, key=lambda r: r["ranks"])
            if len(fr) <= len(single):
                continue
            best: dict[int, dict] = {}
            for r in fr:  # one point per world size: the best layout of the family
                if r["ranks"] not in best or r["step_s"] < best[r["ranks"]]["step_s"]:
                    best[r["ranks"]] = r
            xs = sorted(best)
            axes[0][j].plot(xs, [best[x]["flops_per_s"] / 1e9 for x in xs], "o-", color=colors[fam],
                            label=fam)
            axes[0][j].plot(xs, [best[x]["model_flops"] / best[x]["predicted"]["step_s"] / 1e9 for x in xs],
                            "x--", color=colors[fam], alpha=0.5)
            axes[1][j].plot(xs, [best[x]["efficiency"] for x in xs], "o-", color=colors[fam], label=fam)
        cores = max((r["ranks"] for r in rs if not r["oversubscribed"]), default=1)
        if single:
            xs = sorted({r["ranks"] for r in rs})
            f0 = single[0]["flops_per_s"] / 1e9
            axes[0][j].plot(xs, [f0 * x for x in xs], ":", color="grey", label="ideal (N x 1 rank)")
            axes[0][j].plot(xs, [f0 * min(x, cores) for x in xs], "-.", color="grey", lw=0.8,
                            label=f"{cores} cores' worth")
            axes[1][j].axhline(1.0, ls=":", color="grey")
        for ax in axes[:, j]:
            ax.axvspan(cores + 0.5, max(r["ranks"] for r in rs) + 0.5, color="grey", alpha=0.08)
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"ranks (shaded: > {cores} cores, oversubscribed)")
            ax.grid(alpha=0.3)
        axes[0][j].set_title(f"{sweep} scaling: achieved GFLOP/s, best layout per family (x--: model)",
                             fontsize=9)
        axes[0][j].set_ylabel("GFLOP/s (matmul FLOPs, all ranks)")
        axes[1][j].set_title(f"{sweep} efficiency ({'T1/(N TN)' if sweep == 'strong' else 'T1/TN'})")
        axes[1][j].set_ylabel("efficiency")
        axes[0][j].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=90)
    plt.close(fig)
    written.append("scaling.png")

    fig, axes = plt.subplots(len(sweeps), 1, figsize=(max(8, 0.55 * len(rows)), 4.2 * len(sweeps)),
                             squeeze=False)
    palette = {"compute": "tab:green", "halo": "tab:orange", "pipeline": "tab:blue", "grad_reduce": "tab:red",
               "data_wait": "gold", "other": "lightgrey"}
    for j, sweep in enumerate(sweeps):
        rs = [r for r in rows if r["sweep"] == sweep]
        ax = axes[j][0]
        labels = []
        for i, r in enumerate(rs):
            for k, (src, dx) in enumerate(((r["breakdown_s"], -0.2), (r["predicted"]["breakdown_s"], 0.2))):
                bottom = 0.0
                for c in CATEGORIES:
                    v = 1e3 * src[c]
                    ax.bar(i + dx, v, 0.38, bottom=bottom, color=palette[c], alpha=1.0 if k == 0 else 0.55,
                           label=c if (i == 0 and k == 0) else None)
                    bottom += v
            labels.append(f"{r['ranks']}: {r['layout']}")
        ax.set_xticks(range(len(rs)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{sweep}: breakdown per config (left: measured, mean over ranks; right, faded: model)")
        ax.legend(fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=80)
    plt.close(fig)
    written.append("breakdown.png")

    fig, ax = plt.subplots(figsize=(5, 5))
    for r in rows:
        ax.scatter(1e3 * r["step_s"], 1e3 * r["predicted"]["step_s"], color=colors.get(r["family"], "black"),
                   marker="o" if r["sweep"] == "strong" else "s", s=18)
    lim = [0, 1.1e3 * max(max(r["step_s"], r["predicted"]["step_s"]) for r in rows)]
    ax.plot(lim, lim, color="grey")
    ax.fill_between(lim, [0.85 * v for v in lim], [1.15 * v for v in lim], color="grey", alpha=0.15)
    ax.set_xlabel("measured ms/step")
    ax.set_ylabel("predicted ms/step")
    ax.set_title("model vs measurement (band: +-15 %; o strong, s weak)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "validation.png", dpi=80)
    plt.close(fig)
    written.append("validation.png")
    return written


# ---------------------------------------------------------------------------------------------- extrapolation
PUBLISHED = {
    "oyama512": "Oyama et al. (TPDS 2021): 1.42 PFLOP/s on 512 V100 at mini-batch 128 (512^3, data + "
                "spatial)",
    "mlperf": "MLPerf HPC v3.0 CosmoFlow: 2.1 min time-to-train on 512 H100, ~207 samples/s per H100",
}


def extrapolate(out: Path) -> dict[str, Any]:
    """The model on published setups: LBANN's 512^3 CosmoFlow on 512-2048 V100, MLPerf's 128^3 on 512
    H100. Each row: the layout (given, or the advisor's choice within the device memory), the
    prediction, and the published figure beside it."""
    from cosmoflow.model import build_lbann_model  # noqa: PLC0415
    from cosmoflow.model import build_model as mlperf_model  # noqa: PLC0415
    from hybridpar.advisor import advise  # noqa: PLC0415

    rows = []

    def row(setup: str, machine: str, world: int, cand_spec, pred: pm.Prediction, published: str,
            pub_value: float | None, metric: str, how: str) -> None:
        value = pred.flops_per_s / 1e15 if metric == "PFLOP/s" else pred.samples_per_s / world
        rows.append({"setup": setup, "machine": machine, "gpus": world, "global_batch": pred.batch,
                     "layout": cand_spec.grid.arithmetic, "microbatches": cand_spec.pipeline.microbatches,
                     "rules": len(cand_spec.layers), "how": how, "step_ms": 1e3 * pred.step_time,
                     "samples_per_s": pred.samples_per_s, "samples_per_s_per_gpu": pred.samples_per_s / world,
                     "pflops": pred.flops_per_s / 1e15, "memory_gib": pred.memory["total"] / 2**30,
                     "breakdown_ms": {k: 1e3 * v for k, v in pred.breakdown.items()},
                     "metric": metric, "predicted": value, "published": pub_value,
                     "published_text": published,
                     "predicted_over_published": (value / pub_value) if pub_value else None})

    v100 = pm.PRESETS["v100"]
    for world, batch in ((512, 128), (1024, 128), (2048, 128), (1024, 256), (2048, 512)):
        w = pm.Workload(build_lbann_model(512), (batch, 4, 512, 512, 512))
        pub = 1.42 if (world, batch) == (512, 128) else None
        text = PUBLISHED["oyama512"] if pub else "-"
        if world // batch == 4:  # Oyama's layout: one sample on the 4 GPUs of a node, depth split
            spec = _spec_dict({"grid": {"data": batch, "spatial": [4, 1, 1]}})
            row("LBANN CosmoFlow 512^3", "v100", world, spec, pm.predict(w, spec, v100, world), text, pub,
                "PFLOP/s", "4-way depth split (as published)")
        advice = advise(w, None, world, v100.memory, v100, max_pipe=1)
        row("LBANN CosmoFlow 512^3", "v100", world, advice.best.spec, advice.best.prediction, text, pub,
            "PFLOP/s", "advisor, 16 GiB")
    for batch in (512, 2048):
        w = pm.Workload(mlperf_model(128), (batch, 4, 128, 128, 128))
        for name in ("h100", "h100-fp32"):
            spec = _spec_dict({"grid": {"data": 512}})
            row("MLPerf CosmoFlow 128^3", name, 512, spec, pm.predict(w, spec, name, 512),
                PUBLISHED["mlperf"], 207.0, "samples/s/GPU", "data parallel")
    head = ["setup", "machine", "GPUs", "batch", "layout", "how", "step ms", "samples/s", "PFLOP/s",
            "GiB/GPU", "published", "model/published"]
    body = [[r["setup"], r["machine"], r["gpus"], r["global_batch"],
             r["layout"] + (f" + {r['rules']} rules" if r["rules"] else ""), r["how"], f"{r['step_ms']:.1f}",
             f"{r['samples_per_s']:.0f}", f"{r['pflops']:.2f}", f"{r['memory_gib']:.1f}",
             (f"{r['published']} {r['metric']}" if r["published"] else "-"),
             (f"{r['predicted_over_published']:.2f} ({r['predicted']:.3g} {r['metric']})"
              if r["published"] else "-")] for r in rows]
    table = common.print_table(head, body, "Extrapolation: the model on published setups")
    payload = {"rows": rows, "table": table, "published": PUBLISHED,
               "presets": {k: {"description": m.description, "sources": m.sources}
                           for k, m in pm.PRESETS.items()}}
    common.write_json(out / "extrapolation.json", payload)
    return payload


def _spec_dict(d: dict[str, Any]):
    from hybridpar.planner import ParallelSpec  # noqa: PLC0415

    return ParallelSpec.from_dict(d)


# ---------------------------------------------------------------------------------------------- main
def versions() -> dict[str, str]:
    """Library versions and the checkout's commit (read only)."""
    import subprocess  # noqa: PLC0415

    import numpy  # noqa: PLC0415

    import hybridpar  # noqa: PLC0415

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=common.ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=common.ROOT, capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", False
    return {"hybridpar": hybridpar.__version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": sys.version.split()[0],
            "git_commit": commit + (" (with local changes)" if dirty else "")}


# --tiny: one- and two-rank strong sweeps of the data and pipeline layouts at 8^3 (too small to split
# spatially), one step each, short state probes, no plots
TINY = {"ranks": [1, 2], "layouts": ["data", "pipe"], "sweep": "strong", "size": 8, "batch": 2,
        "warmup": 1, "steps": 1, "repeats": 1, "no_plots": True, "group_wait": 0.0, "probe_window": 0.05}


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("harness", __doc__, steps=6, warmup=2, max_load=1.0, max_wait=900.0, out=False)
    ap.add_argument("--model", choices=("synthetic", "cosmoflow"), default="synthetic")
    ap.add_argument("--sweep", choices=("strong", "weak", "both"), default="both")
    ap.add_argument("--ranks", default="1,2,4,8", type=lambda s: [int(v) for v in s.split(",")])
    ap.add_argument("--layouts", default="data,spatial,pipe,hybrid", type=lambda s: s.split(","))
    ap.add_argument("--size", type=int, default=32, help="volume edge S (S^3 per sample; per rank when weak)")
    ap.add_argument("--batch", type=int, default=8, help="global batch of the strong sweep")
    ap.add_argument("--weak-batch", type=int, default=2, help="per-rank batch of the weak sweep")
    ap.add_argument("--repeats", type=int, default=5, help="timings per calibration sample")
    ap.add_argument("--out-dir", type=Path, default=None,
                    help=f"the result folder (default {common.SCRATCH}/harness; with --record {OUT})")
    ap.add_argument("--calibration", type=Path, default=None,
                    help="calibration JSON (default: OUT_DIR/calibration.json)")
    ap.add_argument("--calibrate", action="store_true", help="re-measure the calibration from scratch")
    ap.add_argument("--calibrate-only", action="store_true")
    ap.add_argument("--group-wait", type=float, default=180.0,
                    help="before each world size, wait up to this long for the load to drop below --max-load")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--malloc", choices=("keep", "default"), default="keep",
                    help="keep: ranks run with glibc malloc keeping freed memory (no page faults per step, "
                         "like the CUDA caching allocator); default: glibc's defaults")
    ap.add_argument("--timeline", type=Path, default=None,
                    help="log every range of every step here (one folder per config) for "
                         "`python -m hybridpar.profiling.timeline DIR/<config>`")
    ap.add_argument("--state", default="drift,contention",
                    help="what of the state probed before each configuration the model takes (comma "
                         "list of drift, contention, link; default drift,contention): the probe's "
                         "3-second exchange timing swings 0.2-1.7 ms between configurations while the "
                         "halo times it should predict repeat within ~10 %%, so the link is the "
                         "calibration's unless 'link' is named")
    ap.add_argument("--probe-window", type=float, default=0.5,
                    help="seconds each timing loop of the state probe runs (the calibration's reference: "
                         "twice that)")
    ap.add_argument("--reanalyse", type=Path, default=None,
                    help="recompute tables, predictions and plots of an earlier scaling.json (no runs)")
    ap.add_argument("--compare", type=Path, nargs=2, default=None, metavar=("A", "B"),
                    help="two scaling.json of the same sweep: how far the measurement repeats (no runs)")
    ap.add_argument("--extrapolate", action="store_true",
                    help="only predict the published setups (no runs; a few minutes of planning)")
    args = common.parse(ap, argv, TINY)
    if args.out_dir is None:
        args.out_dir = OUT if args.record else common.results_dir(args) / "harness"
    if args.probe_window <= 0:
        ap.error(f"--probe-window must be a positive number of seconds, got {args.probe_window}")
    bad_state = [u for u in args.state.split(",") if u and u not in STATE_USES]
    if bad_state:
        ap.error(f"unknown --state {bad_state}; use a comma list of {', '.join(STATE_USES)}")
    bad = [f for f in args.layouts if f not in FAMILIES]
    if bad:
        ap.error(f"unknown layouts {bad}; use {', '.join(FAMILIES)}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    scratch_calib = args.out_dir / "calibration.json"
    if not args.record and args.calibration is None and (OUT / "calibration.json").is_file() \
            and (args.tiny or not scratch_calib.exists()):
        # start from the recorded calibration (a copy: the run adds its own layer shapes to it)
        shutil.copy(OUT / "calibration.json", scratch_calib)
    if args.extrapolate:
        extrapolate(args.out_dir)
        return 0
    if args.reanalyse:
        return reanalyse(args)
    if args.compare:
        return compare(args.compare, args.out_dir)
    calib = args.calibration or args.out_dir / "calibration.json"

    cfgs, workloads, skipped = [], {}, []
    for cfg in make_configs(args):
        key = (cfg.model, cfg.input_shape)
        try:
            if key not in workloads:
                workloads[key] = pm.Workload(build_model(cfg.model, cfg.input_shape), cfg.input_shape)
            workloads[key].plan(_spec(cfg), cfg.world)
        except ValueError as err:  # SpecError: this layout cannot run this problem
            skipped.append({"config": cfg.key, "why": str(err)})
            print(f"skip {cfg.key}: {err}", flush=True)
            continue
        cfgs.append(cfg)
    # keep: every rank reuses freed memory, as PyTorch's caching allocator does on GPUs
    # (hybridpar.device.cpu_alloc, which perf.ranks applies in each); default: glibc's own settings,
    # cpu_alloc told to leave them
    if args.malloc == "default":
        os.environ["HYBRIDPAR_MALLOC_TUNING"] = "0"
    cores = len(os.sched_getaffinity(0))
    quiet = {"skipped": True} if args.no_wait else common.wait_for_quiet(args.max_load, args.max_wait)
    t_start = time.time()
    machine = calibrate(cfgs, workloads, calib, args.calibrate, args.repeats)
    print(f"machine: {machine.description}; link alpha {1e6 * machine.intra.latency:.0f} us, "
          f"{machine.intra.bandwidth / 1e9:.2f} GB/s; contention x{machine.contention:.2f}; engine "
          f"{1e3 * machine.step_overhead:.2f} ms/step + {1e3 * machine.micro_overhead:.2f} ms/micro-batch",
          flush=True)
    if args.calibrate_only:
        return 0

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
    measured = {"quiet": quiet, "load_per_world": loads, "duration_s": time.time() - t_start,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
                "host": common.machine_info(),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    # the raw measurements first: a failure below can be redone with --reanalyse
    common.write_json(args.out_dir / "scaling.json", {"measured": measured, "skipped": skipped, "raw": raw},
                      args)
    report(args, cfgs, raw, workloads, machine, calib, skipped, measured)
    return 0


def report(args: argparse.Namespace, cfgs: list[Config], raw: dict[str, dict], workloads: dict,
           machine: pm.Machine, calib: Path, skipped: list, measured: dict[str, Any]) -> None:
    """Efficiency, predictions, tables, JSON, CSV and plots from the raw measurements."""
    cores = measured["host"].get("usable_cores") or len(os.sched_getaffinity(0))
    uses = tuple(u for u in args.state.split(",") if u)
    rows = analyse(cfgs, raw, workloads, machine, cores, uses)
    text = tables(rows)
    ratios = [r["predicted"]["ratio"] for r in rows]
    within = sum(abs(x - 1) <= 0.15 for x in ratios)
    summary = {"configs": len(rows), "within_15pct": within, "probed_state_used": list(uses),
               "median_abs_error": statistics.median(abs(x - 1) for x in ratios) if ratios else None,
               "within_15pct_not_oversubscribed": sum(abs(r["predicted"]["ratio"] - 1) <= 0.15 for r in rows
                                                      if not r["oversubscribed"]),
               "not_oversubscribed": sum(not r["oversubscribed"] for r in rows)}
    print(f"\nmodel within 15 % on {within}/{len(rows)} configs "
          f"({summary['within_15pct_not_oversubscribed']}/{summary['not_oversubscribed']} without "
          f"oversubscription)", flush=True)
    title = (f"hybridpar scaling, {args.model} {args.size}^3, gloo CPU, 1 thread/rank, {cores} cores "
             f"({measured['host'].get('cpu_model', '?')}); {measured['date'][:10]}")
    written = [] if args.no_plots else plots(rows, args.out_dir, title)
    payload = {
        "measured": measured,
        "note": (f"{cores} usable cores: runs with more ranks than cores time-share them (oversubscribed); "
                 "they validate the harness and the model, they do not measure scalability"),
        "calibration": {"file": str(calib), "machine": {k: v for k, v in machine.to_dict().items()
                                                        if k != "measured"},
                        "measured_layer_shapes": len(machine.measured)},
        "skipped": skipped, "validation": summary, "results": rows, "plots": written,
        "table": text, "raw": raw,
    }
    common.write_json(args.out_dir / "scaling.json", payload, args)
    write_csv(rows, args.out_dir / "scaling.csv")


def compare(paths: list[Path], out_dir: Path) -> int:
    """Two sweeps of the same configurations side by side (``--compare A.json B.json``): how far the
    measurement itself repeats, per configuration and per world size, against the model's 15 %.

    Why: a model can only be validated to the precision its measurements repeat to; on a shared
    host that is a property of the moment, and it is measured here rather than assumed.
    """
    runs = [{(r["sweep"], r["layout"]): r for r in json.loads(p.read_text())["results"]} for p in paths]
    keys = [k for k in runs[0] if k in runs[1]]
    rows, per_world, result = [], {}, []
    for k in keys:
        a, b = runs[0][k], runs[1][k]
        rep = b["step_s"] / a["step_s"]
        per_world.setdefault(a["ranks"], []).append(abs(rep - 1))
        result.append({"sweep": k[0], "layout": k[1], "ranks": a["ranks"],
                       "step_s": [a["step_s"], b["step_s"]], "repeat_ratio": rep,
                       "predicted_ratio": [a["predicted"]["ratio"], b["predicted"]["ratio"]]})
        rows.append([k[0], a["ranks"], k[1], 1e3 * a["step_s"], 1e3 * b["step_s"], f"{rep:.2f}",
                     "yes" if abs(rep - 1) <= 0.15 else "**no**",
                     f"{a['predicted']['ratio']:.2f} / {b['predicted']['ratio']:.2f}"])
    table = common.print_table(
        ["sweep", "ranks", "layout", "run 1 ms", "run 2 ms", "run 2 / run 1", "repeats within 15 %",
         "pred/meas (run 1 / run 2)"], rows, title=f"repeatability: {paths[0]} against {paths[1]}")
    summary = {n: {"configs": len(v), "median_abs_change": statistics.median(v),
                   "beyond_15pct": sum(e > 0.15 for e in v)} for n, v in sorted(per_world.items())}
    for n, v in summary.items():
        print(f"{n} ranks: median |run 2 / run 1 - 1| = {100 * v['median_abs_change']:.1f} %, "
              f"{v['beyond_15pct']}/{v['configs']} configurations change by more than 15 %")
    common.write_json(out_dir / "repeatability.json", {"runs": [str(p) for p in paths],
                                                       "per_world_size": summary, "results": result,
                                                       "table": table})
    return 0


def reanalyse(args: argparse.Namespace) -> int:
    """Recompute the report of an earlier run (``--reanalyse scaling.json``) with the current model."""
    old = json.loads(Path(args.reanalyse).read_text())
    measured = old["measured"]
    saved = argparse.Namespace(**{**vars(args), **{k: v for k, v in measured["config"].items()
                                                   if k in ("model", "sweep", "ranks", "layouts", "size",
                                                            "batch", "weak_batch", "warmup", "steps")}})
    cfgs = [c for c in make_configs(saved) if c.key in old["raw"]]
    workloads = {}
    for cfg in cfgs:
        key = (cfg.model, cfg.input_shape)
        if key not in workloads:
            workloads[key] = pm.Workload(build_model(cfg.model, cfg.input_shape), cfg.input_shape)
    calib = args.calibration or args.out_dir / "calibration.json"
    machine = pm.load_machine(calib)
    report(saved, cfgs, old["raw"], workloads, machine, calib, old.get("skipped", []), measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
