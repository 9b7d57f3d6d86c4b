"""Pack a split into one chunked HDF5 file whose chunks line up with the spatial shards.

Why: half a million small files (the MLPerf split) stall parallel file systems on metadata, and a
whole-sample read per spatial rank wastes I/O. One file per split with ``x`` (N, S, S, S, C) int16
and ``y`` (N, 4) float32, chunked ``(1, S/sd, S/sh, S/sw, C)``, lets a rank of an sd×sh×sw spatial
group read exactly the chunks of its own shard (HDF5 reads whole chunks)::

    python -m cosmoflow.pack --src data/universes --out data/train.h5 --sample-size 64 --chunk-split 2,2,1

``--src`` is anything :func:`cosmoflow.data.open_dataset` reads (raw universes are cut into
sub-cubes on the way). Datasets carry Fletcher-32 checksums, which HDF5 verifies on every read
(:mod:`cosmoflow.validate`). ``--range a:b`` packs only samples a..b-1 of the source, e.g. to split train
from validation; ranges at multiples of the sub-cubes per universe keep universes whole. The file is
written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import h5py
import numpy as np

from cosmoflow.data import open_dataset
from cosmoflow.generate import ProgressBar

PACKED_FORMAT = "hybridpar-packed-v1"


def parse_split(text: str) -> tuple[int, int, int]:
    """``"2,2,1"`` -> (2, 2, 1)."""
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 3 or min(parts) < 1:
        raise ValueError(f"chunk split must be three positive integers sd,sh,sw, got {text!r}")
    return parts  # type: ignore[return-value]


def parse_range(text: str | None, total: int) -> range:
    """``"a:b"`` (either side optional) -> the sample indices it selects out of ``total``."""
    if text is None:
        return range(total)
    start, sep, stop = text.partition(":")
    try:
        a = int(start) if start else 0
        b = int(stop) if stop else total
    except ValueError:
        a, b = -1, -1
    if not sep or not 0 <= a < b <= total:
        raise ValueError(f"range must be start:stop with 0 <= start < stop <= {total} (the source's "
                         f"samples), got {text!r}")
    return range(a, b)


def chunk_shape(sample_size: int, split: tuple[int, int, int], channels: int) -> tuple[int, ...]:
    """Chunk of one shard: (1, S/sd, S/sh, S/sw, C); the split must divide the sample size."""
    for axis, parts in zip("dhw", split, strict=True):
        if sample_size % parts:
            fits = ", ".join(str(p) for p in range(1, sample_size + 1) if sample_size % p == 0 and p <= 64)
            raise ValueError(f"sample size {sample_size} does not split into {parts} shards along {axis}; "
                             f"splits that fit: {fits}")
    return (1, *(sample_size // p for p in split), channels)


def pack(src: str | os.PathLike | list, out: str | os.PathLike, sample_size: int | None,
         split: tuple[int, int, int] = (2, 2, 1), select: str | None = None, progress: bool = True) -> Path:
    """Write the samples of ``src`` (optionally only ``select`` = "a:b") to the packed file ``out``."""
    ds = open_dataset(src, sample_size=sample_size)
    indices = parse_range(select, len(ds))
    s, c = ds.sample_size, ds.channels
    chunks = chunk_shape(s, split, c)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    bar = ProgressBar(len(indices), label=f"pack {out.name}", unit="sample") if progress else None
    try:
        with h5py.File(tmp, "w") as f:
            # Fletcher-32: HDF5 checks each chunk on read, so a damaged file is an error, not a NaN loss
            x = f.create_dataset("x", shape=(len(indices), s, s, s, c), dtype=np.int16, chunks=chunks,
                                 fletcher32=True)
            f.create_dataset("y", data=ds.labels[indices.start:indices.stop].astype(np.float32),
                             fletcher32=True)
            f.attrs["format"] = PACKED_FORMAT
            f.attrs["sample_size"] = s
            f.attrs["chunk_split"] = np.asarray(split)
            f.attrs["source_samples"] = np.array([indices.start, indices.stop])
            for n, i in enumerate(indices):
                x[n] = ds.read_raw(i)[0]
                if bar:
                    bar.update()
        os.replace(tmp, out)
    finally:
        ds.close()
        if bar:
            bar.close()
        if tmp.exists():
            tmp.unlink()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosmoflow.pack", description=__doc__.split("\n")[0])
    parser.add_argument("--src", required=True, nargs="+",
                        help="directory, HDF5 file or glob of universes / MLPerf split files")
    parser.add_argument("--out", required=True, help="packed HDF5 file to write")
    parser.add_argument("--sample-size", type=int, required=True, help="voxels per side of a sample")
    parser.add_argument("--chunk-split", default="2,2,1",
                        help="spatial shards per sample along d,h,w that chunks align to (default 2,2,1)")
    parser.add_argument("--range", dest="select", default=None, help="only source samples start:stop")
    args = parser.parse_args(argv)
    try:
        out = pack(args.src, args.out, args.sample_size, parse_split(args.chunk_split), args.select)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    with h5py.File(out, "r") as f:
        print(f"{out}: {f['x'].shape[0]} samples of {args.sample_size}^3, chunks {f['x'].chunks}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
