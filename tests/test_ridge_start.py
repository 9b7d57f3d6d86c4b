"""The ridge-started network (``model.ridge_start``) starts exactly at the volume study's reference.

Checked: on inputs the reference reads (log1p of Poisson counts, 4 channels), after
``start_at_ridge`` the network's validation predictions equal the ridge's own (``RidgeFit.predict`` on
``reference.features``: the reference's numbers) to 1e-10 in float64 and 1e-4 in float32, whatever the
trunk's random weights; at step 0 only the head's output layer and the probe get gradients (the
residual is zero), after one SGD step the trunk gets them too and the predictions move. Split over 2
ranks (depth, and width) and 3 (depth, uneven: 8 = 3 + 3 + 2), the engine's losses over two SGD steps,
its weights after them and its predictions equal the single-process model's (float64, 1e-9 relative),
so the features a split volume computes from its shards are the reference's too. So are the features with
the correlation between channels (``cross``), split in depth and in width. Through the
application's trainer (2 ranks, each 16³ universe cut into 8³ crops split in depth, learning rate 0):
the run's validation predictions are the reference's ridge predictions fitted on its training files, and
``train.val_every=2`` over 3 epochs validates after epochs 2 and 3 only.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cosmoflow.data import open_dataset
from cosmoflow.experiments import reference
from cosmoflow.model import RidgeStarted, build_model, start_at_ridge

from distributed import ROOT, tiny_universes, train_script

TRAIN, VAL = 24, 8


def _inputs(size: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` inputs (4, size³) whose counts' rate depends on four parameters, so the ridge learns a law."""
    rng = np.random.default_rng(seed)
    y = rng.uniform(-1, 1, size=(n, 4))
    rate = np.exp(0.3 * y[:, :1, None, None, None] + 0.1 * rng.normal(size=(n, 4, size, size, size)))
    return np.log1p(rng.poisson(rate * (1 + 0.2 * y[:, 1:2, None, None, None]))), y


def _fit(size: int, cross: bool = False) -> tuple[reference.RidgeFit, np.ndarray, np.ndarray]:
    x_train, y_train = _inputs(size, TRAIN, 0)
    x_val, _ = _inputs(size, VAL, 1)
    f_train = np.stack([reference.features(x, cross) for x in x_train])
    f_val = np.stack([reference.features(x, cross) for x in x_val])
    ridge = reference.fit(f_train, y_train, np.array([f"u{i}" for i in range(TRAIN)]))
    return ridge, x_val, ridge.predict(f_val)


def _model(size: int, n_conv: int, ridge: reference.RidgeFit, seed: int = 0, probe: str = "trained",
           cross: bool = False) -> RidgeStarted:
    torch.manual_seed(seed)
    model = build_model(size, 4, n_conv, 4, 8, dense=[8], dropout=0.0, global_pool=True, head_norm=True,
                        ridge_start=True, ridge_probe=probe, ridge_cross=cross).double()
    start_at_ridge(model, ridge)
    return model


CASTS = [(torch.float64, 1e-10, "trained", False), (torch.float32, 1e-4, "trained", False),
         (torch.float64, 1e-10, "fixed", False), (torch.float64, 1e-10, "fixed", True)]


@pytest.mark.parametrize("dtype,tol,probe,cross", CASTS)
def test_network_starts_at_the_reference(dtype: torch.dtype, tol: float, probe: str, cross: bool) -> None:
    """Plain and with the correlation between channels (``model.ridge_cross``): the probe reads the
    reference's own features, so the untrained network predicts what that reference predicts."""
    ridge, x_val, want = _fit(16, cross)
    assert np.abs(want).max() > 0.1                                   # a prediction, not zeros
    for seed in (0, 1):                                               # whatever the trunk's weights
        model = _model(16, 2, ridge, seed, probe, cross).to(dtype).eval()
        got = model(torch.from_numpy(x_val).to(dtype)).detach().double().numpy()
        assert np.abs(got - want).max() < tol, (seed, np.abs(got - want).max())


def test_gradients_reach_the_trunk_after_the_first_step() -> None:
    ridge, x_val, want = _fit(16)
    model = _model(16, 2, ridge)
    x, y = _inputs(16, 8, 2)
    x, y = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    F.mse_loss(model(x), y).backward()
    grads = {n: float(p.grad.abs().sum()) for n, p in model.named_parameters()}
    out = [n for n, p in model.named_parameters() if p is model.output_layer().weight][0]
    assert grads[out] > 0 and grads["probe.weight"] > 0               # the residual's layer and the probe
    assert all(v == 0 for n, v in grads.items() if n.startswith("trunk."))   # residual zero: none yet
    opt.step()
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    trunk = [n for n, p in model.named_parameters() if n.startswith("trunk.") and p.grad.abs().sum() > 0]
    assert any(n.endswith("weight") and n.startswith("trunk.0") for n in trunk), trunk
    moved = model.eval()(torch.from_numpy(x_val)).detach().numpy()
    assert np.abs(moved - want).max() > 1e-6                          # fine-tuning moves the predictions
    fixed = _model(16, 2, ridge, probe="fixed")
    assert not [n for n, _ in fixed.named_parameters() if n.startswith("probe")]   # a fixed probe: buffers
    weight = fixed.probe.weight.clone()
    opt = torch.optim.SGD(fixed.parameters(), lr=0.05, momentum=0.9)
    F.mse_loss(fixed(x), y).backward()
    opt.step()
    assert torch.equal(fixed.probe.weight, weight)


