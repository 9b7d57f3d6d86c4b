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
from cosmoflow.metrics import PARAMS, CsvLog, installed, mae

UNITS = ("unitPar: each parameter normalised to [-1, 1] over the generator's prior range (what the network "
         "predicts); mae of a crop size is that of the mean prediction over all crops of a validation "
         "universe; mae is the mean over seeds, mae_spread their standard deviation (ddof 1)")


def score_run(run_dir: Path, crops: int) -> dict[str, Any]:
    """A finished run's validation MAE: per universe (crops averaged) and per crop (each on its own), and
    its learning curve (:func:`curve`)."""
    with np.load(run_dir / "val_predictions.npz") as z:
        pred, true, where = z["pred"], z["true"], z["path"]
    mean, target, _ = per_universe(pred, true, where, crops)
    return {"mae": mae(mean, target), "mae_per_crop": mae(pred, true), "curve": curve(run_dir)}


def curve(run_dir: Path) -> dict[str, list[float]]:
    """The validation MAE after each epoch, per parameter (``{"epoch": [...], P: [...]}``), as the trainer
    logged it: each input scored alone (crops not averaged), which is what shows whether training
    converged."""
    rows = CsvLog(run_dir / "metrics_epochs.csv").read()
    out: dict[str, list[float]] = {"epoch": [float(r["epoch"]) for r in rows]}
    for p in PARAMS:
        out[p] = [float(r[f"mae_{p}"]) for r in rows]
    return out


