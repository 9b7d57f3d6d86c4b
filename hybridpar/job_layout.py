"""The job's layout, resolved once from the plan: its axes and every spatial layout its layers run in.

Why: a plan names a spatial split per layer; the stage builder, the engine's ends (input shards,
split outputs, the loss's ranks) and inference all need the process grid of such a split, with its
groups. Resolving each one where it is needed made every part ask the grid anew, and the groups'
creation order (which must be the same on every rank) depend on who asked first. Here the layouts
are made once, in one order, right after planning; every part reads them from this record.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hybridpar.axes import REPLICATED, Axes, Split
from hybridpar.grid import ProcessGrid


@dataclass(frozen=True)
class JobLayout:
    """The axes of the job (:class:`~hybridpar.axes.Axes`) and this rank's grid under each spatial
    split the plan uses (the stage's own split and the replicated one included)."""

    axes: Axes
    grid: ProcessGrid  # this rank's view with the stage's own split
    layouts: Mapping[Split, ProcessGrid]

    @classmethod
    def resolve(cls, grid: ProcessGrid, splits: Iterable[Split]) -> JobLayout:
        """Every layout of ``splits`` on ``grid``'s ranks, and every group a stage's layers, gradient
        reduction and pipeline may use, created on every rank in one order (``new_group`` requires
        it; groups of one rank are local and lazy, see the grid's ``_self_group``)."""
        layouts = {}
        for split in sorted({tuple(s) for s in splits} | {grid.stage_spatial, REPLICATED}):
            layout = layouts[split] = grid.with_spatial(split)
            if layout.spatial_size > 1:
                layout.spatial_group, layout.halo_group  # noqa: B018 (creates the groups)
            if grid.data > 1:
                layout.batch_group  # noqa: B018 (global-batch statistics: DistBatchNorm3d(stats="stage"))
        for size, name in ((grid.data * grid.stage_size, "stage_group"), (grid.data, "data_group"),
                           (grid.pipe, "pipe_group")):
            if size > 1:
                getattr(grid, name)
        return cls(grid.axes, grid, layouts)

    def of(self, split: Split | None) -> ProcessGrid:
        """The grid of ``split`` (None: replicated), one the plan uses."""
        key = REPLICATED if split is None else tuple(int(s) for s in split)
        try:
            return self.layouts[key]
        except KeyError:
            raise KeyError(f"JobLayout: no layer of the plan runs split {list(key)}; its layouts are "
                           f"{', '.join(str(list(s)) for s in self.layouts)}") from None
