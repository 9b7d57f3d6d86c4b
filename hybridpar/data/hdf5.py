"""What an HDF5 file may point at and claim to hold, checked before any of its data is read.

Why: an HDF5 file is more than data. A link in it may name another file (an external link, a virtual
dataset's source, a dataset's external raw storage), which HDF5 opens and reads as if it were part of
this one, so a file in the data folder can read any file the job may read. And a dataset's shape is
only a claim: a file of 2 KB may declare 64 GiB, whose unwritten storage reads back as fill values
(zeros) or fails with a MemoryError.

:func:`check_datasets` walks the names a loader reads before it reads them:

* every link on the way (soft links followed, at most :data:`MAX_HOPS`) and every file a dataset draws
  on must resolve inside the folder that holds the file, in the place HDF5 would find it first (beside
  the file, the working directory, a ``HDF5_*_PREFIX`` folder);
* a dataset's data must be stored: a chunked dataset has every chunk in the file, a contiguous one its
  whole extent within the file, a virtual one sources for every value, external storage all its bytes.

Each refusal is an :class:`UntrustedFile` (a ``ValueError``): one line naming the file, the dataset,
what it declares or points at, and what would fit.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Iterable

import h5py

MAX_HOPS = 8
"""Most links (soft, external, virtual) followed from one name; real files use one or none."""

_ENV = {"link": "HDF5_EXT_PREFIX", "virtual": "HDF5_VDS_PREFIX", "raw": "HDF5_EXTFILE_PREFIX"}
"""Environment variables naming folders where HDF5 looks first for each kind of referenced file."""


class UntrustedFile(ValueError):
    """An HDF5 file that points outside its folder, or declares data it does not hold."""


def check_datasets(f: h5py.File, names: Iterable[str], folder: str | os.PathLike | None = None) -> None:
    """Check the datasets ``names`` of ``f`` (names absent from the file are left to the caller).

    ``folder`` (default: the folder holding the file) is where every file they draw on must lie.
    Nothing is read but links, layouts and storage sizes, and no file outside ``folder`` is opened.
    """
    here = os.path.dirname(os.path.abspath(f.filename))
    base = os.path.realpath(os.fspath(folder) if folder is not None else here)
    for name in names:
        _walk(f, name, base, f"{f.filename}: dataset '{name}'", 0)


def _walk(f: h5py.File, name: str, folder: str, what: str, hops: int) -> None:
    """Follow ``name`` through ``f`` link by link, then check the dataset it reaches."""
    if hops > MAX_HOPS:
        raise UntrustedFile(f"{what}: more than {MAX_HOPS} links to follow (a loop?); a dataset is reached "
                            "through a link or two")
    parts = [p for p in name.split("/") if p]
    for i in range(len(parts)):
        here, rest = "/" + "/".join(parts[:i + 1]), "/".join(parts[i + 1:])
        key = here.encode()
        try:
            if not f.id.links.exists(key):
                return  # absent: the caller says what it expected
            kind = f.id.links.get_info(key).type
        except (KeyError, ValueError, RuntimeError):
            return  # a path through a dataset: nothing there
        if kind == h5py.h5l.TYPE_SOFT:
            to = f.id.links.get_val(key).decode(errors="replace")
            to = to if to.startswith("/") else posixpath.join(posixpath.dirname(here), to)
            _walk(f, posixpath.join(to, rest) if rest else to, folder, what, hops + 1)
            return
        if kind == h5py.h5l.TYPE_EXTERNAL:
            file_b, obj_b = f.id.links.get_val(key)
            obj = obj_b.decode(errors="replace")
            other = _inside(f.filename, file_b.decode(errors="replace"), folder, what, "link")
            with _open(other, what) as g:
                _walk(g, posixpath.join(obj, rest) if rest else obj, folder, what, hops + 1)
            return
        if kind != h5py.h5l.TYPE_HARD:
            raise UntrustedFile(f"{what}: a user-defined link (type {kind}) on the way; expected a dataset "
                                "or a soft or external link to one")
    obj = f.get("/" + "/".join(parts))
    if isinstance(obj, h5py.Dataset):
        _check_storage(obj, folder, what, hops)


def _check_storage(ds: h5py.Dataset, folder: str, what: str, hops: int) -> None:
    """The files ``ds`` draws on lie in ``folder``, and they hold every value it declares."""
    path = ds.file.filename
    declares = f"declares {ds.shape} {ds.dtype} ({_size(ds.nbytes)})"
    if ds.is_virtual:
        mapped = 0
        for src in ds.virtual_sources():
            mapped += src.vspace.get_select_npoints()
            where = f"{what} (virtual, drawing on '{src.dset_name}' in {src.file_name})"
            if src.file_name == ".":
                _walk(ds.file, src.dset_name, folder, where, hops + 1)
                continue
            with _open(_inside(path, src.file_name, folder, what, "virtual"), what) as g:
                _walk(g, src.dset_name, folder, where, hops + 1)
        if mapped < ds.size:
            raise UntrustedFile(f"{what}: a virtual dataset that {declares} but maps {mapped} of its "
                                f"{ds.size} values to sources; the rest would read as fill values. Expected "
                                "every value mapped")
        return
    if ds.external:
        held = 0
        for name, offset, count in ds.external:
            raw = _inside(path, os.fsdecode(name), folder, what, "raw")
            held += max(0, min(count, os.path.getsize(raw) - offset))
        if held < ds.nbytes:
            raise UntrustedFile(f"{what}: {declares} in external raw files that hold {_size(held)}; expected "
                                f"all {ds.nbytes} bytes")
        return
    if ds.nbytes == 0:
        return
    file_size = os.path.getsize(path)
    layout = ds.id.get_create_plist().get_layout()
    if layout == h5py.h5d.CHUNKED:
        want = math.prod(-(-n // c) for n, c in zip(ds.shape, ds.chunks))
        have = ds.id.get_num_chunks()
        if have < want:
            raise UntrustedFile(f"{what}: {declares} but stores {have} of its {want} chunks (the file is "
                                f"{_size(file_size)}): never written, or written in part; expected every "
                                "chunk in the file")
        stored = ds.id.get_storage_size()
        if stored > file_size:
            raise UntrustedFile(f"{what}: {declares} in chunks of {_size(stored)}, more than the whole file "
                                f"({_size(file_size)}): the file is cut short")
    elif layout == h5py.h5d.CONTIGUOUS:
        offset = ds.id.get_offset()
        if offset is None or offset + ds.nbytes > file_size:
            held = "nothing" if offset is None else _size(max(0, file_size - offset))
            raise UntrustedFile(f"{what}: {declares} but the file ({_size(file_size)}) holds {held} of it: "
                                f"never written, or the file is cut short; expected all {ds.nbytes} bytes in "
                                "the file")


def _inside(base_file: str, name: str, folder: str, what: str, kind: str) -> str:
    """The file HDF5 would open for ``name`` (the first that exists where it looks), which must lie in
    ``folder``."""
    bases = [p for p in os.environ.get(_ENV[kind], "").split(os.pathsep) if p]
    if kind != "raw":  # external raw files are found relative to the working directory alone
        bases.append(os.path.dirname(os.path.abspath(base_file)))
    bases.append(os.getcwd())
    if os.path.isabs(name):
        candidates = [name] + [os.path.join(b, os.path.basename(name)) for b in bases]
    else:
        candidates = [os.path.join(b, name) for b in bases]
    noun = {"link": "an external link to", "virtual": "a virtual dataset drawing on",
            "raw": "external raw storage in"}[kind]
    found = next((c for c in candidates if os.path.exists(c)), None)
    if found is None:
        raise UntrustedFile(f"{what}: {noun} {name!r}, which does not exist; expected a file inside {folder}")
    real = os.path.realpath(found)
    shown = repr(name) if real == name else f"{name!r} ({real})"
    if os.path.commonpath([real, folder]) != folder:
        raise UntrustedFile(f"{what}: {noun} {shown}, outside the data folder {folder}; only files inside it "
                            "are read")
    if not os.path.isfile(real):
        raise UntrustedFile(f"{what}: {noun} {shown}, which is not a regular file")
    return real


def _open(path: str, what: str) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise UntrustedFile(f"{what}: links to {path}, which is not a readable HDF5 file ({err})") from None


def _size(n: float) -> str:
    """``512 B``, ``2.0 KiB``, ``64.0 GiB``: a byte count for messages."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")
