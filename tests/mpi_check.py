"""Run under mpiexec: launcher detection from MPICH's environment, and DistConv3d / pooling with
halos over the MPI transport (mpi4py) against torch.nn, forward and backward, float64."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hybridpar as hp  # noqa: E402

import layer_cases  # noqa: E402


def main() -> None:
    import faulthandler
    faulthandler.dump_traceback_later(180, exit=True)  # a hang prints stacks, then fails
    torch.set_num_threads(1)
    info = hp.init_distributed()
    assert info.launcher in ("mpich", "openmpi"), info
    grid = hp.ProcessGrid(spatial=(info.world_size, 1, 1))
    fails = layer_cases.Failures()
    count = layer_cases.run_conv(fails, grid, random.Random(3), n_random=8, transport="mpi")
    layer_cases.compare_layer(fails, "mpi maxpool", grid, torch.nn.MaxPool3d(3, 2, 1),
                              hp.nn.DistMaxPool3d(3, 2, 1, grid=grid, transport="mpi"), (2, 2, 12, 9, 8), 99)
    fails.raise_if_any(info.rank)
    if info.rank == 0:
        print(f"MPI OK: {count + 1} cases")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
