"""Augmented reads (``hybridpar.data.augment``) against the whole-volume transform.

Checked: for every one of the cube's 48 symmetries, with and without periodic rolls (wrapping on any
axis), on odd and non-cubic extents, every rank's shard of every spatial grid of 1-8 ranks (uneven
splits included) equals that shard of the transformed whole sample, a volume target transformed with
it; a rank reads exactly its shard's voxels; the views are a function of (seed, epoch, index), cover
all 48 symmetries, and come out the same through the loader's worker processes and after a resume.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from hybridpar.data import Augment, Placement, View, VolumeLoader

GRIDS = [(1, 1, 1), (2, 1, 1), (1, 2, 2), (2, 2, 2), (3, 1, 2), (1, 1, 4)]
SYMMETRIES = [(p, f) for p in itertools.permutations(range(3))
              for f in itertools.product([False, True], repeat=3)]


class Volumes:
    """In-memory samples read by region, counting the voxels read; ``target`` 'volume' returns a
    one-channel field of the same extent read with the same region."""

    def __init__(self, n: int, extent: tuple[int, int, int], target: str = "params", seed: int = 0
                 ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 2, *extent, generator=g, dtype=torch.float64)
        self.t = torch.randn(n, 1, *extent, generator=g, dtype=torch.float64)
        self.y = torch.randn(n, 4, generator=g, dtype=torch.float64)
        self.target, self.sample_shape, self.voxels = target, (2, *extent), 0

    def __len__(self) -> int:
        return len(self.x)

    def read(self, i: int, region=None):
        region = region or (slice(None),) * 3
        x = self.x[i][(slice(None), *region)]
        self.voxels += x[0].numel()
        t = self.t[i][(slice(None), *region)].clone() if self.target == "volume" else self.y[i]
        return x.clone(), t


def _shards(extent: tuple[int, int, int], grid: tuple[int, int, int]):
    for coord in itertools.product(*(range(g) for g in grid)):
        yield Placement(1, 0, grid, coord).region(extent)


@pytest.mark.parametrize("extent,shift", [((7, 7, 7), (0, 0, 0)), ((7, 7, 7), (3, 6, 1)),
                                          ((8, 6, 6), (5, 0, 2))],
                         ids=["7cube", "7cube-rolled", "8x6x6-rolled"])
def test_every_shard_of_every_view_is_that_shard_of_the_transformed_volume(extent, shift) -> None:
    ds = Volumes(1, extent, "volume")
    whole_x, whole_t = ds.x[0], ds.t[0]
    for perm, flip in SYMMETRIES:
        if any(extent[a] != extent[b] for a, b in enumerate(perm)):
            with pytest.raises(ValueError, match="equal extent"):
                View(extent, perm, flip, shift)
            continue
        view = View(extent, perm, flip, shift)
        want_x, want_t = view.transform(whole_x), view.transform(whole_t)
        for grid in GRIDS:
            for region in _shards(extent, grid):
                ds.voxels = 0
                x, t = view.read(ds, 0, region)
                case = f"perm {perm} flip {flip} shift {shift} grid {grid} region {region}"
                assert torch.equal(x, want_x[(slice(None), *region)]), case
                assert torch.equal(t, want_t[(slice(None), *region)]), case
                assert ds.voxels == x[0].numel(), f"{case}: read {ds.voxels} voxels for {x[0].numel()}"


def test_parameters_are_returned_as_read_and_identity_reads_once() -> None:
    ds = Volumes(2, (5, 5, 5))
    x, y = View((5, 5, 5), (2, 0, 1), (True, False, True), (1, 2, 3)).read(ds, 1)
    assert torch.equal(y, ds.y[1]) and x.shape == (2, 5, 5, 5)
    x, _ = View((5, 5, 5)).read(ds, 1, (slice(1, 3), slice(0, 5), slice(2, 4)))
    assert torch.equal(x, ds.x[1][:, 1:3, :, 2:4])


def test_views_are_a_function_of_seed_epoch_and_index_and_cover_the_group() -> None:
    aug = Augment()
    seen = {(v.perm, v.flip) for v in (aug.view(0, 0, i, (16, 16, 16)) for i in range(2000))}
    assert len(seen) == 48
    assert aug.view(3, 1, 7, (8, 8, 8)) == aug.view(3, 1, 7, (8, 8, 8))
    assert len({aug.view(3, e, 7, (8, 8, 8)) for e in range(40)}) > 20
    assert all(v.shift == (0, 0, 0) for v in (aug.view(0, 0, i, (8, 8, 8)) for i in range(50)))
    rolled = [Augment(shifts=True).view(0, 0, i, (8, 6, 6)) for i in range(200)]
    assert {v.shift[0] for v in rolled} == set(range(8)) and all(v.perm[0] == 0 for v in rolled)
    assert all(v.perm == (0, 1, 2) and v.flip == (False,) * 3 for v in
               (Augment(symmetries=False, shifts=True).view(0, 0, i, (8, 8, 8)) for i in range(20)))


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_shards_equal_the_transformed_batch_on_every_rank(workers: int) -> None:
    ds = Volumes(6, (6, 6, 6), "volume")
    aug, grid, seed = Augment(shifts=True), (2, 1, 2), 5
    ranks = [Placement(1, 0, grid, c) for c in itertools.product(range(2), range(1), range(2))]
    loaders = [VolumeLoader(ds, p, batch_size=3, seed=seed, workers=workers, augment=aug) for p in ranks]
    try:
        for epoch in (0, 1):
            for loader in loaders:
                loader.set_epoch(epoch)
            order = loaders[0].batches(epoch)
            for k, batches in enumerate(zip(*loaders, strict=True)):
                for p, (x, t) in zip(ranks, batches, strict=True):
                    region = p.region((6, 6, 6))
                    for b, i in enumerate(order[k]):
                        view, at = aug.view(seed, epoch, i, (6, 6, 6)), (slice(None), *region)
                        assert torch.equal(x[b], view.transform(ds.x[i])[at]), (epoch, k, b)
                        assert torch.equal(t[b], view.transform(ds.t[i])[at]), (epoch, k, b)
    finally:
        for loader in loaders:
            loader.close()


def test_a_resumed_loader_draws_the_same_views() -> None:
    ds = Volumes(8, (4, 4, 4))
    a = VolumeLoader(ds, None, batch_size=2, seed=1, workers=0, augment=Augment())
    first = [x for x, _ in a]
    b = VolumeLoader(ds, None, batch_size=2, seed=1, workers=0, augment=Augment())
    b.load_state_dict({"epoch": 0, "index": 2, "seed": 1})
    assert all(torch.equal(x, y) for x, (y, _) in zip(first[2:], b, strict=True))
    assert not all(torch.equal(x, ds.x[i]) for x, i in zip(first[0], a.batches(0)[0], strict=True))


def test_augment_without_an_extent_is_one_clear_error() -> None:
    class Bare:
        def __len__(self) -> int:
            return 2

        def read(self, i: int, region=None):
            return torch.zeros(1, 2, 2, 2), np.zeros(4)

    with pytest.raises(ValueError, match="augment needs the sample's voxel extent"):
        VolumeLoader(Bare(), None, augment=Augment())
