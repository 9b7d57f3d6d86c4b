"""The engine under bf16 autocast, with a loss scale, and in channels_last_3d, against one process.

One training step of the test_engine model (float32 parameters) on layouts spatial 2, pipe 2 and
data 2 (2 ranks): under ``torch.autocast('cpu', dtype=torch.bfloat16)`` the loss and every gradient
agree with the single-process model's under the same autocast within bf16 tolerances; with a loss
scale of 1024 the gradients are 1024 times the unscaled ones (1e-6) while the returned loss is the
unscaled loss; with ``memory_format=torch.channels_last_3d`` (float64) the loss and gradients agree
within 1e-10 and the input shards are channels_last_3d.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from test_engine import make_model

import distributed

LAYOUTS = [{"grid": {"spatial": [2, 1, 1]}}, {"grid": {"pipe": 2}}, {"grid": {"data": 2}}]


def _data(dtype):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(4, 2, 16, 16, 16, generator=g, dtype=dtype),
            torch.randn(4, 4, generator=g, dtype=dtype))


def _reference(dtype, autocast: bool):
    model = make_model().to(dtype)
    x, y = _data(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = F.mse_loss(model(x), y)
    loss.backward()
    return loss.detach().double(), {k: p.grad.double() for k, p in model.named_parameters()}


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _step(hp, layout, dtype, autocast: bool, scale=None, fmt=torch.contiguous_format):
    engine = hp.parallelize(make_model().to(dtype), layout, loss_fn=F.mse_loss, memory_format=fmt)
    x, y = _data(dtype)
    x_local, y_local = engine.shard_batch(x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = engine.train_step(x_local, y_local, loss_scale=scale)
    grads = {k: p.grad.double() for k, p in engine.named_parameters() if p.grad is not None}
    return engine, x_local, loss, grads


def _body(rank: int, world: int) -> None:
    import hybridpar as hp
    from hybridpar.device.memfmt import CL

    fails = []
    bf_loss, bf_grads = _reference(torch.float32, True)
    loss64, grads64 = _reference(torch.float64, False)
    for layout in LAYOUTS:
        name = layout["grid"]
        _, _, loss, grads = _step(hp, layout, torch.float32, True)
        if _rel(loss, bf_loss) > 2e-2:
            fails.append(f"{name} bf16: loss {loss.item():.5f} vs torch {bf_loss.item():.5f}")
        for k, g in grads.items():
            if _rel(g, bf_grads[k]) > 3e-2:
                fails.append(f"{name} bf16: {k}.grad relative error {_rel(g, bf_grads[k]):.2e}")
        _, _, plain, plain_grads = _step(hp, layout, torch.float32, False)
        _, _, scaled, scaled_grads = _step(hp, layout, torch.float32, False, scale=torch.tensor(1024.0))
        if _rel(scaled, plain) > 1e-6:
            fails.append(f"{name} loss scale: the returned loss is scaled")
        for k, g in scaled_grads.items():
            if _rel(g / 1024, plain_grads[k]) > 1e-6:
                fails.append(f"{name} loss scale: {k}.grad is not 1024 x the unscaled one")
        _, x_local, loss, grads = _step(hp, layout, torch.float64, False, fmt=CL)
        if not x_local.is_contiguous(memory_format=CL):
            fails.append(f"{name} channels_last: shard_batch gave strides {x_local.stride()}")
        if _rel(loss, loss64) > 1e-10:
            fails.append(f"{name} channels_last: loss {loss.item()} vs {loss64.item()}")
        for k, g in grads.items():
            if _rel(g, grads64[k]) > 1e-10:
                fails.append(f"{name} channels_last: {k}.grad relative error {_rel(g, grads64[k]):.2e}")
    if fails:
        raise AssertionError(f"rank {rank}: {len(fails)} failures:\n" + "\n".join(fails))


def test_engine_bf16_loss_scale_channels_last():
    distributed.run(_body, 2, timeout=300)
