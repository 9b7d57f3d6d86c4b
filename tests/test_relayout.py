"""Layout-change arithmetic checked without any process: :func:`redistribute_volume` against a voxel
by voxel count on a labelled volume (``numpy.array_split`` gives the shards, as ``torch.tensor_split``
does), on odd extents and uneven splits; :func:`pencil` against the divisors of the rank count."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hybridpar.relayout import pencil, redistribute_volume


def _labels(shape: tuple[int, int, int], split: tuple[int, int, int]) -> np.ndarray:
    """Each voxel's shard in rank order (row-major over the split's d, h, w)."""
    out = np.empty(shape, dtype=np.int64)
    cuts = [np.array_split(np.arange(n), s) for n, s in zip(shape, split)]
    for c in itertools.product(*(range(s) for s in split)):
        rank = (c[0] * split[1] + c[1]) * split[2] + c[2]
        out[np.ix_(cuts[0][c[0]], cuts[1][c[1]], cuts[2][c[2]])] = rank
    return out


def _counted(shape, src, dst, stage) -> tuple[int, int]:
    """The most loaded stage rank's (voxels received, messages): rank q wants dst box q % |dst|, holds
    src shard q % |src|, and hears once from every other src shard in its box."""
    have, want = _labels(shape, src), _labels(shape, dst)
    worst = (0, 0)
    for q in range(stage):
        ids = have[want == q % math.prod(dst)]
        mine = q % math.prod(src)
        worst = max(worst, (int((ids != mine).sum()), len(set(ids.tolist()) - {mine})))
    return worst


CASES = [((5, 7, 3), (2, 1, 1), (1, 3, 1)), ((8, 8, 8), (2, 2, 1), (1, 1, 4)),
         ((4, 9, 6), (1, 3, 2), (3, 1, 1)), ((7, 5, 9), (3, 1, 1), (1, 1, 1)),
         ((6, 6, 6), (1, 1, 1), (2, 3, 1)), ((5, 5, 5), (2, 2, 2), (2, 2, 2))]


@pytest.mark.parametrize("shape,src,dst", CASES)
def test_redistribute_volume_counts_what_each_rank_receives(shape, src, dst):
    for stage in sorted({max(math.prod(src), math.prod(dst)), math.prod(src) * math.prod(dst), 12}):
        assert redistribute_volume(shape, src, dst, stage) == _counted(shape, src, dst, stage), stage


def test_pencil_is_the_squarest_factoring():
    for parts in range(1, 65):
        p1, p2 = pencil(parts)
        assert p1 * p2 == parts and p1 >= p2
        assert not [f for f in range(p2 + 1, math.isqrt(parts) + 1) if parts % f == 0], parts
    assert pencil(7) == (7, 1) and pencil(12) == (4, 3) and pencil(16) == (4, 4)
