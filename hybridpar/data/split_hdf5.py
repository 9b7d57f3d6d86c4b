"""One HDF5 dataset written by many ranks, each its own hyperslab, never gathered.

Why: a split output (a volume predicted voxel by voxel) should leave the job the way it was computed,
each rank writing its shard, yet a reader should see one dataset. Two ways, one result:

* ``mpi``: h5py built with the MPI driver and ranks started by mpirun or srun: every rank opens the
  one file (``driver="mpio"``) and writes its hyperslab;
* ``files`` (any h5py): each writing rank puts its shard into ``STEM.rankNNNN.h5`` beside the output,
  and rank 0 writes the output as an HDF5 virtual dataset mapping those files (by relative name, so the
  folder may move; HDF5 finds them beside the output). Where one rank holds the whole output (one
  process, or a split whose output is replicated), its file *is* the output: one self-contained file,
  which may be copied alone (a virtual dataset copied without its rank files reads as its fill value).

Nothing is half-written under a final name, and nothing we did not write is replaced: every file a write
will create (the output, and in ``files`` mode on several ranks each rank file) is checked before any
work, and an existing one is refused unless ``overwrite`` (a directory always). So are the rank files
of that output an earlier, more split write left (``OUT.rank0003.h5`` where this write makes 2 or none):
refused without ``overwrite``; with it, removed once the new output is in place (:attr:`SplitHdf5.removed`
names them), so that no stale shard sits beside an output that does not use it. Each file is written
under a temporary name in the same folder and renamed into place once complete (rank files first, the
output last), in :meth:`commit`; a failure removes the temporary files (and the rank files just placed,
should the output's own rename fail). ``HYBRIDPAR_HDF5_WRITER=files`` (or ``mpi``) forces a mode.
"""

from __future__ import annotations

import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch.distributed as dist

from hybridpar.process.launchers import detect_launcher

MODE_ENV = "HYBRIDPAR_HDF5_WRITER"
"""``files`` forces one file per rank and a virtual dataset; ``mpi`` requires h5py's MPI driver."""

Box = tuple[tuple[int, int], ...]


def writer_mode() -> str:
    """``mpi`` where h5py has the MPI driver and an MPI launcher started the ranks, else ``files``."""
    forced = os.environ.get(MODE_ENV, "")
    if forced not in ("", "files", "mpi"):
        raise ValueError(f"{MODE_ENV}={forced}: expected 'files' or 'mpi'")
    launched = detect_launcher()
    by_mpi = launched is not None and launched[0] != "torchrun"
    has_mpi = bool(h5py.get_config().mpi)
    if forced == "mpi" and not (has_mpi and by_mpi):
        why = "this h5py has no MPI driver" if not has_mpi else "the ranks were not started by mpirun or srun"
        raise ValueError(f"{MODE_ENV}=mpi: {why}")
    return forced or ("mpi" if has_mpi and by_mpi else "files")


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _agreed_token() -> str:
    """A random suffix every rank agrees on (rank 0's): the temporary names of one write."""
    token = [secrets.token_hex(4)]
    if _world()[1] > 1:
        dist.broadcast_object_list(token, src=0)
    return token[0]


def _barrier() -> None:
    if _world()[1] > 1:
        dist.barrier()


def _agreed_error(mine: str, src: int) -> str:
    """Rank ``src``'s error message (empty: none) on every rank, so that all fail together."""
    held = [mine]
    if _world()[1] > 1:
        dist.broadcast_object_list(held, src=src)
    return held[0]


def _first_error(mine: str) -> str:
    """The first rank's error message of any rank's (empty: none), on every rank."""
    if _world()[1] == 1:
        return mine
    every: list[Any] = [None] * _world()[1]
    dist.all_gather_object(every, mine)
    return next((e for e in every if e), "")


def part_name(path: str | os.PathLike, rank: int) -> str:
    """The name of rank ``rank``'s file of output ``path`` (``files`` mode), beside the output."""
    return f"{Path(path).stem}.rank{rank:04d}.h5"


