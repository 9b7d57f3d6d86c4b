"""Data checked at the door: a damaged universe is caught by ``python -m cosmoflow.check`` and by the
loader, naming the file and the sample, whether HDF5's Fletcher-32 checksum catches it (files from
``cosmoflow.generate`` and ``cosmoflow.pack``) or the value checks do (a file without checksums);
``skip_bad`` reads the next good sample instead, the same one on every spatial rank, and reports it."""

from __future__ import annotations

import os
import re
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
from hybridpar.data.hdf5 import UntrustedFile, check_datasets

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


# Hostile and never-written files (issue 36): each is one line naming the file and the dataset, from
# python -m cosmoflow.check and from the loader, before anything outside the data folder is opened or
# more than the file holds is allocated.

def _zeros(path: Path, written: bool = True) -> Path:
    """A raw universe whose counts are all 0: written as zeros, or declared and never written."""
    with h5py.File(path, "w") as f:
        if written:
            f.create_dataset("full", data=np.zeros((S, S, S, 4), np.int16), chunks=(8, 8, 8, 4))
        else:
            f.create_dataset("full", shape=(S, S, S, 4), dtype=np.int16, chunks=(8, 8, 8, 4))
        f.create_dataset("unitPar", data=np.array([0.5, 0.1, -0.2, 0.3], dtype=np.float32))
    return path


def test_all_zero_universe_is_flagged(tmp_path, capsys):
    """Written as zeros: judged when read (the check, the loader in and out of a worker, skip_bad);
    declared and never written: refused when opened."""
    data = tmp_path / "data"
    data.mkdir()
    _plain_universe(data / "a.h5", 0)
    zero = _zeros(data / "z.h5")
    assert check.main([str(data)]) == 1
    out = capsys.readouterr()
    assert out.out.strip().splitlines() == [
        f"{zero}: sample 0: every particle count of the sample in dataset 'full' is 0: the dataset was never "
        "written (or written empty); expected the particle counts of a universe"]
    ds = open_dataset(data, sample_size=8)
    with pytest.raises(DataError, match=rf"{zero}: sample 3 \(sub-cube \(0, 1, 1\)\), region .*: every "
                                        r"particle count of the region read in dataset 'full' is 0"):
        ds.read(11)
    loader = VolumeLoader(ds, None, batch_size=16, shuffle=False, workers=1)
    with pytest.raises(WorkerError) as caught:  # a worker's failure reaches the trainer, naming the file
        list(loader)
    loader.close()
    assert isinstance(caught.value.original, DataError) and str(zero) in str(caught.value.original)
    skipping = open_dataset(data, skip_bad=True)
    skipping.read(1)
    assert skipping.take_skipped() == [out.out.strip()]
    never = _zeros(tmp_path / "never.h5", written=False)
    with pytest.raises(ValueError, match=rf"{never}: dataset 'full': declares \(16, 16, 16, 4\) int16 \(32.0 "
                                         r"KiB\) but stores 0 of its 8 chunks"):
        open_dataset(never)


