"""Training configuration: YAML -> typed dataclasses, ``--set key=value`` overrides, validated early.

Why: a run must fail in its first second, with a message that names the key and what would fit, not
an hour later. The config is also copied into the run directory, so a run can be repeated exactly.

A config is plain data: YAML without tags (``!!python/...`` constructs nothing), its aliases bounded
(:mod:`hybridpar.plain_yaml`), every value checked against its field's type and range (:data:`AT_LEAST`);
any of these is a :class:`ConfigError`, which the training entry reports in one line with exit 2.
Sizes are checked from above too: a network whose weights, or one sample's largest activation, would not
fit in this machine's memory is refused naming the key and the largest value that fits
(:mod:`cosmoflow.model_size`), the same for a config file and for the one an export carries.

Here are the schema (the dataclasses, whose comments are the reference's meanings), the loading and the
checks of ranges and across keys; reading plain values and typing them field by field is
:mod:`cosmoflow.config_values`'s, whose names this module re-exports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cosmoflow.config_values import (
    MAX_CONFIG_BYTES,
    ConfigError,
    build_section,
    config_text,
    describe_type,
    read_yaml,
    set_key,
)
from cosmoflow.model_size import memory_problem

__all__ = ["AT_LEAST", "AUGMENTS", "BELOW", "MAX_CONFIG_BYTES", "RECONSTRUCT_METRICS", "TASKS", "ZERO_MEANS",
           "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig", "ModelConfig",
           "OptimizerConfig", "TrainConfig", "UNetConfig", "config_from_dict", "describe_type", "load_config",
           "read_yaml", "set_key", "validate"]


@dataclass
class DataConfig:
    """Where the samples are read from, and how."""

    train: str = "data/train"            # directory, file or glob (raw universes, MLPerf split, packed)
    val: str = "data/val"                # the validation set, as data.train
    sample_size: int = 128               # edge of a sample cube, voxels: universes are cut into cubes this
                                         # size
    workers: int = 1                     # reader processes per rank (0: read in the training process)
    prefetch: int = 2                    # batches read ahead
    stage_dir: str | None = None         # copy this replica's files here first (node-local disk)
    channels: int = 4                    # redshift channels read, from z = 0 (1: today's field only)
    skip_bad: bool = False               # a bad sample (cosmoflow.validate) is skipped with a warning, not an
                                         # error; the summary counts them
    augment: str = "none"                # none | symmetries (the cube's 48: flips, transposes) |
                                         # symmetries+shifts (and periodic rolls: whole universes only)


@dataclass
class ModelConfig:
    """The regress task's network (``cosmoflow.model.build_model``: MLPerf HPC CosmoFlow's, resized)."""

    n_conv: int = 5                      # conv + pool blocks: the sample size must divide by 2^n_conv
    base_filters: int = 32               # channels of the first conv, doubled per block
    max_filters: int = 512               # cap on a conv's channels
    dense: list[int] = field(default_factory=lambda: [128, 64])  # widths of the dense head's hidden layers
    dropout: float = 0.5                 # dropout rate after each hidden dense layer (below 1)
    batchnorm: bool = False              # BatchNorm after each conv
    global_pool: bool = False            # global average pooling before the dense head
    head_norm: bool = False              # BatchNorm1d on the pooled features
    spectrum_stats: str = "batch"        # batch | running: the P(k) features standardised by the batch's
                                         # statistics or the training set's (RunningStandardize)
    padding_mode: str = "zeros"          # zeros | circular (the universes are periodic boxes)
    power_spectrum: bool = False         # a P(k) branch of the input channels into the head
    ridge_start: bool = False            # the head reads the volume study reference's features, beside a
                                         # linear probe set to its ridge solution on the training set; the
                                         # head's output starts at zero (the network starts at the reference)
    ridge_probe: str = "trained"         # trained | fixed: the probe fine-tuned, or kept at the ridge fit
    ridge_cross: bool = False            # the reference read with the correlation between snapshots per
                                         # shell (the stronger reference); needs ridge_start
    init_from: str | None = None         # start from these weights: a safetensors file or a weights-only
                                         # torch state dict (hybridpar.checkpoint export writes both);
                                         # a resumed checkpoint still wins


@dataclass
class UNetConfig:
    """The reconstruction task's network (``cosmoflow.unet.UNet3d``)."""

    width: int = 8                       # channels of the full-resolution level, doubled per level
    levels: int = 4                      # resolutions: the sample size must divide by 2^(levels - 1)
    max_width: int = 64                  # cap on a level's channels
    groups: int = 4                      # GroupNorm groups
    padding_mode: str = "circular"       # zeros | circular (periodic boxes)
    displacement: bool = False           # also feed the Zel'dovich displacement of the smoothed z = 0 field
    smoothing: float = 2.0               # its smoothing radius, voxels
    shift_reach: int = 0                 # > 0: also the z = 0 field moved back along it, shifts clamped to
                                         # this many voxels (a halo this wide on a split volume)


