"""Loader benchmark: samples/s, MB/s and bytes read per rank, whole samples against spatial shards.

Why: a spatial rank should read about 1/P of every sample; this measures how close the loader gets on
a packed CosmoFlow file (``x`` (N, S, S, S, 4) int16 channels last, ``y`` (N, 4), chunks
``(1, S/sd, S/sh, S/sw, 4)``), and what it costs in time. The ranks of a spatial group are simulated
one after another in this process (each with its own ``Placement``), so per-rank figures are those of
a rank that has a core to itself; the group's rate is set by its slowest rank.

Bytes are counted three ways: *region* (the int16 bytes of the hyperslab asked for), *chunks* (the
bytes of the HDF5 chunks it touches, what a cold read fetches; from ``cosmoflow.data`` when present)
and *syscall* (``rchar`` of /proc/<pid>/io: what HDF5 actually pulled through read()). The file sits
in the page cache after a warm-up epoch, so MB/s is decode-and-copy speed, not disk speed.

The second table prices augmentation (``Augment()``: a random one of the cube's 48 symmetries per
sample): every rank reads the pre-image of its shard and flips/transposes it in memory, so it must
read the same bytes; epochs with and without it alternate on the same ranks (ratios per round,
medians), since this machine's speed drifts.

The third table runs a loop whose "step" sleeps (like waiting on a GPU) for ``--step-ratio`` times
the synchronous read of a batch, and reports the share of its time spent waiting for data.

    python -m perf loader                      # S=128, N=16, 5 repeats
    python -m perf loader --size 64 --samples 32 --repeats 3
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from hybridpar.data import Augment, Placement, VolumeLoader
from perf import common

CHANNELS = 4
# (label, spatial split): the chunks are cut for --chunk-split (default 2,2,1), so (2,1,1) and
# (2,2,1) are aligned with them and (1,1,4) is not (each rank touches every chunk of a sample).
LAYOUTS = [("whole", (1, 1, 1)), ("P=2 d", (2, 1, 1)), ("P=4 dh", (2, 2, 1)), ("P=4 w", (1, 1, 4))]


def write_packed(path: Path, n: int, size: int, split: tuple[int, int, int], seed: int = 0) -> Path:
    """A packed file of ``n`` random samples: Poisson(1) int16 counts, labels uniform in [-1, 1]."""
    rng = np.random.default_rng(seed)
    chunks = (1, *(size // p for p in split), CHANNELS)
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(n, size, size, size, CHANNELS), dtype=np.int16, chunks=chunks)
        for i in range(n):
            x[i] = rng.poisson(1.0, (size, size, size, CHANNELS)).astype(np.int16)
        f["y"] = rng.uniform(-1, 1, (n, 4)).astype(np.float32)
    return path


class PackedVolumes:
    """Fallback reader of the packed layout (used when cosmoflow.data is missing or broken)."""

    def __init__(self, path: str) -> None:
        self.path, self._f = path, None
        with h5py.File(path, "r") as f:
            self.n, s = f["x"].shape[0], f["x"].shape[1]
        self.sample_shape = (CHANNELS, s, s, s)
        self.sample_nbytes = CHANNELS * s ** 3 * 2
        self.bytes_read = 0

    def __len__(self) -> int:
        return self.n

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_f": None}

    def read(self, i: int, region=None):
        if self._f is None:
            self._f = h5py.File(self.path, "r")
        region = region or (slice(None),) * 3
        raw = self._f["x"][(i, *region, slice(None))]
        self.bytes_read += raw.nbytes
        x = torch.from_numpy(raw).permute(3, 0, 1, 2).float().log1p_()
        return x.contiguous(), torch.from_numpy(self._f["y"][i])


def open_bench_dataset(path: Path, size: int) -> tuple[object, str]:
    """cosmoflow.data.open_dataset if it exists and reads a region correctly, else the fallback."""
    try:
        from cosmoflow.data import open_dataset  # optional: written concurrently

        ds = open_dataset(str(path), sample_size=size)
        ref = PackedVolumes(str(path))
        region = (slice(0, size // 2), slice(size // 4, size // 2), slice(0, size))
        if torch.allclose(ds.read(1, region)[0], ref.read(1, region)[0]):
            return ds, "cosmoflow.data.open_dataset"
    except Exception as err:  # any failure means: use the fallback
        print(f"cosmoflow.data unusable here ({err}); using the benchmark's own reader", file=sys.stderr)
    return PackedVolumes(str(path)), "bench PackedVolumes"


def rchar(pid: int | None = None) -> int:
    """Bytes this process (or ``pid``) read through read()-family syscalls, page cache included."""
    with open(f"/proc/{pid or 'self'}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar"))


def one_epoch(loader: VolumeLoader) -> dict:
    """Time one epoch of ``loader``; bytes by the dataset's counters and by syscalls."""
    ds = loader.dataset
    pids = loader.worker_pids
    sys0 = sum(rchar(p) for p in pids) if pids else rchar()
    chunk0 = getattr(ds, "chunk_bytes_read", 0)
    region0 = loader.bytes_read or 0
    t0 = time.perf_counter()
    samples = sum(x.shape[0] for x, _ in loader)
    wall = time.perf_counter() - t0
    pids = loader.worker_pids or pids
    return {"wall_s": wall, "samples": samples,
            "region_bytes": (loader.bytes_read or 0) - region0,
            "chunk_bytes": getattr(ds, "chunk_bytes_read", 0) - chunk0 if not pids else None,
            "syscall_bytes": (sum(rchar(p) for p in pids) if pids else rchar()) - sys0}


