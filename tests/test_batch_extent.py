"""The batch's extent read in a forward whose batch data parallelism or micro-batches split
(:mod:`hybridpar.planner.batch_extent`): each part reads its own. Sizing a tensor along the batch with it
(``h.view(x.size(0), -1)``, a class token's ``expand(n, -1, -1)``) is what one process does, planned;
read as a value (``out / x.shape[0]``, ``torch.arange(n)``) it gave each sample its part's answer,
silently, and is refused before any step, naming the call and its line, in a traced graph and in a
forward run by module swapping alike (at the top level and in a block), as is a reshape that gives
dim 0 the whole batch's size as a number (``h.reshape(4, -1)``: rows of half samples on a part), and
a sum or scan along a tensor sized with it (``torch.ones(n).sum()``). Python control flow on it (a loop
over ``range(x.shape[0])``, a branch) or a number Python makes of it (``min(n, 3)``, ``math.log(n)``)
runs another program on a part: refused, naming the first call that differs."""

from __future__ import annotations

import array
import fractions
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hybridpar as hp
from hybridpar.planner.batch_extent import PartBatch, PartBatchFloat, misuse, part_kind
from hybridpar.planner.terms import SpecError

SHAPE = (4, 1, 8, 6, 6)
SPLITS = {"data": {"grid": {"data": 2}},
          "micro": {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}},
          "data_x_spatial": {"grid": {"data": 2, "spatial": [2, 1, 1]}}}
WORLD = {"data": 2, "micro": 2, "data_x_spatial": 4}


