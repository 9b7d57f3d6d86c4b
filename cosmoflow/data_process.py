"""What a :class:`~cosmoflow.data.CosmoDataset` holds in one process: its open HDF5 files, the bytes
its reads fetched, and its verdicts on samples and the bad ones it skipped.

Why a class of its own: h5py handles cannot cross a fork or be pickled, and counts and verdicts are
this process's, so all of it is dropped together when the dataset is pickled (a spawned loader worker)
and when another process finds it (a forked one), and starts again empty there; the dataset itself
keeps only what every process shares (the files' layout and labels).
"""

from __future__ import annotations

import math
import os
from typing import Any

import h5py
import numpy as np


class ProcessState:
    """One process's files, counters and verdicts; :meth:`here` starts them afresh in a new process."""

    def __init__(self, chunk_cache_bytes: int | None = None) -> None:
        self.chunk_cache_bytes = chunk_cache_bytes
        self._reset()

    def _reset(self) -> None:
        self.pid = os.getpid()
        self.files: dict[str, h5py.File] = {}
        self.bytes_read = 0
        self.chunk_bytes_read = 0
        self.verdicts: dict[int, str | None] = {}  # sample -> problem (None: good), judged whole
        self.skipped: list[str] = []  # descriptions of samples skipped and not yet taken

    def here(self) -> ProcessState:
        """This state, emptied first if it was made in another process."""
        if self.pid != os.getpid():  # forked: the inherited handles belong to the parent
            self._reset()
        return self

    def __getstate__(self) -> dict[str, Any]:
        return {"chunk_cache_bytes": self.chunk_cache_bytes}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def file(self, path: str) -> h5py.File:
        """``path`` opened for reading in this process (once; with the chunk cache asked for)."""
        files = self.here().files
        f = files.get(path)
        if f is None:
            kw = {} if self.chunk_cache_bytes is None else {"rdcc_nbytes": self.chunk_cache_bytes}
            f = files[path] = h5py.File(path, "r", **kw)
        return f

    def read_slab(self, ds: h5py.Dataset, sel: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The hyperslab ``sel`` of ``ds`` (voxel bounds per axis), counted in :attr:`bytes_read` and,
        by the chunks it touches, in :attr:`chunk_bytes_read`."""
        out = ds[tuple(slice(a, b) for a, b in sel)]
        self.bytes_read += out.nbytes
        self.chunk_bytes_read += _chunk_bytes(ds, sel)
        return out

    def close(self) -> None:
        """Close this process's open files (they reopen on the next read)."""
        files = self.here().files
        for f in files.values():
            f.close()
        files.clear()


def _chunk_bytes(ds: h5py.Dataset, sel: tuple[tuple[int, int], ...]) -> int:
    """Bytes of all chunks a hyperslab touches (HDF5 reads chunks whole); the slab itself if contiguous."""
    item = ds.dtype.itemsize
    if ds.chunks is None:
        return math.prod(b - a for a, b in sel) * item
    count = 1
    for (a, b), c in zip(sel, ds.chunks, strict=True):
        count *= (b - 1) // c - a // c + 1
    return count * math.prod(ds.chunks) * item
