"""A loss the engine cannot combine from its parts over the output's shards is evaluated on the gathered
output; one it cannot combine over samples is refused; a sum is summed; a recomputation leaves buffers
alone.

The engine evaluates ``loss_fn`` on each rank's output shard, micro-batch and replica and combines the
values: exact for a mean over voxels and samples (checked against one process here, as before) and for a
sum (``reduction="sum"``, a per-sample sum averaged over the batch). A loss that is neither over the
shards (masked mean, Dice, Pearson, class-weighted cross entropy, differences between voxels across a
split dim) is evaluated on the whole output, gathered on the ranks that share it, and trains as one
process; one that is neither over the samples (normalised over the batch under data parallelism or
micro-batches) is refused with one line, the same on every rank, before any gradient is applied. With
``pipeline: {recompute: true}`` a model's own buffer updates (an EMA, a step counter, BatchNorm's
statistics) count once per step, as in one process.

Float64, two SGD steps against the same model in one process, on 2 ranks [2,1,1], 4 ranks [2,2,1],
data 2 x spatial [2,1,1] (with micro-batches of one sample) and a 2-stage pipeline.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from layer_cases import Failures, steps_match

SHAPE = (4, 1, 8, 6, 6)


def Plain() -> nn.Module:  # noqa: N802 (named as the model it builds)
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv3d(2, 1, 3, padding=1))


class Deep(nn.Module):
    """Deep supervision at one extent (a list): both volumes stay split, one share weighs both."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv3d(1, 2, 3, padding=1)
        self.main, self.aux = nn.Conv3d(2, 1, 3, padding=1), nn.Conv3d(2, 1, 1)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        h = torch.tanh(self.stem(x))
        return [self.main(h), self.aux(h)]


class Head(nn.Module):
    """A regression head: (N, 4) out, replicated on every rank of a replica."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv3d(1, 2, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool3d(1)
        self.fc = nn.Linear(2, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.tanh(self.conv(x))).flatten(1))


class Stateful(nn.Module):
    """Buffers the forward updates itself (an EMA it then reads, a step counter) beside BatchNorm's."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv3d(1, 4, 3, padding=1), nn.BatchNorm3d(4)
        self.c2 = nn.Conv3d(4, 1, 3, padding=1)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(1, 4, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.c1(x)))
        if self.training:
            self.steps += 1
            self.ema.mul_(0.9).add_(0.1 * h.mean(dim=(0, 2, 3, 4), keepdim=True).detach())
        return self.c2(h - self.ema * (1 + self.steps / 10))


