"""``python -m cosmoflow.infer`` end to end on a tiny reconstruct run (a periodic U-Net, circular
padding): the box written split by 2 ranks, read back as one dataset, equals the run's model on the
whole box in one process (float64, to 1e-5 of the output's scale: the ranks compute in float32), in
the per-rank-file mode (forced), in the default mode (under torchrun: the same files), and under
mpiexec with h5py's MPI driver where h5py has one (skipped here otherwise), along D and along H, one
box and two; r(k) and T(k) of ``--truth`` equal
:func:`cosmoflow.correlation.cross_power`'s in one process; a box too thin for the split at the
U-Net's deepest level runs that level replicated, still exact; each bad input is its one line, exit 2,
printed once, with nothing written under the output's name."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from cosmoflow.correlation import correlation, cross_power, shell_edges
from cosmoflow.data import log_counts
from cosmoflow.generate import generate
from cosmoflow.infer import run_config, split_path
from cosmoflow.reconstruct import build_unet
from perf.ranks import free_port, mpiexec

from distributed import ROOT
from forked import run_python

SETTINGS = ["task=reconstruct", "data.sample_size=8", "data.channels=1", "unet.width=4", "unet.levels=3",
            "unet.max_width=8", "unet.groups=2", "checkpoint.best_metric=val_loss"]

MAKE_RUN = """
import sys, yaml, torch
from pathlib import Path
import hybridpar as hp
from cosmoflow.config import load_config
from cosmoflow.reconstruct import build_unet
from hybridpar.checkpoint import Checkpointer
run = Path(sys.argv[1])
hp.init_distributed()
cfg = load_config(None, sys.argv[2:] + [f"run_dir={run}"])
run.mkdir(parents=True)
(run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
torch.manual_seed(0)
model = build_unet(cfg, 1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))  # GroupNorm's affine too: no weight left at its default
with Checkpointer(run / "checkpoints", None) as ck:
    ck.save(5, {"model": model.state_dict(), "step": 5})
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDPAR_HDF5_WRITER"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A run directory (config and one checkpoint, step 5), a 16³ universe and a packed file of two
    boxes (the universe and a roll of it) with a thin 4x16x16 and an odd 6x16x16 box beside them."""
    d = tmp_path_factory.mktemp("infer")
    script = d / "make_run.py"
    script.write_text(MAKE_RUN)
    res = run_python([str(script), str(d / "run"), *SETTINGS], env=_env(), timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    universe = generate(d / "data", universes=1, size=16, seed=1, progress=False)[0]
    with h5py.File(universe) as f:
        full, linear = f["full"][...], f["linear"][...]
    with h5py.File(d / "boxes.h5", "w") as f:
        f["x"] = np.stack([full, np.roll(full, 5, axis=1)])
        f["thin"] = full[:4]
        f["odd"] = full[:6]
        f["linear"] = linear
    return d, universe


def _reference(run: Path, counts: np.ndarray) -> np.ndarray:
    """The run's model on the whole box (N, D, H, W, C counts) in one process, float64."""
    cfg = run_config(run)
    model = build_unet(cfg, 1).double().eval()
    weights = run / "weights.pt"
    if not weights.exists():
        res = run_python(["-m", "hybridpar.checkpoint", "export", str(run), str(weights)], env=_env())
        assert res.returncode == 0, res.stderr[-3000:]
    model.load_state_dict(torch.load(weights, weights_only=True))
    x = np.stack([log_counts(c[..., :1]) for c in counts])
    with torch.no_grad():
        return model(torch.from_numpy(x).double()).numpy()


def _infer(run: Path, *args: str, ranks: int | None = 2, **env: str):
    return run_python(["-m", "cosmoflow.infer", str(run), *args], env=_env(**env), ranks=ranks, timeout=180)


def test_files_mode_round_trip_and_truth(made):
    """2 ranks split (2, 1, 1), one rank file each and rank 0's virtual dataset; r(k) and T(k) printed."""
    d, universe = made
    out = d / "one.h5"
    res = _infer(d / "run", "--input", str(universe), "--output", f"{out}:field", "--truth", str(universe),
                 HYBRIDPAR_HDF5_WRITER="files")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stdout.count("box 1/1:") == 1, res.stdout  # the progress line, once per job
    with h5py.File(universe) as f:
        counts, linear = f["full"][...][None], f["linear"][...]
    want = _reference(d / "run", counts)
    with h5py.File(out) as f:  # a reader sees one dataset, the ranks' files mapped into it
        ds = f["field"]
        assert ds.is_virtual and sorted(s.file_name for s in ds.virtual_sources()) == \
            ["one.rank0000.h5", "one.rank0001.h5"]
        got = ds[...]
    assert got.shape == (1, 1, 16, 16, 16)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale, np.abs(got - want).max()
    assert not list(d.glob(".*.tmp")), "a temporary file was left behind"
    sums = cross_power(want[0, 0], linear, shell_edges(16))
    for name, expected in (("r(k)", correlation(sums)), ("T(k)", np.sqrt(sums[1] / sums[2]))):
        line = re.search(rf"box 0: {re.escape(name)}\s+(.*)", res.stdout)
        assert line is not None, res.stdout
        printed = np.array([float(v) for v in line.group(1).split()])
        np.testing.assert_allclose(printed, expected, rtol=2e-3, atol=2e-3, err_msg=name)


