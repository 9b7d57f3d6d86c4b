"""The per-rank file: raw tensor bytes, then a header, then a fixed footer; every piece checksummed.

Why not ``torch.save``: it pickles the tensors through a zip writer, while here the bytes of each
host buffer go straight to the file (no extra copy), a reader can fetch one tensor by seeking (a pipeline
stage reads only its own layers), and each piece carries a crc32 (zlib's, cheap beside the write
itself). Layout::

    b"HPCKPT01" | tensor bytes, back to back | header (pickle) | footer: <u64 header length,
                                                                         u32 header crc32, b"HPCKEND1">

The header lists each tensor (key, dtype, shape, offset, size, crc32) and holds the pickled non-tensor
leaves and container shapes of the state (:mod:`.tree`). The footer at the end makes a truncated file
obvious at once; the manifest records each file's size and header crc32, and the header the crc32 of
each tensor, so every byte that matters is verified by any read, whole or partial.

Loading a file unpickles its header: only load checkpoints you trust, as with ``torch.load``.
"""

from __future__ import annotations

import os
import pickle
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint.tree import Flat

MAGIC = b"HPCKPT01"
END = b"HPCKEND1"
FOOTER = struct.Struct("<QI8s")
CHUNK = 16 << 20
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked."""


class CorruptFile(CheckpointError):
    """A file is missing, truncated, or fails its checksum."""


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc: int


@dataclass(frozen=True)
class Written:
    """What the manifest records about one written file."""

    size: int
    header_crc: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint header (written by a newer torch?)")
    return dt


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 and bool included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pack_tree(flat: Flat) -> bytes:
    """The non-tensor part of a state, pickled at snapshot time so later mutation cannot leak in."""
    return pickle.dumps((flat.values, flat.containers), protocol=pickle.HIGHEST_PROTOCOL)


# ---------------------------------------------------------------------------------------- durability
def fsync_dir(path: str | os.PathLike) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that fsyncs each parent whose entries it changed."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir(exist_ok=True)
        fsync_dir(d.parent)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        data = data[n:]


def write_bytes(path: Path, data: memoryview) -> None:
    """Write ``data`` as a whole file and fsync it (a partner copy received over the network)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, tensors: Iterable[tuple[str, torch.Tensor]], tree: bytes,
               on_first_tensor: Callable[[], None] | None = None) -> Written:
    """Write one rank file from host tensors and a packed tree; fsync it; return size and header crc."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, memoryview(MAGIC))
        offset = len(MAGIC)
        table = []
        for i, (key, t) in enumerate(tensors):
            view = byte_view(t)
            crc = 0
            for s in range(0, len(view), CHUNK):
                piece = view[s:s + CHUNK]
                crc = zlib.crc32(piece, crc)
                _write_all(fd, piece)
            table.append(TensorEntry(key, dtype_name(t.dtype), tuple(t.shape), offset, len(view), crc))
            offset += len(view)
            if i == 0 and on_first_tensor is not None:
                on_first_tensor()
        header = pickle.dumps({"format": FORMAT, "tensors": table, "tree": tree},
                              protocol=pickle.HIGHEST_PROTOCOL)
        hcrc = zlib.crc32(header)
        _write_all(fd, memoryview(header + FOOTER.pack(len(header), hcrc, END)))
        os.fsync(fd)
        return Written(offset + len(header) + FOOTER.size, hcrc)
    finally:
        os.close(fd)


def evict(path: Path) -> None:
    """Drop a written file from the page cache (benchmarks: make the next read come from the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- reading
class RankFile:
    """An open rank file whose footer and header have been checked against what the manifest expects."""

    def __init__(self, path: Path, size: int | None = None, header_crc: int | None = None) -> None:
        self.path = path
        try:
            self._f = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        except OSError as e:
            raise CorruptFile(f"{path}: cannot open ({e.strerror})") from None
        try:
            self._check(size, header_crc)
        except BaseException:
            self._f.close()
            raise

    def _check(self, size: int | None, header_crc: int | None) -> None:
        actual = os.fstat(self._f.fileno()).st_size
        if size is not None and actual != size:
            raise CorruptFile(f"{self.path}: {actual} bytes, the manifest says {size} (truncated or "
                              f"overwritten)")
        if actual < len(MAGIC) + FOOTER.size:
            raise CorruptFile(f"{self.path}: {actual} bytes is too short for a checkpoint file")
        self._f.seek(actual - FOOTER.size)
        hlen, hcrc, end = FOOTER.unpack(self._f.read(FOOTER.size))
        self._f.seek(0)
        if self._f.read(len(MAGIC)) != MAGIC or end != END:
            raise CorruptFile(f"{self.path}: not a hybridpar checkpoint file (bad magic; truncated?)")
        if header_crc is not None and hcrc != header_crc:
            raise CorruptFile(f"{self.path}: header checksum {hcrc:08x}, the manifest says {header_crc:08x}")
        start = actual - FOOTER.size - hlen
        if start < len(MAGIC):
            raise CorruptFile(f"{self.path}: header length {hlen} does not fit in {actual} bytes")
        self._f.seek(start)
        raw = self._f.read(hlen)
        if zlib.crc32(raw) != hcrc:
            raise CorruptFile(f"{self.path}: header fails its checksum")
        header = pickle.loads(raw)
        if header.get("format") != FORMAT:
            raise CorruptFile(f"{self.path}: format {header.get('format')!r}, this reader knows {FORMAT}")
        self.table: dict[str, TensorEntry] = {e.key: e for e in header["tensors"]}
        values, containers = pickle.loads(header["tree"])
        self.flat_tree = Flat({}, values, containers)
        self.data_end = start

    def read(self, key: str) -> torch.Tensor:
        """One tensor, checked against its crc32."""
        e = self.table[key]
        t = torch.empty(e.shape, dtype=dtype_of(e.dtype))
        view = byte_view(t)
        if len(view) != e.nbytes or e.offset + e.nbytes > self.data_end:
            raise CorruptFile(f"{self.path}: tensor {key!r} entry does not match its shape/dtype")
        self._f.seek(e.offset)
        crc = 0
        for s in range(0, len(view), CHUNK):
            piece = view[s:s + CHUNK]
            got = self._f.readinto(piece)
            if got != len(piece):
                raise CorruptFile(f"{self.path}: short read in tensor {key!r}")
            crc = zlib.crc32(piece, crc)
        if crc != e.crc:
            raise CorruptFile(f"{self.path}: tensor {key!r} fails its checksum (bit rot or a torn write)")
        return t

    def verify(self) -> None:
        """Check every tensor's checksum without keeping the data (``verify`` in the CLI)."""
        buf = bytearray(CHUNK)
        for e in sorted(self.table.values(), key=lambda e: e.offset):
            self._f.seek(e.offset)
            crc, left = 0, e.nbytes
            while left:
                n = self._f.readinto(memoryview(buf)[:min(left, CHUNK)])
                if not n:
                    raise CorruptFile(f"{self.path}: short read in tensor {e.key!r}")
                crc = zlib.crc32(memoryview(buf)[:n], crc)
                left -= n
            if crc != e.crc:
                raise CorruptFile(f"{self.path}: tensor {e.key!r} fails its checksum")

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RankFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
