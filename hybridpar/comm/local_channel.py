"""One direction between two CPU ranks of a host: a ring of descriptors in shared memory, the data
copied by the receiver with ``process_vm_readv`` (the protocol under :mod:`hybridpar.comm.local_p2p`).

Why a module of its own: the protocol of one pair (who may touch which descriptor when, how a
receive matches a send, how a full ring is unblocked, how a dead peer is noticed) is one idea; which
pairs get a channel, and how ranks agree on it, is another (:mod:`~hybridpar.comm.local_p2p`).

Layout of a channel's segment (the sender creates it): three process-shared semaphores (a lock
around the descriptors, a doorbell for each side), a header of int64 fields, then a ring of
descriptors (state, sequence number, tag, address, size). ``isend`` writes a descriptor and rings
the receiver; the sender's tensor stays referenced until the receiver has copied it. A receive
matches descriptors by tag, oldest first (MPI's non-overtaking rule), copies, marks them done and
rings the sender. Descriptors are touched only under the lock, whose semaphore operations order
memory on any architecture. No thread of our own: progress is made whenever this rank calls in
(posting, ``is_completed``, ``wait``). A receiver that waits for a tag while the sender's ring is
full of others copies the oldest out to a side buffer, so an out-of-order receive cannot deadlock
the pair. Waits are sliced: a peer that died is reported within a second, naming it.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import functools
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

RING = 256  # descriptors per channel: more sends outstanding than this wait in the sender's queue
_SEM_BYTES = 64  # sem_t is 32 bytes on 64-bit glibc; padded
_LOCK, _TO_RECEIVER, _TO_SENDER = 0, 1, 2  # the three semaphores, in this order
_HEADER = 3 * _SEM_BYTES  # then int64 fields:
_MAGIC, _SENDER_PID, _RECEIVER_PID, _BACKLOG = 0, 1, 2, 3  # _BACKLOG: sends queued behind a full ring
_ENTRIES = _HEADER + 64  # then RING entries of int64 fields:
_STATE, _SEQ, _TAG, _ADDR, _NBYTES = range(5)
_FIELDS = 8
_FREE, _POSTED, _DONE = 0, 1, 2
SEGMENT_BYTES = _ENTRIES + RING * _FIELDS * 8
_MAGIC_VALUE = 0x68796272_69647032  # "hybridp2"
_SLICE_S = 0.5  # a wait checks that its peer lives this often


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load_libc() -> ctypes.CDLL | None:
    """The C library with the calls this module needs (ctypes.CDLL releases the GIL around them)."""
    for name in (None, ctypes.util.find_library("c"), ctypes.util.find_library("pthread")):
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            for fn in ("process_vm_readv", "sem_init", "sem_post", "sem_timedwait", "sem_trywait"):
                getattr(lib, fn)
        except (OSError, AttributeError):
            continue
        lib.process_vm_readv.restype = ctypes.c_ssize_t
        lib.process_vm_readv.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                                         ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
        for fn in ("sem_post", "sem_trywait"):
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        lib.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
        lib.sem_timedwait.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Timespec)]
        return lib
    return None


_libc = _load_libc()


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"hybridpar local p2p: {what}: {os.strerror(err)}")


def read_remote(pid: int, addr: int, dst: torch.Tensor) -> None:
    """Copy ``dst.nbytes`` bytes at ``addr`` in process ``pid`` into the contiguous CPU tensor ``dst``."""
    total, done = dst.numel() * dst.element_size(), 0
    while done < total:
        local = _IOVec(dst.data_ptr() + done, total - done)
        remote = _IOVec(addr + done, total - done)
        n = _libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            raise _errno_error(f"reading {total} bytes from process {pid}")
        done += n


@functools.cache
def can_read_memory() -> bool:
    """Whether ``process_vm_readv`` works at all here (a seccomp filter may forbid it): read ourselves."""
    if _libc is None:
        return False
    src, dst = torch.arange(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    try:
        read_remote(os.getpid(), src.data_ptr(), dst)
    except OSError:
        return False
    return torch.equal(src, dst)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a zombie (exited, not yet reaped by its launcher) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X", "x")


def map_segment(path: str, create: bool) -> mmap.mmap:
    """Map a channel's segment: ``create`` makes it (the sender, owner-only), else opens the peer's."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR if create else os.O_RDWR, 0o600)
    try:
        if create:
            os.ftruncate(fd, SEGMENT_BYTES)
        return mmap.mmap(fd, SEGMENT_BYTES)
    finally:
        os.close(fd)


def _popleft(queues: dict, tag: int):
    """The oldest item queued under ``tag``; an emptied queue goes (no per-tag state is kept)."""
    q = queues[tag]
    item = q.popleft()
    if not q:
        del queues[tag]
    return item