def bench_layout(ds, split, batch: int, workers: int, repeats: int) -> dict:
    """Every rank of ``split`` in turn: a warm-up epoch, then ``repeats`` timed epochs each."""
    ranks = []
    for coord in np.ndindex(*split):
        with VolumeLoader(ds, Placement(1, 0, split, coord), batch, seed=0, workers=workers,
                          prefetch=2) as loader:
            one_epoch(loader)  # start workers, fill the page cache
            runs = [one_epoch(loader) for _ in range(repeats)]
        ranks.append(runs)
    sample_bytes = ds.sample_nbytes
    walls = [max(r[k]["wall_s"] for r in ranks) for k in range(repeats)]  # the group waits for all
    per_rank_wall = statistics.median(w["wall_s"] for r in ranks for w in r)
    samples = ranks[0][0]["samples"]
    region = statistics.median(w["region_bytes"] for r in ranks for w in r) / samples
    chunk = [w["chunk_bytes"] for r in ranks for w in r if w["chunk_bytes"] is not None]
    # with workers the look-ahead into the next epoch blurs per-epoch syscall counts: not reported
    syscall = None if workers else statistics.median(
        w["syscall_bytes"] for r in ranks for w in r) / samples
    return {
        "split": list(split), "ranks": len(ranks), "workers": workers, "batch": batch,
        "samples_per_epoch": samples, "repeats": repeats,
        "group_samples_per_s": samples / statistics.median(walls),
        "rank_samples_per_s": samples / per_rank_wall,
        "rank_MB_per_s": region * samples / per_rank_wall / 1e6,
        "region_bytes_over_sample": region / sample_bytes,
        "chunk_bytes_over_sample": statistics.median(chunk) / samples / sample_bytes if chunk else None,
        "syscall_bytes_over_sample": None if syscall is None else syscall / sample_bytes,
        "epoch_walls_s": walls,
    }


