"""Layouts the planner chooses: a layer too small to split, and the layers that read it until the volume
is large again, run replicated with no rule, exactly; a block torch.fx cannot trace into runs split by
module swapping inside it, its shape reads global (at the build size and at another).

Checked against the same model in one process, float64, three SGD steps (every loss, the state dict
after them, predictions: ``_compare`` of ``test_user_models``), on 2 ranks and on 4 (data x spatial,
where a replicated layer's weight gradient must be averaged over the replicas, never summed over the
split as well; and pipe x spatial). ``engine.explain()`` and ``engine.banner()`` show the replicated
layers marked ``!``.
"""

from __future__ import annotations

import contextlib
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_user_models import Failures, _compare

SHAPE = (2, 1, 16, 16, 12)


class AutoNet(nn.Module):
    """16x16x12 pooled to 1x2x2, fewer voxels along d than 2 ranks: the pool, the conv, its activation
    and the upsampling of that small volume run replicated; the skip adds the split activation to
    the upsampled one (redistributed to split again), and the last conv runs split."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 2, 3, padding=1)
        self.pool = nn.MaxPool3d((16, 8, 6))
        self.b = nn.Conv3d(2, 2, 3, padding=1)
        self.act = nn.Tanh()
        self.up = nn.Upsample(scale_factor=(16, 8, 6))
        self.c = nn.Conv3d(2, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.c(self.up(self.act(self.b(self.pool(h)))) + h)


class EvenCheck(nn.Module):
    """A block torch.fx cannot trace into (it iterates over its input's extents): pools only even ones."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = nn.AvgPool3d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for extent in x.shape[2:]:
            if extent % 2:
                raise ValueError(f"odd extent {extent}")
        return self.pool(x)


class NestedNet(nn.Module):
    """Two untraceable blocks on 4 ranks along w: the first reads 12 voxels where each shard holds 3 (odd:
    a shard's shape read would refuse), the second's output (3 voxels) is too small to split, so it, b
    and the upsampling run replicated (whole, the block's check passing on 6); the last conv splits."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv3d(1, 2, 3, padding=1)
        self.down1, self.down2 = EvenCheck(), EvenCheck()
        self.b = nn.Conv3d(2, 1, 3, padding=1)
        self.up = nn.Upsample(scale_factor=4)
        self.c = nn.Conv3d(1, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.up(self.b(self.down2(self.down1(self.a(x))))))


def _body(rank: int, world: int, cases: list[tuple[str, str, dict]]) -> None:
    import hybridpar as hp

    fails = Failures()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(SHAPE, dtype=torch.float64, generator=g)
    y = torch.randn((SHAPE[0], 1, *SHAPE[2:]), dtype=torch.float64, generator=g)
    for desc, model, spec in cases:
        try:
            _compare(fails, f"{desc} {spec}", globals()[model], spec, x, y, F.mse_loss)
        except Exception as err:  # name the case, then go on with the others
            fails.append(f"{desc} {spec}: {type(err).__name__}: {err}")
    if cases[0][1] == "NestedNet":  # another size: the swapped blocks' global extents follow it
        model = NestedNet().double()
        engine = hp.parallelize(model, cases[0][2], input_shape=SHAPE)
        x2 = torch.randn((2, 1, 8, 16, 12), dtype=torch.float64, generator=g)
        with torch.no_grad():
            fails.check("NestedNet predict at 8x16x12", engine.predict(engine.shard_batch(x2)[0]), model(x2))
    with warnings.catch_warnings(record=True) as caught:  # never replicated silently: said once per job
        warnings.simplefilter("always")
        engine = hp.parallelize(AutoNet().double(), cases[0][2], input_shape=SHAPE)
    said = [str(w.message) for w in caught if "run replicated" in str(w.message)]
    if len(said) != (rank == 0) or (said and "pool, b, act, up" not in said[0]):
        fails.append(f"rank {rank}: the replication warnings were {said}")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        table = engine.explain()
    if out.getvalue() != (table + "\n" if rank == 0 else ""):
        fails.append(f"explain printed {out.getvalue()[:200]!r} on rank {rank}")
    if "  ! replicated from here" not in table or table.count("repl!") != 4:
        fails.append(f"explain does not mark pool, b, act and up replicated:\n{table}")
    banner = engine.banner().splitlines()
    if len(banner) != 3 or "pool!, b!, act!, up!" not in banner[2]:
        fails.append(f"banner: {banner}")
    fails.raise_if_any(rank)


CASES = [
    (2, "auto-replicated 1x2x2 level, spatial", "AutoNet", {"grid": {"spatial": [2, 1, 1]}}),
    (4, "auto-replicated 1x2x2 level, data x spatial", "AutoNet",
     {"grid": {"data": 2, "spatial": [2, 1, 1]}}),
    (4, "auto-replicated 1x2x2 level, pipe x spatial", "AutoNet",
     {"grid": {"pipe": 2, "spatial": [2, 1, 1]}, "pipeline": {"microbatches": 2}}),
    (4, "untraceable blocks split, shape reads global", "NestedNet", {"grid": {"spatial": [1, 1, 4]}}),
]


IDS = [f"{c[2]}-{c[0]}-{i}" for i, c in enumerate(CASES)]


@pytest.mark.parametrize("world,desc,model,spec", CASES, ids=IDS)
def test_chosen_layouts_match_one_process(pools, world, desc, model, spec):
    pools(world).run(_body, [(desc, model, spec)], timeout=300)


def test_plans_of_the_cases():
    """What the distributed cases run: AutoNet's pool .. up replicated, the rest split; NestedNet's
    first block split 4 ways along w, the second replicated; strict refuses AutoNet's b."""
    import hybridpar as hp

    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}}).plan(AutoNet(), SHAPE)
    assert [(r.name, r.split, bool(r.auto_replicated)) for r in plan] == [
        ("a", (2, 1, 1), False), ("pool", (1, 1, 1), True), ("b", (1, 1, 1), True),
        ("act", (1, 1, 1), True), ("up", (1, 1, 1), True), ("add", (2, 1, 1), False),
        ("c", (2, 1, 1), False)]
    assert [r.name for r in plan if r.redistribute] == ["pool", "add"]
    strict = hp.ParallelSpec.from_dict({"grid": {"spatial": [2, 1, 1]}, "strict": True})
    with pytest.raises(hp.SpecError, match=r"pool \(MaxPool3d\) cannot run split \[2, 1, 1\]"):
        strict.plan(AutoNet(), SHAPE)
    plan = hp.ParallelSpec.from_dict({"grid": {"spatial": [1, 1, 4]}}).plan(NestedNet(), SHAPE)
    assert [(r.name, r.split, r.input_shape[4], bool(r.auto_replicated)) for r in plan] == [
        ("a", (1, 1, 4), 12, False), ("down1", (1, 1, 4), 12, False), ("down2", (1, 1, 1), 6, True),
        ("b", (1, 1, 1), 3, True), ("up", (1, 1, 1), 3, True), ("c", (1, 1, 4), 12, False)]
