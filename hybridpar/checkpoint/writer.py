"""The background half of a :class:`~hybridpar.checkpoint.Checkpointer`: from a snapshot to a published
version, on two threads.

Why apart from the API: ``save`` only snapshots and returns; everything that touches a disk or waits for
another rank happens here, so that the training loop never does. Per save the persist thread

1. writes this rank's files to L1 (or straight to the root), each fsynced;
2. agrees with all ranks that every file landed, then makes the L2 partner copies (see :mod:`.placement`);
3. agrees again, and publishes the manifest (temp, fsync, rename, directory fsync) in each level
   directory; only now does the version exist for ``latest``/``load``;
4. applies retention, and queues the L3 flush, which the flush thread runs (copy L1 to the root, agree,
   publish the root's manifest, apply the retention policy there).

A second save waits only for steps 1-3 of the previous one (its host buffers are reused); the L3 flush
runs on. The agreement steps use private gloo groups (:mod:`.group`), so they never interleave with the
training loop's own collectives. A failure on any rank fails the save on every rank (none may hang
waiting for the others), deletes what was written, and leaves the previous version intact.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hybridpar.checkpoint import faults
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.file_placement import Copy, FileRole, Placement
from hybridpar.checkpoint.format import FOOTER, CheckpointError, fsync_dir, make_dirs, write_bytes, write_file
from hybridpar.checkpoint.group import Group
from hybridpar.checkpoint.levels import L1, L2, Levels, copy_durable, remove_version, scan_dir
from hybridpar.checkpoint.retention import Policy, Record, keep, newest_per_step
from hybridpar.checkpoint.snapshot import Snapshot


@dataclass
class Job:
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



class Writer:
    """The persist and flush threads of one Checkpointer, and what they share (see the module docstring).

    ``manifest_fields`` are the manifest entries that are the same for every version of this
    Checkpointer (``session``, ``config``, ``layout``, ``scopes``).
    """

    def __init__(self, *, rank: int, levels: Levels, placement: Placement, copies: list[Copy], leader: bool,
                 policy: Policy, keep_local: int, session: str, manifest_fields: dict[str, Any],
                 persist_group: Group, flush_group: Group | None, flush: bool) -> None:
        self.rank = rank
        self.levels = levels
        self.root = levels.root
        self.placement = placement
        self.policy = policy
        self.keep_local = keep_local
        self.session = session
        self._copies = copies
        self._leader = leader
        self._fields = manifest_fields
        self._persist_group = persist_group
        self._flush_group = flush_group
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-persist")
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="ckpt-flush") if flush else None
        self._pending: Future | None = None
        self._flushes: list[Future] = []
        self._unflushed: set[str] = set()
        self._lock = threading.Lock()

    def submit(self, job: Job) -> None:
        """Start persisting ``job`` (the previous one must be waited for first)."""
        self._pending = self._writer.submit(self._persist, job)

    def wait_persist(self) -> str | None:
        """Wait for the last submitted job to be published at L1/L2 (or the root); its name, or None if
        there was none. Raises its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def check_flushes(self, raise_errors: bool, block: bool = False) -> None:
        """Collect finished L3 flushes (all of them with ``block``): raise the first error, or warn."""
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

    def shutdown(self) -> None:
        """Stop the threads and close the groups (after waiting for everything)."""
        self._writer.shutdown()
        if self._flusher is not None:
            self._flusher.shutdown()
        for g in (self._persist_group, self._flush_group):
            if g is not None:
                g.close()

    # ------------------------------------------------------------------------------------ persist thread
    def _persist(self, job: Job) -> str:
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
        return job.name  # the lineage of the next save

    def _agree(self, g: Group, job: Job, err: str, doing: str) -> None:
        self._fail_if(job, list(enumerate(g.all_gather(err))), doing)

    def _fail_if(self, job: Job, errs: list[tuple[int, str]], doing: str) -> None:
        bad = [(r, e) for r, e in errs if e]
        if not bad:
            return
        for p in job.done:
            with contextlib.suppress(OSError):
                os.unlink(p)
        detail = "; ".join(f"rank {r}: {e}" for r, e in bad[:4])
        raise CheckpointError(f"save of step {job.step} ({job.name}) failed while {doing} ({detail}); the "
                              f"previous version is intact")

    def _partner_copies(self, job: Job, l1dir: Path) -> dict[str, dict[str, int]]:
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

    def _manifest(self, job: Job, results: list[dict[str, Any]]) -> dict[str, Any]:
        files: dict[str, dict[str, Any]] = {}
        for role in self.placement.files():
            res = results[role.writer]
            files[role.name] = {"kind": role.kind, "stage": role.stage, "rank": role.writer,
                                "entries": res["entries"][role.name], "copies": [],
                                **res["written"][role.name]}
        for r, res in enumerate(results):
            for fname, rec in res["copies"].items():
                files[fname]["copies"].append({"level": L2, "holder": r, **rec})
        fields = self._fields
        return {"format": mf.FORMAT, "name": job.name, "step": job.step, "time": results[0]["time"],
                "session": fields["session"], "metadata": results[0]["metadata"], "config": fields["config"],
                "order": results[0]["order"],
                "layout": fields["layout"], "files": files, "scopes": fields["scopes"],
                "bytes": sum(f["size"] for f in files.values())}

    # -------------------------------------------------------------------------------------- flush thread
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
            newest = newest_per_step(complete)[-self.keep_local:]
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
