"""What a training run checks, records and builds before its loop: the layout against the world size,
the data against its augmentation, the initial weights against the model; the run directory's records
(the configurations it was started with, the command, where a resumed run stands); the loaders, the
checkpointer and the stop flag of SIGTERM/SIGINT.

Why apart from the loop (:mod:`cosmoflow.trainer`): each has one answer from the config and what it is
handed, and keeps no state of the run's, so the loop reads as its steps; each check is one
:class:`ConfigError` line that the training entry reports with exit 2.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

import hybridpar as hp
from cosmoflow import errors
from cosmoflow.config import Config, ConfigError, read_yaml
from hybridpar.checkpoint import Checkpointer, CheckpointError, load_weights
from hybridpar.data import Augment, VolumeLoader
from hybridpar.process.lifetime import collective_timeout


def check_layout(cfg: Config, spec: hp.ParallelSpec, world: int) -> None:
    """The checks across keys that need only the config and the world size (the grid's product, the
    batch over the data replicas and micro-batches, the sample over the spatial split), run before any
    process group, data set or model exists, so that a layout mistake costs a second, not a start-up.
    Each is one :class:`ConfigError` naming the keys; the planner checks the same again with the model."""
    try:
        grid = spec.resolve_grid(world).grid
    except hp.SpecError as err:
        raise ConfigError(f"parallel.{err}") from None
    batch, micro = cfg.train.batch_size, spec.pipeline.microbatches
    if batch % grid.data:
        fits = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        raise ConfigError(f"train.batch_size: {batch} does not split evenly over parallel.grid "
                          f"data({grid.data}) replicas on {world} rank(s); use a multiple of {grid.data}, "
                          f"or data in {{{fits}}}")
    per = batch // grid.data
    if per % micro:
        fits = ", ".join(str(m) for m in range(1, per + 1) if per % m == 0)
        raise ConfigError(f"parallel.pipeline.microbatches: {micro} does not divide the per-replica batch "
                          f"{per} (train.batch_size {batch} / data({grid.data})); counts that would: {fits}")
    size = cfg.data.sample_size
    for axis, parts in zip("dhw", grid.spatial):
        if parts > size:
            raise ConfigError(f"parallel.grid.spatial: {list(grid.spatial)} splits the {axis} dim in "
                              f"{parts}, but data.sample_size is {size} voxels; split it in at most {size}")


def augmentation(cfg: Config, train_ds: Any) -> Augment | None:
    """The training loader's random views (``data.augment``); rolls only where samples are whole
    periodic universes, since a rolled crop is not a crop of any universe."""
    if cfg.data.augment == "none":
        return None
    shifts = cfg.data.augment.endswith("+shifts")
    if shifts and not train_ds.periodic:
        raise ConfigError(f"data.augment: {cfg.data.augment} rolls samples periodically, but "
                          f"data.sample_size {cfg.data.sample_size} cuts {cfg.data.train}'s files into crops "
                          "(or they are split sub-volumes), which are not periodic; use "
                          "data.augment=symmetries")
    return Augment(symmetries=True, shifts=shifts)


def init_from(model: torch.nn.Module, path: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Load a safetensors or weights-only PyTorch state dict (``python -m hybridpar.checkpoint export``
    writes both) into ``model``, every key matching; a bad file or another model is one config line."""
    try:
        state = load_weights(path)
    except CheckpointError as err:
        raise ConfigError(f"model.init_from: {err}") from None
    errors.check_initial(shapes, state, path)
    model.load_state_dict(state, strict=True)


def write_config(run_dir: Path, cfg: Config) -> None:
    """Keep every configuration a run directory was started with (nothing is overwritten)."""
    path = run_dir / "config.yaml"
    n = 1
    while path.exists():
        if read_yaml(path.read_text(), str(path)) == cfg.to_dict():
            return
        path = run_dir / f"config.{n}.yaml"
        n += 1
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def command_line(launcher: str, world: int) -> str:
    """The command that started this run, as far as this process can tell (for result files)."""
    args = " ".join(sys.argv)
    if launcher == "torchrun":
        return f"torchrun --nproc-per-node {world} {args}"
    if launcher == "none" or world == 1:
        return f"python {args}"
    return f"{'srun' if launcher == 'slurm' else 'mpirun'} -n {world} python {args}"


def epoch_position(done: int, batch: int, loader_epoch: int) -> str:
    """Where a resumed run stands, epochs counted from 1: ``epoch 2, batch 3``, or the epoch whose steps
    are all done but whose validation is not (the loader already at the next epoch)."""
    if loader_epoch > done:
        return f"epoch {done + 1} trained, its validation next"
    return f"epoch {done + 1}, batch {batch}"


def make_loaders(cfg: Config, train_ds: Any, val_ds: Any, grid: Any, device: torch.device,
                 augment: Augment | None) -> tuple[VolumeLoader, VolumeLoader, VolumeLoader | None]:
    """The training loader (with ``augment``'s views), the validation one (every sample, in order) and,
    with ``train.precise_bn_batches``, the one BatchNorm's statistics are re-estimated from; all split
    over the engine's input ``grid``."""
    batch = cfg.train.batch_size
    # On a GPU the batches arrive on it as int16 counts and are finished there (log1p), off the step's path
    on_device = device if device.type == "cuda" else None
    loader = VolumeLoader(train_ds, grid, batch_size=batch, seed=cfg.train.seed,
                          workers=cfg.data.workers, prefetch=cfg.data.prefetch, stage_dir=cfg.data.stage_dir,
                          augment=augment, device=on_device)
    val_loader = VolumeLoader(val_ds, grid, batch_size=batch, shuffle=False, drop_last=False,
                              workers=cfg.data.workers, prefetch=cfg.data.prefetch, device=on_device)
    bn_loader = VolumeLoader(train_ds, grid, batch_size=batch, seed=cfg.train.seed + 7,
                             workers=0) if cfg.train.precise_bn_batches > 0 else None
    return loader, val_loader, bn_loader


def make_checkpointer(cfg: Config, run_dir: Path, grid: Any) -> Checkpointer:
    """The run's checkpoints in ``run_dir/checkpoints``, kept and pinned as the ``checkpoint`` section
    says, each carrying the configuration."""
    ck = cfg.checkpoint
    return Checkpointer(run_dir / "checkpoints", grid, local_dir=ck.local_dir,
                        keep_last=ck.keep_last, keep_every=ck.keep_every,
                        keep_every_on="epoch", best=(ck.best_metric, "min") if ck.best_metric else None,
                        config=cfg.to_dict(), timeout_s=collective_timeout().total_seconds())


def stop_flag() -> dict[str, bool]:
    """Turn SIGTERM/SIGINT into a flag read at step boundaries (all ranks then agree to stop)."""
    flag = {"stop": False}

    def handler(signum, _frame):
        flag["stop"] = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            signal.signal(sig, handler)
        except ValueError:  # not the main thread
            pass
    return flag
