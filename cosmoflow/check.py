"""Check data at the door: ``python -m cosmoflow.check DIR [DIR ...]``.

Why: a damaged universe is cheaper to find before a run than in one. Every sample of every file is
read whole and judged by the loader's own rules (:mod:`cosmoflow.validate`: layout, dtype, the range of
counts and parameters, a dataset of zeros, HDF5 checksums; and before any read, links that leave the
folder and datasets the file does not hold, :mod:`hybridpar.data.hdf5`); each problem is one line
naming the file and the sample.

    python -m cosmoflow.check data/train [data/val ...] [--sample-size 64] [--channels 4]

Exit status 0 if every sample is good, 1 if any is bad, 2 if the arguments are wrong.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from cosmoflow.data import open_dataset
from cosmoflow.data_files import expand_paths
from cosmoflow.validate import DataError


def check_paths(paths: list[str], sample_size: int | None, channels: int,
                out: Callable[[str], None] = print) -> tuple[int, int, int]:
    """Read every sample of every file whole and report each problem with ``out``.

    Returns (files, samples, bad samples); a file that cannot be opened counts as one bad sample.
    """
    files = samples = bad = 0
    for path in expand_paths(paths):
        files += 1
        try:
            ds = open_dataset(path, sample_size=sample_size, channels=channels, skip_bad=True)
        except (ValueError, DataError) as err:
            out(str(err))
            bad += 1
            continue
        try:
            for i in range(len(ds)):
                samples += 1
                try:
                    problem = ds.problem(i)
                except MemoryError:
                    problem = (f"{ds.describe(i)}: a sample of {ds.sample_nbytes / 2 ** 30:.1f} GiB does not "
                               "fit in memory to be read whole; check it in pieces with --sample-size")
                if problem is not None:
                    bad += 1
                    out(problem)
        finally:
            ds.close()
    return files, samples, bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cosmoflow.check", description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="directories, HDF5 files or globs (as data.train takes)")
    parser.add_argument("--sample-size", type=int, default=None,
                        help="cut raw universes into samples of this side (default: one sample a universe)")
    parser.add_argument("--channels", type=int, default=4, help="redshift channels each file must have")
    args = parser.parse_args(argv)
    try:
        files, samples, bad = check_paths(args.paths, args.sample_size, args.channels)
    except FileNotFoundError as err:
        parser.error(str(err))
    verdict = "all good" if not bad else f"{bad} bad"
    print(f"checked {samples} samples in {files} files: {verdict}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
