"""Point-to-point between CPU ranks of one host by cross-memory attach: one copy, no socket.

Why: gloo moves a tensor between two processes of one host through TCP loopback: the kernel copies
it into a socket buffer and out again, and gloo's I/O threads wake for every segment, all on the
cores the stages compute on. Here the receiver copies the sender's tensor straight into its own
buffer with one ``process_vm_readv`` call (Linux cross-memory attach, as Open MPI and MPICH do
between ranks of a node): one copy, done by the rank that needs the data, and no memory besides a
few KiB of descriptors (a staging ring of shared memory would cost each stage megabytes of resident
set). The protocol of one pair lives in :mod:`hybridpar.comm.local_channel`; this module decides
which pairs get one and is the transport the pipeline sees.

Used where it can work, decided once per pair and collectively (:meth:`LocalP2P.create`): same
host, same PID namespace, /dev/shm writable, and a probe read succeeding in both directions (seccomp
may forbid the call). Reading a sibling's memory needs ptrace permission: under Yama scope 1 only
ancestors have it, and a rank grants it to same-user processes (``PR_SET_PTRACER_ANY``, as Open MPI
does) only when the user turned the feature on (``allow_ptrace``); rank 0 says so in one line.
Without that, such a host keeps torch.distributed. Anything else, and every CUDA tensor, goes
through torch.distributed as before. ``HYBRIDPAR_LOCAL_P2P=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import pickle
import socket
import sys
import threading
import uuid

import torch
import torch.distributed as dist

from hybridpar.comm.local_channel import Channel, Work, can_read_memory, map_segment, read_remote
from hybridpar.comm.store import default_store

_PR_SET_PTRACER, _PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1).value


def _host_key() -> str:
    """Ranks with equal keys can read each other's memory by PID: same kernel and PID namespace."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return f"unknown-{uuid.uuid4()}"  # never equal to another rank's
    return f"{socket.gethostname()}/{boot}/{pidns}"


