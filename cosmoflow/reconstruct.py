"""The reconstruction task: predict a universe's initial linear density field from its evolved one.

Why this task: the displacements that turn the initial field into today's clustered one scramble its
small-scale modes (the evolved field decorrelates from the initial one above k ≈ 0.3 h/Mpc in the
generator's universes), and undoing them needs a network that maps a whole volume to a whole volume
(a U-Net) and sees tens of voxels around each one. Every activation of such a network is a
full-resolution volume, which is the case spatial parallelism exists for.

What is measured, on held-out universes, per sample and then averaged:

* ``r(k)`` of the prediction against the truth and, the baseline, of the input itself (the z = 0
  overdensity ``counts / mean - 1``, i.e. no reconstruction) against the truth, per shell of
  :mod:`cosmoflow.correlation`;
* the voxel mean squared error of both, beside the truth's variance (the error of predicting zero).

The goal a run is held to: the prediction's decorrelation ``1 - r`` at most half the input's in every
shell below half the Nyquist frequency. From today's field alone (one channel) the field's own goals
are the ones of Chen et al. 2023: r ≥ 0.9 at k = 0.5 h/Mpc, and r falling to one half at 1.5 times the
scale where the input itself falls to one half (:func:`z0_goal`, ``python -m cosmoflow.reconstruct``
adds them to a result file).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hybridpar as hp
from cosmoflow.config import Config
from cosmoflow.correlation import Shells, correlation, shell_centres, shell_edges
from cosmoflow.displacement import Displacement, WithDisplacement
from cosmoflow.metrics import plot_run
from cosmoflow.unet import UNet3d
from cosmoflow.universe import VOXEL_MPC, Cosmology, box_size
from hybridpar.comm.redistribute import gather
from hybridpar.data import VolumeLoader

GOAL = 0.5
"""The prediction's 1 - r(k) must be at most this fraction of the input's below half the Nyquist frequency."""


def build_unet(cfg: Config, in_channels: int) -> torch.nn.Module:
    """The task's network from the ``unet`` section of the config (with ``unet.displacement``, fed the
    displacement channels of :mod:`cosmoflow.displacement` too)."""
    u = cfg.unet
    displacement = Displacement(u.smoothing, u.shift_reach) if u.displacement else None
    extra = displacement.added_channels if displacement else 0
    model = UNet3d(in_channels + extra, 1, width=u.width, levels=u.levels,
                   max_width=u.max_width, groups=u.groups, padding_mode=u.padding_mode)
    model.check_extent(cfg.data.sample_size)
    return WithDisplacement(model, displacement) if displacement else model


def overdensity(log_counts: np.ndarray) -> np.ndarray:
    """``counts / mean - 1`` from the loader's ``log1p(counts)``: the evolved field as an estimate of the
    initial one (what a reconstruction has to beat)."""
    counts = np.expm1(log_counts.astype(np.float64))
    return counts / counts.mean() - 1.0


@dataclass
class FieldResult:
    """Scores over the validation volumes (every rank holds the same)."""

    size: int
    edges: np.ndarray
    """Shell edges in units of the fundamental frequency."""
    k_fundamental: float
    """Mean 2π/L over the validation boxes, h/Mpc."""
    r_model: np.ndarray
    """(samples, shells) r(k) of each prediction."""
    r_input: np.ndarray
    mse_model: np.ndarray
    """(samples,) voxel MSE of each prediction."""
    mse_input: np.ndarray
    var_truth: np.ndarray
    r_earliest: np.ndarray | None = None
    """(samples, shells) r(k) of the input's last channel (the earliest snapshot, z = 3 of four) when
    the input has several: the most linear field the network was given, a stricter baseline."""
    example: dict[str, np.ndarray] | None = None
    """Middle slices (truth, input, prediction) of the first validation volume, on the rank that read it."""

    @property
    def k(self) -> np.ndarray:
        return shell_centres(self.edges) * self.k_fundamental

    @property
    def k_nyquist(self) -> float:
        return self.size / 2 * self.k_fundamental

    @property
    def low(self) -> np.ndarray:
        """Shells entirely below half the Nyquist frequency (the ones the goal is about)."""
        return self.edges[1:] <= self.size / 4 + 1e-9

    def metrics(self) -> dict[str, float]:
        rm, ri = self.r_model.mean(0), self.r_input.mean(0)
        return {"val_loss": float(self.mse_model.mean()), "val_mse_input": float(self.mse_input.mean()),
                "val_var_truth": float(self.var_truth.mean()),
                "val_r_model": float(rm[self.low].mean()), "val_r_input": float(ri[self.low].mean()),
                "val_decorrelation": float((1 - rm[self.low]).mean())}

    def goal_ratio(self) -> np.ndarray:
        """``(1 - r_model) / (1 - r_input)`` per shell: at most :data:`GOAL` where the goal is met."""
        return (1 - self.r_model.mean(0)) / (1 - self.r_input.mean(0))


@torch.no_grad()
def evaluate_fields(engine: hp.Engine, loader: VolumeLoader, size: int,
                    k_fundamental: float) -> tuple[dict[str, float], FieldResult]:
    """Predict every validation volume and score it against the truth (gathered whole per replica).

    The prediction comes back whole from ``engine.predict``; the truth and the input arrive split like
    the input and are gathered over the replica's spatial group, so no rank reads a whole sample.
    """
    engine.eval()
    edges = shell_edges(size)
    shells = Shells(size, edges)

    def r(fa: np.ndarray, ft: np.ndarray) -> np.ndarray:
        return correlation(shells.sums(fa, ft))

    rows: list[tuple[np.ndarray, np.ndarray, float, float, float, np.ndarray | None]] = []
    example = None
    shape = (size, size, size)
    for x_local, y_local in loader:
        pred = engine.predict(x_local).double().cpu().numpy()
        truth = gather(y_local, engine.input_grid, shape).double().cpu().numpy()
        # the first channel (z = 0) and the last (the earliest snapshot, when there are several)
        ends = x_local[:, :: max(x_local.shape[1] - 1, 1)].contiguous()
        field = gather(ends, engine.input_grid, shape).cpu().numpy()
        for b in range(pred.shape[0]):
            p, t, d = pred[b, 0], truth[b, 0], overdensity(field[b, 0])
            ft = shells.transform(t)  # once per volume, shared by the three fields scored against it
            early = r(shells.transform(overdensity(field[b, -1])), ft) if ends.shape[1] > 1 else None
            rows.append((r(shells.transform(p), ft), r(shells.transform(d), ft),
                         float(((p - t) ** 2).mean()), float(((d - t) ** 2).mean()), float(t.var()), early))
            if example is None:
                mid = size // 2
                example = {"truth (initial field)": t[mid], "input at z = 0 (overdensity)": d[mid],
                           "U-Net prediction": p[mid]}
    engine.train()
    if dist.is_initialized() and dist.get_world_size(engine.grid.data_group) > 1:
        gathered: list[Any] = [None] * engine.grid.data
        dist.all_gather_object(gathered, rows, group=engine.grid.data_group)
        rows = [row for part in gathered for row in part]
    if not rows:
        raise ValueError("the validation set gave no volumes; check data.val and train.batch_size")
    cols = list(zip(*rows))
    early = None if cols[5][0] is None else np.array(cols[5])
    result = FieldResult(size, edges, k_fundamental, np.array(cols[0]), np.array(cols[1]),
                         np.array(cols[2]), np.array(cols[3]), np.array(cols[4]), early, example)
    return result.metrics(), result


def mean_fundamental(labels: np.ndarray, size: int, voxel_mpc: float = VOXEL_MPC) -> float:
    """Mean ``2π/L`` (h/Mpc) over samples of side ``size`` voxels of ``voxel_mpc`` Mpc with these unitPar
    labels (L follows H_0)."""
    boxes = np.array([box_size(size, Cosmology.from_unit(u).h0, voxel_mpc) for u in labels])
    return float(np.mean(2 * np.pi / boxes))


def voxel_of(path: str) -> float:
    """The voxel side (Mpc) a universe file was generated with (its ``voxel_mpc`` attribute; files
    written before the generator had one used the default), so wave numbers in h/Mpc follow it."""
    import h5py  # noqa: PLC0415 (the data layer's dependency; only this reads file attributes here)

    with h5py.File(path, "r") as f:
        return float(f.attrs.get("voxel_mpc", VOXEL_MPC))


def print_table(result: FieldResult) -> None:
    """r(k) of the prediction and of the input per shell, and the voxel errors."""
    ratio = result.goal_ratio()
    print(f"\ncross-correlation with the initial field per shell ({len(result.r_model)} validation volumes "
          f"of {result.size}^3; goal: 1 - r at most {GOAL:g}x the input's below k_Nyquist/2 = "
          f"{result.k_nyquist / 2:.2f} h/Mpc):")
    early = result.r_earliest
    print(f"  {'k [h/Mpc]':>9} {'r input':>8} {'r U-Net':>8} {'(1-r) ratio':>12}  goal  "
          + ("r of the earliest input channel" if early is not None else ""))
    rm, ri = result.r_model.mean(0), result.r_input.mean(0)
    for i, (k, a, b, q, low) in enumerate(zip(result.k, ri, rm, ratio, result.low)):
        mark = ("met" if q <= GOAL else "missed") if low else "-"
        extra = f"{early.mean(0)[i]:8.3f}" if early is not None else ""
        print(f"  {k:9.3f} {a:8.3f} {b:8.3f} {q:12.3f}  {mark:<6}{extra}")
    print(f"voxel MSE: U-Net {result.mse_model.mean():.4f}, input (evolved overdensity) "
          f"{result.mse_input.mean():.4f}, predicting zero {result.var_truth.mean():.4f}", flush=True)


def result_json(result: FieldResult, command: str, machine: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The task's result file (``reconstruction.json``): r(k) of both fields per shell, voxel errors."""
    low, ratio = result.low, result.goal_ratio()
    return {
        "k": result.k.round(5).tolist(), "k_nyquist": round(result.k_nyquist, 5),
        "r_model": result.r_model.mean(0).round(5).tolist(),
        "r_input": result.r_input.mean(0).round(5).tolist(),
        "mse_model": float(result.mse_model.mean()), "mse_input": float(result.mse_input.mean()),
        "size": result.size, "command": command, "machine": machine,
        "r_model_std": result.r_model.std(0).round(5).tolist(),
        "r_input_std": result.r_input.std(0).round(5).tolist(),
        "var_truth": float(result.var_truth.mean()), "validation_volumes": int(len(result.r_model)),
        "r_input_earliest_channel": None if result.r_earliest is None
        else result.r_earliest.mean(0).round(5).tolist(),
        "below_half_nyquist": low.tolist(),
        "goal": {"max_decorrelation_ratio": GOAL, "ratio": ratio.round(4).tolist(),
                 "met": bool(np.all(ratio[low] <= GOAL))},
        "k_units": "h/Mpc (shells of 2 fundamental frequencies; k at the validation boxes' mean size)",
        **extra,
    }


