"""Version names and the manifest: the one file that makes a version exist.

Why: a version is complete exactly when its manifest is there, so the manifest is written last, to a
temp name, fsynced, renamed over ``MANIFEST.json`` and the directory fsynced. A crash at any earlier
moment leaves a directory without a manifest, which every reader ignores. The manifest lists every
file of the version (size, header crc32, writer rank, partner copies) and carries its own crc32, so a
damaged manifest is caught too.

A version is named ``SSSSSSSSSSSS-SESSION-SEQ`` (step, an id drawn once per run, the save's ordinal in
that run): a resumed run that saves a step again never overwrites what an earlier run wrote.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridpar.checkpoint.format import CorruptFile, fsync_dir

MANIFEST = "MANIFEST.json"
FORMAT = "hybridpar-checkpoint/1"
_NAME = re.compile(r"^(\d{12})-([0-9a-f]{8})-(\d{4,})$")


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


def read(vdir: Path) -> dict[str, Any] | None:
    """The manifest of ``vdir``; None if there is none (an incomplete version); CorruptFile if damaged."""
    path = vdir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptFile(f"{path}: cannot read ({e.strerror})") from None
    try:
        doc = json.loads(raw)
        body, crc = doc["manifest"], doc["crc32"]
    except (ValueError, KeyError, TypeError):
        raise CorruptFile(f"{path}: not a valid manifest (unparsable JSON)") from None
    if zlib.crc32(_canonical(body)) != crc:
        raise CorruptFile(f"{path}: manifest fails its checksum")
    if body.get("format") != FORMAT:
        raise CorruptFile(f"{path}: format {body.get('format')!r}, this reader knows {FORMAT!r}")
    if body.get("name") != vdir.name:
        raise CorruptFile(f"{path}: names version {body.get('name')!r} but sits in {vdir.name!r}")
    return body


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
