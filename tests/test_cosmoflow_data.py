"""The three on-disk formats, read whole and by region, checked against numpy slicing of the raw arrays.

* Raw universes are cut as MLPerf's prepare step cuts them (``np.split`` over axes 0, 1, 2, in that
  nesting), so sample (i·n + j)·n + k is sub-cube (i, j, k).
* MLPerf split files and our packed file (made by ``python -m cosmoflow.pack``) give the very same
  samples and labels; ``x`` is ``log1p`` of the counts, float32, channels first.
* A region read equals the same slice of the whole read, and only the hyperslab leaves the file
  (``bytes_read``); with chunks aligned to the shards, exactly one shard's chunks are touched.
* The dataset survives pickling and forking with files already open.
* Each bad input is a one-line error naming the file, the dataset and what would fit.
"""

from __future__ import annotations

import multiprocessing
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from cosmoflow import pack as packing
from cosmoflow.data import open_dataset

U, S = 32, 16  # universe side, sample side: 8 sub-cubes per universe


def _mlperf_split(full: np.ndarray, size: int) -> list[np.ndarray]:
    """MLPerf HPC's prepare.py, verbatim in structure: nested np.split over axes 0, 1, 2."""
    n = full.shape[0] // size
    return [xijk for xi in np.split(full, n, axis=0) for xij in np.split(xi, n, axis=1)
            for xijk in np.split(xij, n, axis=2)]


def _expected(counts: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.log1p(counts.astype(np.float32)).transpose(3, 0, 1, 2).copy())


@pytest.fixture(scope="module")
def universes(tmp_path_factory) -> tuple[Path, list[np.ndarray], list[np.ndarray]]:
    """Two raw universe files with random counts (distinct values make slicing errors visible)."""
    root = tmp_path_factory.mktemp("universes")
    rng = np.random.default_rng(0)
    fulls, pars = [], []
    for u in range(2):
        full = rng.integers(0, 300, size=(U, U, U, 4), dtype=np.int16)
        par = rng.uniform(-1, 1, 4).astype(np.float32)
        with h5py.File(root / f"univ_{u}.h5", "w") as f:
            f["full"], f["unitPar"] = full, par
        fulls.append(full)
        pars.append(par)
    return root, fulls, pars


@pytest.fixture(scope="module")
def split_dir(universes, tmp_path_factory) -> Path:
    root, fulls, pars = universes
    out = tmp_path_factory.mktemp("split")
    n = 0
    for full, par in zip(fulls, pars, strict=True):
        for cube in _mlperf_split(full, S):
            with h5py.File(out / f"sample_{n:03d}.h5", "w") as f:
                f["x"], f["y"] = cube, par
            n += 1
    return out


