"""The sharded volume loader: this rank's sub-volume of this replica's batches, prefetched.

Why: in hybrid spatial/data parallel training no rank should ever hold a whole sample. Every rank of
a spatial group walks the same batches in the same order (:mod:`~hybridpar.data.sampler`) and reads
only its own balanced shard of each sample (:mod:`~hybridpar.data.input_placement`), so the input lands
split exactly as the first distributed layer expects, and I/O per rank shrinks as 1/P. Reads run in
background processes (:mod:`~hybridpar.data.workers`) ``prefetch`` batches ahead, and the time the
training loop still spends blocked on data is measured, since that is what a data-wait share reports.

Position: the loader remembers the epoch and the index of the *next* batch; ``state_dict()`` saved in
a checkpoint and ``load_state_dict()`` on resume give exactly the remaining batches in the same
order. Because ``index`` counts *global* batches, a resume on a different number of replicas with
the same global batch size also continues the same sample sequence.
"""

from __future__ import annotations

import functools
import os
import time
import weakref
from collections.abc import Iterator, Sequence

import torch

from hybridpar.data.augment import Augment
from hybridpar.data.dataset import StoredForm, VolumeDataset, read_batch, spatial_extent, take_skipped
from hybridpar.data.device_stage import DeviceStage
from hybridpar.data.host_slots import HostSlots
from hybridpar.data.input_placement import Placement
from hybridpar.data.sampler import ShardedSampler
from hybridpar.data.staging import stage_dataset
from hybridpar.data.workers import WorkerPool

Batch = tuple[torch.Tensor, torch.Tensor]


