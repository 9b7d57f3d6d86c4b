"""What a CosmoFlow HDF5 file holds, found out before any sample is read: its format, its sample size, its
labels, each dataset's shape and dtype checked.

Why apart from the reader (:mod:`cosmoflow.data`): the files are inspected once, when a dataset is
opened, and everything here is that one pass (which files a path names, which of the three formats
each is, whether it holds what its format needs), refusing a bad file in one line naming it and what
would fit; the reader then only reads. :func:`hybridpar.data.hdf5.check_datasets` runs first, so that
no dataset linking outside its folder or declaring more than the file holds is opened.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import h5py
import numpy as np

from hybridpar.data.hdf5 import check_datasets

Format = Literal["universe", "split", "packed"]
Target = Literal["params", "linear"]
PathsLike = str | os.PathLike | Iterable[str | os.PathLike]
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf")


@dataclass(frozen=True)
class FileEntry:
    """One file's place in the dataset: its format and how its samples are laid out."""

    path: str
    format: Format
    count: int
    """Samples in this file."""
    per_side: int = 1
    """Sub-cubes per side (raw universes); 1 otherwise."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def expand_paths(paths: PathsLike) -> list[str]:
    """Files named by a directory, a file, a glob or a list of those, in a stable order."""
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    if not items:
        raise FileNotFoundError("no paths given; expected a directory, an HDF5 file, a glob or a list")
    files: list[str] = []
    for item in items:
        p = os.fspath(item)
        if os.path.isdir(p):
            found = sorted(str(f) for f in Path(p).iterdir()
                           if f.is_file() and f.suffix.lower() in HDF5_SUFFIXES)
            if not found:
                raise FileNotFoundError(f"{p}: no HDF5 files ({', '.join('*' + s for s in HDF5_SUFFIXES)}) "
                                        "in this directory")
            files.extend(found)
        elif os.path.isfile(p):
            files.append(p)
        elif any(ch in p for ch in "*?["):
            found = sorted(f for f in glob.glob(p) if os.path.isfile(f))
            if not found:
                raise FileNotFoundError(f"{p}: the glob matches no files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"{p}: no such file or directory")
    return files


def _dataset(f: h5py.File, path: str, name: str) -> h5py.Dataset:
    obj = f.get(name)
    if not isinstance(obj, h5py.Dataset):
        found = ", ".join(sorted(f.keys())) or "nothing"
        raise ValueError(f"{path}: no dataset '{name}' (found: {found}); expected 'full' + 'unitPar' "
                         "(raw universe) or 'x' + 'y' (MLPerf split or packed)")
    return obj


def _check_counts(ds: h5py.Dataset, path: str, name: str, want: str) -> None:
    if ds.dtype != np.int16:
        raise ValueError(f"{path}: dataset '{name}' has dtype {ds.dtype}; expected int16 particle counts "
                         f"of shape {want}")


def _check_labels(ds: h5py.Dataset, path: str, name: str, want: tuple[int, ...], n_outputs: int) -> None:
    if ds.shape != want:
        raise ValueError(f"{path}: dataset '{name}' has shape {ds.shape}; expected {want} "
                         f"({n_outputs} parameters per sample)")
    if ds.dtype.kind not in "fiu":
        raise ValueError(f"{path}: dataset '{name}' has dtype {ds.dtype}; expected float32 parameters")


def _cube_side(shape: tuple[int, ...], lead: int, channels: int) -> int | None:
    """Side S if ``shape`` is ``lead`` leading dims then (S, S, S, C) with C >= ``channels``, else None
    (the first ``channels`` are read: 1 is the z = 0 field alone)."""
    if len(shape) != lead + 4:
        return None
    s = shape[lead:lead + 3]
    return s[0] if s[0] == s[1] == s[2] and s[0] > 0 and shape[-1] >= channels else None


def _check_linear(f: h5py.File, path: str, side: int) -> None:
    """The reconstruction target beside a raw universe: ``linear`` (U, U, U) floats."""
    obj = f.get("linear")
    if not isinstance(obj, h5py.Dataset):
        raise ValueError(f"{path}: no dataset 'linear' (the initial density field the reconstruction task "
                         "predicts); generate the universes again with python -m cosmoflow.generate "
                         "(without --no-linear)")
    if obj.shape != (side,) * 3 or obj.dtype.kind != "f":
        raise ValueError(f"{path}: dataset 'linear' has shape {obj.shape} and dtype {obj.dtype}; expected "
                         f"{(side,) * 3} floats, the size of 'full' without its channels")


def inspect_file(path: str, sample_size: int | None, channels: int = 4, n_outputs: int = 4,
                 size_from: str = "", target: Target = "params") -> tuple[FileEntry, int, np.ndarray]:
    """Detect the format of one file: (entry, sample size, labels (count, n_outputs) float32).

    ``size_from`` names where ``sample_size`` came from when it was not given (for the error message);
    ``target="linear"`` also requires the reconstruction target, which only raw universes carry.
    """
    try:
        f = h5py.File(path, "r")
    except OSError as err:
        raise ValueError(f"{path}: not a readable HDF5 file ({err})") from None
    with f:
        check_datasets(f, ("full", "unitPar", "linear", "x", "y"))  # before any is opened (or read)
        if "full" in f:
            full = _dataset(f, path, "full")
            want = f"(U, U, U, C >= {channels}) with U a multiple of the sample size"
            side = _cube_side(full.shape, 0, channels)
            if side is None:
                raise ValueError(f"{path}: dataset 'full' has shape {full.shape}; expected {want}")
            _check_counts(full, path, "full", want)
            if "unitPar" not in f:
                raise ValueError(f"{path}: raw universe without dataset 'unitPar'; expected 'unitPar' of "
                                 f"shape ({n_outputs},) beside 'full'")
            par = _dataset(f, path, "unitPar")
            _check_labels(par, path, "unitPar", (n_outputs,), n_outputs)
            if target == "linear":
                _check_linear(f, path, side)
            size = side if sample_size is None else sample_size
            if side % size:
                fits = ", ".join(str(d) for d in _divisors(side))
                raise ValueError(f"{path}: sample_size {size} does not divide the universe size {side}; "
                                 f"sample sizes that fit: {fits}")
            n = side // size
            labels = np.repeat(np.asarray(par[()], dtype=np.float32)[None], n ** 3, axis=0)
            return FileEntry(path, "universe", n ** 3, n), size, labels
        if "x" in f and target == "linear":
            raise ValueError(f"{path}: an MLPerf split or packed file holds no initial density field; the "
                             "reconstruction task reads raw universes ('full' + 'unitPar' + 'linear') as "
                             "python -m cosmoflow.generate writes them")
        if "x" in f:
            x = _dataset(f, path, "x")
            if "y" not in f:
                raise ValueError(f"{path}: dataset 'x' without dataset 'y'; expected 'y' of shape "
                                 f"({n_outputs},) (MLPerf split) or (N, {n_outputs}) (packed)")
            y = _dataset(f, path, "y")
            lead = len(x.shape) - 4
            side = _cube_side(x.shape, lead, channels) if lead in (0, 1) else None
            if side is None:
                raise ValueError(f"{path}: dataset 'x' has shape {x.shape}; expected (S, S, S, C >= "
                                 f"{channels}) (MLPerf split) or (N, S, S, S, C >= {channels}) (packed)")
            _check_counts(x, path, "x", f"(S, S, S, {channels})")
            if sample_size is not None and sample_size != side:
                wanted = f"size {sample_size} of {size_from}" if size_from else f"sample_size {sample_size}"
                raise ValueError(f"{path}: holds samples of size {side}, not the {wanted}; use "
                                 f"sample_size={side} or a divisor of the universes' size (only raw "
                                 "universes are cut to size)")
            if lead == 0:
                _check_labels(y, path, "y", (n_outputs,), n_outputs)
                return FileEntry(path, "split", 1), side, np.asarray(y[()], dtype=np.float32)[None]
            count = x.shape[0]
            _check_labels(y, path, "y", (count, n_outputs), n_outputs)
            return FileEntry(path, "packed", count), side, np.asarray(y[()], dtype=np.float32)
        found = ", ".join(sorted(f.keys())) or "nothing"
        raise ValueError(f"{path}: no dataset 'full' or 'x' (found: {found}); expected 'full' + 'unitPar' "
                         "(raw universe) or 'x' + 'y' (MLPerf split or packed)")
