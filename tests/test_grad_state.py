"""Gradient state across steps, as users drive it, exact against the same model in one process:

* accumulation over ``train_step`` calls (no ``zero_grad`` between, batch size 1 on large volumes):
  each step reduces only what its own backward adds, so earlier gradients are not counted once per rank;
* a layer frozen after ``parallelize`` gets no ``.grad`` (SGD momentum and AdamW leave it bit for bit);
* a layer frozen when ``parallelize`` ran and unfrozen later is summed over its shards (ranks agree);
* ``zero_grad(set_to_none=False)`` between steps;
* a trainable parameter no rank computes a gradient of ends with ``.grad`` None, as in torch.

Float64, on 2 ranks (spatial, data, spatial with two micro-batches) and 4 (2x2x1, data x spatial,
pipeline x spatial: each rank checks its stage's parameters; freezing c2, whose weight gradients the
last stage defers, once crashed its step).
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layer_cases import Failures

SHAPE = (4, 1, 8, 6, 4)  # batch 4: data 2 x micro-batches 2


class Gate(nn.Module):
    """A channel scale (used) beside a parameter the forward never reads: torch leaves its grad None."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, c).reshape(1, c, 1, 1, 1))
        self.unused = nn.Parameter(torch.ones(c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def Net() -> nn.Sequential:  # noqa: N802 (a model class as users name one)
    """Layers a pipeline stage runs one by one: the last stage's c2 defers its weight gradients."""
    return nn.Sequential(OrderedDict(c1=nn.Conv3d(1, 3, 3, padding=1), gate=Gate(3), relu=nn.ReLU(),
                                     c2=nn.Conv3d(3, 1, 3, padding=1)))


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(SHAPE, dtype=torch.float64, generator=g),
             torch.randn(SHAPE, dtype=torch.float64, generator=g)) for _ in range(n)]


def _optimizers(kind: str, model: nn.Module, ref: nn.Module):
    if kind == "adamw":
        return (torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
                torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1))
    return (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01),
            torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.01))


class Pair:
    """The engine's model and the one-process reference, stepped together and compared."""

    def __init__(self, fails: Failures, desc: str, spec: dict, opt: str = "sgd",
                 frozen: tuple[str, ...] = ()) -> None:
        import hybridpar as hp

        torch.manual_seed(0)
        self.ref = Net().double()
        self.model = copy.deepcopy(self.ref)
        for name in frozen:
            self.ref.get_submodule(name).requires_grad_(False)
            self.model.get_submodule(name).requires_grad_(False)
        self.engine = hp.parallelize(self.model, spec, loss_fn=F.mse_loss)
        self.opt, self.ref_opt = _optimizers(opt, self.model, self.ref)
        self.fails, self.desc = fails, desc

    def backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.engine.train_step(*self.engine.shard_batch(x, y))
        F.mse_loss(self.ref(x), y).backward()

    def step(self, set_to_none: bool = True) -> None:
        self.opt.step()
        self.ref_opt.step()
        self.opt.zero_grad(set_to_none=set_to_none)
        self.ref_opt.zero_grad(set_to_none=set_to_none)

    def freeze(self, name: str, on: bool) -> None:
        self.model.get_submodule(name).requires_grad_(not on)
        self.ref.get_submodule(name).requires_grad_(not on)

    def check(self, when: str, grads: bool = True) -> None:
        """This rank's stage's parameters (and gradients) against the reference's, and bit for bit
        against those of its stage's first rank."""
        ref = dict(self.ref.named_parameters())
        held = {id(p) for p in self.engine.parameters()}
        group = self.engine.grid.stage_group
        for name, p in self.model.named_parameters():
            if id(p) not in held:  # another pipeline stage's
                continue
            what = f"{self.desc}, {when}: {name}"
            if grads:
                self.fails.check(f"{what}.grad", p.grad, ref[name].grad)
            self.fails.check(what, p.detach(), ref[name].detach())
            first = p.detach().clone()
            dist.broadcast(first, dist.get_global_rank(group, 0), group=group)
            if not torch.equal(first, p.detach()):
                self.fails.append(f"{what}: differs from its stage's first rank's")


