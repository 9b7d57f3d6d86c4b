"""The volume study's results: per-run scores, the result file (and its schema), a table and a plot.

Why apart from the runs: the result file is read by people and by the README's table, so its shape is
one function (:func:`check_schema`) that both the study and its test call, and the numbers in it come
only from the trainer's ``val_predictions.npz`` files, scored by :mod:`.averaging`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cosmoflow.experiments.averaging import per_universe, spread
from cosmoflow.metrics import PARAMS, installed, mae

UNITS = ("unitPar: each parameter normalised to [-1, 1] over the generator's prior range (what the network "
         "predicts); mae of a crop size is that of the mean prediction over all crops of a validation "
         "universe; mae is the mean over seeds, mae_spread their standard deviation (ddof 1)")


def score_run(run_dir: Path, crops: int) -> dict[str, dict[str, float]]:
    """A finished run's validation MAE: per universe (crops averaged) and per crop (each on its own)."""
    with np.load(run_dir / "val_predictions.npz") as z:
        pred, true, where = z["pred"], z["true"], z["path"]
    mean, target, _ = per_universe(pred, true, where, crops)
    return {"mae": mae(mean, target), "mae_per_crop": mae(pred, true)}


def size_entry(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """``{"mae", "mae_spread", "seeds"}`` of one input size from its runs' records (one per seed)."""
    mean, std = spread([r["mae"] for r in per_seed])
    return {"mae": mean, "mae_spread": std, "seeds": per_seed}


def baseline(train_labels: np.ndarray, val_labels: np.ndarray) -> dict[str, dict[str, float]]:
    """Predict-the-mean: every validation universe gets the training universes' mean parameters."""
    guess = np.broadcast_to(np.asarray(train_labels, dtype=np.float64).mean(axis=0), np.shape(val_labels))
    return {"mae": mae(guess, val_labels)}


def check_schema(doc: dict[str, Any]) -> None:
    """Raise ValueError naming the first key of ``doc`` that is not the study's result schema::

        {"sizes": {"32": {"mae": {P: x}, "mae_spread": {P: x}, "seeds": [...]}, ...},
         "baseline": {"mae": {P: x}}, "command": str, "machine": ..., "units": str}
    """
    def params(where: str, d: Any) -> None:
        if not isinstance(d, dict) or sorted(d) != sorted(PARAMS):
            raise ValueError(f"{where}: expected one number per parameter {list(PARAMS)}, got {d!r}")
        for k, v in d.items():
            if not isinstance(v, float | int) or not np.isfinite(v):
                raise ValueError(f"{where}.{k}: expected a finite number, got {v!r}")

    want = {"sizes", "baseline", "command", "machine", "units"}
    if not isinstance(doc, dict) or set(doc) != want:
        raise ValueError(f"volume_study.json: top-level keys {sorted(doc) if isinstance(doc, dict) else doc} "
                         f"must be exactly {sorted(want)}")
    if not doc["sizes"] or not all(isinstance(k, str) and k.isdigit() for k in doc["sizes"]):
        raise ValueError(f"sizes: keys must be input sizes as strings like '32', got {list(doc['sizes'])}")
    for size, entry in doc["sizes"].items():
        if not isinstance(entry, dict) or set(entry) != {"mae", "mae_spread", "seeds"}:
            raise ValueError(f"sizes.{size}: keys must be exactly mae, mae_spread, seeds")
        params(f"sizes.{size}.mae", entry["mae"])
        params(f"sizes.{size}.mae_spread", entry["mae_spread"])
        if not isinstance(entry["seeds"], list) or not entry["seeds"]:
            raise ValueError(f"sizes.{size}.seeds: expected a non-empty list of per-seed records")
        for i, rec in enumerate(entry["seeds"]):
            if not isinstance(rec, dict) or not isinstance(rec.get("seed"), int):
                raise ValueError(f"sizes.{size}.seeds[{i}]: expected a record with an integer 'seed'")
            params(f"sizes.{size}.seeds[{i}].mae", rec.get("mae"))
    if not isinstance(doc["baseline"], dict) or set(doc["baseline"]) != {"mae"}:
        raise ValueError("baseline: expected exactly {'mae': {parameter: number}}")
    params("baseline.mae", doc["baseline"]["mae"])
    for key in ("command", "units"):
        if not isinstance(doc[key], str) or not doc[key]:
            raise ValueError(f"{key}: expected a non-empty string, got {doc[key]!r}")


def table(doc: dict[str, Any], ref: dict[str, Any] | None = None) -> str:
    """The markdown table: validation MAE ± seed spread per input size and parameter, the baseline, and
    the power-spectrum reference (:mod:`.reference`) where ``ref`` is given."""
    head = "| input | crops / universe | " + " | ".join(PARAMS) + " |"
    lines = [head, "|" + "---|" * (len(PARAMS) + 2)]
    for size, entry in sorted(doc["sizes"].items(), key=lambda kv: int(kv[0])):
        crops = entry["seeds"][0].get("crops", "?")
        cells = [f"{entry['mae'][p]:.4f} ± {entry['mae_spread'][p]:.4f}" for p in PARAMS]
        lines.append(f"| {size}³ | {crops} | " + " | ".join(cells) + " |")
    lines.append("| predict the mean | – | " + " | ".join(f"{doc['baseline']['mae'][p]:.4f}" for p in PARAMS)
                 + " |")
    for size, entry in sorted(doc["sizes"].items(), key=lambda kv: int(kv[0])):
        if (per_crop := _per_crop(entry)) is not None:
            mean, std = per_crop
            cells = [f"({mean[p]:.4f} ± {std[p]:.4f})" for p in PARAMS]
            lines.append(f"| {size}³, each crop alone | – | " + " | ".join(cells) + " |")
    for size, entry in sorted((ref or {}).get("sizes", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| power spectrum + ridge, {size}³ | – | "
                     + " | ".join(f"[{entry['mae'][p]:.4f}]" for p in PARAMS) + " |")
    seeds = sorted({r["seed"] for e in doc["sizes"].values() for r in e["seeds"]})
    note = (f"\nValidation MAE in {doc['units'].split(':')[0]} units (normalised to [-1, 1]); crop sizes: "
            f"the mean prediction over all crops of a universe (in round brackets: each crop scored alone); "
            f"± is the standard deviation over seeds {seeds}."
            + (f" In square brackets: no network, a ridge regression on power spectra ({ref['features']})."
               if ref else "")
            + f"\n\n{_ratios(doc['sizes'], 'whole volume over the smallest crops (goal: sigma_8 <= 0.7)')}"
            + (f"\n\n{_ratios(ref['sizes'], 'power spectrum + ridge')}" if ref else "")
            + f"\n\nCommand: `{doc['command']}`\n")
    return "\n".join(lines) + "\n" + note


def _per_crop(entry: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]] | None:
    """Mean and seed spread of a crop size's MAE with each crop scored alone; None for whole volumes."""
    runs = entry["seeds"]
    if runs[0].get("crops", 1) <= 1 or not all("mae_per_crop" in r for r in runs):
        return None
    return spread([r["mae_per_crop"] for r in runs])


def _ratios(sizes: dict[str, Any], what: str) -> str:
    """The study's goal in one line: the largest size's MAE over the smallest's, for sigma_8 and Omega_m
    (with the seed spread where the entries have one)."""
    order = sorted(sizes, key=int)
    lo, hi = sizes[order[0]], sizes[order[-1]]
    parts = []
    for p in ("sigma_8", "Omega_m"):
        text = f"{p}: {order[-1]}³ / {order[0]}³ = {hi['mae'][p] / lo['mae'][p]:.2f}"
        if "mae_spread" in lo:
            noise = max(lo["mae_spread"][p], hi["mae_spread"][p])
            text += f" (difference {hi['mae'][p] - lo['mae'][p]:+.4f} against a seed spread of {noise:.4f})"
        parts.append(text)
    return f"MAE ratio, {what}: " + "; ".join(parts)


def plot(doc: dict[str, Any], path: Path, ref: dict[str, Any] | None = None) -> Path | None:
    """MAE against input size per parameter (error bars: the seed spread; crops scored alone in gray; the
    power-spectrum reference as triangles), the baseline dashed; None and nothing written when matplotlib
    is not installed."""
    if not installed("matplotlib"):
        return None
    import matplotlib  # noqa: PLC0415 (optional)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    sizes = sorted(doc["sizes"], key=int)
    fig, axes = plt.subplots(1, len(PARAMS), figsize=(14, 4.0))
    for ax, p in zip(axes, PARAMS):
        ax.errorbar([int(s) for s in sizes], [doc["sizes"][s]["mae"][p] for s in sizes],
                    yerr=[doc["sizes"][s]["mae_spread"][p] for s in sizes], fmt="o-", capsize=3,
                    label="model (crops: mean per universe)")
        alone = [(int(s), c[0][p]) for s in sizes if (c := _per_crop(doc["sizes"][s])) is not None]
        if alone:
            ax.plot(*zip(*alone), "x:", color="gray", label="each crop alone")
        if ref:
            ref_sizes = sorted(ref["sizes"], key=int)
            ax.plot([int(s) for s in ref_sizes], [ref["sizes"][s]["mae"][p] for s in ref_sizes], "^--",
                    color="tab:green", label="power spectrum + ridge (no network)")
        ax.axhline(doc["baseline"]["mae"][p], color="k", ls="--", lw=0.8, label="predict the mean")
        ax.set(xscale="log", xticks=[int(s) for s in sizes], xticklabels=[f"{s}³" for s in sizes],
               title=p, xlabel="input size", ylabel="validation MAE (unitPar)")
        ax.minorticks_off()
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
