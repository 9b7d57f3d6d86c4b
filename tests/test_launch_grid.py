"""Launcher detection and process-grid arithmetic, without spawning (plus one small spawned check)."""

from __future__ import annotations

import ast
import re

import pytest

from hybridpar.grid import _resolve
from hybridpar.process.launchers import _first_slurm_host, detect_launcher

import distributed


def test_detects_each_launcher():
    assert detect_launcher({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}) == ("torchrun", 3, 8, 1)
    assert detect_launcher({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
                            "OMPI_COMM_WORLD_LOCAL_RANK": "2"}) == ("openmpi", 2, 4, 2)
    assert detect_launcher({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}) == ("mpich", 1, 2, 1)
    assert detect_launcher({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1"}) == \
        ("slurm", 5, 16, 1)
    assert detect_launcher({}) is None


@pytest.mark.parametrize("nodes,first", [("nid001", "nid001"), ("nid[004-007,012]", "nid004"),
                                         ("gpu[12,15],cpu3", "gpu12")])
def test_slurm_master_is_first_node(nodes, first):
    assert _first_slurm_host(nodes) == first


def test_world_without_rendezvous_is_a_clear_error(monkeypatch):
    import hybridpar.process.launchers as launch

    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(RuntimeError, match="MASTER_ADDR.*RANK/WORLD_SIZE"):
        launch.init_distributed()


def test_grid_arithmetic_errors():
    with pytest.raises(ValueError, match=r"data\(2\) \* pipe\(1\) \* spatial\(2\*2\*1\) = 8 != world size 4"):
        _resolve(2, 1, (2, 2, 1), 4)
    assert _resolve(-1, 1, (2, 1, 1), 8) == (4, 1, (2, 1, 1))
    assert _resolve(1, 2, (2, -1, 1), 8) == (1, 2, (2, 2, 1))
    with pytest.raises(ValueError, match="at most one"):
        _resolve(-1, -1, (1, 1, 1), 4)
    with pytest.raises(ValueError, match="not divisible"):
        _resolve(-1, 1, (3, 1, 1), 8)


def _grid_body(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    import hybridpar as hp

    # a job on one host (the rendezvous address is 127.0.0.1): every socket the ranks listen on, the
    # store's rank 0 hosts and gloo's, is on the loopback interface
    assert set(listening_addresses()) <= LOOPBACK, (rank, listening_addresses())
    g = hp.ProcessGrid(data=2, pipe=2, spatial=(2, 1, 1))
    # rank order (data, pipe, d, h, w): spatial neighbours are adjacent ranks
    assert (g.data_index, g.pipe_index, g.spatial_coord) == (rank // 4, (rank // 2) % 2, (rank % 2, 0, 0))
    assert g.neighbours(0) == ((None, rank + 1) if rank % 2 == 0 else (rank - 1, None))
    assert g.spatial_ranks == [rank - rank % 2, rank - rank % 2 + 1]
    for group, size in ((g.spatial_group, 2), (g.stage_group, 4), (g.data_group, 2), (g.pipe_group, 2)):
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        assert t.item() == size
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=g.data_group)
    assert t.item() == rank + (rank + 4 if rank < 4 else rank - 4)
    assert g.mesh.mesh_dim_names == ("data", "pipe", "d", "h", "w")
    r = g.with_spatial((1, 1, 1))
    assert r.replica == rank % 2 and r.spatial_ranks == [rank]
    # A group of one rank is created by that rank alone, on first use, and shared by every purpose;
    # collective group creation on all ranks afterwards must still line up.
    if rank % 2 == 0:
        assert r.spatial_group is r.halo_group and dist.get_world_size(r.spatial_group) == 1
        t = torch.ones(1)
        dist.all_reduce(t, group=r.spatial_group)
        assert t.item() == 1
    later = hp.ProcessGrid(data=4, pipe=1, spatial=(2, 1, 1))
    t = torch.ones(1)
    dist.all_reduce(t, group=later.halo_group)
    assert t.item() == 2


def test_grid_groups_and_neighbours():
    distributed.run(_grid_body, 8, timeout=300)


def listening_addresses() -> list[str]:
    """The local addresses (hex, as /proc/net/tcp writes them) of this process's listening TCP sockets."""
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in list(f)[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.append(cols[1].rsplit(":", 1)[0])
    return found


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1


PLAIN = """
import os, sys, torch, torch.distributed as dist
import hybridpar as hp
sys.path.insert(0, os.environ["TESTS"])
from test_launch_grid import listening_addresses
hp.init_distributed()
t = torch.ones(2)
dist.all_reduce(t)
print("mpi started:", "mpi4py.MPI" in sys.modules, flush=True)
print("listening:", sorted(set(listening_addresses())), flush=True)
"""


def test_a_plain_process_starts_no_mpi_and_listens_on_loopback_only(tmp_path):
    """A single process with no launcher neither initialises MPI (MPICH's singleton listens on every
    interface and leaves /dev/shm segments behind) nor opens a socket beyond the loopback interface."""
    import os
    import subprocess
    import sys

    script = tmp_path / "plain.py"
    script.write_text(PLAIN)
    launched = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(distributed.ROOT),
                              "TESTS": str(distributed.ROOT / "tests")})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "mpi started: False" in res.stdout, res.stdout
    addresses = ast.literal_eval(res.stdout.split("listening:", 1)[1].strip())
    assert set(addresses) <= LOOPBACK, res.stdout


RESTARTED = """
import os, sys, torch, torch.distributed as dist
import hybridpar as hp
hp.init_distributed()
store = dist.distributed_c10d._get_default_store()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0" and dist.get_rank() == 0:
    store.set("left by attempt 0", "1")  # what the dead attempt published, as gloo's addresses are
t = torch.ones(1)
dist.all_reduce(t)
if attempt == "0" and dist.get_rank() == 1:
    os.kill(os.getpid(), 9)  # the first attempt loses a rank after its group formed
dist.all_reduce(t)
print(f"attempt {attempt} rank {dist.get_rank()} sum {t.item():g} "
      f"sees attempt 0's keys {store.check(['left by attempt 0'])}", flush=True)
dist.destroy_process_group()
"""


def test_torchrun_restart_forms_a_fresh_group(tmp_path):
    """torchrun --max-restarts: the attempt after a killed rank joins a group of its own, not the dead
    attempt's (gloo would otherwise connect to the listening addresses the dead ranks published, which
    fails in about half of the restarts): a key the dead attempt set is not seen by the next, which
    makes the check deterministic in one run."""
    import os
    import subprocess
    import sys

    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(distributed.ROOT)}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", "--max-restarts=1", str(script)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    # both ranks print to torchrun's one stdout: their lines may interleave
    # (a line need not end before the next begins: the last word is matched, not a word's run)
    line = r"attempt \d rank \d sum \d sees attempt 0's keys (?:True|False)"
    assert sorted(re.findall(line, res.stdout)) == \
        [f"attempt 1 rank {r} sum 4 sees attempt 0's keys False" for r in (0, 1)], res.stdout


LEFT_AT_EXIT = """
import atexit, torch, torch.distributed as dist
import hybridpar as hp
from hybridpar import grid as grid_module

def check():  # registered before init_distributed, so it runs after the exit hook (last in, first out)
    print("after exit hook:", dist.is_initialized(), len(grid_module._GROUP_CACHE), flush=True)

atexit.register(check)
hp.init_distributed()
first = hp.ProcessGrid().pipe_group
hp.process.launchers.shutdown()
hp.init_distributed()  # a second world gets groups of its own, not the destroyed world's
second = hp.ProcessGrid().pipe_group
t = torch.ones(3)
dist.broadcast(t, 0, group=second)
print("fresh groups:", first is not second, t.sum().item(), flush=True)
"""


def test_groups_are_destroyed_before_the_interpreter_exits(tmp_path):
    """init_distributed has the interpreter run launch.shutdown at exit: a group alive during
    finalisation can abort a successful run (a gloo thread asking for the GIL), and a world joined after
    shutdown gets fresh groups."""
    import os
    import subprocess
    import sys

    script = tmp_path / "left.py"
    script.write_text(LEFT_AT_EXIT)
    launched = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launched}
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(distributed.ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fresh groups: True 3.0" in res.stdout, res.stdout
    assert "after exit hook: False 0" in res.stdout, res.stdout


def _heartbeat_body(rank: int, world: int) -> None:
    import threading

    import torch.distributed as dist

    import hybridpar as hp

    beating = [t for t in threading.enumerate() if t.name == "hybridpar-heartbeat"]
    assert len(beating) == 1 and beating[0].is_alive(), threading.enumerate()
    hp.process.launchers.shutdown()
    assert not beating[0].is_alive() and not dist.is_initialized()
    assert [t.name for t in threading.enumerate() if t.name == "hybridpar-heartbeat"] == []


def test_shutdown_ends_the_heartbeat():
    """launch.shutdown (run at exit) stops the heartbeat thread and waits for it: a store call it
    returns from while the interpreter finalises aborts a run that succeeded (SIGABRT, 'terminate
    called without an active exception', seen once in the fault soak's last attempt)."""
    distributed.run(_heartbeat_body, 2, timeout=120)