def plot_fields(run_dir: Path, result: FieldResult) -> list[Path]:
    """r(k) against k for both fields, and middle slices of the first validation volume, as PNG."""
    try:
        import matplotlib  # noqa: PLC0415 (optional)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    curves = [("U-Net prediction", result.r_model, "o-"),
              ("input at z = 0 (evolved field)", result.r_input, "s--")]
    if result.r_earliest is not None:
        curves.append(("input, earliest snapshot", result.r_earliest, "^:"))
    for name, r, style in curves:
        ax.errorbar(result.k, r.mean(0), yerr=r.std(0), fmt=style, ms=4, capsize=2, label=name)
    ax.axvline(result.k_nyquist / 2, color="0.5", lw=0.8, ls=":", label="half Nyquist")
    ax.set(xlabel="k [h/Mpc]", ylabel="r(k) with the initial field", ylim=(-0.05, 1.02),
           title=f"Reconstruction, {result.size}^3 validation volumes")
    ax.legend()
    fig.tight_layout()
    paths = [out_dir / "r_k.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    if result.example is not None:
        fig, axes = plt.subplots(1, 3, figsize=(12, 4))
        lim = 3 * float(np.std(next(iter(result.example.values()))))
        for ax, (name, img) in zip(axes, result.example.items()):
            ax.imshow(img, cmap="RdBu_r", vmin=-lim, vmax=lim)
            ax.set(title=name, xticks=[], yticks=[])
        fig.tight_layout()
        paths.append(out_dir / "slices.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths


def report(run_dir: Path, result: FieldResult, plots: bool, command: str, machine: dict[str, Any],
           **extra: Any) -> dict[str, Any]:
    """The end of a run (rank 0): the table, ``reconstruction.json`` and the plots; returns what the
    run's summary adds (whether the goal was met, the plot files)."""
    print_table(result)
    payload = result_json(result, command, machine, **extra)
    (run_dir / "reconstruction.json").write_text(json.dumps(payload, indent=1) + "\n")
    files = [*plot_run(run_dir, None, None), *plot_fields(run_dir, result)] if plots else []
    return {"goal_met": payload["goal"]["met"], "plots": [str(p) for p in files]}


Z0_GOAL = {"k": 0.5, "r": 0.9, "half_scale_ratio": 1.5}
"""From z = 0 alone: r at least ``r`` in the shell nearest ``k`` h/Mpc, and the scale where r falls to
one half at least ``half_scale_ratio`` times the baseline's (a reconstruction from z = 0 without the
displacement channels: the same network, so the ratio is what the reconstruction's own step buys)."""


def half_scale(k: list[float], r: list[float]) -> float | None:
    """The wavenumber where r(k) first falls below one half, linear between the shells around it (None
    where no two neighbouring shells bracket it: r never falls below one half, or is below it already
    in the first shell)."""
    for i in range(1, len(r)):
        if r[i] < 0.5 <= r[i - 1]:
            return float(k[i - 1] + (r[i - 1] - 0.5) / (r[i - 1] - r[i]) * (k[i] - k[i - 1]))
    return None


def z0_goal(doc: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """The figures of :data:`Z0_GOAL` for the result file ``doc`` against the result file ``baseline``:
    r in the shell nearest the goal's k, both half-correlation scales, their ratio, met or not."""
    k, r = doc["k"], doc["r_model"]
    i = min(range(len(k)), key=lambda j: abs(k[j] - Z0_GOAL["k"]))
    mine, base = half_scale(k, r), half_scale(baseline["k"], baseline["r_model"])
    ratio = mine / base if mine is not None and base is not None else None
    return {"k": k[i], "r": r[i], "half_scale": mine, "baseline_half_scale": base, "half_scale_ratio": ratio,
            "goal": Z0_GOAL, "met": bool(r[i] >= Z0_GOAL["r"] and ratio is not None
                                        and ratio >= Z0_GOAL["half_scale_ratio"])}


def _result(path: Path) -> dict[str, Any]:
    """A reconstruction result file with its ``k`` and ``r_model`` per shell; ValueError in one line
    naming the file otherwise."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON result file ({err})") from None
    k, r = (doc.get(key) if isinstance(doc, dict) else None for key in ("k", "r_model"))
    if not (isinstance(k, list) and isinstance(r, list) and len(k) == len(r) > 0):
        raise ValueError(f"{path}: a reconstruction result needs lists k and r_model of one value per shell "
                         "(reconstruction.json of a run)")
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cosmoflow.reconstruct",
                                 description="add the z = 0 goals (Z0_GOAL) to reconstruction result files")
    ap.add_argument("results", nargs="+", help="reconstruction.json files of runs from z = 0")
    ap.add_argument("--baseline", required=True, help="the result file of the z = 0 run without "
                    "displacement channels, whose half-correlation scale is the goal's unit")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        base = _result(Path(args.baseline))
        docs = {path: _result(path) for path in map(Path, args.results)}  # all read before any is written
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    for path, doc in docs.items():
        doc["z0_goal"] = z0_goal(doc, base)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        g = doc["z0_goal"]
        scale = "never" if g["half_scale"] is None else f"{g['half_scale']:.3f} h/Mpc"
        ratio = "-" if g["half_scale_ratio"] is None else f"{g['half_scale_ratio']:.2f}x"
        print(f"{path}: r({g['k']:.2f} h/Mpc) = {g['r']:.3f}, r = 1/2 at {scale} ({ratio} the baseline's): "
              f"{'met' if g['met'] else 'not met'}", flush=True)
    return 0


if __name__ == "__main__":
    from hybridpar.process import failure

    failure.run_main(main)  # under torchelastic's @record, as launch/train.py and cosmoflow.infer
