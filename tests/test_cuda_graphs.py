"""CUDA graphs (``train.cuda_graphs``): the captured training step replays to the same losses and
weights as eager steps (one rank, bf16 autocast through ``Accel``, 4 SGD steps, 1e-3 relative on
the losses: bf16 kernels may differ between captured and eager runs only by their algorithms); a
second batch shape is an error naming the captured one. Without CUDA, ``Accel`` refuses the option
(``tests/test_accel_train.py``)."""

from __future__ import annotations

import pytest

import distributed


def _body(rank: int, world: int) -> None:
    import torch
    import torch.nn.functional as F
    from test_engine import make_model

    import hybridpar as hp
    from hybridpar.device.accel import Accel

    torch.manual_seed(0)
    data = [(torch.randn(2, 2, 16, 16, 16, device="cuda"), torch.randn(2, 4, device="cuda"))
            for _ in range(4)]
    runs = {}
    for graphs in (False, True):
        model = make_model().float().cuda()
        engine = hp.parallelize(model, {"grid": {}}, loss_fn=F.mse_loss, input_shape=(2, 2, 16, 16, 16))
        opt = torch.optim.SGD(engine.parameters(), lr=0.01, momentum=0.9)
        accel = Accel(torch.device("cuda"), "bf16", cuda_graphs=graphs)
        accel.prepare(engine)
        losses = [accel.step(engine, opt, x, y).item() for x, y in data]
        runs[graphs] = (losses, [p.detach().clone() for p in engine.parameters()])
        if graphs:
            with pytest.raises(ValueError, match="captured for a batch of"):
                accel.step(engine, opt, data[0][0][:1], data[0][1][:1])
    for a, b in zip(runs[True][0], runs[False][0]):
        assert abs(a - b) <= 1e-3 * abs(b), (runs[True][0], runs[False][0])
    for p, q in zip(runs[True][1], runs[False][1]):
        assert torch.allclose(p, q, rtol=1e-2, atol=1e-4)


@pytest.mark.cuda
def test_captured_step_matches_eager():
    distributed.run(_body, 1, timeout=300)
