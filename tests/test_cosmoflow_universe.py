"""Synthetic universes: the physics checked against its definitions, and the generator's files.

* The linear field's measured power spectrum equals the input P(k) within a few percent (16 seeds,
  shells of 2 k_f from 6 k_f to 32 k_f, expected power averaged over the very same modes).
* The growth factor equals 1/(1+z) for Ω_m = 1 and the Carroll, Press & Turner (1992) fit to ~1 %.
* The transfer function tends to 1 on large scales and falls; P(k) peaks near k ≈ 0.02 h/Mpc.
* log1p variance of the counts rises with σ_8 (phases fixed), and with time (z = 3 → 0).
* Counts are int16 with mean exactly 1; everything is deterministic per seed.
* ``python -m cosmoflow.generate`` writes the real data set's layout, independent of worker count.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from cosmoflow import generate as gen
from cosmoflow.universe import (
    FIDUCIAL,
    REDSHIFTS,
    VOXEL_MPC,
    Cosmology,
    PowerSpectrum,
    box_size,
    draw_unit_params,
    eisenstein_hu_nowiggle,
    growth_factor,
    linear_field,
    make_universe,
    measure_power,
    universe_from_seed,
)


def _log1p_var(full: np.ndarray) -> np.ndarray:
    return np.log1p(full.astype(np.float64)).var(axis=(0, 1, 2))


@pytest.mark.parametrize("voxel_mpc", [VOXEL_MPC, 2 / 0.7])
def test_linear_power_spectrum_matches_input(voxel_mpc: float) -> None:
    """The field has the spectrum asked for, on the default voxel and on one twice as coarse (whose box,
    twice as large in Mpc/h, reaches the larger scales)."""
    cosmo = Cosmology.from_unit([0.5, -0.3, 0.7, -0.8])  # off-fiducial in every parameter
    n = 64
    box = box_size(n, cosmo.h0, voxel_mpc)
    assert box == pytest.approx(n * voxel_mpc * cosmo.h)
    kf = 2 * np.pi / box
    edges = kf * np.arange(6, 34, 2)  # well sampled: >= ~450 independent modes per shell and seed
    power = PowerSpectrum(cosmo)
    measured = []
    for seed in range(16):
        _, p, expected = measure_power(linear_field(n, cosmo, seed, voxel_mpc=voxel_mpc), box, edges, power)
        measured.append(p)
    ratio = np.mean(measured, axis=0) / expected
    assert np.all(np.abs(ratio - 1) < 0.05), ratio
    assert abs(ratio.mean() - 1) < 0.015, ratio.mean()


def test_power_spectrum_normalisation_and_shape() -> None:
    cosmo = Cosmology()
    power = PowerSpectrum(cosmo)
    assert power.sigma(8.0) == pytest.approx(cosmo.sigma_8, rel=1e-6)
    doubled = PowerSpectrum(Cosmology(sigma_8=2 * cosmo.sigma_8))
    k = np.geomspace(1e-3, 5, 50)
    np.testing.assert_allclose(doubled(k), 4 * power(k), rtol=1e-9)
    t = eisenstein_hu_nowiggle(k, cosmo.omega_m, cosmo.h)
    assert eisenstein_hu_nowiggle(np.array([1e-5]), cosmo.omega_m, cosmo.h)[0] == pytest.approx(1, abs=1e-3)
    assert np.all(np.diff(t) < 0)
    peak = k[np.argmax(power(k))]
    assert 0.01 < peak < 0.04
    # P(k = 0.1 h/Mpc) for Planck-like parameters is about 5-7 x 10^3 (Mpc/h)^3
    assert 4e3 < power(np.array([0.1]))[0] < 8e3


def test_growth_factor() -> None:
    z = np.array(REDSHIFTS)
    np.testing.assert_allclose(growth_factor(z, 1.0), 1 / (1 + z), rtol=1e-4)

    def cpt92(zz: np.ndarray, om: float) -> np.ndarray:
        a3 = (1 + zz) ** 3
        omz = om * a3 / (om * a3 + 1 - om)
        olz = 1 - omz
        g = 2.5 * omz / (omz ** (4 / 7) - olz + (1 + omz / 2) * (1 + olz / 70))
        return g / (1 + zz)

    for om in (0.27, 0.3, 0.33):
        approx = cpt92(z, om) / cpt92(np.array([0.0]), om)
        np.testing.assert_allclose(growth_factor(z, om), approx, rtol=0.01)
    assert growth_factor(0.0, 0.3) == pytest.approx(1.0)


def test_unit_parameters() -> None:
    assert Cosmology.from_unit(np.zeros(4)) == Cosmology(*FIDUCIAL)
    u = np.array([1, -1, 0.5, -0.25], dtype=np.float32)
    c = Cosmology.from_unit(u)
    assert c.omega_m == pytest.approx(0.33) and c.sigma_8 == pytest.approx(0.72)
    np.testing.assert_allclose(c.to_unit(), u, atol=1e-6)
    assert box_size(128, 70.0) == 128.0 and box_size(64, 77.0) == pytest.approx(70.4)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        Cosmology.from_unit([0.0, 0.0])


def test_counts_layout() -> None:
    full = make_universe(16, np.zeros(4), seed=1)
    assert full.shape == (16, 16, 16, 4) and full.dtype == np.int16
    np.testing.assert_array_equal(full.astype(np.int64).sum(axis=(0, 1, 2)), [16 ** 3] * 4)
    assert full.min() >= 0


@pytest.mark.parametrize("smoothing", [2.0, 1.0])
def test_log1p_variance_rises_with_sigma8(smoothing) -> None:
    for seed in range(3):
        unit = draw_unit_params(seed)
        variances = [_log1p_var(make_universe(32, [unit[0], s, unit[2], unit[3]], seed, smoothing=smoothing))
                     for s in (-1, -0.5, 0, 0.5, 1)]
        assert np.all(np.diff(np.array(variances), axis=0) > 0), (seed, variances)


@pytest.mark.parametrize("smoothing", [2.0, 1.0])
def test_clustering_grows_with_time(smoothing) -> None:
    for seed in range(3):
        unit = draw_unit_params(seed)
        var = _log1p_var(make_universe(32, unit, seed, smoothing=smoothing))  # channels z = 0, 0.5, 1.5, 3
        assert np.all(np.diff(var) < 0), (seed, unit, var)


def test_deterministic_per_seed() -> None:
    a, ua = universe_from_seed(16, (7, 3))
    b, ub = universe_from_seed(16, (7, 3))
    c, uc = universe_from_seed(16, (7, 4))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(ua, ub)
    assert not np.array_equal(a, c) and not np.array_equal(ua, uc)
    assert ua.dtype == np.float32 and np.all(np.abs(ua) <= 1)
    # the field's phases depend on the seed only: same seed, other parameters, strongly correlated field
    f1 = linear_field(16, Cosmology(), 5)
    f2 = linear_field(16, Cosmology(sigma_8=0.9, n_s=1.0), 5)
    assert np.corrcoef(f1.ravel(), f2.ravel())[0, 1] > 0.95


def test_generate_cli_layout_and_worker_independence(tmp_path, capsys) -> None:
    assert gen.main(["--out", str(tmp_path / "a"), "--universes", "3", "--size", "16", "--workers", "2",
                     "--seed", "5", "--smoothing", "1.5"]) == 0
    assert "universes 16^3 [" in capsys.readouterr().err
    gen.generate(tmp_path / "b", universes=3, size=16, workers=1, seed=5, progress=False, smoothing=1.5)
    files = sorted((tmp_path / "a").iterdir())
    assert [f.name for f in files] == [f"univ_s5_{i:05d}.h5" for i in range(3)]
    for f in files:
        with h5py.File(f, "r") as fa, h5py.File(tmp_path / "b" / f.name, "r") as fb:
            assert fa["full"].shape == (16, 16, 16, 4) and fa["full"].dtype == np.int16
            assert fa["unitPar"].shape == (4,) and fa["unitPar"].dtype == np.float32
            np.testing.assert_array_equal(fa["full"][()], fb["full"][()])
            np.testing.assert_array_equal(fa["unitPar"][()], fb["unitPar"][()])
            assert fa.attrs["smoothing_mpc_h"] == 1.5
            assert fa.attrs["box_mpc_h"] == pytest.approx(16 / 0.7 * fa.attrs["physPar"][3] / 100)
    assert gen.main(["--out", str(tmp_path / "d"), "--universes", "1", "--size", "8",
                     "--voxel-mpc", "2.5"]) == 0
    with h5py.File(tmp_path / "d" / "univ_s0_00000.h5", "r") as f:
        assert f.attrs["voxel_mpc"] == 2.5
        assert f.attrs["box_mpc_h"] == pytest.approx(8 * 2.5 * f.attrs["physPar"][3] / 100)
    from cosmoflow.reconstruct import mean_fundamental, voxel_of  # r(k)'s wave numbers follow the voxel
    assert voxel_of(str(tmp_path / "d" / "univ_s0_00000.h5")) == 2.5
    assert voxel_of(str(files[0])) == pytest.approx(VOXEL_MPC)
    assert mean_fundamental(np.zeros((1, 4)), 8, 2.5) == pytest.approx(2 * np.pi / (8 * 2.5 * 0.7))
    with pytest.raises(SystemExit):
        gen.main(["--out", str(tmp_path / "e"), "--universes", "1", "--size", "8", "--voxel-mpc", "0"])
    assert "--voxel-mpc must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gen.main(["--out", str(tmp_path / "c"), "--universes", "0", "--size", "16"])
    assert "--universes must be at least 1" in capsys.readouterr().err
