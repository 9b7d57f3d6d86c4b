"""The model on published setups (``--extrapolate``): LBANN's 512³ CosmoFlow on V100s, MLPerf's 128³ on
H100s, each prediction beside the published figure.

Why: the sweep validates the model on this host; this shows what it says at the scale the published
runs were made at (not validated there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridpar import perfmodel as pm
from perf import common

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
