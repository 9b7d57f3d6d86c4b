"""From the raw timings to one row per configuration (efficiency, breakdown, the model's prediction with
the probed state), and the tables and CSV of those rows.

Why apart from the runs: ``--reanalyse`` recomputes all of it from a stored ``scaling.json`` with the
current model, without running anything.
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.configs import CATEGORIES, Config, parallel_spec

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
        pred = pm.predict(w, parallel_spec(cfg), here, n)
        fit_only = pm.predict(w, parallel_spec(cfg), replace(here, measured={}), n)
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
