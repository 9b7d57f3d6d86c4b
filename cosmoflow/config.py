"""Training configuration: YAML -> typed dataclasses, ``--set key=value`` overrides, validated early.

Why: a run must fail in its first second, with a message that names the key and what would fit, not
an hour later. The config is also copied into the run directory, so a run can be repeated exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hybridpar.planner.config import check_keys


class ConfigError(ValueError):
    """A configuration key or value that cannot work; the message says what would."""


@dataclass
class DataConfig:
    train: str = "data/train"            # directory, file or glob (raw universes, MLPerf split, packed)
    val: str = "data/val"
    sample_size: int = 128
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
    n_conv: int = 5
    base_filters: int = 32
    max_filters: int = 512
    dense: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.5
    batchnorm: bool = False
    global_pool: bool = False            # global average pooling before the dense head
    head_norm: bool = False              # BatchNorm1d on the pooled features
    spectrum_stats: str = "batch"        # batch | running: the P(k) features standardised by the batch's
                                         # statistics or the training set's (RunningStandardize)
    padding_mode: str = "zeros"          # zeros | circular (the universes are periodic boxes)
    power_spectrum: bool = False         # a P(k) branch of the input channels into the head


@dataclass
class UNetConfig:
    """The reconstruction task's network (``cosmoflow.unet.UNet3d``)."""

    width: int = 8                       # channels of the full-resolution level, doubled per level
    levels: int = 4                      # resolutions: the sample size must divide by 2^(levels - 1)
    max_width: int = 64
    groups: int = 4                      # GroupNorm groups
    padding_mode: str = "circular"       # zeros | circular (periodic boxes)
    displacement: bool = False           # also feed the Zel'dovich displacement of the smoothed z = 0 field
    smoothing: float = 2.0               # its smoothing radius, voxels
    shift_reach: int = 0                 # > 0: also the z = 0 field moved back along it, shifts clamped to
                                         # this many voxels (a halo this wide on a split volume)


@dataclass
class OptimizerConfig:
    name: str = "sgd"                    # sgd | lars | adamw
    base_lr: float = 0.001               # per base_batch samples, scaled linearly with the global batch
    base_batch: int = 64
    momentum: float = 0.9
    weight_decay: float = 0.0
    warmup_epochs: float = 4.0
    decay_epochs: list[float] = field(default_factory=lambda: [32.0, 64.0])
    decay_factors: list[float] = field(default_factory=lambda: [0.25, 0.125])


@dataclass
class TrainConfig:
    epochs: int = 8
    batch_size: int = 8                  # global batch
    seed: int = 0
    max_steps: int | None = None         # stop early (tests, smoke runs)
    precise_bn_batches: int = 0          # before validating, re-estimate BatchNorm statistics on this many
                                         # training batches with the weights frozen (0: off)
    log_every: int = 1
    precision: str = "fp32"              # fp32 | bf16 | fp16 (autocast; fp16 with a gradient scaler)
    channels_last: bool = False          # NDHWC activations (channels_last_3d)
    compile: bool = False                # torch.compile the layers
    cuda_graphs: bool = False            # capture the training step in a CUDA graph (CUDA + NCCL)


@dataclass
class CheckpointConfig:
    every_steps: int | None = 50
    every_minutes: float | None = None
    keep_last: int = 3
    keep_every: int | None = None
    best_metric: str | None = "val_mae"  # pin the version with the lowest value of this metric
    resume: bool = True
    local_dir: str | None = None         # node-local copies (L1) first, flushed to run_dir in the
                                         # background; restarts read them first ("{node}" per node)


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    plots: bool = True
    progress: bool = True


AUGMENTS = ("none", "symmetries", "symmetries+shifts")
"""Training-set views (``hybridpar.data.Augment``); validation always reads samples as they are."""

TASKS = ("regress", "reconstruct")
"""regress: the four cosmological parameters of a volume (CosmoFlow); reconstruct: the initial linear
density field of a volume, voxel by voxel (a U-Net)."""


