"""The volume study: per-universe averaging, the per-size plan, and a tiny study end to end.

Checked: the averaging of crop predictions per universe against hand-built predictions (noise that
cancels within a universe must give zero error, a shuffled row order must not matter, a missing crop
or crops that disagree on their universe's parameters must be errors); the plan the shipped config
implies (crops, depth, batch, learning-rate base per size); and ``python -m cosmoflow.experiments.volume``
on 16³ universes at "sizes" 8³ and 16³ (the last split over 2 ranks), one epoch, one seed, through
the same code path as the real study: its result file must pass the schema check, every validation
crop must have been predicted exactly once, and the reported MAE must be the per-universe one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

from cosmoflow.config import ConfigError
from cosmoflow.correlation import correlation, cross_power
from cosmoflow.experiments import reference
from cosmoflow.experiments.averaging import per_universe, spread
from cosmoflow.experiments.report import beyond_power, check_schema, convergence, goals
from cosmoflow.experiments.study import load_study
from cosmoflow.metrics import mae

from forked import run_python

ROOT = Path(__file__).resolve().parents[1]


def _crops(universes: int, crops: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    truth = rng.uniform(-1, 1, size=(universes, 4))
    names = np.repeat([f"u{i}.h5" for i in range(universes)], crops)
    return truth, names, np.repeat(truth, crops, axis=0)


def test_noise_that_cancels_within_a_universe_averages_away() -> None:
    truth, names, true = _crops(3, 4)
    noise = np.tile([[0.3], [-0.3], [0.1], [-0.1]], (3, 4))        # zero mean per universe
    order = np.random.default_rng(1).permutation(len(true))         # rows in no particular order
    pred = true + noise
    mean, target, keys = per_universe(pred[order], true[order], names[order], crops=4)
    assert list(keys) == ["u0.h5", "u1.h5", "u2.h5"]
    np.testing.assert_allclose(target, truth)
    np.testing.assert_allclose(mean, truth, atol=1e-12)
    assert max(mae(mean, target).values()) < 1e-12
    assert mae(pred, true)["sigma_8"] == pytest.approx(0.2)       # per crop: the noise stays


def test_averaging_is_the_mean_not_another_statistic() -> None:
    truth, names, true = _crops(2, 3)
    pred = true.copy()
    pred[0] += 0.9                                                   # one outlier crop of universe 0
    mean, target, _ = per_universe(pred, true, names, crops=3)
    np.testing.assert_allclose(mean[0] - truth[0], 0.3)
    np.testing.assert_allclose(mean[1], truth[1])
    assert mae(mean, target)["Omega_m"] == pytest.approx(0.15)


def test_missing_crop_or_mixed_universe_is_an_error() -> None:
    _, names, true = _crops(2, 4)
    with pytest.raises(ValueError, match=r"u1.h5 has 3 validation samples, expected 4"):
        per_universe(true[:-1], true[:-1], names[:-1], crops=4)
    mixed = true.copy()
    mixed[5, 1] += 0.5                                               # a crop of u1 with other parameters
    with pytest.raises(ValueError, match="u1.h5 disagree"):
        per_universe(mixed, mixed, names, crops=4)


def test_spread_over_seeds() -> None:
    mean, std = spread([{"a": 1.0}, {"a": 3.0}])
    assert mean == {"a": 2.0} and std["a"] == pytest.approx(np.sqrt(2.0))
    assert spread([{"a": 1.0}])[1] == {"a": 0.0}


def test_shipped_plan(tmp_path: Path) -> None:
    """The config of the real study: the same voxels and learning rate per step at every size."""
    study = load_study(ROOT / "launch/configs/volume_study.yaml", out=str(tmp_path))
    plan = {r.size: (r.crops, r.n_conv, r.batch_size, r.base_batch, r.ranks) for r in study.runs}
    assert plan == {16: (64, 2, 512, 4096, 2), 32: (8, 3, 64, 512, 2), 64: (1, 4, 8, 64, 2)}
    assert study.runs[-1].spatial != (1, 1, 1)                       # the whole volume is split
    assert study.universes.size == 64 and study.universes.channels == 4 and len(study.seeds) >= 2
    assert study.universes.voxel_mpc == pytest.approx(2 / 0.7)      # the 128 Mpc/h box of a 128^3 one
    assert study.universes.split_dir("val").name == "val_64_n128_seed152_sm1_vox2.85714"
    cfg = study.trainer_config(study.runs[0], study.seeds[0])
    assert cfg.data.sample_size == 16 and cfg.parallel["grid"]["data"] == 2
    assert cfg.model.power_spectrum and cfg.model.spectrum_stats == "running"
    old = load_study(ROOT / "launch/configs/volume_study_128.yaml", out=str(tmp_path / "128"))
    assert [r.size for r in old.runs] == [32, 64, 128] and old.universes.split_dir("val").name == \
        "val_128_n48_seed152_sm1"                                      # the default voxel: no suffix


def test_set_changes_every_run_but_not_what_the_study_sets(tmp_path: Path) -> None:
    """``--set`` (a fix tried at every size) reaches every run's trainer config; the per-run keys stay
    the study's; a key the trainer does not know is one clear error."""
    sets = ["model.batchnorm=true", "optimizer.name=adamw", "optimizer.base_lr=0.001", "train.batch_size=7"]
    study = load_study(ROOT / "launch/configs/volume_study.yaml", out=str(tmp_path), sets=sets)
    for run in study.runs:
        cfg = study.trainer_config(run, study.seeds[0])
        assert cfg.model.batchnorm and cfg.optimizer.name == "adamw" and cfg.optimizer.base_lr == 0.001
        assert cfg.train.batch_size == run.batch_size != 7
    plain = load_study(ROOT / "launch/configs/volume_study.yaml", out=str(tmp_path / "plain"))
    assert not plain.trainer_config(plain.runs[0], 0).model.batchnorm    # the YAML's tree is not changed
    with pytest.raises(ConfigError, match="no_such_key"):
        load_study(ROOT / "launch/configs/volume_study.yaml", out=str(tmp_path), sets=["model.no_such_key=1"])


