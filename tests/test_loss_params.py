"""A loss that reads the model's parameters itself trains as one process.

The engine evaluates ``loss_fn`` on each rank's output shard; a term the loss adds from a parameter (a
penalty on a learnable gate, Kendall's learnable loss weight used nowhere in the forward, weight decay
written into the loss) gave each rank part of that parameter's gradient, and the reduction averaged the
parts: 0.5x on two ranks, silently, and a parameter no layer uses drifted apart on the ranks. Now the
parts are summed over the ranks that evaluate the loss; a pipeline, whose loss stage does not hold the
other stages' parameters, is refused in one line on every rank.

Float64, two SGD-with-momentum steps beside the same model in one process, every gradient of the first
step and every parameter after both, on 2 ranks [2,1,1], 4 ranks [2,2,1], data 2 x spatial [2,1,1],
two micro-batches, and data 2 alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from graph_models import GradNormed
from layer_cases import Failures


class Gate(nn.Module):
    """A learnable gate on a split activation, penalised in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.gamma = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + self.gamma * h)


class Kendall(nn.Module):
    """A learnable loss weight (log variance) that only the loss reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.log_var = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Head(nn.Module):
    """A regression head: its (N, 2) output is whole on every rank of a replica."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv3d(1, 3, 3, padding=1), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(self.conv(x)).mean(dim=(2, 3, 4)))


def _loss(model: nn.Module, name: str):
    """The loss ``name`` over ``model``'s own parameters (a closure, as a user writes it)."""
    if name == "penalty":
        return lambda o, y: F.mse_loss(o, y) + 0.1 * model.gamma.abs()
    if name == "kendall":
        return lambda o, y: F.mse_loss(o, y) * torch.exp(-model.log_var) / 2 + model.log_var / 2
    if name == "head penalty":
        return lambda o, y: F.mse_loss(o, y) + 0.05 * model.fc.weight.pow(2).sum()
    return lambda o, y: F.mse_loss(o, y) + 1e-2 * sum(p.pow(2).sum() for p in model.parameters())  # decay


S2, S4 = {"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [2, 2, 1]}}
DS = {"grid": {"data": 2, "spatial": [2, 1, 1]}}
MB2 = {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}
D2 = {"grid": {"data": 2}}
CASES = [  # (world, model, loss, spec)
    (2, "Gate", "penalty", S2), (2, "Kendall", "kendall", S2), (2, "Gate", "decay", S2),
    (2, "Head", "head penalty", S2), (2, "Kendall", "kendall", MB2), (2, "Gate", "penalty", D2),
    (4, "Gate", "penalty", S4), (4, "Kendall", "kendall", S4), (4, "Gate", "decay", DS),
    (4, "Head", "head penalty", DS), (4, "Kendall", "kendall", DS),
]


def _data(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn((4, 1, 9, 7, 6), dtype=torch.float64, generator=g)
    y = torch.randn((4, 2) if model == "Head" else (4, 1, 9, 7, 6), dtype=torch.float64, generator=g)
    return x, y


def _body(rank: int, world: int, model: str, loss: str, spec: dict) -> None:
    import hybridpar as hp

    fails, desc = Failures(), f"{model} {loss} {spec}"
    x, y = _data(model)
    torch.manual_seed(0)
    ref = globals()[model]().double()
    mine = copy.deepcopy(ref)
    engine = hp.parallelize(mine, spec, loss_fn=_loss(mine, loss))
    local = engine.shard_batch(x, y)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (mine, ref))
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        got = engine.train_step(*local)
        want = _loss(ref, loss)(ref(x), y)
        want.backward()
        fails.check(f"{desc}: step {step} loss", got.detach().reshape(()), want.detach(), 1e-9)
        if step == 0:
            for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
                if p.grad is None:
                    fails.append(f"{desc}: {name} has no gradient")
                else:
                    fails.check(f"{desc}: {name}.grad", p.grad, q.grad, 1e-9)
        opt.step()
        ref_opt.step()
    for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        fails.check(f"{desc}: {name} after 2 steps", p.detach(), q.detach(), 1e-9)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,model,loss,spec", CASES,
                         ids=[f"{w}-{m}-{lo}-{'x'.join(f'{k}{v}' for k, v in s['grid'].items())}"
                              f"{'-mb2' if 'pipeline' in s else ''}".replace(" ", "_")
                              for w, m, lo, s in CASES])
def test_a_loss_reading_parameters_trains_as_one_process(pools, world, model, loss, spec):
    pools(world).run(_body, model, loss, spec, timeout=120)


def _pipeline_body(rank: int, world: int) -> str:
    import hybridpar as hp

    x, y = _data("Gate")
    torch.manual_seed(0)
    mine = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv3d(2, 1, 3, padding=1)).double()
    loss = _loss(mine, "decay")
    engine = hp.parallelize(mine, {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2}}, loss_fn=loss)
    try:
        engine.train_step(*engine.shard_batch(x, y))
    except ValueError as err:
        return str(err)
    return "no error"


def test_a_pipeline_refuses_a_loss_that_reads_parameters(pools):
    said = set(pools(2).run(_pipeline_body, timeout=60))
    assert len(said) == 1, f"ranks said different things: {said}"
    line = said.pop()
    assert line.startswith("Engine.train_step: loss_fn reads parameter(s) 0.weight, 0.bias, 2.weight, "
                           "2.bias itself") and "pipeline" in line and "\n" not in line, line


def _hooked_loss_body(rank: int, world: int, how: str) -> str:
    import hybridpar as hp

    x, y = _data("Gate")
    torch.manual_seed(0)
    mine = nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv3d(2, 1, 3, padding=1)).double()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if how == "hook":
            out.register_hook(lambda g: g / g.norm())  # a norm over what this rank holds of the output
        else:
            out = GradNormed.apply(out)
        return F.mse_loss(out, target)

    engine = hp.parallelize(mine, {"grid": {"spatial": [2, 1, 1]}}, loss_fn=loss)
    try:
        engine.train_step(*engine.shard_batch(x, y))
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("how,says", [
    ("hook", "registers a gradient hook"),
    ("function", "applies an autograd.Function of its own (GradNormed.apply)")])
def test_backward_code_in_the_loss_is_refused(pools, how, says):
    """The loss is evaluated on each rank's part of the output: a gradient hook or a Function's backward
    there would see that part's gradient alone."""
    said = set(pools(2).run(_hooked_loss_body, how, timeout=60))
    assert len(said) == 1, f"ranks said different things: {said}"
    line = said.pop()
    assert line.startswith(f"loss_fn {says} at test_loss_params.py:"), line
    assert "\n" not in line, line
