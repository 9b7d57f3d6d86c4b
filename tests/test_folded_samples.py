"""Other dims folded into the samples' dim where data parallelism or micro-batches hold the batch in parts:
a 2.5-D network's planes (``h.permute(0, 2, 1, 3, 4).reshape(n * d, c, hh, w)``, a Conv2d on each, and
back), a layer shared by every channel (``h.reshape(n * c, 1, d, hh, w)``). Row-major order keeps each
sample's rows together (dim 0 then holds the samples in blocks of rows), so each part computes on its
own samples what one process computes on them: planned, and exact in float64 against one process,
traced and run by module swapping. What works across those rows (a mean or a flip along dim 0, the
first sample's rows picked, random numbers drawn for them, a fold written for one batch's size) works
across the samples, and is refused before any step, naming the call and its line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layer_cases import Failures
from test_user_models import _compare

SHAPE = (4, 1, 7, 6, 5)
SPLITS = {"spatial": (2, {"grid": {"spatial": [2, 1, 1]}}),  # the batch whole: anything along dim 0
          "data": (2, {"grid": {"data": 2}}),
          "micro": (2, {"grid": {"spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}),
          "data_x_spatial": (4, {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
          "pipeline": (2, {"grid": {"pipe": 2}, "pipeline": {"microbatches": 2}})}


def _fold(what: str, h: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """``h`` (N, 3, D, H, W) through a fold of other dims into dim 0, as ``what`` says (``m.plane``: a
    Conv2d of 3 channels; ``m.shared``: a Conv3d of 1)."""
    n, c, d, hh, w = h.shape
    if what == "planes":  # 2.5-D: a 2-D layer on each plane along D
        z = F.relu(m.plane(h.permute(0, 2, 1, 3, 4).reshape(n * d, c, hh, w)))
        return z.reshape(n, d, c, hh, w).permute(0, 2, 1, 3, 4)
    if what == "planes of fixed extents":  # read off no shape: a pipeline's cut carries the rows alone
        z = F.relu(m.plane(h.permute(0, 2, 1, 3, 4).reshape(-1, 3, *SHAPE[3:])))
        return z.reshape(-1, SHAPE[2], 3, *SHAPE[3:]).permute(0, 2, 1, 3, 4)
    if what == "channels":  # one layer shared by every channel
        return m.shared(h.reshape(n * c, 1, d, hh, w)).view(n, c, d, hh, w)
    if what == "channels and back":  # two reshapes, the first changing dim 0: one chain
        return h.reshape(n * c, 1, d, hh, w).reshape(n, c, d, hh, w) * 2
    if what == "flattened rows":  # each voxel's channels a row, normalised, then back
        z = h.permute(0, 2, 3, 4, 1).reshape(-1, c)
        return F.normalize(z, dim=1).reshape(n, d, hh, w, c).permute(0, 4, 1, 2, 3)
    z = h.permute(0, 2, 1, 3, 4).reshape(n * d, c, hh, w)
    if what == "a mean over the rows":
        z = z - z.mean(0, keepdim=True)
    elif what == "the rows flipped":
        z = z.flip(0)
    elif what == "the first sample's rows":
        z = z * z[:d].mean()
    elif what == "noise like the rows":
        z = z + torch.randn_like(z)
    elif what == "noise of the rows' shape":
        z = z + torch.randn(z.shape, dtype=z.dtype)
    elif what == "a fold written for 4 samples":
        z = h.permute(0, 2, 1, 3, 4).reshape(4 * d, c, hh, w)
    elif what == "a scan over the rows":
        z = z.cumsum(0)
    elif what == "a mean over the rows a layer made":  # the layer's output: rows of the samples again
        z = torch.relu(m.plane(z))
        z = z - z.mean(0, keepdim=True)
    return z.reshape(n, d, c, hh, w).permute(0, 2, 1, 3, 4)


class Folded(nn.Module):
    """A traced forward (torch.fx sees it whole)."""

    def __init__(self, what: str = "planes") -> None:
        super().__init__()
        self.what = what
        self.a, self.b = nn.Conv3d(1, 3, 3, padding=1), nn.Conv3d(3, 1, 3, padding=1)
        self.plane, self.shared = nn.Conv2d(3, 3, 3, padding=1), nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_fold(self.what, torch.relu(self.a(x)), self))


class FoldedChecked(Folded):
    """The same behind a check on the input's shape, which torch.fx cannot trace: run by module swapping."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != 1:
            raise ValueError("one channel in")
        return super().forward(x)