def _dice(o: torch.Tensor, y: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    """Soft Dice over ``dims`` (None: every dim), one per sample over (1, 2, 3, 4)."""
    p, t = torch.sigmoid(o), (y > 0).to(o.dtype)
    total = (lambda v: v.sum()) if dims is None else (lambda v: v.sum(dims))
    return 1 - (2 * total(p * t) + 1) / (total(p) + total(t) + 1)


def _pearson(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 1 - torch.corrcoef(torch.stack([o.flatten(), y.flatten()]))[0, 1]


LOSSES = {
    "mse": F.mse_loss,
    "sum": lambda o, y: F.mse_loss(o, y, reduction="sum"),
    "sample sum": lambda o, y: ((o - y) ** 2).sum(dim=tuple(range(1, o.dim()))).mean(),  # a VAE's
    "deep mean": lambda o, y: F.mse_loss(o[0], y) + 0.5 * F.l1_loss(o[1], y),
    "TV along H": lambda o, y: F.mse_loss(o, y) + 0.1 * (o[:, :, :, 1:] - o[:, :, :, :-1]).abs().mean(),
    "TV along D": lambda o, y: F.mse_loss(o, y) + 0.1 * (o[:, :, 1:] - o[:, :, :-1]).abs().mean(),
    "masked mean": lambda o, y: ((o - y) ** 2 * (y > 0)).sum() / (y > 0).sum(),
    # torch hands a mode F.l1_loss without its weight: the loss's watch ran it unweighted
    "weighted l1": lambda o, y: F.l1_loss(o, y, weight=1.0 + (y > 0).to(o.dtype)),
    "dice": lambda o, y: 1 - (2 * (torch.sigmoid(o) * (y > 0)).sum() + 1)
    / (torch.sigmoid(o).sum() + (y > 0).sum() + 1),
    "sample dice": lambda o, y: _dice(o, y, (1, 2, 3, 4)).mean(),
    "deep dice": lambda o, y: _dice(o[0], y, None) + 0.5 * _dice(o[1], y, None),
    "pearson": _pearson,
    "batch-normalised": lambda o, y: F.mse_loss(o, y) / y.var(),
    "nearly a mean": lambda o, y: F.mse_loss(o, y) + 1e-7 * F.mse_loss(o, y) ** 2,  # 1e-6 off the mean's
    "plus the extreme": lambda o, y: F.mse_loss(o, y) + 0.1 * o.abs().amax(),
    # a mean in value, not in gradient: a scale read off the values (detached) multiplies the gradient
    "spread-scaled gradient": lambda o, y: F.mse_loss(
        o.detach() + (o - o.detach()) / (o.detach().std() + 0.1), y),
    # on a coarser grid (a shard at an odd offset pools other pairs), or over windows wider than a part
    "self-normalised": lambda o, y: F.mse_loss(o, y) / F.mse_loss(o, y).detach(),  # 1, gradient / value
    "pooled sum": lambda o, y: F.mse_loss(F.avg_pool3d(o, 2), F.avg_pool3d(y, 2), reduction="sum"),
    "windowed mean": lambda o, y: F.mse_loss(F.avg_pool3d(o, (3, 1, 1), stride=1),
                                             F.avg_pool3d(y, (3, 1, 1), stride=1)),
    "a zero term of the extreme": lambda o, y: F.mse_loss(o, y)
    + ((o - o.detach()) * o.detach().amax()).mean(),
    # class-index targets (N, D, H, W), as torch's segmentation losses take them
    "CE": F.cross_entropy,
    "CE sum": lambda o, y: F.cross_entropy(o, y, reduction="sum"),
    "weighted CE": lambda o, y: F.cross_entropy(o, y, weight=torch.tensor([0.2, 1.0, 3.0], dtype=o.dtype)),
}

S2, S4 = {"grid": {"spatial": [2, 1, 1]}}, {"grid": {"spatial": [2, 2, 1]}}
DS = {"grid": {"data": 2, "spatial": [2, 1, 1]}}
DSM = {"grid": {"data": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}  # one sample each
PIPE = {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2}}
PIPE4 = {"grid": {"pipe": 2}, "pipeline": {"microbatches": 4}}  # one sample each

# (world, model, loss, spec): trained exactly as one process
EXACT = [
    (2, "Plain", "mse", S2), (2, "Plain", "sum", S2), (2, "Plain", "TV along H", S2),
    (2, "Deep", "deep mean", S2), (2, "Head", "mse", S2), (2, "Head", "batch-normalised", S2),
    (2, "Plain", "sum", PIPE),
    (4, "Plain", "mse", S4), (4, "Plain", "sum", S4), (4, "Deep", "deep mean", S4),
    (4, "Plain", "mse", DS), (4, "Plain", "sum", DS), (4, "Plain", "sample sum", DS),
    (4, "Plain", "sum", DSM), (4, "Head", "mse", DS), (4, "Head", "sum", DSM),
    (2, "Classes", "CE", S2), (4, "Classes", "CE", S4), (4, "Classes", "CE sum", DSM),
    (2, "Classes", "CE sum", PIPE),
]
# (world, model, loss, spec): no mean or sum over the output's shards, evaluated on the whole output
# (gathered) and trained exactly as one process
WHOLE = [
    (2, "Plain", "masked mean", S2), (2, "Plain", "weighted l1", S2), (2, "Plain", "dice", S2),
    (2, "Plain", "pearson", S2),
    (2, "Plain", "TV along D", S2), (2, "Plain", "nearly a mean", S2), (4, "Plain", "TV along H", S4),
    (2, "Classes", "weighted CE", S2), (4, "Classes", "weighted CE", S4), (4, "Plain", "sample dice", DS),
    (4, "Plain", "sample dice", DSM), (4, "Deep", "deep dice", S4),
    (2, "Plain", "spread-scaled gradient", S2), (4, "Plain", "a zero term of the extreme", S4),
    (4, "Plain", "pooled sum", S4), (2, "Plain", "windowed mean", S2),
]
# (world, model, loss, spec, what the line says was cut): refused alike on every rank
REFUSED = [
    (2, "Plain", "dice", PIPE, "(samples)"),
    (2, "Plain", "plus the extreme", PIPE4, "a sample paired with its second half along D tiled"),
    (4, "Head", "batch-normalised", DS, "(samples)"),
    (4, "Head", "batch-normalised", DSM, "a sample taken twice"),
    (4, "Plain", "dice", DS, "(samples)"), (4, "Classes", "weighted CE", DSM, "a sample paired"),
    (4, "Plain", "spread-scaled gradient", DS, "its gradient differs from its value's"),
    (4, "Plain", "self-normalised", DSM, "its gradient differs from its value's: the loss's slope along a "
                                         "fixed direction, on a sample paired"),
]


def _id(world: int, model: str, loss: str, spec: dict) -> str:
    grid = "x".join(f"{k}{v}" for k, v in spec["grid"].items())
    pipeline = f"-{spec['pipeline']}" if "pipeline" in spec else ""
    return f"{world}-{model}-{loss}-{grid}{pipeline}".replace(" ", "")


def _data(model: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    if model == "Classes":  # class indices (N, D, H, W)
        return x, torch.randint(0, 3, (SHAPE[0], *SHAPE[2:]), generator=g)
    y = torch.randn((SHAPE[0], 4) if model == "Head" else (SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64,
                    generator=g)
    return x, y


def _engine(model: str, loss: str, spec: dict):
    import hybridpar as hp

    torch.manual_seed(0)
    ref = globals()[model]().double()
    mine = globals()[model]().double()
    mine.load_state_dict(ref.state_dict())
    return ref, mine, hp.parallelize(mine, spec, loss_fn=LOSSES[loss])


def _exact_body(rank: int, world: int, model: str, loss: str, spec: dict) -> None:
    fails, desc = Failures(), f"{model} {loss} {spec}"
    x, y = _data(model)
    ref, mine, engine = _engine(model, loss, spec)
    local = engine.shard_batch(x, y)
    opt = torch.optim.SGD(mine.parameters(), lr=0.02)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    steps_match(fails, desc, engine, opt, ref, ref_opt, local, (x, y), LOSSES[loss], steps=2)
    state = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        fails.check(f"{desc}: {k} after 2 steps", state[k].to(v.dtype), v, 1e-9)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,model,loss,spec", EXACT,
                         ids=[_id(*case) for case in EXACT])
def test_a_loss_that_splits_trains_as_one_process(pools, world, model, loss, spec):
    pools(world).run(_exact_body, model, loss, spec, timeout=300)


def _whole_body(rank: int, world: int, model: str, loss: str, spec: dict) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        _exact_body(rank, world, model, loss, spec)
    return [str(w.message) for w in said if "gathered on each of" in str(w.message)]


@pytest.mark.parametrize("world,model,loss,spec", WHOLE, ids=[_id(*case) for case in WHOLE])
def test_a_loss_that_does_not_split_over_the_shards_trains_on_the_gathered_output(pools, world, model, loss,
                                                                                  spec):
    """Dice, Pearson, a masked mean, a class-weighted cross entropy, differences across a split dim:
    the output and target gathered whole on the ranks that share them, two steps exactly as one
    process (the loss, every gradient, every weight); rank 0 says so once."""
    said = pools(world).run(_whole_body, model, loss, spec, timeout=300)
    assert len(said[0]) == 1 and all(not s for s in said[1:]), f"{model} {loss} {spec}: {said}"
    assert said[0][0].startswith("Engine.train_step: loss_fn ") and "MiB per rank" in said[0][0], said[0][0]


def _one_step(engine, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[str, bool]:
    """What one step said (its error, or "no error") and whether it left ``model``'s weights and
    gradients untouched."""
    weights = [p.detach().clone() for p in model.parameters()]
    try:
        engine.train_step(*engine.shard_batch(x, y))
    except ValueError as err:
        said = str(err)
    else:
        said = "no error"
    untouched = all(p.grad is None or not p.grad.any() for p in model.parameters()) and all(
        torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True))
    return said, untouched


def _refused_body(rank: int, world: int, model: str, loss: str, spec: dict) -> tuple[str, bool]:
    _, mine, engine = _engine(model, loss, spec)
    return _one_step(engine, mine, *_data(model))


@pytest.mark.parametrize("world,model,loss,spec,cut", REFUSED,
                         ids=[_id(*case[:4]) for case in REFUSED])
def test_a_loss_that_does_not_split_is_refused_alike_on_every_rank(pools, world, model, loss, spec, cut):
    said = pools(world).run(_refused_body, model, loss, spec, timeout=300)
    desc = f"{model} {loss} {spec}"
    lines = {s for s, _ in said}
    assert len(lines) == 1, f"{desc}: ranks said different things: {lines}"
    line = lines.pop()
    name = "_pearson" if loss == "pearson" else f"<lambda> ({__file__}:"
    assert line.startswith(f"Engine.train_step: loss_fn {name}") and "\n" not in line, f"{desc}: {line}"
    assert cut in line and "reduction 'mean' or 'sum'" in line, f"{desc}: {line}"
    assert all(ok for _, ok in said), f"{desc}: a gradient was applied or left before the refusal"


def Classes() -> nn.Module:  # noqa: N802 (named as the model it builds)
    return nn.Sequential(nn.Conv3d(1, 2, 3, padding=1), nn.Tanh(), nn.Conv3d(2, 3, 3, padding=1))


def _ignored(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y[:, 0], ignore_index=255)


def _weighted(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y[:, 0], weight=torch.tensor([0.2, 1.0, 3.0], dtype=o.dtype))


def _parts(o: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return F.mse_loss(o, y), {"mse": F.mse_loss(o, y).detach()}


# name: (model, loss, batch, the step refused (its batch the first with ignored voxels), what the line says;
# None: no refusal, the loss evaluated on the gathered output from that step on)
def _one_element(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(o, y).reshape(1, 1)  # a scalar kept in a (1, 1) tensor, summed over micro-batches


LATER = {
    "ignore_index from the 2nd batch": ("Classes", _ignored, 4, None, None),
    "ignore_index in one replica's 2nd batch": ("Classes", _ignored, 4, 1, "every replica's and micro-"),
    "weighted CE, one sample per replica": ("Classes", _weighted, 2, 0, "its first half along D tiled"),
    "tuple returned": ("Plain", _parts, 4, 0, "returned a tuple of 2 items; "),
    "one element": ("Plain", _one_element, 4, None, None),
}


def _later_body(rank: int, world: int, case: str, spec: dict) -> tuple[str, int, float]:
    """Two steps beside one process until the engine refuses: what it said, at which step, and how far
    the weights then are from one process's after the steps before (0: nothing applied)."""
    model, loss_fn, batch, refused_at, _ = LATER[case]
    g = torch.Generator().manual_seed(7)
    x = torch.randn((2, batch, *SHAPE[1:]), dtype=torch.float64, generator=g)
    if model == "Classes":
        y = torch.randint(0, 3, (2, batch, 1, *SHAPE[2:]), generator=g)
        if loss_fn is _ignored:
            y[1, batch // 2:, :, :2] = 255  # the first batch has none: a mean there
    else:
        y = torch.randn(x.shape, dtype=torch.float64, generator=g)
    import hybridpar as hp

    torch.manual_seed(0)
    ref = globals()[model]().double()
    mine = globals()[model]().double()
    mine.load_state_dict(ref.state_dict())
    engine = hp.parallelize(mine, spec, loss_fn=loss_fn)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.05) for m in (mine, ref))
    for step in range(2):
        opt.zero_grad()
        try:
            engine.train_step(*engine.shard_batch(x[step], y[step]))
        except ValueError as err:
            pairs = zip(mine.parameters(), ref.parameters(), strict=True)
            off = max((p - q).abs().max().item() for p, q in pairs)
            return str(err), step, off
        opt.step()
        ref_opt.zero_grad()
        loss_fn(ref(x[step]), y[step]).backward()
        ref_opt.step()
    return "no error", 2, max((p - q).abs().max().item() for p, q in zip(mine.parameters(), ref.parameters(),
                                                                         strict=True))


@pytest.mark.parametrize("world,case,spec", [
    (2, "ignore_index from the 2nd batch", S2),
    (4, "ignore_index in one replica's 2nd batch", DSM),
    (2, "weighted CE, one sample per replica", {"grid": {"data": 2}}),
    (2, "tuple returned", S2), (2, "tuple returned", PIPE), (4, "one element", DSM),
], ids=["ignore_index-later-spatial2", "ignore_index-later-data2xspatial2", "weighted_ce-data2",
        "tuple-spatial2", "tuple-pipe2", "one_element-data2xspatial2"])
def test_a_loss_is_checked_on_every_step_and_must_be_a_scalar(pools, world, case, spec):
    said = pools(world).run(_later_body, case, spec, timeout=60)  # a rank left waiting would time out
    desc, (_, _, _, step, part) = f"{case} {spec}", LATER[case]
    lines = {s for s, _, _ in said}
    assert len(lines) == 1, f"{desc}: ranks said different things: {lines}"
    line = lines.pop()
    if step is None:  # no mean over the shards from the 2nd step: the output gathered for it, exact
        assert line == "no error", f"{desc}: {line}"
        assert max(o for _, _, o in said) < 1e-9, f"{desc}: weights off one process's by {said}"
        return
    name = LATER[case][1].__name__
    assert line.startswith(f"Engine.train_step: loss_fn {name} ") and "\n" not in line, f"{desc}: {line}"
    assert part in line, f"{desc}: the line does not say {part!r}: {line}"
    steps, offs = [s for _, s, _ in said], [o for _, _, o in said]
    assert set(steps) == {step}, f"{desc}: refused at steps {steps}, not {step}"
    assert max(offs) < 1e-9, f"{desc}: weights off one process's after the steps before by {offs}"


def _recompute_body(rank: int, world: int, spec: dict) -> None:
    fails, desc = Failures(), f"recompute {spec}"
    x, y = _data("Stateful")
    ref, mine, engine = _engine("Stateful", "mse", spec)
    local = engine.shard_batch(x, y)
    engine.load_full_state_dict(ref.state_dict())  # the engine starts from the reference's buffers
    opt = torch.optim.SGD(mine.parameters(), lr=0.02)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.02)
    steps_match(fails, desc, engine, opt, ref, ref_opt, local, (x, y), F.mse_loss, steps=2)
    state = engine.full_state_dict()
    for k, v in ref.state_dict().items():  # steps, ema, BatchNorm's statistics and count, the weights
        fails.check(f"{desc}: {k} after 2 steps", state[k].to(v.dtype), v, 1e-9)
    engine.eval()
    ref.eval()
    with torch.no_grad():
        want = ref(x)
    fails.check(f"{desc}: prediction", tree_leaves(engine.predict(local[0]))[0], want)
    fails.raise_if_any(rank)


@pytest.mark.parametrize("world,spec", [
    (2, {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"recompute": True}}),
    (4, {"grid": {"spatial": [2, 2, 1]}, "pipeline": {"recompute": True}}),
], ids=["2-spatial", "4-spatial_2x2"])
def test_recomputation_leaves_buffers_as_one_process(pools, world, spec):
    pools(world).run(_recompute_body, spec, timeout=300)


def _roi(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A masked mean over a region of interest (where the target is positive)."""
    m = (y > 0).to(o.dtype)
    return ((o - y) ** 2 * m).sum() / m.sum().clamp(min=1)


def _class_roi(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross entropy averaged over the voxels of one class (of class indices, N, D, H, W)."""
    m = (y == 2).to(o.dtype)
    return (F.cross_entropy(o, y, reduction="none") * m).sum() / m.sum().clamp(min=1)


def _head_weighted(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(o, y, weight=torch.tensor([0.2, 1.0, 3.0, 0.5], dtype=o.dtype))


MB2 = {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}
# name: (world, model, loss, spec, what the line says): a loss normalised by what differs between ranks,
# replicas or micro-batches, and alike within each rank's halves
ACROSS = {
    "ROI on one rank's shard": (2, "Plain", _roi, S2, "every output shard taken together"),
    "ROI on one rank's shard, 3 ranks": (3, "Plain", _roi, {"grid": {"spatial": [3, 1, 1]}},
                                         "every output shard taken together"),
    "ROI on one rank's shard, float32": (2, "Plain", _roi, S2, "every output shard taken together"),
    "ROI in one replica's samples": (4, "Plain", _roi, DS, "combines sums or means of the samples' values"),
    "class-index ROI on one rank's shard": (2, "Classes", _class_roi, S2,
                                            "every output shard taken together"),
    "ignore_index in the 2nd micro-batch": (2, "Classes", _ignored, MB2,
                                            "a selection of the samples' values"),
    "weighted CE head, one sample per replica": (2, "Head", _head_weighted, {"grid": {"data": 2}},
                                                 "combines sums or means of the samples' values"),
}


def _across_target(model: str, batch: int) -> torch.Tensor:
    """The targets of :data:`ACROSS`: alike within each rank's halves, unlike between ranks."""
    g = torch.Generator().manual_seed(7)
    if model == "Head":
        return torch.tensor([0, 2, 1, 3][:batch])
    if model == "Classes":
        y = torch.randint(0, 3, (batch, 1, *SHAPE[2:]), generator=g)
        y[batch // 2:] = 255  # the second micro-batch ignored whole
        return y
    y = torch.rand((batch, 1, *SHAPE[2:]), dtype=torch.float64, generator=g) + 0.5
    y[:, :, SHAPE[2] // 2:] *= -1  # outside the region: the second half along D
    return y


def _across_body(rank: int, world: int, case: str) -> tuple[str, bool, float]:
    """What one step said, whether it left the weights and gradients untouched, and how far its
    gradients are from one process's."""

    _, model, loss_fn, spec, _ = ACROSS[case]
    batch = 2 if model == "Head" else 4
    x = torch.randn((batch, *SHAPE[1:]), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = _across_target(model, batch)
    if case == "ROI in one replica's samples":
        y = y.abs()
        y[batch // 2:] *= -1
    if case == "class-index ROI on one rank's shard":  # the class on rank 0's half only, every voxel of it
        y = torch.randint(0, 2, (batch, *SHAPE[2:]), generator=torch.Generator().manual_seed(7))
        y[:, :SHAPE[2] // 2] = 2
    torch.manual_seed(0)
    mine = globals()[model]().double()
    if case.endswith("float32"):  # the pieces are compared in float64 whatever the model's dtype
        mine, x, y = mine.float(), x.float(), y.float()
    ref = globals()[model]().to(next(mine.parameters()).dtype)
    return _against_one_process(mine, ref, spec, loss_fn, x, y)


def _against_one_process(mine: nn.Module, ref: nn.Module, spec: dict, loss_fn, x: torch.Tensor,
                         y: torch.Tensor) -> tuple[str, bool, float]:
    """One step of ``mine`` parallelized by ``spec`` (what it said, whether it left the model untouched)
    and how far its gradients are from ``ref``'s (a copy) in one process."""
    import hybridpar as hp

    ref.load_state_dict(mine.state_dict())
    said, untouched = _one_step(hp.parallelize(mine, spec, loss_fn=loss_fn), mine, x, y)
    loss_fn(ref(x), y).backward()
    off = max(math.inf if p.grad is None else (p.grad - q.grad).abs().max().item()
              for p, q in zip(mine.parameters(), ref.parameters(), strict=True))
    return said, untouched, off


@pytest.mark.parametrize("case", list(ACROSS), ids=[c.replace(" ", "_") for c in ACROSS])
def test_a_loss_normalised_by_what_differs_between_ranks_is_found(pools, case):
    """Each rank's halves agree (the ROI or the ignored samples lie whole on one side of a rank's cut),
    the ranks, replicas or micro-batches do not: on one process the loss is not the engine's combination
    (0.5x the gradient for the ROI on two ranks). Across the output's shards: the loss evaluated on the
    gathered output, the gradients one process's; across replicas or micro-batches: refused alike on
    every rank, nothing applied."""
    world, *_, part = ACROSS[case]
    said = pools(world).run(_across_body, case, timeout=60)
    lines = {s for s, _, _ in said}
    assert len(lines) == 1, f"{case}: ranks said different things: {lines}"
    line = lines.pop()
    if part == "every output shard taken together":
        tol = 1e-5 if case.endswith("float32") else 1e-12
        assert line == "no error" and max(o for _, _, o in said) < tol, f"{case}: {line}, {said}"
        return
    assert line.startswith("Engine.train_step: loss_fn ") and "\n" not in line, f"{case}: {line}"
    assert part in line, f"{case}: the line does not say {part!r}: {line}"
    assert all(ok for _, ok, _ in said), f"{case}: a gradient was applied or left before the refusal"


def test_a_loss_that_raises_on_a_part_fits_no_combination_of_them():
    """A window wider than a part (SSIM, a local correlation) raises there: that is no mean or sum of
    the parts, so the loss is evaluated on the gathered output, never assumed to split."""
    from hybridpar.pipeline.loss_check import probe, rtol_of

    g = torch.Generator().manual_seed(0)
    o, y = (torch.randn((1, 1, 6, 4, 4), dtype=torch.float64, generator=g) for _ in range(2))

    def windowed(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(F.avg_pool3d(o, (5, 1, 1), stride=1), F.avg_pool3d(y, (5, 1, 1), stride=1))

    found = probe(windowed, o, y, float(windowed(o, y)), 2, lambda t: t.dim() == 5, 6)
    assert found.fits(rtol_of(torch.float64)) == (False, False), found


def _sampled(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE over 50 voxels drawn at random: no mean over the shards, and its draw one process's alone."""
    idx = torch.randperm(o.numel())[:50]
    return ((o.flatten() - y.flatten())[idx] ** 2).mean()


def _sampled_body(rank: int, world: int) -> None:
    fails = Failures()
    x, y = _data("Plain")
    torch.manual_seed(0)
    ref = Plain().double()
    mine = Plain().double()
    mine.load_state_dict(ref.state_dict())
    import hybridpar as hp

    engine = hp.parallelize(mine, S2, loss_fn=_sampled)
    local = engine.shard_batch(x, y)
    opt, ref_opt = torch.optim.SGD(mine.parameters(), lr=0.02), torch.optim.SGD(ref.parameters(), lr=0.02)
    for step in range(2):
        for model, o in ((mine, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.manual_seed(10 + step)  # each side draws from one state
            loss = engine.train_step(*local) if model is mine else _sampled(ref(x), y)
            if model is ref:
                loss.backward()
            o.step()
            if model is mine:
                got = loss.detach()
        fails.check(f"sampled loss, step {step}", got.reshape(()), loss.detach())
    state = engine.full_state_dict()
    for k, v in ref.state_dict().items():
        fails.check(f"sampled loss: {k} after 2 steps", state[k], v, 1e-9)
    fails.raise_if_any(rank)


def test_a_loss_that_draws_random_numbers_draws_what_one_process_draws(pools):
    """Evaluated on the gathered output (it is no mean over the shards), a loss that samples voxels
    draws from the generator state the step's loss drew from, and the check's evaluations and the
    engine's build draw nothing from the user's stream: the losses and weights are one process's
    (the build's layers drew their initial weights, the check's parts their own voxels: 0.39 off)."""
    pools(2).run(_sampled_body, timeout=300)


BIG = (2, 1, 24, 20, 20)  # shards wider than the pieces the value checks read (loss_across.CAP voxels a dim)


def _blind_target(case: str) -> torch.Tensor:
    """A target whose normaliser differs only at voxels no check on values reads: positive (in the
    region of interest) at every H the pieces read on rank 0's half (or the first sample) and at every H
    on the other; for the extreme, its largest value on rank 0's half, in both parts a check within the
    rank cuts it into, at an H no piece reads (where they read, the largest is alike on every part)."""
    from hybridpar.pipeline.loss_across import _positions

    g = torch.Generator().manual_seed(7)
    y = torch.rand(BIG, dtype=torch.float64, generator=g) + 0.5
    read = _positions(BIG[3], 8, y.device)
    unread = [h for h in range(BIG[3]) if h not in read.tolist()]
    if case == "extreme":
        y[:, 0, [0, 11, 12, 23], 0, 0] = 2.0  # what the pieces and every part read: alike on both ranks
        y[:, 0, [2, 9], unread[0], 3] = 40.0
        return y
    blind = y[:1] if case == "replicas" else y[:, :, :BIG[2] // 2]
    blind[..., unread, :] *= -1
    return y


BLIND = {  # case: (world, loss, spec, what one step does)
    "shards": (2, _roi, S2, "whole"),
    "replicas": (4, _roi, DS, "refused"),
    "extreme": (2, lambda o, y: F.mse_loss(o, y) / y.abs().amax(), S2, "whole"),
}


def _blind_body(rank: int, world: int, case: str) -> tuple[str, bool, float]:

    _, loss_fn, spec, _ = BLIND[case]
    x = torch.randn(BIG, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = _blind_target(case)
    torch.manual_seed(0)
    return _against_one_process(Plain().double(), Plain().double(), spec, loss_fn, x, y)


@pytest.mark.parametrize("case", list(BLIND))
def test_a_normaliser_that_differs_only_where_no_value_check_reads_is_found(pools, case):
    """A masked mean whose mask differs between the ranks' shards, or between replicas' samples, only
    at voxels the checks on values do not read, and a loss scaled by the target's extreme lying there:
    no value check tells them from a mean (they trained 0.24-0.27 off, the loss 1.5x); by what they
    compute (a ratio, an extreme) they are no mean. Over the shards: evaluated on the gathered output,
    one process's gradients; over replicas and micro-batches: refused alike, nothing applied."""
    world, _, _, expected = BLIND[case]
    said = pools(world).run(_blind_body, case, timeout=120)
    lines = {s for s, _, _ in said}
    assert len(lines) == 1, f"{case}: ranks said different things: {lines}"
    line = lines.pop()
    if expected == "whole":
        assert line == "no error" and max(o for _, _, o in said) < 1e-12, f"{case}: {line}, {said}"
        return
    assert line.startswith("Engine.train_step: loss_fn _roi") and "by what it computes" in line, line
    assert all(ok for _, ok, _ in said), f"{case}: a gradient was applied or left before the refusal"