def _accumulate(fails: Failures, desc: str, spec: dict, k: int, rounds: int) -> None:
    """``k`` train_steps then one optimizer step, ``rounds`` times (the next on moved weights)."""
    pair = Pair(fails, f"{desc} accumulating {k}", spec)
    data = _batches(rounds * k)
    for r in range(rounds):
        for i, (x, y) in enumerate(data[r * k:(r + 1) * k]):
            pair.backward(x, y)
            pair.check(f"round {r} after train_step {i}")
        pair.step()
        pair.check(f"round {r} after the step", grads=False)


def _freeze(fails: Failures, desc: str, spec: dict, opt: str, name: str) -> None:
    """Two steps, ``name`` frozen after the first: its weights unchanged bit for bit, the others exact."""
    pair = Pair(fails, f"{desc} freezing {name} ({opt})", spec, opt)
    data = _batches(3)
    pair.backward(*data[0])
    pair.step()
    pair.freeze(name, True)
    frozen = dict(pair.model.get_submodule(name).named_parameters())
    kept = {n: p.detach().clone() for n, p in frozen.items()}
    for i, (x, y) in enumerate(data[1:]):
        pair.backward(x, y)
        for n, p in frozen.items():
            if p.grad is not None:
                fails.append(f"{pair.desc}: frozen {name}.{n} got a .grad at step {i}")
        pair.check(f"frozen, train_step {i}")
        pair.step()
        for n, p in frozen.items():
            if not torch.equal(p.detach(), kept[n]):
                fails.append(f"{pair.desc}: frozen {name}.{n} moved at step {i}")
        pair.check(f"frozen, step {i}", grads=False)


def _unfreeze(fails: Failures, desc: str, spec: dict) -> None:
    """c1 frozen when parallelize runs, one step, unfrozen, two steps: exact, ranks identical."""
    pair = Pair(fails, f"{desc} unfreezing c1", spec, frozen=("c1",))
    for i, (x, y) in enumerate(_batches(3)):
        pair.backward(x, y)
        pair.check(f"train_step {i}")
        pair.step()
        pair.check(f"step {i}", grads=False)
        pair.freeze("c1", False)


def _zeros_kept(fails: Failures, desc: str, spec: dict) -> None:
    """zero_grad(set_to_none=False) between steps, one accumulation of two train_steps among them."""
    pair = Pair(fails, f"{desc} zero_grad(set_to_none=False)", spec)
    for i, (x, y) in enumerate(_batches(4)):
        pair.backward(x, y)
        pair.check(f"train_step {i}")
        if i != 1:
            pair.step(set_to_none=False)
            pair.check(f"step {i}", grads=False)


KINDS = {
    "accumulation": lambda f, d, s: (_accumulate(f, d, s, 2, 2), _accumulate(f, d, s, 3, 1)),
    "freeze": lambda f, d, s: (_freeze(f, d, s, "sgd", "c1"), _freeze(f, d, s, "adamw", "c2")),
    "unfreeze": _unfreeze,
    "zeros kept": _zeros_kept,
}

SPECS = {
    2: [{"grid": {"spatial": [2, 1, 1]}}, {"grid": {"data": 2}},
        {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}],
    4: [{"grid": {"spatial": [2, 2, 1]}}, {"grid": {"data": 2, "spatial": [2, 1, 1]}},
        {"grid": {"pipe": 2, "spatial": [2, 1, 1]},
         "pipeline": {"microbatches": 2, "stages": ["c1", "gate"]}}],
}


def _body(rank: int, world: int, kind: str) -> None:
    torch.set_default_dtype(torch.float64)
    fails = Failures()
    for spec in SPECS[world]:
        try:
            KINDS[kind](fails, f"{spec}", spec)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{kind} {spec}: {type(err).__name__}: {err}")
    fails.raise_if_any(rank)


CASES = [(world, kind) for world in SPECS for kind in KINDS]  # grouped by world: one pool each


@pytest.mark.parametrize("world,kind", CASES, ids=[f"{w}-{k.replace(' ', '_')}" for w, k in CASES])
def test_grad_state_matches_torch(pools, world, kind):
    pools(world).run(_body, kind, timeout=300)
