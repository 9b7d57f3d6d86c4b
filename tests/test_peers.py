"""Which peer process ended and how (``hybridpar.comm.peers``), on real processes of this host and an
in-memory store, without a process group: a live peer is not reported, an unreaped one is named with its
exit code or signal as ``waitpid`` would give it, a reaped one with the code it recorded (or none), a
reused process id counts as ended, and peers on other hosts are listed as unseen; and the line of a
closed connection whose peer is not seen to end here."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from hybridpar.comm import peers


def _zombie(proc: subprocess.Popen) -> None:
    """Wait, without reaping it, until ``proc`` has ended."""
    deadline = time.monotonic() + 30
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child did not end"
        time.sleep(0.01)


def _record(store: dist.Store, rank: int, pid: int, host: str | None = None,
            start: str | None = None) -> None:
    rec = {"host": host or peers._host(), "pid": pid, "start": start or peers._start_time(pid)}
    store.set(f"hybridpar/proc/{rank}", json.dumps(rec))


@pytest.fixture
def store(monkeypatch):
    monkeypatch.setattr(peers, "_registered", [])
    return dist.HashStore()


def test_ended_peers_are_named_with_how_they_ended(store):
    peers.register(store, 0)
    sleeper = subprocess.Popen(["sleep", "60"])
    leaver = subprocess.Popen(["sh", "-c", "exit 3"])
    killed = subprocess.Popen(["sleep", "60"])
    try:
        for rank, proc in ((1, sleeper), (3, killed)):
            _record(store, rank, proc.pid)
        _record(store, 4, 1, host="elsewhere")
        assert peers.ended(store, 5) == ([], [4])  # alive, or unseen from here (rank 2 not recorded yet)
        _record(store, 2, leaver.pid)
    finally:
        _zombie(leaver)
        killed.send_signal(signal.SIGKILL)
        _zombie(killed)
    gone, elsewhere = peers.ended(store, 5)
    assert gone == [peers.Ended(2, leaver.pid, "exited with code 3"),
                    peers.Ended(3, killed.pid, "killed by SIGKILL")] and elsewhere == [4]
    leaver.wait()
    killed.wait()
    store.set("hybridpar/exit/3", "7")  # what failure.leave records before a process leaves
    assert peers.ended(store, 4)[0] == [peers.Ended(2, leaver.pid, None),
                                        peers.Ended(3, killed.pid, "exited with code 7")]
    sleeper.kill()
    sleeper.wait()


def test_a_reused_process_id_and_a_missing_record(store):
    """A live process under a recorded pid but with another start time is not the peer (the peer ended);
    a rank that never recorded itself is left out rather than waited for."""
    import os

    _record(store, 0, os.getpid())
    _record(store, 1, os.getpid(), start="1")
    assert peers.ended(store, 3) == ([peers.Ended(1, os.getpid(), None)], [])


def test_record_exit_and_status_names():
    assert peers.describe_status(signal.SIGKILL) == "killed by SIGKILL"
    assert peers.describe_status(3 << 8) == "exited with code 3"
    assert peers.describe_status(signal.SIGSEGV | 0x80) == "killed by SIGSEGV"  # core dumped
    peers.record_exit(1)  # nothing registered: nothing to do, no error


def test_a_lost_connection_no_peer_here_was_seen_to_end_blames_no_rank():
    """Without a heartbeat (or with the ended peer on another host), a closed connection says so, with
    gloo's cause but not its advice, and does not say that this rank gave up."""
    from hybridpar.comm import liveness

    err = RuntimeError("[../gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:41876: Connection "
                       "reset by peer. This is typically caused by a remote worker hanging or bugs in the "
                       "application. Check the logs of the remote worker before reporting an error. GLHF! "
                       "\U0001f3d6\ufe0f")
    assert liveness.is_timeout(err)
    line = str(liveness.explain(err, "in agree_flags"))
    assert line.startswith("rank 0 lost its connection to a peer in agree_flags: Read error "
                           "[127.0.0.1]:41876: Connection reset by peer; a peer's process ended, not on this "
                           "host"), line
    assert "GLHF" not in line and "gave up" not in line and "typically" not in line