def test_variants_extend_the_study_and_replace_its_sizes(tmp_path: Path) -> None:
    """A variant (``extends``) changes only what it states: sections merge key by key, ``sizes`` is
    replaced whole; the shipped variants' plans; a config that extends itself is one error."""
    configs = ROOT / "launch/configs"
    aug = load_study(configs / "volume_study_augment.yaml", out=str(tmp_path / "a"))
    assert [r.size for r in aug.runs] == [32, 128] and aug.seeds == [0, 1]
    cfg = aug.trainer_config(aug.runs[1], 0)
    assert cfg.data.augment == "symmetries" and cfg.model.batchnorm and cfg.optimizer.name == "adamw"
    assert cfg.data.workers == 1 and cfg.model.base_filters == 8 and cfg.train.epochs == 8  # the base's
    big = load_study(configs / "volume_study_gpu256.yaml", out=str(tmp_path / "b"))
    plan = {r.size: (r.crops, r.n_conv, r.batch_size, r.ranks) for r in big.runs}
    assert plan == {64: (64, 4, 256, 2), 128: (8, 5, 32, 2), 256: (1, 6, 4, 4)}
    assert big.universes.size == 256 and big.universes.workers == 16   # through volume_study_gpu.yaml
    assert big.trainer_config(big.runs[0], 0).data.workers == 2
    cnn = load_study(configs / "volume_study_cnn.yaml", out=str(tmp_path / "cnn"))
    assert [r.size for r in cnn.runs] == [64] and cnn.universes == load_study(
        configs / "volume_study.yaml", out=str(tmp_path / "base")).universes       # the same universes
    assert not cnn.trainer_config(cnn.runs[0], 0).model.power_spectrum
    ridge = load_study(configs / "volume_study_ridge.yaml", out=str(tmp_path / "ridge"))
    assert [r.size for r in ridge.runs] == [16, 32, 64] and ridge.seeds == [0, 1, 2]
    rc = ridge.trainer_config(ridge.runs[2], 0)
    assert rc.model.ridge_start and not rc.model.power_spectrum and rc.train.val_every == 2
    assert rc.train.epochs == 16 and rc.optimizer.warmup_epochs == 0 and rc.optimizer.decay_epochs == [12]
    assert rc.model.ridge_probe == "fixed" and rc.optimizer.base_lr == 0.024
    assert not rc.model.ridge_cross
    cross = load_study(configs / "volume_study_cross.yaml", out=str(tmp_path / "cross"))
    assert [r.size for r in cross.runs] == [64] and cross.seeds == [0, 1, 2]      # whole universes only
    xc = cross.trainer_config(cross.runs[0], 0)
    assert xc.model.ridge_cross and xc.model.ridge_probe == "fixed" and xc.train.epochs == 16
    short = load_study(configs / "volume_study_ridge_short.yaml", out=str(tmp_path / "short"))
    sc = short.trainer_config(short.runs[0], 0)                        # as the short checks ran
    assert sc.model.ridge_probe == "trained" and sc.optimizer.base_lr == 0.08 and sc.train.epochs == 4
    fixed = load_study(configs / "volume_study_ridge_short_fixed.yaml", out=str(tmp_path / "fixed"))
    fc = fixed.trainer_config(fixed.runs[0], 0)
    assert fc.model.ridge_probe == "fixed" and fc.train.epochs == 4 and fc.model.ridge_start
    assert fc.optimizer.base_lr == 0.08
    loop = tmp_path / "loop.yaml"
    loop.write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_study(loop, out=str(tmp_path / "c"))