def _use(what: str, x: torch.Tensor, h: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """``h`` (N, 2, D, H, W) with the batch's extent of ``x`` used as ``what`` says (``m``: the model, its
    two spare layers ``c1``, ``c2``)."""
    n = x.shape[0]
    if what == "divided by the batch's extent":
        return h / x.shape[0]
    if what == "sample indices":
        return h + torch.arange(x.size(0), dtype=h.dtype).view(-1, 1, 1, 1, 1)
    if what == "a ramp over the batch":
        return h * torch.linspace(0, 1, n, dtype=h.dtype).view(-1, 1, 1, 1, 1)
    if what == "the extent doubled, as a value":
        return h * (n * 2)
    if what == "a mean by the number of elements":
        return h - h.sum((1, 2, 3, 4), keepdim=True) / h.numel()
    if what == "flattened by the batch's extent":
        return h.view(x.size(0), -1).tanh().view(h.shape)
    if what == "zeros beside each sample":
        return torch.cat([h, h.new_zeros(n, 1, *h.shape[2:])], 1)[:, :2]
    if what == "a token for each sample":
        return h + torch.ones(1, 2, 1, 1, 1, dtype=h.dtype).expand(x.shape[0], -1, -1, -1, -1)
    if what == "voxels per sample":  # the batch's extent divided out: one process's count
        return h * (x.numel() / (x.size(0) * 1000))
    if what == "zeros of the input's shape":
        return h + torch.zeros(x.shape, dtype=h.dtype)
    if what == "a loop over the samples' places":  # range makes plain ints: no tag follows them
        places = torch.stack([torch.tensor(float(i + 1), dtype=h.dtype) for i in range(n)])
        return h * places.view(-1, 1, 1, 1, 1)
    if what == "a loop in a helper, given an int":
        return h * _places(int(x.shape[0]), h.dtype)
    if what == "a branch on the batch's extent":
        return h * 2 if x.shape[0] > 2 else h
    if what == "a loop over the channels":
        return torch.cat([h[:, c:c + 1] * (c + 1) for c in range(h.shape[1])], 1)
    if what == "a branch on a spatial extent":
        return h * 2 if x.shape[3] > 2 else h
    if what == "a number chosen by the batch's extent":  # the same calls, given other numbers
        return h * (2.0 if x.shape[0] == 4 else 1.0)
    if what == "the extent through int and min":
        return h / min(int(x.shape[0]), 3)
    if what == "the extent through math":
        return h * math.log(x.shape[0])
    if what == "a layer chosen by the batch's extent":  # the same calls, given another layer's weights
        return (m.c1 if x.shape[0] > 2 else m.c2)(h)
    if what == "a value chosen by the batch's extent":  # the same calls, given another value
        a, b = torch.tanh(h), torch.sigmoid(h)
        return a if x.shape[0] > 2 else b
    if what == "ones along the batch, summed":  # the part's extent again, as a value
        return h / torch.ones(x.shape[0], dtype=h.dtype).sum()
    if what == "ones along an int of the extent, summed":  # int() drops the tag: batch_flow sees the size
        return h / torch.ones(int(x.shape[0]), dtype=h.dtype).sum()
    if what == "a fill along an int of the extent, softmaxed":
        return h * torch.full((int(x.size(0)), 1), 2.0, dtype=h.dtype).softmax(0).view(-1, 1, 1, 1, 1)
    if what == "sample places made by NumPy":  # an array: compared by its content, not its type
        return h * torch.as_tensor(np.arange(x.shape[0]), dtype=h.dtype).view(-1, 1, 1, 1, 1)
    if what == "sample places from a range":
        return h * torch.tensor(range(x.shape[0]), dtype=h.dtype).view(-1, 1, 1, 1, 1)
    if what == "ones along the batch from an array":
        return h / torch.tensor(array.array("d", [1.0] * x.shape[0]), dtype=h.dtype).sum()
    if what == "a fraction of the extent":  # a number of another class, compared by its value
        return h * h.new_tensor([fractions.Fraction(int(x.shape[0]), 4)])
    if what == "noise from a generator seeded with the extent":  # compared by the generator's state
        return h + torch.rand(2, 1, 1, 1, generator=torch.Generator().manual_seed(int(x.shape[0])))
    if what == "noise after the global generator is seeded with the extent":
        torch.manual_seed(int(x.shape[0]))
        return h + torch.rand(2, 1, 1, 1)
    if what == "noise from a generator seeded with a constant":
        return h + torch.rand(2, 1, 1, 1, dtype=h.dtype, generator=torch.Generator().manual_seed(4))
    if what == "a weight's gradient scaled by the extent":  # a hook's closure, compared by what it holds
        n, w = x.shape[0], m.c1.weight * 1
        if w.requires_grad:  # (a traced parent's shape run has none)
            w.register_hook(lambda g: g * n / 4)
        return F.conv3d(h, w, m.c1.bias)
    if what == "a weight's gradient scaled by a constant":
        w = m.c1.weight * 1
        if w.requires_grad:
            w.register_hook(lambda g: g * 0.5)
        return F.conv3d(h, w, m.c1.bias)
    if what == "a Function given the extent":  # recorded with what it is given
        return F.conv3d(h, _Scaled.apply(m.c1.weight, float(x.shape[0]) / 4), m.c1.bias)
    if what == "a torch layer bounded by the extent":  # its settings recorded, not its calls' numbers
        k = int(x.shape[0]) / 8
        return nn.Hardtanh(-k, k)(h)
    if what == "ones along the batch, scanned":  # each sample's place in its part
        return h * torch.ones(x.shape[0], 1, dtype=h.dtype).cumsum(0).view(-1, 1, 1, 1, 1)
    if what == "rows of a batch of 4, as a number":  # a part of 2: rows of half samples, softmaxed
        return torch.softmax(h.reshape(4, -1), -1).reshape(h.shape)
    if what == "rows of a batch of 4, viewed":
        return h - h.view(4, -1).mean(1).view(-1, 1, 1, 1, 1)
    if what == "rows of each sample by -1":
        return torch.softmax(h.reshape(-1, 2 * 8 * 6 * 6), -1).reshape(h.shape)
    if what == "a sample's voxels":  # a sample picked for its shape: every part's is one process's
        return h * (h[0].numel() / 1000) + h[-1, 0].shape[-1]
    if what == "zeros like a sample":  # its shape and dtype alone
        return h + torch.zeros_like(h[0]) + torch.full_like(h[-1], 0.5)
    if what == "a sample's values":
        return h * h[0].mean()
    if what == "a sample through a layer":
        return h + m.c1(h[-1:]).mean()
    if what == "a sample's shape, then its values":
        first = h[0]
        return h * first.numel() + first.amax()
    raise AssertionError(what)


class _Scaled(torch.autograd.Function):
    """Identity forward; backward scaled by ``s`` (from ``ctx``, which the forward's calls never show)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, s: float) -> torch.Tensor:  # noqa: ANN001 (torch's signature)
        ctx.s = s
        return w.clone()

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return g * ctx.s, None


def _places(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.cat([torch.full((1, 1, 1, 1, 1), i, dtype=dtype) for i in range(n)])


REFUSED = ["divided by the batch's extent", "sample indices", "a ramp over the batch",
           "the extent doubled, as a value", "a mean by the number of elements"]
PLANNED = ["flattened by the batch's extent", "rows of each sample by -1", "zeros beside each sample",
           "a token for each sample", "zeros of the input's shape", "voxels per sample",
           "a loop over the channels", "a branch on a spatial extent", "a sample's voxels",
           "noise from a generator seeded with a constant", "zeros like a sample"]
BACKWARD = ["a weight's gradient scaled by the extent", "a weight's gradient scaled by a constant",
            "a Function given the extent"]
"""Code the backward runs on a weight's gradient, which each part computes over its own samples: a
gradient hook or a Function of the user's sees the part's sum, which a clamp or a norm reads as one
process never does (and a closure can carry the part's extent there)."""
PICKED = ["a sample's values", "a sample through a layer", "a sample's shape, then its values"]
"""A sample picked off a batch in parts: its shape alike on every part (planned), its values not."""
FIXED = ["rows of a batch of 4, as a number", "rows of a batch of 4, viewed"]
"""A reshape that gives dim 0 the whole batch's number of samples: on a part of 2 its rows are half
samples, which a softmax or a mean along them reads as no process does (no error: the sizes divide)."""
FLOW = ["a loop over the samples' places", "a loop in a helper, given an int",
        "a branch on the batch's extent", "a number chosen by the batch's extent",
        "the extent through int and min", "the extent through math", "a layer chosen by the batch's extent",
        "a value chosen by the batch's extent", "ones along an int of the extent, summed",
        "a fill along an int of the extent, softmaxed", "sample places made by NumPy",
        "sample places from a range", "ones along the batch from an array", "a fraction of the extent",
        "noise from a generator seeded with the extent", "noise after the global generator is seeded with "
        "the extent", "a torch layer bounded by the extent"]
ALONG = ["ones along the batch, summed", "ones along the batch, scanned"]
"""A tensor sized along the batch with its extent holds a part's samples there: a sum or a scan along it
reads the part."""
"""Python control flow on the batch's extent (:mod:`hybridpar.planner.batch_flow`): torch.fx cannot
trace it, so each model runs by module swapping."""


class Traced(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        self.a, self.b = nn.Conv3d(1, 2, 3, padding=1), nn.Conv3d(2, 1, 1)
        self.c1, self.c2 = nn.Conv3d(2, 2, 1), nn.Conv3d(2, 2, 1)
        self.what = what

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_use(self.what, x, torch.tanh(self.a(x)), self))


class Swapped(Traced):
    """The same with a branch on an extent, which torch.fx cannot trace: run by module swapping."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if x.shape[2] > 4:
            h = _use(self.what, x, h, self)
        return self.b(h)


class InBlock(nn.Module):
    """A traced model around the untraceable forward (run by module swapping inside the block)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.stem, self.block = nn.Conv3d(1, 1, 1), Swapped(what)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(torch.relu(self.stem(x)))


MODELS = {"traced": Traced, "swapped": Swapped, "in_block": InBlock}


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("what", REFUSED)
def test_the_batch_extent_read_as_a_value_is_refused(what, model, split):
    spec = hp.ParallelSpec.from_dict(SPLITS[split])
    with pytest.raises(SpecError, match=r"reads the batch's extent.* as a value.* at test_batch_extent.py:"):
        spec.plan(MODELS[model](what), SHAPE, WORLD[split])


def _refused_on_parts(what: str, model: str, split: str, match: str) -> None:
    """Refused where the batch is held in parts (one line matching ``match``); planned where a spatial
    split holds it whole."""
    spec = hp.ParallelSpec.from_dict(SPLITS[split])
    with pytest.raises(SpecError, match=match):
        spec.plan(MODELS[model](what), SHAPE, WORLD[split])
    assert hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(MODELS[model](what), SHAPE, 2)


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", ["swapped", "in_block"])
@pytest.mark.parametrize("what", ALONG)
def test_a_tensor_sized_along_the_batch_is_judged_per_sample(what, model, split):
    _refused_on_parts(what, model, split, r"(sum \(over|cumsum \(along) the samples' dim\).* at test_batch")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("what", FIXED)
def test_a_reshape_giving_the_batch_a_number_is_refused(what, model, split):
    _refused_on_parts(what, model, split, r"(reshape|view) \(gives the batch's dim a size of its own, 4, "
                                          r".*write -1 or x.shape\[0\] there\).* at test_batch_extent.py:")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", ["swapped", "in_block"])
@pytest.mark.parametrize("what", FLOW)
def test_control_flow_on_the_batch_extent_is_refused(what, model, split):
    """A part runs another program than one process: the first call that differs is named."""
    _refused_on_parts(what, model, split, r"runs other calls on a part of the batch than on the whole.*on 4 "
                                          r"samples .* at test_batch_extent.py:\d+, on 2 ")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("what", PICKED)
def test_a_sample_picked_for_its_values_is_refused(what, model, split):
    _refused_on_parts(what, model, split, r"(indexing \(picks among the samples\)|__getitem__ \(across the "
                                          r"samples of the batch).* at test_batch_extent.py:\d+")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", ["swapped", "in_block"])
@pytest.mark.parametrize("what", BACKWARD)
def test_backward_code_on_a_weight_is_refused(what, model, split):
    _refused_on_parts(what, model, split, r"(register_hook \(on a value whose gradient|_Scaled.apply \(an "
                                          r"autograd.Function of the model's own on values whose gradient) "
                                          r"data parallelism or micro-batches compute in parts.* at test_")


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("what", PLANNED)
def test_the_batch_extent_sizing_a_tensor_is_planned(what, model, split):
    assert hp.ParallelSpec.from_dict(SPLITS[split]).plan(MODELS[model](what), SHAPE, WORLD[split])


@pytest.mark.parametrize("what", REFUSED)
def test_without_a_split_batch_every_use_is_planned(what):
    """The batch whole on every rank: each reads one process's extent."""
    assert hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(Swapped(what), SHAPE, 2)


def test_len_of_a_batch_in_parts_is_refused():
    """Python's ``len`` makes a plain int of the part's extent, whose uses cannot be followed."""
    class Len(Traced):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(x)).view(len(x), -1).view(len(x), 2, *x.shape[2:]))

    with pytest.raises(SpecError, match=r"len \(of a tensor holding the batch.*\) at test_batch_extent.py"):
        hp.ParallelSpec.from_dict({"grid": {"data": 2}}).plan(Len("len"), SHAPE, 2)


