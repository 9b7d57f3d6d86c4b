"""The training loop on hybridpar: data, model, engine, optimizer, checkpoints, metrics.

Two tasks share it (``task`` in the config): ``regress``, CosmoFlow's four parameters of a volume,
and ``reconstruct``, a universe's initial density field voxel by voxel with a U-Net
(:mod:`cosmoflow.reconstruct`); they differ in the model, the target the loader reads and the
validation scores, nothing else.

Why one file for the loop: like nanoGPT's ``train.py``, it should be readable in one sitting, as the
named steps of :func:`run`; everything it calls lives in the library (engine, loader, checkpointer,
profiler) or in small application modules (config, optim, metrics, the checks and records before the
loop in :mod:`cosmoflow.train_setup`, validation in :mod:`cosmoflow.train_eval`). Launch it with
``launch/train.py`` under torchrun, mpirun or srun.

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
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

import hybridpar as hp
from cosmoflow import errors, linear_probe
from cosmoflow.config import Config
from cosmoflow.data import open_dataset
from cosmoflow.errors import Stop
from cosmoflow.metrics import Reporter
from cosmoflow.model import build_network
from cosmoflow.optim import lr_of_step, make_optimizer, set_lr
from cosmoflow.reconstruct import evaluate_fields, mean_fundamental, report, voxel_of
from cosmoflow.train_eval import evaluate, precise_bn, report_regress
from cosmoflow.train_setup import (
    augmentation,
    check_layout,
    command_line,
    epoch_position,
    init_from,
    make_checkpointer,
    make_loaders,
    stop_flag,
    write_config,
)
from hybridpar.checkpoint import faults, load_optimizer_state, optimizer_state, rng_state, set_rng_state
from hybridpar.data import Augment
from hybridpar.device.accel import Accel
from hybridpar.process.launchers import launch_world_size
from hybridpar.profiling import StepTimer
from hybridpar.profiling import range as prange
from hybridpar.profiling.hostinfo import machine_info


def _agree(flag: bool, group=None) -> bool:
    """True on every rank if it is true on any."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0])
    with prange("agree_flags"):  # names the operation should a peer stop answering here
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