def test_size_that_does_not_fit_is_one_clear_error(tmp_path: Path) -> None:
    tree = yaml.safe_load((ROOT / "launch/configs/volume_study.yaml").read_text())
    tree["sizes"] = {48: {"grid": {"data": 2}}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=r"input size 48 .* sizes that fit: \[64, 32, 16"):
        load_study(bad, out=str(tmp_path))


def test_tiny_study_end_to_end(tmp_path: Path) -> None:
    tree = yaml.safe_load((ROOT / "launch/configs/volume_study.yaml").read_text())
    tree["universes"] = {"dir": str(tmp_path / "data"), "size": 16, "channels": 4, "train": 4, "val": 2,
                         "train_seed": 3, "val_seed": 4, "smoothing": 1.0, "workers": 1}
    tree["seeds"] = [0]
    tree["batch_universes"] = 2
    tree["sizes"] = {8: {"grid": {"data": 2}}, 16: {"grid": {"data": 1, "spatial": [2, 1, 1]}}}
    tree["training"]["model"]["n_conv"] = 3                           # 16 -> 2; 8: 2 levels
    tree["training"]["train"]["epochs"] = 1
    tree["training"]["data"]["workers"] = 0      # loading in the ranks: a worker's fork server costs seconds
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tree))
    results = tmp_path / "results" / "volume_study.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = run_python(["-m", "cosmoflow.experiments.volume", "--config", str(config),
                       "--out", str(tmp_path / "out"), "--results", str(results)], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "4x16^3 | conv3 4->8 | MaxPool -> 8^3" in proc.stdout            # the architecture per size
    assert "| 8³ | 8 |" in proc.stdout and (results.with_suffix(".md")).exists()
    assert "plot: " in proc.stdout                                     # a PNG, or the one-line note
    doc = json.loads(results.read_text())
    check_schema(doc)
    assert sorted(doc["sizes"], key=int) == ["8", "16"]
    for size, crops in (("8", 8), ("16", 1)):
        (rec,) = doc["sizes"][size]["seeds"]
        assert rec["seed"] == 0 and rec["crops"] == crops
        with np.load(Path(rec["run_dir"]) / "val_predictions.npz") as z:
            pred, true, where, local = z["pred"], z["true"], z["path"], z["local"]
        assert len(pred) == 2 * crops                                  # every crop of both universes...
        for name in set(where):                                        # ...exactly once
            assert sorted(local[where == name]) == list(range(crops))
        mean, target, _ = per_universe(pred, true, where, crops)
        assert doc["sizes"][size]["mae"] == pytest.approx(mae(mean, target))
    assert doc["sizes"]["16"]["seeds"][0]["ranks"] == 2
    ref = json.loads(reference.path_for(results).read_text())             # the no-network reference
    assert sorted(ref["sizes"], key=int) == ["8", "16"]
    assert "| power spectrum + ridge, 16³ | – | [" in results.with_suffix(".md").read_text()
    cross = json.loads(reference.path_for(results, cross=True).read_text())  # with the channels' correlation
    assert sorted(cross["sizes"], key=int) == ["8", "16"] and "correlation" in cross["features"]
    assert "| power spectra + correlation between channels + ridge, 16³ | – | [" in \
        results.with_suffix(".md").read_text()
    # a second start reuses the finished runs (the study resumes) and reports the same numbers
    again = run_python(["-m", "cosmoflow.experiments.volume", "--config", str(config),
                        "--out", str(tmp_path / "out"), "--results", str(results)], env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.count("reusing") == 2, again.stdout[-2000:]
    assert json.loads(results.read_text())["sizes"] == doc["sizes"]


def test_schema_check_names_the_key() -> None:
    entry = {"mae": dict.fromkeys(("Omega_m", "sigma_8", "n_s", "H_0"), 0.1)}
    doc = {"sizes": {"32": {**entry, "mae_spread": entry["mae"], "seeds": [{"seed": 0, **entry}]}},
           "baseline": entry, "command": "x", "machine": {}, "units": "unitPar"}
    check_schema(doc)
    with pytest.raises(ValueError, match="top-level keys"):
        check_schema({k: v for k, v in doc.items() if k != "units"})
    check_schema({**doc, "reading": "what the figures mean"})          # optional, as date
    doc["sizes"]["32"]["mae"] = {"Omega_m": 0.1}
    with pytest.raises(ValueError, match=r"sizes.32.mae: expected one number per parameter"):
        check_schema(doc)


def _entry(maes: dict[str, float], spread_: float, curve: list[float] | None = None) -> dict:
    rec = {"seed": 0, "mae": maes}
    if curve is not None:
        rec["curve"] = {"epoch": list(range(1, len(curve) + 1)), **{p: curve for p in maes}}
    return {"mae": maes, "mae_spread": dict.fromkeys(maes, spread_), "seeds": [rec]}


def test_goals_and_convergence_lines_say_met_or_not_with_their_figures() -> None:
    """The report's goal lines: Omega_m and H_0 must halve from the smallest crops to the whole volume by
    more than both seed spreads; the network must be at most the reference on Omega_m, sigma_8 and H_0
    at every size; the learning curve's last quarter is reported as a relative change."""
    p = ("Omega_m", "sigma_8", "n_s", "H_0")
    small = dict(zip(p, (0.40, 0.30, 0.40, 0.40)))
    large = dict(zip(p, (0.14, 0.20, 0.35, 0.25)))
    doc = {"sizes": {"16": _entry(small, 0.01, [0.6, 0.5, 0.45, 0.44, 0.44, 0.44, 0.44, 0.44]),
                     "64": _entry(large, 0.02)}}
    ref = {"sizes": {"16": {"mae": dict(zip(p, (0.45, 0.31, 0.4, 0.41)))},
                     "64": {"mae": dict(zip(p, (0.16, 0.18, 0.3, 0.18)))}}}
    text = goals(doc, ref)
    assert "- Omega_m: 64³ / 16³ = 0.35 (goal <= 0.5; difference -0.2600 against seed spreads 0.0300 " \
           "together): met; the reference's ratio 0.36" in text
    assert "- H_0: 64³ / 16³ = 0.62" in text and "H_0: 64³ / 16³ = 0.62 (goal <= 0.5; difference -0.1500 " \
           "against seed spreads 0.0300 together): not met" in text
    assert "at 16³: Omega_m 0.4000 vs 0.4500, sigma_8 0.3000 vs 0.3100, H_0 0.4000 vs 0.4100: met" in text
    assert "at 64³: Omega_m 0.1400 vs 0.1600, sigma_8 0.2000 vs 0.1800 (worse), H_0 0.2500 vs 0.1800 " \
           "(worse): not met" in text
    doc["sizes"]["16"]["mae_spread"]["Omega_m"] = 0.3          # the gain within the seeds' noise: not met
    assert "- Omega_m: 64³ / 16³ = 0.35 (goal <= 0.5; difference -0.2600 against seed spreads 0.3200 " \
           "together): not met" in goals(doc)
    assert convergence(doc) == ("Learning curves, mean validation MAE over the last quarter of epochs "
                                "(each input alone): 16³ seed 0: 0.4400 -> 0.4400 (+0.0%). Every run "
                                "within 2%: met (largest change 0.0%)")
    text = goals(doc, ref)
    assert "beyond its seed spread on Omega_m, sigma_8, H_0 at every size: not met (16³ Omega_m 0.4000 + " \
           "0.3000 > 0.4500; 64³ sigma_8 0.2000 + 0.0200 > 0.1800; 64³ H_0 0.2500 + 0.0200 > 0.1800)" in text
    assert "- stretch, network <= 0.9 x reference at 64³: Omega_m 0.88, sigma_8 1.11: not met" in text
    cross = {"sizes": {"64": {"mae": dict(zip(p, (0.12, 0.18, 0.3, 0.17)))}}}
    assert beyond_power(doc, ref, cross) == (
        "\n- no network, with the correlation between channels at 64³: Omega_m 0.1200 (0.75 x the reference; "
        "network 0.1400), sigma_8 0.1800 (1.00 x the reference; network 0.2000), H_0 0.1700 (0.94 x the "
        "reference; network 0.2500)\n- network <= 0.95 x the reference with the correlation between "
        "channels at 64³: Omega_m 1.17: not met")
    assert beyond_power(doc, ref, None) == ""
    one = goals({"sizes": {"64": doc["sizes"]["64"]}}, ref)
    assert "one input size (64³), no comparison between sizes" in one and "64³ / 64³" not in one
    doc["sizes"]["16"]["seeds"][0]["curve"]["Omega_m"] = [0.6, 0.5, 0.45, 0.44, 0.44, 0.44, 0.44, 0.40]
    assert convergence(doc).endswith("Every run within 2%: not met (largest change 2.3%)")


def test_reference_features_of_white_noise() -> None:
    """White noise of variance v has power v in every shell (measure_power's normalisation on a box of d
    voxels), zero skewness; shells an 8³ input is too small to hold are reported as 0."""
    rng = np.random.default_rng(1)
    v = 0.25
    x = rng.normal(3.0, v ** 0.5, size=(2, 32, 32, 32))
    f = reference.features(x).reshape(2, -1)
    shells = len(reference.SHELLS) - 1
    for row in f:
        assert row[0] == 0.0                                            # [1/64, 1/32): no mode in 32 voxels
        assert row[1] != 0.0                                            # a few modes: held, but noisy
        assert np.allclose(row[2:shells], np.log(v), atol=0.1)         # shells of many modes: log v
        mean, log_var, skew = row[shells:]
        assert mean == pytest.approx(3.0, abs=0.01) and log_var == pytest.approx(np.log(v), abs=0.02)
        assert abs(skew) < 0.05
    small = reference.features(rng.normal(size=(1, 8, 8, 8)))
    assert np.all(small[:3] == 0.0) and np.all(small[3:shells] != 0.0)  # the fundamental of 8 is 1/8


def test_reference_cross_features_are_the_correlation_between_channels() -> None:
    """With ``cross`` the features are the plain ones, then per channel pair and shell the correlation
    coefficient: the numpy ``cross_power`` of cosmoflow.correlation on a correlated pair, 1 for a copy,
    -1 for a negated copy, 0 beside a constant channel and in shells the input does not hold."""
    rng = np.random.default_rng(4)
    a = rng.normal(size=(16, 16, 16))
    x = np.stack([a, 0.5 * a + rng.normal(size=a.shape), a, -a, np.full(a.shape, 0.7)])
    plain, both = reference.features(x), reference.features(x, cross=True)
    shells = len(reference.SHELLS) - 1
    assert np.array_equal(both[:len(plain)], plain)
    r = both[len(plain):].reshape(-1, shells)                           # pairs (0,1) (0,2) (0,3) (0,4) ...
    assert r.shape == (10, shells) and np.all(r[:, :2] == 0.0)          # 16 voxels hold no mode below 1/16
    want = correlation(cross_power(a, x[1], np.asarray(reference.SHELLS) * 16))
    assert np.allclose(r[0, 2:], want[2:], rtol=1e-12, atol=0)
    assert np.allclose(r[1, 2:], 1.0) and np.allclose(r[2, 2:], -1.0) and np.all(r[3] == 0.0)


def test_reference_ridge_recovers_a_linear_law_and_folds_whole_universes() -> None:
    rng = np.random.default_rng(2)
    universes, crops = 40, 8
    truth = rng.uniform(-1, 1, size=(universes, 4))
    mix = rng.normal(size=(4, 6))
    x = np.repeat(truth @ mix, crops, axis=0) + 0.05 * rng.normal(size=(universes * crops, 6))
    names = np.repeat([f"u{i}" for i in range(universes)], crops)
    held = list(reference._folds(names, reference.FOLDS))
    assert sum(h.astype(int) for h in held).tolist() == [1] * len(names)   # each row held out once
    for h in held:
        assert set(names[h]).isdisjoint(names[~h])                      # never a universe on both sides
    val_truth = rng.uniform(-1, 1, size=(10, 4))
    pred, chosen = reference.fit_predict(x, np.repeat(truth, crops, axis=0), names, val_truth @ mix)
    assert np.abs(pred - val_truth).max() < 0.1 and set(chosen) == {"Omega_m", "sigma_8", "n_s", "H_0"}


def test_reference_features_of_a_constant_channel_are_finite() -> None:
    """A constant channel (an empty crop at high redshift: no power at all) gives finite features (the
    floor's log, skewness 0) beside a fluctuating one, so the regression never meets NaN."""
    x = np.stack([np.full((8, 8, 8), 0.69), np.random.default_rng(3).normal(size=(8, 8, 8))])
    f = reference.features(x).reshape(2, -1)
    shells = len(reference.SHELLS) - 1
    assert np.isfinite(f).all()
    assert np.all(f[0, 3:shells] == np.log(reference.FLOOR)) and np.all(f[0, :3] == 0.0)  # held / not
    assert f[0, shells:].tolist() == [pytest.approx(0.69), np.log(reference.FLOOR), 0.0]


def test_parts_share_the_runs_between_them() -> None:
    """``--part K/N``: the N parts together run every (size, seed) run exactly once, each a mix of sizes;
    a part outside 1..N is one clear error."""
    from cosmoflow.experiments.volume import part_of, share

    parts = [share(9, (k, 3)) for k in (1, 2, 3)]
    assert sorted(i for p in parts for i in p) == list(range(9))
    assert parts[0] == [0, 3, 6]                        # 3 sizes x 3 seeds: one run of each size per part
    assert part_of("2/3") == (2, 3) and share(4, part_of("1/1")) == [0, 1, 2, 3]
    for bad in ("0/3", "4/3", "3", "a/b"):
        with pytest.raises(ConfigError, match="give K/N with 1 <= K <= N"):
            part_of(bad)