@dataclass
class OptimizerConfig:
    """The optimizer and its learning-rate schedule (``cosmoflow.optim``: MLPerf HPC CosmoFlow's)."""

    name: str = "sgd"                    # sgd | lars | adamw
    base_lr: float = 0.001               # per base_batch samples, scaled linearly with the global batch
    base_batch: int = 64                 # the batch base_lr is given for
    momentum: float = 0.9                # SGD and LARS momentum (adamw: unused)
    weight_decay: float = 0.0            # L2 penalty added to the gradient (adamw: decoupled decay)
    warmup_epochs: float = 4.0           # the rate rises linearly from base_lr to its scaled peak over these
    decay_epochs: list[float] = field(default_factory=lambda: [32.0, 64.0])  # epochs at which each decay
                                         # factor starts (increasing)
    decay_factors: list[float] = field(default_factory=lambda: [0.25, 0.125])  # the peak rate times this
                                         # from the matching decay epoch on


@dataclass
class TrainConfig:
    """The training loop."""

    epochs: int = 8                      # passes over the training set, each followed by a validation
    batch_size: int = 8                  # global batch
    seed: int = 0                        # initial weights, shuffling, augmentation (each replica adds its
                                         # index)
    max_steps: int | None = None         # stop after this many steps, >= 1 (smoke runs; null: no limit)
    precise_bn_batches: int = 0          # before validating, re-estimate BatchNorm statistics on this many
                                         # training batches with the weights frozen (0: off)
    val_every: int = 1                   # validate after every this many epochs and after the last (the
                                         # training loss of a row then spans the epochs since the last one)
    log_every: int = 1                   # without a terminal, print the progress line every this many steps
    precision: str = "fp32"              # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    channels_last: bool = False          # NDHWC activations (channels_last_3d)
    compile: bool = False                # torch.compile the layers
    cuda_graphs: bool = False            # capture the training step in a CUDA graph (CUDA + NCCL)


@dataclass
class CheckpointConfig:
    """Checkpoints in ``run_dir/checkpoints`` (``hybridpar.checkpoint``)."""

    every_steps: int | None = 50         # save every this many steps (0 or null: not by step count)
    every_minutes: float | None = None   # and every this many minutes (0 or null: not by time)
    keep_last: int = 3                   # >= 1 newest versions kept
    keep_every: int | None = None        # also keep every epoch divisible by this (>= 1; null: none)
    best_metric: str | None = "val_mae"  # pin the version with the lowest value of this metric
    resume: bool = True                  # start from run_dir's newest complete checkpoint, if any
    local_dir: str | None = None         # node-local copies (L1) first, flushed to run_dir in the
                                         # background; restarts read them first ("{node}" per node)


@dataclass
class LoggingConfig:
    """What a run reports besides ``metrics_*.csv`` (always written)."""

    tensorboard: bool = True             # TensorBoard event files in run_dir/tensorboard
    plots: bool = True                   # loss curves and predicted-against-true plots in run_dir/plots
    progress: bool = True                # a progress line per step (rank 0, on stderr)


AUGMENTS = ("none", "symmetries", "symmetries+shifts")
"""Training-set views (``hybridpar.data.Augment``); validation always reads samples as they are."""

TASKS = ("regress", "reconstruct")
"""regress: the four cosmological parameters of a volume (CosmoFlow); reconstruct: the initial linear
density field of a volume, voxel by voxel (a U-Net)."""


@dataclass
class Config:
    """A training run (``launch/train.py``)."""

    run_dir: str = "runs/cosmoflow"      # where the run writes (config, metrics, checkpoints, summary);
                                         # started again, it resumes
    task: str = "regress"                # regress (four cosmological parameters of a volume) | reconstruct
                                         # (the initial density field, voxel by voxel)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    unet: UNetConfig = field(default_factory=UNetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: dict[str, Any] = field(default_factory=lambda: {"grid": {"data": -1}})  # the parallel spec
                                         # (hybridpar.ParallelSpec: grid, pipeline, layers, timeout_s);
                                         # data -1: every rank a data replica
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Short hash of the configuration, recorded with every checkpoint."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply ``key=value`` overrides, validate, and return the typed config."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        tree = read_yaml(config_text(p), str(p))
        if tree is None:
            tree = {}
        if not isinstance(tree, dict):
            raise ConfigError(f"{p}: the top level is a {type(tree).__name__}; a config is a mapping of "
                              "sections (run_dir, data, model, train, ...) as in launch/configs/demo.yaml")
    for item in overrides or []:
        set_key(tree, item)
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any], source: str = "") -> Config:
    """The typed, validated config of a plain mapping (a YAML file's, or :meth:`Config.to_dict`'s as a
    checkpoint or an export keeps it); a :class:`ConfigError` naming ``source`` otherwise."""
    try:
        cfg = build_section(Config, tree, "")
        validate(cfg)
    except ConfigError as err:
        if source:
            raise ConfigError(f"{source}: {err}") from None
        raise
    return cfg


