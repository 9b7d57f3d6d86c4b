"""Index arithmetic of a layout change: what moving a 3D volume from one split to another receives.

Why apart from :mod:`hybridpar.geometry`: that module answers questions about one dim split over one
grid axis (shards, halos), which a layer asks; these answers are about whole 3D boxes under two
splits at once, which the FFT's transposes and the cost model of a layout change ask
(:mod:`hybridpar.fft`, :mod:`hybridpar.perfmodel.comm_cost`). Pure, like geometry: no communication.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

from hybridpar.geometry import shard_range, shard_ranges


def pencil(parts: int) -> tuple[int, int]:
    """The pencil grid (p1, p2) of ``parts`` ranks a 3D FFT transposes through: p1 · p2 = parts, as
    square as the factors allow (p1 >= p2; slabs, p2 = 1, when ``parts`` is prime)."""
    p2 = max(f for f in range(1, int(parts ** 0.5) + 1) if parts % f == 0)
    return parts // p2, p2


def _boxes(shape: Sequence[int], split: tuple[int, int, int]) -> list[tuple[tuple[int, int], ...]]:
    """Every rank's box of a (D, H, W) ``shape`` split ``split``, in rank order."""
    sd, sh, sw = split
    return [tuple(shard_range(shape[a], split[a], c[a]) for a in range(3))
            for c in itertools.product(range(sd), range(sh), range(sw))]


@functools.lru_cache(maxsize=4096)
def redistribute_volume(shape: tuple[int, int, int], src: tuple[int, int, int], dst: tuple[int, int, int],
                        stage: int) -> tuple[int, int]:
    """Voxels and messages the most loaded stage rank receives moving ``src`` -> ``dst``, routed as
    :func:`hybridpar.comm.redistribute.redistribute_tensor` routes them: stage rank ``q`` needs the
    ``dst`` box ``q % |dst|`` and already holds the ``src`` shard ``q % |src|``; every other ``src``
    shard overlapping its box sends one message. The ``src`` shards tile the volume, so the voxels
    received are the box minus the part q holds."""
    if src == dst:
        return 0, 0
    ns, nd = math.prod(src), math.prod(dst)
    src_ranges = [shard_ranges(shape[a], src[a]) for a in range(3)]
    sb, db = _boxes(shape, src), _boxes(shape, dst)
    worst = (0, 0)
    for qd, qs in {(q % nd, q % ns) for q in range(stage)}:
        want, own = db[qd], sb[qs]
        held = math.prod(max(0, min(a[1], b[1]) - max(a[0], b[0])) for a, b in zip(own, want))
        senders = math.prod(sum(1 for r in src_ranges[a] if min(r[1], want[a][1]) > max(r[0], want[a][0]))
                            for a in range(3))
        vox = math.prod(hi - lo for lo, hi in want) - held
        worst = max(worst, (vox, senders - (1 if held else 0)))
    return worst
