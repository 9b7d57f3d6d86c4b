"""``hybridpar.infer``: a fully convolutional model on whole volumes, file to file, kept split.

Why: the engine exists for volumes too large for one device, and inference on them is where a user
feels it. Tiling a volume (MONAI's ``sliding_window_inference``) leaves seams wherever a window's
normalisation or strided layers see another context than the whole volume's, never wraps around a
periodic box, and holds the whole output on one device. Run split, each rank reads only the input
its first layer needs, the halos make the result the one-process result (circular padding wraps
around the box's faces), and each rank writes only its shard of the output: no rank ever holds a
whole volume.

A reader and a writer are anything indexed as numpy arrays of shape (N, C, D, H, W): an
``h5py.Dataset`` (open the file with the MPI driver, or one file per rank and a virtual dataset, as
``python -m cosmoflow.infer`` does), a ``numpy.memmap``, a zarr array. :func:`infer` reads
``reader[n, :, d0:d1, h0:h1, w0:w1]`` (the rank's hyperslab) and assigns
``writer[n, :, d0:d1, h0:h1, w0:w1]`` (the shard it computed), each distinct shard once.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.redistribute import local_box
from hybridpar.entry import parallelize
from hybridpar.grid import ProcessGrid
from hybridpar.pipeline.engine import Engine
from hybridpar.planner import ParallelSpec

Box = tuple[tuple[int, int], ...]
"""Global (lo, hi) voxel ranges along D, H, W."""


class VolumeReader(Protocol):
    """Volumes (N, C, D, H, W) read by numpy-style basic indexing."""

    shape: Sequence[int]

    def __getitem__(self, index: tuple) -> Any: ...


class VolumeWriter(Protocol):
    """Volumes (N, C', D, H, W) written by numpy-style basic indexing."""

    shape: Sequence[int]

    def __setitem__(self, index: tuple, value: np.ndarray) -> None: ...


def hyperslab(n: int, box: Box) -> tuple:
    """The index of volume ``n``'s ``box`` (all channels) in an (N, C, D, H, W) array."""
    return (n, slice(None), *(slice(lo, hi) for lo, hi in box))


def output_grid(engine: Engine) -> ProcessGrid:
    """The layout of the engine's volume output (the last stage's split)."""
    return engine.layout.of(engine.output_split)


def output_shape(engine: Engine) -> tuple[int, ...]:
    """The global (N, C', D, H, W) the engine's model returns for its build shape."""
    return tuple(engine.stage.lead_output.output_shape)


def writer_boxes(engine: Engine, volume: tuple[int, int, int]) -> dict[int, Box]:
    """Which rank writes which box of the output: of the ranks of one data-parallel replica's last
    stage holding the same box (a replicated or partly replicated output), the lowest writes it (each
    replica writes the volumes it computed). Every rank gets the same map."""
    box = local_box(volume, output_grid(engine)) if engine.last_stage else None
    mine = (engine.grid.data_index, box)
    every: list[Any] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    owners: dict[tuple[int, Box], int] = {}
    for rank, (replica, b) in enumerate(every):
        if b is not None:
            owners.setdefault((replica, tuple(map(tuple, b))), rank)
    return {rank: b for (_, b), rank in owners.items()}


def infer(engine_or_model: Engine | nn.Module, reader: VolumeReader, writer: VolumeWriter, *,
          spec: ParallelSpec | dict | None = None, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None,
          each: Callable[[int, torch.Tensor], None] | None = None,
          progress: Callable[[int, int, float], None] | None = None) -> Engine:
    """Run a fully convolutional model over every volume of ``reader``, writing ``writer``, split.

    ``engine_or_model``: an :class:`Engine` (built at any size: it runs at the reader's, which its
    split must take; unbuilt, it is built for one volume per data-parallel replica), or a model,
    parallelized here by ``spec`` (default: the world split along D). Volumes go to the
    data-parallel replicas in turn, one at a time. On every rank of the last stage,
    ``each(n, y_local)`` receives the shard of volume ``n`` before it is written (to score it, say: a
    collective over :func:`output_grid` is fine), and on every rank ``progress(n, N, seconds)``
    follows each volume. Every rank must call this. Returns
    the engine, in eval mode.
    """
    n_vol, channels, *volume = (int(s) for s in reader.shape)
    if len(volume) != 3:
        raise ValueError(f"hybridpar.infer: the reader's volumes are (N, C, D, H, W); got shape "
                         f"{tuple(reader.shape)}")
    size = (channels, *volume)
    if isinstance(engine_or_model, Engine):
        engine = engine_or_model
    else:
        world = dist.get_world_size() if dist.is_initialized() else 1
        engine = parallelize(engine_or_model, spec or {"grid": {"spatial": [world, 1, 1]}})
    # one volume per replica at a time, at the reader's size (any size the built split takes)
    engine.bind((engine.grid.data, *size), "hybridpar.infer")
    engine.eval()
    out = output_shape(engine)
    if len(out) != 5 or tuple(out[2:]) != tuple(volume):
        raise ValueError(f"hybridpar.infer: the model maps {size} to {out[1:]}; whole-box inference needs a "
                         f"fully convolutional model whose output has the input's extent")
    want = (n_vol, *out[1:])
    if tuple(writer.shape) != want:
        raise ValueError(f"hybridpar.infer: the writer holds {tuple(writer.shape)}; the model writes {want}")
    owners = writer_boxes(engine, tuple(volume))
    rank = dist.get_rank() if dist.is_initialized() else 0
    in_box = local_box(tuple(volume), engine.input_grid)
    grid = engine.grid
    # predict agrees on the size with the whole job, so every replica makes as many calls: one short
    # of volumes repeats its last and drops the result
    for step in range(-(-n_vol // grid.data)):
        n = step * grid.data + grid.data_index
        spare = n >= n_vol
        n = min(n, n_vol - 1)
        t0 = time.perf_counter()
        if engine.first_stage:
            x = np.asarray(reader[hyperslab(n, in_box)])
            x_local = torch.from_numpy(np.ascontiguousarray(x)).to(dtype=dtype)[None]
            if device is not None:
                x_local = x_local.to(device)
        else:  # later stages receive their input from the previous stage
            x_local = None
        y = engine.predict(x_local, batch=1, gather=False)  # this rank's shard, never the whole volume
        if engine.last_stage and not isinstance(y, torch.Tensor):
            raise ValueError(f"hybridpar.infer: the model returns a {type(y).__name__}; infer writes one "
                             "volume output (wrap the model to return the tensor to write)")
        if spare:
            continue
        if engine.last_stage:
            if each is not None:
                each(n, y)
            if rank in owners:
                writer[hyperslab(n, owners[rank])] = y[0].detach().cpu().numpy()
        if progress is not None:
            progress(n, n_vol, time.perf_counter() - t0)
    return engine
