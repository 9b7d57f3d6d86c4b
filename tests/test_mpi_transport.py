"""The MPI transport (halos, and pipeline stage-to-stage traffic) and the mpirun launch path:
tests/mpi_check.py under mpiexec -n 2, one case per test (skipped when mpi4py or an mpiexec is not
installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from perf.ranks import free_port, mpiexec

pytest.importorskip("mpi4py")
MPIEXEC = mpiexec()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec")
@pytest.mark.parametrize("case", ["halo", "pipeline"])
def test_over_mpi_matches_torch(case):
    """tests/mpi_check.py CASE on 2 ranks started by mpiexec (its docstring says what each checks)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "HYBRIDPAR_TRANSPORT"):
        env.pop(k, None)
    script = Path(__file__).with_name("mpi_check.py")
    res = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), case], capture_output=True,
                         text=True, timeout=240, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert f"MPI OK ({case})" in res.stdout