def last_quarter_change(c: dict[str, list[float]]) -> tuple[float, float, float] | None:
    """The mean validation MAE (over the parameters) after the epoch before the last quarter of the
    epochs and after the last, and its relative change: how flat the curve ends. None when the curve
    has fewer than four epochs."""
    n = len(c.get("epoch", []))
    if n < 4:
        return None
    mean = np.mean([c[p] for p in PARAMS], axis=0)
    start, end = float(mean[n - 1 - max(n // 4, 1)]), float(mean[-1])
    return start, end, end / start - 1


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
         "baseline": {"mae": {P: x}}, "command": str, "machine": ..., "units": str, "date": str,
         "reading": str}

    (``date``, when the report was written, is optional: earlier result files lack it; so is
    ``reading``, what the figures mean and what limits an unmet goal, added by whoever read them).
    """
    def params(where: str, d: Any) -> None:
        if not isinstance(d, dict) or sorted(d) != sorted(PARAMS):
            raise ValueError(f"{where}: expected one number per parameter {list(PARAMS)}, got {d!r}")
        for k, v in d.items():
            if not isinstance(v, float | int) or not np.isfinite(v):
                raise ValueError(f"{where}.{k}: expected a finite number, got {v!r}")

    want = {"sizes", "baseline", "command", "machine", "units"}
    if not isinstance(doc, dict) or not want <= set(doc) <= want | {"date", "reading"}:
        raise ValueError(f"volume_study.json: top-level keys {sorted(doc) if isinstance(doc, dict) else doc} "
                         f"must be exactly {sorted(want)} (and optionally date, reading)")
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


def table(doc: dict[str, Any], ref: dict[str, Any] | None = None, cross: dict[str, Any] | None = None) -> str:
    """The markdown table: validation MAE ± seed spread per input size and parameter, the baseline, and
    the power-spectrum reference (:mod:`.reference`) where ``ref`` is given; ``cross``: the reference that
    also reads the correlation between channels, a row of its own and a line under the goals."""
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
    for size, entry in sorted((cross or {}).get("sizes", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(f"| power spectra + correlation between channels + ridge, {size}³ | – | "
                     + " | ".join(f"[{entry['mae'][p]:.4f}]" for p in PARAMS) + " |")
    seeds = sorted({r["seed"] for e in doc["sizes"].values() for r in e["seeds"]})
    note = (f"\nValidation MAE in {doc['units'].split(':')[0]} units (normalised to [-1, 1]); crop sizes: "
            f"the mean prediction over all crops of a universe (in round brackets: each crop scored alone); "
            f"± is the standard deviation over seeds {seeds}."
            + (f" In square brackets: no network, a ridge regression on power spectra ({ref['features']})."
               if ref else "")
            + (" The correlation rows add, per pair of channels (snapshots) and shell, their correlation "
               "coefficient." if cross else "")
            + f"\n\n{goals(doc, ref)}" + beyond_power(doc, ref, cross)
            + f"\n\n{convergence(doc)}"
            + (f"\n\nReading: {doc['reading']}" if doc.get("reading") else "")
            + f"\n\nCommand: `{doc['command']}`\n")
    return "\n".join(lines) + "\n" + note


def _per_crop(entry: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]] | None:
    """Mean and seed spread of a crop size's MAE with each crop scored alone; None for whole volumes."""
    runs = entry["seeds"]
    if runs[0].get("crops", 1) <= 1 or not all("mae_per_crop" in r for r in runs):
        return None
    return spread([r["mae_per_crop"] for r in runs])


GAIN = ("Omega_m", "H_0")
"""The parameters whose MAE a larger volume must shrink: their information is on the largest scales."""
BEAT = ("Omega_m", "sigma_8", "H_0")
"""The parameters on which the network must match the power-spectrum reference at every size."""


def goals(doc: dict[str, Any], ref: dict[str, Any] | None = None) -> str:
    """The study's goals, each with its figures and met or not: on Omega_m and H_0 the whole volume's MAE
    at most half the smallest crops', by more than both seed spreads; at every size the network's MAE
    at most the reference's on Omega_m, sigma_8 and H_0."""
    sizes = doc["sizes"]
    order = sorted(sizes, key=int)
    lo, hi = sizes[order[0]], sizes[order[-1]]
    lines = [] if len(order) > 1 else [f"- volume: one input size ({order[0]}³), no comparison between sizes"]
    for p in GAIN if len(order) > 1 else ():
        ratio = hi["mae"][p] / lo["mae"][p]
        noise = lo["mae_spread"][p] + hi["mae_spread"][p]
        met = ratio <= 0.5 and lo["mae"][p] - hi["mae"][p] > noise
        lines.append(f"- {p}: {order[-1]}³ / {order[0]}³ = {ratio:.2f} (goal <= 0.5; difference "
                     f"{hi['mae'][p] - lo['mae'][p]:+.4f} against seed spreads {noise:.4f} together): "
                     f"{'met' if met else 'not met'}")
        if ref and order[0] in ref["sizes"] and order[-1] in ref["sizes"]:
            r = ref["sizes"]
            lines[-1] += f"; the reference's ratio {r[order[-1]]['mae'][p] / r[order[0]]['mae'][p]:.2f}"
    if ref:
        for size in order:
            if size not in ref["sizes"]:
                continue
            cells = [f"{p} {sizes[size]['mae'][p]:.4f} vs {ref['sizes'][size]['mae'][p]:.4f}"
                     + ("" if sizes[size]["mae"][p] <= ref["sizes"][size]["mae"][p] else " (worse)")
                     for p in BEAT]
            met = all(sizes[size]["mae"][p] <= ref["sizes"][size]["mae"][p] for p in BEAT)
            lines.append(f"- network against the reference at {size}³: {', '.join(cells)}: "
                         f"{'met' if met else 'not met'}")
        lines += _beyond_spread(sizes, ref["sizes"], order)
    return "Goals:\n" + "\n".join(lines)


STRETCH = 0.9
"""The stretch goal: at the whole volume, the network's MAE at most this times the reference's on
:data:`STRETCH_PARAMS`: information beyond the power spectrum, shown on the study's data."""
STRETCH_PARAMS = ("Omega_m", "sigma_8")


def _beyond_spread(sizes: dict[str, Any], ref: dict[str, Any], order: list[str]) -> list[str]:
    """The network at most the reference by more than its seed spread (MAE + spread <= the reference's)
    on :data:`BEAT` at every size; and the stretch goal at the largest size."""
    common = [s for s in order if s in ref]
    if not common:
        return []
    short = [f"{s}³ {p} {sizes[s]['mae'][p]:.4f} + {sizes[s]['mae_spread'][p]:.4f} > {ref[s]['mae'][p]:.4f}"
             for s in common for p in BEAT
             if round(sizes[s]["mae"][p] + sizes[s]["mae_spread"][p] - ref[s]["mae"][p], 10) > 0]
    lines = [f"- network at most the reference beyond its seed spread on {', '.join(BEAT)} at every size: "
             + ("met" if not short else f"not met ({'; '.join(short)})")]
    top = order[-1]
    if top in ref:
        ratios = {p: sizes[top]["mae"][p] / ref[top]["mae"][p] for p in STRETCH_PARAMS}
        met = all(r <= STRETCH for r in ratios.values())
        lines.append(f"- stretch, network <= {STRETCH} x reference at {top}³: "
                     + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items())
                     + f": {'met' if met else 'not met'}")
    return lines


def beyond_power(doc: dict[str, Any], ref: dict[str, Any] | None, cross: dict[str, Any] | None) -> str:
    """A line under the goals: at the largest size, the reference with the correlation between channels
    against the plain one and the network; what a network could gain beyond each channel's spectrum
    without going past two-point statistics."""
    top = max(doc["sizes"], key=int)
    if not (ref and cross and top in ref["sizes"] and top in cross["sizes"]):
        return ""
    r, c, n = ref["sizes"][top]["mae"], cross["sizes"][top]["mae"], doc["sizes"][top]["mae"]
    cells = ", ".join(f"{p} {c[p]:.4f} ({c[p] / r[p]:.2f} x the reference; network {n[p]:.4f})" for p in BEAT)
    ratios = {p: n[p] / c[p] for p in CROSS_PARAMS}
    met = all(v <= CROSS_BEAT for v in ratios.values())
    return (f"\n- no network, with the correlation between channels at {top}³: {cells}"
            f"\n- network <= {CROSS_BEAT} x the reference with the correlation between channels at {top}³: "
            + ", ".join(f"{p} {v:.2f}" for p, v in ratios.items()) + f": {'met' if met else 'not met'}")


CROSS_BEAT = 0.95
"""At the whole volume, the network's MAE at most this times the reference that also reads the
correlation between channels, on :data:`CROSS_PARAMS`: beyond every summary the study computes."""
CROSS_PARAMS = ("Omega_m",)


FLAT = 0.02
"""A converged run's last-quarter change of validation MAE is at most this, relative, for every seed."""


def convergence(doc: dict[str, Any]) -> str:
    """Per size and seed: the validation MAE (mean over parameters, each input alone) after the epoch
    before the last quarter and after the last, and its relative change: a converged run ends flat."""
    parts = []
    for size, entry in sorted(doc["sizes"].items(), key=lambda kv: int(kv[0])):
        for rec in entry["seeds"]:
            c = rec.get("curve")
            ends = last_quarter_change(c) if c else None
            if ends is None:
                continue
            start, end, change = ends
            parts.append(f"{size}³ seed {rec['seed']}: {start:.4f} -> {end:.4f} ({change:+.1%})")
    if not parts:
        return "Learning curves: fewer than four epochs per run, no convergence check."
    worst = max(abs(c[2]) for e in doc["sizes"].values() for r in e["seeds"]
                if r.get("curve") and (c := last_quarter_change(r["curve"])) is not None)
    return ("Learning curves, mean validation MAE over the last quarter of epochs (each input alone): "
            + "; ".join(parts) + f". Every run within {FLAT:.0%}: {'met' if worst <= FLAT else 'not met'} "
            f"(largest change {worst:.1%})")


def plot(doc: dict[str, Any], path: Path, ref: dict[str, Any] | None = None,
         cross: dict[str, Any] | None = None) -> Path | None:
    """MAE against input size per parameter (error bars: the seed spread; crops scored alone in gray; the
    power-spectrum reference as triangles, the one with the correlation between channels as squares),
    the baseline dashed; None and nothing written when matplotlib is not installed."""
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
        for r, style, color, label in ((ref, "^--", "tab:green", "power spectrum + ridge (no network)"),
                                       (cross, "s--", "tab:purple", "+ correlation between channels")):
            if r:
                ref_sizes = sorted(r["sizes"], key=int)
                ax.plot([int(s) for s in ref_sizes], [r["sizes"][s]["mae"][p] for s in ref_sizes], style,
                        color=color, label=label)
        ax.axhline(doc["baseline"]["mae"][p], color="k", ls="--", lw=0.8, label="predict the mean")
        ax.set(xscale="log", xticks=[int(s) for s in sizes], xticklabels=[f"{s}³" for s in sizes],
               title=p, xlabel="input size", ylabel="validation MAE (unitPar)")
        ax.minorticks_off()
    return _save(fig, axes, path, ncol=3 if cross else 4)


def plot_curves(doc: dict[str, Any], path: Path) -> Path | None:
    """The learning curves: validation MAE per epoch and parameter, one colour per input size, one line
    per seed; None and nothing written when matplotlib is not installed or no run has a curve."""
    runs = [r for e in doc["sizes"].values() for r in e["seeds"]]
    if not installed("matplotlib") or not any(r.get("curve") for r in runs):
        return None
    import matplotlib  # noqa: PLC0415 (optional)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1, len(PARAMS), figsize=(14, 4.0))
    for k, (size, entry) in enumerate(sorted(doc["sizes"].items(), key=lambda kv: int(kv[0]))):
        for j, rec in enumerate(entry["seeds"]):
            c = rec.get("curve")
            if not c:
                continue
            for ax, p in zip(axes, PARAMS):
                ax.plot(c["epoch"], c[p], color=f"C{k}", ls=("-", "--", ":")[j % 3],
                        label=f"{size}³, seed {rec['seed']}")
    for ax, p in zip(axes, PARAMS):
        ax.axhline(doc["baseline"]["mae"][p], color="k", ls="--", lw=0.8, label="predict the mean")
        ax.set(title=p, xlabel="epoch", ylabel="validation MAE, each input alone")
    return _save(fig, axes, path, ncol=7)


def _save(fig: Any, axes: Any, path: Path, ncol: int) -> Path:
    """The first panel's legend under the panels, the figure written to ``path`` and closed."""
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional; imported by the caller already)

    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=ncol, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