def bench_augment(ds, split, batch: int, repeats: int) -> dict:
    """Epochs with ``Augment()`` over epochs without, alternated on every rank of ``split`` in turn
    (synchronous reads): the median per-round time ratio and the bytes read ratio."""
    time_ratios, byte_ratios = [], []
    for coord in np.ndindex(*split):
        place = Placement(1, 0, split, coord)
        with VolumeLoader(ds, place, batch, seed=0, workers=0) as plain, \
                VolumeLoader(ds, place, batch, seed=0, workers=0, augment=Augment()) as augmented:
            one_epoch(plain)
            one_epoch(augmented)
            for _ in range(repeats):
                a, b = one_epoch(plain), one_epoch(augmented)
                time_ratios.append(b["wall_s"] / a["wall_s"])
                byte_ratios.append(b["region_bytes"] / a["region_bytes"] if a["region_bytes"] else None)
    known = [r for r in byte_ratios if r is not None]
    return {"split": list(split), "batch": batch, "repeats": repeats, "time_ratios": time_ratios,
            "time_ratio": statistics.median(time_ratios),
            "bytes_ratio": statistics.median(known) if known else None}


def bench_wait(ds, split, batch: int, workers: int, step_s: float, epochs: int, repeats: int) -> dict:
    """Data-wait share of a loop whose step takes ``step_s`` without using the CPU (a GPU step):
    the median over ``repeats`` runs of ``epochs`` epochs each, after a warm-up epoch."""
    shares, rates = [], []
    with VolumeLoader(ds, Placement(1, 0, split, (0, 0, 0)), batch, seed=0, workers=workers,
                      prefetch=2) as loader:
        for _ in loader:  # warm-up epoch: workers started, page cache filled
            time.sleep(step_s)
        for _ in range(repeats):
            wait0, t0 = loader.wait_time, time.perf_counter()
            for _ in range(epochs):
                for _ in loader:
                    time.sleep(step_s)
            wall = time.perf_counter() - t0
            shares.append((loader.wait_time - wait0) / wall)
            rates.append(epochs * len(loader) * loader.local_batch_size / wall)
    return {"split": list(split), "workers": workers, "batch": batch, "epochs": epochs,
            "repeats": repeats, "batches": epochs * len(loader), "step_ms": step_s * 1e3,
            "wait_share": statistics.median(shares), "wait_shares": shares,
            "samples_per_s": statistics.median(rates)}


def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


TINY = {"size": 16, "samples": 4, "batch": 2, "repeats": 1, "wait_epochs": 1, "wait_repeats": 1}  # seconds


