"""Find out how this process was launched and join the process group.

Why: the same training script must run under torchrun, mpirun/mpiexec (Open MPI, MPICH) and Slurm's
srun, and as a plain single process, without the user exporting anything by hand. Each launcher
leaves its own environment variables; this module reads them, fills in what torch.distributed's
``env://`` rendezvous needs, and picks the backend (NCCL on CUDA with a gloo group beside it for
host-side work such as checkpoint writers, gloo on CPU, and gloo alone where more ranks than GPUs
run on a host: they share devices, which NCCL refuses; see :mod:`hybridpar.comm.devices`).
"""

from __future__ import annotations

import atexit
import gc
import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridpar.comm import devices
from hybridpar.device import cpu_alloc
from hybridpar.process.lifetime import forget_group_state, set_collective_timeout

# (rank, world size, local rank) variables of each launcher, in the order they are tried.
_LAUNCHERS: dict[str, tuple[str, str, str]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
}


@dataclass(frozen=True)
class LaunchInfo:
    """Where this process sits in the job, and how it learned it."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    backend: str


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``nid[001-004,007],gpu12`` (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise RuntimeError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_launcher(env: dict[str, str] | None = None) -> tuple[str, int, int, int] | None:
    """(launcher, rank, world size, local rank) from the environment, or None for a plain process."""
    env = os.environ if env is None else env
    for name, (r, w, lr) in _LAUNCHERS.items():
        if r in env and w in env:
            local = env.get(lr) or env.get("LOCAL_RANK") or env.get("MPI_LOCALRANKID") or "0"
            return name, int(env[r]), int(env[w]), int(local)
    return None


def launch_world_size(env: Mapping[str, str] | None = None) -> int:
    """The world size this process will join, read from the launcher before any process group exists
    (as :func:`init_distributed` reads it): so that checks of a config against the world size run in
    the first second, not after the group and the model are built. A plain process: 1."""
    env = os.environ if env is None else env
    found = detect_launcher(dict(env))
    if found is not None:
        return found[2]
    mpi = _mpi4py_world(env)
    return mpi[1] if mpi else 1


# Variables an MPI launcher's process manager sets (PMI, PMIx, Open MPI, MVAPICH, Cray PALS, Intel MPI):
# without one of them the process was not started by mpirun, and initialising MPI would only start a
# singleton (MPICH's opens a listening socket on every interface and a /dev/shm segment a crash leaks).
_MPI_HINTS = ("PMI_", "PMIX_", "OMPI_", "MV2_", "PALS_", "HYDRA_", "I_MPI_")


def _mpi4py_world(env: Mapping[str, str]) -> tuple[int, int, int] | None:
    """(rank, size, local rank) from mpi4py if it is installed and a launcher started this process
    (an MPI launcher's variables are set): a plain process never initialises MPI."""
    if not any(k.startswith(_MPI_HINTS) for k in env):
        return None
    try:
        from mpi4py import MPI  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return None
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return comm.Get_rank(), comm.Get_size(), local


def _rendezvous(launcher: str, rank: int, env: dict[str, str]) -> None:
    """Fill MASTER_ADDR/MASTER_PORT where the launcher did not (mpirun, srun)."""
    if "MASTER_ADDR" not in env:
        if launcher == "slurm" and "SLURM_JOB_NODELIST" in env:
            env["MASTER_ADDR"] = _first_slurm_host(env["SLURM_JOB_NODELIST"])
        else:
            env["MASTER_ADDR"] = "127.0.0.1"
    if "MASTER_PORT" not in env:
        job = env.get("SLURM_JOB_ID", "0")
        env["MASTER_PORT"] = str(29500 + int(job) % 1000 if job.isdigit() else 29500)


def _is_loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.")


def loopback_interface() -> str | None:
    """The name of this host's loopback interface (``lo`` on Linux, ``lo0`` on macOS), if it has one."""
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), None)


def keep_on_loopback(env: MutableMapping[str, str], world: int) -> None:
    """Bind gloo's and NCCL's sockets to the loopback interface when every rank is on this host.

    Why: by default they listen on the address the host name resolves to, so a job on one machine
    (a laptop, one node, a test) would accept connections from the network. A job whose launcher says
    all ranks are local (its local world size is the world size), or whose rendezvous address is a
    loopback one, needs nothing else. A variable the user set is kept.
    """
    addr = env.get("MASTER_ADDR", "")
    local = devices.local_world_size(env)
    if not (world == 1 or local == world or _is_loopback(addr)):
        return
    lo = loopback_interface()
    if lo is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", lo)
        env.setdefault("NCCL_SOCKET_IFNAME", lo)


def _loopback_store(env: Mapping[str, str], rank: int, world: int, timeout: timedelta) -> dist.Store | None:
    """The rendezvous store, listening on the loopback address only, where the job's address is a
    loopback one and a rank of the job hosts it (not torchrun's agent); else None (``env://``).

    Why: torch's store server listens on every interface whatever ``MASTER_ADDR`` says; rank 0 binds
    the listening socket itself and hands it over (``master_listen_fd``).
    """
    addr = env["MASTER_ADDR"]
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" or not _is_loopback(addr):
        return None
    port = int(env["MASTER_PORT"])
    if rank != 0:
        return dist.TCPStore(addr, port, world, is_master=False, timeout=timeout)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1" if addr == "localhost" else addr, port))
        listener.listen(max(world, 128))
        return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout,
                             master_listen_fd=os.dup(listener.fileno()))


