"""Running statistics under data parallelism: after every training step (and a training-mode
``predict``) every rank holds the same BatchNorm3d, InstanceNorm3d and BatchNorm1d running statistics,
``full_state_dict()`` is bit-identical on every rank, and the statistics equal the average over the
replicas of what torch's layers track on each replica's micro-batches (float64, weights held fixed so
that torch's per-replica copies see the same weights; 1e-10 relative). Layouts: data 2 x spatial 2,
data 2 x pipe 2 (1F1B), data 4; micro-batches 1 and 2. One spawned group of 4 ranks."""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layer_cases import Failures

BATCH, STEPS = 8, 3


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        conv1=nn.Conv3d(2, 4, 3, padding=1), bn=nn.BatchNorm3d(4), act1=nn.ReLU(),
        conv2=nn.Conv3d(4, 4, 3, padding=1),
        inorm=nn.InstanceNorm3d(4, affine=True, track_running_stats=True),
        act2=nn.ReLU(), pool=nn.AvgPool3d(2), flat=nn.Flatten(), fc1=nn.Linear(4 * 4 * 4 * 4, 8),
        bn1d=nn.BatchNorm1d(8), act3=nn.ReLU(), fc2=nn.Linear(8, 3))).double()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # replicas see differently scaled samples, so their own statistics would differ clearly
    scale = torch.linspace(0.5, 3.0, BATCH, dtype=torch.float64).view(-1, 1, 1, 1, 1)
    return [(torch.randn(BATCH, 2, 8, 8, 8, generator=g, dtype=torch.float64) * scale + 1.0,
             torch.randn(BATCH, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def expected(data: int, micro: int, predicts: int) -> dict[str, torch.Tensor]:
    """Per replica, torch's layers on its micro-batches (fixed weights); then the replicas' average."""
    states = []
    per = BATCH // data
    for r in range(data):
        model = copy.deepcopy(make_model()).train()
        with torch.no_grad():
            for x, _ in batches() + batches()[:predicts]:
                for chunk in x[r * per:(r + 1) * per].tensor_split(min(micro, per)):
                    model(chunk)
        states.append(model.state_dict())
    return {k: sum(s[k] for s in states) / data if v.is_floating_point() else v
            for k, v in states[0].items()}


def _all_equal(fails: Failures, desc: str, state: dict[str, torch.Tensor]) -> None:
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, state)
    for r, other in enumerate(gathered):
        for k, v in state.items():
            if not torch.equal(v, other[k]):
                fails.append(f"{desc}: full_state_dict()[{k!r}] differs between ranks "
                             f"{dist.get_rank()} and {r}")


def _body(rank: int, world: int, layout: dict, with_optimizer: bool) -> None:
    import hybridpar as hp

    fails = Failures()
    desc = str(layout)
    engine = hp.parallelize(make_model(), layout, loss_fn=F.mse_loss)
    for x, y in batches():
        engine.train_step(*engine.shard_batch(x, y))  # no optimizer step: weights stay fixed
        _all_equal(fails, f"{desc} after a step", engine.full_state_dict())
    engine.predict(engine.shard_batch(*batches()[0])[0])  # training mode: updates statistics
    state = engine.full_state_dict()
    _all_equal(fails, f"{desc} after a training-mode predict", state)
    want = expected(engine.grid.data, layout["pipeline"]["microbatches"], predicts=1)
    for k, v in want.items():
        if "running" in k or "num_batches" in k:
            fails.check(f"{desc} {k}", state[k].to(v.dtype), v)
    if with_optimizer:  # with an optimizer too: every rank still holds one state
        engine = hp.parallelize(make_model(), layout, loss_fn=F.mse_loss, input_shape=batches()[0][0].shape)
        opt = torch.optim.SGD(engine.parameters() or [{"params": []}], lr=0.05, momentum=0.9)
        for x, y in batches():
            engine.train_step(*engine.shard_batch(x, y))
            opt.step()
            opt.zero_grad()
        _all_equal(fails, f"{desc} after SGD steps", engine.full_state_dict())
    fails.raise_if_any(rank)


def _layout(data: int, pipe: int = 1, spatial=(1, 1, 1), micro: int = 1, schedule: str = "gpipe") -> dict:
    return {"grid": {"data": data, "pipe": pipe, "spatial": list(spatial)},  # micro-batches' statistics:
            "pipeline": {"microbatches": micro, "schedule": schedule, "micro_batch_stats": micro > 1}}


LAYOUTS = {"data2-spatial2-gpipe": _layout(2, spatial=(2, 1, 1), micro=2),
           "data2-pipe2-1f1b": _layout(2, pipe=2, micro=2, schedule="1f1b"), "data4": _layout(4)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_running_statistics_agree_over_replicas(pools, name):
    pools(4).run(_body, LAYOUTS[name], name == "data2-spatial2-gpipe", timeout=300)