def planned_files(path: str | os.PathLike, world: int, mode: str) -> list[Path]:
    """Every file a write of ``path`` on ``world`` ranks in ``mode`` may create: the output, and in
    ``files`` mode on several ranks each rank's file (which ranks write is known only once they have
    written, so all of them are counted)."""
    out = Path(path)
    parts = [out.with_name(part_name(out, r)) for r in range(world)] if mode == "files" and world > 1 else []
    return [out, *parts]


def rank_files_beside(path: str | os.PathLike) -> list[Path]:
    """The rank files of output ``path`` that exist beside it: names :func:`part_name` gives for some
    rank (``OUT.rank0003.h5``), and nothing else (not ``OUT.rank3.h5``, not another output's)."""
    out = Path(path)
    pattern = re.compile(re.escape(out.stem) + r"\.rank([0-9]+)\.h5")
    try:
        names = os.listdir(out.parent)
    except OSError:
        return []
    found = [n for n in names if (m := pattern.fullmatch(n)) and n == part_name(out, int(m.group(1)))]
    return [out.with_name(n) for n in sorted(found)]


def check_targets(path: str | os.PathLike, world: int, mode: str, overwrite: bool) -> None:
    """Refuse, in one line naming the file, to create ``path`` where a file it would create is a directory,
    or exists and ``overwrite`` is false; or where the output's folder does not exist; or, without
    ``overwrite``, where a rank file of ``path`` that this write does not create exists (an earlier,
    more split write's, which the write would otherwise leave beside an output that does not use it).
    Every rank sees the same files, so every rank raises the same line."""
    out = Path(path)
    if not out.parent.is_dir():
        raise ValueError(f"output folder {out.parent} does not exist")
    planned = planned_files(out, world, mode)
    for p in planned:
        rank_file = p != out
        name = f"output {out}: its rank file {p}" if rank_file else f"output {p}"
        if p.is_dir():
            raise ValueError(f"{name} is a directory; name a file to write")
        if os.path.lexists(p) and not overwrite:
            earlier = " (from an earlier split write)" if rank_file else ""
            raise ValueError(f"{name} exists{earlier}; pass --overwrite to replace it")
    stale = [p for p in rank_files_beside(out) if p not in planned]
    if stale and not overwrite:
        more = f" and {len(stale) - 1} more" if len(stale) > 1 else ""
        raise ValueError(f"output {out}: the rank file {stale[0]}{more} of an earlier split write exists; "
                         "pass --overwrite to replace the output and remove it")


