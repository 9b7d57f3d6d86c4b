"""Data checked at the door: a damaged universe is caught by ``python -m cosmoflow.check`` and by the
loader, naming the file and the sample, whether HDF5's Fletcher-32 checksum catches it (files from
``cosmoflow.generate`` and ``cosmoflow.pack``) or the value checks do (a file without checksums);
``skip_bad`` reads the next good sample instead, the same one on every spatial rank, and reports it."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from cosmoflow import check
from cosmoflow.data import open_dataset
from cosmoflow.generate import generate
from cosmoflow.pack import pack
from cosmoflow.validate import DataError
from hybridpar.data import VolumeLoader, WorkerError

S = 16


def _flip_chunk(path: Path, name: str, chunk: int) -> None:
    """Overwrite bytes inside one stored chunk of dataset ``name`` (as a bad disk block would)."""
    with h5py.File(path, "r") as f:
        info = f[name].id.get_chunk_info(chunk)
    data = bytearray(path.read_bytes())
    for o in range(info.byte_offset + 64, info.byte_offset + 96):
        data[o] ^= 0x5A
    path.write_bytes(bytes(data))


def _plain_universe(path: Path, seed: int, negative_at: tuple[int, ...] | None = None,
                    label: float = 0.5) -> None:
    """A raw universe without checksums (as the real ExaLearn files are), optionally with one bad count."""
    full = np.random.default_rng(seed).integers(0, 5, size=(S, S, S, 4), dtype=np.int16)
    if negative_at is not None:
        full[negative_at] = -300
    with h5py.File(path, "w") as f:
        f.create_dataset("full", data=full)
        f.create_dataset("unitPar", data=np.array([label, 0.1, -0.2, 0.3], dtype=np.float32))


@pytest.fixture(scope="module")
def universes(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("universes")
    generate(d, universes=3, size=S, seed=4, progress=False)
    return d


def test_generate_and_pack_write_checksums(universes, tmp_path):
    with h5py.File(next(universes.iterdir()), "r") as f:
        assert f["full"].fletcher32 and f["linear"].fletcher32 and f["unitPar"].fletcher32
    out = pack(universes, tmp_path / "packed.h5", sample_size=8, split=(2, 1, 1), progress=False)
    with h5py.File(out, "r") as f:
        assert f["x"].fletcher32 and f["y"].fletcher32
    _flip_chunk(out, "x", 5)  # chunk 5: sample 2, second half along d
    ds = open_dataset(out)
    with pytest.raises(DataError, match=r"packed\.h5: sample 2, region d 4:8.*checksum mismatch"):
        ds.read(2, (slice(4, 8), slice(0, 8), slice(0, 8)))
    ds.read(2, (slice(0, 4), slice(0, 8), slice(0, 8)))  # the other half is intact


def test_check_and_loader_name_the_damaged_file_and_sample(universes, tmp_path, capsys):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for p in universes.iterdir():
        (damaged / p.name).write_bytes(p.read_bytes())
    bad = sorted(damaged.iterdir())[1]
    _flip_chunk(bad, "full", 0)  # a universe of 16³ is one chunk: all 8 of its samples are bad
    assert check.main([str(damaged), "--sample-size", "8"]) == 1
    out = capsys.readouterr()
    lines = out.out.strip().splitlines()
    assert len(lines) == 8 and all(line.startswith(f"{bad}: sample ") for line in lines), out.out
    assert lines[0].startswith(f"{bad}: sample 0 (sub-cube (0, 0, 0)): checksum mismatch"), lines[0]
    assert "checked 24 samples in 3 files: 8 bad" in out.err
    assert check.main([str(universes)]) == 0

    ds = open_dataset(damaged, sample_size=8)
    with pytest.raises(DataError, match=rf"{bad}: sample 0 \(sub-cube \(0, 0, 0\)\), region d 0:8, h 0:8, "
                                        r"w 0:8: checksum mismatch.*data.skip_bad"):
        ds.read(8)
    loader = VolumeLoader(ds, None, batch_size=4, shuffle=False, workers=1)
    with pytest.raises(WorkerError) as caught:  # through a worker process: the original error comes along
        list(loader)
    loader.close()
    assert isinstance(caught.value.original, DataError) and str(bad) in str(caught.value.original)


def test_value_checks_without_checksums(tmp_path):
    _plain_universe(tmp_path / "a.h5", 0)
    _plain_universe(tmp_path / "b.h5", 1, negative_at=(12, 3, 9, 2))
    ds = open_dataset(tmp_path, sample_size=8)
    ds.read(9, (slice(0, 8), slice(0, 8), slice(0, 4)))  # the bad voxel lies in the other half along w
    with pytest.raises(DataError, match=r"b\.h5: sample 5 \(sub-cube \(1, 0, 1\)\), region d 8:16, h 0:8, "
                                        r"w 8:16: 1 particle counts out of range \[0, 16384\] \(first: -300, "
                                        r"negative, at voxel \(4, 3, 1\) channel 2"):
        ds.read(13)
    _plain_universe(tmp_path / "c.h5", 2, label=float("nan"))
    with pytest.raises(DataError, match=r"c\.h5: sample 0: parameters .* are not all finite"):
        open_dataset(tmp_path / "c.h5")
    _plain_universe(tmp_path / "c.h5", 2, label=3.0)
    with pytest.raises(DataError, match=r"outside \[-1, 1\]"):
        open_dataset(tmp_path / "c.h5")


def test_skip_bad_reads_the_next_good_sample_on_every_rank(tmp_path):
    """Two spatial ranks read different halves of a bad sample (the bad voxel in one half only): both
    read the same substitute, with its own label, and both report the skipped sample once."""
    _plain_universe(tmp_path / "a.h5", 0, negative_at=(1, 1, 1, 0))
    _plain_universe(tmp_path / "b.h5", 1, label=-0.5)
    whole = open_dataset(tmp_path)  # two samples of 16³: a.h5 is bad, b.h5 good
    halves = [(slice(0, 8), slice(0, S), slice(0, S)), (slice(8, S), slice(0, S), slice(0, S))]
    for region in halves:
        ds = open_dataset(tmp_path, skip_bad=True)
        x, y = ds.read(0, region)
        ref_x, ref_y = whole.read(1, region)
        torch.testing.assert_close(x, ref_x)
        assert y[0].item() == -0.5 == ref_y[0].item()
        ds.read(0, region)
        skipped = ds.take_skipped()
        assert len(skipped) == 1 and "a.h5: sample 0: 1 particle counts" in skipped[0]
    loader = VolumeLoader(open_dataset(tmp_path, skip_bad=True), None, batch_size=2, shuffle=False, workers=1)
    (x, y), = list(loader)
    loader.close()
    assert y[:, 0].tolist() == [-0.5, -0.5] and len(loader.skipped) == 1
