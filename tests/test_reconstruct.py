"""The reconstruction task: r(k) against exact cases, the generator's initial field, its per-rank reads,
the task's config checks, and ``launch/train.py`` end to end on tiny universes (2 ranks, split volumes):
the result file has the fields the issue names, plots and CSV are written, a second start resumes.
The U-Net's parity with one process is in test_graph_engine (``CosmoUNet``)."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmoflow.config import ConfigError, load_config
from cosmoflow.correlation import correlation, cross_power, mode_lengths, shell_edges
from cosmoflow.data import open_dataset
from cosmoflow.generate import generate
from cosmoflow.reconstruct import half_scale
from cosmoflow.reconstruct import main as z0_goal_cli
from cosmoflow.universe import Cosmology, draw_unit_params, linear_field

from distributed import ROOT, train_script


def _field(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, n, n))


def test_mode_weights_give_parseval():
    """Each stored rfftn mode weighted by its conjugate twins: Σ w |f_k|² = n³ Σ x² (odd and even n)."""
    for n in (6, 7):
        x = _field(n, 1)
        f = np.fft.rfftn(x).ravel()
        _, w = mode_lengths(n)
        assert np.isclose((w * np.abs(f) ** 2).sum(), n ** 3 * (x ** 2).sum())


def test_correlation_exact_cases():
    n = 32
    edges = shell_edges(n)
    a, b = _field(n, 1), _field(n, 2)
    assert np.allclose(correlation(cross_power(a, a, edges)), 1.0)
    assert np.allclose(correlation(cross_power(a, 3.0 * a + 7.0, edges)), 1.0)  # scale and mean do not count
    assert np.allclose(correlation(cross_power(a, -a, edges)), -1.0)
    # equal-power independent noise: r = 1/sqrt(2) up to the scatter of each shell's modes
    mixed = correlation(cross_power(a, a + b, edges))[2:]
    assert np.all(np.abs(mixed - 2 ** -0.5) < 0.08)
    assert np.all(np.abs(correlation(cross_power(a, b, edges))[2:]) < 0.1)
    with pytest.raises(ValueError, match="same shape"):
        cross_power(a, a[:8, :8, :8], edges)


@pytest.fixture(scope="module")
def fields(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("fields")
    generate(d / "train", 4, 16, seed=1, progress=False, smoothing=1.0)
    generate(d / "val", 2, 16, seed=2, progress=False, smoothing=1.0)
    generate(d / "bare", 1, 16, seed=1, progress=False, linear=False)
    return d


def test_z0_goal_reads_r_at_half_an_inverse_mpc_and_the_half_correlation_scale(tmp_path):
    """The z = 0 goals added to a result file: r in the shell nearest 0.5 h/Mpc, the scale where r
    falls through one half (linear between shells) against the baseline's, met only when both hold."""
    k = [0.1, 0.3, 0.5, 0.7, 0.9, 1.1]
    assert half_scale(k, [1.0, 0.9, 0.7, 0.5, 0.3, 0.1]) == pytest.approx(0.7)    # r = 1/2 is not below
    assert half_scale(k, [1.0, 0.9, 0.8, 0.6, 0.4, 0.1]) == pytest.approx(0.8)
    assert half_scale(k, [1.0] * 6) is None
    base = tmp_path / "base.json"
    base.write_text(json.dumps({"k": k, "r_model": [1.0, 0.9, 0.6, 0.4, 0.2, 0.1]}))     # r = 1/2 at 0.6
    runs = {"good": [1.0, 0.99, 0.92, 0.8, 0.6, 0.4], "short": [1.0, 0.99, 0.92, 0.6, 0.4, 0.2],
            "blurred": [1.0, 0.95, 0.88, 0.8, 0.7, 0.6]}
    for name, r in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps({"k": k, "r_model": r, "command": name}))
    assert z0_goal_cli([str(tmp_path / f"{n}.json") for n in runs] + ["--baseline", str(base)]) == 0
    got = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in runs}
    assert got["good"]["command"] == "good"                                        # the file, extended
    g = got["good"]["z0_goal"]
    assert (g["k"], g["r"], g["baseline_half_scale"]) == (0.5, 0.92, pytest.approx(0.6))
    assert g["half_scale"] == pytest.approx(1.0) and g["half_scale_ratio"] == pytest.approx(1 / 0.6)
    assert g["met"] and not got["short"]["z0_goal"]["met"]                        # 0.8 / 0.6 < 1.5
    assert got["blurred"]["z0_goal"]["half_scale"] is None and not got["blurred"]["z0_goal"]["met"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k": k}))                                           # no r_model: refused
    before = (tmp_path / "good.json").read_text()
    assert z0_goal_cli([str(tmp_path / "good.json"), str(bad), "--baseline", str(base)]) == 2
    assert z0_goal_cli([str(bad), "--baseline", str(tmp_path / "missing.json")]) == 2
    assert (tmp_path / "good.json").read_text() == before                         # nothing written


def test_generator_writes_the_initial_field(fields):
    with h5py.File(fields / "train" / "univ_s1_00001.h5") as f:
        stored = f["linear"][()]
    cosmo = Cosmology.from_unit(draw_unit_params((1, 1)))
    np.testing.assert_allclose(stored, linear_field(16, cosmo, (1, 1), 1.0), rtol=1e-5, atol=1e-5)
    with h5py.File(fields / "bare" / "univ_s1_00000.h5") as f:
        assert "linear" not in f


def test_target_is_read_per_region_like_the_input(fields):
    ds = open_dataset(fields / "train", sample_size=8, channels=1, target="linear")
    assert len(ds) == 4 * 8 and ds.sample_shape == (1, 8, 8, 8)
    with h5py.File(ds.entries[1].path) as f:
        full, linear = f["full"][()], f["linear"][()]
    region = (slice(1, 5), slice(0, 8), slice(3, 7))
    x, y = ds.read(8 + 5, region)  # file 1, sub-cube 5 = (1, 0, 1)
    corner = (slice(9, 13), slice(0, 8), slice(11, 15))
    np.testing.assert_array_equal(y.numpy()[0], linear[corner])
    np.testing.assert_allclose(x.numpy()[0], np.log1p(full[corner][..., 0].astype(np.float32)))
    assert x.shape == (1, 4, 8, 4)


def test_missing_target_names_the_file(fields, tmp_path):
    with pytest.raises(ValueError, match=r"univ_s1_00000\.h5: no dataset 'linear'.*without --no-linear"):
        open_dataset(fields / "bare", target="linear")
    packed = tmp_path / "p.h5"
    with h5py.File(packed, "w") as f:
        f["x"] = np.zeros((2, 8, 8, 8, 4), np.int16)
        f["y"] = np.zeros((2, 4), np.float32)
    with pytest.raises(ValueError, match="holds no initial density field"):
        open_dataset(packed, target="linear")
    with pytest.raises(ValueError, match="target must be one of"):
        open_dataset(fields / "train", target="labels")


def test_reconstruct_config_checks():
    cfg = ROOT / "launch/configs/reconstruct.yaml"
    assert load_config(cfg).task == "reconstruct"
    with pytest.raises(ConfigError, match="divisible by 8; data.sample_size 36"):
        load_config(cfg, ["data.sample_size=36"])
    with pytest.raises(ConfigError, match="not reported by the reconstruct task"):
        load_config(cfg, ["checkpoint.best_metric=val_mae"])
    with pytest.raises(ConfigError, match="task: 'segment' is not one of regress, reconstruct"):
        load_config(cfg, ["task=segment"])
    with pytest.raises(ConfigError, match="at least 3 levels"):
        load_config(cfg, ["unet.levels=2"])
    with pytest.raises(ConfigError, match="data.channels: 5"):
        load_config(cfg, ["data.channels=5"])


def _args(data: Path, run: Path, *extra: str) -> list[str]:
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", "data.sample_size=16",
            "data.workers=0", "unet.levels=3", "unet.width=4", "unet.max_width=8", "unet.groups=2",
            "train.batch_size=2", f"run_dir={run}", "logging.progress=false", "logging.tensorboard=false",
            "checkpoint.every_steps=2", "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}}", *extra]
    config = str(ROOT / "launch/configs/reconstruct.yaml")
    return ["--config", config, *[a for s in sets for a in ("--set", s)]]