def test_misuse_tells_a_size_from_a_value():
    n = PartBatch(4)
    assert isinstance(n * 2, PartBatch) and isinstance(1 / n, PartBatchFloat) and isinstance(-n, PartBatch)
    shape = torch.Size((n, 3))
    for name, args in [("view", (None, n, -1)), ("view", (None, shape)), ("zeros", (n, 4)),
                       ("zeros", (shape,)), ("new_full", (None, (n, 2), 0.5)), ("full", ((n, 2), 1.0)),
                       ("repeat", (None, n, 1))]:
        assert misuse(name, args, {}, part_kind) is None, name
    for name, args in [("arange", (n,)), ("__truediv__", (None, n)), ("view", (None, 2, n)),
                       ("new_full", (None, (n, 2), n)), ("mul", (None, 1 / n))]:
        assert misuse(name, args, {}, part_kind), name


class _PooledNorm(nn.Module):
    """A BatchNorm on a map pooled to 1x1x1 (a squeeze-excitation's gate): one value per channel on a
    part of one sample. ``check``: behind a shape check (run by module swapping)."""

    def __init__(self, check: bool) -> None:
        super().__init__()
        self.check = check
        self.c1, self.bn1 = nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm3d(2)
        self.c2, self.bn2 = nn.Conv3d(2, 2, 1), nn.BatchNorm3d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.check and x.shape[1] != 1:
            raise ValueError("one channel in")
        h = torch.relu(self.bn1(self.c1(x)))
        return h * torch.sigmoid(self.bn2(self.c2(nn.functional.adaptive_avg_pool3d(h, 1))))