class SplitHdf5:
    """Dataset ``name`` of shape ``shape`` (N, C, D, H, W) in a new file ``path``, written split.

    Collective: every rank constructs it and calls :meth:`commit`. A rank assigns
    ``writer[n, :, d0:d1, h0:h1, w0:w1] = shard`` for its one box (any volumes ``n``, always the same
    box; a rank may write nothing). Refuses (:func:`check_targets`) an existing output or rank file
    unless ``overwrite``, and a directory in their place always. With ``overwrite``, the rank files of
    the output that this write did not write are removed once it is in place, and listed in
    :attr:`removed` (on rank 0).
    """

    def __init__(self, path: str | os.PathLike, name: str, shape: tuple[int, ...], dtype: Any = "float32",
                 overwrite: bool = False) -> None:
        self.path, self.name, self.shape = Path(path), name, tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.mode = writer_mode()
        self.rank, self.world = _world()
        self.overwrite = overwrite
        check_targets(self.path, self.world, self.mode, overwrite)
        self.tag = _agreed_token()
        self.tmp = self.path.with_name(f".{self.path.name}.{self.tag}.tmp")
        self.box: Box | None = None
        self.volumes: list[int] = []
        self.file: h5py.File | None = None
        self.ds: h5py.Dataset | None = None
        self.removed: list[Path] = []  # stale rank files of an earlier write, removed by commit (rank 0)
        if self.mode == "mpi":
            from mpi4py import MPI  # noqa: PLC0415 (only with an MPI-enabled h5py)

            self.file = h5py.File(self.tmp, "w", driver="mpio", comm=MPI.COMM_WORLD)
            self.ds = self.file.create_dataset(name, shape=self.shape, dtype=self.dtype)

    def part(self, rank: int) -> str:
        """The name of rank ``rank``'s file (``files`` mode), beside the output."""
        return part_name(self.path, rank)

    def _part_tmp(self) -> Path:
        return self.path.with_name(f".{self.part(self.rank)}.{self.tag}.tmp")

    def __setitem__(self, index: tuple, value: np.ndarray) -> None:
        n, channels, *sel = index
        box = tuple((s.start or 0, self.shape[2 + i] if s.stop is None else s.stop)
                    for i, s in enumerate(sel))
        if channels != slice(None) or len(box) != 3:
            raise ValueError(f"SplitHdf5: write [n, :, d0:d1, h0:h1, w0:w1], got {index}")
        if self.box is None:
            self.box = box
            if self.mode == "files":  # chunked by volume: volumes another replica writes take no room
                self.file = h5py.File(self._part_tmp(), "w")
                local = (*self.shape[:2], *(hi - lo for lo, hi in box))
                self.ds = self.file.create_dataset(self.name, shape=local, dtype=self.dtype,
                                                   chunks=_chunks(local, self.dtype.itemsize))
        elif box != self.box:
            raise ValueError(f"SplitHdf5: rank {self.rank} writes box {self.box}, then {box}; one box a rank")
        assert self.ds is not None
        if n not in self.volumes:
            self.volumes.append(int(n))
        if self.mode == "mpi":
            self.ds[index] = value
        else:
            self.ds[n] = value

    def __enter__(self) -> SplitHdf5:
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()

    def abort(self) -> None:
        """Remove this rank's temporary files (not collective: after a failure). A file opened with the
        MPI driver is left open: closing it is collective, and the other ranks may never come."""
        if self.file is not None and self.mode == "files":
            self.file.close()
            self.file = None
        mine = [self._part_tmp()] if self.mode == "files" else []
        if self.rank == 0:
            mine.append(self.tmp)
        for p in mine:
            p.unlink(missing_ok=True)

    def commit(self) -> None:
        """Close and rename into place (collective): rank files first, then the output; on any failure
        the temporary files are removed (:meth:`abort`) and every rank raises the same error. Then, with
        ``overwrite``, rank 0 removes the output's rank files this write did not write (:attr:`removed`)."""
        try:
            written = self._commit()
        except BaseException:
            self.abort()
            raise
        if self.rank == 0 and self.overwrite:
            self.removed = _remove_stale(self.path, written)

    def _commit(self) -> list[str]:
        """Place the files; the names of the rank files placed (none where the output holds the data)."""
        if self.file is not None:
            self.file.close()
            self.file = None
        _barrier()
        if self.mode == "mpi":
            failed = ""
            if self.rank == 0:
                failed = _attempt(lambda: os.replace(self.tmp, self.path), self.path)
            if failed := _agreed_error(failed, 0):
                raise ValueError(failed)
            return []
        held: list[Any] = [(self.box, self.volumes)]
        if self.world > 1:
            held = [None] * self.world
            dist.all_gather_object(held, (self.box, self.volumes))
        sole = self._sole_writer(held)
        if sole is not None:  # one rank holds the whole output: its file is the output
            failed = ""
            if self.rank == sole:
                failed = _attempt(lambda: os.replace(self._part_tmp(), self.path), self.path)
            if failed := _agreed_error(failed, sole):
                raise ValueError(failed)
            return []
        failed = _attempt(lambda: self._write_virtual(held), self.path) if self.rank == 0 else ""
        if failed := _agreed_error(failed, 0):  # nothing placed yet: every rank drops its temporary files
            raise ValueError(failed)
        failed = ""
        if self.box is not None:
            mine = self.path.with_name(self.part(self.rank))
            failed = _attempt(lambda: os.replace(self._part_tmp(), mine), mine)
        failed = _first_error(failed)
        if self.rank == 0:
            failed = failed or _attempt(lambda: os.replace(self.tmp, self.path), self.path)
            if failed:  # the rank files would be left pointing nowhere: they go too
                for rank, (box, _) in enumerate(held):
                    if box is not None:
                        self.path.with_name(self.part(rank)).unlink(missing_ok=True)
        if failed := _agreed_error(failed, 0):
            raise ValueError(failed)
        return [self.part(rank) for rank, (box, _) in enumerate(held) if box is not None]

    def _sole_writer(self, held: list[tuple[Box | None, list[int]]]) -> int | None:
        """The rank that wrote every voxel of every volume, if one rank wrote everything."""
        writers = [r for r, (box, _) in enumerate(held) if box is not None]
        if len(writers) != 1:
            return None
        box, volumes = held[writers[0]]
        whole = tuple((0, s) for s in self.shape[2:])
        if tuple(map(tuple, box)) != whole or sorted(volumes) != list(range(self.shape[0])):
            return None
        return writers[0]

    def _write_virtual(self, held: list[tuple[Box | None, list[int]]]) -> None:
        """Rank 0: the output's temporary file as a virtual dataset over the rank files (by their final
        names), every voxel of every volume mapped once (checked)."""
        layout = h5py.VirtualLayout(shape=self.shape, dtype=self.dtype)
        per_volume: dict[int, list[Box]] = {n: [] for n in range(self.shape[0])}
        for rank, (box, volumes) in enumerate(held):
            if box is None:
                continue
            region = tuple(slice(lo, hi) for lo, hi in box)
            local = (*self.shape[:2], *(hi - lo for lo, hi in box))
            source = h5py.VirtualSource(self.part(rank), self.name, shape=local)
            for n in volumes:
                layout[(n, slice(None), *region)] = source[n]
                per_volume[n].append(box)
        for n, boxes in per_volume.items():
            _check_tiling(boxes, self.shape[2:], f"{self.path} volume {n}")
        with h5py.File(self.tmp, "w") as f:
            f.create_virtual_dataset(self.name, layout, fillvalue=np.nan)


