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
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.analysis import STATE_USES
from perf.harness.calibrate import calibrate
from perf.harness.configs import FAMILIES, Config, make_configs, parallel_spec
from perf.harness.extrapolate import extrapolate
from perf.harness.models import build_model
from perf.harness.repeatability import compare
from perf.harness.report import reanalyse, report
from perf.harness.sweep import run_sweep

OUT = common.RESULTS / "scaling"


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


def build_parser() -> argparse.ArgumentParser:
    """The harness's flags: the shared ones (``perf.common.parser``) and the sweep's own."""
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
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The flags, checked, with the result folder made (and seeded with the recorded calibration where
    a trial run has none of its own)."""
    ap = build_parser()
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
    return args


def plan_configs(args: argparse.Namespace) -> tuple[list[Config], dict, list[dict[str, str]]]:
    """The sweep's configurations that the engine can plan for their problem, the workload of each
    problem, and the ones skipped with why."""
    cfgs, workloads, skipped = [], {}, []
    for cfg in make_configs(args):
        key = (cfg.model, cfg.input_shape)
        try:
            if key not in workloads:
                workloads[key] = pm.Workload(build_model(cfg.model, cfg.input_shape), cfg.input_shape)
            workloads[key].plan(parallel_spec(cfg), cfg.world)
        except ValueError as err:  # SpecError: this layout cannot run this problem
            skipped.append({"config": cfg.key, "why": str(err)})
            print(f"skip {cfg.key}: {err}", flush=True)
            continue
        cfgs.append(cfg)
    return cfgs, workloads, skipped


def main(argv: list[str] | None = None) -> int:
    """A sweep: configurations planned, the machine calibrated, every world size run, the raw results
    written first and then the report (``--extrapolate``, ``--reanalyse``, ``--compare``: only that)."""
    args = parse_args(argv)
    if args.extrapolate:
        extrapolate(args.out_dir)
        return 0
    if args.reanalyse:
        return reanalyse(args)
    if args.compare:
        return compare(args.compare, args.out_dir)
    calib = args.calibration or args.out_dir / "calibration.json"

    cfgs, workloads, skipped = plan_configs(args)
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

    raw, loads = run_sweep(args, cfgs, calib, cores)
    measured = {"quiet": quiet, "load_per_world": loads, "duration_s": time.time() - t_start,
                "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "versions": versions(),
                "host": common.machine_info(),
                "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    # the raw measurements first: a failure below can be redone with --reanalyse
    common.write_json(args.out_dir / "scaling.json", {"measured": measured, "skipped": skipped, "raw": raw},
                      args)
    report(args, cfgs, raw, workloads, machine, calib, skipped, measured)
    return 0


if __name__ == "__main__":
    sys.exit(main())
