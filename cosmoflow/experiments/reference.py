"""How much each input size *could* tell: a classical estimator on the same crops and universes.

Why: when a network trained on whole universes does not beat one trained on crops, two explanations
compete: the larger volume carries no more information about the parameters (a property of the
universes), or the network does not extract it (a property of the training). A reference that needs no
training settles which. This one is what cosmologists did before CNNs: measure each input's power
spectrum, regress the parameters on it linearly. Per input (a crop or a whole universe) and channel:
the log of the shell-averaged power of ``log1p(counts)`` in fixed shells of wavenumber (in cycles per
voxel, the same physical shells at every size; shells an input is too small to hold are left out), and
the channel's mean, log variance and skewness. A ridge regression on the training inputs, its strength
per parameter chosen by cross-validation over training *universes* (crops of one universe never sit on
both sides of a fold), predicts the validation inputs; crop sizes are scored by the mean prediction over
a universe's crops, exactly as the networks are (:mod:`.averaging`).

    python -m cosmoflow.experiments.reference --config launch/configs/volume_study.yaml

writes ``<results>_reference.json`` beside the study's result file; the study's table and plot show it
(:mod:`.report`).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cosmoflow.data import open_dataset
from cosmoflow.experiments.averaging import per_universe
from cosmoflow.metrics import PARAMS, mae
from cosmoflow.summaries import FLOOR, SHELLS, ReferenceFeatures

__all__ = ["FLOOR", "SHELLS", "RidgeFit", "describe", "features", "fit", "fit_predict", "reference",
           "ridge_start"]

STRENGTHS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
"""Ridge strengths tried (on standardised features), per parameter, by cross-validation."""
FOLDS = 4
_SPECTRA = ("per channel: log shell power of log1p(counts) in shells " + ", ".join(f"{e:.3g}" for e in SHELLS)
            + " cycles/voxel (those the input holds), mean, log variance, skewness")
_CROSS = "per pair of channels, their correlation coefficient in each shell"
_RIDGE = (f"ridge regression, strength per parameter from {FOLDS}-fold cross-validation over training "
          "universes")
FEATURES = f"{_SPECTRA}; {_RIDGE}"


def describe(cross: bool = False) -> str:
    """What the reference reads, for its result file: :data:`FEATURES`, and with ``cross`` the
    correlation between channels."""
    return f"{_SPECTRA}; {_CROSS}; {_RIDGE}" if cross else FEATURES


@functools.lru_cache(maxsize=8)
def _extractor(size: int, channels: int, cross: bool) -> ReferenceFeatures:
    return ReferenceFeatures(size, channels, cross)


def features(x: np.ndarray | torch.Tensor, cross: bool = False) -> np.ndarray:
    """Summary statistics of one input ``x`` (C, d, d, d), float ``log1p(counts)``, in float64:
    :class:`cosmoflow.summaries.ReferenceFeatures`, the module the ridge-started network computes too
    (``cross``: with the correlations between channels after them)."""
    t = torch.as_tensor(np.asarray(x, dtype=np.float64))
    with torch.no_grad():
        return _extractor(t.shape[-1], t.shape[0], cross)(t[None])[0].numpy()


def _rows(directory: Path, size: int, channels: int, indices: range, cross: bool = False
          ) -> tuple[list, list, list]:
    """Features, targets and universe file of the samples ``indices`` (one worker's share)."""
    ds = open_dataset(directory, sample_size=size, channels=channels)
    rows, targets, where = [], [], []
    for i in indices:
        x, y = ds.read(i)
        rows.append(features(x.numpy(), cross))
        targets.append(np.asarray(y, dtype=np.float64))
        where.append(ds.locate(i)[0].path)
    return rows, targets, where


def _table(directory: Path, size: int, channels: int, workers: int = 1, cross: bool = False
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features, targets, universe file) of every sample of ``directory`` cut into ``size``³ inputs,
    measured by ``workers`` processes (a 256³ universe cut into 32³ crops is 512 spectra per channel)."""
    n = len(open_dataset(directory, sample_size=size, channels=channels))
    step = max(n // (4 * workers), 1)  # a few chunks per worker: uneven ones even out
    chunks = [range(lo, min(lo + step, n)) for lo in range(0, n, step)]
    if workers <= 1:
        parts = [_rows(directory, size, channels, c, cross) for c in chunks]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_rows, *zip(*[(directory, size, channels, c, cross) for c in chunks])))
    rows, targets, where = ([v for part in parts for v in part[k]] for k in range(3))
    return np.asarray(rows), np.asarray(targets), np.asarray(where)


def _ridge(x: np.ndarray, y: np.ndarray, strength: float) -> np.ndarray:
    """Weights (features + 1, outputs) of a ridge regression with an unpenalised intercept (last row)."""
    a = np.c_[x, np.ones(len(x))]
    penalty = strength * np.eye(a.shape[1])
    penalty[-1, -1] = 0.0
    return np.linalg.solve(a.T @ a + penalty, a.T @ y)


def _predict(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.c_[x, np.ones(len(x))] @ w


def _folds(universes: np.ndarray, k: int) -> Iterator[np.ndarray]:
    """Boolean masks of the held-out rows of ``k`` folds that split whole universes."""
    keys = np.unique(universes)
    order = np.random.default_rng(0).permutation(len(keys))
    for f in range(k):
        yield np.isin(universes, keys[order[f::k]])


@dataclass(frozen=True)
class RidgeFit:
    """A fitted reference: which features vary over the training set (``usable``; the rest are
    constants, weight 0), their training mean and spread (the standardisation), and per parameter the
    ridge weights on the standardised usable features with the intercept last (``weights``, (usable + 1,
    parameters)) and the strength cross-validation chose. Everything a linear probe needs to predict
    exactly as the reference does."""

    usable: np.ndarray
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    strength: dict[str, float]

    def predict(self, x: np.ndarray) -> np.ndarray:
        return _predict(self.weights, (x[:, self.usable] - self.mean) / self.scale)

    def to_dict(self) -> dict[str, Any]:
        return {"usable": self.usable.tolist(), "mean": self.mean.tolist(), "scale": self.scale.tolist(),
                "weights": self.weights.tolist(), "strength": self.strength}

    @classmethod
    def from_dict(cls, doc: dict[str, Any]) -> RidgeFit:
        usable = np.asarray(doc["usable"], dtype=bool)
        mean, scale = np.asarray(doc["mean"], dtype=np.float64), np.asarray(doc["scale"], dtype=np.float64)
        weights = np.asarray(doc["weights"], dtype=np.float64)
        k = int(usable.sum())
        if mean.shape != (k,) or scale.shape != (k,) or weights.ndim != 2 or weights.shape[0] != k + 1:
            raise ValueError(f"a ridge fit of {k} usable features needs mean and scale of {k} values and "
                             f"weights of {k + 1} rows, got {mean.shape}, {scale.shape}, {weights.shape}")
        return cls(usable, mean, scale, weights, {str(p): float(v) for p, v in doc["strength"].items()})


def fit(x_train: np.ndarray, y_train: np.ndarray, u_train: np.ndarray) -> RidgeFit:
    """The ridge regression of ``y_train`` on the features ``x_train``, strength per parameter chosen by
    cross-validation over the training universes ``u_train``."""
    usable = np.ptp(x_train, axis=0) > 0  # a shell no input holds is a constant 0
    mu, sd = x_train[:, usable].mean(0), x_train[:, usable].std(0)
    z_train = (x_train[:, usable] - mu) / sd
    cv = np.zeros((len(STRENGTHS), y_train.shape[1]))
    for held in _folds(u_train, FOLDS):
        for s, strength in enumerate(STRENGTHS):
            w = _ridge(z_train[~held], y_train[~held], strength)
            cv[s] += np.abs(_predict(w, z_train[held]) - y_train[held]).sum(0)
    chosen = [STRENGTHS[int(s)] for s in cv.argmin(axis=0)]
    weights = np.concatenate([_ridge(z_train, y_train[:, [j]], lam) for j, lam in enumerate(chosen)], axis=1)
    return RidgeFit(usable, mu, sd, weights, dict(zip(PARAMS, chosen)))


def fit_predict(x_train: np.ndarray, y_train: np.ndarray, u_train: np.ndarray,
                x_val: np.ndarray) -> tuple[np.ndarray, dict[str, float]]:
    """Validation predictions of the ridge regression, and the strength chosen per parameter."""
    ridge = fit(x_train, y_train, u_train)
    return ridge.predict(x_val), ridge.strength


def ridge_start(train_dir: Path | str, size: int, channels: int, workers: int = 1,
                cross: bool = False) -> RidgeFit:
    """The reference (``cross``: the one with the correlation between channels) fitted on every
    ``size``³ input of ``train_dir``: where a ridge-started network's linear probe begins
    (:func:`cosmoflow.model.start_at_ridge`)."""
    x_train, y_train, u_train = _table(Path(train_dir), size, channels, workers, cross)
    return fit(x_train, y_train, u_train)


def reference(train_dir: Path, val_dir: Path, sizes: list[int], channels: int, workers: int = 1,
              cross: bool = False) -> dict[str, Any]:
    """``{"sizes": {"32": {"mae": {P: x}, "strength": {P: λ}}, ...}, "features": str}`` (unitPar);
    the spectra are measured by ``workers`` processes; ``cross``: the features include the correlation
    between channels (a stronger reference, still no network)."""
    out: dict[str, Any] = {}
    for size in sizes:
        x_train, y_train, u_train = _table(train_dir, size, channels, workers, cross)
        x_val, y_val, u_val = _table(val_dir, size, channels, workers, cross)
        pred, chosen = fit_predict(x_train, y_train, u_train, x_val)
        mean, target, _ = per_universe(pred, y_val, u_val)
        out[str(size)] = {"mae": mae(mean, target), "strength": chosen}
        what = "reference with cross spectra" if cross else "reference"
        print(f"  {what} {size}^3: " + ", ".join(f"{p} {v:.4f}" for p, v in out[str(size)]["mae"].items()),
              flush=True)
    return {"sizes": out, "features": describe(cross)}


def path_for(results: Path, cross: bool = False) -> Path:
    """Where the reference (``cross``: the one with the correlations between channels) of a study whose
    result file is ``results`` lives."""
    return results.with_name(results.stem + ("_reference_cross.json" if cross else "_reference.json"))


def main(argv: list[str] | None = None) -> int:
    from cosmoflow.config import ConfigError  # noqa: PLC0415
    from cosmoflow.experiments.study import load_study, prepare_data  # noqa: PLC0415

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m cosmoflow.experiments.reference",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="launch/configs/volume_study.yaml", help="the study's YAML")
    ap.add_argument("--results", help="the study's result JSON (default: the config's); the reference is "
                                      "written beside it as <stem>_reference.json")
    ap.add_argument("--cross", action="store_true", help="add the correlation between channels per shell "
                    "to the features; written as <stem>_reference_cross.json")
    args = ap.parse_args(argv)
    try:
        study = load_study(args.config, None, args.results)
        prepare_data(study)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    u = study.universes
    doc = reference(u.split_dir("train"), u.split_dir("val"), [r.size for r in study.runs], u.channels,
                    u.workers, args.cross)
    path = path_for(Path(study.results), args.cross)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"reference: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
