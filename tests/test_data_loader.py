"""hybridpar.data: the sharded volume loader, checked against plain index arithmetic and whole samples.

Two small datasets of our own (the loader is generic): one in memory, one over HDF5 files written to
``tmp_path``. Both encode the sample index in ``y`` and count the bytes they read, so every test
can say which samples a rank got and how much of each it read. A ``Placement`` stands in for a
process grid (and a plain dataclass with the same four attributes, as a ProcessGrid has them): the
loader needs only those numbers, not a process group.
"""

from __future__ import annotations

import gc
import math
import os
import pickle
import time
from dataclasses import dataclass

import h5py
import numpy as np
import pytest
import torch

from hybridpar.data import (
    Placement,
    ShardedSampler,
    VolumeLoader,
    WorkerError,
    epoch_permutation,
    stage_files,
)
from hybridpar.geometry import shard_range

pytestmark = pytest.mark.timeout(60)

SHAPE = (2, 7, 5, 4)  # C, D, H, W: odd extents so shards are uneven


@dataclass
class FakeGrid:
    """The four attributes of a ProcessGrid the loader reads (a real one needs a process group)."""

    data: int
    data_index: int
    spatial_shape: tuple[int, int, int]
    spatial_coord: tuple[int, int, int]


def full_sample(i: int, shape: tuple[int, ...] = SHAPE) -> torch.Tensor:
    """The whole sample ``i``: every voxel distinct, and distinct across samples."""
    return torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape) + 1000.0 * i


class MemoryVolumes:
    """In-memory samples; records every (index, region) asked for and counts the bytes returned."""

    def __init__(self, n: int, shape: tuple[int, ...] = SHAPE, fail_at: int | None = None) -> None:
        self.n, self.sample_shape, self.fail_at = n, shape, fail_at
        self.bytes_read = 0
        self.reads: list[tuple[int, tuple[slice, ...] | None]] = []

    def __len__(self) -> int:
        return self.n

    def read(self, i: int, region=None):
        if i == self.fail_at:
            raise OSError(f"sample {i} is corrupt")
        x = full_sample(i, self.sample_shape)
        if region is not None:
            x = x[(slice(None), *region)].clone()
        self.bytes_read += x.numel() * x.element_size()
        self.reads.append((i, region))
        return x, torch.tensor([float(i), -float(i)])


class H5Volumes:
    """HDF5-backed samples, ``x`` (n, C, D, H, W) float32 and ``y`` (n, 2) per file, opened lazily.

    Implements the FileBacked protocol (``files``, ``with_files``) used by staging.
    """

    def __init__(self, files: list[str], per_file: int) -> None:
        self.files, self.per_file = list(files), per_file
        self.sample_shape = SHAPE
        self.bytes_read = 0
        self._handles: dict[int, h5py.File] = {}

    def __len__(self) -> int:
        return len(self.files) * self.per_file

    def with_files(self, paths):
        return H5Volumes(list(paths), self.per_file)

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}

    def read(self, i: int, region=None):
        f, j = divmod(i, self.per_file)
        if f not in self._handles:
            self._handles[f] = h5py.File(self.files[f], "r")
        h = self._handles[f]
        sel = (j, slice(None), *(region or (slice(None),) * 3))
        x = h["x"][sel]
        self.bytes_read += x.nbytes
        return torch.from_numpy(x), torch.from_numpy(h["y"][j])


def write_h5(path, first: int, count: int) -> str:
    with h5py.File(path, "w") as h:
        h["x"] = np.stack([full_sample(first + k).numpy() for k in range(count)])
        h["y"] = np.array([[first + k, -(first + k)] for k in range(count)], dtype=np.float32)
    return str(path)


@pytest.fixture
def h5_dataset(tmp_path) -> H5Volumes:
    src = tmp_path / "src"
    src.mkdir()
    return H5Volumes([write_h5(src / "a.h5", 0, 6), write_h5(src / "b.h5", 6, 6)], per_file=6)


def ids(y: torch.Tensor) -> list[int]:
    return [int(v) for v in y[:, 0]]


def epoch_ids(loader: VolumeLoader) -> list[list[int]]:
    return [ids(y) for _, y in loader]


