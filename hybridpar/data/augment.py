"""Random symmetries of a volume, read shard by shard: each rank reads only what its shard comes from.

Why in the loader and not a transform on the batch: with a spatial split no rank holds the whole
sample, and flipping, transposing or rolling a volume moves voxels between shards. So the view of a
sample is drawn first, from ``(seed, epoch, index)`` alone (every rank of the sample's spatial group
draws the same one, with no communication), and each rank reads the *pre-image* of its own shard:
the same hyperslab read it makes without augmentation (up to eight when a roll wraps around the box),
then flips and transposes what it read in memory. A rank's shard is then exactly that shard of the
transformed whole volume, and a volume target (``read`` returning a ``y`` with the same spatial
extent, such as an initial density field) is transformed with it.

The transformations, each drawn uniformly:

* ``symmetries``: the 48 symmetries of the cube: a permutation of the axes (among axes of equal
  extent, so the sample keeps its shape) and a flip of each axis. For statistically isotropic data
  (a universe, a porous medium, a turbulent box) every one is another valid sample;
* ``shifts``: a periodic roll by any offset along each axis; valid only where the sample is a whole
  periodic box (a simulation box, not a crop of one).

The map, for a view ``(perm, flip, shift)`` of a sample ``x`` of extent ``n`` (``x`` indexed by its own
axes 0, 1, 2): ``out = permute(flip(roll(x, -shift)), perm)``, i.e. output axis ``a`` runs along input
axis ``perm[a]``, reversed where ``flip[perm[a]]``, starting at ``shift[perm[a]]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hybridpar.data.dataset import Region, VolumeDataset

Extent = tuple[int, int, int]
_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16, torch.int16, torch.int32, torch.int64,
                 torch.uint8, torch.int8, torch.bool)


@dataclass(frozen=True)
class View:
    """One transformation of a sample of voxel extent ``extent`` (D, H, W): ``perm`` (output axis ->
    input axis), ``flip`` and ``shift`` per input axis."""

    extent: Extent
    perm: tuple[int, int, int] = (0, 1, 2)
    flip: tuple[bool, bool, bool] = (False, False, False)
    shift: tuple[int, int, int] = (0, 0, 0)

    def __post_init__(self) -> None:
        if sorted(self.perm) != [0, 1, 2] or any(self.extent[a] != self.extent[b]
                                                  for a, b in enumerate(self.perm)):
            raise ValueError(f"View: perm {self.perm} must permute axes of equal extent of {self.extent}")

    @property
    def is_identity(self) -> bool:
        return self == View(self.extent)

    def source(self, region: Region) -> list[list[slice]]:
        """Per input axis, the slices of ``x`` (in order; two where the roll wraps) that the output
        ``region`` comes from."""
        extent = self.extent
        wanted: list[tuple[int, int]] = [(0, 0)] * 3
        for a, s in enumerate(region):
            b = self.perm[a]
            lo, hi, _ = s.indices(extent[a])
            wanted[b] = (extent[b] - hi, extent[b] - lo) if self.flip[b] else (lo, hi)
        pieces = []
        for b, (lo, hi) in enumerate(wanted):
            n, s = extent[b], self.shift[b] % extent[b]
            start, stop = lo + s, hi + s
            if stop <= n:
                pieces.append([slice(start, stop)])
            elif start >= n:
                pieces.append([slice(start - n, stop - n)])
            else:
                pieces.append([slice(start, n), slice(0, stop - n)])
        return pieces

    def apply(self, block: torch.Tensor) -> torch.Tensor:
        """The output shard from the source ``block`` (..., d, h, w) assembled in input axis order.

        On the CPU through numpy, whose flips are views: one strided copy instead of torch's two
        (``flip`` always copies)."""
        lead = block.dim() - 3
        flips = [lead + b for b in range(3) if self.flip[b]]
        order = (*range(lead), *(lead + b for b in self.perm))
        if block.device.type == "cpu" and block.dtype in _NUMPY_DTYPES and not block.requires_grad:
            view = np.transpose(np.flip(block.numpy(), flips) if flips else block.numpy(), order)
            return torch.from_numpy(view.copy(order="C"))
        out = block.flip(flips) if flips else block
        return out.permute(*order).contiguous()

    def transform(self, x: torch.Tensor) -> torch.Tensor:
        """The whole-volume transform (the reference the shard reads must equal)."""
        dims = tuple(range(x.dim() - 3, x.dim()))
        return self.apply(torch.roll(x, [-s for s in self.shift], dims))

    def read(self, dataset: VolumeDataset, index: int, region: Region | None = None
             ) -> tuple[torch.Tensor, object]:
        """``dataset.read(index, region)`` of the transformed sample: the hyperslab(s) the region comes
        from, assembled, flipped and permuted. A ``y`` with the spatial extent of what was read (a
        volume target read with the region) is transformed the same way; any other ``y`` is returned
        as read."""
        if region is None:
            region = (slice(0, self.extent[0]), slice(0, self.extent[1]), slice(0, self.extent[2]))
        if self.is_identity:
            return dataset.read(index, region)
        pieces = self.source(region)
        combos = list(itertools.product(*(range(len(p)) for p in pieces)))
        reads = [dataset.read(index, tuple(pieces[b][k] for b, k in enumerate(combo))) for combo in combos]
        xs = [torch.as_tensor(x) for x, _ in reads]
        y = reads[0][1]
        if isinstance(y, torch.Tensor) and y.dim() >= 3 and y.shape[-3:] == xs[0].shape[-3:]:
            y = self.apply(_assemble(pieces, dict(zip(combos, (v for _, v in reads), strict=True))))
        return self.apply(_assemble(pieces, dict(zip(combos, xs, strict=True)))), y


@dataclass(frozen=True)
class Augment:
    """Which random views the loader draws (see the module docstring); ``Augment()`` draws the cube's
    48 symmetries, ``Augment(shifts=True)`` periodic rolls as well."""

    symmetries: bool = True
    shifts: bool = False

    def view(self, seed: int, epoch: int, index: int, extent: Extent) -> View:
        """The view of sample ``index`` in ``epoch``: a function of its arguments only, so every rank
        draws the same one (the generator is seeded with the tuple, as the sampler's shuffle is)."""
        rng = np.random.default_rng([seed, epoch, index, 0xA06])
        perm, flip, shift = [0, 1, 2], [False] * 3, [0] * 3
        if self.symmetries:
            for n in sorted(set(extent)):  # permute only axes of equal extent: the sample keeps its shape
                axes = [b for b in range(3) if extent[b] == n]
                for b, c in zip(axes, rng.permutation(axes), strict=True):
                    perm[b] = int(c)
            flip = [bool(f) for f in rng.integers(0, 2, size=3)]
        if self.shifts:
            shift = [int(rng.integers(0, n)) for n in extent]
        return View(extent, tuple(perm), tuple(flip), tuple(shift))  # type: ignore[arg-type]


def _assemble(pieces: Sequence[Sequence[slice]], blocks: dict[tuple[int, ...], torch.Tensor]) -> torch.Tensor:
    """One block from those read for every combination of the per-axis ``pieces`` (keyed by the
    pieces' positions), concatenated in order along each axis where a roll wrapped."""
    def build(axis: int, prefix: tuple[int, ...]) -> torch.Tensor:
        if axis == 3:
            return blocks[prefix]
        parts = [build(axis + 1, (*prefix, k)) for k in range(len(pieces[axis]))]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=parts[0].dim() - 3 + axis)
    return build(0, ())
