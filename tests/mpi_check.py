"""Run under mpiexec -n 2 with one argument, the case:

* ``halo``: launcher detection from MPICH's environment, and DistConv3d / pooling with halos over the
  MPI transport (mpi4py) against torch.nn, forward and backward, float64;
* ``pipeline``: a 2-stage engine (GPipe and 1F1B, 3 micro-batches) whose stage-to-stage traffic goes
  over MPI (``HYBRIDPAR_TRANSPORT=mpi``) against the same engine over gloo (loss, every gradient and
  the predictions equal bit for bit) and against the single-process model (within 1e-10), float64.
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))

import hybridpar as hp  # noqa: E402

import layer_cases  # noqa: E402


def halo(info: hp.process.launchers.LaunchInfo, fails: layer_cases.Failures) -> str:
    grid = hp.ProcessGrid(spatial=(info.world_size, 1, 1))
    count = layer_cases.run_conv(fails, grid, random.Random(3), n_random=8, transport="mpi")
    layer_cases.compare_layer(fails, "mpi maxpool", grid, torch.nn.MaxPool3d(3, 2, 1),
                              hp.nn.DistMaxPool3d(3, 2, 1, grid=grid, transport="mpi"), (2, 2, 12, 9, 8), 99)
    return f"{count + 1} cases"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv3d(4, 4, 3, padding=1),
                         nn.Flatten(), nn.Linear(4 * 6 ** 3, 2)).double()


def _step(schedule: str, mpi: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One engine step and a prediction: (loss, this stage's gradients by the original model's names,
    outputs)."""
    if mpi:
        os.environ["HYBRIDPAR_TRANSPORT"] = "mpi"  # read once, when the engine is built
    try:
        spec = {"grid": {"data": 1, "pipe": 2, "spatial": [1, 1, 1]},
                "pipeline": {"schedule": schedule, "microbatches": 3, "stages": "auto"}}
        engine = hp.parallelize(_model(), spec, loss_fn=nn.functional.mse_loss, input_shape=(6, 2, 6, 6, 6))
    finally:
        os.environ.pop("HYBRIDPAR_TRANSPORT", None)
    assert (engine.transport.mpi is not None) == mpi, f"{schedule}: MPI transport {'not ' * mpi}in use"
    x, y = _data()
    xl, yl = engine.shard_batch(x, y)
    loss = engine.train_step(xl, yl)
    grads = {name: p.grad.clone() for name, p in engine.named_parameters()}
    return loss, grads, engine.predict(xl)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(6, 2, 6, 6, 6, generator=g, dtype=torch.float64),
            torch.randn(6, 2, generator=g, dtype=torch.float64))


def pipeline(info: hp.process.launchers.LaunchInfo, fails: layer_cases.Failures) -> str:
    ref_model = _model()
    x, y = _data()
    ref_out = ref_model(x)
    ref_loss = nn.functional.mse_loss(ref_out, y)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in ref_model.named_parameters()}
    for schedule in ("gpipe", "1f1b"):
        (l_gloo, g_gloo, p_gloo), (l_mpi, g_mpi, p_mpi) = _step(schedule, False), _step(schedule, True)
        if not torch.equal(l_mpi, l_gloo):
            fails.append(f"{schedule}: loss over MPI {l_mpi.item()!r} != over gloo {l_gloo.item()!r}")
        if not torch.equal(p_mpi, p_gloo):
            fails.append(f"{schedule}: predictions over MPI differ from gloo's")
        fails.extend(f"{schedule}: gradient of {k} over MPI differs from gloo's"
                     for k in g_gloo if not torch.equal(g_mpi[k], g_gloo[k]))
        fails.check(f"{schedule}: MPI loss against one process", l_mpi.reshape(1),
                    ref_loss.detach().reshape(1), 1e-10)
        fails.check(f"{schedule}: MPI predictions against one process", p_mpi, ref_out.detach(), 1e-10)
        for k, g in g_mpi.items():
            fails.check(f"{schedule}: MPI gradient of {k} against one process", g, ref_grads[k], 1e-10)
    return "gpipe and 1f1b"


CASES = {"halo": halo, "pipeline": pipeline}


def main() -> None:
    import faulthandler
    faulthandler.dump_traceback_later(180, exit=True)  # a hang prints stacks, then fails
    case = sys.argv[1]
    torch.set_num_threads(1)
    info = hp.init_distributed()
    assert info.launcher in ("mpich", "openmpi"), info
    fails = layer_cases.Failures()
    what = CASES[case](info, fails)
    fails.raise_if_any(info.rank)
    if info.rank == 0:
        print(f"MPI OK ({case}): {what}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
