"""One line per failure: the first rank that fails speaks, the others stay quiet.

Why: an error raised on every rank (a bad config, a missing file) would print once per rank, and a
fault on one rank would make every other rank print its own secondary error (a closed connection, a
timeout) on top. The ranks agree through the rendezvous store, which every launcher provides and
which stays usable after a collective has failed: the first rank to claim the failure prints its line;
the others print nothing.

Under torchrun each rank also writes its line to the error file torchelastic names in
``TORCHELASTIC_ERROR_FILE`` (what ``torch.distributed.elastic``'s ``@record`` does with a traceback),
so torchrun's closing report shows that line as the root cause instead of a link to its docs; the
ranks that stopped because of it say so, dated a second later, so that torchrun (which picks the
earliest) names the right rank.

A failure no entry point foresaw (an exception that escapes its one-line reporting) is recorded by
``@record`` itself: :func:`run_main` runs an entry point under it, so torchrun's report names that
traceback as the root cause too.

Exit codes (:data:`CONFIG_ERROR`, :data:`RUNTIME_FAULT`) tell a job that cannot start as configured
from one that failed while running. mpirun and srun pass a rank's code on; torchrun exits 1 and shows
each rank's code in its report.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import NoReturn

import torch.distributed as dist

from hybridpar.comm import peers
from hybridpar.comm.store import default_store

CONFIG_ERROR = 2
"""The job cannot run as configured: a bad key or value, a missing file, a spec that does not fit, a
checkpoint of another model. Fix the command line or the config; running it again will not help."""
RUNTIME_FAULT = 1
"""The job failed while running: damaged data, a diverged loss, a rank that stopped answering, a bug.
Resuming from the newest checkpoint may help."""

_KEY = "hybridpar/failure"
_STORE_TIMEOUT = timedelta(seconds=10)  # a store that does not answer (its host is gone) must not hang us
_QUIET_GRACE_S = 5.0  # how long a quiet rank waits, before any group exists, for rank 0 to speak


def _store() -> dist.Store | None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    try:
        return default_store()
    except (RuntimeError, ValueError):
        return None


def _launcher_rank() -> int:
    """This process's rank before (or without) a process group, from the launcher's environment."""
    from hybridpar.process.launchers import detect_launcher  # noqa: PLC0415 (launch imports torch.distributed)

    found = detect_launcher()
    return found[1] if found else 0


def first(key: str) -> bool:
    """True on exactly one rank of the job: the first to ask for ``key`` (every rank without a group)."""
    store = _store()
    if store is None:
        return True
    try:
        store.set_timeout(_STORE_TIMEOUT)
        return store.add(f"hybridpar/once/{key}", 1) == 1
    except (RuntimeError, OSError):
        return True


def report(line: str, code: int = RUNTIME_FAULT) -> int:
    """Print ``line`` to stderr if this rank failed first in the job, record it for torchrun, and
    return ``code`` (the process's exit status).

    Before a process group exists every rank is assumed to meet the same error (configuration), and
    rank 0 speaks. When the store cannot be reached, every rank speaks, prefixed with its rank.
    """
    _keep_exit_code()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else _launcher_rank()
    store = _store()
    stamp = int(time.time())
    if store is None:
        root, root_line, root_stamp, speak = 0, line, stamp, rank == 0
    else:
        try:
            store.set_timeout(_STORE_TIMEOUT)
            if store.add(_KEY, 1) == 1:
                store.set(f"{_KEY}/first", json.dumps([rank, line, stamp]))
                root, root_line, root_stamp = rank, line, stamp
            else:
                root, root_line, root_stamp = json.loads(store.get(f"{_KEY}/first"))
            store.add(f"{_KEY}/known", 1)
            speak = root == rank
        except (RuntimeError, OSError, ValueError):
            root, root_line, root_stamp, speak = rank, f"rank {rank}: {line}", stamp, True
    if speak:
        print(root_line, file=sys.stderr, flush=True)
        _error_file(root_line, stamp)
    else:
        if store is None and dist.is_available() and not dist.is_initialized():
            # Before any group: rank 0 meets the same error and speaks; a quiet rank that left at once
            # would have the launcher stop rank 0 (torchrun's SIGTERM) before it printed the line. Its
            # own time is all it knows of rank 0's: dated after the wait, it stays the later of the two
            # however much later rank 0 started (within the wait).
            time.sleep(_QUIET_GRACE_S)
            root_stamp = int(time.time())
        _error_file(f"stopped because rank {root} failed (the root cause below)", max(stamp, root_stamp + 1))
    if code == CONFIG_ERROR and store is not None and _hosts_store(rank):
        _wait_for_peers(store)
    return code


def _hosts_store(rank: int) -> bool:
    """Whether this process serves the rendezvous store: rank 0 does under mpirun, srun and ``env://``;
    torchrun's agent serves it for its workers."""
    return rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _wait_for_peers(store: dist.Store) -> None:
    """Keep the store up until every rank has read the job's line (or :data:`_QUIET_GRACE_S` passed).

    Why: the store lives in this process. A configuration error is met by every rank, and one that
    meets it a moment later (a loaded machine) would find the store gone once this one left, and print
    its own copy of the line. A runtime fault leaves at once: its peers may never report (hung or dead),
    and a restart should not wait for them.
    """
    end = time.monotonic() + _QUIET_GRACE_S
    try:
        while store.add(f"{_KEY}/known", 0) < dist.get_world_size() and time.monotonic() < end:
            time.sleep(0.02)
    except (RuntimeError, OSError):
        pass


def leave(code: int) -> NoReturn:
    """End the process with ``code`` (a process entry point's last call).

    After a failure, threads may still wait in a collective with a peer that died (a checkpoint
    writer's all-gather): a normal exit joins them and hangs until the launcher kills the process,
    and a peer waiting on this rank hangs with it, so a restart would wait out the launcher's grace
    period (torchrun's 30 s) for nothing. A failed process therefore flushes its output and leaves at
    once; checkpoints are unharmed (a version counts only once its manifest is renamed into place).
    A successful one exits normally.
    """
    if code == 0:
        sys.exit(0)
    peers.record_exit(code)  # what a peer's error line says of this rank (hybridpar.comm.peers)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_main(main: Callable[[], int | None]) -> NoReturn:
    """Run a process entry point's ``main`` and :func:`leave` with its exit status, under torchelastic's
    ``@record`` (``torch.distributed.elastic.multiprocessing.errors``): an exception ``main`` lets
    escape is written to ``TORCHELASTIC_ERROR_FILE`` (torchrun's root cause), printed, and ends the
    process with :data:`RUNTIME_FAULT`. Imported here, when the entry point runs, not before its
    ``--help``. A ``SystemExit`` (argparse's usage error: 2) passes through as it is."""
    from torch.distributed.elastic.multiprocessing.errors import record  # noqa: PLC0415

    try:
        code = record(main)()
    except Exception:
        traceback.print_exc()
        leave(RUNTIME_FAULT)
    leave(code or 0)


def _keep_exit_code() -> None:
    """Ignore SIGTERM from here on: torchrun sends it to every rank as soon as one has exited, and a
    rank still on its way out would then report -15 instead of its own code (in the main thread only)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        pass


def _error_file(message: str, stamp: int) -> None:
    """Write torchelastic's error file, if the launcher asked for one (the format ``@record`` writes, with
    ``message`` in place of the traceback torchrun shows)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    body = {"message": message, "extraInfo": {"py_callstack": message, "timestamp": str(stamp)}}
    try:
        with open(path, "w") as f:
            json.dump({"message": body}, f)
    except OSError:
        pass
