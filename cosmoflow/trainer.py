"""The training loop on hybridpar: data, model, engine, optimizer, checkpoints, metrics.

Two tasks share it (``task`` in the config): ``regress``, CosmoFlow's four parameters of a volume,
and ``reconstruct``, a universe's initial density field voxel by voxel with a U-Net
(:mod:`cosmoflow.reconstruct`); they differ in the model, the target the loader reads and the
validation scores, nothing else.

Why one file: like nanoGPT's ``train.py``, the loop should be readable in one sitting; everything it
calls lives in the library (engine, loader, checkpointer, profiler) or in small application modules
(config, optim, metrics). Launch it with ``launch/train.py`` under torchrun, mpirun or srun.

A run directory holds ``config.yaml``, ``metrics_steps.csv``, ``metrics_epochs.csv``,
``tensorboard/``, ``plots/``, ``checkpoints/`` and ``summary.json`` (and, for ``regress``, the last
validation's per-sample predictions ``val_predictions.npz``; for ``reconstruct``,
``reconstruction.json``). Starting again on the same run directory resumes from its newest complete
checkpoint. SIGTERM (a Slurm time limit) ends the run at the next step boundary with a final
checkpoint; a NaN loss stops it without overwriting the last good checkpoint.
"""

from __future__ import annotations

import json
import math
import random
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

import hybridpar as hp
from cosmoflow import errors, linear_probe
from cosmoflow.config import Config, ConfigError, read_yaml
from cosmoflow.data import open_dataset
from cosmoflow.errors import Stop
from cosmoflow.metrics import PARAMS, Reporter, mae_per_parameter, plot_run, save_predictions
from cosmoflow.model import build_network
from cosmoflow.optim import lr_of_step, make_optimizer, set_lr
from cosmoflow.reconstruct import evaluate_fields, mean_fundamental, report, voxel_of
from hybridpar.checkpoint import (
    Checkpointer,
    CheckpointError,
    faults,
    load_optimizer_state,
    load_weights,
    optimizer_state,
    rng_state,
    set_rng_state,
)
from hybridpar.data import Augment, VolumeLoader
from hybridpar.device.accel import Accel
from hybridpar.process.launchers import launch_world_size
from hybridpar.process.lifetime import collective_timeout
from hybridpar.profiling import StepTimer
from hybridpar.profiling import range as prange
from hybridpar.profiling.hostinfo import machine_info


def _signals() -> dict[str, bool]:
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


def _agree(flag: bool, group=None) -> bool:
    """True on every rank if it is true on any."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    with prange("agree_flags"):  # names the operation should a peer stop answering here
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _write_config(run_dir: Path, cfg: Config) -> None:
    """Keep every configuration a run directory was started with (nothing is overwritten)."""
    path = run_dir / "config.yaml"
    n = 1
    while path.exists():
        if read_yaml(path.read_text(), str(path)) == cfg.to_dict():
            return
        path = run_dir / f"config.{n}.yaml"
        n += 1
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def evaluate(engine: hp.Engine, loader: VolumeLoader
             ) -> tuple[dict[str, float], np.ndarray, np.ndarray, np.ndarray]:
    """Validation loss and MAE per parameter over the whole set (summed over data replicas), and every
    replica's predictions, targets and sample indices (so they can be grouped, e.g. per universe)."""
    engine.eval()
    preds, trues = [], []
    index = np.asarray([i for batch in loader.batches() for i in batch], dtype=np.int64)
    for i, (x_local, y) in enumerate(loader):
        if i == 1:  # a fault-injection point for the recovery tests (mid-validation)
            faults.hit("validate", 0, dist.get_rank())
        out = engine.predict(x_local)
        preds.append(out.detach().cpu().double().numpy())
        trues.append(y.cpu().double().numpy())
    engine.train()
    pred = np.concatenate(preds) if preds else np.zeros((0, 4))
    true = np.concatenate(trues) if trues else np.zeros((0, 4))
    err = pred - true
    sums = torch.tensor([*np.abs(err).sum(0), (err ** 2).sum(), len(pred)], dtype=torch.float64)
    if dist.get_world_size(engine.grid.data_group) > 1:
        dist.all_reduce(sums, group=engine.grid.data_group)
        gathered: list[Any] = [None] * engine.grid.data
        dist.all_gather_object(gathered, (pred, true, index), group=engine.grid.data_group)
        pred = np.concatenate([g[0] for g in gathered])
        true = np.concatenate([g[1] for g in gathered])
        index = np.concatenate([g[2] for g in gathered])
    n = max(sums[-1].item(), 1.0)
    maes = {f"mae_{p}": sums[i].item() / n for i, p in enumerate(PARAMS)}
    metrics = {"val_loss": sums[4].item() / (4 * n), "val_mae": sum(maes.values()) / 4, **maes}
    return metrics, pred, true, index


