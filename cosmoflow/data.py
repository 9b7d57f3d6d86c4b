"""CosmoFlow samples from HDF5, whole or as a spatial region read straight from the file.

Why: a rank of a spatial group needs only its own sub-volume of each sample. Reading the whole
16 MiB sample and slicing it in memory would multiply the I/O by the number of spatial ranks, so
``read(i, region)`` turns the region into an HDF5 hyperslab and only those voxels leave the file
(and, with chunks aligned to the shards, only those chunks).

Three on-disk formats are recognised per file, all channels last with int16 particle counts:

====================  ======================================  ==========================================
format                datasets                                samples per file
====================  ======================================  ==========================================
raw universe          ``full`` (U, U, U, C), ``unitPar`` (4,)  (U/S)³ sub-cubes, numbered (i·n + j)·n + k
MLPerf split          ``x`` (S, S, S, C), ``y`` (4,)           1
packed (ours)         ``x`` (N, S, S, S, C), ``y`` (N, 4)      N, one chunked file per split
====================  ======================================  ==========================================

Sub-cube (i, j, k) of a raw universe (i along axis 0, …) is sample ``(i·n + j)·n + k`` of that file,
the order in which MLPerf's prepare step splits a universe with ``np.split`` over axes 0, 1, 2.

In memory a sample is ``x`` float32 (C, d, h, w) channels first after ``log1p``, and ``y`` the target
of the task: the four parameters, float32 (4,), or for the reconstruction task (``target="linear"``)
the same region of the raw universe's ``linear`` dataset (the initial density field), float32
(1, d, h, w), read as a hyperslab like the input and so split like it.

h5py handles cannot cross a fork or be pickled, so files are opened lazily, on the first read in
each process; pickling drops them and a process that finds handles opened by another pid discards
them (:class:`cosmoflow.data_process.ProcessState` holds them, with the process's counters and
verdicts). The files are inspected once in :func:`open_dataset` (and closed again) to detect the
formats and keep all labels in memory, which also gives the loader ``labels`` for free; before that,
:mod:`cosmoflow.data_files` does that inspection, :func:`hybridpar.data.hdf5.check_datasets` first
refusing a file whose datasets link outside its folder or declare more than the file holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import get_args

import numpy as np
import torch

from cosmoflow.data_files import HDF5_SUFFIXES, FileEntry, PathsLike, Target, expand_paths, inspect_file
from cosmoflow.data_process import ProcessState
from cosmoflow.validate import (
    LABEL_BOUND,
    DataError,
    checked_read,
    count_problem,
    field_problem,
    label_problem,
)

Region = tuple[slice, slice, slice]
"""Three slices (start/stop, no step) in a sample's voxel coordinates along D, H, W."""
TARGETS: tuple[str, ...] = get_args(Target)
__all__ = ["HDF5_SUFFIXES", "CosmoDataset", "FileEntry", "Region", "log_counts", "open_dataset"]


def _region_bounds(region: Sequence[slice] | None, size: int) -> tuple[tuple[int, int], ...]:
    """``((d0, d1), (h0, h1), (w0, w1))`` of a region, checked against a sample of side ``size``."""
    if region is None:
        return ((0, size),) * 3
    if not isinstance(region, tuple | list) or len(region) != 3 or not all(isinstance(s, slice)
                                                                           for s in region):
        raise ValueError(f"region must be 3 slices along D, H, W, got {region!r}")
    bounds = []
    for s in region:
        start = 0 if s.start is None else s.start
        stop = size if s.stop is None else s.stop
        if s.step not in (None, 1) or not (0 <= start < stop <= size):
            raise ValueError(f"region {region!r} is not 3 slices with 0 <= start < stop <= {size} and "
                             "no step")
        bounds.append((int(start), int(stop)))
    return tuple(bounds)