AT_LEAST: dict[str, int] = {
    "data.sample_size": 1, "data.prefetch": 1, "data.channels": 1,
    "model.n_conv": 1, "model.base_filters": 1, "model.max_filters": 1, "model.dense": 1,
    "unet.width": 1, "unet.levels": 1, "unet.max_width": 1, "unet.groups": 1,
    "optimizer.base_batch": 1,
    "train.epochs": 1, "train.batch_size": 1, "train.max_steps": 1, "train.log_every": 1,
    "train.val_every": 1,
    "checkpoint.keep_last": 1, "checkpoint.keep_every": 1,
}
"""Numbers that are sizes, counts or periods: at least 1 (each entry of a list). Every other number
is at least 0, where 0 means none or off (``data.workers``, ``checkpoint.every_steps``, a rate, a seed):
no number in a config is negative."""
ZERO_MEANS: dict[str, str] = {
    "data.workers": "read in the training process", "train.precise_bn_batches": "off",
    "checkpoint.every_steps": "no saves by step count", "checkpoint.every_minutes": "no saves by time",
    "unet.shift_reach": "off", "optimizer.warmup_epochs": "no warm-up",
}
"""What 0 means where it is the lower bound and means something (for messages)."""
BELOW: dict[str, float] = {"model.dropout": 1.0, "train.seed": 2 ** 31}
"""Upper bounds (exclusive): a dropout of 1 drops everything; numpy takes seeds below 2^32 and a
replica adds its index to the seed."""


def _check_ranges(section: Any, where: str = "") -> None:
    """Every number of ``section`` (and of its lists and subsections) within :data:`AT_LEAST` (else 0)
    and :data:`BELOW`."""
    for f in dataclasses.fields(section):
        key, value = f"{where}{f.name}", getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_ranges(value, f"{key}.")
            continue
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if not isinstance(v, int | float) or isinstance(v, bool):
                continue
            low, high = AT_LEAST.get(key, 0), BELOW.get(key, math.inf)
            if low <= v < high:
                continue
            name = f"{key}[{i}]" if isinstance(value, list) else key
            fits = f"at least {low}" if v < low else f"below {high:g}"
            note = f" (0: {ZERO_MEANS[key]})" if v < low and key in ZERO_MEANS else ""
            raise ConfigError(f"{name}: {v} is out of range; it must be {fits}{note}")


def validate(cfg: Config) -> None:
    """Value checks that types alone do not catch."""
    _check_ranges(cfg)
    if cfg.task not in TASKS:
        raise ConfigError(f"task: {cfg.task!r} is not one of {', '.join(TASKS)}")
    if cfg.data.augment not in AUGMENTS:
        raise ConfigError(f"data.augment: {cfg.data.augment!r} is not one of {', '.join(AUGMENTS)}")
    if not 1 <= cfg.data.channels <= 4:
        raise ConfigError(f"data.channels: {cfg.data.channels} redshift channels; the universes have 1 to 4 "
                          "(z = 0, 0.5, 1.5, 3, read from the first)")
    from hybridpar.device.accel import check  # noqa: PLC0415 (torch, only when validating)

    problem = check(cfg.train.precision, cfg.train.cuda_graphs)
    if problem:
        raise ConfigError(f"train.{problem}")
    if cfg.optimizer.name not in ("sgd", "lars", "adamw"):
        raise ConfigError(f"optimizer.name: {cfg.optimizer.name!r} is not one of sgd, lars, adamw")
    if len(cfg.optimizer.decay_epochs) != len(cfg.optimizer.decay_factors):
        raise ConfigError(f"optimizer.decay_epochs ({len(cfg.optimizer.decay_epochs)} entries) and "
                          f"decay_factors ({len(cfg.optimizer.decay_factors)}) must have equal length")
    at = cfg.optimizer.decay_epochs
    if any(b <= a for a, b in zip(at, at[1:])):
        raise ConfigError(f"optimizer.decay_epochs: {at} must increase (each entry is the epoch at which "
                          "its decay factor starts)")
    for section, mode in (("model", cfg.model.padding_mode), ("unet", cfg.unet.padding_mode)):
        if mode not in ("zeros", "circular"):
            raise ConfigError(f"{section}.padding_mode: {mode!r} is not one of zeros, circular "
                              f"(circular: periodic boxes, as the generator's universes are)")
    if cfg.model.spectrum_stats not in ("batch", "running"):
        raise ConfigError(f"model.spectrum_stats: {cfg.model.spectrum_stats!r} is not one of batch, running "
                          f"(running: the P(k) features standardised with the training set's statistics)")
    if cfg.task == "reconstruct":
        _validate_reconstruct(cfg)
    else:
        _validate_regress(cfg)
    problem = memory_problem(cfg, Config())  # the sizes' upper bound, once every count is known sane
    if problem:
        raise ConfigError(problem)