def child_pids() -> set[int]:
    """Live worker processes of this one, from /proc (independent of multiprocessing's bookkeeping):
    its descendants, less the forkserver the workers are forked from and its resource tracker (they
    outlive a loader)."""
    parents, cmd = {}, {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd[int(d)] = f.read()
            except OSError:
                continue
            if fields[0] != "Z":
                parents[int(d)] = int(fields[1])
    out, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier}
        out |= frontier
    me = os.getpid()
    helper = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")
    return {pid for pid in out if not (parents[pid] == me and any(h in cmd.get(pid, b"") for h in helper))}


# ---------------------------------------------------------------------------------- sampling
def test_global_shuffle_then_shard():
    """Per epoch the replicas are disjoint, and replica r's k-th batch is the r-th slice of the k-th
    global batch of the shared permutation, so together they read its first floor(N/B)*B samples.
    Checked against the permutation itself, and through the loader on the samples actually read."""
    n, batch, data = 23, 6, 3
    for epoch in (0, 1):
        perm = epoch_permutation(n, seed=5, epoch=epoch).tolist()
        per_replica = []
        for r in range(data):
            loader = VolumeLoader(MemoryVolumes(n), Placement(data, r), batch, seed=5, workers=0)
            loader.set_epoch(epoch)
            per_replica.append(epoch_ids(loader))
        for k in range(n // batch):
            assert sum((per_replica[r][k] for r in range(data)), []) == perm[k * batch:(k + 1) * batch]
        seen = [i for rep in per_replica for b in rep for i in b]
        assert len(seen) == len(set(seen)) == (n // batch) * batch
        assert sorted(seen) == sorted(perm[:(n // batch) * batch])
    # not shard-then-shuffle: a replica's set of samples changes from epoch to epoch
    s0 = [ShardedSampler(n, batch, data, 0, seed=5).batches(e) for e in (0, 1)]
    assert {i for b in s0[0] for i in b} != {i for b in s0[1] for i in b}


def test_order_is_deterministic_per_seed_and_epoch():
    """The permutation depends on (seed, epoch) only: equal for equal pairs, different otherwise;
    shuffle=False is the identity; a loader's consecutive epochs follow the sampler's."""
    assert epoch_permutation(50, 3, 2).tolist() == epoch_permutation(50, 3, 2).tolist()
    assert epoch_permutation(50, 3, 2).tolist() != epoch_permutation(50, 3, 3).tolist()
    assert epoch_permutation(50, 3, 2).tolist() != epoch_permutation(50, 4, 2).tolist()
    assert sorted(epoch_permutation(50, 3, 2).tolist()) == list(range(50))
    assert epoch_permutation(7, 3, 2, shuffle=False).tolist() == list(range(7))
    loader = VolumeLoader(MemoryVolumes(12), None, 4, seed=9, workers=0)
    first, second = epoch_ids(loader), epoch_ids(loader)
    assert loader.state_dict() == {"epoch": 2, "index": 0, "seed": 9}
    assert first == ShardedSampler(12, 4, seed=9).batches(0)
    assert second == ShardedSampler(12, 4, seed=9).batches(1)


def test_short_last_batch_without_drop_last():
    """drop_last=False covers every sample exactly once; the short last global batch is split as
    evenly as possible, a replica left with none gets an empty batch of the right trailing shape."""
    n, batch, data = 9, 4, 2
    loaders = [VolumeLoader(MemoryVolumes(n), Placement(data, r, (2, 1, 1), (0, 0, 0)), batch,
                            shuffle=False, drop_last=False, workers=0) for r in range(data)]
    got = [[(x.shape, ids(y)) for x, y in ld] for ld in loaders]
    assert len(loaders[0]) == 3
    assert [ids for _, ids in got[0]] == [[0, 1], [4, 5], [8]]
    assert [ids for _, ids in got[1]] == [[2, 3], [6, 7], []]
    assert got[1][2][0] == (0, 2, 4, 5, 4)


# ---------------------------------------------------------------------------------- regions
@pytest.mark.parametrize("split", [(2, 3, 1), (1, 1, 4), (3, 2, 2)])
def test_spatial_shards_tile_the_sample(split):
    """Every rank of a spatial group gets the same samples in the same order and the same y; its
    x is the balanced shard_range block, and the blocks of all ranks reassemble the whole sample."""
    n, batch = 6, 2
    whole = VolumeLoader(MemoryVolumes(n), None, batch, seed=1, workers=0)
    reference = list(whole)
    out = [torch.full((batch, *SHAPE), float("nan")) for _ in reference]
    ys = []
    for coord in np.ndindex(*split):
        loader = VolumeLoader(MemoryVolumes(n), FakeGrid(1, 0, split, coord), batch, seed=1,
                              workers=0)
        ranges = [shard_range(e, p, c) for e, p, c in zip(SHAPE[1:], split, coord, strict=True)]
        for k, (x, y) in enumerate(loader):
            assert x.shape == (batch, 2, *(b - a for a, b in ranges))
            ys.append(y)
            (d0, d1), (h0, h1), (w0, w1) = ranges
            assert torch.isnan(out[k][:, :, d0:d1, h0:h1, w0:w1]).all()  # no overlap
            out[k][:, :, d0:d1, h0:h1, w0:w1] = x
    for k, (x, _) in enumerate(reference):
        assert torch.equal(out[k], x)
    for k in range(len(reference)):
        assert all(torch.equal(ys[k], ys[r * len(reference) + k]) for r in range(math.prod(split)))


def test_only_the_region_is_read(h5_dataset):
    """The dataset is asked for this rank's region only, and the bytes it reads from HDF5 per rank
    are the region's, summing to exactly the whole samples' bytes over the group."""
    split, batch = (2, 2, 1), 4
    sample_bytes = math.prod(SHAPE) * 4
    total = 0
    for coord in np.ndindex(*split):
        loader = VolumeLoader(h5_dataset.with_files(h5_dataset.files), Placement(1, 0, split, coord),
                              batch, workers=0)
        nb = len(loader) * batch
        for _ in loader:
            pass
        region_voxels = math.prod(s.stop - s.start for s in loader.region)
        assert loader.bytes_read == nb * SHAPE[0] * region_voxels * 4
        assert loader.bytes_read < 0.5 * nb * sample_bytes  # about 1/P of each sample
        total += loader.bytes_read
    assert total == nb * sample_bytes
    mem = MemoryVolumes(12)
    list(VolumeLoader(mem, Placement(1, 0, split, (1, 0, 0)), batch, workers=0))
    assert all(r == (slice(4, 7), slice(0, 3), slice(0, 4)) for _, r in mem.reads)


# ---------------------------------------------------------------------------------- position
def test_resume_mid_epoch_gives_exactly_the_remaining_batches():
    """A loader restored from state_dict() after 2 of 5 batches of epoch 1 yields batches 2..4 of
    that epoch and then epoch 2, equal to an uninterrupted run; set_epoch keeps the restored
    position, and the saved seed wins over the new loader's."""
    make = lambda seed=7: VolumeLoader(MemoryVolumes(20), Placement(2, 1), 4, seed=seed, workers=0)
    straight = make()
    straight.set_epoch(1)
    epoch1 = epoch_ids(straight)
    epoch2 = epoch_ids(straight)
    assert len(epoch1) == 5

    first = make()
    first.set_epoch(1)
    it = iter(first)
    consumed = [ids(next(it)[1]) for _ in range(2)]
    state = first.state_dict()
    assert state == {"epoch": 1, "index": 2, "seed": 7}
    del it

    resumed = make(seed=123)
    resumed.load_state_dict(state)
    resumed.set_epoch(1)  # the usual loop calls this; it must not rewind
    assert consumed + epoch_ids(resumed) == epoch1
    assert epoch_ids(resumed) == epoch2

    ended = make()
    ended.load_state_dict({"epoch": 1, "index": 5, "seed": 7})  # saved after the last batch
    assert ended.state_dict() == {"epoch": 2, "index": 0, "seed": 7}
    with pytest.raises(ValueError, match="does not fit"):
        ended.load_state_dict({"epoch": 0, "index": 6, "seed": 7})

    older, newer = iter(ended), iter(ended)
    next(older)
    next(newer)
    with pytest.raises(RuntimeError, match="superseded"):
        next(older)


def test_wait_time_is_measured():
    """wait_time accumulates the seconds spent blocked on each batch; last_wait is the latest."""
    loader = VolumeLoader(MemoryVolumes(8), None, 2, workers=0)
    assert loader.wait_time == 0.0
    list(loader)
    assert loader.wait_time > 0.0 and 0.0 < loader.last_wait <= loader.wait_time


# ---------------------------------------------------------------------------------- processes
def test_prefetch_processes_match_synchronous_reads(h5_dataset):
    """Two worker processes with prefetch 2 give the same batches (values, order, y) and the same
    byte count as synchronous reads: after an early break and a rewind, over two epochs (the
    look-ahead crossing into the next), and after a jump back to epoch 0."""
    place = Placement(2, 1, (1, 2, 1), (0, 1, 0))
    sync = VolumeLoader(h5_dataset, place, 4, seed=3, workers=0)
    expected = [[(x.clone(), y.clone()) for x, y in sync] for _ in range(2)]
    before = child_pids()
    with VolumeLoader(h5_dataset.with_files(h5_dataset.files), place, 4, seed=3, workers=2,
                      prefetch=2) as loader:
        x, _ = next(iter(loader))  # stop early, leaving batches in flight
        assert len(loader.worker_pids) == 2 and set(loader.worker_pids) <= child_pids()
        loader.load_state_dict({"epoch": 0, "index": 0, "seed": 3})  # rewind
        got = [[(x.clone(), y.clone()) for x, y in loader] for _ in range(2)]
        assert loader.bytes_read == sync.bytes_read + x.numel() * 4  # delivered batches only
        loader.set_epoch(0)  # the look-ahead read epoch 2's batches: they must be dropped
        got.append([(x.clone(), y.clone()) for x, y in loader])
    expected.append(expected[0])
    for e in range(3):
        assert len(got[e]) == len(expected[e])
        for (xa, ya), (xb, yb) in zip(got[e], expected[e], strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert child_pids() <= before


class StoredVolumes(MemoryVolumes):
    """A dataset with a stored form (``StoredForm``): int16 samples scaled by 0.5 when finished, so that
    a batch that skipped ``finish``, or was finished twice, is visible."""

    def read(self, i: int, region=None):
        x, y = self.read_stored(i, region)
        return self.finish(x[None])[0], y

    def read_stored(self, i: int, region=None):
        x, y = super().read(i, region)
        return (x % 30000).to(torch.int16), y

    @staticmethod
    def finish(x: torch.Tensor) -> torch.Tensor:
        return x.float() * 0.5


def test_stored_form_through_reused_buffers_matches_host_reads():
    """``device=`` with a ``StoredForm`` dataset and workers: batches are written into a few reused
    shared buffers (``host_slots``) and finished after the copy. Against synchronous host reads: equal
    (values, order, y) over a short last batch, a replica's empty share, an early break and a rewind,
    and a look-ahead into the next epoch; a worker's failure still surfaces when its batch is due."""
    place = [Placement(2, r, (2, 1, 1), (1, 0, 0)) for r in range(2)]
    for r in range(2):
        sync = VolumeLoader(StoredVolumes(9), place[r], 4, seed=1, drop_last=False, workers=0)
        expected = [[(x.clone(), y.clone()) for x, y in sync] for _ in range(2)]
        with VolumeLoader(StoredVolumes(9), place[r], 4, seed=1, drop_last=False, workers=2, prefetch=2,
                          device="cpu") as loader:
            assert loader.stored
            first, _ = next(iter(loader))  # stop early: batches in flight hold buffers, which must come back
            assert len(loader._pool._slots.buffers) == 4  # the slot road, not a segment per batch
            loader.load_state_dict({"epoch": 0, "index": 0, "seed": 1})
            got = [[(x.clone(), y.clone()) for x, y in loader] for _ in range(2)]
            assert loader.bytes_read == sync.bytes_read + first.numel() * 4  # delivered batches only
        assert [len(e) for e in got] == [len(e) for e in expected] == [3, 3]
        for e in range(2):
            for (xa, ya), (xb, yb) in zip(got[e], expected[e], strict=True):
                assert xa.shape == xb.shape and torch.equal(xa, xb) and torch.equal(ya, yb)
    assert got[0][2][0].shape[0] == 0  # replica 1's share of the last batch of 9 samples: none
    broken = VolumeLoader(StoredVolumes(8, fail_at=5), None, 2, shuffle=False, workers=2, device="cpu")
    with pytest.raises(WorkerError, match="sample 5 is corrupt"):
        for _ in broken:
            pass
    broken.close()


class SlowVolumes(MemoryVolumes):
    """Each read sleeps, like a cold file system: what prefetching has to hide."""

    def read(self, i: int, region=None):
        time.sleep(0.05)
        return super().read(i, region)


def test_prefetch_hides_read_time():
    """Synchronous reads make the consumer wait for every (50 ms) read; two prefetching workers read
    the next batch while the consumer is still busy with the current one, also across the epoch
    boundary (the look-ahead runs into the next epoch), so it has arrived before it is asked for.
    Checked by order (arrived, then asked), not by a clock a loaded machine would stretch."""
    with VolumeLoader(SlowVolumes(5), None, 1, workers=0) as loader:
        for _ in range(2):
            for _ in loader:
                pass
        assert loader.wait_time >= 10 * 0.05
    with VolumeLoader(SlowVolumes(5), None, 1, workers=2, prefetch=2) as loader:
        for epoch in range(2):
            for k, _ in enumerate(loader):
                following = (epoch, k + 1) if k + 1 < 5 else (epoch + 1, 0)
                deadline = time.monotonic() + 20  # the consumer's step: long enough for one read
                while following not in loader._pool._ready and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert following in loader._pool._ready, f"batch {following} was not read ahead"
        assert loader.state_dict()["epoch"] == 2


def test_results_are_received_before_they_are_asked_for():
    """The pool's receiver thread rebuilds a finished batch from shared memory while the trainer is
    busy elsewhere, so asking for it later costs no wait; a late result of an abandoned generation
    is dropped, not handed out."""
    from hybridpar.data.workers import WorkerPool

    pool = WorkerPool(MemoryVolumes(8), None, workers=1)
    try:
        gen = pool.begin()
        pool.submit(gen, "a", [0, 1])
        deadline = time.monotonic() + 20
        while "a" not in pool._ready and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "a" in pool._ready  # arrived without get()
        waits = []
        cond_wait = pool._cond.wait
        pool._cond.wait = lambda timeout=None: waits.append(timeout) or cond_wait(timeout)
        x, y, _, _ = pool.get(gen, "a")
        pool._cond.wait = cond_wait
        assert waits == []  # handed out what the receiver had rebuilt, without waiting
        torch.testing.assert_close(y, torch.tensor([[0.0, -0.0], [1.0, -1.0]]))
        pool.submit(gen, "b", [2])
        gen2 = pool.begin()  # abandon "b"
        pool.submit(gen2, "c", [3])
        _, y, _, _ = pool.get(gen2, "c")
        assert y.tolist() == [[3.0, -3.0]] and "b" not in pool._ready
    finally:
        pool.close()
    assert not pool._receiver.is_alive()


def test_workers_leave_no_processes_behind():
    """No reader process survives close(), garbage collection of a loader left mid-epoch, or a
    worker's read error (which surfaces as WorkerError naming the failing batch)."""
    before = child_pids()
    loader = VolumeLoader(MemoryVolumes(16), None, 2, workers=2)
    next(iter(loader))
    pids = loader.worker_pids
    assert len(pids) == 2
    loader.close()
    assert not set(pids) & child_pids() and loader.worker_pids == []

    loader = VolumeLoader(MemoryVolumes(16), None, 2, workers=1)
    it = iter(loader)
    next(it)
    pids = loader.worker_pids
    del it, loader
    gc.collect()
    assert not set(pids) & child_pids()

    bad = VolumeLoader(MemoryVolumes(8, fail_at=5), None, 2, shuffle=False, workers=1)
    with pytest.raises(WorkerError, match="sample 5 is corrupt"):
        list(bad)
    assert bad.worker_pids == [] and child_pids() <= before


def test_spawned_workers_read_the_same(h5_dataset):
    """With the spawn start method (nothing inherited, dataset pickled) the batches are the same."""
    place = Placement(1, 0, (2, 1, 1), (1, 0, 0))
    expected = [y for _, y in VolumeLoader(h5_dataset, place, 3, workers=0)]
    with VolumeLoader(h5_dataset, place, 3, workers=1, start_method="spawn") as loader:
        got = [y for _, y in loader]
    assert len(got) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


# ---------------------------------------------------------------------------------- staging
def test_staging_copies_files_and_reads_the_copies(h5_dataset, tmp_path, capsys):
    """stage_dir copies every file under the node-local directory with a progress bar on stderr;
    the loader then reads the copies (the originals are moved away) and gets the same batches.
    A second staging reuses the copies."""
    expected = epoch_ids(VolumeLoader(h5_dataset, None, 4, workers=0))
    local = tmp_path / "local"
    loader = VolumeLoader(h5_dataset, None, 4, workers=0, stage_dir=local, progress=True)
    assert sorted(p.name for p in local.iterdir() if not p.name.startswith(".")) == ["a.h5", "b.h5"]
    assert "staging" in capsys.readouterr().err
    assert loader.dataset.files == [str(local / "a.h5"), str(local / "b.h5")]
    for f in h5_dataset.files:
        os.rename(f, f + ".moved")
    assert epoch_ids(loader) == expected
    for f in h5_dataset.files:
        os.rename(f + ".moved", f)
    mtime = os.stat(local / "a.h5").st_mtime_ns
    assert stage_files(h5_dataset.files, local, progress=False) == loader.dataset.files
    assert os.stat(local / "a.h5").st_mtime_ns == mtime


# ---------------------------------------------------------------------------------- errors
def test_errors_say_what_would_fit(tmp_path):
    """Each misconfiguration fails at construction with a message naming what would fit."""
    with pytest.raises(ValueError, match=r"not divisible by the data-parallel degree 4.*8 or 12"):
        VolumeLoader(MemoryVolumes(40), Placement(4, 0), 10, workers=0)
    with pytest.raises(ValueError, match=r"5 samples, fewer than one global batch of 8.*<= 4"):
        VolumeLoader(MemoryVolumes(5), Placement(2, 0), 8, workers=0)
    with pytest.raises(ValueError, match=r"extent 5 along h cannot be split over 8 ranks.*at most 5"):
        VolumeLoader(MemoryVolumes(4), Placement(1, 0, (1, 8, 1), (0, 0, 0)), 2, workers=0)
    no_shape = MemoryVolumes(4)
    del no_shape.sample_shape
    with pytest.raises(ValueError, match="sample_shape"):
        VolumeLoader(no_shape, Placement(1, 0, (2, 1, 1), (0, 0, 0)), 2, workers=0)
    assert VolumeLoader(no_shape, Placement(1, 0, (2, 1, 1), (0, 0, 0)), 2, workers=0,
                        sample_shape=(7, 5, 4)).region == (slice(0, 4), slice(0, 5), slice(0, 4))
    with pytest.raises(TypeError, match="'files' list"):
        VolumeLoader(MemoryVolumes(4), None, 2, workers=0, stage_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="nope.h5"):
        VolumeLoader(H5Volumes([str(tmp_path / "nope.h5")], 4), None, 2, workers=0,
                     stage_dir=tmp_path / "local")
    unpicklable = MemoryVolumes(4)
    unpicklable.lock = open(os.devnull)  # an unpicklable member
    with pytest.raises(TypeError, match="must pickle"):
        next(iter(VolumeLoader(unpicklable, None, 2, workers=1)))
    unpicklable.lock.close()
    with pytest.raises(TypeError, match="not a volume dataset"):
        VolumeLoader([1, 2, 3], None, 1)
    with pytest.raises(ValueError, match="prefetch"):
        VolumeLoader(MemoryVolumes(4), None, 2, prefetch=0)
    assert pickle.loads(pickle.dumps(MemoryVolumes(3))).n == 3