@dataclass
class Config:
    run_dir: str = "runs/cosmoflow"
    task: str = "regress"                # regress | reconstruct
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    unet: UNetConfig = field(default_factory=UNetConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: dict[str, Any] = field(default_factory=lambda: {"grid": {"data": -1}})
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """Short hash of the configuration, recorded with every checkpoint."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def _coerce(where: str, value: Any, typ: Any, default: Any) -> Any:
    """Check (and, for strings from ``--set``, convert) one value against its declared type."""
    text = str(typ)
    if value is None:
        if "None" in text:
            return None
        raise ConfigError(f"{where}: must not be empty")
    if "list" in text:
        if isinstance(value, str):
            value = yaml.safe_load(value)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list like [1, 2], got {value!r}")
        return value
    if text.startswith("dict") or "dict[" in text:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return value
    for kind in (bool, int, float, str):
        if kind.__name__ in text.replace("None", ""):
            if kind is bool and isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ConfigError(f"{where}: expected true or false, got {value!r}")
                return value.lower() in ("true", "1", "yes")
            if kind in (int, float) and isinstance(value, bool):
                break
            try:
                if kind is int and isinstance(value, float) and not value.is_integer():
                    break
                return kind(value)
            except (TypeError, ValueError):
                break
    raise ConfigError(f"{where}: expected {text.replace('typing.', '')}, got {value!r} "
                      f"(default {default!r})")


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    check_keys(where or "config", data, list(fields), ConfigError)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        f = fields[key]
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            kwargs[key] = _build(f.type, value, path)
            continue
        sub = globals().get(str(f.type))
        if sub is not None and dataclasses.is_dataclass(sub):
            kwargs[key] = _build(sub, value, path)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs[key] = _coerce(path, value, f.type, default)
    return cls(**kwargs)


def set_key(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set`` assignment (``section.key=value``, the value read as YAML) to a config tree."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. train.epochs=4")
    key, value = assignment.split("=", 1)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = yaml.safe_load(value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML config, apply ``key=value`` overrides, validate, and return the typed config."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        tree = yaml.safe_load(p.read_text()) or {}
    for item in overrides or []:
        set_key(tree, item)
    cfg = _build(Config, tree, "")
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Value checks that types alone do not catch."""
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
    for name, value in (("train.batch_size", cfg.train.batch_size), ("train.epochs", cfg.train.epochs),
                        ("data.sample_size", cfg.data.sample_size)):
        if value < 1:
            raise ConfigError(f"{name}: must be at least 1, got {value}")
    for section, mode in (("model", cfg.model.padding_mode), ("unet", cfg.unet.padding_mode)):
        if mode not in ("zeros", "circular"):
            raise ConfigError(f"{section}.padding_mode: {mode!r} is not one of zeros, circular "
                              f"(circular: periodic boxes, as the generator's universes are)")
    if cfg.model.spectrum_stats not in ("batch", "running"):
        raise ConfigError(f"model.spectrum_stats: {cfg.model.spectrum_stats!r} is not one of batch, running "
                          f"(running: the P(k) features standardised with the training set's statistics)")
    if cfg.task == "reconstruct":
        _validate_reconstruct(cfg)
        return
    n = cfg.model.n_conv
    if cfg.data.sample_size % (2 ** n):
        fits = [k for k in range(1, 8) if cfg.data.sample_size % (2 ** k) == 0]
        raise ConfigError(f"model.n_conv: {n} pooling layers need a sample size divisible by {2 ** n}; "
                          f"data.sample_size {cfg.data.sample_size} fits n_conv in {fits}")


RECONSTRUCT_METRICS = ("val_loss", "val_decorrelation")
"""What the reconstruct task can pin its best checkpoint on (lowest wins): the voxel MSE, and the mean of
1 - r(k) over the shells below half the Nyquist frequency."""


def _validate_reconstruct(cfg: Config) -> None:
    u = cfg.unet
    if u.levels < 3:
        raise ConfigError(f"unet.levels: {u.levels}; a reconstruction U-Net needs at least 3 levels to "
                          "reach the displacement scale (several Mpc/h)")
    step = 2 ** (u.levels - 1)
    if cfg.data.sample_size % step:
        fits = [k for k in range(3, 8) if cfg.data.sample_size % 2 ** (k - 1) == 0]
        hint = f"fits levels in {fits}" if fits else "fits none: 3 levels need a multiple of 4"
        raise ConfigError(f"unet.levels: {u.levels} levels need a sample size divisible by {step}; "
                          f"data.sample_size {cfg.data.sample_size} {hint}")
    if u.shift_reach < 0 or (u.shift_reach and not u.displacement):
        raise ConfigError(f"unet.shift_reach: {u.shift_reach}; it is the reach in voxels (>= 0) of the field "
                          "moved back along the displacement, which needs unet.displacement: true")
    for name, value in (("unet.width", u.width), ("unet.max_width", u.max_width), ("unet.groups", u.groups)):
        if value < 1:
            raise ConfigError(f"{name}: must be at least 1, got {value}")
    if u.width % u.groups or u.max_width % u.groups:
        raise ConfigError(f"unet.groups: {u.groups} GroupNorm groups must divide unet.width ({u.width}) and "
                          f"unet.max_width ({u.max_width})")
    best = cfg.checkpoint.best_metric
    if best is not None and best not in RECONSTRUCT_METRICS:
        raise ConfigError(f"checkpoint.best_metric: {best!r} is not reported by the reconstruct task; "
                          f"use one of {', '.join(RECONSTRUCT_METRICS)} (lowest wins) or null")
