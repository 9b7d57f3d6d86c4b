"""Reading a version back: the keys a rank asks for, from whichever copy of each file is intact.

Why its own module: ``Checkpointer.load``, the CLI's ``export``/``diff``/``verify`` and the tests all read
the same way. A file is tried at each level in turn (L1, L2, L3); the first copy whose size, header and
tensor checksums all match is used, and the damaged copies are reported so the caller can warn. A rank
reads ``global.bin``, its own ``rank-R.bin`` (if rank R existed when the version was saved) and, from the
stage files, only the keys it asks for, so a checkpoint saved under one layout loads under another.
Whatever a file holds, crafted or damaged, it fails as a :class:`CorruptFile`, so a caller falls back.
"""

from __future__ import annotations

from typing import Any

from hybridpar.checkpoint.file_placement import GLOBAL_FILE, RANK, STAGE, rank_file
from hybridpar.checkpoint.format import CorruptFile, RankFile
from hybridpar.checkpoint.levels import Levels, locations
from hybridpar.checkpoint.manifest import confined
from hybridpar.checkpoint.tree import ROOT, Flat, KeyFilter, escape, merge, select


def read_file(levels: Levels, body: dict[str, Any], fname: str, keep: KeyFilter) -> tuple[Flat, list[str]]:
    """The selected leaves of one file, and the problems met on damaged copies before an intact one."""
    problems: list[str] = []
    missing: list[str] = []
    for level, path, size, hcrc in locations(levels, body, fname):
        if not path.exists():
            missing.append(f"{level} copy: {path} is missing")
            continue
        try:
            with RankFile(confined(path.parent, path.name), size, hcrc) as f:
                shape = Flat(dict.fromkeys(f.table), f.flat_tree.values, f.flat_tree.containers)
                sel = select(shape, keep)
                sel.tensors = {k: f.read(k) for k in sel.tensors}
                return sel, problems
        except CorruptFile as e:
            problems.append(f"{level} copy: {e}")
    raise CorruptFile(f"{body['name']}/{fname}: no intact copy ({'; '.join(problems + missing)})")


def read_version(levels: Levels, body: dict[str, Any], rank: int, keep: KeyFilter
                 ) -> tuple[Flat, list[str]]:
    """What ``rank`` gets from a version: stage entries (merged over stages, filtered), global entries and
    its own per-rank entries. Returns the merged leaves and notes for warnings."""
    files = body["files"]
    order = sorted((f for f in files if files[f]["kind"] == STAGE), key=lambda f: files[f]["stage"])
    if GLOBAL_FILE in files:
        order.append(GLOBAL_FILE)
    notes: list[str] = []
    mine = rank_file(rank)
    if mine in files:
        order.append(mine)
    elif any(files[f]["kind"] == RANK and files[f].get("entries") for f in files):
        entries = sorted({e for f in files if files[f]["kind"] == RANK for e in files[f]["entries"]})
        if any(keep(escape(e)) for e in entries):
            notes.append(f"rank {rank} did not exist when {body['name']} was saved (world "
                         f"{body['layout']['world']}): its per-rank entries are not restored")
        else:  # nothing asked for was per rank (inference reads the model): one note, the same on every rank
            notes.append(f"saved on {body['layout']['world']} rank(s): its per-rank state "
                         f"({', '.join(entries)}) was not needed here")
    parts = []
    for fname in order:
        flat, problems = read_file(levels, body, fname, keep)
        parts.append(flat)
        notes += problems
    out = merge(parts)
    if ROOT in out.containers:  # the top-level entries in the order rank 0 gave them
        kind, keys = out.containers[ROOT]
        rank_of = {k: i for i, k in enumerate(body.get("order", []))}
        out.containers[ROOT] = (kind, sorted(keys, key=lambda k: rank_of.get(k, len(rank_of))))
    return out, notes


def verify_version(levels: Levels, body: dict[str, Any], full: bool = True) -> tuple[bool, list[str]]:
    """Check every visible copy of every file: (every file has an intact copy, the problems found).

    ``full`` reads every byte against its checksum; otherwise only sizes, footers and headers are
    checked (cheap, for listings). A file none of whose copies is intact makes the version unusable; a
    damaged copy beside an intact one is reported but harmless.
    """
    problems: list[str] = []
    usable = True
    for fname in body["files"]:
        intact = False
        seen = False
        for level, path, size, hcrc in locations(levels, body, fname):
            if not path.exists():
                continue
            seen = True
            try:
                with RankFile(confined(path.parent, path.name), size, hcrc) as f:
                    if full:
                        f.verify()
                intact = True
            except CorruptFile as e:
                problems.append(f"{level} copy: {e}")
        if not intact:
            usable = False
            problems.append(f"{fname}: no intact copy" + ("" if seen else " (no copy found)"))
    return usable, problems
