"""What the loader asks of a dataset, and how a batch is read from one.

Why a protocol and not a base class: the loader is generic (CosmoFlow universes, CT scans, climate
fields), so any object with ``len(ds)`` and ``ds.read(i, region)`` will do. Two properties matter for
scale and are part of the contract:

* ``read(i, region)`` reads **only** the hyperslab ``region`` (three slices over the sample's voxel
  dims D, H, W) from storage, so a rank of a spatial group reads about 1/P of every sample;
* the object pickles cheaply and opens its files lazily, because worker processes receive a pickled
  copy and h5py handles can neither cross a fork nor be pickled.

Optional attributes the loader uses when present: ``sample_shape`` (``(C, D, H, W)`` or
``(D, H, W)``; needed to split samples spatially), ``bytes_read`` (a running count the loader sums
over its workers), ``take_skipped()`` (descriptions of bad samples the dataset read something else in
place of since the last call; the loader gathers them from its workers into ``loader.skipped``), and
the :class:`FileBacked` pair used by staging.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

Region = tuple[slice, slice, slice]


@runtime_checkable
class VolumeDataset(Protocol):
    """Samples ``0..len-1``; ``read`` returns ``(x, y)``, x a float32 tensor of shape (C, d, h, w)."""

    def __len__(self) -> int: ...

    def read(self, i: int, region: Region | None = None) -> tuple[torch.Tensor, object]: ...


@runtime_checkable
class FileBacked(Protocol):
    """A dataset that can be pointed at copies of its files (used to stage them on node-local disk).

    ``files`` lists every file the dataset reads; ``with_files(paths)`` returns the same dataset
    (same samples, same order) reading ``paths[k]`` wherever it read ``files[k]``.
    """

    files: Sequence[str]

    def with_files(self, paths: Sequence[str]) -> FileBacked: ...


@runtime_checkable
class StoredForm(Protocol):
    """A dataset whose samples can travel in the form they are stored in and be finished on the device.

    ``read_stored(i, region)`` returns ``(x, y)`` with ``x`` as stored (for CosmoFlow: int16 counts,
    (d, h, w, C) channels last), and ``finish`` turns a batch of those, stacked on dim 0, into what
    ``read`` would have given: float (b, C, d, h, w), torch operations only, so it runs on any device.
    The loader uses the pair when it delivers batches to a device (``VolumeLoader(device=...)``).
    """

    def read_stored(self, i: int, region: Region | None = None) -> tuple[torch.Tensor, object]: ...

    def finish(self, x: torch.Tensor) -> torch.Tensor: ...


def read_batch(dataset: VolumeDataset, indices: Sequence[object], region: Region | None,
               shared: bool = False, stored: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ``indices`` (their ``region`` only) and stack them into ``(x, y)`` batch tensors. An item
    is a sample index or an ``(index, view)`` pair (an augmented read, :mod:`hybridpar.data.augment`).

    With ``shared`` (in a worker process) the batch is stacked straight into shared memory, which
    saves the copy ``share_memory_()`` would make before the batch crosses to the trainer. With
    ``stored`` the samples are read in their stored form (:class:`StoredForm`), to be finished later.

    An empty ``indices`` (a replica's share of a short last batch) still needs the batch's shapes,
    so it reads sample 0 and keeps none of it.
    """
    probe = list(indices) if len(indices) else [0]
    xs, ys = [], []
    for item in probe:
        x, y = _read_item(dataset, item, region, stored)
        xs.append(torch.as_tensor(x))
        ys.append(torch.as_tensor(y))
    if not len(indices):
        return torch.stack(xs)[:0].clone(), torch.stack(ys)[:0].clone()
    if not shared:
        return torch.stack(xs), torch.stack(ys)
    return _stack_shared(xs), _stack_shared(ys)


def read_stored_into(dataset: VolumeDataset, indices: Sequence[int], region: Region | None,
                     out: torch.Tensor) -> torch.Tensor:
    """Read the stored form of ``indices`` (their ``region``) into ``out[:len(indices)]`` (a buffer of
    the batch's shape, :mod:`~hybridpar.data.host_slots`); returns the stacked targets."""
    if not len(indices):  # a replica's share of a short last batch: no samples, the targets' shape
        _, y = _read_item(dataset, 0, region, stored=True)
        return torch.as_tensor(y)[None][:0].clone()
    ys = []
    for j, i in enumerate(indices):
        x, y = _read_item(dataset, i, region, stored=True)
        x = torch.as_tensor(x)
        if tuple(x.shape) != tuple(out.shape[1:]) or x.dtype != out.dtype:
            raise ValueError(f"sample {i}: stored form {tuple(x.shape)} {x.dtype}, but this loader's batches "
                             f"hold {tuple(out.shape[1:])} {out.dtype} (the first sample's); every sample's "
                             f"region must have one stored shape and dtype")
        out[j].copy_(x)
        ys.append(torch.as_tensor(y))
    return torch.stack(ys)


def _read_item(dataset: VolumeDataset, item: object, region: Region | None,
               stored: bool = False) -> tuple[torch.Tensor, object]:
    """One item of a batch: a sample index, or ``(index, view)`` where the loader augments (the view
    reads the pre-image of ``region`` and transforms it: :class:`hybridpar.data.augment.View`)."""
    if stored:
        if isinstance(item, tuple):
            raise ValueError("an augmented read is finished on the host: the stored form is read only "
                             "without augment")
        return dataset.read_stored(int(item), region)  # type: ignore[attr-defined]
    if isinstance(item, tuple):
        index, view = item
        return view.read(dataset, int(index), region)
    return dataset.read(int(item), region)


def take_skipped(dataset: object) -> list[str]:
    """The dataset's skipped-sample notes since the last call, if it keeps any (see the module doc)."""
    take = getattr(dataset, "take_skipped", None)
    return list(take()) if callable(take) else []


def _stack_shared(items: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(items)`` allocated in shared memory (as torch's own DataLoader collate does)."""
    first = items[0]
    shape = (len(items), *first.shape)
    storage = first.untyped_storage()._new_shared(math.prod(shape) * first.element_size())
    return torch.stack(items, out=first.new_empty(0).set_(storage, 0, shape))


def spatial_extent(dataset: object, sample_shape: Sequence[int] | None) -> tuple[int, int, int] | None:
    """The sample's (D, H, W): from ``sample_shape`` if given, else ``dataset.sample_shape``."""
    shape = sample_shape if sample_shape is not None else getattr(dataset, "sample_shape", None)
    if shape is None:
        return None
    shape = tuple(int(s) for s in shape)
    if len(shape) not in (3, 4):
        raise ValueError(f"sample_shape must be (C, D, H, W) or (D, H, W), got {shape}")
    return shape[-3], shape[-2], shape[-1]