def _restart_store(env: dict[str, str], world: int, timeout) -> dist.Store | None:
    """A store of this attempt's own under torchrun restarts (``--max-restarts``), else None.

    Why: torchrun's agent hosts one TCPStore for the whole job and its workers connect to it as
    clients; torch's ``env://`` handler adds no per-attempt prefix, so after a restart gloo can read the
    listening addresses that the previous attempt's (dead) ranks published and fail with "Gloo
    connectFullMesh failed ... Connection refused". Prefixing every key with the restart count gives
    each attempt a clean namespace on the same store.
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in env:
        return None
    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"hybridpar/attempt{env['TORCHELASTIC_RESTART_COUNT']}/", store)


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> LaunchInfo:
    """Join the job's process group (idempotent) and return where this process sits.

    Tries torchrun, Open MPI, MPICH, Slurm and mpi4py, in that order. A plain process with no launcher
    gets a world of one: it still initialises a one-rank gloo group so that every distributed code path
    runs unchanged. A world larger than one without rendezvous information is an error naming the
    variables looked for.

    ``timeout_s`` bounds every wait for a peer (:func:`hybridpar.process.lifetime.collective_timeout`);
    each rank also beats a heartbeat into the rendezvous store, so that a timeout can name the ranks
    that stopped answering (:mod:`hybridpar.comm.liveness`).
    """
    env = os.environ
    found = detect_launcher()
    if found is None:
        mpi = _mpi4py_world(env)
        found = ("mpi4py", *mpi) if mpi else ("none", 0, 1, 0)
    launcher, rank, world, local = found
    if world > 1 and launcher in ("openmpi", "mpich", "slurm", "mpi4py"):
        _rendezvous(launcher, rank, env)
    if world > 1 and ("MASTER_ADDR" not in env or "MASTER_PORT" not in env):
        looked = ", ".join(f"{r}/{w}" for r, w, _ in _LAUNCHERS.values())
        raise RuntimeError(
            f"hybridpar.init_distributed: world size {world} but no rendezvous address: set MASTER_ADDR "
            f"and MASTER_PORT, or launch with torchrun, mpirun or srun (looked for {looked} and "
            f"MASTER_ADDR/MASTER_PORT)")
    cuda = torch.cuda.is_available()
    sharing = cuda and devices.will_share(devices.local_world_size(env), torch.cuda.device_count())
    if backend is None:
        backend = "cpu:gloo,cuda:nccl" if cuda and not sharing else "gloo"
    if cuda:
        torch.cuda.set_device(local % torch.cuda.device_count())
    else:
        cpu_alloc.tune()  # activations come from glibc malloc: keep freed memory between steps
    if not dist.is_initialized():
        keep_on_loopback(env, world)
        set_collective_timeout(timeout_s)
        atexit.unregister(shutdown)  # once, however often a process joins and leaves
        atexit.register(shutdown)
        if world == 1 and "MASTER_ADDR" not in env:
            store = dist.HashStore()
            dist.init_process_group(backend, store=store, rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s))
        else:
            env.setdefault("RANK", str(rank))
            env.setdefault("WORLD_SIZE", str(world))
            env.setdefault("LOCAL_RANK", str(local))
            nccl = "nccl" in backend
            kwargs = {"device_id": torch.device("cuda", torch.cuda.current_device())} if nccl else {}
            timeout = timedelta(seconds=timeout_s)
            store = _restart_store(env, world, timeout) or _loopback_store(env, rank, world, timeout)
            if store is not None:
                kwargs["store"] = store
            else:
                kwargs["init_method"] = "env://"
            dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
            from hybridpar.comm import liveness  # noqa: PLC0415 (comm imports this module's package)

            liveness.start(timeout_s)
        if cuda and world > 1:  # once, at group creation: who shares this rank's GPU
            peers = devices.exchange_placements()
            if peers and "nccl" in backend:
                raise RuntimeError(f"hybridpar.init_distributed: rank {rank} shares GPU "
                                   f"{torch.cuda.current_device()} with ranks {peers} but the backend is "
                                   f"{backend!r}, which NCCL refuses; launch so that the local world size is "
                                   f"known (torchrun sets LOCAL_WORLD_SIZE) or pass backend='gloo'")
    return LaunchInfo(launcher, dist.get_rank(), dist.get_world_size(), local, backend)


def shutdown() -> None:
    """Leave the job: stop the heartbeat, destroy every process group (torch's and the grids' cached
    ones) and free what still holds them. ``init_distributed`` registers it to run at interpreter exit;
    calling it earlier, or after ``destroy_process_group``, is safe.

    Why at exit: threads that call into C++ with the GIL released must be done before the interpreter
    finalises. One that comes back for the GIL then is ended by ``pthread_exit`` inside a ``noexcept``
    destructor: ``terminate called without an active exception`` and SIGABRT after a run that
    succeeded. Two kinds exist: the heartbeat's store calls (:func:`hybridpar.comm.liveness.stop` ends
    it), and gloo worker threads, which drop a finished transfer's tensors and so release their Python
    objects. Garbage (engines and layers hold groups and work in reference cycles) is collected while
    the groups live, then destroying the groups joins their threads (torch releases the GIL meanwhile).
    """
    from hybridpar.comm import liveness  # noqa: PLC0415 (comm imports this module's package)

    liveness.stop()
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_group_state()
    gc.collect()


def device() -> torch.device:
    """The device this rank computes on: its CUDA device if any, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