class Work:
    """A pending send or receive on a channel; ``wait`` drives the channel until it completes (as
    torch's ``Work`` does)."""

    def __init__(self, channel: Channel, tensor: torch.Tensor, tag: int) -> None:
        self.channel, self.tensor, self.tag = channel, tensor, tag
        self.done = False

    def is_completed(self) -> bool:
        if not self.done:
            self.channel.progress()
        return self.done

    def wait(self, timeout: float | None = None) -> bool:
        self.channel.wait_for(self, timeout)
        return True


@dataclass
class Channel:
    """One direction between this rank and ``peer``: the shared descriptors and this side's queues.

    ``mutex``: shared by every channel of one transport (its calls are thread-safe, as torch's);
    ``timeout``: how long a wait lasts before it names its peer.
    """

    rank: int
    peer: int
    peer_pid: int
    sending: bool  # this rank is the channel's sender
    mm: mmap.mmap
    mutex: threading.RLock
    timeout: float
    fields: np.ndarray = field(init=False)  # int64 view of the header
    entries: np.ndarray = field(init=False)  # (RING, _FIELDS) int64 view
    base: int = field(init=False)
    next_seq: int = 0
    queued: collections.deque = field(default_factory=collections.deque)  # sends behind a full ring
    inflight: dict = field(default_factory=dict)  # seq -> send Work whose tensor the peer may read
    recvs: dict = field(default_factory=dict)  # tag -> deque of posted receive Works, oldest first
    stash: dict = field(default_factory=dict)  # tag -> deque of messages copied aside (uint8)

    def __post_init__(self) -> None:
        self.fields = np.frombuffer(self.mm, dtype=np.int64, count=8, offset=_HEADER)
        self.entries = np.frombuffer(self.mm, dtype=np.int64, count=RING * _FIELDS,
                                     offset=_ENTRIES).reshape(RING, _FIELDS)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    # ------------------------------------------------------------------ setup
    def init_as_sender(self) -> None:
        """The sender's half of set-up: semaphores, and the header the receiver checks."""
        for which, value in ((_LOCK, 1), (_TO_RECEIVER, 0), (_TO_SENDER, 0)):
            if _libc.sem_init(self._sem(which), 1, value) != 0:
                raise _errno_error("sem_init")
        self.fields[_MAGIC], self.fields[_SENDER_PID], self.fields[_RECEIVER_PID] = \
            _MAGIC_VALUE, os.getpid(), self.peer_pid

    def is_for_me(self) -> bool:
        """The receiver's check that the segment it opened is the one its peer made for it."""
        return self.fields[_MAGIC] == _MAGIC_VALUE and self.fields[_RECEIVER_PID] == os.getpid()

    # ------------------------------------------------------------------ semaphores
    def _sem(self, which: int) -> int:
        return self.base + which * _SEM_BYTES

    def _post(self, which: int) -> None:
        if _libc.sem_post(self._sem(which)) != 0:
            raise _errno_error("sem_post")

    def _drain(self, which: int) -> None:
        while _libc.sem_trywait(self._sem(which)) == 0:
            pass

    def _timed_wait(self, which: int, seconds: float) -> bool:
        """Wait on a semaphore for at most ``seconds``; False on timeout."""
        deadline = time.time() + seconds
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        while _libc.sem_timedwait(self._sem(which), ctypes.byref(ts)) != 0:
            err = ctypes.get_errno()
            if err == 110:  # ETIMEDOUT
                return False
            if err != 4:  # EINTR: retry
                raise _errno_error("sem_timedwait")
        return True

    def _check_peer(self, what: str) -> None:
        if not _alive(self.peer_pid):
            raise RuntimeError(f"hybridpar local p2p: rank {self.peer} (pid {self.peer_pid}) exited while "
                               f"this rank {what}")

    def _lock(self, what: str) -> None:
        while not self._timed_wait(_LOCK, _SLICE_S):
            self._check_peer(what)

    def _unlock(self) -> None:
        self._post(_LOCK)

    # ------------------------------------------------------------------ operations
    def send(self, t: torch.Tensor, tag: int) -> Work:
        work = Work(self, t, tag)
        with self.mutex:
            self.queued.append(work)
            self._progress_send()
        return work

    def recv(self, t: torch.Tensor, tag: int) -> Work:
        work = Work(self, t, tag)
        with self.mutex:
            if tag in self.stash:
                self._fill(work, _popleft(self.stash, tag))
            else:
                self.recvs.setdefault(tag, collections.deque()).append(work)
                self._progress_recv(stash=False)
        return work

    def progress(self, stash: bool = False) -> None:
        """Move what can move now, without waiting (``stash``: a receiver may copy a message aside
        to unblock a sender whose ring is full)."""
        with self.mutex:
            if self.sending:
                self._progress_send()
            else:
                self._progress_recv(stash)

    def wait_for(self, work: Work, timeout: float | None) -> None:
        """Drive the channel until ``work`` is done; a dead peer or ``timeout`` is an error naming both."""
        what = (f"waited for its {'send to' if self.sending else 'receive from'} rank {self.peer} (tag "
                f"{work.tag}, {work.tensor.numel() * work.tensor.element_size()} bytes)")
        bell = _TO_SENDER if self.sending else _TO_RECEIVER
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            self._drain(bell)  # a ring after this point is not lost: the state is checked below
            self.progress(stash=True)
            if work.done:
                return
            if not self._timed_wait(bell, _SLICE_S):
                self._check_peer(what)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"hybridpar local p2p: timed out after {limit:.0f} s: rank "
                                       f"{self.rank} {what}")

    def _progress_send(self) -> None:
        """Reclaim descriptors the receiver is done with; post queued sends into free ones."""
        if not self.queued and not self.inflight:
            return
        self._lock("sent")
        try:
            state = self.entries[:, _STATE]
            for i in np.flatnonzero(state == _DONE):
                self.inflight.pop(int(self.entries[i, _SEQ])).done = True
                self.entries[i, _STATE] = _FREE
            posted = 0
            if self.queued:
                for i in np.flatnonzero(state == _FREE)[:len(self.queued)]:
                    work = self.queued.popleft()
                    t = work.tensor
                    self.entries[i, _SEQ:_NBYTES + 1] = (self.next_seq, work.tag, t.data_ptr(),
                                                         t.numel() * t.element_size())
                    self.entries[i, _STATE] = _POSTED
                    self.inflight[self.next_seq] = work
                    self.next_seq += 1
                    posted += 1
            self.fields[_BACKLOG] = len(self.queued)
        finally:
            self._unlock()
        if posted:
            self._post(_TO_RECEIVER)

    def _progress_recv(self, stash: bool) -> None:
        """Copy posted messages whose tag has a receive waiting; with ``stash``, unblock a full ring."""
        self._lock("received")
        try:
            idx = np.flatnonzero(self.entries[:, _STATE] == _POSTED)
            idx = idx[np.argsort(self.entries[idx, _SEQ], kind="stable")]
            matched = []
            for i in idx:
                tag = int(self.entries[i, _TAG])
                if tag in self.recvs:
                    matched.append((i, _popleft(self.recvs, tag)))
            if not matched and stash and len(idx) and self.fields[_BACKLOG] > 0:
                matched = [(idx[0], None)]  # the sender waits for room; this rank for another tag
            descriptors = [(i, w, int(self.entries[i, _TAG]), int(self.entries[i, _ADDR]),
                            int(self.entries[i, _NBYTES])) for i, w in matched]
        finally:
            self._unlock()
        error, copied = None, []
        for i, work, tag, addr, nbytes in descriptors:  # copy outside the lock: entries stay ours
            if work is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
                read_remote(self.peer_pid, addr, buf)
                self.stash.setdefault(tag, collections.deque()).append(buf)
            elif (mismatch := self._size_error(work, nbytes)) is not None:
                error = error or mismatch  # that receive fails; its message stays for a right one
                continue
            else:
                read_remote(self.peer_pid, addr, work.tensor)
                work.done = True
            copied.append(i)
        if copied:
            self._lock("received")
            try:
                self.entries[copied, _STATE] = _DONE
            finally:
                self._unlock()
            self._post(_TO_SENDER)
        if error is not None:
            raise error

    def _size_error(self, work: Work, nbytes: int) -> RuntimeError | None:
        want = work.tensor.numel() * work.tensor.element_size()
        if nbytes == want:
            return None
        return RuntimeError(f"hybridpar local p2p: rank {self.peer} sent {nbytes} bytes with tag "
                            f"{work.tag}; rank {self.rank} posted a receive of {want} bytes "
                            f"({tuple(work.tensor.shape)}, {work.tensor.dtype})")

    def _fill(self, work: Work, buf: torch.Tensor) -> None:
        """Complete a receive from a message stashed earlier (see ``_progress_recv``)."""
        if (error := self._size_error(work, buf.numel())) is not None:
            self.stash.setdefault(work.tag, collections.deque()).appendleft(buf)
            raise error
        if buf.numel():
            work.tensor.view(-1).view(torch.uint8).copy_(buf)
        work.done = True
