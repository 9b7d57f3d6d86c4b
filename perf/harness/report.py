"""The report of a sweep: rows, validation summary, tables, plots, ``scaling.json`` and ``scaling.csv``, from
the raw measurements of a run just made or of a stored one (``--reanalyse``).

Why one function for both: a stored run re-predicted with a changed model must be reported exactly as a
fresh one is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.analysis import analyse, tables, write_csv
from perf.harness.configs import Config, make_configs
from perf.harness.models import build_model
from perf.harness.plots import plots


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