class VolumeLoader:
    """Iterate ``(x_local, y)`` batches of this rank for one epoch at a time.

    ``x_local`` has shape ``(b, C, d, h, w)``: ``b = batch_size // grid.data`` samples (``batch_size``
    is the *global* batch), each cut to this rank's shard along D, H and W; ``y`` has shape
    ``(b, ...)`` and is the same on every rank of a spatial group. ``grid`` is a
    :class:`hybridpar.ProcessGrid`, a :class:`Placement`, any object with ``data``, ``data_index``,
    ``spatial_shape`` and ``spatial_coord``, or ``None`` (one rank, whole samples).

    ``workers`` reader processes keep ``prefetch`` batches each in flight (like ``prefetch_factor``
    of ``torch.utils.data.DataLoader``); ``workers=0`` reads synchronously in this process (for
    debugging). Workers start at the first iteration and live until :meth:`close` (or the loader is
    garbage collected, or the interpreter exits); use the loader as a context manager to be explicit.
    ``start_method`` picks the multiprocessing start method (default: ``forkserver`` where the
    platform has it, since forking a multi-threaded trainer can hang the child); the dataset is
    pickled into each worker either way, so no open file handle crosses a fork.

    ``stage_dir`` copies the dataset's files there first (see :mod:`~hybridpar.data.staging`), with a
    progress bar on stderr (``progress=None``: on each node's first rank only).
    ``sample_shape`` (``(C, D, H, W)`` or ``(D, H, W)``) is needed for a spatial split (and for
    ``augment``) unless the dataset has a ``sample_shape`` attribute.

    ``augment`` (:class:`~hybridpar.data.augment.Augment`) gives every sample of every epoch a random
    view (the cube's symmetries, periodic rolls), the same on every rank of its spatial group, each
    rank reading only what its shard comes from; a resumed run draws the same views.

    ``device`` delivers the batches on that device (:mod:`~hybridpar.data.device_stage`): moved there on
    a side stream as they arrive from the workers, so the training step finds them in place. A dataset
    that has a stored form (:class:`~hybridpar.data.dataset.StoredForm`) then crosses in it and is
    finished on the device (CosmoFlow: int16 counts, ``log1p`` on the GPU), unless ``augment`` is
    set (views are taken of finished samples, on the host).
    """

    def __init__(self, dataset: VolumeDataset, grid: object | None = None, batch_size: int = 1, *,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = True, prefetch: int = 2,
                 workers: int = 1, stage_dir: str | os.PathLike | None = None,
                 sample_shape: Sequence[int] | None = None, start_method: str | None = None,
                 progress: bool | None = None, augment: Augment | None = None,
                 device: torch.device | str | None = None) -> None:
        if workers < 0:
            raise ValueError(f"workers must be >= 0 (0 reads in this process), got {workers}")
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1 batch per worker, got {prefetch}")
        if not isinstance(dataset, VolumeDataset):
            raise TypeError(f"a {type(dataset).__name__} is not a volume dataset: it needs __len__ "
                            f"and read(i, region=None) -> (x, y)")
        self.placement = Placement.of(grid)
        if stage_dir is not None:
            dataset = stage_dataset(dataset, stage_dir, progress=progress)
        self.dataset = dataset
        self.sampler = ShardedSampler(len(dataset), batch_size, self.placement.data,
                                      self.placement.data_index, shuffle, seed, drop_last)
        self.region = None
        self.augment = augment
        self.extent = spatial_extent(dataset, sample_shape)
        if self.extent is None and (self.placement.is_split or augment is not None):
            why = f"a spatial split {self.placement.spatial_shape}" if self.placement.is_split else "augment"
            raise ValueError(f"{why} needs the sample's voxel extent: pass sample_shape=(C, D, H, W) or "
                             f"give the dataset a 'sample_shape' attribute")
        if self.placement.is_split:
            self.region = self.placement.region(self.extent)
        self.workers, self.prefetch, self.start_method = workers, prefetch, start_method
        self.stored = device is not None and augment is None and isinstance(dataset, StoredForm)
        """Whether samples cross in their stored form and are finished on ``device``."""
        self._stage = None if device is None else DeviceStage(
            device, dataset.finish if self.stored else None)  # type: ignore[attr-defined]
        self.epoch = 0
        self.index = 0
        self.wait_time = 0.0
        self.last_wait = 0.0
        self._worker_bytes = 0
        self.skipped: list[str] = []
        """What the dataset reported skipping (``take_skipped``), in this process and its workers."""
        self._main_bytes0 = getattr(dataset, "bytes_read", None)
        self._generation = 0
        self._pool: WorkerPool | None = None
        self._carry: tuple[tuple[int, int], int, int] | None = None  # next-epoch reads in flight
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ sizes
    def __len__(self) -> int:
        """Batches per epoch (the same on every rank)."""
        return len(self.sampler)

    @property
    def batch_size(self) -> int:
        """The global batch over all data-parallel replicas."""
        return self.sampler.batch_size

    @property
    def local_batch_size(self) -> int:
        """Samples per batch on this rank."""
        return self.sampler.local_batch_size

    @property
    def seed(self) -> int:
        return self.sampler.seed

    @property
    def bytes_read(self) -> int | None:
        """Bytes the dataset reported reading, summed over workers (None if it does not count)."""
        if self._main_bytes0 is None:
            return None
        return self._worker_bytes + (self.dataset.bytes_read - self._main_bytes0)

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, int]:
        """``{'epoch', 'index', 'seed'}``: the epoch and in-epoch index of the next batch."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a saved position (adopting its seed, so the order is the saved run's)."""
        epoch, index, seed = int(state["epoch"]), int(state["index"]), int(state["seed"])
        if not 0 <= index <= len(self) or epoch < 0:
            raise ValueError(f"saved loader position epoch {epoch} batch {index} does not fit this "
                             f"loader's {len(self)} batches per epoch (dataset or batch size changed?)")
        if seed != self.seed:
            s = self.sampler
            self.sampler = ShardedSampler(s.num_samples, s.batch_size, s.data, s.data_index,
                                          s.shuffle, seed, s.drop_last)
        self.epoch, self.index = (epoch + 1, 0) if index == len(self) else (epoch, index)

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at its first batch, unless the loader already sits inside ``epoch``.

        The exception makes the usual loop (``for e in range(start, E): loader.set_epoch(e)``) keep a
        mid-epoch position restored by :meth:`load_state_dict`.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.index = epoch, 0

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This replica's sample indices, batch by batch, of ``epoch`` (default: the current one)."""
        return self.sampler.batches(self.epoch if epoch is None else epoch)

    def _items(self, epoch: int) -> list[list[object]]:
        """What the readers read in ``epoch``: sample indices, or ``(index, view)`` pairs where the
        loader augments (the view a function of seed, epoch and index: the same on every rank)."""
        batches = self.sampler.batches(epoch)
        if self.augment is None:
            return batches
        return [[(i, self.augment.view(self.seed, epoch, i, self.extent)) for i in b] for b in batches]

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch; afterwards the loader sits at the next epoch."""
        self._generation += 1
        generation, epoch, start = self._generation, self.epoch, self.index
        batches = self._items(epoch)
        reads = self._sync_reads if self.workers == 0 else self._pooled_reads
        for k, batch in enumerate(reads(epoch, batches, start), start):
            self.epoch, self.index = (epoch, k + 1) if k + 1 < len(batches) else (epoch + 1, 0)
            yield batch
            if self._generation != generation:  # checked before the next read is even asked for
                raise RuntimeError("this loader iterator was superseded by a newer iter(loader); a "
                                   "loader serves one iteration at a time")

    def _timed(self, t0: float) -> None:
        self.last_wait = time.perf_counter() - t0
        self.wait_time += self.last_wait

    def _sync_reads(self, epoch: int, batches: list[list[int]], start: int) -> Iterator[Batch]:
        for k in range(start, len(batches)):
            t0 = time.perf_counter()
            batch = read_batch(self.dataset, batches[k], self.region, stored=self.stored)
            if self._stage is not None:
                batch = self._stage.take(*self._stage.put(*batch))
            self._timed(t0)
            self.skipped += take_skipped(self.dataset)
            yield batch

    def _pooled_reads(self, epoch: int, batches: list[list[int]], start: int) -> Iterator[Batch]:
        """Batches from the workers, keeping ``workers * prefetch`` in flight.

        Near the end of an epoch the look-ahead runs on into the next epoch (whose order is known
        from the seed), so the next epoch's first batch is not a cold read. If the next iteration
        starts anywhere else (``set_epoch``, ``load_state_dict``), those reads are dropped.
        """
        pool = self._ensure_pool()
        carry, self._carry = self._carry, None
        if carry is not None and carry[:2] == ((epoch, start), pool.generation):
            generation, sent = pool.generation, start + carry[2]
        else:
            generation, sent = pool.begin(), start
        depth, n = self.workers * self.prefetch, len(batches)
        following: list[list[int]] | None = None
        for k in range(start, n):
            while sent - k < depth:
                if sent < n:
                    pool.submit(generation, (epoch, sent), batches[sent])
                else:
                    if following is None:
                        following = self._items(epoch + 1)
                    if sent - n >= len(following):
                        break
                    pool.submit(generation, (epoch + 1, sent - n), following[sent - n])
                sent += 1
            t0 = time.perf_counter()
            x, y, nbytes, skipped = pool.get(generation, (epoch, k))
            if self._stage is not None:
                x, y = self._stage.take(x, y)
            self._timed(t0)
            self._worker_bytes += nbytes
            self.skipped += skipped
            if k == n - 1:
                self._carry = ((epoch + 1, 0), generation, sent - n)
            yield x, y

    def _ensure_pool(self) -> WorkerPool:
        if self._pool is None or self._pool.closed:
            self.close()  # detach the finalizer of a pool that closed itself after a worker error
            stage, slots = self._stage, None
            on_arrival = None if stage is None else stage.put
            if stage is not None and self.stored and len(self.dataset):  # in reused, page-locked buffers
                before = getattr(self.dataset, "bytes_read", None)
                probe, _ = read_batch(self.dataset, [0], self.region, stored=True)  # the batch's shape
                if self._main_bytes0 is not None:  # not a read of the training's: left out of bytes_read
                    self._main_bytes0 += self.dataset.bytes_read - before
                slots = HostSlots(2 * self.workers, (self.local_batch_size, *probe.shape[1:]), probe.dtype,
                                  stage.device)
                on_arrival = functools.partial(stage.put, copied=True)
            self._pool = WorkerPool(self.dataset, self.region, self.workers, self.start_method, self.stored,
                                    on_arrival, slots)
            self._finalizer = weakref.finalize(self, self._pool.close)
        return self._pool

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of live reader processes (empty before the first iteration or after close)."""
        return [] if self._pool is None or self._pool.closed else self._pool.pids

    def close(self) -> None:
        """Stop the reader processes (a later iteration starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()  # runs pool.close once and detaches
            self._finalizer = None
        self._pool = None

    def __enter__(self) -> VolumeLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.placement
        return (f"VolumeLoader({len(self.dataset)} samples, batch {self.batch_size} "
                f"({self.local_batch_size} per replica {p.data_index}/{p.data}), spatial "
                f"{p.spatial_shape} coord {p.spatial_coord}, region {self.region}, epoch {self.epoch} "
                f"batch {self.index}/{len(self)}, workers {self.workers}x{self.prefetch})")
