"""Which ranks share one GPU, so that their CUDA traffic goes through pinned host memory.

Why: NCCL refuses two ranks on one device, yet testing the CUDA code paths (side streams, pinned
staging, device placement, the checkpointer's device-to-host snapshot) with 2-4 ranks needs exactly
that on a single-GPU machine, and a node without a working NCCL is in the same position. Such ranks
use gloo for everything and the ``staged`` transport for point-to-point traffic
(:class:`hybridpar.comm.transport.StagedP2P`).

Decided twice, each time once: before the process group exists, from the launcher's local world
size against the visible devices (the backend must be chosen then: :func:`will_share`), and right
after, exactly, from one exchange of every rank's (host, device index) (:func:`record`, the
collisions of :func:`collisions`). Nothing else ever selects the staged transport implicitly.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

# local world size variables of each launcher (torchrun, Open MPI, MPICH/Hydra, Slurm)
_LOCAL_SIZE = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
_STATE: dict[str, object] = {"shared": False, "peers": (), "said": False}


def local_world_size(env: dict[str, str] | None = None) -> int | None:
    """Ranks on this host per the launcher, or None when it does not say."""
    env = os.environ if env is None else env
    for var in _LOCAL_SIZE:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def will_share(local_world: int | None, device_count: int) -> bool:
    """Whether ranks of this host will have to share GPUs: more local ranks than devices."""
    return local_world is not None and device_count > 0 and local_world > device_count


def collisions(placements: list[tuple[str, int]], rank: int) -> list[int]:
    """The other ranks on ``rank``'s host and device; ``placements[r]`` = (host, device index) of
    rank ``r`` (device index -1: no GPU, never a collision)."""
    mine = placements[rank]
    return [r for r, p in enumerate(placements) if r != rank and p == mine and mine[1] >= 0]


def record(placements: list[tuple[str, int]], rank: int) -> list[int]:
    """Remember whether this rank shares its device (from every rank's placement); its peers."""
    peers = collisions(placements, rank)
    _STATE["shared"], _STATE["peers"] = bool(peers), tuple(peers)
    return peers


def exchange_placements() -> list[int]:
    """Gather every rank's (host, device index) once, after the group is made; record collisions."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else -1
    mine = (f"{socket.gethostname()}", device)
    placements: list = [None] * dist.get_world_size()
    dist.all_gather_object(placements, mine)
    return record(placements, dist.get_rank())


def shares_device() -> bool:
    """Whether this rank shares its GPU with another rank (as recorded at group creation)."""
    return bool(_STATE["shared"])


def say_staged_once() -> None:
    """One line, once per job (rank 0), when the staged transport is selected automatically."""
    if _STATE["said"]:
        return
    _STATE["said"] = True
    if not dist.is_initialized() or dist.get_rank() == 0:
        dev = torch.cuda.current_device() if torch.cuda.is_available() else "?"
        print(f"hybridpar: ranks share GPU {dev} (rank 0 with ranks {list(_STATE['peers'])}): their CUDA "
              f"halos and pipeline transfers go through pinned host memory over gloo (transport 'staged')",
              file=sys.stderr, flush=True)