def main(argv: list[str] | None = None) -> int:
    ap = common.parser("loader", __doc__)
    ap.add_argument("--size", type=int, default=128, help="sample side S (default 128)")
    ap.add_argument("--samples", type=int, default=16, help="samples in the file (default 16)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="timed epochs per rank (medians reported)")
    ap.add_argument("--workers", default="0,2", help="worker counts to compare (default 0,2)")
    ap.add_argument("--step-ratio", type=float, default=2.0,
                    help="simulated step = this x the synchronous read time of a batch (default 2)")
    ap.add_argument("--wait-epochs", type=int, default=3, help="epochs per data-wait run (default 3)")
    ap.add_argument("--wait-repeats", type=int, default=3, help="data-wait runs (median; default 3)")
    ap.add_argument("--chunk-split", default="2,2,1", help="shards the file's chunks align to")
    ap.add_argument("--dir", default=None, help="where to write the file (default: a temp dir)")
    args = common.parse(ap, argv, TINY)
    split = tuple(int(p) for p in args.chunk_split.split(","))
    torch.set_num_threads(1)

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = write_packed(Path(tmp) / "packed.h5", args.samples, args.size, split)
        ds, reader = open_bench_dataset(path, args.size)
        with h5py.File(path, "r") as f:
            chunks = f["x"].chunks
        rows = []
        for workers in (int(w) for w in args.workers.split(",")):
            for label, layout in LAYOUTS:
                row = bench_layout(ds, layout, args.batch, workers, args.repeats)
                row["layout"] = label
                rows.append(row)
                print(f"  done {label} workers={workers}", file=sys.stderr)
        augments = []
        for label, layout in (LAYOUTS[0], LAYOUTS[2]):
            augments.append({"layout": label, **bench_augment(ds, layout, args.batch, args.repeats)})
            print(f"  done augment {label}", file=sys.stderr)
        waits = []
        for label, layout in (LAYOUTS[0], LAYOUTS[2]):
            sync = next(r for r in rows if r["layout"] == label and r["workers"] == 0)
            step = args.step_ratio * args.batch / sync["rank_samples_per_s"]
            for workers in (0, 1, 2):
                row = bench_wait(ds, layout, args.batch, workers, step, args.wait_epochs,
                                 args.wait_repeats)
                row["layout"] = label
                waits.append(row)
                print(f"  done wait {label} workers={workers}", file=sys.stderr)

    mb = ds.sample_nbytes / 2**20
    print(f"\nloader: {args.samples} samples of {args.size}^3 x {CHANNELS} int16 ({mb:.0f} MiB each), "
          f"chunks {chunks}, batch {args.batch}, reader {reader}; medians of {args.repeats} epochs, "
          f"warm page cache")
    head = (f"{'layout':<8} {'split':<9} {'wk':>2} {'rank smp/s':>10} {'rank MB/s':>9} "
            f"{'group smp/s':>11} {'region/S':>8} {'chunks/S':>8} {'syscall/S':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['layout']:<8} {'x'.join(map(str, r['split'])):<9} {r['workers']:>2} "
              f"{r['rank_samples_per_s']:>10.1f} {r['rank_MB_per_s']:>9.0f} "
              f"{r['group_samples_per_s']:>11.1f} {r['region_bytes_over_sample']:>8.3f} "
              f"{fmt(r['chunk_bytes_over_sample'], '>8.3f')} {fmt(r['syscall_bytes_over_sample'], '>9.3f')}")
    print("region/S, chunks/S, syscall/S: bytes read per rank per sample over the sample's int16 bytes "
          "(goal 1/P); MB/s counts region bytes (int16 on disk)")

    print(f"\naugmentation (a random cube symmetry per sample), epochs alternated with plain ones, "
          f"{args.repeats} rounds per rank, workers 0")
    head = f"{'layout':<8} {'split':<9} {'time aug/plain':>14} {'bytes aug/plain':>15}"
    print(head)
    print("-" * len(head))
    for r in augments:
        print(f"{r['layout']:<8} {'x'.join(map(str, r['split'])):<9} {r['time_ratio']:>14.3f} "
              f"{fmt(r['bytes_ratio'], '>15.3f')}")

    print(f"\ndata-wait share of a loop whose step (sleep, like a GPU step) lasts {args.step_ratio:g}x "
          f"the synchronous read of a batch; median of {args.wait_repeats} runs of {args.wait_epochs} "
          f"epochs after a warm-up")
    head = f"{'layout':<8} {'split':<9} {'wk':>2} {'step ms':>8} {'wait share':>10} {'smp/s':>7}"
    print(head)
    print("-" * len(head))
    for r in waits:
        print(f"{r['layout']:<8} {'x'.join(map(str, r['split'])):<9} {r['workers']:>2} "
              f"{r['step_ms']:>8.1f} {r['wait_share']:>10.1%} {r['samples_per_s']:>7.1f}")

    result = {
        "libraries": {"h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version, "numpy": np.__version__},
        "config": {"size": args.size, "samples": args.samples, "channels": CHANNELS,
                   "batch": args.batch, "repeats": args.repeats, "chunks": list(chunks),
                   "chunk_split": list(split), "sample_bytes": ds.sample_nbytes, "reader": reader,
                   "page_cache": "warm (one warm-up epoch per rank)",
                   "ranks": "simulated one after another in one process",
                   "step_ratio": args.step_ratio, "wait_epochs": args.wait_epochs,
                   "wait_repeats": args.wait_repeats},
        "rows": rows,
        "augment": augments,
        "wait": waits,
    }
    common.write_json(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
