"""Scores of crop-trained models per universe: the mean of the predictions over all crops of one universe.

Why: a model trained on 32³ crops sees a 64th of a 128³ universe at a time, but it is asked about the
universe, whose parameters every crop shares. Averaging its 64 predictions is the fair comparison with
a model that reads the whole universe at once: it uses the same voxels. The per-crop error alone would
charge the small model for a handicap that a user of it would not accept.

The validation predictions come from the trainer's ``val_predictions.npz`` (:func:`cosmoflow.metrics.
save_predictions`), one row per sample with the file it was read from; for raw universes cut into
sub-cubes by ``data.sample_size`` that file is the universe (:mod:`cosmoflow.data`: sub-cube (i, j, k)
of a universe file is its sample ``(i·n + j)·n + k``), so the file names the group.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def per_universe(pred: np.ndarray, true: np.ndarray, universe: Sequence[str] | np.ndarray,
                 crops: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(mean prediction, target, key)`` per universe, universes sorted by key.

    ``universe`` names each row's universe. Every row of a universe must carry the same target (they are
    crops of one box) and, when ``crops`` is given, a universe must have exactly that many rows: a
    missing or doubled crop would bias its mean silently, so either is an error naming the universe.
    """
    pred, true = np.asarray(pred, dtype=np.float64), np.asarray(true, dtype=np.float64)
    keys, inverse, counts = np.unique(np.asarray(universe), return_inverse=True, return_counts=True)
    if pred.shape != true.shape or pred.ndim != 2 or len(inverse) != len(pred):
        raise ValueError(f"per_universe: pred {pred.shape}, true {true.shape} and {len(inverse)} universe "
                         "names must agree: one row (sample) each, one column per parameter")
    if crops is not None and np.any(counts != crops):
        k = int(np.flatnonzero(counts != crops)[0])
        raise ValueError(f"per_universe: universe {keys[k]} has {counts[k]} validation samples, expected "
                         f"{crops} crops; every crop of a universe must be predicted exactly once")
    sums = np.zeros((len(keys), pred.shape[1]))
    np.add.at(sums, inverse, pred)
    first = np.zeros(len(keys), dtype=np.int64)
    first[inverse[::-1]] = np.arange(len(inverse))[::-1]  # the first row of each universe
    target = true[first]
    off = np.abs(true - target[inverse]).max(axis=1)
    if np.any(off > 1e-6):
        k = int(inverse[int(np.argmax(off))])
        raise ValueError(f"per_universe: the samples of universe {keys[k]} disagree on its parameters (by "
                         f"{off.max():.3g}); crops of one universe share its targets, so these are not one")
    return sums / counts[:, None], target, keys


def spread(values: Sequence[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean and spread over seeds per parameter; the spread is the sample standard deviation (ddof 1),
    0 for a single seed (no spread can be measured from one)."""
    names = list(values[0])
    table = np.array([[v[n] for n in names] for v in values], dtype=np.float64)
    std = table.std(axis=0, ddof=1) if len(values) > 1 else np.zeros(len(names))
    return dict(zip(names, map(float, table.mean(axis=0)))), dict(zip(names, map(float, std)))
