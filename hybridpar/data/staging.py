"""Copy a dataset's files to node-local storage before training, with a progress bar on stderr.

Why: a parallel file system serves thousands of small random hyperslab reads per step badly; a node's
SSD or RAM disk serves them well. Staging copies the files once and points the dataset at the copies
through the :class:`~hybridpar.data.dataset.FileBacked` protocol (``ds.files``, ``ds.with_files``).

Which files: with a global shuffle every replica reads samples from every file within a few epochs,
so a replica needs all the files the dataset reads, not a fixed share (a fixed share per node is
the shard-then-shuffle shortcut that hurt CosmoFlow's convergence).

Several ranks of one node may stage into the same directory at once: each file is guarded by a lock
file, copied to a temporary name and renamed into place, so exactly one rank copies it and the others
find it complete. A copy whose size and modification time match the source is reused.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

from hybridpar.data.dataset import FileBacked

_BLOCK = 16 << 20


class ProgressBar:
    """A one-line byte progress bar: redrawn in place on a terminal, a few lines in a log file."""

    def __init__(self, total: int, files: int, label: str = "staging", stream: TextIO | None = None,
                 enabled: bool = True) -> None:
        self.total, self.files, self.label = max(total, 1), files, label
        self.stream = sys.stderr if stream is None else stream
        self.enabled = enabled
        self.done = self.files_done = 0
        self.start = self._last = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._quarter = 0

    def update(self, nbytes: int = 0, files: int = 0) -> None:
        """Count ``nbytes`` more bytes and ``files`` more finished files; redraw when due."""
        self.done += nbytes
        self.files_done += files
        now = time.monotonic()
        if self._tty and now - self._last >= 0.2:
            self._last = now
            self._draw()
        elif not self._tty and self.done * 4 // self.total > self._quarter:
            self._quarter = self.done * 4 // self.total
            if self._quarter < 4:  # a log file gets 25 %, 50 %, 75 % and the final line
                self._draw()

    def finish(self) -> None:
        """Draw the final state and end the line."""
        self._draw(final=True)

    def _draw(self, final: bool = False) -> None:
        if not self.enabled:
            return
        frac = min(self.done / self.total, 1.0)
        rate = self.done / max(time.monotonic() - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24) + "." * (24 - int(frac * 24))
        line = (f"{self.label} [{bar}] {self.files_done}/{self.files} files "
                f"{self.done / 2**30:.2f}/{self.total / 2**30:.2f} GiB {rate / 1e6:.0f} MB/s "
                f"eta {eta:.0f}s")
        if self._tty:
            line = "\r" + line + ("\n" if final else "")
        else:
            line += "\n"
        self.stream.write(line)
        self.stream.flush()


def _targets(files: Sequence[str], dest: Path) -> list[Path]:
    """Where each file goes: its path relative to the files' common directory, under ``dest``."""
    srcs = [Path(f).resolve() for f in files]
    root = Path(os.path.commonpath([s.parent for s in srcs]))
    return [dest / s.relative_to(root) for s in srcs]


def _fresh(src: Path, dst: Path) -> bool:
    """True when ``dst`` is a complete copy of ``src`` (same size, same modification second)."""
    try:
        a, b = src.stat(), dst.stat()
    except FileNotFoundError:
        return False
    return a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime)


def _copy(src: Path, dst: Path, bar: ProgressBar) -> None:
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    try:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            while block := fi.read(_BLOCK):
                fo.write(block)
                bar.update(len(block))
        shutil.copystat(src, tmp)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _show(progress: bool | None) -> bool:
    """Progress default: only the first rank of a node (``LOCAL_RANK`` unset or 0) draws a bar."""
    return os.environ.get("LOCAL_RANK", "0") == "0" if progress is None else progress


def stage_files(files: Sequence[str], dest: str | os.PathLike, progress: bool | None = None,
                stream: TextIO | None = None) -> list[str]:
    """Copy ``files`` under ``dest`` (skipping up-to-date copies) and return the copies' paths.

    ``progress=None`` shows the bar on the node's first rank only.
    """
    if not files:
        raise ValueError("nothing to stage: the dataset lists no files")
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(f"cannot stage {missing[0]}: no such file"
                                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    dest = Path(dest)
    targets = _targets(files, dest)
    bar = ProgressBar(sum(os.path.getsize(f) for f in files), len(files), f"staging to {dest}",
                      stream, enabled=_show(progress))
    for src, dst in zip(files, targets, strict=True):
        src = Path(src).resolve()
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.resolve() == src:
            bar.update(src.stat().st_size, 1)
            continue
        with open(dst.with_name(f".{dst.name}.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another local rank may be copying this very file
            if _fresh(src, dst):
                bar.update(src.stat().st_size, 1)
            else:
                _copy(src, dst, bar)
                bar.update(0, 1)
    bar.finish()
    return [str(t) for t in targets]


def stage_dataset(dataset: object, dest: str | os.PathLike, progress: bool | None = None,
                  stream: TextIO | None = None) -> object:
    """The same dataset reading node-local copies of its files under ``dest``."""
    if not isinstance(dataset, FileBacked):
        raise TypeError(
            f"cannot stage a {type(dataset).__name__}: staging needs a dataset with a 'files' list and "
            f"a 'with_files(paths)' method (see hybridpar.data.FileBacked); drop stage_dir otherwise")
    return dataset.with_files(stage_files(list(dataset.files), dest, progress, stream))
