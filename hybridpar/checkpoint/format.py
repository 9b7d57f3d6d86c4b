"""The per-rank file: raw tensor bytes, then a header, then a fixed footer; every piece checksummed.

Why not ``torch.save``: it pickles the tensors through a zip writer, while here the bytes of each
host buffer go straight to the file (no extra copy), a reader can fetch one tensor by seeking (a pipeline
stage reads only its own layers), and each piece carries a crc32 (zlib's, cheap beside the write
itself). Layout::

    b"HPCKPT02" | tensor bytes, back to back | header (JSON) | footer: <u64 header length,
                                                                       u32 header crc32, b"HPCKEND1">

The header lists each tensor (key, dtype, shape, offset, size, crc32) and holds the typed non-tensor
leaves and container shapes of the state (:mod:`.header`). The footer at the end makes a truncated file
obvious at once; the manifest records each file's size and header crc32, and the header the crc32 of
each tensor, so every byte that matters is verified by any read, whole or partial.

Reading a file never runs code from it, and a file that fails any check is one :class:`CorruptFile`
naming it: every length, offset, shape and dtype is checked against the file's size before anything is
allocated from it (:mod:`.header`). Files of format 1 (magic ``HPCKPT01``, a pickled header) are read by
an unpickler that admits only the globals such a header holds (:mod:`.legacy`).
"""

from __future__ import annotations

import io
import os
import stat
import struct
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint import legacy
from hybridpar.checkpoint.header import (
    DTYPES,
    BadHeader,
    TensorEntry,
    decode_header,
    dtype_name,
    encode_header,
    encode_tree,
)
from hybridpar.checkpoint.tree import Flat

MAGIC = b"HPCKPT02"
MAGIC_V1 = b"HPCKPT01"  # format 1: pickled header (:mod:`.legacy`)
END = b"HPCKEND1"
FOOTER = struct.Struct("<QI8s")
CHUNK = 16 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read as asked."""


class CorruptFile(CheckpointError):
    """A file is missing, truncated, or fails its checksum."""


@dataclass(frozen=True)
class Written:
    """What the manifest records about one written file."""

    size: int
    header_crc: int


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (any dtype, bf16 and bool included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def pack_tree(flat: Flat) -> bytes:
    """The non-tensor part of a state as header JSON, taken at save time so later mutation cannot leak in;
    a TypeError naming the key of anything a checkpoint does not store (:func:`.header.encode_tree`)."""
    return encode_tree(flat)


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
        header = encode_header(table, tree)
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
def _open_regular(path: Path) -> io.FileIO:
    """``path`` opened for reading, or CorruptFile naming it unless it is a regular file.

    Why by descriptor: a directory, a FIFO or a symlink to a folder planted under a rank file's name
    must fail as one line naming the *path* (``os.fdopen`` on a directory names only the descriptor),
    so that a reader falls back to another copy or an older version. ``O_NONBLOCK``: a FIFO must not
    hang the open; the type is checked on the open descriptor, so the file cannot be swapped between
    the check and the read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise CorruptFile(f"{path}: cannot open ({e.strerror})") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise CorruptFile(f"{path}: not a regular file (a {_kind(mode)}), refused")
        return io.FileIO(fd, "rb", closefd=True)
    except OSError as e:
        os.close(fd)
        raise CorruptFile(f"{path}: cannot open ({e.strerror})") from None
    except BaseException:
        os.close(fd)
        raise


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


class RankFile:
    """An open rank file whose footer and header have been checked against what the manifest expects."""

    def __init__(self, path: Path, size: int | None = None, header_crc: int | None = None) -> None:
        self.path = path
        self._f = _open_regular(path)
        try:
            self._check(size, header_crc)
        except OSError as e:
            self._f.close()
            raise CorruptFile(f"{path}: cannot read ({e.strerror})") from None
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
        hlen, hcrc, end = FOOTER.unpack(self._read(FOOTER.size))
        self._f.seek(0)
        magic = self._read(len(MAGIC))
        if magic not in (MAGIC, MAGIC_V1) or end != END:
            raise CorruptFile(f"{self.path}: not a hybridpar checkpoint file (bad magic; truncated?)")
        if header_crc is not None and hcrc != header_crc:
            raise CorruptFile(f"{self.path}: header checksum {hcrc:08x}, the manifest says {header_crc:08x}")
        if hlen > actual - len(MAGIC) - FOOTER.size:
            raise CorruptFile(f"{self.path}: header length {hlen} does not fit in {actual} bytes")
        start = actual - FOOTER.size - hlen
        self._f.seek(start)
        raw = self._read(hlen)
        if zlib.crc32(raw) != hcrc:
            raise CorruptFile(f"{self.path}: header fails its checksum")
        decode = decode_header if magic == MAGIC else legacy.decode_header
        try:
            self.table, self.flat_tree = decode(raw, len(MAGIC), start)
        except BadHeader as e:
            raise CorruptFile(f"{self.path}: {e}") from None
        except (RecursionError, MemoryError, ValueError, TypeError, KeyError, IndexError, AttributeError,
                OverflowError) as e:  # a check this reader missed: still one line naming the file
            raise CorruptFile(f"{self.path}: unreadable header ({type(e).__name__}: {str(e)[:80]})") from None
        self.data_end = start

    def _read(self, n: int) -> bytes:
        """Exactly ``n`` bytes (``n`` already checked against the file's size)."""
        data = self._f.read(n)
        if len(data) != n:
            raise CorruptFile(f"{self.path}: short read (the file changed while being read?)")
        return data

    def read(self, key: str) -> torch.Tensor:
        """One tensor, checked against its crc32 (its entry was checked against the file when opened)."""
        e = self.table[key]
        t = torch.empty(e.shape, dtype=DTYPES[e.dtype])
        view = byte_view(t)
        if len(view) != e.nbytes or e.offset + e.nbytes > self.data_end:
            raise CorruptFile(f"{self.path}: tensor {key!r} entry does not match its shape/dtype")
        try:
            self._f.seek(e.offset)
            crc = 0
            for s in range(0, len(view), CHUNK):
                piece = view[s:s + CHUNK]
                got = self._f.readinto(piece)
                if got != len(piece):
                    raise CorruptFile(f"{self.path}: short read in tensor {key!r}")
                crc = zlib.crc32(piece, crc)
        except OSError as err:
            raise CorruptFile(f"{self.path}: cannot read tensor {key!r} ({err.strerror})") from None
        if crc != e.crc:
            raise CorruptFile(f"{self.path}: tensor {key!r} fails its checksum (bit rot or a torn write)")
        return t

    def verify(self) -> None:
        """Check every tensor's checksum without keeping the data (``verify`` in the CLI); shapes and dtypes
        were checked against the byte counts when the file was opened."""
        buf = bytearray(min(CHUNK, max((e.nbytes for e in self.table.values()), default=0)))
        try:
            for e in self.table.values():  # in file order
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
        except OSError as err:
            raise CorruptFile(f"{self.path}: cannot read ({err.strerror})") from None

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RankFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
