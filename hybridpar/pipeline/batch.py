"""A global batch cut into this rank's piece, and a replica's piece into micro-batches.

Why a module of its own: which samples and which sub-volume a rank receives follows from the grid
and the layouts of the model's ends alone (the first reader's split for the input, the output's for
a volume target), the same rule for training, prediction and any loader.
"""

from __future__ import annotations

import torch

from hybridpar.comm.redistribute import local_box
from hybridpar.device import memfmt
from hybridpar.grid import ProcessGrid


def split_sizes(batch: int, parts: int) -> list[int]:
    """Micro-batch sizes: ``batch`` samples in ``parts`` pieces (fewer if there are fewer samples)."""
    parts = min(parts, batch)
    return [len(c) for c in torch.arange(batch).tensor_split(parts)]


def _own(t: torch.Tensor) -> torch.Tensor:
    """``t`` in storage of its own: a piece that stays a view would keep the whole global batch alive
    (and count as such in memory) after the caller lets it go. Dense in its own memory format."""
    t = memfmt.dense(t)
    return t.clone() if t.untyped_storage().nbytes() > t.numel() * t.element_size() else t


def _box(t: torch.Tensor, grid: ProcessGrid) -> torch.Tensor:
    """``grid``'s box of ``t``'s last three (spatial) dims."""
    box = local_box(tuple(t.shape[-3:]), grid)
    return t[(Ellipsis, *(slice(a, b) for a, b in box))]


def one_target(y: object, what: str, x: object = None) -> None:
    """Refuse a target that is no tensor, or (given the input ``x``) not of its samples along dim 0, in
    one line: the engine cuts, splits and counts one tensor by the samples of the batch."""
    if not isinstance(y, torch.Tensor):
        raise ValueError(f"{what}: the target must be one tensor (N, ...), got {type(y).__name__}; targets "
                         f"of several parts go in one tensor (a volume's channels concatenated, a head's "
                         f"columns) that loss_fn cuts apart again")
    if isinstance(x, torch.Tensor) and x.dim() and (not y.dim() or y.shape[0] != x.shape[0]):
        held = f"{y.shape[0]} along dim 0" if y.dim() else "no dim"
        raise ValueError(f"{what}: the target holds {held} where the input holds {x.shape[0]} samples; the "
                         f"engine cuts the batch by samples (micro-batches, data parallelism): give the "
                         f"model's output and its target the batch first (not h[-1])")


def shard(x: torch.Tensor, y: torch.Tensor | None, grid: ProcessGrid, input_grid: ProcessGrid,
          output_grid: ProcessGrid, output_volume: tuple[int, ...] | None,
          memory_format: torch.memory_format) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(this rank's input, its target) of a global batch: its replica's samples; of a volume input,
    ``input_grid``'s box; of a volume target of a split output (``output_grid``, of ``output_volume``
    voxels), the output's box."""
    if y is not None:
        one_target(y, "Engine.shard_batch", x)
    n = x.shape[0]
    if n % grid.data:
        raise ValueError(f"Engine.shard_batch: global batch {n} does not split over "
                         f"data({grid.data}) replicas; use a multiple of {grid.data}")
    per = n // grid.data
    rows = slice(grid.data_index * per, (grid.data_index + 1) * per)
    x_rep = x[rows]
    if x.dim() == 5 and not input_grid.is_replicated:
        x_rep = _box(x_rep, input_grid)
    x_rep = x_rep.contiguous(memory_format=memory_format) if x_rep.dim() == 5 else x_rep
    if y is None:
        return _own(x_rep), None
    y_rep = y[rows]
    if not output_grid.is_replicated:
        if y.dim() not in (4, 5) or tuple(y.shape[-3:]) != output_volume:
            raise ValueError(f"Engine.shard_batch: the model's output is a split volume of "
                             f"{'x'.join(map(str, output_volume))} voxels; the target must be N, C, D, H, "
                             f"W (or N, D, H, W: class indices) of that size, got {tuple(y.shape)}")
        y_rep = _box(y_rep, output_grid)
    return _own(x_rep), _own(y_rep)