class CosmoDataset:
    """Samples of one or more HDF5 files; picklable, opening files lazily in each process.

    ``bytes_read`` counts the raw (int16) bytes of the hyperslabs this process read, and
    ``chunk_bytes_read`` the bytes of the HDF5 chunks those hyperslabs touch (what a cold read fetches
    from disk); both restart from zero in a new process.
    """

    def __init__(self, entries: list[FileEntry], labels: np.ndarray, sample_size: int, channels: int,
                 chunk_cache_bytes: int | None = None, target: Target = "params", skip_bad: bool = False
                 ) -> None:
        self.entries = entries
        self.target = target
        self.skip_bad = skip_bad
        """Read the next good sample in place of a bad one (each judged whole, see :meth:`read_raw`)."""
        self.labels = labels
        """All labels (len, n_outputs) float32, in sample order."""
        self.sample_size = sample_size
        self.channels = channels
        self.chunk_cache_bytes = chunk_cache_bytes
        self._process = ProcessState(chunk_cache_bytes)
        """This process's open files, byte counters and verdicts (dropped on pickling and on a fork)."""
        self._starts = np.cumsum([0] + [e.count for e in entries])
        far = np.abs(labels).max(1, initial=0) > LABEL_BOUND
        suspect = np.flatnonzero(~np.isfinite(labels).all(1) | far)  # checked one by one below
        self._bad_labels = {int(i): p for i in suspect if (p := label_problem(labels[i])) is not None}
        if self._bad_labels and not skip_bad:
            i, problem = next(iter(self._bad_labels.items()))
            raise DataError(f"{self.describe(i)}: {problem}{_HINT}")

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def periodic(self) -> bool:
        """Whether every sample is a whole periodic box (a raw universe read uncut), which a periodic
        roll maps onto another valid sample; a crop or an MLPerf split sub-volume is not one."""
        return all(e.format == "universe" and e.per_side == 1 for e in self.entries)

    def __repr__(self) -> str:
        kinds = sorted({e.format for e in self.entries})
        return (f"CosmoDataset({len(self)} samples of {self.sample_shape} from {len(self.entries)} files, "
                f"formats {', '.join(kinds)})")

    @property
    def sample_shape(self) -> tuple[int, int, int, int]:
        """In-memory shape of a whole sample, channels first."""
        s = self.sample_size
        return (self.channels, s, s, s)

    @property
    def sample_nbytes(self) -> int:
        """Raw (int16, on-disk) bytes of one whole sample."""
        return self.channels * self.sample_size ** 3 * 2

    @property
    def bytes_read(self) -> int:
        return self._process.here().bytes_read

    @property
    def chunk_bytes_read(self) -> int:
        return self._process.here().chunk_bytes_read

    def reset_counters(self) -> None:
        here = self._process.here()
        here.bytes_read = here.chunk_bytes_read = 0

    def locate(self, index: int) -> tuple[FileEntry, int]:
        """The file holding sample ``index`` and the sample's index inside that file."""
        index = self._index(index)
        f = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.entries[f], index - int(self._starts[f])

    def describe(self, index: int) -> str:
        """``path: sample k`` (with its sub-cube for a raw universe), for messages."""
        entry, local = self.locate(index)
        where = f"{entry.path}: sample {local}"
        if entry.format == "universe" and entry.per_side > 1:
            n = entry.per_side
            where += f" (sub-cube {(local // (n * n), (local // n) % n, local % n)})"
        return where

    def problem(self, index: int) -> str | None:
        """What is wrong with sample ``index``, read whole (counts, parameters, the initial field if the
        file has one, checksums), as a message naming file and sample; None if it is good. Cached in
        this process."""
        verdicts = self._process.here().verdicts
        index = self._index(index)
        if index in verdicts:
            return verdicts[index]
        entry, local = self.locate(index)
        where = self.describe(index)
        problem = self._bad_labels.get(index)
        try:
            if problem is None:
                sel = self._slab(entry, local, None)
                name = "full" if entry.format == "universe" else "x"
                lead = ((local, local + 1),) if entry.format == "packed" else ()
                ds = self._process.file(entry.path)[name]
                x = checked_read(lambda: ds[tuple(slice(a, b) for a, b in (*lead, *sel))], where)
                problem = count_problem(x[0] if lead else x, of="the sample", name=name)
            if problem is None and entry.format == "universe" and "linear" in self._process.file(entry.path):
                lin = self._process.file(entry.path)["linear"]
                problem = field_problem(checked_read(lambda: lin[tuple(slice(a, b) for a, b in sel)], where))
        except DataError as err:
            verdicts[index] = str(err)
            return str(err)
        verdicts[index] = None if problem is None else f"{where}: {problem}"
        return verdicts[index]

    def _usable(self, index: int) -> int:
        """``index``, or with ``skip_bad`` the next good sample after it (recording the skipped ones)."""
        index = self._index(index)
        if not self.skip_bad:
            return index
        here = self._process.here()
        for step in range(len(self)):
            j = (index + step) % len(self)
            new = j not in here.verdicts
            problem = self.problem(j)
            if problem is None:
                return j
            if new:
                here.skipped.append(problem)
        raise DataError(f"every one of the {len(self)} samples is bad; the first: {self.problem(index)}")

    def take_skipped(self) -> list[str]:
        """The bad samples this process skipped since the last call (the loader gathers them)."""
        here = self._process.here()
        out, here.skipped = here.skipped, []
        return out

    def _index(self, index: int) -> int:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"sample {index} out of range for a dataset of {n} samples")
        return int(index) % n

    def _slab(self, entry: FileEntry, local: int, region: Region | None) -> tuple[tuple[int, int], ...]:
        """The region's voxel bounds along D, H, W in the file's dataset (after a packed file's index)."""
        bounds = _region_bounds(region, self.sample_size)
        if entry.format != "universe":
            return bounds
        n, s = entry.per_side, self.sample_size
        corner = (local // (n * n), (local // n) % n, local % n)
        return tuple((c * s + a, c * s + b) for c, (a, b) in zip(corner, bounds))

    def read_raw(self, index: int, region: Region | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)`` as stored: x int16 (d, h, w, C) channels last, y the float32 parameters; only the
        region is read."""
        index = self._usable(index)
        entry, local = self.locate(index)
        f = self._process.file(entry.path)
        sel = self._slab(entry, local, region) + ((0, self.channels),)
        where = f"{self.describe(index)}, region {_region_text(sel)}"
        read_slab = self._process.read_slab
        if entry.format == "universe":
            x = checked_read(lambda: read_slab(f["full"], sel), where, _HINT)
        elif entry.format == "split":
            x = checked_read(lambda: read_slab(f["x"], sel), where, _HINT)
        else:
            x = checked_read(lambda: read_slab(f["x"], ((local, local + 1), *sel))[0], where, _HINT)
        problem = count_problem(x, name="full" if entry.format == "universe" else "x")
        if problem is not None:
            raise DataError(f"{where}: {problem}{_HINT}")
        return x, self.labels[index].copy()

    def read_linear(self, index: int, region: Region | None = None) -> np.ndarray:
        """The reconstruction target of sample ``index``: its region of ``linear``, float32 (d, h, w)."""
        index = self._usable(index)
        entry, local = self.locate(index)
        if entry.format != "universe":
            raise ValueError(f"{entry.path}: only raw universes carry the initial density field 'linear'")
        ds = self._process.file(entry.path)["linear"]
        sel = self._slab(entry, local, region)
        where = f"{self.describe(index)}, region {_region_text(sel)}"
        y = np.asarray(checked_read(lambda: self._process.read_slab(ds, sel), where, _HINT), dtype=np.float32)
        problem = field_problem(y)
        if problem is not None:
            raise DataError(f"{where}: {problem}{_HINT}")
        return y

    def read(self, index: int, region: Region | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: x float32 (C, d, h, w) channels first, ``log1p`` of the counts; y the target.

        Without ``region`` the whole sample, (C, S, S, S); with it only that hyperslab is read, of the
        input and, for ``target="linear"``, of the target, which is then float32 (1, d, h, w).
        """
        index = self._usable(index)
        raw, y = self.read_raw(index, region)
        x = log_counts(raw)
        if self.target == "linear":
            y = self.read_linear(index, region)[None]
        return torch.from_numpy(x), torch.from_numpy(y)

    def read_stored(self, index: int, region: Region | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` with x the stored counts, int16 (d, h, w, C): half the bytes of ``read``'s x, to be
        finished (:meth:`finish`) on the device it is trained on."""
        index = self._usable(index)
        raw, y = self.read_raw(index, region)
        if self.target == "linear":
            y = self.read_linear(index, region)[None]
        return torch.from_numpy(raw), torch.from_numpy(y)

    @staticmethod
    def finish(x: torch.Tensor) -> torch.Tensor:
        """A batch of stored counts (b, d, h, w, C) as the network's input: float32 (b, C, d, h, w)
        ``log1p`` of the counts, as :func:`log_counts` gives, laid out channels last in memory (the
        stored order; the engine makes it contiguous where the model wants that)."""
        return x.permute(0, 4, 1, 2, 3).float().log1p_()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read(index)

    def close(self) -> None:
        """Close this process's open files (they reopen on the next read)."""
        self._process.close()


def log_counts(raw: np.ndarray) -> np.ndarray:
    """The network's input from stored counts (d, h, w, C) channels last: float32 (C, d, h, w),
    ``log1p`` of the counts (what every reader of a sample, training or inference, feeds the model)."""
    # numpy, not torch: torch's OpenMP pool deadlocks in a forked child once the parent has used
    # it, and loader workers are forked; numpy's ufuncs run single-threaded and fork-safe.
    x = np.empty((raw.shape[3], *raw.shape[:3]), dtype=np.float32)
    np.copyto(x, raw.transpose(3, 0, 1, 2), casting="unsafe")
    np.log1p(x, out=x)
    return x


def open_dataset(paths: PathsLike, sample_size: int | None = None, channels: int = 4, n_outputs: int = 4,
                 chunk_cache_bytes: int | None = None, target: Target = "params", skip_bad: bool = False
                 ) -> CosmoDataset:
    """Open CosmoFlow samples from a directory, an HDF5 file, a glob or a list of those.

    ``sample_size`` cuts raw universes into cubes of that side and must match the other formats; None
    takes each file's natural size (a whole universe is one sample), which must then agree across files.
    ``chunk_cache_bytes`` sets h5py's per-file chunk cache (default 1 MiB). ``target`` picks what
    ``y`` is: ``"params"`` (the four parameters) or ``"linear"`` (the initial density field).

    Every read checks what it read (:mod:`cosmoflow.check`): a bad sample is a :class:`DataError`
    naming file, sample and problem. With ``skip_bad`` the next good sample is read in its place
    instead, and :meth:`CosmoDataset.take_skipped` names the skipped ones. A skipped sample is judged
    on its whole volume, read once per process, so that every rank of a spatial group, each reading
    its own region, skips the same samples.
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if sample_size is not None and sample_size < 1:
        raise ValueError(f"sample_size must be a positive number of voxels, got {sample_size}")
    entries: list[FileEntry] = []
    labels: list[np.ndarray] = []
    size: int | None = sample_size
    size_from = ""
    for path in expand_paths(paths):
        entry, side, lab = inspect_file(path, size, channels, n_outputs, size_from, target)
        if size is None:  # the first file fixes the size the others must have (or be cut to)
            size, size_from = side, f"the first file {path}"
        entries.append(entry)
        labels.append(lab)
    assert size is not None
    return CosmoDataset(entries, np.concatenate(labels), size, channels, chunk_cache_bytes, target, skip_bad)


_HINT = ("; check the files with python -m cosmoflow.check, replace the damaged one, or set "
         "data.skip_bad: true to skip bad samples")


def _region_text(sel: Sequence[tuple[int, int]]) -> str:
    """``d 0:8, h 0:16, w 0:16`` of a slab's voxel bounds (in the file's dataset)."""
    return ", ".join(f"{axis} {a}:{b}" for axis, (a, b) in zip("dhw", sel[:3]))
