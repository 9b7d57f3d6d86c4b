"""The form of a loss's computation along the dims the engine cuts (hybridpar.pipeline.loss_form), in
one process: what it says of losses as users write them, and that what it calls a mean or a sum is one.

Each loss is followed on an output and target cut along D and H (roles 1, 2) and along the samples
(role 0): its verdict per axis is a mean, a sum, nothing (the checks on values tell: the loss read the
batch's count) or the reason it is no combination of its parts. Every mean or sum it finds is checked
against the numbers: the loss of the whole equals its parts' (four spatial parts of unequal size, two
samples) combined as the engine combines them, the gradient too.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hybridpar.pipeline import form_algebra as fa
from hybridpar.pipeline.loss_check import FORM
from hybridpar.pipeline.loss_form import LossForm


def _dice(o: torch.Tensor, y: torch.Tensor, dims: tuple[int, ...] | None) -> torch.Tensor:
    p, t = torch.sigmoid(o), (y > 0).to(o.dtype)
    total = (lambda v: v.sum()) if dims is None else (lambda v: v.sum(dims))
    return 1 - (2 * total(p * t) + 1) / (total(p) + total(t) + 1)


def _terms(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.zeros(2, dtype=o.dtype)
    z[0] = F.mse_loss(o, y, reduction="sum")
    z[1] = F.l1_loss(o, y, reduction="sum")
    return z.sum()


def _written_through_a_view(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    e = ((o - y) ** 2).clone()
    e[:, :, 0].zero_()  # the part's first plane, not the whole's
    return e.mean()


def _a_zero_written_through_a_view(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.zeros(2, dtype=o.dtype)
    z[0:1].fill_(3.0)  # no longer zeros: 3 added to the sum on every part
    return (F.mse_loss(o, y, reduction="sum") + z).sum()


def _masked_mean(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    m = (y > 0).to(o.dtype)
    return ((o - y) ** 2 * m).sum() / m.sum().clamp(min=1.0)


with warnings.catch_warnings():  # TorchScript is deprecated; users' code still has it
    warnings.simplefilter("ignore", DeprecationWarning)
    _scripted = torch.jit.script(_masked_mean)  # runs no torch function a mode sees


def _count_through_data(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = torch.zeros((), dtype=o.dtype)
    z.data = (y > 0).sum().to(o.dtype)
    return ((o - y) ** 2 * (y > 0)).sum() / z.clamp(min=1)


def _zeroed_through_detach(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = y.clone()
    t.detach()[:, :, 0] = 0  # the part's first plane
    return F.mse_loss(o, t)


def _count_into_a_view(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    buf = torch.zeros(2, dtype=o.dtype)
    with torch.no_grad():
        torch.sum((y > 0).to(o.dtype), dim=(0, 1, 2, 3, 4), out=buf[0])
    return ((o - y) ** 2 * (y > 0)).sum() / buf.sum().clamp(min=1)


def _ignore_cleared(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = torch.where(y == 0, 255, y)
    loss = F.cross_entropy(o, t, ignore_index=255)
    t.data[t.data == 255] = 0
    return loss


def _per_sample_loop(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return sum(F.mse_loss(a, b) for a, b in zip(o, y, strict=True)) / len(o)


def _accumulated(o: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=o.dtype)
    total += F.mse_loss(o, y)
    total += 0.5 * F.l1_loss(o, y)
    return total


R = fa  # reason codes
# name: (loss, target: volume or classes, along the shards, along the samples)
CASES = {
    "mse": (F.mse_loss, "volume", "mean", "mean"),
    "sum": (lambda o, y: F.mse_loss(o, y, reduction="sum"), "volume", "sum", "sum"),
    "per-sample sum": (lambda o, y: ((o - y) ** 2).sum(dim=(1, 2, 3, 4)).mean(), "volume", "sum", "mean"),
    "terms": (lambda o, y: F.mse_loss(o, y) + 0.1 * F.smooth_l1_loss(o, y), "volume", "mean", "mean"),
    "terms written into a tensor": (_terms, "volume", "sum", "sum"),
    "terms accumulated in place": (_accumulated, "volume", "mean", "mean"),
    "a zero written through a view": (_a_zero_written_through_a_view, "volume", R.OFFSET, R.OFFSET),
    "python sum": (lambda o, y: sum([F.mse_loss(o, y, reduction="sum"), (o - y).abs().sum()]), "volume",
                   "sum", "sum"),
    "mean plus a constant": (lambda o, y: F.mse_loss(o, y) + 1.0, "volume", "mean", "mean"),
    "sum plus a constant": (lambda o, y: F.mse_loss(o, y, reduction="sum") + 1.0, "volume", R.OFFSET,
                            R.OFFSET),
    "flattened per sample": (lambda o, y: ((o - y) ** 2).view(o.size(0), -1).mean(1).mean(), "volume",
                             "mean", "values"),
    "channels last": (lambda o, y: ((o - y) ** 2).permute(0, 2, 3, 4, 1).mean(), "volume", "mean", "mean"),
    "a mask's sum": (lambda o, y: ((o - y) ** 2)[y > 0].sum(), "volume", "sum", "sum"),
    "a mask's mean": (lambda o, y: ((o - y) ** 2)[y > 0].mean(), "volume", R.SELECTION, R.SELECTION),
    "masked mean": (lambda o, y: ((o - y) ** 2 * (y > 0)).sum() / (y > 0).sum(), "volume", R.RATIO, R.RATIO),
    "dice": (lambda o, y: _dice(o, y, None), "volume", R.OFFSET, R.OFFSET),
    "per-sample dice": (lambda o, y: _dice(o, y, (1, 2, 3, 4)).mean(), "volume", R.OFFSET, "mean"),
    "by the target's extreme": (lambda o, y: F.mse_loss(o, y) / y.abs().amax(), "volume", R.EXTREME,
                                R.EXTREME),
    "self-normalised": (lambda o, y: F.mse_loss(o, y) / F.mse_loss(o, y).detach(), "volume", R.RATIO,
                        R.RATIO),
    "differences along D": (lambda o, y: (o[:, :, 1:] - o[:, :, :-1]).abs().mean(), "volume", R.MIXES,
                            "mean"),
    "differences along W": (lambda o, y: (o[..., 1:] - o[..., :-1]).abs().mean(), "volume", "mean", "mean"),
    "pooled": (lambda o, y: F.mse_loss(F.avg_pool3d(o, 2), F.avg_pool3d(y, 2)), "volume", R.MIXES, "mean"),
    "mean over D, sum over H": (lambda o, y: ((o - y) ** 2).mean(2).sum(), "volume", R.KINDS, "sum"),
    "a branch on values": (lambda o, y: F.mse_loss(o, y) * (2 if y.mean() > 0 else 1), "volume", R.VALUES,
                           R.VALUES),
    "its own value read": (lambda o, y: (lambda v: v if v.item() > 0 else 2 * v)(F.mse_loss(o, y)), "volume",
                           R.VALUES, R.VALUES),
    "a branch on torch.equal": (lambda o, y: F.mse_loss(o, y) * (2 if torch.equal(y[:, :, :1], y[:, :, :1])
                                                                else 1), "volume", R.VALUES, R.VALUES),
    "a scripted masked mean": (lambda o, y: _scripted(o, y), "volume", R.UNFOLLOWED, R.UNFOLLOWED),
    "a scripted term": (lambda o, y: F.mse_loss(o, y) + _scripted(o, y), "volume", R.UNFOLLOWED,
                        R.UNFOLLOWED),
    "a count of argwhere": (lambda o, y: ((o - y) ** 2 * (y > 0)).sum() / max(
        1, torch.argwhere(y > 0).shape[0]), "volume", R.EXTENTS, R.EXTENTS),
    "a fill of a value of the output's": (lambda o, y: F.mse_loss(o, y) * torch.full(
        (), (y > 0).double().mean()), "volume", R.UNFOLLOWED, R.UNFOLLOWED),
    "a gather of fewer positions": (lambda o, y: o.gather(1, torch.zeros(
        (len(o), 1, 1, 1, 1), dtype=torch.long)).pow(2).mean(), "volume", R.MIXES, "values"),
    "its own value, then scaled in place": (lambda o, y: (lambda v: v.mul_(0.5 if v.item() > 0 else 1.0))(
        F.mse_loss(o, y)), "volume", R.VALUES, R.VALUES),
    "the reciprocal of a mean": (lambda o, y: torch.div(1, F.mse_loss(o, y)), "volume", R.RATIO, R.RATIO),
    "a sum by the bytes": (lambda o, y: ((o - y) ** 2).sum() / o.nbytes, "volume", R.EXTENTS, "values"),
    "a sum by a stride": (lambda o, y: ((o - y) ** 2).sum() / o.stride(1), "volume", R.EXTENTS, "values"),
    "a sum by a count of ones": (lambda o, y: ((o - y) ** 2).sum() / torch.ones_like(o).sum(), "volume",
                                 R.RATIO, R.RATIO),
    "weighted l1": (lambda o, y: F.l1_loss(o, y, weight=(y > 0).to(o.dtype) + 0.5), "volume", R.RATIO,
                    R.RATIO),
    "a dict target": (lambda o, y: F.mse_loss(o, y["t"], reduction="sum"), "dict", "sum", "sum"),
    "no target": (lambda o, y: o.pow(2).sum(), "none", "sum", "sum"),
    "class weights of the batch": (lambda o, y: F.cross_entropy(o, y, weight=1.0 / torch.bincount(
        y.flatten(), minlength=3).clamp(min=1).to(o.dtype), reduction="sum"), "classes", R.UNFOLLOWED,
        R.UNFOLLOWED),
    "a vmapped count": (lambda o, y: ((o - y) ** 2 * (y > 0)).sum() / torch.vmap(lambda t: (t > 0).sum())(y)
                        .sum().clamp(min=1), "volume", R.UNFOLLOWED, R.UNFOLLOWED),
    "a count written through .data": (_count_through_data, "volume", R.RATIO, R.RATIO),
    "the target zeroed through detach": (_zeroed_through_detach, "volume", R.MIXES, R.MIXES),
    "a count into a view of zeros": (_count_into_a_view, "volume", R.MIXES, R.MIXES),
    "ignore_index cleared after the call": (_ignore_cleared, "classes", R.SELECTION, R.SELECTION),
    "kernels of the output's": (lambda o, y: F.conv3d(o, o.mean((1, 2, 3, 4)).view(-1, 1, 1, 1, 1)).mean(),
                                "volume", R.MIXES, R.MIXES),
    "an accumulator from torch.tensor(0.)": (lambda o, y: torch.tensor(0.0, dtype=o.dtype) + F.mse_loss(
        o, y, reduction="sum"), "volume", "sum", "sum"),
    "a count of a zero volume": (lambda o, y: ((o - y) ** 2).sum() / (y * 0 + 1).sum(), "volume", R.RATIO,
                                 R.RATIO),
    "DDP's unused-output trick": (lambda o, y: F.mse_loss(o, y) + 0 * o.sum(), "volume", "mean", "mean"),
    "channels picked by a list": (lambda o, y: F.mse_loss(torch.cat([o, y], 1)[:, [0]], y), "volume", "mean",
                                  "mean"),
    "a class-weight table": (lambda o, y: (F.cross_entropy(o, y, reduction="none") * torch.tensor(
        [0.2, 1.0, 3.0], dtype=o.dtype)[y]).sum(), "classes", "sum", "sum"),
    "channels last, masked": (lambda o, y: F.cross_entropy(o.permute(0, 2, 3, 4, 1)[y >= 0], y[y >= 0],
                                                           reduction="sum"), "classes", "sum", "sum"),
    "std over channels": (lambda o, y: torch.std(torch.cat([o, y], 1), 1, True).mean(), "volume", "mean",
                          "mean"),
    "n = o.shape[1]": (lambda o, y: ((o - y) ** 2).sum() / o.shape[1], "volume", "sum", "sum"),
    "a mean by hand": (lambda o, y: ((o - y) ** 2).sum() / o.numel(), "volume", R.EXTENTS, "values"),
    "written through a view": (_written_through_a_view, "volume", R.MIXES, R.MIXES),
    "a loop over samples": (_per_sample_loop, "volume", "mean", R.MIXES),
    "kl batchmean": (lambda o, y: F.kl_div(F.log_softmax(o, 1), F.softmax(y, 1), reduction="batchmean"),
                     "volume", "sum", "mean"),
    "bce": (lambda o, y: F.binary_cross_entropy_with_logits(o, (y > 0).to(o.dtype)), "volume", "mean",
            "mean"),
    "a square of per-sample means": (lambda o, y: ((o - y).mean((2, 3, 4)) ** 2).mean(), "volume", R.RATIO,
                                     "mean"),
    "a mean and a sum": (lambda o, y: F.mse_loss(o, y) + 0.1 * (o - y).abs().sum(), "volume", R.KINDS,
                         R.KINDS),
    "centred by a mean": (lambda o, y: ((o - y.mean((2, 3, 4), keepdim=True)) ** 2).mean(), "volume", R.RATIO,
                          "mean"),
    "a flipped target": (lambda o, y: F.mse_loss(o, y.flip(2)), "volume", R.MIXES, "mean"),
    "a rolled target": (lambda o, y: F.mse_loss(o, y.roll(1, 3)), "volume", R.MIXES, "mean"),
    "every second voxel": (lambda o, y: F.mse_loss(o[:, :, ::2], y[:, :, ::2]), "volume", R.MIXES, "mean"),
    "the first voxels": (lambda o, y: ((o - y).reshape(-1)[:10] ** 2).mean(), "volume", R.MIXES, R.MIXES),
    "a dot product": (lambda o, y: o.flatten().dot(y.flatten()), "volume", R.UNFOLLOWED, R.UNFOLLOWED),
    "where, then a sum": (lambda o, y: torch.where(y > 0, o - y, 0).abs().sum() / 5, "volume", "sum", "sum"),
    "per channel, stacked": (lambda o, y: torch.stack([F.mse_loss(a, b) for a, b in zip(
        torch.cat([o, o], 1).unbind(1), torch.cat([y, y], 1).unbind(1), strict=True)]).mean(), "volume",
        "mean", "mean"),
    "sums chained": (lambda o, y: (o - y).abs().sum(-1).sum(-1).sum(-1).mean(), "volume", "sum", "mean"),
    "cross entropy": (F.cross_entropy, "classes", "mean", "mean"),
    "cross entropy sum": (lambda o, y: F.cross_entropy(o, y, reduction="sum"), "classes", "sum", "sum"),
    "class-weighted cross entropy": (lambda o, y: F.cross_entropy(o, y, weight=torch.tensor(
        [0.2, 1.0, 3.0], dtype=o.dtype)), "classes", R.RATIO, R.RATIO),
    "ignore_index met": (lambda o, y: F.cross_entropy(o, torch.where(y == 0, 255, y), ignore_index=255),
                         "classes", R.SELECTION, R.SELECTION),
    "ignore_index not met": (lambda o, y: F.cross_entropy(o, y, ignore_index=255), "classes", "mean", "mean"),
    "one-hot by hand": (lambda o, y: -(F.one_hot(y, 3).permute(0, 4, 1, 2, 3) * F.log_softmax(o, 1)).sum(1)
                        .mean(), "classes", "mean", "mean"),
}


def _data(target: str) -> tuple[torch.Tensor, Any]:
    if target in ("dict", "none"):
        o, y = _data("volume")
        return o, ({"t": y} if target == "dict" else None)
    g = torch.Generator().manual_seed(0)
    if target == "classes":
        return (torch.randn((2, 3, 5, 7, 4), dtype=torch.float64, generator=g),
                torch.randint(0, 3, (2, 5, 7, 4), generator=g))
    return (torch.randn((2, 1, 5, 7, 4), dtype=torch.float64, generator=g),
            torch.randn((2, 1, 5, 7, 4), dtype=torch.float64, generator=g))


def _part(y: Any, box: tuple, target: str, axis: str) -> Any:
    if y is None:
        return None
    if isinstance(y, dict):
        return {k: _part(v, box, "volume", axis) for k, v in y.items()}
    return y[box] if target == "volume" or axis == "batch" else y[(box[0], *box[2:])]


def _verdict(found: list) -> str | int:
    if not found:
        return "values"
    f = found[0]
    if f.mean != f.mean:
        return f.dim - FORM
    return "mean" if f.mean == 1.0 else "sum"


def _followed(loss_fn, o: torch.Tensor, y: torch.Tensor) -> tuple[str | int, str | int]:
    form = LossForm(o, y, [0, 1], True)
    with form:
        loss = loss_fn(o, y)
    space, batch = form.findings(loss)
    return _verdict(space), _verdict(batch)


@pytest.mark.parametrize("name", list(CASES))
def test_the_form_of_a_loss(name):
    """The verdict per axis, and where it is a mean or a sum, the numbers agree: the whole's loss and
    gradient are the parts' (cut at D 2 | 3 and H 3 | 4, or into its two samples) combined by their
    shares (a mean) or added (a sum)."""
    loss_fn, target, space, batch = CASES[name]
    o, y = _data(target)
    o.requires_grad_()
    got = _followed(loss_fn, o, y)
    assert got == (space, batch), f"{name}: {got}, expected {(space, batch)}"
    whole = loss_fn(o, y)
    (g_whole,) = torch.autograd.grad(whole, o)
    d, h = 2, 3
    boxes = {"space": [(slice(None), slice(None), a, b) for a in (slice(0, d), slice(d, None))
                       for b in (slice(0, h), slice(h, None))],
             "batch": [(slice(0, 1),), (slice(1, 2),)]}
    for axis, kind in (("space", space), ("batch", batch)):
        if kind not in ("mean", "sum"):
            continue
        total, grad = 0.0, torch.zeros_like(o)
        for box in boxes[axis]:
            yb = _part(y, box, target, axis)
            ob = o[box].detach().requires_grad_()
            part = loss_fn(ob, yb)
            share = ob.numel() / o.numel() if kind == "mean" else 1.0
            total = total + share * part.detach()
            (g,) = torch.autograd.grad(part, ob)
            grad[box] = share * g
        assert torch.allclose(total, whole.detach(), rtol=1e-12), f"{name} along {axis}: {total} != {whole}"
        assert torch.allclose(grad, g_whole, rtol=1e-10, atol=1e-14), f"{name} along {axis}: gradients differ"


def test_monai_losses():
    """MONAI's Dice family is no mean over voxels; per sample it is a mean over the samples (its count
    read: the checks on values tell), over the batch (``batch=True``) it is none; its focal loss is a mean."""
    losses = pytest.importorskip("monai.losses")
    o, _ = _data("volume")
    y = (torch.rand(o.shape, generator=torch.Generator().manual_seed(1)) > 0.5).to(o.dtype)
    assert _followed(losses.DiceLoss(sigmoid=True), o, y) == (R.EXTENTS, "values")
    assert _followed(losses.DiceLoss(sigmoid=True, batch=True), o, y)[1] not in ("mean", "sum", "values")
    assert _followed(losses.FocalLoss(), o, y)[1] in ("mean", "values")
