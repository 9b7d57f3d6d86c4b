"""Whether ``loss_fn`` splits across ranks and micro-batches: its value on pieces of every part taken
together against the parts' own values.

Why: the check within a rank (:mod:`hybridpar.pipeline.loss_check`) cuts what one rank holds in two. A
loss normalised by something that differs between ranks but not between a rank's halves passes it: a
masked mean whose region of interest lies on one rank (the others' shards masked whole) trained with
0.5x the gradient on two ranks, one whose mask density differs by rank 20 % off, and so did a masked
loss whose first micro-batch masked nothing while the second did.

How: every rank of the stage takes a piece of its output and target, the same few voxels along each
spatial dim (:data:`CAP` at most, spread over its shard, as many on every rank: the smallest shard's
extent decides) of every volume that has the output's extent, and its per-sample vectors (a head's
(N, k)) whole, in float64 (where a normalisation one count apart shows above rounding, whatever the
model's dtype), and all-gathers them over the stage (one small all-gather per dtype). Each rank then
evaluates ``loss_fn`` on the pieces of the ranks that hold its samples (the output's shards) taken
together along the first split dim, and on those of the replicas at its spatial position, with this
rank's first output piece beside the targets of its other micro-batches, taken together along the
batch, and compares each value with the parts' mean (they are of equal size) and sum: a
:class:`~hybridpar.pipeline.loss_check.Finding` per axis that the stage's agreement reads with the
others. Every rank evaluates the same pieces; the agreement makes the verdict one. Tensors of another
shape (a scalar, a gathered volume) go to every evaluation as this rank holds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from hybridpar.pipeline.loss_check import ACROSS, Finding, evaluate

CAP = 8  # voxels a piece takes along each spatial dim: enough to tell where a mask lies, cheap to send


def counts(output_shape: Sequence[int], split: Sequence[int]) -> tuple[int, int, int]:
    """Voxels of a piece along each spatial dim: :data:`CAP` or the smallest shard's extent."""
    return tuple(min(CAP, n // p) for n, p in zip(output_shape[-3:], split, strict=True))  # type: ignore


def _positions(extent: int, count: int, device: torch.device) -> torch.Tensor:
    """``count`` distinct positions spread over ``range(extent)`` (``count <= extent``)."""
    return torch.linspace(0, extent - 1, count, device=device).round().long()


class Pieces:
    """The leaves of ``(out, y)`` that a piece holds: volumes of the output's extent, thinned to
    ``shape`` voxels, and per-sample vectors of ``samples`` rows; :meth:`tree` puts other leaves back."""

    def __init__(self, out: Any, y: Any, box: tuple[int, ...], shape: tuple[int, int, int], samples: int):
        self.leaves, self.spec = tree_flatten((out, y))
        self.box, self.shape, self.samples = box, shape, samples
        self.kept = [i for i, t in enumerate(self.leaves) if isinstance(t, torch.Tensor) and (
            self._volume(t) or (0 < t.dim() <= 2 and t.shape[0] == samples))]

    def _volume(self, t: torch.Tensor) -> bool:
        """N, C, D, H, W of the output's extent, or N, D, H, W (a target of class indices)."""
        return t.dim() in (4, 5) and tuple(t.shape[-3:]) == self.box and t.shape[0] == self.samples

    def take(self, leaves: list[Any], device: torch.device | None = None) -> list[torch.Tensor]:
        """The kept leaves of ``leaves`` (of this structure), volumes thinned, on ``device`` if given (a
        later micro-batch's target may not be on the output's yet)."""
        taken = []
        for i in self.kept:
            t = leaves[i]
            if self._volume(t):
                for d, (extent, count) in enumerate(zip(self.box, self.shape, strict=True)):
                    t = t.index_select(d - 3, _positions(extent, count, t.device))
            t = t.double() if t.is_floating_point() else t  # exact enough to tell a normalisation apart
            taken.append((t if device is None else t.to(device)).contiguous())
        return taken

    def tree(self, kept: list[torch.Tensor]) -> tuple[Any, Any]:
        """``(out, y)`` with the kept leaves replaced by ``kept``."""
        leaves = list(self.leaves)
        for i, t in zip(self.kept, kept, strict=True):
            leaves[i] = t
        return tree_unflatten(leaves, self.spec)

    def volumes(self) -> list[bool]:
        """Which kept leaves are volumes (taken together along space; the others only along the batch)."""
        return [self._volume(self.leaves[i]) for i in self.kept]


def _gather(taken: list[torch.Tensor], group: dist.ProcessGroup) -> list[list[torch.Tensor]]:
    """Every rank's kept leaves, by rank of ``group``: one all-gather per dtype, the leaves flattened
    into it (bool travels as uint8: not every backend has it)."""
    world = dist.get_world_size(group)
    ranks: list[list[torch.Tensor | None]] = [[None] * len(taken) for _ in range(world)]
    sent = [t.to(torch.uint8) if t.dtype == torch.bool else t for t in taken]
    for dtype in sorted({t.dtype for t in sent}, key=str):
        these = [i for i, t in enumerate(sent) if t.dtype == dtype]
        flat = torch.cat([sent[i].reshape(-1) for i in these])
        got = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(got, flat, group=group)
        for r, g in enumerate(got):
            for i, part in zip(these, g.split([sent[i].numel() for i in these]), strict=True):
                part = part.view(sent[i].shape)
                ranks[r][i] = part.to(torch.bool) if taken[i].dtype == torch.bool else part
    return ranks  # type: ignore[return-value]


def _finding(loss_fn: Callable, pieces: Pieces, parts: list[list[torch.Tensor]], dim: int,
             along: list[bool]) -> Finding:
    """The loss of ``parts`` taken together along ``dim`` (the leaves ``along`` marks; the others as the
    first part holds them) against the parts' mean and sum; nothing found where it raises."""
    try:
        together = [torch.cat([p[i] for p in parts], dim) if a else parts[0][i] for i, a in enumerate(along)]
        whole = evaluate(loss_fn, *pieces.tree(together))
        values = [evaluate(loss_fn, *pieces.tree(p)) for p in parts]
    except (RuntimeError, ValueError, TypeError, IndexError):
        return Finding(-1, math.nan, math.nan, math.nan)
    return Finding(ACROSS, whole, sum(values) / len(values), sum(values))


def findings(loss_fn: Callable, out: Any, y: Any, other_ys: list[Any], shape: tuple[int, int, int],
             split_dims: list[int], group: dist.ProcessGroup | None, space_peers: list[int],
             batch_peers: list[int]) -> tuple[list[Finding], list[Finding]]:
    """This rank's findings across ranks: along space over ``space_peers`` (ranks of ``group`` that hold
    shards of this rank's samples, taken together along the first of ``split_dims``), along the batch
    over ``batch_peers`` (ranks at this spatial position in other replicas) and this rank's other
    micro-batches' targets ``other_ys`` (each beside this output). ``shape``: a piece's voxels."""
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    volume = next((t for t in leaves if t.dim() == 5), None)
    samples = y.shape[0] if isinstance(y, torch.Tensor) and y.dim() > 0 else 0
    box = tuple(volume.shape[2:]) if volume is not None else ()
    if not samples or min(shape) < 1:
        return [], []
    with torch.no_grad(), torch.random.fork_rng(devices=[y.device] if y.device.type == "cuda" else []):
        pieces = Pieces(out, y, box, shape, samples)
        if not pieces.kept:
            return [], []
        mine = pieces.take(pieces.leaves)
        ranks = _gather(mine, group) if group is not None else [mine]
        space, batch = [], []
        if split_dims and len(space_peers) > 1:
            space.append(_finding(loss_fn, pieces, [ranks[r] for r in space_peers], split_dims[0] - 3,
                                  pieces.volumes()))
        parts = [ranks[r] for r in batch_peers]
        y_at = len(tree_flatten(out)[0])  # the target's leaves follow the output's
        for other in other_ys:
            if isinstance(other, torch.Tensor) and other.shape[0] == samples:
                swapped = list(pieces.leaves)
                others, _ = tree_flatten(other)
                swapped[y_at:y_at + len(others)] = others
                parts.append(pieces.take(swapped, y.device))
        if len(parts) > 1:
            batch.append(_finding(loss_fn, pieces, parts, 0, [True] * len(pieces.kept)))
    return space, batch
