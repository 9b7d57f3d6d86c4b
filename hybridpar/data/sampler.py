"""Which samples each data-parallel replica reads, batch by batch: shuffle globally, then shard.

Why this order: sharding the samples per replica first and shuffling within each shard (the MLPerf
CosmoFlow staging shortcut) hurt convergence at scale, because each replica then sees a fixed subset
forever. Here every epoch draws one permutation of the *whole* dataset from a seed shared by all
ranks, cuts it into global batches, and gives replica ``r`` of ``R`` the ``r``-th slice of each::

    permutation(seed, epoch):  p0 p1 p2 p3 p4 p5 p6 p7 p8 p9 ...
    global batch 0 (B = 4):    [p0 p1 | p2 p3]     replica 0 reads p0 p1, replica 1 reads p2 p3
    global batch 1:            [p4 p5 | p6 p7]

so over one epoch the replicas are disjoint and together read the permutation's first
``floor(N / B) * B`` samples. With ``drop_last=False`` a final short global batch of ``N mod B``
samples is split as evenly as possible (some replicas may get fewer, even none: reduce metrics as
sums and counts). Pure arithmetic: no processes, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridpar.geometry import shard_range


def epoch_permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The global order of ``n`` samples in ``epoch``: identical on every rank that shares ``seed``.

    The generator is seeded with the pair ``(seed, epoch)`` (numpy's SeedSequence), so runs with
    neighbouring seeds do not replay each other's epochs shifted by one.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(n).astype(np.int64)


def _fits(batch_size: int, data: int) -> str:
    """The multiples of ``data`` nearest to ``batch_size``, for error messages."""
    lo = batch_size // data * data
    return f"{lo} or {lo + data}" if lo else f"{data}"


@dataclass(frozen=True)
class ShardedSampler:
    """Batches of one data-parallel replica: ``batch_size`` is the *global* batch over all replicas."""

    num_samples: int
    batch_size: int
    data: int = 1
    data_index: int = 0
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.batch_size % self.data:
            raise ValueError(
                f"global batch_size {self.batch_size} is not divisible by the data-parallel degree "
                f"{self.data} (grid.data); use a multiple of {self.data}, e.g. "
                f"{_fits(self.batch_size, self.data)}")
        if self.num_samples < 1 or (self.drop_last and self.num_samples < self.batch_size):
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than one global batch of "
                f"{self.batch_size}; use batch_size <= {max(self.num_samples // self.data, 1) * self.data}"
                f" (a multiple of data={self.data}), more samples, or drop_last=False")

    @property
    def local_batch_size(self) -> int:
        """Samples per batch on this replica (the last batch may hold fewer when not drop_last)."""
        return self.batch_size // self.data

    def __len__(self) -> int:
        """Batches per epoch (the same on every replica)."""
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def permutation(self, epoch: int) -> np.ndarray:
        """The global sample order of ``epoch`` (shared by all replicas)."""
        return epoch_permutation(self.num_samples, self.seed, epoch, self.shuffle)

    def batches(self, epoch: int) -> list[list[int]]:
        """This replica's sample indices, batch by batch, for ``epoch``."""
        order = self.permutation(epoch)
        out = []
        for k in range(len(self)):
            start = k * self.batch_size
            size = min(self.batch_size, self.num_samples - start)
            lo, hi = shard_range(size, self.data, self.data_index)
            out.append(order[start + lo:start + hi].tolist())
        return out