@pytest.mark.parametrize("check", [False, True], ids=["traced", "swapped"])
def test_a_batch_norm_with_one_value_per_channel_on_a_part_is_refused(check):
    """Training would fail inside the forward on every replica of one sample, after the norms before it
    moved their statistics: refused before any step, naming it; planned on parts of two samples, and in
    eval mode (running statistics)."""
    spec = hp.ParallelSpec.from_dict({"grid": {"data": 2}})
    with pytest.raises(SpecError, match=r"BatchNorm3d \(one value per channel on each part of 1 sample "
                                        r"the batch is held in, its input \[2, 2, 1, 1, 1\].* at "
                                        r"test_batch_extent.py:\d+"):
        spec.plan(_PooledNorm(check), (2, 1, 6, 6, 6), 2)
    assert spec.plan(_PooledNorm(check), (4, 1, 6, 6, 6), 2)
    assert spec.plan(_PooledNorm(check).eval(), (2, 1, 6, 6, 6), 2)


def _smaller_batch_body(rank: int, world: int) -> None:
    """An engine built on parts of 2 samples, then given a batch whose parts hold 1: the step is refused
    before the forward, the norms' statistics as they were."""
    torch.manual_seed(0)
    model = _PooledNorm(False).double()
    engine = hp.parallelize(model, {"grid": {"data": 2}}, loss_fn=nn.functional.mse_loss)
    x, y = torch.randn(4, 1, 6, 6, 6, dtype=torch.float64), torch.randn(4, 2, 6, 6, 6, dtype=torch.float64)
    engine.train_step(*engine.shard_batch(x, y))
    before = model.bn1.running_var.clone()
    with pytest.raises(ValueError, match=r"Engine.train_step: bn2: BatchNorm3d \(one value per channel on "
                                         r"each part of 1 sample"):
        engine.train_step(*engine.shard_batch(x[:2], y[:2]))
    assert torch.equal(model.bn1.running_var, before), "a refused step moved bn1's statistics"


def test_a_batch_norm_with_one_value_per_channel_at_a_smaller_batch_is_refused_at_the_step(pools):
    pools(2).run(_smaller_batch_body, timeout=120)


def test_a_batch_norm_on_folded_rows_counts_each_samples_rows():
    """A BatchNorm1d on the rows of a fold (N * D, C) sees D values per channel on a part of one sample."""

    class Folded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.c, self.bn = nn.Conv3d(1, 2, 3, padding=1), nn.BatchNorm1d(2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = nn.functional.adaptive_avg_pool3d(self.c(x), (None, 1, 1)).flatten(2)  # (N, C, D)
            n, c, d = h.shape
            return self.bn(h.permute(0, 2, 1).reshape(n * d, c)).reshape(n, d, c).permute(0, 2, 1)

    assert hp.ParallelSpec.from_dict({"grid": {"data": 2}}).plan(Folded(), (2, 1, 6, 6, 6), 2)