def _remove_stale(path: Path, written: list[str]) -> list[Path]:
    """Remove the rank files of output ``path`` (:func:`rank_files_beside`) not named in ``written``: an
    earlier write's, which the new output does not use. A directory under such a name is left; so is a
    file that cannot be removed. Returns those removed."""
    removed = []
    for p in rank_files_beside(path):
        if p.name in written or p.is_dir():
            continue
        try:
            p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed


def _attempt(action: Callable[[], Any], target: Path) -> str:
    """Run ``action``, which writes ``target``: '' if it did, else one line naming ``target`` and why
    not (an ``OSError``'s reason, not the temporary name it was raised for; a ``ValueError`` as is)."""
    try:
        action()
    except OSError as err:
        return f"output {target} cannot be written: {err.strerror or err}"
    except ValueError as err:
        return str(err)
    return ""


def _chunks(shape: tuple[int, ...], itemsize: int, most: int = 64 << 20) -> tuple[int, ...]:
    """Chunks of one volume and channel, halved along D until at most ``most`` bytes (HDF5 allows 4 GiB)."""
    d, h, w = shape[2:]
    while d > 1 and d * h * w * itemsize > most:
        d = (d + 1) // 2
    return (1, 1, d, h, w)


def _check_tiling(boxes: list[Box], volume: tuple[int, ...], what: str) -> None:
    """The boxes cover ``volume`` exactly once: none overlaps another and their volumes add up."""
    def size(b: Box) -> int:
        return int(np.prod([hi - lo for lo, hi in b]))

    for i, a in enumerate(boxes):
        for b in boxes[:i]:
            if all(max(a[k][0], b[k][0]) < min(a[k][1], b[k][1]) for k in range(3)):
                raise ValueError(f"SplitHdf5 {what}: two ranks wrote the overlapping boxes {a} and {b}")
    if sum(map(size, boxes)) != int(np.prod(volume)):
        raise ValueError(f"SplitHdf5 {what}: the ranks wrote {sum(map(size, boxes))} of the "
                         f"{int(np.prod(volume))} voxels of each volume; every voxel needs a writer")
