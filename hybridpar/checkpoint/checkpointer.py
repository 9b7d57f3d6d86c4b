"""The Checkpointer: snapshot now, persist in the background, publish with a manifest, restart from the
newest intact version at any level.

Why this shape: the training loop must lose as little time as possible per checkpoint, and a killed job
must never lose more than the steps since the last *complete* version. So ``save`` only copies the state
into reused host buffers (or, with ``overlap=True``, not even that: see :mod:`.snapshot`) and hands the
rest to a writer thread, which per save:

1. writes this rank's files to L1 (or straight to the root), each fsynced;
2. agrees with all ranks that every file landed, then makes the L2 partner copies (see :mod:`.placement`);
3. agrees again, and publishes the manifest (temp, fsync, rename, directory fsync) in each level
   directory; only now does the version exist for ``latest``/``load``;
4. applies retention, and queues the L3 flush, which a second thread runs (copy L1 to the root, agree,
   publish the root's manifest, apply the retention policy there).

A second ``save`` waits only for step 1-3 of the previous one (its host buffers are reused); the L3
flush runs on. The agreement steps use private gloo groups (:mod:`.group`), so they never interleave with
the training loop's own collectives.

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

import contextlib
import hashlib
import json
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint import faults
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.format import (
    FOOTER,
    CheckpointError,
    CorruptFile,
    fsync_dir,
    make_dirs,
    pack_tree,
    write_bytes,
    write_file,
)
from hybridpar.checkpoint.group import Group
from hybridpar.checkpoint.levels import (
    L1,
    L2,
    Found,
    Levels,
    available,
    complete_levels,
    copy_durable,
    remove_version,
    scan,
    scan_dir,
)
from hybridpar.checkpoint.placement import GLOBAL, RANK, STAGE, Copy, FileRole, Placement
from hybridpar.checkpoint.restore import read_version
from hybridpar.checkpoint.retention import Policy, Record, keep
from hybridpar.checkpoint.snapshot import HostBuffers, Snapshot
from hybridpar.checkpoint.tree import flatten, key_filter, unflatten


@dataclass(frozen=True)
class Version:
    """One complete version as this process sees it.

    ``metadata`` holds what ``save`` was given (e.g. ``epoch``, ``metrics``) plus ``config_hash``,
    ``code_version`` and ``parent`` (the version this run resumed from or saved before: its lineage).
    ``levels`` are the levels at which this process sees every file of the version.
    """

    name: str
    step: int
    time: float
    bytes: int
    levels: tuple[str, ...]
    metadata: dict[str, Any]

    @property
    def epoch(self) -> int | None:
        return self.metadata.get("epoch")

    @property
    def metrics(self) -> dict[str, Any]:
        return self.metadata.get("metrics", {})

    @property
    def parent(self) -> str | None:
        return self.metadata.get("parent")


@dataclass
class _Job:
    """One save on its way to disk."""

    name: str
    step: int
    seq: int
    time: float
    metadata: dict[str, Any]
    files: list[FileRole]
    self_made: list[Copy]
    trees: dict[str, bytes]
    entries: dict[str, list[str]]
    order: list[str]
    snap: Snapshot
    done: list[str] = field(default_factory=list)


def _code_version() -> str:
    """hybridpar's version, plus the git commit of the checkout it runs from, read without running git."""
    import hybridpar  # noqa: PLC0415 (avoid an import cycle at module load)

    version = getattr(hybridpar, "__version__", "unknown")
    here = Path(__file__).resolve()
    for d in here.parents:
        git = d / ".git"
        if git.is_dir():
            try:
                head = (git / "HEAD").read_text().strip()
                if head.startswith("ref:"):
                    ref = head[4:].strip()
                    p = git / ref
                    if p.exists():
                        head = p.read_text().strip()
                    else:
                        packed = (git / "packed-refs").read_text().splitlines()
                        head = next(line.split()[0] for line in packed if line.endswith(" " + ref))
                return f"{version}+g{head[:12]}"
            except (OSError, StopIteration):
                return version
    return version