class Training:
    """One training run's state, built and advanced by :func:`run`'s steps in their order."""

    def __init__(self, cfg: Config) -> None:
        """The layout checked against the world size, then the process group and the run directory."""
        self.cfg = cfg
        self.started = time.monotonic()
        self.spec = spec = hp.ParallelSpec.from_dict(cfg.parallel)
        check_layout(cfg, spec, launch_world_size())  # before the process group, the data and the model
        self.info = hp.init_distributed(**({"timeout_s": spec.timeout_s} if spec.timeout_s else {}))
        self.rank = self.info.rank
        self.run_dir = Path(cfg.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_config(self.run_dir, cfg)
        torch.manual_seed(cfg.train.seed)  # the same initial weights on every rank
        self.reconstruct = cfg.task == "reconstruct"
        self.S, self.channels, self.batch = cfg.data.sample_size, cfg.data.channels, cfg.train.batch_size
        self.metrics: dict[str, Any] = {}
        self.skipped: set[str] = set()
        self.pred = self.true = self.val_index = self.fields = None

    def open_data(self) -> Augment | None:
        """The training and validation sets, and the training loader's views (``data.augment``, checked
        against the data before the model is built)."""
        cfg = self.cfg
        how = {"sample_size": self.S, "channels": self.channels, "skip_bad": cfg.data.skip_bad,
               "target": "linear" if self.reconstruct else "params"}
        self.train_ds = open_dataset(cfg.data.train, **how)
        self.val_ds = open_dataset(cfg.data.val, **how)
        return augmentation(cfg, self.train_ds)

    def build_model(self) -> torch.nn.Module:
        """The network on this rank's device, at its initial weights (a ridge probe's, ``init_from``'s)."""
        cfg, t = self.cfg, self.cfg.train
        self.accel = Accel(hp.process.launchers.device(), t.precision, t.channels_last, t.compile,
                           t.cuda_graphs)
        model = build_network(cfg).to(self.accel.device)
        self.shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        if cfg.model.ridge_start and not self.reconstruct:  # the probe at the reference's solution
            linear_probe.start(cfg, model, self.run_dir, self.rank)
        if cfg.model.init_from:  # weights trained elsewhere (a resumed checkpoint still wins over them)
            init_from(model, cfg.model.init_from, self.shapes)
        return model

    def parallelize(self, model: torch.nn.Module) -> None:
        """The engine over the grid, its layout reported, each replica's generators seeded."""
        cfg, S, channels = self.cfg, self.S, self.channels
        # the mean over every voxel (reconstruct) or output: hybridpar weighs each shard by its volume share
        engine = hp.parallelize(model, self.spec, loss_fn=F.mse_loss,
                                input_shape=(self.batch, channels, S, S, S),
                                memory_format=self.accel.memory_format)
        if self.reconstruct and engine.output_split != engine.input_split:
            raise ValueError(f"task reconstruct: the spec leaves the U-Net's output split "
                             f"{engine.output_split} but its input {engine.input_split}; the target field is "
                             "read split like the input, so give the last layers the first layer's spatial "
                             "split")
        if self.rank == 0:  # the layout the planner chose: the whole table in the run directory, its gist
            (self.run_dir / "layout.txt").write_text(engine.explain(echo=False) + "\n")
            print(engine.banner(), flush=True)
        self.engine = engine
        # Dropout masks must agree inside a replica (replicated head), differ between replicas. Python's
        # and numpy's generators are seeded too, so whatever draws from them repeats after a restart.
        replica_seed = cfg.train.seed + 1000 * engine.grid.data_index + 1
        torch.manual_seed(replica_seed)
        random.seed(replica_seed)
        np.random.seed(replica_seed)
        self.flops = hp.flops.count(model, (1, channels, S, S, S))

    def make_loaders(self, augment: Augment | None) -> None:
        """The loaders, the optimizer, the engine prepared for the step, and the checkpointer."""
        cfg = self.cfg
        self.loader, self.val_loader, self.bn_loader = make_loaders(
            cfg, self.train_ds, self.val_ds, self.engine.input_grid, self.accel.device, augment)
        self.opt = make_optimizer(cfg.optimizer, self.engine.parameters(), self.batch)
        self.accel.prepare(self.engine)
        self.ckpt = make_checkpointer(cfg, self.run_dir, self.engine.grid)
        self.ckpt.attach(self.opt)  # the optimizer step waits for an overlapped snapshot copy, nothing else

    def resume(self) -> None:
        """Step, epoch, weights, optimizer, loader and generators from the newest complete checkpoint, if
        ``checkpoint.resume`` and there is one; else from the start."""
        self.step, self.epoch, self.resumed = 0, 0, False
        self.epoch_loss = {"sum": 0.0, "steps": 0}  # this epoch's training losses so far (checkpointed)
        if not self.cfg.checkpoint.resume:
            return
        ckpt, loader = self.ckpt, self.loader
        state = ckpt.load()
        if state is None:
            return
        errors.check_resumable(self.shapes, state["model"], f"{ckpt.root} (step {state['step']})")
        self.engine.load_full_state_dict(state["model"])
        load_optimizer_state(self.engine, self.opt, state["optimizer"])
        loader.load_state_dict(state["loader"])
        if "rng" in state:
            set_rng_state(state["rng"])
        self.step, self.epoch = int(state["step"]), int(state["epoch"])
        self.epoch_loss.update(state.get("train", {}).get("epoch_loss", {}))
        self.resumed = True
        if self.rank == 0:
            print(f"resumed from step {self.step} ({epoch_position(self.epoch, loader.index, loader.epoch)}) "
                  f"in {ckpt.root}", flush=True)

    def start_reporting(self) -> None:
        """The metrics' reporter (rows after a resumed step set aside), the step timer, the number of
        steps, the stop flag of SIGTERM/SIGINT, and the validation's fundamental wave number."""
        cfg = self.cfg
        self.steps_per_epoch = len(self.loader)
        self.reporter = Reporter(self.run_dir, self.rank == 0, cfg.logging.tensorboard, cfg.logging.progress,
                                 plots=cfg.logging.plots, every=cfg.train.log_every, epochs=cfg.train.epochs,
                                 steps_per_epoch=self.steps_per_epoch)
        if self.resumed:
            self.reporter.rewind(self.step)  # the steps after the checkpoint run again: their rows go
        else:
            # an earlier start's rows set aside, said in one line
            self.reporter.start_afresh("no checkpoint to resume from" if cfg.checkpoint.resume
                                       else "checkpoint.resume is false")
        self.timer = StepTimer(rank=self.rank)
        self.total = cfg.train.epochs * self.steps_per_epoch
        if cfg.train.max_steps is not None:
            self.total = min(self.total, cfg.train.max_steps)
        self.stop = stop_flag()
        self.last_save = time.monotonic()
        val_ds = self.val_ds
        self.k_fundamental = mean_fundamental(val_ds.labels, self.S, voxel_of(val_ds.locate(0)[0].path))

    def save(self, metadata: dict[str, Any] | None = None, overlap: bool = True) -> None:
        """A checkpoint of the run as it stands, never of non-finite weights."""
        engine, step, epoch = self.engine, self.step, self.epoch
        checks = [torch.isfinite(p).all() for p in engine.parameters()]
        finite = not checks or bool(torch.stack(checks).all())  # one host sync, not one per parameter
        if _agree(not finite):  # never let a diverged model become the newest checkpoint
            raise Stop(f"weights became non-finite by step {step} (epoch {epoch + 1}); not saving. The "
                       f"newest good checkpoint: {errors.newest_checkpoint(self.ckpt)}; lower "
                       "optimizer.base_lr")
        state = {"model": engine.local_state_dict(), "optimizer": optimizer_state(engine, self.opt),
                 "rng": rng_state(), "loader": self.loader.state_dict(), "step": step, "epoch": epoch,
                 "train": {"epoch_loss": dict(self.epoch_loss)}}
        self.ckpt.save(step, state, {"epoch": epoch, **(metadata or {})}, overlap=overlap)
        self.last_save = time.monotonic()

    def validate(self, number: int) -> None:
        """Validate after (1-based) epoch ``number``."""
        self.reporter.validating(number, len(self.val_loader))
        if self.reconstruct:
            self.metrics, self.fields = evaluate_fields(self.engine, self.val_loader, self.S,
                                                        self.k_fundamental)
        else:
            self.metrics, self.pred, self.true, self.val_index = evaluate(self.engine, self.val_loader)

    def train(self) -> None:
        """The epochs left, each validated (every ``train.val_every``) and saved."""
        cfg, loader = self.cfg, self.loader
        # An epoch whose steps are all done may still owe its validation (a save right after its last
        # step, then a kill): it runs even when no step is left.
        while self.epoch < cfg.train.epochs and (self.step < self.total or loader.epoch > self.epoch):
            # A save right after an epoch's last step (before its validation) leaves the loader at the
            # next epoch: resumed from it, the epoch's steps are all done and must not run again.
            finished = loader.epoch > self.epoch
            if not finished:
                loader.set_epoch(self.epoch)  # keeps a mid-epoch position restored from a checkpoint
            for x_local, y in ([] if finished else loader):
                if self.train_step(x_local, y):
                    break
            self.end_epoch()
        if self.resumed and not self.metrics:  # resumed from the run's last checkpoint: the report still
            self.validate(max(self.epoch, 1))   # needs the final validation (the checkpoint's weights)

    def train_step(self, x_local: torch.Tensor, y: torch.Tensor) -> bool:
        """One optimizer step, reported and saved when due; True when it was the run's last."""
        cfg, loader, step = self.cfg, self.loader, self.step
        errors.note_skipped(loader.skipped, self.skipped)
        set_lr(self.opt, lr_of_step(cfg.optimizer, self.batch, step, self.steps_per_epoch))
        t0 = time.perf_counter()
        with self.timer.step(step):
            loss = self.accel.step(self.engine, self.opt, x_local, y)
        dt = time.perf_counter() - t0
        value = loss.item()
        if not math.isfinite(value):
            bad_input = _agree(not (torch.isfinite(x_local).all() and torch.isfinite(y).all()))
            batch_of = loader.batches(self.epoch)[(loader.index or len(loader)) - 1]
            raise errors.diverged(value, step + 1, self.epoch, self.train_ds, batch_of, self.ckpt, bad_input)
        self.step = step = step + 1
        faults.hit("step", step, self.rank)  # a fault-injection point for the recovery tests
        self.epoch_loss["sum"] += value
        self.epoch_loss["steps"] += 1
        self.report_step(value, dt)
        ck = cfg.checkpoint
        due = (ck.every_steps and step % ck.every_steps == 0) or \
            (ck.every_minutes and time.monotonic() - self.last_save > 60 * ck.every_minutes)
        if _agree(bool(due) or self.stop["stop"]):
            if _agree(self.stop["stop"]):
                raise KeyboardInterrupt
            self.save()
        return step >= self.total

    def report_step(self, value: float, dt: float) -> None:
        """The step's row: loss, rate, throughput, and the shares of time waiting for data and talking."""
        batch, loader = self.batch, self.loader
        parts = self.timer.breakdown()
        comm = sum(parts.get(k, 0.0) for k in ("halo", "pipeline", "grad_reduce"))
        self.reporter.step({"step": self.step, "epoch": self.epoch, "loss": value,
                            "lr": self.opt.param_groups[0]["lr"], "step_s": dt, "samples_per_s": batch / dt,
                            "gflops": self.flops.total * batch / dt / 1e9,
                            "data_wait_share": min(loader.last_wait / (dt + loader.last_wait), 1.0),
                            "comm_share": comm / dt}, self.total)

    def end_epoch(self) -> None:
        """After an epoch's steps (or a cut short one): validated and saved, or only saved when it is not
        a validation epoch."""
        cfg = self.cfg
        ended = self.loader.epoch > self.epoch  # the epoch ran to its end (else max_steps cut it short)
        if ended:
            self.epoch += 1
        epoch = self.epoch
        if ended and epoch % cfg.train.val_every and epoch < cfg.train.epochs and self.step < self.total:
            self.save()  # not a validation epoch: the checkpoint alone (resumable at every epoch)
            return
        if self.bn_loader is not None:
            precise_bn(self.engine, self.bn_loader, cfg.train.precise_bn_batches, epoch)
        number = epoch if ended else epoch + 1  # the epoch just run, from 1 (cut short: not ended)
        self.validate(number)
        n = self.epoch_loss["steps"]
        train_loss = self.epoch_loss["sum"] / n if n else float("nan")
        row = {"epoch": epoch, "last_step": self.step, "train_loss": train_loss, **self.metrics}
        self.reporter.epoch(row, number)
        if ended:
            self.epoch_loss.update(sum=0.0, steps=0)
        self.save({"metrics": self.metrics})

    def stopped(self) -> dict[str, Any]:
        """Stopped by a signal: a final checkpoint, written before returning."""
        if self.rank == 0:
            print(f"\nstopping on a signal at step {self.step}: writing a final checkpoint", flush=True)
        self.save(overlap=False)
        self.close_outputs()
        return {"stopped": True, "step": self.step}

    def close_outputs(self) -> None:
        """The checkpointer (its last save flushed) and the reporter's files closed."""
        self.ckpt.close()
        self.reporter.close()

    def finish(self) -> dict[str, Any]:
        """The summary of a completed run: written to ``summary.json`` with its report (rank 0)."""
        cfg, rank, run_dir = self.cfg, self.rank, self.run_dir
        self.close_outputs()
        self.loader.close()
        self.val_loader.close()
        summary = {"step": self.step, "epoch": self.epoch, **self.metrics}
        if cfg.data.skip_bad:
            skipped = self.skipped | set(self.val_loader.skipped)
            summary["skipped_samples"] = errors.skipped_everywhere(skipped)
            if rank == 0 and summary["skipped_samples"]:
                print(f"skipped {summary['skipped_samples']} bad samples (data.skip_bad)", flush=True)
        if rank == 0 and self.fields is not None:
            info = self.info
            summary.update(report(run_dir, self.fields, cfg.logging.plots,
                                  command=command_line(info.launcher, info.world_size),
                                  machine=machine_info(), epochs=self.epoch, steps=self.step,
                                  train_volumes=len(self.train_ds), channels=self.channels,
                                  world_size=info.world_size, parallel=cfg.parallel,
                                  wall_s=round(time.monotonic() - self.started, 1)))
        if rank == 0 and self.pred is not None:
            summary.update(report_regress(run_dir, self.metrics, self.pred, self.true, self.val_index,
                                          self.train_ds, self.val_ds, cfg.logging.plots))
        if rank == 0 and (self.fields is not None or self.pred is not None):
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
            print(f"run directory: {run_dir.resolve()}", flush=True)
        return summary


def run(cfg: Config) -> dict[str, Any]:
    """Train per ``cfg``; returns the final summary (validation MAE per parameter and the baseline, or
    the reconstruction's scores)."""
    t = Training(cfg)  # the layout checked before the process group, the data and the model
    augment = t.open_data()
    t.parallelize(t.build_model())
    t.make_loaders(augment)
    t.resume()
    t.start_reporting()
    try:
        t.train()
    except KeyboardInterrupt:
        return t.stopped()
    except Stop:
        t.close_outputs()
        raise  # main() prints it, once per job
    return t.finish()


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