def Planes() -> nn.Module:  # noqa: N802 (a model's name, as _compare takes it)
    return Folded("planes")


def Channels() -> nn.Module:  # noqa: N802
    return Folded("channels")


def Rows() -> nn.Module:  # noqa: N802
    return Folded("flattened rows")


def FixedPlanes() -> nn.Module:  # noqa: N802
    return Folded("planes of fixed extents")


def CheckedPlanes() -> nn.Module:  # noqa: N802
    return FoldedChecked("planes")


def CheckedChannels() -> nn.Module:  # noqa: N802
    return FoldedChecked("channels")


def CheckedChannelsBack() -> nn.Module:  # noqa: N802
    return FoldedChecked("channels and back")


def MeanOverRows() -> nn.Module:  # noqa: N802
    return Folded("a mean over the rows a layer made")


def CheckedMeanOverRows() -> nn.Module:  # noqa: N802
    return FoldedChecked("a mean over the rows a layer made")


MODELS = {"Planes": Planes, "Channels": Channels, "Rows": Rows, "FixedPlanes": FixedPlanes,
          "CheckedPlanes": CheckedPlanes, "CheckedChannels": CheckedChannels,
          "CheckedChannelsBack": CheckedChannelsBack}
WHOLE_BATCH = {"MeanOverRows": MeanOverRows, "CheckedMeanOverRows": CheckedMeanOverRows}  # across the rows


IN_FOLD = {"FixedPlanes": "plane"}  # a node that reads the folded rows


def _body(rank: int, world: int, split: str) -> None:
    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    for name, make in (MODELS | WHOLE_BATCH if split == "spatial" else MODELS).items():
        spec = SPLITS[split][1]
        if split == "pipeline" and name != "FixedPlanes":
            continue
        if split == "pipeline":  # the second stage starts on the folded rows: they cross the cut
            spec = {**spec, "pipeline": {**spec["pipeline"], "stages": ["a", IN_FOLD[name]]}}
        try:
            _compare(fails, f"{name} {split}", make, spec, x, y)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{name} {split}: {type(err).__name__}: {str(err)[:400]}")
    fails.raise_if_any(rank)


@pytest.mark.parametrize("split", list(SPLITS))
def test_folds_into_the_samples_dim_match_one_process(pools, split):
    pools(SPLITS[split][0]).run(_body, split, timeout=400)


REFUSED = {
    "a mean over the rows": r"mean \(over the samples' dim\)",
    "the rows flipped": r"flip \(along the samples' dim\)",
    "the first sample's rows": r"indexing \(picks among the samples\)|getitem",
    "noise like the rows": r"randn_like",
    "noise of the rows' shape": r"randn",
    "a fold written for 4 samples": r"gives the batch's dim a size of its own",
    "a scan over the rows": r"cumsum \(along the samples' dim\)",
    "a mean over the rows a layer made": r"mean \(over the samples' dim\)",
}


@pytest.mark.parametrize("model", [Folded, FoldedChecked], ids=["traced", "swapped"])
@pytest.mark.parametrize("what", list(REFUSED))
def test_what_works_across_the_folded_rows_is_refused(what, model):
    import hybridpar as hp
    from hybridpar.planner.terms import SpecError

    world, split = SPLITS["data"]
    spec = hp.ParallelSpec.from_dict(split)
    with pytest.raises(SpecError, match=REFUSED[what] + r".* at test_folded_samples.py:\d+"):
        spec.plan(model(what).double(), SHAPE, world)
