"""Where a rank sits for input purposes: which data-parallel replica, which spatial sub-volume.

Why a small value type instead of the process grid itself: the loader needs four numbers
(``data``, ``data_index``, ``spatial_shape``, ``spatial_coord``), not process groups, so tests and
benchmarks can place a "rank" anywhere without starting ``torch.distributed``. ``Placement.of(grid)``
accepts a :class:`hybridpar.ProcessGrid` (or any object with those four attributes) or ``None``
(one rank reading whole samples).
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpar.axes import SPATIAL_AXES
from hybridpar.data.dataset import Region
from hybridpar.geometry import shard_range


@dataclass(frozen=True)
class Placement:
    """Replica ``data_index`` of ``data``; spatial ``coord`` in a grid of ``spatial_shape`` ranks."""

    data: int = 1
    data_index: int = 0
    spatial_shape: tuple[int, int, int] = (1, 1, 1)
    spatial_coord: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        if self.data < 1 or not 0 <= self.data_index < self.data:
            raise ValueError(f"Placement: replica {self.data_index} outside 0..{self.data - 1}")
        if len(self.spatial_shape) != 3 or len(self.spatial_coord) != 3:
            raise ValueError(f"Placement: spatial_shape {self.spatial_shape} and spatial_coord "
                             f"{self.spatial_coord} need 3 entries (d, h, w)")
        for axis, n, c in zip(SPATIAL_AXES, self.spatial_shape, self.spatial_coord, strict=True):
            if n < 1 or not 0 <= c < n:
                raise ValueError(f"Placement: coordinate {c} along {axis} outside 0..{n - 1}")

    @classmethod
    def of(cls, grid: object | None) -> Placement:
        """The placement of a process grid (or a stand-in with the same four attributes)."""
        if grid is None:
            return cls()
        if isinstance(grid, Placement):
            return grid
        return cls(int(grid.data), int(grid.data_index),
                   tuple(int(s) for s in grid.spatial_shape),
                   tuple(int(c) for c in grid.spatial_coord))

    @property
    def is_split(self) -> bool:
        """True when samples are split spatially (each rank reads a sub-volume)."""
        return self.spatial_shape != (1, 1, 1)

    def region(self, extent: tuple[int, int, int]) -> Region:
        """This rank's balanced shard of a sample of voxel extent ``(D, H, W)``, as three slices.

        Shards follow :func:`hybridpar.geometry.shard_range`, the split every distributed layer
        assumes, so the input lands exactly where the first layer expects it.
        """
        slices = []
        for axis, n, parts, c in zip(SPATIAL_AXES, extent, self.spatial_shape, self.spatial_coord,
                                     strict=True):
            if n < parts:
                raise ValueError(
                    f"sample extent {n} along {axis} cannot be split over {parts} ranks (every shard "
                    f"needs at least one voxel); use a split of at most {n} along {axis} or larger "
                    f"samples")
            slices.append(slice(*shard_range(n, parts, c)))
        return slices[0], slices[1], slices[2]
