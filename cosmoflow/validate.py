"""What a good sample looks like: the checks behind the loader and ``python -m cosmoflow.check``.

Why: flipped bytes in one universe used to surface as a ``log1p`` warning and a NaN loss a few steps
later, naming neither the file nor the sample. The same rules run in two places: in the loader on every
read (:mod:`cosmoflow.data`), so a damaged file stops a run, or with ``data.skip_bad`` is skipped, at
the sample that is wrong; and in :mod:`cosmoflow.check`, over every sample of a directory.

Besides the layout and dtype (:func:`cosmoflow.data_files.inspect_file`): particle counts are non-negative
and at most :data:`MAX_COUNT` in a voxel, and not all 0 (a dataset never written); parameters are
finite and within [-1, 1] (``unitPar`` is normalised); the initial density field, where a file has one,
is finite; and HDF5's Fletcher-32 checksums, where the file was written with them (``cosmoflow.pack``
and ``cosmoflow.generate`` write them): HDF5 verifies a chunk on every read, and a mismatch comes back
as an ``OSError`` that only says "filter returned failure", named here as what it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

MAX_COUNT = 16384
"""Most particles one voxel may plausibly hold: the densest halo cores of the real 512³ sets hold
thousands; a count above this is a damaged high-order bit, not physics."""
LABEL_BOUND = 1.0 + 1e-3
"""``unitPar`` lies in [-1, 1] (a little slack for float rounding)."""

T = TypeVar("T")


class DataError(Exception):
    """A sample whose content is wrong; the message names the file, the sample and what is wrong."""


def count_problem(x: np.ndarray, of: str = "the region read", name: str = "full") -> str | None:
    """What is wrong with particle counts ``x`` (d, h, w, C), or None: negative or implausible values
    (the first one located in ``of``), or no particle at all: dataset ``name`` was never written (a
    universe holds about one particle per voxel and channel, so even a thin region holds hundreds)."""
    if x.size == 0:
        return None
    if x.dtype == np.int16:  # one pass: a negative count reads as >= 32768 unsigned
        low, high = 0, int(x.view(np.uint16).max())
    else:
        low, high = int(x.min()), int(x.max())
    if low >= 0 and 0 < high <= MAX_COUNT:
        return None
    if low == high == 0:
        return (f"every particle count of {of} in dataset '{name}' is 0: the dataset was never written (or "
                "written empty); expected the particle counts of a universe")
    bad = (x < 0) | (x > MAX_COUNT)
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    value = int(x[where])
    kind = "negative" if value < 0 else f"implausible (> {MAX_COUNT})"
    return (f"{int(bad.sum())} particle counts out of range [0, {MAX_COUNT}] (first: {value}, {kind}, at "
            f"voxel {where[:3]} channel {where[3]} of {of})")


def label_problem(y: np.ndarray) -> str | None:
    """What is wrong with one sample's parameters ``y`` (4,), or None: non-finite or outside [-1, 1]."""
    y = np.asarray(y, dtype=np.float64)
    if not np.isfinite(y).all():
        return f"parameters {np.array2string(y, precision=4)} are not all finite"
    if np.abs(y).max() > LABEL_BOUND:
        return f"parameters {np.array2string(y, precision=4)} lie outside [-1, 1] (unitPar is normalised)"
    return None


def field_problem(y: np.ndarray) -> str | None:
    """What is wrong with a region of the initial density field, or None: non-finite values."""
    if np.isfinite(y).all():
        return None
    return f"the initial density field 'linear' has {int((~np.isfinite(y)).sum())} non-finite values"


def checked_read(read: Callable[[], T], what: str, hint: str = "") -> T:
    """``read()``, with an HDF5 read failure turned into a :class:`DataError` saying what failed.

    A chunk whose Fletcher-32 checksum does not match fails its filter, and HDF5 reports only "filter
    returned failure during read"; the caller's ``what`` names the file and sample, ``hint`` what to do.
    """
    try:
        return read()
    except OSError as err:
        cause = ("checksum mismatch (Fletcher-32): the file is damaged" if "filter" in str(err)
                 else f"HDF5 could not read it ({err})")
        raise DataError(f"{what}: {cause}{hint}") from None
