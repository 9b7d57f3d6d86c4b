"""State a micro-batched step would get wrong, and gradient clipping over a pipeline.

Why: these were silent: with ``pipeline.microbatches`` 2 an InstanceNorm's running statistics and a
forward's own counter moved twice per step, and torch's ``clip_grad_norm_`` on a pipeline clipped each
stage by its own norm. Now the first two are refused in one line on every rank (the buffers left as
before the step) and ``Engine.clip_grad_norm_`` clips by the whole model's norm, as one process does.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

SHAPE = (2, 1, 12, 10, 8)


class Plain(nn.Module):
    def __init__(self, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.c1 = nn.Conv3d(1, 4, 3, padding=1)
        self.n = norm or nn.Identity()
        self.c2 = nn.Conv3d(4, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.relu(self.n(self.c1(x))))


class Counter(Plain):
    """A forward keeping a step counter (updated in place) and a weight EMA (rebound) in buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))
        self.register_buffer("ema_w", torch.zeros(4, 1, 3, 3, 3, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            self.ema_w = 0.9 * self.ema_w + 0.1 * self.c1.weight.detach()
        return super().forward(x)


class WarmCounter(Plain):
    """A counter the forward starts moving once the user's script says the warm-up is over, and a
    coordinate grid it rewrites alike on every call (its values never change)."""

    def __init__(self) -> None:
        super().__init__()
        self.warm = False
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))
        self.register_buffer("grid", torch.arange(SHAPE[2], dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[2] > 1:  # untraceable: run by module swapping, whose forward reads self.warm live
            self.grid.copy_(torch.arange(x.shape[2], dtype=torch.float64))
            if self.training and self.warm:
                self.steps += 1
        return super().forward(x)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(SHAPE, dtype=torch.float64, generator=g),
             torch.randn(SHAPE, dtype=torch.float64, generator=g)) for _ in range(2)]


def _clip_body(rank: int, world: int, spec: dict, norm_type: float) -> list[str]:
    """Two SGD steps with clipping against one process with torch's ``clip_grad_norm_``."""
    import hybridpar as hp

    torch.manual_seed(0)
    ref = Plain().double()
    model = copy.deepcopy(ref)
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss, input_shape=SHAPE)
    opt = torch.optim.SGD(engine.parameters() or [{"params": []}], lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    fails = []
    for s, (x, y) in enumerate(_batches()):
        opt.zero_grad()
        ref_opt.zero_grad()
        engine.train_step(*engine.shard_batch(x, y))
        F.mse_loss(ref(x), y).backward()
        got = engine.clip_grad_norm_(0.05, norm_type)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        if not torch.allclose(got.double(), want, rtol=1e-12, atol=0):
            fails.append(f"{spec} step {s}: norm {got.item()} vs one process {want.item()}")
        ref_grads = dict(ref.named_parameters())
        for k, p in engine.named_parameters():
            if not torch.allclose(p.grad, ref_grads[k].grad, rtol=1e-12, atol=1e-15):
                fails.append(f"{spec} step {s}: clipped grad of {k} differs")
        opt.step()
        ref_opt.step()
    full = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        if not torch.allclose(full[k].double(), v, rtol=1e-12, atol=1e-15):
            fails.append(f"{spec}: {k} after 2 clipped steps differs from one process")
    return fails


@pytest.mark.parametrize("spec", [
    {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2, "stages": ["c1", "c2"]}},
    {"grid": {"spatial": [2, 1, 1]}},
], ids=["pipe2", "spatial2"])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
def test_clip_grad_norm_matches_one_process(pools, spec, norm_type):
    fails = pools(2).run(_clip_body, spec, norm_type, timeout=300)
    assert fails == [[], []], fails


def _refusal_body(rank: int, world: int, case: str) -> tuple[str, float, float]:
    """The refusal each case gets (or "" where none), and the counter and the EMA's largest value
    afterwards, in the engine's state and in the model's own (-1 if none)."""
    import hybridpar as hp

    torch.manual_seed(0)
    norm = nn.InstanceNorm3d(4, affine=True, track_running_stats=True)
    model = (Counter() if case == "counter" else Plain(norm)).double()
    spec = {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}
    if case == "instancenorm accepted":
        spec["pipeline"]["micro_batch_stats"] = True
    if case.startswith("pipeline"):  # the norm on one stage: the other refuses alike, not waiting on it
        spec = {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2, "micro_batch_stats": case != "pipeline"}}
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss, input_shape=SHAPE)
    x, y = _batches()[0]
    if case == "pipeline, another size":  # the first stage alone sees its input
        x, y = x[:, :, 1:], y[:, :, 1:]
    try:
        engine.train_step(*engine.shard_batch(x, y))
        said = ""
    except (hp.SpecError, ValueError) as err:  # a SpecError is a ValueError
        said = str(err)
    if case != "counter":
        return said, -1.0, -1.0
    full, own = engine.full_state_dict(), model.state_dict()
    return said, full["steps"].item() + own["steps"].item(), full["ema_w"].abs().max().item() + \
        own["ema_w"].abs().max().item()


def _late_body(rank: int, world: int) -> tuple[list[str], float]:
    """Three micro-batched steps, the warm-up ending after the second: what each step said, and the
    counter afterwards."""
    import hybridpar as hp

    torch.manual_seed(0)
    model = WarmCounter().double()
    spec = {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss, input_shape=SHAPE)
    said = []
    for step in range(3):
        model.warm = step == 2
        try:
            engine.train_step(*engine.shard_batch(*_batches()[0]))
            said.append("")
        except hp.SpecError as err:
            said.append(str(err))
    return said, engine.full_state_dict()["steps"].item()


def test_a_buffer_the_forward_starts_moving_later_is_refused(pools):
    """Found at the step it first moves (by version counter, no copy), not only at the first step; a
    buffer written alike every step (the grid) is compared by value and passes."""
    said = pools(2).run(_late_body, timeout=300)
    assert said[0] == said[1], f"ranks said different things: {said}"
    (first, second, third), steps = said[0]
    assert first == second == "", said[0]
    assert third.startswith("Engine.train_step: the forward changed buffer steps at this step, not at the "
                            "first micro-batched one: it moved once per each of the 2 micro-batches"), third
    assert steps == 2.0  # as the micro-batches left it, which the message says


@pytest.mark.parametrize("case,start", [
    ("instancenorm", "Engine.train_step: n (InstanceNorm3d) tracks running statistics"),
    ("pipeline", "Engine.train_step: n (InstanceNorm3d) tracks running statistics"),
    ("pipeline, another size", "Engine.train_step: trains at the build size 12x10x8; got 11x10x8"),
    ("counter", "Engine.train_step: the forward changes buffers ema_w, steps, which would move once per"),
    ("instancenorm accepted", ""),
])
def test_micro_batches_refuse_buffers_the_forward_moves(pools, case, start):
    said = pools(2).run(_refusal_body, case, timeout=300)
    messages = {m for m, _, _ in said}
    assert len(messages) == 1, f"{case}: ranks said different things: {said}"
    (message,) = messages
    assert "\n" not in message and message.startswith(start), f"{case}: {message!r}"
    if case == "counter":
        assert [s for _, *s in said] == [[0.0, 0.0]] * 2, f"{case}: buffers not restored: {said}"