def test_reconstruct_end_to_end_and_resume(fields, tmp_path):
    run = tmp_path / "run"
    first = train_script(_args(fields, run, "train.epochs=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    result = json.loads((run / "reconstruction.json").read_text())
    keys = ("k", "k_nyquist", "r_model", "r_input", "mse_model", "mse_input", "size", "command", "machine")
    assert set(keys) <= set(result), set(keys) - set(result)
    assert result["size"] == 16 and len(result["k"]) == len(result["r_model"]) == len(result["r_input"]) == 4
    assert all(-1.0 <= r <= 1.0 for r in result["r_model"] + result["r_input"])
    assert result["validation_volumes"] == 2 and "launch/train.py" in result["command"]
    assert len(result["r_input_earliest_channel"]) == 4  # four snapshots in: the z = 3 one is scored too
    assert "cross-correlation with the initial field" in first.stdout
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 2  # 4 volumes / batch 2
    if _has("matplotlib"):
        assert (run / "plots" / "r_k.png").is_file() and (run / "plots" / "slices.png").is_file()
    second = train_script(_args(fields, run, "train.epochs=2"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2" in second.stdout


def test_output_split_differs_from_input_is_one_line(fields, tmp_path):
    res = train_script(_args(fields, tmp_path / "r", "train.epochs=1",
                          "parallel={grid: {spatial: [2, 1, 1]}, layers: {'head': {spatial: [1, 2, 1]}}}"))
    assert res.returncode != 0
    assert "the target field is read split like the input" in res.stderr


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True



def test_displacement_points_into_an_overdensity():
    """ψ = i k / k² δ: matter converges on an overdense blob (δ = -∇·ψ > 0), so beside a blob at the
    centre the displacement points back to it, and its divergence is the smoothed -δ."""
    import torch

    from cosmoflow.displacement import Displacement

    n = 16
    grid = torch.arange(n, dtype=torch.float64) - n / 2
    r2 = grid.view(-1, 1, 1) ** 2 + grid.view(1, -1, 1) ** 2 + grid.view(1, 1, -1) ** 2
    counts = 1.0 + 4.0 * torch.exp(-r2 / 8.0)
    out = Displacement(smoothing=1.0)(torch.log1p(counts).view(1, 1, n, n, n))
    psi = out[0, 1:]
    c = n // 2
    assert psi[0, c + 3, c, c] < 0 < psi[0, c - 3, c, c]  # along D, towards the centre
    assert psi[1, c, c + 3, c] < 0 < psi[1, c, c - 3, c] and psi[2, c, c, c + 3] < 0 < psi[2, c, c, c - 3]
    f, h = 2 * torch.pi * torch.fft.fftfreq(n, dtype=torch.float64), \
        2 * torch.pi * torch.fft.rfftfreq(n, dtype=torch.float64)  # radians per voxel
    k = [f.view(-1, 1, 1), f.view(1, -1, 1), h.view(1, 1, -1)]
    div = sum(torch.fft.irfftn(1j * kj * torch.fft.rfftn(psi[j]), s=(n, n, n)) for j, kj in enumerate(k))
    delta = counts / counts.mean() - 1
    smooth = torch.fft.irfftn(torch.fft.rfftn(delta) * torch.exp(-0.5 * (k[0] ** 2 + k[1] ** 2 + k[2] ** 2)),
                              s=(n, n, n))
    assert torch.allclose(-div, smooth, atol=1e-5)  # to the Nyquist planes' share (exp(-pi^2 / 2) of it)


def _displacement_body(rank: int, world: int, split: tuple[int, int, int]) -> None:
    import torch

    import hybridpar as hp
    from cosmoflow.displacement import Displacement

    from layer_cases import Failures

    fails = Failures()
    grid = hp.ProcessGrid(spatial=split)
    g = torch.Generator().manual_seed(3)
    # contrasted counts, so that ψ reaches about a voxel and the shifts are clamped at reach 1
    x = torch.log1p(torch.rand(2, 2, 9, 8, 7, dtype=torch.float64, generator=g) ** 6 * 50)
    weights = torch.randn(2, 6, 9, 8, 7, dtype=torch.float64, generator=g)
    for smoothing, reach in ((1.5, 0), (0.5, 1), (0.5, 2)):
        case = f"displacement smoothing {smoothing} reach {reach} split {split}"
        layer = Displacement(smoothing, reach)
        ours = hp.pipeline.convert.to_distributed(layer, grid)
        whole = x.clone().requires_grad_()
        want = layer(whole)
        (want * weights[:, :want.shape[1]]).sum().backward()
        mine = hp.scatter(x, grid).requires_grad_()
        got = ours(mine)
        (got * hp.scatter(weights[:, :want.shape[1]], grid)).sum().backward()
        fails.check(f"{case}: forward", hp.gather(got.detach(), grid), want.detach(), 1e-10)
        fails.check(f"{case}: input gradient", hp.gather(mine.grad, grid), whole.grad, 1e-10)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,split", [(2, (2, 1, 1)), (3, (3, 1, 1)), (4, (2, 2, 1))],
                         ids=["2", "3", "2x2"])
def test_displacement_split_equals_whole(pools, world, split):
    """The displacement channels of a split volume (hp.fft), and the field moved back along them (a
    periodic halo of the reach), are those of the whole, forward and backward, float64 to 1e-10."""
    pools(world).run(_displacement_body, split, timeout=120)


def test_the_shifted_channel_reads_the_field_where_the_displacement_points():
    """Reach > 0 appends channel 0 read at q + ψ(q): periodic trilinear interpolation, the shift
    clamped to [-reach, reach - 1], checked against a direct evaluation; a reach wider than the
    volume is refused in one line."""
    import torch

    from cosmoflow.displacement import Displacement

    g = torch.Generator().manual_seed(5)
    x = torch.log1p(torch.rand(2, 1, 10, 11, 9, dtype=torch.float64, generator=g) ** 6 * 50)
    reach = 1
    out = Displacement(0.5, reach)(x)
    psi = out[:, 1:4].clamp(-reach, reach - 1)
    assert (out[:, 1:4] > reach - 1).any(), "the case must clamp"
    shape = x.shape[2:]
    lattice = torch.stack(torch.meshgrid(*[torch.arange(e, dtype=torch.float64) for e in shape],
                                         indexing="ij"))
    for b in range(2):
        at = lattice + psi[b]
        lo = torch.floor(at)
        frac, lo = at - lo, lo.long()
        want = 0
        for dz in (0, 1):
            for dy in (0, 1):
                for dx in (0, 1):
                    w = (frac[0] if dz else 1 - frac[0]) * (frac[1] if dy else 1 - frac[1]) \
                        * (frac[2] if dx else 1 - frac[2])
                    want = want + w * x[b, 0][(lo[0] + dz) % shape[0], (lo[1] + dy) % shape[1],
                                              (lo[2] + dx) % shape[2]]
        assert torch.allclose(out[b, 4], want, atol=1e-12)
    with pytest.raises(ValueError, match="reach 12 is wider than the volume"):
        Displacement(0.5, 12)(x)


def test_displacement_and_power_spectrum_options_build_their_models():
    """``unet.displacement`` feeds the U-Net three more channels through a registered layer that plans
    split; ``model.power_spectrum`` gives CosmoFlow's head the P(k) features beside its own."""
    import hybridpar as hp
    from cosmoflow.displacement import WithDisplacement
    from cosmoflow.model import build_model
    from cosmoflow.reconstruct import build_unet

    cfg = load_config(ROOT / "launch/configs/reconstruct.yaml",
                      ["data.channels=1", "unet.displacement=true", "data.sample_size=16", "unet.levels=3"])
    model = build_unet(cfg, 1)
    assert isinstance(model, WithDisplacement) and model.net.encoder[0][0].in_channels == 4
    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 2, 1]}}).plan(model, (2, 1, 16, 16, 16), 4)
    assert plan[0].name == "displacement" and plan[0].split == (2, 2, 1) and plan[0].transpose_bytes > 0
    regressor = build_model(32, 4, 2, 4, 8, dense=[8], dropout=0.0, global_pool=True, power_spectrum=True)
    assert regressor.head[0].in_features == 8 + 4 * 9  # 8 pooled features; per channel 7 shells of 2 k_f
    # inside the Nyquist sphere and 2 beyond it (to the faces' diagonals and the corners)
    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(regressor, (2, 4, 32, 32, 32), 2)
    assert {r.name: r.out_split for r in plan}["spectrum"] == (1, 1, 1)