def test_a_fit_of_another_size_is_refused() -> None:
    ridge, _, _ = _fit(8)
    model = build_model(16, 4, 2, 4, 8, dense=[8], dropout=0.0, global_pool=True, ridge_start=True)
    usable = np.ones(model.standardize.mean.numel() + 4, dtype=bool)
    bad = reference.RidgeFit(usable, np.zeros(usable.sum()), np.ones(usable.sum()),
                             np.zeros((usable.sum() + 1, 4)), ridge.strength)
    with pytest.raises(ValueError, match="the model's probe takes 44"):
        start_at_ridge(model, bad)


def test_cross_without_ridge_start_is_refused() -> None:
    from cosmoflow.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.ridge_cross .* set model.ridge_start: true"):
        load_config(None, ["model.ridge_cross=true"])


def _split_body(rank: int, world: int, size: int, n_conv: int, spatial: list[int], probe: str,
                cross: bool) -> None:
    import hybridpar as hp

    ridge, x_val, want = _fit(size, cross)
    x, y = _inputs(size, 4, 3)
    batches = [(torch.from_numpy(x), torch.from_numpy(y))] * 2
    single = _model(size, n_conv, ridge, probe=probe, cross=cross)
    opt = torch.optim.SGD(single.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for xb, yb in batches:
        loss = F.mse_loss(single(xb), yb)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    case = f"size {size}, spatial {spatial}, cross {cross}, rank {rank}"
    spec = hp.ParallelSpec.from_dict({"grid": {"spatial": spatial}})
    engine = hp.parallelize(_model(size, n_conv, ridge, probe=probe, cross=cross), spec, loss_fn=F.mse_loss)
    engine.eval()
    start = engine.predict(engine.shard_batch(torch.from_numpy(x_val), torch.zeros(VAL, 4))[0])
    assert np.abs(start.detach().numpy() - want).max() < 1e-10, f"{case}: split start is not the reference"
    engine.train()
    opt = torch.optim.SGD(engine.parameters(), lr=0.05, momentum=0.9)
    for step, (xb, yb) in enumerate(batches):
        loss = engine.train_step(*engine.shard_batch(xb, yb))
        opt.step()
        opt.zero_grad()
        assert abs(loss.item() - losses[step]) <= 1e-9 * abs(losses[step]), f"{case}: step {step} loss"
    state, ref = engine.full_state_dict(), single.state_dict()
    for k, v in ref.items():
        err = ((state[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)).item()
        assert err <= 1e-9, f"{case}: {k} relative error {err:.2e}"


@pytest.mark.parametrize("world,size,n_conv,spatial,probe,cross", [(2, 12, 2, [2, 1, 1], "trained", False),
                                                                   (2, 12, 2, [1, 1, 2], "fixed", True),
                                                                   (3, 8, 1, [3, 1, 1], "trained", False)],
                         ids=["2-depth", "2-width-fixed-cross", "3-uneven"])
def test_split_network_matches_single_process(pools, world: int, size: int, n_conv: int,
                                              spatial: list[int], probe: str, cross: bool) -> None:
    pools(world).run(_split_body, size, n_conv, spatial, probe, cross, timeout=300)


def _cross_body(rank: int, world: int, spatial: list[int]) -> None:
    import hybridpar as hp
    from cosmoflow.summaries import ReferenceFeatures

    x = torch.from_numpy(_inputs(12, 2, 5)[0])
    want = ReferenceFeatures(12, 4, cross=True)(x)
    engine = hp.parallelize(ReferenceFeatures(12, 4, cross=True), {"grid": {"spatial": spatial}})
    got = engine.predict(engine.shard_batch(x)[0])
    err = (got - want).abs().max().item()
    assert err <= 1e-10 * want.abs().max().item(), f"spatial {spatial}, rank {rank}: cross features, {err}"


@pytest.mark.parametrize("spatial", [[2, 1, 1], [1, 1, 2]], ids=["depth", "width"])
def test_cross_features_split_match_single_process(pools, spatial: list[int]) -> None:
    """The reference's features with the correlation between channels (``cross``: pair sums through the
    same power spectrum) computed from the shards of a volume split over 2 ranks equal one process's."""
    pools(2).run(_cross_body, spatial, timeout=120)


def test_trainer_starts_at_the_reference_and_validates_every_second_epoch(tmp_path: Path) -> None:
    data, run = tiny_universes(tmp_path / "universes"), tmp_path / "run"
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", "data.sample_size=8",
            "data.workers=0", "model.n_conv=2", "model.base_filters=4", "model.dense=[8]",
            "model.power_spectrum=false",
            "model.ridge_start=true", "data.augment=symmetries", "train.batch_size=8", "train.epochs=3",
            "train.val_every=2", "optimizer.base_lr=0.0", "optimizer.momentum=0.0", f"run_dir={run}",
            "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
            "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}}"]
    config = ["--config", str(ROOT / "launch/configs/demo.yaml")]
    res = train_script([*config, *[a for v in sets for a in ("--set", v)]])
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((run / "ridge_start.json").read_text())["size"] == 8
    with open(run / "metrics_epochs.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [2, 3]
    ridge = reference.ridge_start(data / "train", 8, 4)
    val = open_dataset(data / "val", sample_size=8, channels=4)
    want = ridge.predict(np.stack([reference.features(val.read(i)[0]) for i in range(len(val))]))
    with np.load(run / "val_predictions.npz") as z:
        got, sample = z["pred"], z["sample"]
    assert sorted(sample.tolist()) == list(range(len(val)))
    assert np.abs(got - want[sample]).max() < 1e-4, np.abs(got - want[sample]).max()