def ptrace_scope() -> int | None:
    """The Yama ptrace scope (1: only ancestors may read a process's memory), None without Yama."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def set_ptracer_any() -> None:
    """Let any process of this user read this one's memory (Yama's ``PR_SET_PTRACER_ANY``)."""
    ctypes.CDLL(None).prctl(ctypes.c_int(_PR_SET_PTRACER), ctypes.c_ulong(_PR_SET_PTRACER_ANY),
                            ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))


def permit_peer_reads(allow_ptrace: bool) -> bool:
    """Whether peers will be able to read this rank's memory; relaxes ptrace protection only when
    ``allow_ptrace`` and Yama scope 1 requires it, and rank 0 says which in one line."""
    if ptrace_scope() != 1:
        return True  # scope 0 (same user may read), or 2 and 3 where no prctl helps: the probe tells
    if allow_ptrace:
        set_ptracer_any()
        _say("same-host pipeline transfers: each rank lets processes of its user read its memory "
             "(PR_SET_PTRACER_ANY under Yama ptrace_scope 1), as asked (local_p2p=True)")
        return True
    _say("same-host pipeline transfers go through torch.distributed: Yama ptrace_scope 1 forbids "
         "reading a sibling rank's memory; parallelize(..., local_p2p=True) lets each rank allow it")
    return False


_SAID: set[str] = set()


def _say(line: str) -> None:
    """``line`` on rank 0, once per job."""
    if line not in _SAID and dist.get_rank() == 0:
        _SAID.add(line)
        print(f"hybridpar: {line}", file=sys.stderr, flush=True)


def available() -> bool:
    """Whether this process could use the transport at all (Linux, the calls, /dev/shm)."""
    return (os.environ.get("HYBRIDPAR_LOCAL_P2P", "1") != "0" and os.path.isdir("/dev/shm")
            and os.access("/dev/shm", os.W_OK) and can_read_memory())


class _Board:
    """Values each rank posts for its peers, through the default group's rendezvous store.

    Every rank creates boards in the same order, so the n-th board of every rank shares one prefix.
    """

    _count = itertools.count()

    def __init__(self) -> None:
        self.store = default_store()
        self.prefix = f"hybridpar/local_p2p/{next(self._count)}/"
        self.rank = dist.get_rank()

    def publish(self, phase: str, value) -> None:
        self.store.set(f"{self.prefix}{phase}/{self.rank}", pickle.dumps(value))

    def fetch(self, phase: str, ranks: list[int]) -> dict:
        """Each listed rank's value of ``phase``, waiting for it (the store's timeout applies)."""
        return {r: pickle.loads(self.store.get(f"{self.prefix}{phase}/{r}")) for r in ranks}


class LocalP2P:
    """Sends and receives of CPU tensors between ranks of one host (see module doc); a
    :class:`~hybridpar.comm.transport.Transport` for the pairs it :meth:`handles`.

    ``peers``: the global ranks this rank has a channel with, both ways. Build with :meth:`create`.
    """

    name = "local"

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.send_channels: dict[int, Channel] = {}
        self.recv_channels: dict[int, Channel] = {}
        self.mutex = threading.RLock()  # torch.distributed calls are thread-safe; so is this

    @property
    def peers(self) -> set[int]:
        return set(self.send_channels)

    def handles(self, t: torch.Tensor, peer: int) -> bool:
        """Whether a transfer of ``t`` with ``peer`` goes through this transport (both sides agree)."""
        return peer in self.send_channels and t.device.type == "cpu"

    # ------------------------------------------------------------------ setup
    @classmethod
    def create(cls, peers: set[int] | list[int], enabled: bool = True, timeout: float = 1800.0,
               allow_ptrace: bool = False) -> LocalP2P:
        """Every rank of the default group calls it, in the same order, with the ranks it talks to.

        A channel pair exists between ranks a and b where each names the other, both are enabled and
        :func:`available`, share a host key, and each read the other's probe. Every other pair has no
        channel, and :meth:`handles` says False for it on both sides. Ranks agree through the
        rendezvous store, each waiting on its own peers only: a gloo collective here would leave
        ~0.05 MiB of buffers in every rank's heap for the run. ``allow_ptrace``: see the module doc.
        """
        rank = dist.get_rank()
        board = _Board()
        ok = enabled and available() and permit_peer_reads(allow_ptrace)
        probe = torch.tensor([rank, 0x5EED], dtype=torch.int64)
        me = (sorted(int(p) for p in peers if p != rank) if ok else [], _host_key(), os.getpid(),
              probe.data_ptr(), uuid.uuid4().hex[:16])
        board.publish("info", me)
        info = board.fetch("info", me[0])
        candidates = [p for p in me[0] if rank in info[p][0] and info[p][1] == me[1]]
        readable = []
        for p in candidates:
            got = torch.zeros(2, dtype=torch.int64)
            try:
                read_remote(info[p][2], info[p][3], got)
            except OSError:
                continue
            if got.tolist() == [p, 0x5EED]:
                readable.append(p)
        board.publish("readable", readable)
        seen = board.fetch("readable", candidates)
        del probe  # kept alive until every candidate has read it
        pairs = [p for p in readable if rank in seen[p]]
        self = cls(rank, timeout)

        def path(src: int, dst: int) -> str:  # named by the sender's token
            return f"/dev/shm/hybridpar-{(me if src == rank else info[src])[4]}-{src}-{dst}"

        def channel(p: int, sending: bool) -> Channel:
            mm = map_segment(path(rank, p) if sending else path(p, rank), create=sending)
            return Channel(rank, p, info[p][2], sending, mm, self.mutex, timeout)

        created = []
        try:
            for p in pairs:  # this rank creates the segments it sends on
                ch = channel(p, sending=True)
                created.append(path(rank, p))
                ch.init_as_sender()
                self.send_channels[p] = ch
            board.publish("created", True)
            board.fetch("created", pairs)
            for p in pairs:
                self.recv_channels[p] = ch = channel(p, sending=False)
                if not ch.is_for_me():
                    raise RuntimeError(f"hybridpar local p2p: segment {path(p, rank)} is not rank {p}'s")
            board.publish("opened", True)
            board.fetch("opened", pairs)  # both sides mapped: the names can go (a crash leaves nothing)
        finally:
            for name in created:
                os.unlink(name)
        return self

    # ------------------------------------------------------------------ operations
    def isend(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a send of the contiguous CPU tensor ``t``; keep it unchanged until the work completes."""
        if not t.is_contiguous():
            raise ValueError("hybridpar local p2p: send of a non-contiguous tensor")
        return self.send_channels[peer].send(t, tag)

    def irecv(self, t: torch.Tensor, peer: int, tag: int) -> Work:
        """Post a receive into the contiguous CPU tensor ``t`` (filled in place)."""
        if not t.is_contiguous():
            raise ValueError("hybridpar local p2p: receive into a non-contiguous tensor")
        return self.recv_channels[peer].recv(t, tag)

    def recv(self, t: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        self.irecv(t, peer, tag).wait()
        return t

    def exchange(self, sends: list[tuple[int, torch.Tensor, int]],
                 recvs: list[tuple[int, torch.Tensor, int]]) -> None:
        """:class:`~hybridpar.comm.transport.Transport`'s call: post all, wait for all."""
        works = [self.irecv(t, p, tag) for p, t, tag in recvs]
        works += [self.isend(t, p, tag) for p, t, tag in sends]
        for w in works:
            w.wait()