@torch.no_grad()
def precise_bn(engine: hp.Engine, loader: VolumeLoader, batches: int, epoch: int) -> None:
    """Re-estimate BatchNorm running statistics with the current weights (Wu & Johnson, 2021).

    Running averages taken while the weights move lag behind them; a model whose head normalises
    pooled features across the batch then evaluates far off. Averaging the batch statistics of a few
    training batches, weights frozen, removes the lag. Every replica's batches count: the engine
    averages the statistics over the data-parallel replicas after each training-mode forward.
    """
    norms = [m for _, layer in engine.layers for m in layer.modules()
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    if not norms or batches <= 0:
        return
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    engine.train()
    loader.set_epoch(epoch)
    for i, (x_local, _) in enumerate(loader):
        engine.predict(x_local)
        if i + 1 >= batches:
            break
    for m, mom in zip(norms, saved):
        m.momentum = mom


def _epoch_position(done: int, batch: int, loader_epoch: int) -> str:
    """Where a resumed run stands, epochs counted from 1: ``epoch 2, batch 3``, or the epoch whose steps
    are all done but whose validation is not (the loader already at the next epoch)."""
    if loader_epoch > done:
        return f"epoch {done + 1} trained, its validation next"
    return f"epoch {done + 1}, batch {batch}"


def _command_line(launcher: str, world: int) -> str:
    """The command that started this run, as far as this process can tell (for result files)."""
    args = " ".join(sys.argv)
    if launcher == "torchrun":
        return f"torchrun --nproc-per-node {world} {args}"
    if launcher == "none" or world == 1:
        return f"python {args}"
    return f"{'srun' if launcher == 'slurm' else 'mpirun'} -n {world} python {args}"


def _augment(cfg: Config, train_ds: Any) -> Augment | None:
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


def _init_from(model: torch.nn.Module, path: str, shapes: dict[str, tuple[int, ...]]) -> None:
    """Load a safetensors or weights-only PyTorch state dict (``python -m hybridpar.checkpoint export``
    writes both) into ``model``, every key matching; a bad file or another model is one config line."""
    try:
        state = load_weights(path)
    except CheckpointError as err:
        raise ConfigError(f"model.init_from: {err}") from None
    errors.check_initial(shapes, state, path)
    model.load_state_dict(state, strict=True)


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


def run(cfg: Config) -> dict[str, Any]:
    """Train per ``cfg``; returns the final summary (validation MAE per parameter and the baseline, or
    the reconstruction's scores)."""
    started = time.monotonic()
    spec = hp.ParallelSpec.from_dict(cfg.parallel)
    check_layout(cfg, spec, launch_world_size())  # before the process group, the data and the model
    info = hp.init_distributed(**({"timeout_s": spec.timeout_s} if spec.timeout_s else {}))
    rank = info.rank
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        _write_config(run_dir, cfg)
    torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank

    reconstruct = cfg.task == "reconstruct"
    target = "linear" if reconstruct else "params"
    S, channels = cfg.data.sample_size, cfg.data.channels
    skip = cfg.data.skip_bad
    train_ds = open_dataset(cfg.data.train, sample_size=S, channels=channels, target=target, skip_bad=skip)
    val_ds = open_dataset(cfg.data.val, sample_size=S, channels=channels, target=target, skip_bad=skip)
    augment = _augment(cfg, train_ds)  # data.augment against the data, before the model is built
    t = cfg.train
    accel = Accel(hp.process.launchers.device(), t.precision, t.channels_last, t.compile, t.cuda_graphs)
    model = build_network(cfg).to(accel.device)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.model.ridge_start and not reconstruct:  # the probe at the reference's solution (linear probing)
        linear_probe.start(cfg, model, run_dir, rank)
    if cfg.model.init_from:  # weights trained elsewhere (a resumed checkpoint still wins over them)
        _init_from(model, cfg.model.init_from, shapes)
    batch = cfg.train.batch_size
    # the mean over every voxel (reconstruct) or output: hybridpar weighs each shard by its volume share
    engine = hp.parallelize(model, spec, loss_fn=F.mse_loss, input_shape=(batch, channels, S, S, S),
                            memory_format=accel.memory_format)
    if reconstruct and engine.output_split != engine.input_split:
        raise ValueError(f"task reconstruct: the spec leaves the U-Net's output split {engine.output_split} "
                         f"but its input {engine.input_split}; the target field is read split like the "
                         "input, so give the last layers the first layer's spatial split")
    if rank == 0:  # the layout the planner chose: the whole table in the run directory, its gist here
        (run_dir / "layout.txt").write_text(engine.explain(echo=False) + "\n")
        print(engine.banner(), flush=True)
    grid = engine.grid
    # Dropout masks must agree inside a replica (replicated head), differ between replicas. Python's and
    # numpy's generators are seeded too, so whatever draws from them repeats after a restart.
    replica_seed = cfg.train.seed + 1000 * grid.data_index + 1
    torch.manual_seed(replica_seed)
    random.seed(replica_seed)
    np.random.seed(replica_seed)
    flops = hp.flops.count(model, (1, channels, S, S, S))

    # On a GPU the batches arrive on it as int16 counts and are finished there (log1p), off the step's path
    on_device = accel.device if accel.device.type == "cuda" else None
    loader = VolumeLoader(train_ds, engine.input_grid, batch_size=batch, seed=cfg.train.seed,
                          workers=cfg.data.workers, prefetch=cfg.data.prefetch, stage_dir=cfg.data.stage_dir,
                          augment=augment, device=on_device)
    val_loader = VolumeLoader(val_ds, engine.input_grid, batch_size=batch, shuffle=False, drop_last=False,
                              workers=cfg.data.workers, prefetch=cfg.data.prefetch, device=on_device)
    bn_loader = VolumeLoader(train_ds, engine.input_grid, batch_size=batch, seed=cfg.train.seed + 7,
                             workers=0) if cfg.train.precise_bn_batches > 0 else None
    opt = make_optimizer(cfg.optimizer, engine.parameters(), batch)
    accel.prepare(engine)
    ck = cfg.checkpoint
    ckpt = Checkpointer(run_dir / "checkpoints", grid, local_dir=ck.local_dir,
                        keep_last=ck.keep_last, keep_every=ck.keep_every,
                        keep_every_on="epoch", best=(ck.best_metric, "min") if ck.best_metric else None,
                        config=cfg.to_dict(), timeout_s=collective_timeout().total_seconds())
    ckpt.attach(opt)  # the optimizer step waits for an overlapped snapshot copy, nothing else does

    step, epoch = 0, 0
    resumed = False
    epoch_loss = {"sum": 0.0, "steps": 0}  # this epoch's training losses so far (kept by checkpoints)
    if ck.resume:
        state = ckpt.load()
        if state is not None:
            errors.check_resumable(shapes, state["model"], f"{ckpt.root} (step {state['step']})")
            engine.load_full_state_dict(state["model"])
            load_optimizer_state(engine, opt, state["optimizer"])
            loader.load_state_dict(state["loader"])
            if "rng" in state:
                set_rng_state(state["rng"])
            step, epoch = int(state["step"]), int(state["epoch"])
            epoch_loss.update(state.get("train", {}).get("epoch_loss", {}))
            resumed = True
            if rank == 0:
                print(f"resumed from step {step} ({_epoch_position(epoch, loader.index, loader.epoch)}) in "
                      f"{ckpt.root}", flush=True)

    steps_per_epoch = len(loader)
    reporter = Reporter(run_dir, rank == 0, cfg.logging.tensorboard, cfg.logging.progress,
                        plots=cfg.logging.plots, every=cfg.train.log_every, epochs=cfg.train.epochs,
                        steps_per_epoch=steps_per_epoch)
    if resumed:
        reporter.rewind(step)  # the steps after the checkpoint run again: their rows go
    else:
        # an earlier start's rows set aside, said in one line
        reporter.start_afresh("no checkpoint to resume from" if ck.resume else "checkpoint.resume is false")
    timer = StepTimer(rank=rank)
    total = cfg.train.epochs * steps_per_epoch
    if cfg.train.max_steps is not None:
        total = min(total, cfg.train.max_steps)
    stop = _signals()
    last_save = time.monotonic()

    def save(metadata: dict[str, Any] | None = None, overlap: bool = True) -> None:
        nonlocal last_save
        checks = [torch.isfinite(p).all() for p in engine.parameters()]
        finite = not checks or bool(torch.stack(checks).all())  # one host sync, not one per parameter
        if _agree(not finite):  # never let a diverged model become the newest checkpoint
            raise Stop(f"weights became non-finite by step {step} (epoch {epoch + 1}); not saving. The "
                       f"newest good checkpoint: {errors.newest_checkpoint(ckpt)}; lower optimizer.base_lr")
        state = {"model": engine.local_state_dict(), "optimizer": optimizer_state(engine, opt),
                 "rng": rng_state(), "loader": loader.state_dict(), "step": step, "epoch": epoch,
                 "train": {"epoch_loss": dict(epoch_loss)}}
        ckpt.save(step, state, {"epoch": epoch, **(metadata or {})}, overlap=overlap)
        last_save = time.monotonic()

    metrics: dict[str, Any] = {}
    skipped: set[str] = set()
    pred = true = val_index = fields = None
    k_fundamental = mean_fundamental(val_ds.labels, S, voxel_of(val_ds.locate(0)[0].path))

    def validate(number: int) -> None:
        """Validate after (1-based) epoch ``number``."""
        nonlocal metrics, fields, pred, true, val_index
        reporter.validating(number, len(val_loader))
        if reconstruct:
            metrics, fields = evaluate_fields(engine, val_loader, S, k_fundamental)
        else:
            metrics, pred, true, val_index = evaluate(engine, val_loader)

    try:
        # An epoch whose steps are all done may still owe its validation (a save right after its last
        # step, then a kill): it runs even when no step is left.
        while epoch < cfg.train.epochs and (step < total or loader.epoch > epoch):
            # A save right after an epoch's last step (before its validation) leaves the loader at the
            # next epoch: resumed from it, the epoch's steps are all done and must not run again.
            finished = loader.epoch > epoch
            if not finished:
                loader.set_epoch(epoch)  # keeps a mid-epoch position restored from a checkpoint
            for x_local, y in ([] if finished else loader):
                errors.note_skipped(loader.skipped, skipped)
                set_lr(opt, lr_of_step(cfg.optimizer, batch, step, steps_per_epoch))
                t0 = time.perf_counter()
                with timer.step(step):
                    loss = accel.step(engine, opt, x_local, y)
                dt = time.perf_counter() - t0
                value = loss.item()
                if not math.isfinite(value):
                    bad_input = _agree(not (torch.isfinite(x_local).all() and torch.isfinite(y).all()))
                    batch_of = loader.batches(epoch)[(loader.index or len(loader)) - 1]
                    raise errors.diverged(value, step + 1, epoch, train_ds, batch_of, ckpt, bad_input)
                step += 1
                faults.hit("step", step, rank)  # a fault-injection point for the recovery tests
                epoch_loss["sum"] += value
                epoch_loss["steps"] += 1
                parts = timer.breakdown()
                comm = sum(parts.get(k, 0.0) for k in ("halo", "pipeline", "grad_reduce"))
                reporter.step({"step": step, "epoch": epoch, "loss": value, "lr": opt.param_groups[0]["lr"],
                               "step_s": dt, "samples_per_s": batch / dt,
                               "gflops": flops.total * batch / dt / 1e9,
                               "data_wait_share": min(loader.last_wait / (dt + loader.last_wait), 1.0),
                               "comm_share": comm / dt}, total)
                due = (ck.every_steps and step % ck.every_steps == 0) or \
                    (ck.every_minutes and time.monotonic() - last_save > 60 * ck.every_minutes)
                if _agree(bool(due) or stop["stop"]):
                    if _agree(stop["stop"]):
                        raise KeyboardInterrupt
                    save()
                if step >= total:
                    break
            ended = loader.epoch > epoch  # the epoch ran to its end (else max_steps cut it short)
            if ended:
                epoch += 1
            if ended and epoch % cfg.train.val_every and epoch < cfg.train.epochs and step < total:
                save()  # not a validation epoch: the checkpoint alone (resumable at every epoch)
                continue
            if bn_loader is not None:
                precise_bn(engine, bn_loader, cfg.train.precise_bn_batches, epoch)
            number = epoch if ended else epoch + 1  # the epoch just run, from 1 (cut short: not ended)
            validate(number)
            n = epoch_loss["steps"]
            train_loss = epoch_loss["sum"] / n if n else float("nan")
            reporter.epoch({"epoch": epoch, "last_step": step, "train_loss": train_loss, **metrics}, number)
            if ended:
                epoch_loss.update(sum=0.0, steps=0)
            save({"metrics": metrics})
        if resumed and not metrics:  # resumed from the run's last checkpoint: the report still needs
            validate(max(epoch, 1))   # the final validation (the checkpoint's weights: the same one)
    except KeyboardInterrupt:
        if rank == 0:
            print(f"\nstopping on a signal at step {step}: writing a final checkpoint", flush=True)
        save(overlap=False)
        ckpt.close()
        reporter.close()
        return {"stopped": True, "step": step}
    except Stop:
        ckpt.close()
        reporter.close()
        raise  # main() prints it, once per job
    ckpt.close()
    reporter.close()
    loader.close()
    val_loader.close()
    summary = {"step": step, "epoch": epoch, **metrics}
    if skip:
        summary["skipped_samples"] = errors.skipped_everywhere(skipped | set(val_loader.skipped))
        if rank == 0 and summary["skipped_samples"]:
            print(f"skipped {summary['skipped_samples']} bad samples (data.skip_bad)", flush=True)
    if rank == 0 and fields is not None:
        summary.update(report(run_dir, fields, cfg.logging.plots,
                              command=_command_line(info.launcher, info.world_size), machine=machine_info(),
                              epochs=epoch, steps=step, train_volumes=len(train_ds), channels=channels,
                              world_size=info.world_size, parallel=cfg.parallel,
                              wall_s=round(time.monotonic() - started, 1)))
    if rank == 0 and pred is not None:
        base = mae_per_parameter(np.broadcast_to(train_ds.labels.mean(0), true.shape), true)
        summary["baseline"] = base
        save_predictions(run_dir / "val_predictions.npz", pred, true, val_index, val_ds)
        summary["plots"] = [str(p) for p in plot_run(run_dir, pred, true)] if cfg.logging.plots else []
        print("\nvalidation MAE per parameter (unitPar units), model vs predict-the-training-mean baseline:")
        print(f"  {'parameter':<10} {'model':>8} {'baseline':>9} {'change':>8}")
        for p in PARAMS:
            m, b = metrics[f"mae_{p}"], base[f"mae_{p}"]
            print(f"  {p:<10} {m:8.4f} {b:9.4f} {100 * (m / b - 1):+7.1f}%")
    if rank == 0 and (fields is not None or pred is not None):
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"run directory: {run_dir.resolve()}", flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    """``launch/train.py``'s entry: ``--config FILE [--set key=value ...]``, or ``--help-config``."""
    from cosmoflow.config import load_config  # noqa: PLC0415
    from cosmoflow.train_args import parse  # noqa: PLC0415

    args = parse(argv)
    if args.help_config:
        from cosmoflow.train_args import help_config  # noqa: PLC0415

        sys.stdout.write(help_config())
        return 0
    return errors.run_job(lambda: run(load_config(args.config, args.set)))