def _halvings_fit(size: int) -> int:
    """How many times a volume of side ``size`` can be halved exactly."""
    return (size & -size).bit_length() - 1


def _validate_regress(cfg: Config) -> None:
    m = cfg.model
    if m.base_filters > m.max_filters:
        raise ConfigError(f"model.base_filters: {m.base_filters} channels exceed model.max_filters "
                          f"({m.max_filters}), which caps every conv's channels; at most {m.max_filters} has "
                          f"an effect (or raise model.max_filters)")
    if cfg.model.ridge_probe not in ("trained", "fixed"):
        raise ConfigError(f"model.ridge_probe: {cfg.model.ridge_probe!r} is not one of trained, fixed "
                          "(fixed: the ridge-started probe kept at the ridge solution)")
    if cfg.model.ridge_cross and not cfg.model.ridge_start:
        raise ConfigError("model.ridge_cross reads the reference with cross spectra into a ridge-started "
                          "head: set model.ridge_start: true as well")
    if cfg.model.ridge_start and cfg.model.power_spectrum:
        raise ConfigError("model.ridge_start and model.power_spectrum both feed spectrum features to the "
                          "head (the reference's, or the growth branch's); set one of them to false")
    n = cfg.model.n_conv
    if n > _halvings_fit(cfg.data.sample_size):  # 2 ** n only once n is known to be small
        fits = [k for k in range(1, 8) if cfg.data.sample_size % (2 ** k) == 0]
        divisor = 2 ** n if n < 64 else f"2^{n}"
        raise ConfigError(f"model.n_conv: {n} pooling layers need a sample size divisible by {divisor}; "
                          f"data.sample_size {cfg.data.sample_size} fits n_conv in {fits}")


RECONSTRUCT_METRICS = ("val_loss", "val_decorrelation")
"""What the reconstruct task can pin its best checkpoint on (lowest wins): the voxel MSE, and the mean of
1 - r(k) over the shells below half the Nyquist frequency."""


def _validate_reconstruct(cfg: Config) -> None:
    u = cfg.unet
    if u.levels < 3:
        raise ConfigError(f"unet.levels: {u.levels}; a reconstruction U-Net needs at least 3 levels to "
                          "reach the displacement scale (several Mpc/h)")
    if u.levels - 1 > _halvings_fit(cfg.data.sample_size):  # 2 ** levels only once levels is small
        fits = [k for k in range(3, 8) if cfg.data.sample_size % 2 ** (k - 1) == 0]
        hint = f"fits levels in {fits}" if fits else "fits none: 3 levels need a multiple of 4"
        step = 2 ** (u.levels - 1) if u.levels < 64 else f"2^{u.levels - 1}"
        raise ConfigError(f"unet.levels: {u.levels} levels need a sample size divisible by {step}; "
                          f"data.sample_size {cfg.data.sample_size} {hint}")
    if u.width > u.max_width:
        raise ConfigError(f"unet.width: {u.width} channels exceed unet.max_width ({u.max_width}), which caps "
                          f"every level's channels; at most {u.max_width} has an effect (or raise "
                          f"unet.max_width)")
    if u.shift_reach < 0 or (u.shift_reach and not u.displacement):
        raise ConfigError(f"unet.shift_reach: {u.shift_reach}; it is the reach in voxels (>= 0) of the field "
                          "moved back along the displacement, which needs unet.displacement: true")
    if u.width % u.groups or u.max_width % u.groups:
        raise ConfigError(f"unet.groups: {u.groups} GroupNorm groups must divide unet.width ({u.width}) and "
                          f"unet.max_width ({u.max_width})")
    best = cfg.checkpoint.best_metric
    if best is not None and best not in RECONSTRUCT_METRICS:
        raise ConfigError(f"checkpoint.best_metric: {best!r} is not reported by the reconstruct task; "
                          f"use one of {', '.join(RECONSTRUCT_METRICS)} (lowest wins) or null")
