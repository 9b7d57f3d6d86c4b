"""Version names and the manifest: the one file that makes a version exist.

Why: a version is complete exactly when its manifest is there, so the manifest is written last, to a
temp name, fsynced, renamed over ``MANIFEST.json`` and the directory fsynced. A crash at any earlier
moment leaves a directory without a manifest, which every reader ignores. The manifest lists every
file of the version (size, header crc32, writer rank, partner copies) and carries its own crc32, so a
damaged manifest is caught too.

A manifest is checked field by field when read (types, ranges, ranks within the world), and the file
names it lists must be plain names that stay inside their version folder: no ``..``, no separator, no
absolute path, no symlink resolving elsewhere (:func:`confined`). A manifest that fails is one
CorruptFile line, and the version is passed over like a damaged one.

A version is named ``SSSSSSSSSSSS-SESSION-SEQ`` (step, an id drawn once per run, the save's ordinal in
that run): a resumed run that saves a step again never overwrites what an earlier run wrote.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridpar.checkpoint.format import CorruptFile, fsync_dir

MANIFEST = "MANIFEST.json"
FORMAT = "hybridpar-checkpoint/1"
_NAME = re.compile(r"^(\d{12})-([0-9a-f]{8})-(\d{4,})$")
_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\.bin$")  # global.bin, stage-000.bin, rank-00000.bin
MAX_BYTES = 256 << 20  # a manifest of 100 000 ranks is ~50 MiB


def version_name(step: int, session: str, seq: int) -> str:
    if not 0 <= step < 10**12:
        raise ValueError(f"checkpoint step must be in 0..10**12-1, got {step}")
    return f"{step:012d}-{session}-{seq:04d}"


def parse_name(name: str) -> tuple[int, str, int] | None:
    """(step, session, seq) of a version directory name, or None if the name is not a version's."""
    m = _NAME.match(name)
    return (int(m[1]), m[2], int(m[3])) if m else None


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def encode(body: dict[str, Any]) -> bytes:
    crc = zlib.crc32(_canonical(body))
    return json.dumps({"crc32": crc, "manifest": body}, sort_keys=True, indent=1).encode()


def write(vdir: Path, body: dict[str, Any], tag: str,
          before_rename: Callable[[], None] | None = None) -> None:
    """Publish ``body`` as the manifest of ``vdir``: temp file, fsync, rename, directory fsync.

    ``tag`` keeps temp names apart when several writers publish the same manifest in one directory.
    """
    tmp = vdir / f".{MANIFEST}.{tag}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        data = memoryview(encode(body))
        while data:
            data = data[os.write(fd, data):]
        os.fsync(fd)
    finally:
        os.close(fd)
    if before_rename is not None:
        before_rename()
    os.replace(tmp, vdir / MANIFEST)
    fsync_dir(vdir)


def _inside(vdir: Path, path: Path) -> Path:
    """``path``, or CorruptFile if it is a symlink that resolves outside ``vdir`` (or loops)."""
    if path.is_symlink():
        try:
            inside = path.resolve().is_relative_to(vdir.resolve())
        except (OSError, RuntimeError):  # RuntimeError before Python 3.13
            raise CorruptFile(f"{path}: a symlink loop, refused") from None
        if not inside:
            raise CorruptFile(f"{path}: a symlink out of its version folder, refused")
    return path


def confined(vdir: Path, name: str) -> Path:
    """``vdir / name``, or CorruptFile unless ``name`` is a plain rank-file name whose path resolves inside
    ``vdir`` (a version folder that is itself a symlink is followed; nothing inside it may lead out)."""
    if not _FILE.match(name):
        raise CorruptFile(f"{vdir}: file name {name[:80]!r} is not a checkpoint file's name (names stay "
                          f"inside their version folder)")
    return _inside(vdir, vdir / name)