def test_default_mode_two_boxes_split_along_h(made):
    """Two boxes of a packed (N, D, H, W, C) dataset, split (1, 2, 1), the writer h5py offers
    (MPI driver or rank files), over an existing output with --overwrite; read from another folder."""
    d, _ = made
    out = d / "two.h5"
    out.write_bytes(b"an older output")
    res = _infer(d / "run", "--input", f"{d / 'boxes.h5'}:x", "--output", str(out), "--grid", "1,2,1",
                 "--overwrite", "--step", "5")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert res.stdout.count("box 1/2:") == 1 and res.stdout.count("box 2/2:") == 1, res.stdout
    with h5py.File(d / "boxes.h5") as f:
        want = _reference(d / "run", f["x"][...])
    moved = shutil.copytree(d, d.parent / "moved", ignore=shutil.ignore_patterns("data", "run"))
    with h5py.File(moved / "two.h5") as f:
        got = f["prediction"][...]
    assert got.shape == (2, 1, 16, 16, 16)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


@pytest.mark.skipif(not h5py.get_config().mpi or mpiexec() is None,
                    reason="the MPI driver mode needs h5py built with MPI and an mpiexec")
def test_mpi_driver_mode(made):
    """Under mpiexec with h5py's MPI driver (forced): one file, no virtual dataset, the same numbers."""
    d, universe = made
    out = d / "mpi.h5"
    env = {**_env(HYBRIDPAR_HDF5_WRITER="mpi", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    res = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-m", "cosmoflow.infer", str(d / "run"),
                          "--input", str(universe), "--output", str(out)], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    with h5py.File(universe) as f:
        want = _reference(d / "run", f["full"][...][None])
    with h5py.File(out) as f:
        assert not f["prediction"].is_virtual
        got = f["prediction"][...]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert not list(d.glob("mpi.rank*.h5"))


def _one_line(res, pattern: str) -> None:
    """Exit 2 and exactly one error line, matching ``pattern``."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert res.returncode == 2, res.stderr[-3000:]
    assert len(lines) == 1 and re.search(pattern, lines[0]), res.stderr[-3000:]


def test_bad_inputs_are_one_line(made, tmp_path):
    """Each bad input: its line, exit 2, and no file under the output's name."""
    d, universe = made
    out = tmp_path / "out.h5"
    cases = {
        "a missing input file": ((str(d / "nope.h5"),), r"input .*nope\.h5 does not exist"),
        "a missing dataset": ((f"{universe}:counts",), r"has no dataset 'counts' \(datasets: full, linear"),
        "a dataset that is not counts": ((f"{d / 'boxes.h5'}:linear",), r"expected 4 or 5 dimensions"),
    }
    for what, (inp, pattern) in cases.items():
        res = _infer(d / "run", "--input", *inp, "--output", str(out), ranks=None)
        _one_line(res, pattern)
        assert not out.exists(), what
    other = tmp_path / "other"  # the same checkpoint, a config of a wider U-Net
    shutil.copytree(d / "run", other)
    cfg = yaml.safe_load((other / "config.yaml").read_text())
    cfg["unet"]["width"] = 8
    (other / "config.yaml").write_text(yaml.safe_dump(cfg))
    res = _infer(other, "--input", str(universe), "--output", str(out), ranks=None)
    _one_line(res, r"holds another model than the run's config builds: \d+ shape mismatches \(encoder")
    out.write_bytes(b"keep me")
    res = _infer(d / "run", "--input", str(universe), "--output", str(out), ranks=None)
    _one_line(res, r"output .*out\.h5 exists; pass --overwrite to replace it")
    assert out.read_bytes() == b"keep me"


def test_a_thin_box_runs_its_deep_levels_replicated(made, tmp_path):
    """On 2 ranks: a 4x16x16 box split along D leaves the U-Net's deepest level 1 voxel deep, too thin
    to split: the planner replicates that level (the banner and layout say so) and the output is still
    the one-process output."""
    d, _ = made
    out = tmp_path / "thin.h5"
    res = _infer(d / "run", "--input", f"{d / 'boxes.h5'}:thin", "--output", str(out))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    with h5py.File(d / "boxes.h5") as f:
        want = _reference(d / "run", f["thin"][...][None])
    with h5py.File(out) as f:
        got = f["prediction"][...]
    assert got.shape == want.shape == (1, 1, 4, 16, 16)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


def test_a_box_the_model_cannot_take(made, tmp_path):
    """A 6x16x16 box cannot pass the U-Net's two poolings: one line naming the extent, once for the
    job, exit 2 on the rank that met it first, nothing written. A rank still on its way to the same
    error when the first one leaves may be stopped by the launcher (SIGTERM, as torchrun does)."""
    d, _ = made
    out = tmp_path / "odd.h5"
    res = _infer(d / "run", "--input", f"{d / 'boxes.h5'}:odd", "--output", str(out))
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert len(lines) == 1 and re.search(r"\b6\b", lines[0]), res.stderr[-3000:]
    assert 2 in res.codes and all(c in (2, -signal.SIGTERM) for c in res.codes), res.codes
    assert not out.exists()


def test_split_path():
    assert split_path("a/b.h5:grp/x", "full") == (Path("a/b.h5"), "grp/x")
    assert split_path("a/b.h5", "full") == (Path("a/b.h5"), "full")
    assert split_path("c:/dir/b.h5", "full") == (Path("c:/dir/b.h5"), "full")


def test_virtual_dataset_tiling_is_checked():
    """Rank 0 refuses to map an output whose ranks' boxes overlap or leave voxels unwritten."""
    from hybridpar.data.split_hdf5 import _check_tiling

    halves = [((0, 4), (0, 8), (0, 8)), ((4, 8), (0, 8), (0, 8))]
    _check_tiling(halves, (8, 8, 8), "out.h5")
    with pytest.raises(ValueError, match="overlapping boxes"):
        _check_tiling([halves[0], ((3, 8), (0, 8), (0, 8))], (8, 8, 8), "out.h5")
    with pytest.raises(ValueError, match="wrote 256 of the 512 voxels"):
        _check_tiling(halves[:1], (8, 8, 8), "out.h5")