def _config_hash(config: Mapping[str, Any] | None) -> str | None:
    if config is None:
        return None
    text = json.dumps(config, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


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
        self._meta_auto = {"config_hash": _config_hash(config), "code_version": _code_version()}
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
        self._leader = self.rank == min(r for r in range(self.world) if node_of[r] == node_of[self.rank])

        self._buffers = HostBuffers()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-flush") if local else None
        self._pending: Future | None = None
        self._flushes: list[Future] = []
        self._unflushed: set[str] = set()
        self._lock = threading.Lock()
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
        self._check_flushes(raise_errors=False)
        meta = mf.jsonable(dict(metadata or {}))
        for k, v in self._meta_auto.items():
            meta.setdefault(k, v)
        meta.setdefault("parent", self._parent)
        name = mf.version_name(step, self.session, self._seq)
        self._seq += 1

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
        snap = Snapshot(items, self._buffers, overlap=overlap, overlap_min_bytes=self.overlap_min_bytes)
        self._snapshot = snap if snap.pending else None
        job = _Job(name, step, self._seq - 1, time.time(), meta, files, self_made, trees, entries,
                   list(state), snap)
        self._pending = self._writer.submit(self._persist, job)

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
        self._check_flushes(raise_errors=True, block=True)

    def close(self) -> None:
        """Wait for everything, then stop the writer threads."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._writer.shutdown()
            if self._flusher is not None:
                self._flusher.shutdown()
            for g in (self._persist_group, self._flush_group):
                if g is not None:
                    g.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wait_persist(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _check_flushes(self, raise_errors: bool, block: bool = False) -> None:
        keep_running: list[Future] = []
        errors = []
        with self._lock:
            flushes, self._flushes = self._flushes, []
        for f in flushes:
            if not block and not f.done():
                keep_running.append(f)
                continue
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        with self._lock:
            self._flushes[:0] = keep_running
        if errors and raise_errors:
            raise errors[0]
        for e in errors:
            warnings.warn(f"L3 flush failed (the version stays at L1/L2): {e}", stacklevel=3)

    # ------------------------------------------------------------------------------------ writer thread
    def _persist(self, job: _Job) -> None:
        g = self._persist_group
        vdir = self.levels.write_dir() / job.name
        written: dict[str, dict[str, int]] = {}
        copies: dict[str, dict[str, int]] = {}
        err = ""
        try:
            faults.hit("copy", job.step, self.rank)
            job.snap.finish()
            make_dirs(vdir)
            first = lambda: faults.hit("persist", job.step, self.rank)
            for role in job.files:
                host = job.snap.host.get(role.name, [])
                w = write_file(vdir / role.name, host, job.trees[role.name], first)
                written[role.name] = {"size": w.size, "header_crc": w.header_crc}
                job.done.append(str(vdir / role.name))
            fsync_dir(vdir)
        except Exception as e:  # noqa: BLE001 (every rank must learn of it, or the others would hang)
            err = f"{type(e).__name__}: {e}"
        finally:
            job.snap.release()  # never leave before_update() waiting on a copy that will not come
        self._agree(g, job, err, "writing its files")
        if self._copies:
            try:
                copies = self._partner_copies(job, vdir)
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {e}"
        results = g.all_gather({"err": err, "written": written, "copies": copies, "entries": job.entries,
                                "time": job.time, "metadata": job.metadata, "order": job.order})
        self._fail_if(job, [(r, res["err"]) for r, res in enumerate(results)], "making partner copies")
        body = self._manifest(job, results)
        err = ""
        try:
            before = lambda: faults.hit("manifest", job.step, self.rank)
            if self.levels.local is None:
                if self.rank == 0:
                    mf.write(vdir, body, f"r{self.rank}", before)
            elif self._leader:
                mf.write(vdir, body, f"r{self.rank}", before)
                l2 = self.levels.local_dir(L2) / job.name
                if l2.is_dir():
                    mf.write(l2, body, f"r{self.rank}")
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        self._agree(g, job, err, "publishing the manifest")
        if self.levels.local is None:
            if self.rank == 0:
                self._retain(self.root, job.seq, self.policy)
        else:
            if self._leader:
                self._retain(self.levels.local_dir(L1), job.seq, None)
                self._retain(self.levels.local_dir(L2), job.seq, None)
            assert self._flusher is not None
            with self._lock:
                self._unflushed.add(job.name)
                self._flushes.append(self._flusher.submit(self._flush, job.name, job.step, job.seq, body))
        g.all_gather(None)  # retention done everywhere: after wait(), every rank sees the same versions
        self._parent = job.name  # the lineage of the next save (read only once this job is done)

    def _agree(self, g: Group, job: _Job, err: str, doing: str) -> None:
        self._fail_if(job, list(enumerate(g.all_gather(err))), doing)

    def _fail_if(self, job: _Job, errs: list[tuple[int, str]], doing: str) -> None:
        bad = [(r, e) for r, e in errs if e]
        if not bad:
            return
        for p in job.done:
            with contextlib.suppress(OSError):
                os.unlink(p)
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
        raise CheckpointError(f"save of step {job.step} ({job.name}) failed while {doing} ({detail}); the "
                              f"previous version is intact")

    def _partner_copies(self, job: _Job, l1dir: Path) -> dict[str, dict[str, int]]:
        """L2: write self-made stage copies from our own snapshot; exchange the other files' bytes."""
        g = self._persist_group
        l2 = self.levels.local_dir(L2) / job.name
        out: dict[str, dict[str, int]] = {}
        mine = [c for c in self._copies if c.holder == self.rank]
        sends = []  # posted first, so that a failure here cannot leave a partner waiting for them
        for c in self._copies:
            if not c.self_made and c.file.writer == self.rank:
                data = torch.from_file(str(l1dir / c.file.name), shared=False,
                                       size=(l1dir / c.file.name).stat().st_size, dtype=torch.uint8)
                sends += g.send(data, c.holder)
        if mine:
            make_dirs(l2)
        for c in job.self_made:
            w = write_file(l2 / c.file.name, job.snap.host.get(c.file.name, []), job.trees[c.file.name])
            out[c.file.name] = {"size": w.size, "header_crc": w.header_crc}
        for c in mine:
            if c.self_made:
                continue
            data = g.recv(c.file.writer)
            path = l2 / c.file.name
            write_bytes(path, memoryview(data.numpy()))
            _, hcrc, _ = FOOTER.unpack(data[-FOOTER.size:].numpy().tobytes())
            out[c.file.name] = {"size": data.numel(), "header_crc": hcrc}
        for work, _ in sends:
            work.wait()
        if mine:
            fsync_dir(l2)
        return out

    def _manifest(self, job: _Job, results: list[dict[str, Any]]) -> dict[str, Any]:
        files: dict[str, dict[str, Any]] = {}
        for role in self.placement.files():
            res = results[role.writer]
            files[role.name] = {"kind": role.kind, "stage": role.stage, "rank": role.writer,
                                "entries": res["entries"][role.name], "copies": [],
                                **res["written"][role.name]}
        for r, res in enumerate(results):
            for fname, rec in res["copies"].items():
                files[fname]["copies"].append({"level": L2, "holder": r, **rec})
        grid = self.grid
        layout = {"world": self.world, "local": self.levels.local is not None,
                  "stage_of": list(self.placement.stage_of), "node_of": list(self.placement.node_of),
                  "data": grid.data if grid is not None else self.world,
                  "pipe": grid.pipe if grid is not None else 1,
                  "spatial": list(grid.stage_spatial) if grid is not None else [1, 1, 1]}
        return {"format": mf.FORMAT, "name": job.name, "step": job.step, "time": results[0]["time"],
                "session": self.session, "metadata": results[0]["metadata"], "config": self.config,
                "order": results[0]["order"],
                "layout": layout, "files": files,
                "scopes": {"replicated": list(self.replicated), "per_rank": list(self.per_rank)},
                "bytes": sum(f["size"] for f in files.values())}

    def _flush(self, name: str, step: int, seq: int, body: dict[str, Any]) -> None:
        """L3: copy this rank's L1 files to the root, agree, publish the root's manifest, retain."""
        g = self._flush_group
        assert g is not None
        dst = self.root / name
        err = ""
        try:
            make_dirs(dst)
            src = self.levels.local_dir(L1) / name
            for i, role in enumerate(self.placement.writes(self.rank)):
                copy_durable(src / role.name, dst / role.name)
                if i == 0:
                    faults.hit("flush", step, self.rank)
            fsync_dir(dst)
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        try:
            bad = [(r, e) for r, e in enumerate(g.all_gather(err)) if e]
            if bad:
                raise CheckpointError(f"L3 flush of {name} failed: " +
                                      "; ".join(f"rank {r}: {e}" for r, e in bad[:4]))
            err = ""
            if self.rank == 0:
                try:
                    mf.write(dst, body, "r0")
                except Exception as e:  # noqa: BLE001
                    err = f"{type(e).__name__}: {e}"
            bad = [(r, e) for r, e in enumerate(g.all_gather(err)) if e]
            if bad:
                raise CheckpointError(f"publishing {name} at L3 failed: rank {bad[0][0]}: {bad[0][1]}")
        finally:
            with self._lock:
                self._unflushed.discard(name)
        if self.rank == 0:
            self._retain(self.root, seq, self.policy)
        if self._leader:  # what waited for this flush may go now
            self._retain(self.levels.local_dir(L1), seq, None)
            self._retain(self.levels.local_dir(L2), seq, None)
        g.all_gather(None)  # retention done everywhere

    def _retain(self, d: Path, seq: int, policy: Policy | None) -> None:
        """Apply retention in one level directory (``policy`` None: the newest ``keep_local``).

        Deletes complete versions the policy drops, and incomplete ones left by other runs or by failed
        saves of this run; never one still being written or waiting for its L3 flush.
        """
        try:
            self._retain_in(d, seq, policy)
        except OSError as e:  # a version left behind costs space, not correctness: never fail a save
            warnings.warn(f"checkpoint retention in {d} failed: {e}", stacklevel=2)

    def _retain_in(self, d: Path, seq: int, policy: Policy | None) -> None:
        entries = scan_dir(d)
        with self._lock:
            protected = set(self._unflushed)
        complete = [Record(n, b["step"], b["time"], b["metadata"]) for n, b, _ in entries if b is not None]
        if policy is None:
            newest = sorted(complete, key=lambda v: (v.time, v.name))[-self.keep_local:]
            kept = {v.name for v in newest}
        else:
            kept = keep(policy, complete)
        for name, body, problem in entries:
            if name in kept or name in protected or problem is not None:
                continue
            parsed = mf.parse_name(name)
            assert parsed is not None
            if body is None and parsed[1] == self.session and parsed[2] >= seq:
                continue  # ours, and possibly still being written by another rank
            remove_version(d / name)

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
