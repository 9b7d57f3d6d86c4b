"""The hybrid engine against the single-process model: 3 SGD-with-momentum steps, float64, losses per
step and full_state_dict() equal within 1e-10 relative, for pipe=2 and 4; spatial (2,1,1) x pipe 2;
data 2 x pipe 2; data 2 x spatial 2; data 2 x pipe 2 x spatial 2 (8 ranks); GPipe and 1F1B; with
and without activation recomputation."""

from __future__ import annotations

from collections import OrderedDict
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import distributed

STEPS, BATCH = 3, 8


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2),
                             nn.Conv3d(4, 8, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2))
    head = nn.Sequential(nn.Flatten(), nn.Linear(8 * 4 * 4 * 4, 16), nn.LeakyReLU(0.3), nn.Linear(16, 4))
    return nn.Sequential(OrderedDict(features=features, head=head)).double()


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 2, 16, 16, 16, generator=g, dtype=torch.float64),
             torch.randn(BATCH, 4, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def reference():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for x, y in batches():
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _body(rank: int, world: int, layout: dict, fresh: bool) -> None:
    """One layout; ``fresh``: the first case of its pool, so no group exists yet but the default."""
    import hybridpar as hp

    ref_losses, ref_state = reference()
    failures = []
    from torch.distributed import distributed_c10d

    layout = dict(layout)
    groups_before = len(distributed_c10d._world.pg_map)
    # NCCL's layout of communicators (one per kind of pipeline traffic), exercised over gloo
    as_nccl = layout.pop("as_nccl", False)
    spec = hp.ParallelSpec.from_dict(layout)
    engine = hp.parallelize(make_model(), spec, loss_fn=F.mse_loss)
    opt = None
    for step, (x, y) in enumerate(batches()):
        if step == 0:
            with mock.patch("torch.distributed.get_backend", return_value="nccl" if as_nccl else "gloo"):
                x_local, y_local = engine.shard_batch(x, y)  # builds the engine and its groups
            if as_nccl and engine.grid.pipe > 1 and engine.p2p_groups["F"] is None:
                failures.append(f"{layout}: no communicators of their own under NCCL")
            # a pipeline over every rank (gloo) needs no communicator beyond the default one:
            # groups of one rank (spatial, halo, stage, data here) cost threads and move nothing
            made = len(distributed_c10d._world.pg_map) - groups_before
            if fresh and engine.grid.pipe == world and not as_nccl and made:
                failures.append(f"{layout}: {made} communicators created besides the default")
        else:
            x_local, y_local = engine.shard_batch(x, y)
        # a stage may hold no parameters at all (pooling and activations only)
        if opt is None and engine.parameters():
            opt = torch.optim.SGD(engine.parameters(), lr=0.05, momentum=0.9)
        loss = engine.train_step(x_local, y_local)
        if opt is not None:
            opt.step()
            opt.zero_grad()
        err = abs(loss.item() - ref_losses[step]) / abs(ref_losses[step])
        if not err <= 1e-10:
            failures.append(f"{layout}: step {step} loss {loss.item()} vs {ref_losses[step]} ({err:.2e})")
    state = engine.full_state_dict()
    if list(state) != list(ref_state):
        failures.append(f"{layout}: full_state_dict keys {list(state)} != {list(ref_state)}")
    for k, v in ref_state.items():
        if k in state and not _rel(state[k], v) <= 1e-10:
            failures.append(f"{layout}: {k} relative error {_rel(state[k], v):.2e}")
    out = engine.predict(engine.shard_batch(*batches()[0])[0])
    model = make_model()
    model.load_state_dict(ref_state)
    per = BATCH // engine.grid.data
    want = model(batches()[0][0])[engine.grid.data_index * per:(engine.grid.data_index + 1) * per]
    if not _rel(out, want.detach()) <= 1e-10:
        failures.append(f"{layout}: predict relative error {_rel(out, want.detach()):.2e}")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _layout(data=1, pipe=1, spatial=(1, 1, 1), schedule="gpipe", micro=2, recompute=False,
            stages="auto") -> dict:
    return {"grid": {"data": data, "pipe": pipe, "spatial": list(spatial)},
            "pipeline": {"schedule": schedule, "microbatches": micro, "recompute": recompute,
                         "stages": stages}}


LAYOUTS = {
    2: [_layout(pipe=2), _layout(pipe=2, schedule="1f1b", micro=4), _layout(pipe=2, recompute=True),
        _layout(pipe=2, schedule="1f1b", recompute=True),
        {**_layout(pipe=2, schedule="1f1b", micro=4), "as_nccl": True}],
    4: [_layout(pipe=2, spatial=(2, 1, 1)),
        _layout(pipe=2, spatial=(2, 1, 1), schedule="1f1b", recompute=True),
        _layout(data=2, pipe=2), _layout(data=2, pipe=2, schedule="1f1b"),
        _layout(data=2, spatial=(2, 1, 1), micro=1), _layout(data=2, spatial=(1, 2, 1), recompute=True),
        _layout(pipe=4, micro=4),
        _layout(pipe=4, schedule="1f1b", stages=["features.0", "features.3", "head.1", "head.3"]),
        {**_layout(data=2, pipe=2, micro=4), "as_nccl": True}],
    8: [_layout(data=2, pipe=2, spatial=(2, 1, 1)),
        _layout(data=2, pipe=2, spatial=(1, 1, 2), schedule="1f1b", recompute=True)],
}
CASES = [(world, i, layout) for world, layouts in LAYOUTS.items() for i, layout in enumerate(layouts)]


def _case_id(world: int, layout: dict) -> str:
    g, p = layout["grid"], layout["pipeline"]
    grid = f"d{g['data']}p{g['pipe']}s{''.join(map(str, g['spatial']))}"
    return (f"{world}-{grid}-{p['schedule']}-m{p['microbatches']}"
            + ("-recompute" if p["recompute"] else "") + ("-named" if p["stages"] != "auto" else "")
            + ("-as_nccl" if layout.get("as_nccl") else ""))


@pytest.mark.parametrize("world,index,layout", CASES, ids=[_case_id(w, lay) for w, _, lay in CASES])
def test_engine_matches_single_process(pools, world, index, layout):
    pools(world).run(_body, layout, index == 0, timeout=600)


def _order_body(rank: int, world: int) -> None:
    """On the second stage, when does the last input gradient leave, against the weight gradients?"""
    import hybridpar as hp
    from hybridpar.pipeline import deferred
    from hybridpar.pipeline import engine as engine_mod

    x, y = batches()[0]
    for schedule in ("gpipe", "1f1b"):
        engine = hp.parallelize(make_model(), _layout(pipe=2, schedule=schedule, micro=2), loss_fn=F.mse_loss)
        x_local, y_local = engine.shard_batch(x, y)
        events: list[str] = []
        for p in engine.parameters():
            p.register_post_accumulate_grad_hook(lambda p, events=events: events.append("grad"))
        send = engine._send

        def logged(t, dst, tag, send=send, events=events):
            events.append(f"send {tag - engine_mod._BWD}" if tag >= engine_mod._BWD else "send F")
            return send(t, dst, tag)

        engine._send = logged
        engine.train_step(x_local, y_local)
        if rank == 1:
            last = max(i for i, e in enumerate(events) if e.startswith("send"))
            after = events[last + 1:].count("grad")
            # GPipe holds 2 micro-batches here: every weight of the last backward waits for the send;
            # 1F1B's last stage holds 1: only the prefix up to its first conv or linear layer does
            modules = [m for _, m in engine.layers]
            first = deferred.deferrable(modules).index(True)
            want = len(engine.parameters()) if schedule == "gpipe" else len(list(modules[first].parameters()))
            assert 0 < want and after == want, f"{schedule}: {after} weights after the last send, want {want}"


def test_input_gradient_leaves_before_deferred_weight_gradients():
    """GPipe holds 2 micro-batches on stage 1, so its last backward sends the input gradient before
    computing any weight gradient; 1F1B's last stage holds 1, so only the weights of its first conv or
    linear layer wait (memory)."""
    distributed.run(_order_body, 2, timeout=300)