def read(vdir: Path) -> dict[str, Any] | None:
    """The manifest of ``vdir``; None if there is none (an incomplete version); CorruptFile if damaged."""
    path = _inside(vdir, vdir / MANIFEST)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptFile(f"{path}: cannot read ({e.strerror})") from None
    try:  # the type checked on the descriptor itself (os.fdopen on a directory raises and leaks it)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise CorruptFile(f"{path}: not a regular file of at most {MAX_BYTES} bytes")
        parts, got = [], 0
        while got <= MAX_BYTES and (chunk := os.read(fd, MAX_BYTES + 1 - got)):
            parts.append(chunk)
            got += len(chunk)
        raw = b"".join(parts)
    except OSError as e:
        raise CorruptFile(f"{path}: cannot read ({e.strerror})") from None
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
        body, crc = doc["manifest"], doc["crc32"]
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CorruptFile(f"{path}: not a valid manifest (unparsable JSON)") from None
    if type(body) is not dict or zlib.crc32(_canonical(body)) != crc:
        raise CorruptFile(f"{path}: manifest fails its checksum")
    if body.get("format") != FORMAT:
        raise CorruptFile(f"{path}: format {str(body.get('format'))[:40]!r}, this reader knows {FORMAT!r}")
    if body.get("name") != vdir.name:
        raise CorruptFile(f"{path}: names version {str(body.get('name'))[:40]!r} but sits in {vdir.name!r}")
    problem = check(body)
    if problem:
        raise CorruptFile(f"{path}: {problem}")
    for fname in body["files"]:
        confined(vdir, fname)
    return body


def _int(x: Any, lo: int = 0, hi: int = 1 << 62) -> bool:
    return type(x) is int and lo <= x <= hi


def check(body: dict[str, Any]) -> str | None:
    """What is wrong with a manifest's fields (None: every field the readers use has its type and range)."""
    if parse_name(body["name"]) is None or not _int(body.get("step")) or body["step"] != parse_name(
            body["name"])[0]:
        return f"step {str(body.get('step'))[:20]} does not match the version name"
    t = body.get("time")
    if type(t) not in (int, float) or not (math.isfinite(t) and 0 <= t < 1e11):
        return f"time {str(t)[:30]} is not a time"
    meta = body.get("metadata")
    if type(meta) is not dict or type(meta.get("metrics", {})) is not dict:
        return "metadata (or its metrics) is not a map"
    if not _int(body.get("bytes")) or type(body.get("order", [])) is not list \
            or not all(type(k) is str for k in body.get("order", [])):
        return "bytes or order is not what a manifest holds"
    layout = body.get("layout")
    if type(layout) is not dict or not _int(layout.get("world"), 1, 1 << 24) \
            or type(layout.get("local")) is not bool or type(layout.get("node_of")) is not list \
            or len(layout["node_of"]) != layout["world"] \
            or not all(_int(n, 0, 1 << 24) for n in layout["node_of"]):
        return "layout is not {world, local, node_of per rank}"
    world = layout["world"]
    files = body.get("files")
    if type(files) is not dict:
        return "files is not a map"
    for fname, rec in files.items():
        if type(rec) is not dict or rec.get("kind") not in ("global", "stage", "rank") \
                or not _int(rec.get("rank"), 0, world - 1) or not _int(rec.get("size")) \
                or not _int(rec.get("header_crc"), 0, 0xFFFFFFFF) or type(rec.get("entries")) is not list \
                or not all(type(e) is str for e in rec["entries"]) \
                or not (_int(rec.get("stage")) if rec["kind"] == "stage" else rec.get("stage") is None) \
                or type(rec.get("copies", [])) is not list:
            return f"the record of file {str(fname)[:80]!r} is not what a manifest holds"
        for c in rec.get("copies", []):
            if type(c) is not dict or not _int(c.get("holder"), 0, world - 1) or not _int(c.get("size")) \
                    or not _int(c.get("header_crc"), 0, 0xFFFFFFFF):
                return f"a copy of file {str(fname)[:80]!r} is not what a manifest holds"
    return None


def jsonable(metadata: dict[str, Any] | None, what: str = "metadata") -> dict[str, Any]:
    """``metadata`` as plain JSON (numpy and 0-d tensor numbers converted), or an error naming the culprit."""
    if metadata is None:
        return {}

    def convert(x: Any) -> Any:
        item = getattr(x, "item", None)
        if callable(item) and getattr(x, "ndim", 1) == 0:
            return item()
        raise TypeError(f"{what} holds a {type(x).__name__} ({x!r:.60}): use numbers, strings, lists "
                        f"or dicts")

    return json.loads(json.dumps(dict(metadata), default=convert))
