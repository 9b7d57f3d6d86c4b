"""The Checkpointer on 4 gloo ranks (one spawned group, many cases in it) and then in one process: stage files
written once, round trip, loading under other layouts (pipeline split, data degree, spatial split, one
process), restart from L2 partner copies after a "node" loses its L1 and the shared copy is gone, and a
failure on one rank failing the save on all. Two "nodes" of two ranks are played by ``local_dir`` with
``{node}`` and ``ranks_per_node=2``. Everything loaded is compared bit for bit with what was saved."""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from test_checkpoint_units import _same

import distributed

LAYERS = 4
pytestmark = pytest.mark.timeout(120)


def _layer(key: str) -> int | None:
    m = re.search(r"layers\.(\d+)\.", key)
    return int(m[1]) if m else None


def _stage_of(layer: int, pipe: int) -> int:
    return layer * pipe // LAYERS


def full_state(step: int, rank: int = 0) -> dict:
    """The whole model's state at ``step``, as a single process would hold it."""
    g = torch.Generator().manual_seed(step)
    model, mom, hyper = {}, {}, {}
    for i in range(LAYERS):
        model[f"layers.{i}.weight"] = torch.randn(3 + i, 2, generator=g)
        model[f"layers.{i}.bias"] = torch.randn(3 + i, generator=g).to(torch.bfloat16)
        mom[f"layers.{i}.weight"] = {"momentum_buffer": torch.randn(3 + i, 2, generator=g)}
        hyper[f"layers.{i}.weight"] = {"lr": 0.1, "momentum": 0.9}
    return {"model": model, "optimizer": {"state": mom, "hyper": hyper},
            "rng": {"torch": torch.Generator().manual_seed(100 + rank).get_state(), "rank": rank},
            "loader": {"epoch": step // 2, "position": 64 * step}, "step": step}


def wanted(stage: int, pipe: int):
    """What a rank of ``stage`` under a ``pipe``-stage split loads: its layers and everything else."""
    return lambda k: _layer(k) is None or _stage_of(_layer(k), pipe) == stage


def stage_state(step: int, rank: int, stage: int, pipe: int) -> dict:
    """What that rank holds (and saves): its layers only, under their full-model names."""
    s = full_state(step, rank)
    keep = wanted(stage, pipe)
    s["model"] = {k: v for k, v in s["model"].items() if keep(f"model/{k}")}
    for part in ("state", "hyper"):
        s["optimizer"][part] = {k: v for k, v in s["optimizer"][part].items() if keep(f"x/{k}")}
    return s


def _grid(**kw):
    import hybridpar as hp

    return hp.ProcessGrid(**kw)


def _check_layouts(ck, rank: int, step: int) -> None:
    """Load one checkpoint under several layouts of the same 4 ranks; compare with what each holds."""
    from hybridpar.checkpoint import keys_for

    for kw in ({"data": 2, "pipe": 2}, {"pipe": 4}, {"data": 4}, {"pipe": 2, "spatial": (2, 1, 1)}):
        g = _grid(**kw)
        mine = stage_state(step, rank, g.pipe_index, g.pipe)
        _same(mine, ck.load(keys=keys_for(mine["model"])))  # what the stage's own module names


def _lose_node0_and_shared(base: Path, name: str, root: str, rank: int) -> None:
    import torch.distributed as dist

    dist.barrier()
    if rank == 0:
        import shutil

        shutil.rmtree(base / f"{root}-node0" / "L1" / name)
        shutil.rmtree(base / root / name)
    dist.barrier()


def _scenario(rank: int, base: Path, root: str, grid_kw: dict) -> None:
    import torch.distributed as dist

    from hybridpar.checkpoint import Checkpointer, CheckpointError
    from hybridpar.checkpoint.faults import ENV

    g = _grid(**grid_kw)
    ck = Checkpointer(base / root, g, keep_last=2, local_dir=str(base / f"{root}-node{{node}}"),
                      ranks_per_node=2, keep_local=1, timeout_s=60)
    for step in (1, 2, 3):
        ck.save(step, stage_state(step, rank, g.pipe_index, g.pipe), {"epoch": step}, overlap=step == 3)
        ck.before_update()
    ck.wait()
    v = ck.versions()
    assert [(x.step, x.levels) for x in v] == [(2, ("L3",)), (3, ("L1", "L2", "L3"))], v
    names = sorted(p.name for p in (base / root / v[-1].name).iterdir())
    stages = [f"stage-{p:03d}.bin" for p in range(g.pipe)]
    assert names == ["MANIFEST.json", "global.bin", *[f"rank-{r:05d}.bin" for r in range(4)], *stages]
    _same(stage_state(3, rank, g.pipe_index, g.pipe), ck.load(keys=wanted(g.pipe_index, g.pipe)))
    _check_layouts(ck, rank, 3)

    # node 0 loses its local disk and the shared copy is gone: node 1's L1 and L2 still hold it all
    _lose_node0_and_shared(base, v[-1].name, root, rank)
    assert [(x.step, x.levels) for x in ck.versions()] == [(2, ("L3",)), (3, ("L2",))]
    _check_layouts(ck, rank, 3)
    # ... and node 1's partner copies too: step 3 is gone, restart falls back to step 2
    dist.barrier()
    if rank == 2:
        import shutil

        shutil.rmtree(base / f"{root}-node1" / "L2" / v[-1].name)
    dist.barrier()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = ck.load(keys=wanted(g.pipe_index, g.pipe))
    said = [w for w in seen if "no intact copy" in str(w.message)]
    assert len(said) == (rank == 0), f"rank {rank}: {[str(w.message) for w in seen]}"  # once per job
    _same(stage_state(2, rank, g.pipe_index, g.pipe), got)

    # a failure on one rank fails the save everywhere; the versions stay as they were
    os.environ[ENV] = "persist:raise:4:1"
    ck.save(4, stage_state(4, rank, g.pipe_index, g.pipe))
    with pytest.raises(CheckpointError, match="rank 1: OSError: injected"):
        ck.wait()
    del os.environ[ENV]
    assert ck.latest() == 2
    ck.save(5, stage_state(5, rank, g.pipe_index, g.pipe))
    ck.wait()
    assert ck.latest() == 5
    ck.close()


def _four(rank: int, world: int, base: str) -> None:
    from hybridpar.checkpoint import Checkpointer

    warnings.simplefilter("error", UserWarning)  # no warning unless a test expects it
    base = Path(base)
    # data=2 x pipe=2: each stage has a replica on the other node, which writes the L2 copy itself
    _scenario(rank, base, "A", {"data": 2, "pipe": 2})
    # pipe=2 x spatial 2: no replica off-node, the stage files travel to the partner
    _scenario(rank, base, "B", {"pipe": 2, "spatial": (2, 1, 1)})
    # plain data parallelism without a grid: rank 0 writes the model once, every rank its RNG
    dp = Checkpointer(base / "C", timeout_s=60)
    dp.save(7, full_state(7, rank), overlap=True)
    dp.wait()
    assert sorted(p.name for p in (base / "C" / dp.versions()[0].name).glob("*.bin")) == \
        ["global.bin", *[f"rank-{r:05d}.bin" for r in range(4)], "stage-000.bin"]
    _same(full_state(7, rank), dp.load())
    dp.close()


def test_checkpoints_across_ranks_levels_and_layouts(tmp_path):
    distributed.run(_four, 4, str(tmp_path), timeout=100)
    from hybridpar.checkpoint import Checkpointer

    # one process, no process group: the whole model, merged from both stages, and rank 0's RNG
    # (a change of world size; the 4-rank group above changed pipeline, data and spatial degrees)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _same(full_state(5, 0), Checkpointer(tmp_path / "A").load())
        _same(full_state(5, 0), Checkpointer(tmp_path / "B").load())
        _same(full_state(7, 0), Checkpointer(tmp_path / "C").load())
