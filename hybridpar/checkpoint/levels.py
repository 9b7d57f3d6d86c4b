"""Where the copies of a version live (L1, L2, L3), and what a process can see of them.

Why: restart must take the newest version that is complete at *any* level, and a damaged copy at one
level must not hide an intact one at another. VeloC's levels, as directories:

* L1 ``LOCAL/L1/<version>``: node-local storage (``local_dir``; a ``{node}`` in it names each node's
  directory, which is how one machine plays several nodes in tests);
* L2 ``LOCAL/L2/<version>``: partner copies held on another node (see :mod:`.placement`);
* L3 ``ROOT/<version>``: shared storage, flushed from L1 in the background; without ``local_dir``
  saves go straight here.

Everything here looks only at the file system, from one process: a level "has" a version when this
process sees its manifest and every file that level should hold, at the recorded size. Checksums are
verified when files are read (:mod:`.restore`), not here.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.format import CorruptFile, fsync_dir

L1, L2, L3 = "L1", "L2", "L3"


@dataclass(frozen=True)
class Levels:
    """The level directories as seen from one process on node ``node`` of ``nodes``."""

    root: Path
    local: str | None = None
    node: int = 0
    nodes: int = 1

    @property
    def templated(self) -> bool:
        return self.local is not None and "{node}" in self.local

    def local_dir(self, level: str, node: int | None = None) -> Path:
        if self.local is None:
            raise ValueError("no local_dir configured: there is no L1/L2")
        base = self.local.format(node=self.node if node is None else node)
        return Path(base) / level

    def write_dir(self) -> Path:
        """Where this process writes its files first: its L1 directory, or the root without one."""
        return self.local_dir(L1) if self.local is not None else self.root

    def dirs(self) -> list[tuple[str, Path]]:
        """Every level directory this process can look into, nearest first."""
        out: list[tuple[str, Path]] = []
        if self.local is not None:
            nodes = range(self.nodes) if self.templated else [self.node]
            for level in (L1, L2):
                mine = [self.local_dir(level)]
                others = [self.local_dir(level, n) for n in nodes if n != self.node]
                out += [(level, p) for p in mine + others]
        out.append((L3, self.root))
        return out

    def holder_dir(self, level: str, node: int) -> Path:
        """The directory of ``level`` on saved node ``node`` (this process's own without a template)."""
        if level == L3:
            return self.root
        return self.local_dir(level, node if self.templated else self.node)


@dataclass
class Found:
    """One version as seen across levels: its manifest (from any intact copy) and where it sits."""

    name: str
    manifest: dict[str, Any] | None = None
    dirs: list[tuple[str, Path]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def step(self) -> int:
        parsed = mf.parse_name(self.name)
        assert parsed is not None
        return parsed[0]

    @property
    def order(self) -> tuple[float, str]:
        """Newest last: by the time the save was taken, then by name."""
        return (self.manifest["time"] if self.manifest else 0.0, self.name)


def scan_dir(d: Path) -> list[tuple[str, dict[str, Any] | None, str | None]]:
    """The version directories in one level directory: (name, manifest or None, problem or None)."""
    try:
        entries = sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    out = []
    for name in entries:
        if mf.parse_name(name) is None:
            continue
        try:
            out.append((name, mf.read(d / name), None))
        except CorruptFile as e:
            out.append((name, None, str(e)))
    return out


def scan(levels: Levels) -> dict[str, Found]:
    """Every version directory visible at any level, with its manifest where one is intact."""
    found: dict[str, Found] = {}
    for level, d in levels.dirs():
        for name, body, problem in scan_dir(d):
            f = found.setdefault(name, Found(name))
            f.dirs.append((level, d / name))
            if problem is not None:
                f.problems.append(f"{level}: {problem}")
            elif body is not None and f.manifest is None:
                f.manifest = body
    return found


def locations(levels: Levels, body: dict[str, Any], fname: str) -> list[tuple[str, Path, int, int]]:
    """The copies of file ``fname`` of a version, nearest first: (level, path, size, header crc)."""
    rec = body["files"][fname]
    node_of = body["layout"]["node_of"]
    name = body["name"]
    out = []
    if levels.local is not None and body["layout"]["local"]:
        out.append((L1, levels.holder_dir(L1, node_of[rec["rank"]]) / name / fname,
                    rec["size"], rec["header_crc"]))
        for c in rec.get("copies", []):
            out.append((L2, levels.holder_dir(L2, node_of[c["holder"]]) / name / fname,
                        c["size"], c["header_crc"]))
    out.append((L3, levels.root / name / fname, rec["size"], rec["header_crc"]))
    return out


def _has(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except OSError:
        return False


def complete_levels(levels: Levels, found: Found) -> list[str]:
    """The levels at which this process sees the manifest and every file that level holds."""
    body = found.manifest
    if body is None:
        return []
    with_manifest = {lv for lv, d in found.dirs if (d / mf.MANIFEST).exists()}
    have: dict[str, bool] = {}
    for fname in body["files"]:
        per_level: dict[str, bool] = {}
        for level, path, size, _ in locations(levels, body, fname):
            per_level[level] = per_level.get(level, False) or _has(path, size)
        for level in (L1, L2, L3):
            if level in per_level:
                have[level] = have.get(level, True) and per_level[level]
    return [lv for lv in (L1, L2, L3) if have.get(lv) and lv in with_manifest]


def available(levels: Levels, found: Found) -> bool:
    """Whether every file of the version has at least one copy of the right size in sight."""
    body = found.manifest
    if body is None:
        return False
    return all(any(_has(p, s) for _, p, s, _ in locations(levels, body, f)) for f in body["files"])


def remove_version(vdir: Path) -> bool:
    """Delete a version directory, manifest first, so a crash midway never leaves a half version that
    looks complete. Tolerates another process deleting the same directory at the same time.

    Never deletes through a symlink: a version folder that is one (or that resolves outside its level
    directory) is left as it is, and False returned; what it points to may be another run's.
    """
    if vdir.is_symlink() or (vdir.exists() and vdir.resolve().parent != vdir.parent.resolve()):
        return False
    with contextlib.suppress(FileNotFoundError):
        os.unlink(vdir / mf.MANIFEST)
        fsync_dir(vdir)
    shutil.rmtree(vdir, ignore_errors=True)  # does not follow symlinks inside the folder
    with contextlib.suppress(FileNotFoundError):
        fsync_dir(vdir.parent)
    return True


def copy_durable(src: Path, dst: Path) -> None:
    """Copy a file (in-kernel where possible) and fsync the copy."""
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        size = os.fstat(fi.fileno()).st_size
        sent = 0
        try:
            while sent < size:
                n = os.sendfile(fo.fileno(), fi.fileno(), sent, size - sent)
                if n == 0:
                    break
                sent += n
        except OSError:
            fi.seek(0)
            fo.seek(0)
            fo.truncate()
            shutil.copyfileobj(fi, fo, 16 << 20)
        fo.flush()
        os.fsync(fo.fileno())
