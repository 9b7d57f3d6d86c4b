"""Validation of a training run: the regress task's scores over the whole validation set, every
replica's predictions gathered, BatchNorm's statistics re-estimated before it (precise BN), and the
final report against the predict-the-training-mean baseline.

Why apart from the loop (:mod:`cosmoflow.trainer`): these are passes over a loader with the weights
frozen, the same whenever the loop calls them; the reconstruct task's scores are
:func:`cosmoflow.reconstruct.evaluate_fields`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import hybridpar as hp
from cosmoflow.metrics import PARAMS, mae_per_parameter, plot_run, save_predictions
from hybridpar.checkpoint import faults
from hybridpar.data import VolumeLoader


def evaluate(engine: hp.Engine, loader: VolumeLoader
             ) -> tuple[dict[str, float], np.ndarray, np.ndarray, np.ndarray]:
    """Validation loss and MAE per parameter over the whole set (summed over data replicas), and every
    replica's predictions, targets and sample indices (so they can be grouped, e.g. per universe)."""
    engine.eval()
    preds, trues = [], []
    index = np.asarray([i for batch in loader.batches() for i in batch], dtype=np.int64)
    for i, (x_local, y) in enumerate(loader):
        if i == 1:  # a fault-injection point for the recovery tests (mid-validation)
            faults.hit("validate", 0, dist.get_rank())
        out = engine.predict(x_local)
        preds.append(out.detach().cpu().double().numpy())
        trues.append(y.cpu().double().numpy())
    engine.train()
    pred = np.concatenate(preds) if preds else np.zeros((0, 4))
    true = np.concatenate(trues) if trues else np.zeros((0, 4))
    err = pred - true
    sums = torch.tensor([*np.abs(err).sum(0), (err ** 2).sum(), len(pred)], dtype=torch.float64)
    if dist.get_world_size(engine.grid.data_group) > 1:
        dist.all_reduce(sums, group=engine.grid.data_group)
        gathered: list[Any] = [None] * engine.grid.data
        dist.all_gather_object(gathered, (pred, true, index), group=engine.grid.data_group)
        pred = np.concatenate([g[0] for g in gathered])
        true = np.concatenate([g[1] for g in gathered])
        index = np.concatenate([g[2] for g in gathered])
    n = max(sums[-1].item(), 1.0)
    maes = {f"mae_{p}": sums[i].item() / n for i, p in enumerate(PARAMS)}
    metrics = {"val_loss": sums[4].item() / (4 * n), "val_mae": sum(maes.values()) / 4, **maes}
    return metrics, pred, true, index


@torch.no_grad()
def precise_bn(engine: hp.Engine, loader: VolumeLoader, batches: int, epoch: int) -> None:
    """Re-estimate BatchNorm running statistics with the current weights (Wu & Johnson, 2021).

    Running averages taken while the weights move lag behind them; a model whose head normalises
    pooled features across the batch then evaluates far off. Averaging the batch statistics of a few
    training batches, weights frozen, removes the lag. Every replica's batches count: the engine
    averages the statistics over the data-parallel replicas after each training-mode forward.
    """
    norms = [m for _, layer in engine.layers for m in layer.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms or batches <= 0:
        return
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    engine.train()
    loader.set_epoch(epoch)
    for i, (x_local, _) in enumerate(loader):
        engine.predict(x_local)
        if i + 1 >= batches:
            break
    for m, mom in zip(norms, saved):
        m.momentum = mom


def report_regress(run_dir: Path, metrics: dict[str, Any], pred: np.ndarray, true: np.ndarray,
                   val_index: np.ndarray, train_ds: Any, val_ds: Any, plots: bool) -> dict[str, Any]:
    """The regress task's last validation kept (predictions, plots) and its MAE per parameter printed
    against predicting the training mean; returns the summary's ``baseline`` and ``plots``."""
    base = mae_per_parameter(np.broadcast_to(train_ds.labels.mean(0), true.shape), true)
    out: dict[str, Any] = {"baseline": base}
    save_predictions(run_dir / "val_predictions.npz", pred, true, val_index, val_ds)
    out["plots"] = [str(p) for p in plot_run(run_dir, pred, true)] if plots else []
    print("\nvalidation MAE per parameter (unitPar units), model vs predict-the-training-mean baseline:")
    print(f"  {'parameter':<10} {'model':>8} {'baseline':>9} {'change':>8}")
    for p in PARAMS:
        m, b = metrics[f"mae_{p}"], base[f"mae_{p}"]
        print(f"  {p:<10} {m:8.4f} {b:9.4f} {100 * (m / b - 1):+7.1f}%")
    return out
