"""Input for hybrid-parallel training: each rank reads its own sub-volume of its replica's batches.

The pieces, one idea per module:

* :mod:`~hybridpar.data.dataset` - what a dataset must offer (``len``, ``read(i, region)``);
* :mod:`~hybridpar.data.sampler` - a global shuffle per epoch from a shared seed, *then* a shard per
  data-parallel replica;
* :mod:`~hybridpar.data.input_placement` - which replica and which spatial shard a rank reads;
* :mod:`~hybridpar.data.augment` - random symmetries (flips, transposes, periodic rolls) of a sample,
  each rank reading only the pre-image of its shard;
* :mod:`~hybridpar.data.workers` - reader processes prefetching batches through shared memory;
* :mod:`~hybridpar.data.host_slots` - the reused, page-locked batch buffers they write into when the
  loader delivers on a GPU;
* :mod:`~hybridpar.data.device_stage` - batches moved to the device on a side stream as they arrive,
  and finished there (a dataset's :class:`StoredForm`);
* :mod:`~hybridpar.data.staging` - copying the dataset's files to node-local storage first;
* :mod:`~hybridpar.data.hdf5` - what an HDF5 file may point at (nothing outside its folder) and claim
  (no more than it holds), checked before it is read;
* :mod:`~hybridpar.data.split_hdf5` - :class:`SplitHdf5`, one HDF5 dataset written by many ranks, each
  its hyperslab (the output of split inference, :func:`hybridpar.infer`);
* :mod:`~hybridpar.data.loader` - :class:`VolumeLoader`, which puts them together and keeps the
  position a checkpoint saves.

Example::

    loader = VolumeLoader(dataset, grid, batch_size=64, workers=2, prefetch=2)
    loader.load_state_dict(ckpt["loader"])          # on resume
    for x_local, y in loader:                       # x_local: (64 // grid.data, C, d, h, w)
        ...
        ckpt["loader"] = loader.state_dict()
"""

from hybridpar.data.augment import Augment, View
from hybridpar.data.dataset import FileBacked, Region, StoredForm, VolumeDataset, read_batch
from hybridpar.data.input_placement import Placement
from hybridpar.data.loader import VolumeLoader
from hybridpar.data.sampler import ShardedSampler, epoch_permutation
from hybridpar.data.split_hdf5 import SplitHdf5
from hybridpar.data.staging import ProgressBar, stage_dataset, stage_files
from hybridpar.data.workers import WorkerError

__all__ = [
    "Augment",
    "FileBacked",
    "Placement",
    "ProgressBar",
    "Region",
    "ShardedSampler",
    "SplitHdf5",
    "StoredForm",
    "VolumeDataset",
    "View",
    "VolumeLoader",
    "WorkerError",
    "epoch_permutation",
    "read_batch",
    "stage_dataset",
    "stage_files",
]
