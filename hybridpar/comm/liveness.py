"""Which ranks still answer, so that a collective timeout can say who stopped.

Why: a rank that stops answering (SIGSTOP, a debugger, a hung host) leaves the others waiting in a
collective until the group's timeout, and gloo's error then names neither the operation nor the peer
("Timed out waiting 10000ms for recv operation to complete"). Worse, the timeout closes the group, so
no collective can ask who is missing. The rendezvous store still answers (torchrun's agent hosts it, or
rank 0), so every rank beats a counter there from a daemon thread; a rank a timeout hits reads all
counters twice, a few beats apart: ranks whose counter did not move have stopped. The operation comes
from the profiling range the error left (:func:`hybridpar.profiling.where`: the halo exchange, the
pipeline transfer or the gradient reduction, and the step) and from the caller.
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from hybridpar import profiling
from hybridpar.comm import peers
from hybridpar.comm.store import default_store

_PREFIX = "hybridpar/beat/"


class CollectiveTimeout(RuntimeError):
    """A collective or transfer gave up waiting for a peer; the message names the operation and the
    ranks that stopped answering."""


class PeerDied(CollectiveTimeout):
    """A peer's process ended while this rank waited for it; the message names the rank and how it
    ended (:mod:`hybridpar.comm.peers`)."""


@dataclass
class _Heart:
    store: dist.Store
    every: float
    world: int
    timeout_s: float
    stopped: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


_heart: list[_Heart] = []  # this process's heartbeat, once started


def beat_interval(timeout_s: float) -> float:
    """Seconds between beats: a tenth of the timeout, within [0.2, 5] (cheap, and quick to judge)."""
    return min(max(timeout_s / 10.0, 0.2), 5.0)


def start(timeout_s: float) -> None:
    """Beat this rank's counter in the default group's store until :func:`stop` (once per group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    store = default_store()
    if _heart and _heart[0].store is store:
        return
    stop()  # a new default group: the old beat ends with its store
    heart = _Heart(store, beat_interval(timeout_s), dist.get_world_size(), float(timeout_s))
    key = f"{_PREFIX}{dist.get_rank()}"
    heart.store.add(key, 1)  # the key exists before anyone can ask for it
    peers.register(heart.store, dist.get_rank())

    def beat() -> None:
        while not heart.stopped.wait(heart.every):
            try:
                heart.store.add(key, 1)
            except Exception:  # the store's host is gone: nothing left to tell
                return

    heart.thread = threading.Thread(target=beat, name="hybridpar-heartbeat", daemon=True)
    heart.thread.start()
    _heart.append(heart)


def stop(wait_s: float = 10.0) -> None:
    """End this process's heartbeat and wait (up to ``wait_s``) for its thread to leave.

    Why before the interpreter exits (:func:`hybridpar.process.launchers.shutdown` calls it): a store
    call releases the GIL in C++, and a daemon thread that comes back from one while the interpreter
    finalises is ended by ``pthread_exit`` inside a ``noexcept`` destructor: ``terminate called
    without an active exception`` and SIGABRT after a run that succeeded. The beat waits on an event,
    so it leaves at once unless a store call is under way.
    """
    while _heart:
        heart = _heart.pop()
        heart.stopped.set()
        if heart.thread is not None:
            heart.thread.join(timeout=wait_s)


def silent_ranks() -> list[int] | None:
    """Ranks whose heartbeat stood still over 2.5 beats (this call waits that long); None if unknown
    (no heartbeat started, or the store itself does not answer)."""
    if not _heart:
        return None
    heart = _heart[0]
    keys = [f"{_PREFIX}{r}" for r in range(heart.world)]
    try:
        heart.store.set_timeout(timedelta(seconds=max(5.0, 4 * heart.every)))
        before = heart.store.multi_get(keys)
        time.sleep(2.5 * heart.every)
        after = heart.store.multi_get(keys)
    except Exception:
        return None
    return [r for r in range(len(keys)) if before[r] == after[r]]


_TIMEOUT_TEXT = re.compile(r"timed out|timeout|connection (closed|reset) by peer", re.IGNORECASE)
_LOST_TEXT = re.compile(r"connection (closed|reset) by peer", re.IGNORECASE)
_GLOO_ADVICE = re.compile(r"\.?\s*This is typically caused by .*$", re.IGNORECASE | re.DOTALL)
"""gloo's advice appended to its errors ("Check the logs of the remote worker ... GLHF!"), which the
line replaces with what it found out."""


def is_timeout(err: BaseException) -> bool:
    """Whether ``err`` is a peer not answering: a gloo/local transfer timeout or a lost connection."""
    return isinstance(err, RuntimeError) and not isinstance(err, CollectiveTimeout) \
        and bool(_TIMEOUT_TEXT.search(str(err)))


def explain(err: BaseException, doing: str = "") -> CollectiveTimeout:
    """A :class:`CollectiveTimeout` for ``err`` (see :func:`is_timeout`): which operation waited, on
    which rank, and which ranks stopped answering. ``doing`` is the caller's description."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    cause = re.sub(r"^\[[^\]]*\]\s*", "", cause)  # gloo's "[file.cc:78] " prefix
    cause = _GLOO_ADVICE.sub("", cause)
    where = ", ".join(p for p in (doing, profiling.where(err)) if p)
    limit = _heart[0].timeout_s if _heart else None
    # A closed connection is a peer whose process ended (killed, crashed): nothing to wait for, and a
    # launcher that restarts the job (torchrun --max-restarts) is waiting for this rank to exit.
    lost = bool(_LOST_TEXT.search(str(err)))
    if lost and _heart:
        died = _died(rank, where)
        if died is not None:
            return died
    if lost:  # no peer on this host was seen to end: say what is known, and blame no rank for it
        return PeerDied(f"rank {rank} lost its connection to a peer{' ' + where if where else ''}: {cause}; "
                        "a peer's process ended, not on this host as far as it can see (its own error, if "
                        "it could print one, comes first; the launcher's report names it)")
    silent = silent_ranks()
    if silent is None:
        who = ("the rendezvous store does not answer either (rank 0 hosts it unless torchrun does): rank 0 "
               "has probably stopped")
    elif silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} stopped answering"
    else:
        who = ("every rank still answers: one is slower than the timeout allows, or the ranks called "
               "different collectives")
    setting = f" (timeout_s = {limit:g})" if limit is not None else ""
    return CollectiveTimeout(f"rank {rank} gave up waiting{' ' + where if where else ''}: {cause}{setting}; "
                             f"{who}")


_EXITING_S = 1.0
"""How long a closed connection waits for its peer to show as ended: a process closes its sockets
while it exits, before ``/proc`` shows it gone (a large address space takes a while to tear down)."""
_NO_STATUS = ("without an exit status this rank can read: a signal it cannot catch (SIGKILL: the OOM "
              "killer, a user, a scheduler) or a crash; the launcher's report names it")


def _died(rank: int, where: str) -> PeerDied | None:
    """A :class:`PeerDied` naming the peers whose processes ended and how, as far as this host can see;
    None if none of this host's peers ended (the one that did ran elsewhere)."""
    heart = _heart[0]
    deadline = time.monotonic() + _EXITING_S
    while True:
        gone, elsewhere = peers.ended(heart.store, heart.world)
        gone = [g for g in gone if g.rank != rank]
        if gone or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if not gone:
        return None
    what = "; ".join(f"rank {g.rank} (pid {g.pid}) died{': ' + g.how if g.how else ' ' + _NO_STATUS}"
                     for g in gone)
    waited = f"rank {rank} was waiting for {'it' if len(gone) == 1 else 'them'}{' ' + where if where else ''}"
    unseen = f" (ranks {', '.join(map(str, elsewhere))} run on other hosts, unseen from here)" \
        if elsewhere else ""
    return PeerDied(f"{what}; {waited}{unseen}")
