"""The Checkpointer: snapshot now, persist in the background, publish with a manifest, restart from the
newest intact version at any level.

Why this shape: the training loop must lose as little time as possible per checkpoint, and a killed job
must never lose more than the steps since the last *complete* version. So ``save`` only copies the state
into reused host buffers (or, with ``overlap=True``, not even that: see :mod:`.snapshot`) and hands the
rest to the writer threads of :mod:`.writer` (files, partner copies, manifest, L3 flush, retention).
Reading back (``versions``, ``latest``, ``load``) needs no thread: it scans the levels and reads the
newest version whose every file has an intact copy somewhere (:mod:`.restore`).

Typical loop (the DataStates mode; ``attach`` makes every ``optimizer.step()`` wait for the copy)::

    ckpt = Checkpointer("/shared/run1", grid, local_dir="/local/ckpt", keep_last=3)
    ckpt.attach(optimizer)
    state = ckpt.load()                      # None on a fresh start; collective
    ...
    for step in range(start, steps):
        loss_fn(model(x), y).backward()      # the copy of the previous save runs meanwhile
        optimizer.step()                     # waits for that copy, never for the disk
        if step % every == 0:
            ckpt.save(step, {"model": ..., "optimizer": ..., "rng": ..., "loader": ...},
                      {"epoch": e, "metrics": {...}}, overlap=True)
    ckpt.wait()
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint import faults
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.file_placement import GLOBAL, RANK, STAGE, Placement
from hybridpar.checkpoint.format import CheckpointError, CorruptFile, pack_tree
from hybridpar.checkpoint.group import Group
from hybridpar.checkpoint.levels import Found, Levels, available, complete_levels, scan
from hybridpar.checkpoint.restore import read_version
from hybridpar.checkpoint.retention import Policy
from hybridpar.checkpoint.snapshot import HostBuffers, Snapshot, check_tensor
from hybridpar.checkpoint.tree import flatten, key_filter, unflatten
from hybridpar.checkpoint.version import Version, code_version, config_hash
from hybridpar.checkpoint.writer import Job, Writer

__all__ = ["Checkpointer", "Version"]


class Checkpointer:
    """Asynchronous, multi-level, versioned checkpoints of a training state (see the module docstring).

    Constructing one is collective under a process group: every rank, with the same ``root`` and
    ``local_dir``. ``save``, ``wait`` and ``load`` are collective too; ``latest`` and ``versions`` are
    not (they report what this process sees). Call ``close`` (or ``wait``) before the process group is
    destroyed.

    Args:
        root: the shared, persistent directory (L3). Every rank must see the same one.
        grid: the :class:`hybridpar.ProcessGrid`; None for a single process, or for plain data
            parallelism over an initialised process group.
        keep_last: how many of the newest versions retention keeps at the root (None: all).
        keep_every: also keep every version whose step (or ``keep_every_on`` metadata entry, e.g.
            ``"epoch"``) is a multiple of this, for later study.
        best: ``(metric, "min" | "max")``: also keep the best version by ``metadata["metrics"][metric]``.
        local_dir: node-local directory for L1 (and L2); ``{node}`` in it is replaced by the node index.
            None: saves go straight to ``root``.
        keep_local: how many complete versions L1/L2 keep (versions not yet flushed to L3 are kept too).
        partner: keep L2 copies on a partner node (needs ``local_dir`` and more than one node).
        ranks_per_node: ranks per node, in blocks of consecutive ranks; default: from host names.
        replicated: top-level entries of the state that are the same on every rank of a pipeline stage
            (weights, optimizer state), keyed by full-model names; written once per stage.
        per_rank: top-level entries that differ between ranks (RNG states); written by every rank and
            returned to the same rank. Every other entry is taken to be the same on all ranks (step,
            data-loader position, ...) and written by rank 0.
        config: the run's configuration; its hash goes into every version's metadata, itself into the
            manifest.
        overlap_min_bytes: with ``save(overlap=True)``, tensors smaller than this are copied at once.
        timeout_s: how long a writer waits for the other ranks before failing the save.
    """

    def __init__(self, root: str | os.PathLike, grid: Any = None, keep_last: int | None = 3,
                 keep_every: int | None = None, *, keep_every_on: str = "step",
                 best: tuple[str, str] | None = None, local_dir: str | os.PathLike | None = None,
                 keep_local: int = 2, partner: bool = True, ranks_per_node: int | None = None,
                 replicated: Collection[str] = ("model", "optimizer"), per_rank: Collection[str] = ("rng",),
                 config: Mapping[str, Any] | None = None, overlap_min_bytes: int = 1 << 20,
                 timeout_s: float = 600.0) -> None:
        self.root = Path(root)
        self.policy = Policy(keep_last, keep_every, keep_every_on, best)
        if keep_local < 1:
            raise ValueError(f"keep_local must be >= 1 (the newest version), got {keep_local}")
        overlap_scopes = set(replicated) & set(per_rank)
        if overlap_scopes:
            raise ValueError(f"entries {sorted(overlap_scopes)} are both replicated and per_rank: pick one")
        self.replicated, self.per_rank = tuple(replicated), tuple(per_rank)
        self.keep_local = keep_local
        self.overlap_min_bytes = overlap_min_bytes
        self.config = json.loads(json.dumps(config, default=str)) if config is not None else None
        self._meta_auto = {"config_hash": config_hash(config), "code_version": code_version()}
        local = None if local_dir is None else str(local_dir)

        self._persist_group = Group(timeout_s)
        self._flush_group = Group(timeout_s) if local is not None else None
        self.rank, self.world = self._persist_group.rank, self._persist_group.world
        if grid is not None and (grid.rank, grid.world_size) != (self.rank, self.world):
            raise ValueError(f"Checkpointer: grid is rank {grid.rank} of {grid.world_size}, the process "
                             f"group rank {self.rank} of {self.world}")
        token = secrets.token_hex(4) if self.rank == 0 else None
        seen = self._persist_group.all_gather((token, socket.gethostname(), local, str(self.root)))
        if len({s[2:] for s in seen}) != 1:
            raise ValueError(f"Checkpointer: every rank must pass the same root and local_dir, got "
                             f"{sorted({s[2:] for s in seen})}")
        self.session: str = seen[0][0]
        if ranks_per_node is not None:
            if ranks_per_node < 1 or self.world % ranks_per_node:
                raise ValueError(f"ranks_per_node={ranks_per_node} does not divide the world size "
                                 f"{self.world}")
            node_of = tuple(r // ranks_per_node for r in range(self.world))
        else:
            hosts = list(dict.fromkeys(s[1] for s in seen))
            node_of = tuple(hosts.index(s[1]) for s in seen)
        self.placement = Placement.from_grid(grid, node_of)
        self.grid = grid
        self.levels = Levels(self.root, local, node_of[self.rank], self.placement.nodes)
        self._copies = self.placement.copies() if (partner and local is not None) else []
        scopes = {"replicated": list(self.replicated), "per_rank": list(self.per_rank)}
        layout = {"world": self.world, "local": self.levels.local is not None,
                  "stage_of": list(self.placement.stage_of), "node_of": list(self.placement.node_of),
                  "data": grid.data if grid is not None else self.world,
                  "pipe": grid.pipe if grid is not None else 1,
                  "spatial": list(grid.stage_spatial) if grid is not None else [1, 1, 1]}
        self._writer = Writer(
            rank=self.rank, levels=self.levels, placement=self.placement, copies=self._copies,
            leader=self.rank == min(r for r in range(self.world) if node_of[r] == node_of[self.rank]),
            policy=self.policy, keep_local=keep_local, session=self.session,
            manifest_fields={"session": self.session, "config": self.config, "layout": layout,
                             "scopes": scopes},
            persist_group=self._persist_group, flush_group=self._flush_group, flush=bool(local))

        self._buffers = HostBuffers()
        self._snapshot: Snapshot | None = None
        self._seq = 0
        self._parent: str | None = None
        self._closed = False

    # ------------------------------------------------------------------------------------------- save
    def save(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None = None, *,
             overlap: bool = False) -> None:
        """Snapshot ``state`` as version ``step`` and return; the writes go on in the background.

        Collective: every rank calls it with its own state. Without ``overlap`` the tensors are copied
        before returning, so the caller may change them at once. With ``overlap=True`` the large ones are
        copied while the caller runs its next forward/backward, and :meth:`before_update` (or an
        optimizer passed to :meth:`attach`) must be called before they change. If the previous save
        failed, this warns and carries on (a full disk should not end a run; :meth:`wait` raises).
        """
        if self._closed:
            raise CheckpointError("Checkpointer.save after close()")
        try:
            self._wait_persist()
        except CheckpointError as e:
            warnings.warn(str(e), stacklevel=2)
        faults.hit("snapshot", step, self.rank)
        self._writer.check_flushes(raise_errors=False)
        meta = mf.jsonable(dict(metadata or {}))
        for k, v in self._meta_auto.items():
            meta.setdefault(k, v)
        meta.setdefault("parent", self._parent)
        name = mf.version_name(step, self.session, self._seq)
        self._seq += 1

        files, self_made, trees, entries, items = self._contents(state)
        snap = Snapshot(items, self._buffers, overlap=overlap, overlap_min_bytes=self.overlap_min_bytes)
        self._snapshot = snap if snap.pending else None
        job = Job(name, step, self._seq - 1, time.time(), meta, files, self_made, trees, entries,
                  list(state), snap)
        self._writer.submit(job)

    def reserve(self, state: Mapping[str, Any]) -> None:
        """Allocate the host buffers a save of ``state`` copies into, now (not collective).

        A save reuses its host buffers (pinned where the tensors are on a GPU) from the previous save;
        the first one has to allocate them, and pinning gigabytes takes about a second, which that save
        would stall training for. Called once before the training loop with the state the loop will
        save, it moves that cost out of the loop; a later save of other shapes reallocates as before.
        """
        for file, key, t in self._contents(state)[4]:
            self._buffers.get((file, key), check_tensor(key, t))

    def _contents(self, state: Mapping[str, Any]) -> tuple[list, list, dict[str, bytes], dict[str, list[str]],
                                                            list[tuple[str, str, torch.Tensor]]]:
        """What this rank writes of ``state``: its files, its self-made copies, each file's packed tree
        and entry names, and the (file, key, tensor) items to snapshot."""
        parts = self._split(state)
        files = self.placement.writes(self.rank)
        self_made = [c for c in self._copies if c.self_made and c.holder == self.rank]
        trees: dict[str, bytes] = {}
        entries: dict[str, list[str]] = {}
        items: list[tuple[str, str, torch.Tensor]] = []
        for role in [*files, *(c.file for c in self_made)]:
            content = parts[role.kind]
            flat = flatten(content)
            trees[role.name] = pack_tree(flat)
            entries[role.name] = list(content)
            items += [(role.name, k, t) for k, t in flat.tensors.items()]
        return files, self_made, trees, entries, items

    def _split(self, state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """This rank's share of ``state``, by file kind."""
        if not isinstance(state, Mapping):
            raise TypeError(f"Checkpointer.save: state must be a dict of entries, got {type(state).__name__}")
        bad = [k for k in state if not isinstance(k, str)]
        if bad:
            raise TypeError(f"Checkpointer.save: top-level state keys must be strings, got {bad[:3]}")
        parts: dict[str, dict[str, Any]] = {GLOBAL: {}, STAGE: {}, RANK: {}}
        for k, v in state.items():
            kind = STAGE if k in self.replicated else RANK if k in self.per_rank else GLOBAL
            parts[kind][k] = v
        if not self.placement.snapshots_replicated(self.rank):
            parts[STAGE] = {}
        if self.rank != 0:
            parts[GLOBAL] = {}
        return parts

    def before_update(self) -> None:
        """Block until the last ``save(overlap=True)`` has its copy: call before the optimizer step.

        Cheap when there is nothing to wait for. On CUDA it does not block the host: the compute stream
        waits for the copy stream.
        """
        snap = self._snapshot
        if snap is not None:
            snap.guard()
            if not snap.pending:
                self._snapshot = None

    def attach(self, optimizer: torch.optim.Optimizer) -> Any:
        """Call :meth:`before_update` before every ``optimizer.step()``; returns the hook's handle."""
        return optimizer.register_step_pre_hook(lambda *_: self.before_update())

    def wait(self) -> None:
        """Block until every save so far is published at every level (L3 flush included).

        Raises the error of a failed save or flush.
        """
        self._wait_persist()
        self._writer.check_flushes(raise_errors=True, block=True)

    def close(self) -> None:
        """Wait for everything, then stop the writer threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wait_persist(self) -> None:
        name = self._writer.wait_persist()
        if name is not None:
            self._parent = name  # the lineage of the next save

    # ------------------------------------------------------------------------------------------- read
    def _found(self) -> list[Found]:
        """Versions with an intact manifest in sight, oldest first."""
        return sorted((f for f in scan(self.levels).values() if f.manifest is not None),
                      key=lambda f: f.order)

    def versions(self) -> list[Version]:
        """Every complete version this process can see, oldest first (by the time it was saved)."""
        out = []
        for f in self._found():
            levels = complete_levels(self.levels, f)
            if not levels and not available(self.levels, f):
                continue
            body = f.manifest
            assert body is not None
            out.append(Version(f.name, body["step"], body["time"], body["bytes"], tuple(levels),
                               dict(body["metadata"])))
        return out

    def latest(self) -> int | None:
        """The step of the newest version whose every file this process sees at some level, or None.

        Never names a version still being written (it has no manifest yet). Checksums are checked by
        :meth:`load`, which falls back further if needed.
        """
        for f in reversed(self._found()):
            if available(self.levels, f):
                return f.step
        return None

    def load(self, step: int | None = None, *, keys: Callable[[str], bool] | Iterable[str] | None = None
             ) -> dict[str, Any] | None:
        """This rank's state from the newest intact version (or the newest of ``step``); None if there is
        no checkpoint at all.

        Collective when there is a process group. The result holds the replicated entries merged over
        all pipeline stages of the saved layout (only the leaves ``keys`` selects: key names such as
        ``"model"`` or ``"model/fc.weight"``, a predicate, or None for all; see
        :func:`hybridpar.checkpoint.keys_of`), the global entries, and this rank's per-rank entries if it
        existed in the saved layout. Tensors are on the CPU. A version that fails its checks is skipped
        with a warning naming the problem; with ``step`` given, that is an error instead.
        """
        self.wait()
        keep_key = key_filter(keys)
        g = self._persist_group
        found = {f.name: f for f in self._found()}
        mine = [(f.order, f.name) for f in found.values() if step is None or f.step == step]
        names = sorted({c for cands in g.all_gather(mine) for c in cands}, reverse=True)
        problems: list[str] = []
        for _, name in names:
            notes: list[str] = []
            try:
                if name not in found:
                    raise CorruptFile(f"no intact manifest visible on rank {self.rank}")
                flat, notes = read_version(self.levels, found[name].manifest, self.rank, keep_key)
                err = ""
            except CheckpointError as e:
                err = str(e)
            every = g.all_gather((err, notes))
            bad = [(r, e) for r, (e, _) in enumerate(every) if e]
            if not bad:
                self._warn_skipped(name, found, problems)
                if self.rank == 0:  # every rank's notes, once per job
                    for n in dict.fromkeys(n for _, ns in every for n in ns):
                        warnings.warn(f"checkpoint {name}: {n}", stacklevel=2)
                self._parent = name
                return unflatten(flat)
            detail = _by_message(bad)
            if step is not None:
                raise CheckpointError(f"checkpoint of step {step} ({name}) is damaged: {detail}")
            problems.append(f"{name}: {detail}")
        if problems:
            raise CheckpointError(f"no intact checkpoint under {self.root}: " + " | ".join(problems))
        if step is not None:
            have = sorted({f.step for f in found.values()})
            raise CheckpointError(f"no checkpoint of step {step} under {self.root} (steps: {have})")
        self._warn_skipped(None, found, problems)
        return None

    def _warn_skipped(self, chosen: str | None, found: dict[str, Found], problems: list[str]) -> None:
        """Name what load passed over: damaged versions, and incomplete ones newer than the choice."""
        chosen_step = found[chosen].step if chosen else -1
        skipped = list(problems)
        for f in scan(self.levels).values():
            if f.manifest is None and f.step >= chosen_step:
                why = "; ".join(f.problems) or "no manifest: the save never completed"
                skipped.append(f"{f.name}: {why}")
        if skipped and self.rank == 0:  # problems hold every rank's findings: said once per job
            using = f"loading {chosen}" if chosen else "starting fresh"
            warnings.warn(f"skipped newer checkpoint(s), {using}: " + " | ".join(skipped), stacklevel=3)


def _by_message(bad: list[tuple[int, str]], most: int = 4) -> str:
    """``ranks 0, 1: msg; rank 3: other``: per-rank errors, ranks with the same message together."""
    ranks: dict[str, list[int]] = {}
    for r, e in bad:
        ranks.setdefault(e, []).append(r)
    parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in ranks.items()]
    return "; ".join(parts[:most]) + (f"; and {len(parts) - most} more" if len(parts) > most else "")