def test_declared_size_is_checked_against_the_file(tmp_path, capsys):
    """A 2 KB file declaring 64 GiB (chunked or contiguous, nothing written) is refused before a read,
    and a file cut short (HDF5 finds that itself) too: one line each, no MemoryError."""
    big = (2048, 2048, 2048, 4)
    par = np.zeros(4, np.float32)
    with h5py.File(tmp_path / "chunked.h5", "w") as f:
        f.create_dataset("full", shape=big, dtype=np.int16, chunks=(16, 16, 16, 4))
        f.create_dataset("unitPar", data=par)
    with h5py.File(tmp_path / "contiguous.h5", "w") as f:
        f.create_dataset("full", shape=big, dtype=np.int16)
        f.create_dataset("unitPar", data=par)
    with h5py.File(tmp_path / "short.h5", "w") as f:
        f.create_dataset("unitPar", data=par)
        f.create_dataset("full", data=np.ones((S, S, S, 4), np.int16))
    short = tmp_path / "short.h5"
    short.write_bytes(short.read_bytes()[:-4096])
    assert check.main([str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == (f"{tmp_path / 'chunked.h5'}: dataset 'full': declares (2048, 2048, 2048, 4) int16 "
                        "(64.0 GiB) but stores 0 of its 2097152 chunks (the file is 2.0 KiB): never written, "
                        "or written in part; expected every chunk in the file")
    assert lines[1].startswith(f"{tmp_path / 'contiguous.h5'}: dataset 'full': declares (2048, 2048, 2048, "
                               "4) int16 (64.0 GiB) but the file (2.0 KiB) holds nothing of it"), lines[1]
    assert lines[2].startswith(f"{short}: not a readable HDF5 file (") and "truncated" in lines[2], lines[2]
    with pytest.raises(ValueError, match=r"chunked\.h5: dataset 'full': declares \(2048, 2048, 2048, 4\)"):
        open_dataset(tmp_path / "chunked.h5", sample_size=128)


def test_links_out_of_the_data_folder_are_refused(tmp_path, monkeypatch, capsys):
    """External links (direct, or behind a soft link), virtual datasets and external raw storage that
    reach a file outside the data folder are refused, naming the target; a link inside it is read."""
    outside, data = tmp_path / "outside", tmp_path / "data"
    outside.mkdir()
    data.mkdir()
    _plain_universe(outside / "secret.h5", 7)
    (outside / "raw.bin").write_bytes(np.ones((S, S, S, 4), np.int16).tobytes())
    _plain_universe(data / "sibling.h5", 8)
    par = np.zeros(4, np.float32)
    with h5py.File(data / "elink.h5", "w") as f:
        f["full"] = h5py.ExternalLink("../outside/secret.h5", "/full")
        f["unitPar"] = par
    with h5py.File(data / "soft.h5", "w") as f:
        f["g"] = h5py.ExternalLink(str(outside / "secret.h5"), "/")
        f["full"] = h5py.SoftLink("/g/full")
        f["unitPar"] = par
    layout = h5py.VirtualLayout(shape=(S, S, S, 4), dtype=np.int16)
    layout[:] = h5py.VirtualSource("../outside/secret.h5", "full", shape=(S, S, S, 4))
    with h5py.File(data / "virtual.h5", "w") as f:
        f.create_virtual_dataset("full", layout)
        f["unitPar"] = par
    monkeypatch.chdir(tmp_path)  # HDF5 finds relative external raw files from the working directory
    with h5py.File(data / "raw.h5", "w") as f:
        f.create_dataset("full", shape=(S, S, S, 4), dtype=np.int16,
                         external=[("outside/raw.bin", 0, S ** 3 * 8)])
        f["unitPar"] = par
    with h5py.File(data / "inside.h5", "w") as f:
        f["full"] = h5py.ExternalLink("sibling.h5", "/full")
        f["unitPar"] = par
    secret = outside / "secret.h5"
    expected = {
        "elink.h5": f"an external link to '../outside/secret.h5' ({secret}), outside the data folder {data}",
        "raw.h5": f"external raw storage in 'outside/raw.bin' ({outside / 'raw.bin'}), outside the data",
        "soft.h5": f"an external link to '{secret}', outside the data folder {data}",
        "virtual.h5": f"a virtual dataset drawing on '../outside/secret.h5' ({secret}), outside the data",
    }
    for name, message in expected.items():
        with pytest.raises(ValueError) as err:
            open_dataset(data / name)
        assert str(err.value).startswith(f"{data / name}: dataset 'full': {message}"), str(err.value)
    assert check.main([str(data)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 4 and all(any(n in line for n in expected) for line in lines), lines
    x, _ = open_dataset(data / "inside.h5").read(0)
    ref, _ = open_dataset(data / "sibling.h5").read(0)
    torch.testing.assert_close(x, ref)


def test_link_loops_fifos_and_unmapped_virtual_values_are_refused(tmp_path):
    """Links that never end, a link to something that is not a file, and a virtual dataset whose
    unmapped values would read as fill values: each one line, found by the walk alone."""
    with h5py.File(tmp_path / "loop.h5", "w") as f:
        f["full"] = h5py.SoftLink("/a")
        f["a"] = h5py.SoftLink("/full")
        f["x"] = h5py.ExternalLink("loop.h5", "/x")
        f["src"] = np.ones((2, 4), np.int16)
        layout = h5py.VirtualLayout(shape=(4, 4), dtype=np.int16)
        layout[:2] = h5py.VirtualSource(".", "src", shape=(2, 4))
        f.create_virtual_dataset("y", layout)
        f["pipe"] = h5py.ExternalLink("fifo", "/x")
    os.mkfifo(tmp_path / "fifo")  # opening it would wait for a writer forever
    with h5py.File(tmp_path / "loop.h5", "r") as f:
        fifo = f"an external link to 'fifo' ({tmp_path / 'fifo'}), which is not a regular file"
        for name, message in [("full", "more than 8 links to follow"), ("x", "more than 8 links to follow"),
                              ("y", "maps 8 of its 16 values to sources"), ("pipe", fifo)]:
            with pytest.raises(UntrustedFile, match=re.escape(f"loop.h5: dataset '{name}': ")) as err:
                check_datasets(f, [name])
            assert message in str(err.value), err.value
