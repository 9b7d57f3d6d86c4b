"""The job's parallel axes by name, and the one record of their sizes.

Why a module of its own: every part of the engine talks about the same five axes (data-parallel
replicas, pipeline stages, and the spatial split of a volume's depth, height and width), and each
used to spell them its own way. Here they have one spelling, and :class:`Axes` holds their sizes,
resolved once from a spec and the world size (the "-1 takes the ranks left over" rule lives in
:func:`fill_leftover` alone). Pure arithmetic: no process group, no torch.

Vocabulary (as in :mod:`hybridpar.grid`): an *axis* is a process-grid axis, named in lower case
(``data``, ``pipe``, ``d``, ``h``, ``w``); a *dim* is a tensor dimension, named in upper case
(``D``, ``H``, ``W``) in messages about a layer's input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

DATA, PIPE = "data", "pipe"
SPATIAL_AXES = ("d", "h", "w")
"""The grid axes that split a volume's depth, height and width."""
AXES = (DATA, PIPE, *SPATIAL_AXES)
"""Every axis of the job, in rank order (row-major: the spatial ranks of one stage are adjacent)."""
DIM_NAMES = ("D", "H", "W")
"""The tensor dims the spatial axes split, as a layer's messages name them."""

Split = tuple[int, int, int]
"""A spatial split: ranks along (d, h, w)."""
REPLICATED: Split = (1, 1, 1)
"""The split of an activation every rank holds whole."""


class LeftoverError(ValueError):
    """Sizes that -1 cannot complete to the world size. ``known``: the product of the fixed sizes
    (0 when more than one size is -1); callers word the message for their input (a spec's keys, a
    grid's arguments)."""

    def __init__(self, known: int, world: int, several: bool = False) -> None:
        self.known, self.world, self.several = known, world, several
        what = "more than one size is -1" if several else f"fixed sizes multiply to {known}"
        super().__init__(f"{what}: cannot fill {world} ranks")


def fill_leftover(sizes: Sequence[int], world: int) -> tuple[int, ...]:
    """``sizes`` with its one -1 replaced by the ranks left over on ``world`` ranks (unchanged when no
    size is -1). Raises :class:`LeftoverError` where more than one size is -1 or the fixed sizes do
    not divide ``world``; checking that the product equals ``world`` is the caller's (its message
    says which grids fit)."""
    out = list(sizes)
    if out.count(-1) > 1:
        raise LeftoverError(0, world, several=True)
    if -1 in out:
        known = math.prod(s for s in out if s != -1)
        if known <= 0 or world % known:
            raise LeftoverError(known, world)
        out[out.index(-1)] = world // known
    return tuple(out)


@dataclass(frozen=True)
class Axes:
    """The sizes of the job's axes, by name: ``data`` replicas × ``pipe`` stages × the ``spatial``
    split (d, h, w) of each stage. Resolved (no -1) and consistent with the world size."""

    data: int
    pipe: int
    spatial: tuple[int, int, int]

    @classmethod
    def of(cls, sizes: Sequence[int] | tuple[int, int, Sequence[int]]) -> Axes:
        """From (data, pipe, d, h, w) in :data:`AXES` order, or (data, pipe, (d, h, w))."""
        if len(sizes) == 3:
            data, pipe, spatial = sizes
            sizes = (data, pipe, *spatial)
        data, pipe, d, h, w = (int(s) for s in sizes)
        return cls(data, pipe, (d, h, w))

    @property
    def sizes(self) -> dict[str, int]:
        """Every axis's size by name, in :data:`AXES` order."""
        return dict(zip(AXES, (self.data, self.pipe, *self.spatial), strict=True))

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage of one replica: the product of the spatial split."""
        return math.prod(self.spatial)

    @property
    def world(self) -> int:
        """Ranks of the job."""
        return self.data * self.pipe * self.stage_size

    def describe(self, splits: Iterable[Split] = ()) -> str:
        """``data 2 × pipe 1 × d 2 h 1 w 1 = 4 ranks; layers split 1x2x1, 2x1x1``: the axes and the
        spatial layouts ``splits`` the layers run in (the replicated one left out), as ``explain``
        prints them."""
        d, h, w = self.spatial
        out = f"data {self.data} × pipe {self.pipe} × d {d} h {h} w {w} = {self.world} ranks"
        shown = sorted({tuple(s) for s in splits} - {REPLICATED})
        if shown:
            out += "; layers split " + ", ".join("x".join(map(str, s)) for s in shown)
        return out
