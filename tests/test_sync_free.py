"""No hidden host round trips: a split-grid training step on CUDA under sync debug mode.

Two ranks share the GPU (the device machine has one), spatial split (2, 1, 1), the test_engine model
with an overlapped convolution: after two warm-up steps (halo plans and index tensors are built
once), one ``engine.train_step`` and optimizer step run under ``torch.cuda.set_sync_debug_mode("warn")``;
every synchronising CUDA call made from Python is a warning attributed to the line that made it, and
each must be a deliberate one:

* ``hybridpar/comm/transport.py`` (``StagedP2P``): the current stream is synchronised once per
  exchange before gloo reads the pinned host copies. Only where ranks share a GPU (or the staged
  transport is asked for); NCCL needs none. The MPI transport does the same for CUDA-aware MPI.

Deliberate elsewhere, and outside this step: the trainer's ``loss.item()`` once per step (progress
line and NaN check; with fp16 also the gradient scaler's overflow check), the checkpointer waiting for
its device-to-host snapshot before the next optimizer step, ``full_state_dict`` (copies to the host).
Synchronisations inside gloo's own threads (its CUDA collectives stage through host memory) are not
Python calls and not counted: they exist only on the shared-GPU layout, never under NCCL.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import distributed

DELIBERATE = {"hybridpar/comm/transport.py"}
ROOT = str(Path(__file__).resolve().parent.parent)


def _body(rank: int, world: int) -> None:
    import traceback
    import warnings

    import torch
    import torch.nn.functional as F
    from torch import nn

    import hybridpar as hp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                          nn.Conv3d(4, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.AvgPool3d(2), nn.Flatten(),
                          nn.Linear(4 * 4 * 4 * 4, 4)).cuda()
    engine = hp.parallelize(model, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=F.mse_loss, overlap=True)
    x = torch.randn(2, 2, 16, 16, 16, device="cuda")
    y = torch.randn(2, 4, device="cuda")
    x_local, y_local = engine.shard_batch(x, y)  # builds the engine at this shape
    opt = torch.optim.SGD(engine.parameters(), lr=0.01, momentum=0.9)
    for _ in range(2):
        engine.train_step(x_local, y_local)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    syncs: list[str] = []
    stacks: dict[str, str] = {}

    def attribute(message, category, filename, lineno, file=None, line=None) -> None:
        """The line of ours that made the synchronising call: torch raises the warning from inside
        its own Python wrapper (``Stream.synchronize``, ``torch.cuda.synchronize``), so the warning's
        own filename is torch's; the innermost frame in this repository is the caller."""
        if "synchroniz" not in str(message):
            return
        stack = traceback.extract_stack()[:-1]
        ours = [f for f in stack if f.filename.startswith(ROOT) and "/tests/" not in f.filename
                and "/perf/" not in f.filename]
        where = f"{ours[-1].filename[len(ROOT) + 1:]}:{ours[-1].lineno}" if ours else f"{filename}:{lineno}"
        syncs.append(where)
        stacks[where] = " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                    for f in stack[::-1][:8])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")  # before the hook: turning the mode on warns of itself
        warnings.showwarning = attribute
        try:
            engine.train_step(x_local, y_local)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    hidden = [s for s in syncs if not any(d in s for d in DELIBERATE)]
    assert not hidden, (f"rank {rank}: synchronising CUDA calls that are not deliberate: {hidden}; "
                        f"stacks: {[stacks[h] for h in sorted(set(hidden))]}")
    if rank == 0:
        print(f"deliberate synchronisations in one step: {len(syncs)} ({sorted(set(syncs))})")


@pytest.mark.cuda
def test_split_step_makes_no_hidden_host_round_trips():
    distributed.run(_body, 2, timeout=300, env={"LOCAL_WORLD_SIZE": "2"})
