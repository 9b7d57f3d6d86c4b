"""``parallelize(model, "auto", ...)`` on 2 ranks: the first rank's advisor choice is every rank's spec
(the same as ``advise`` on the job's world size, memory and calibration), it trains, it is written as
YAML that ``load_spec`` reads back, and an existing file is not written over; a missing input shape
and a CPU without a calibration are refused in one line on every rank, before any group is made."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from cosmoflow.model import build_model


def _body(rank: int, world: int, tmp: str) -> None:
    import hybridpar as hp
    from hybridpar import perfmodel as pm
    from hybridpar.advisor import advise
    from hybridpar.auto_layout import memory_per_rank
    from hybridpar.planner import SpecError

    os.environ["HYBRIDPAR_MACHINE"] = os.path.join(tmp, "nothing.json")
    torch.manual_seed(0)
    shape = (4, 4, 16, 16, 16)
    with pytest.raises(SpecError, match="no calibration at .*perf harness --calibrate-only"):
        hp.parallelize(build_model(16, n_conv=2), "auto", loss_fn=F.mse_loss, input_shape=shape)
    with pytest.raises(SpecError, match=r"needs input_shape=\(N, C, D, H, W\)"):
        hp.parallelize(build_model(16, n_conv=2), "auto", loss_fn=F.mse_loss)

    machine = os.path.join(tmp, "machine.json")
    if rank == 0:
        pm.save_machine(pm.PRESETS["v100"], machine)
    torch.distributed.barrier()
    os.environ["HYBRIDPAR_MACHINE"] = machine
    out = os.path.join(tmp, "auto.yaml")
    model = build_model(16, n_conv=2)
    engine = hp.parallelize(model, "auto", loss_fn=F.mse_loss, input_shape=shape, spec_out=out)
    want = advise(build_model(16, n_conv=2), shape, world,
                  memory_per_rank(torch.device("cpu"), pm.PRESETS["v100"], world), "v100").best.spec
    assert engine.spec == want.resolve_grid(world), (engine.spec, want)
    torch.distributed.barrier()
    assert hp.load_spec(out) == want
    x, y = torch.randn(shape), torch.randn(4, 4)
    loss = engine.train_step(*engine.shard_batch(x, y))
    assert torch.isfinite(loss)
    with pytest.raises(SpecError, match="auto.yaml exists"):
        hp.parallelize(build_model(16, n_conv=2), "auto", loss_fn=F.mse_loss, input_shape=shape, spec_out=out)


def test_auto_spec_is_the_advisors_choice_on_every_rank(pools, tmp_path):
    pools(2).run(_body, str(tmp_path), timeout=300)