@pytest.fixture(scope="module")
def packed(universes, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("packed") / "train.h5"
    assert packing.main(["--src", str(universes[0]), "--out", str(out), "--sample-size", str(S)]) == 0
    return out


def test_universe_subcube_numbering(universes) -> None:
    root, fulls, pars = universes
    ds = open_dataset(root, sample_size=S)
    assert len(ds) == 16 and ds.sample_shape == (4, S, S, S) and ds.sample_nbytes == 4 * S ** 3 * 2
    cubes = [c for full in fulls for c in _mlperf_split(full, S)]
    for idx, cube in enumerate(cubes):
        x, y = ds.read(idx)
        assert x.dtype == torch.float32 and x.shape == (4, S, S, S) and x.is_contiguous()
        torch.testing.assert_close(x, _expected(cube), rtol=0, atol=0)
        np.testing.assert_array_equal(y.numpy(), pars[idx // 8])
    n = 2  # sub-cube (i, j, k) = (1, 0, 1) of the second universe: index 8 + (1*n + 0)*n + 1
    torch.testing.assert_close(ds.read(8 + (1 * n + 0) * n + 1)[0], _expected(fulls[1][S:, :S, S:]))
    whole = open_dataset(root / "univ_0.h5")  # sample_size None: a whole universe is one sample
    assert len(whole) == 1 and whole.sample_shape == (4, U, U, U)


def test_all_formats_agree(universes, split_dir, packed) -> None:
    raw = open_dataset(universes[0], sample_size=S)
    split = open_dataset(split_dir)
    pk = open_dataset(packed, sample_size=S)
    assert {e.format for e in raw.entries} == {"universe"}
    assert {e.format for e in split.entries} == {"split"}
    assert [e.format for e in pk.entries] == ["packed"]
    assert len(raw) == len(split) == len(pk) == 16
    for i in range(len(raw)):
        xr, yr = raw.read(i)
        for other in (split, pk):
            xo, yo = other.read(i)
            torch.testing.assert_close(xo, xr, rtol=0, atol=0)
            torch.testing.assert_close(yo, yr, rtol=0, atol=0)
    with h5py.File(packed, "r") as f:
        assert f["x"].chunks == (1, S // 2, S // 2, S, 4) and f["y"].dtype == np.float32


REGIONS = [
    (slice(0, 8), slice(0, 8), slice(0, 16)),  # one shard of a 2x2x1 split
    (slice(8, 16), slice(0, 16), slice(0, 16)),  # one shard of a 2x1x1 split
    (slice(3, 11), slice(5, 6), slice(None, 7)),  # arbitrary, unaligned
    (slice(0, 16), slice(0, 16), slice(0, 16)),
]


@pytest.mark.parametrize("fmt", ["universe", "split", "packed"])
def test_region_reads_equal_slices(fmt, universes, split_dir, packed) -> None:
    src = {"universe": universes[0], "split": split_dir, "packed": packed}[fmt]
    ds = open_dataset(src, sample_size=S)
    for i in (0, 5, 15):
        full, y = ds.read(i)
        for region in REGIONS:
            ds.reset_counters()
            part, yp = ds.read(i, region)
            torch.testing.assert_close(part, full[(slice(None), *region)], rtol=0, atol=0)
            torch.testing.assert_close(yp, y)
            assert ds.bytes_read == part.numel() * 2  # only the hyperslab left the file


def test_aligned_shard_reads_touch_only_their_chunks(packed) -> None:
    ds = open_dataset(packed)
    for d in range(2):
        for h in range(2):
            ds.reset_counters()
            ds.read(3, (slice(d * 8, d * 8 + 8), slice(h * 8, h * 8 + 8), slice(0, S)))
            assert ds.chunk_bytes_read == ds.bytes_read == ds.sample_nbytes // 4
    ds.reset_counters()
    ds.read(3, (slice(4, 12), slice(0, 8), slice(0, S)))  # straddles two chunks along d
    assert ds.chunk_bytes_read == ds.sample_nbytes // 2


def test_paths_glob_list_and_pack_range(universes, split_dir, packed, tmp_path) -> None:
    root = universes[0]
    files = sorted(str(p) for p in root.iterdir())
    by_glob = open_dataset(str(root / "univ_*.h5"), sample_size=S)
    mixed = open_dataset([files[1], split_dir, packed], sample_size=S)
    assert len(by_glob) == 16 and len(mixed) == 8 + 16 + 16
    torch.testing.assert_close(mixed.read(0)[0], by_glob.read(8)[0])
    torch.testing.assert_close(mixed.read(8 + 3)[0], by_glob.read(3)[0])
    part = packing.pack(root, tmp_path / "val.h5", S, (1, 1, 2), select="8:16", progress=False)
    val = open_dataset(part)
    assert len(val) == 8 and val.labels.shape == (8, 4)
    torch.testing.assert_close(val.read(2)[0], by_glob.read(10)[0])
    np.testing.assert_array_equal(val.labels, by_glob.labels[8:])


def _sum_sample(args: tuple) -> float:
    ds, i = args  # numpy's sum: torch ops in a forked child can hang on the parent's OpenMP pool
    return float(ds.read(i, (slice(0, 8), slice(0, 16), slice(0, 16)))[0].numpy().sum(dtype=np.float64))


_INHERITED: list = []  # a dataset a forked child inherits, with the parent's file handles open


def _sum_inherited(i: int) -> float:
    return _sum_sample((_INHERITED[0], i))


def test_pickle_and_fork_with_open_files(packed) -> None:
    ds = open_dataset(packed)
    expected = [_sum_sample((ds, i)) for i in range(4)]  # opens the file in this process
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.bytes_read == 0
    assert _sum_sample((clone, 2)) == expected[2]
    _INHERITED[:] = [ds]
    try:
        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map_async(_sum_inherited, range(4)).get(timeout=60) == expected
            assert pool.map_async(_sum_sample, [(ds, i) for i in range(4)]).get(timeout=60) == expected
    finally:
        _INHERITED.clear()
    assert ds.bytes_read == 4 * ds.sample_nbytes // 2  # the children's reads are theirs
    ds.close()
    assert _sum_sample((ds, 1)) == expected[1]  # reopens after close


def _write(path: Path, **datasets: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f[name] = data
    return path


def test_errors(universes, packed, tmp_path) -> None:
    i16 = np.int16
    cube = np.zeros((S, S, S, 4), i16)
    par = np.zeros(4, np.float32)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="empty: no HDF5 files"):
        open_dataset(empty)
    with pytest.raises(FileNotFoundError, match="nowhere.h5: no such file"):
        open_dataset(tmp_path / "nowhere.h5")
    with pytest.raises(FileNotFoundError, match="matches no files"):
        open_dataset(str(tmp_path / "none_*.h5"))
    (tmp_path / "text.h5").write_text("not hdf5")
    cases = {
        "text.h5": "not a readable HDF5 file",
        _write(tmp_path / "nopar.h5", full=np.zeros((U, U, U, 4), i16)).name: "without dataset 'unitPar'",
        _write(tmp_path / "noy.h5", x=cube).name: "dataset 'x' without dataset 'y'",
        _write(tmp_path / "other.h5", data=cube).name: r"no dataset 'full' or 'x' \(found: data\)",
        _write(tmp_path / "float.h5", full=np.zeros((U, U, U, 4), np.float32), unitPar=par).name:
            "dataset 'full' has dtype float32; expected int16",
        _write(tmp_path / "notcube.h5", full=np.zeros((U, U, 16, 4), i16), unitPar=par).name:
            r"'full' has shape \(32, 32, 16, 4\); expected \(U, U, U, C >= 4\)",
        _write(tmp_path / "chan.h5", x=np.zeros((S, S, S, 3), i16), y=par).name:
            r"'x' has shape \(16, 16, 16, 3\); expected \(S, S, S, C >= 4\)",
        _write(tmp_path / "badpar.h5", full=np.zeros((U, U, U, 4), i16), unitPar=np.zeros(3)).name:
            r"'unitPar' has shape \(3,\); expected \(4,\)",
        _write(tmp_path / "bady.h5", x=np.zeros((3, S, S, S, 4), i16), y=np.zeros((2, 4))).name:
            r"'y' has shape \(2, 4\); expected \(3, 4\)",
    }
    for name, message in cases.items():
        with pytest.raises(ValueError, match=message) as err:
            open_dataset(tmp_path / name, sample_size=S)
        assert name in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"univ_0.h5: sample_size 12 does not divide the universe size 32; "
                                         r"sample sizes that fit: 1, 2, 4, 8, 16, 32"):
        open_dataset(universes[0], sample_size=12)
    with pytest.raises(ValueError, match="train.h5: holds samples of size 16, not the sample_size 8; use "
                                         "sample_size=16"):
        open_dataset(packed, sample_size=8)
    with pytest.raises(ValueError, match="not the size 32 of the first file"):
        open_dataset([universes[0] / "univ_0.h5", packed])
    ds = open_dataset(packed)
    with pytest.raises(IndexError, match="sample 16 out of range for a dataset of 16"):
        ds.read(16)
    for region in [(slice(0, 8),) * 2, (slice(0, 8, 2),) * 3, (slice(0, 17),) * 3, (slice(5, 5),) * 3,
                   (slice(-4, None),) * 3]:
        with pytest.raises(ValueError, match="0 <= start < stop <= 16|3 slices along D, H, W"):
            ds.read(0, region)
    with pytest.raises(ValueError, match="does not split into 3 shards along d; splits that fit: 1, 2, 4"):
        packing.pack(universes[0], tmp_path / "p.h5", S, (3, 1, 1), progress=False)
    with pytest.raises(ValueError, match="range must be start:stop with 0 <= start < stop <= 16"):
        packing.pack(universes[0], tmp_path / "p.h5", S, select="4:40", progress=False)
    assert not any(p.name.startswith("p.h5") for p in tmp_path.iterdir())


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_on_device_finishes_the_stored_form(universes, workers) -> None:
    """``VolumeLoader(device=...)`` reads the int16 counts (``read_stored``) and finishes them with
    ``finish``: equal to the host's ``read`` to one float32 rounding of log1p (numpy's against torch's),
    on a spatial shard too; targets bitwise; with ``augment`` the host path is taken, bitwise."""
    from hybridpar.data import Augment, Placement, VolumeLoader

    ds = open_dataset(universes[0], sample_size=S)
    place = Placement(1, 0, (2, 1, 2), (1, 0, 0))
    host = VolumeLoader(ds, place, batch_size=3, workers=0, shuffle=False)
    dev = VolumeLoader(ds, place, batch_size=3, workers=workers, shuffle=False, device="cpu")
    assert dev.stored
    with host, dev:
        pairs = list(zip(host, dev))
    assert len(pairs) == len(host) == 5
    for (x0, y0), (x1, y1) in pairs:
        assert x1.shape == x0.shape == (3, 4, S // 2, S, S // 2)
        torch.testing.assert_close(x1, x0, rtol=2.5e-7, atol=0)
        assert torch.equal(y1, y0)
    aug = VolumeLoader(ds, place, batch_size=3, workers=0, shuffle=False, device="cpu", augment=Augment())
    plain = VolumeLoader(ds, place, batch_size=3, workers=0, shuffle=False, augment=Augment())
    assert not aug.stored
    (xa, ya), (xp, yp) = next(iter(aug)), next(iter(plain))
    assert torch.equal(xa, xp) and torch.equal(ya, yp)


@pytest.mark.cuda
def test_loader_on_cuda_finishes_on_the_gpu(universes) -> None:
    """The same on a GPU: batches arrive on it (copied on the loader's side stream, ordered before the
    consuming stream's work by an event), finished there, equal to the host's read to float32 rounding."""
    from hybridpar.data import VolumeLoader

    ds = open_dataset(universes[0], sample_size=S)
    host = VolumeLoader(ds, None, batch_size=2, workers=0, shuffle=False)
    dev = VolumeLoader(ds, None, batch_size=2, workers=2, shuffle=False, device="cuda")
    with host, dev:
        for (x0, y0), (x1, y1) in zip(host, dev):
            assert x1.is_cuda and y1.is_cuda and x1.is_contiguous(memory_format=torch.channels_last_3d)
            x1 = x1 * 1.0  # device work on the consuming stream, after the event
            torch.testing.assert_close(x1.cpu(), x0, rtol=5e-7, atol=0)
            assert torch.equal(y1.cpu(), y0)
