"""How far a measurement repeats: two sweeps of the same configurations side by side (``--compare``).

Why: the model's 15 % is only meaningful next to the spread of the measurement it is validated against.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from perf import common


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
