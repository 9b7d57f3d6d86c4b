"""Which peer process ended, and how: for the one line a survivor prints when a connection closes.

Why: when a rank's process dies (SIGKILL from the OOM killer or a user, a crash, an exit), every other
rank's next collective fails with gloo's "Connection reset by peer", which names an address, not a
rank, and the survivor that reports it first would otherwise be taken for the rank that failed. The
launcher (torchrun) knows the exit status but only tells it at the end; a sibling process cannot wait
for it. So each rank records in the rendezvous store, when the group starts, its host, process id and
start time (:func:`register`), and its exit code when it leaves through
:func:`hybridpar.process.failure.leave` (:func:`record_exit`). A survivor then looks up each peer on its
own host in ``/proc``: a process that is gone (or is another process under the same id) has ended; one
not yet reaped by its parent is a zombie whose exit status ``/proc/PID/stat`` still holds. Peers on
other hosts cannot be seen from here: :func:`ended` says so rather than guess.
"""

from __future__ import annotations

import json
import os
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

_PROC = "hybridpar/proc/"
_EXIT = "hybridpar/exit/"
_TIMEOUT = timedelta(seconds=5)  # a store that does not answer must not hold up the error line
_registered: list[tuple[dist.Store, int]] = []


@dataclass(frozen=True)
class Ended:
    """A peer whose process has ended: its rank, process id, and how (``None``: not known)."""

    rank: int
    pid: int
    how: str | None


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (field 3 on), or None if there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def _start_time(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields and len(fields) > 19 else None  # field 22: start time, in clock ticks


def _host() -> str:
    """Which process table this process is in: the host name, its boot and its pid namespace (two
    containers on one machine may share a name but not their process ids)."""
    parts = [socket.gethostname()]
    for read in (lambda: Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                 lambda: os.readlink("/proc/self/ns/pid")):
        try:
            parts.append(read())
        except OSError:
            parts.append("?")
    return " ".join(parts)


def register(store: dist.Store, rank: int) -> None:
    """Record this process (host, pid, start time) under ``rank`` in ``store`` (once per store)."""
    if any(s is store for s, _ in _registered):
        return
    me = {"host": _host(), "pid": os.getpid(), "start": _start_time(os.getpid())}
    store.set(f"{_PROC}{rank}", json.dumps(me))
    _registered[:] = [(store, rank)]


def record_exit(code: int) -> None:
    """Record this process's exit code for its peers (a process about to leave; never raises)."""
    for store, rank in _registered:
        try:
            store.set_timeout(_TIMEOUT)
            store.set(f"{_EXIT}{rank}", str(code))
        except Exception:  # noqa: BLE001 (the store's host may be gone: nothing left to tell)
            pass


def describe_status(status: int) -> str:
    """A wait status (``waitpid``'s, as ``/proc/PID/stat`` keeps it) as torchrun's report puts it."""
    if status & 0x7F:
        number = status & 0x7F
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        return f"killed by {name}"
    return f"exited with code {(status >> 8) & 0xFF}"


def _recorded(store: dist.Store, rank: int) -> str | None:
    """How ``rank`` said it would leave (:func:`record_exit`), or None."""
    try:
        if store.check([f"{_EXIT}{rank}"]):
            return f"exited with code {int(store.get(f'{_EXIT}{rank}'))}"
    except (RuntimeError, ValueError):
        pass
    return None


def ended(store: dist.Store, world: int) -> tuple[list[Ended], list[int]]:
    """The peers on this host whose processes have ended, and the ranks on other hosts (unseen)."""
    host = _host()
    gone: list[Ended] = []
    elsewhere: list[int] = []
    try:
        store.set_timeout(_TIMEOUT)
        keys = [f"{_PROC}{r}" for r in range(world)]
        present = keys if store.check(keys) else [k for k in keys if store.check([k])]
        records = {int(k[len(_PROC):]): json.loads(v) for k, v in zip(present, store.multi_get(present))}
    except (RuntimeError, ValueError):
        return [], []
    for rank, rec in sorted(records.items()):
        if rec["host"] != host:
            elsewhere.append(rank)
            continue
        fields = _stat(rec["pid"])
        reused = rec["start"] is not None and fields is not None and fields[19] != rec["start"]
        if fields is None or fields[0] in ("Z", "X") or reused:
            zombie = fields is not None and not reused and fields[0] == "Z" and len(fields) > 49
            # a zombie keeps its wait status (field 52) until its parent reaps it
            how = describe_status(int(fields[49])) if zombie else _recorded(store, rank)
            gone.append(Ended(rank, rec["pid"], how))
    return gone, elsewhere
