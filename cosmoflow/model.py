"""The CosmoFlow network as a flat ``nn.Sequential``: MLPerf HPC's reference and LBANN's large-input variant.

Why flat: hybridpar's spec walks a ``Sequential`` layer by layer, deciding for each one how it is split
across the spatial grid and where pipeline stages cut, so every layer must be a direct child (no
nested blocks) and carry its hyper-parameters in standard torch modules.

Convolutions use ``padding=k//2`` (``padding=1`` for k = 3), which for odd kernels and stride 1 equals
Keras' ``'same'`` and is the symmetric padding the spatially distributed convolution supports
(``padding='same'`` would also work in plain torch, but its asymmetric form for even kernels is what
LBANN's distconv refuses, so odd kernels only).

The MLPerf HPC reference (TensorFlow/Keras) at 128³::

    5 × [Conv3d k3 'same' → LeakyReLU(0.3) → MaxPool3d(2)]   filters 32, 64, 128, 256, 512
    Flatten (4³·512 = 32,768) → Linear 128 → LeakyReLU → Dropout → Linear 64 → LeakyReLU → Dropout
    → Linear 4 → tanh → × 1.2                                   8,907,556 parameters

Keras' LeakyReLU slope is 0.3 (torch's default 0.01), and its default initialiser is Glorot-uniform
with zero biases, which ``init='glorot'`` reproduces. LBANN's variant for 512³ inputs has
log2(W) − 2 conv layers of 16·2^i channels capped at 256, average pooling k3 s2 p1, dense 2048 → 256
and He-normal initialisation.

The heads that also take spectrum features (a P(k) branch, a start at the ridge reference) wrap the
built ``Sequential`` in :mod:`cosmoflow.model_branches`; their names are importable from here.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from cosmoflow.model_branches import (
    FixedLinear,
    PowerSpectrumBranch,
    RidgeProbe,
    RidgeStarted,
    RunningStandardize,
    SpectrumStats,
    Standardize,
    start_at_ridge,
    with_power_spectrum,
    with_ridge_start,
)

if TYPE_CHECKING:
    from cosmoflow.config import Config

__all__ = ["FixedLinear", "Init", "OutputScale", "PowerSpectrumBranch", "RidgeProbe", "RidgeStarted",
           "RunningStandardize", "SpectrumStats", "Standardize", "build_lbann_model", "build_model",
           "build_model_from_export", "build_network", "conv_channels", "count_parameters", "start_at_ridge"]

Init = Literal["glorot", "kaiming", "torch"]


class OutputScale(nn.Module):
    """Multiplies by a constant: the ``× 1.2`` after tanh, so targets in [-1, 1] are not at saturation."""

    def __init__(self, scale: float = 1.2) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale

    def extra_repr(self) -> str:
        return f"scale={self.scale}"


def _pool(kind: str) -> nn.Module:
    if kind == "max":
        return nn.MaxPool3d(kernel_size=2, stride=2)
    if kind == "avg":
        return nn.AvgPool3d(kernel_size=3, stride=2, padding=1)
    raise ValueError(f"pool must be 'max' (k2 s2, MLPerf) or 'avg' (k3 s2 p1, LBANN), got {kind!r}")


def _pooled(extent: int, kind: str) -> int:
    return extent // 2 if kind == "max" else (extent - 1) // 2 + 1


def _init(model: nn.Module, how: Init, slope: float) -> None:
    """Glorot-uniform (Keras' default) or He-normal (LBANN) weights, zero biases; ``torch`` keeps torch's."""
    if how == "torch":
        return
    if how not in ("glorot", "kaiming"):
        raise ValueError(f"init must be 'glorot', 'kaiming' or 'torch', got {how!r}")
    for m in model.modules():
        if isinstance(m, nn.Conv3d | nn.Linear):
            if how == "glorot":
                nn.init.xavier_uniform_(m.weight)
            else:
                nn.init.kaiming_normal_(m.weight, a=slope, nonlinearity="leaky_relu")
            if m.bias is not None:
                nn.init.zeros_(m.bias)


def _build(input_size: int, in_channels: int, channels: list[int], kernel_size: int, pool: str,
           dense: Sequence[int], n_outputs: int, dropout: float, batchnorm: bool, leaky_slope: float,
           output_scale: float, bn_momentum: float, global_pool: bool = False,
           head_norm: bool = False, padding_mode: str = "zeros") -> nn.Sequential:
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd so that padding k//2 is 'same', got {kernel_size}; "
                         "kernels that fit: 1, 3, 5, ...")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if padding_mode not in ("zeros", "circular"):
        raise ValueError(f"padding_mode must be 'zeros' or 'circular' (a periodic box), got {padding_mode!r}")
    layers: list[nn.Module] = []
    c_in, extent = in_channels, input_size
    for c_out in channels:
        layers.append(nn.Conv3d(c_in, c_out, kernel_size, padding=kernel_size // 2, bias=not batchnorm,
                                padding_mode=padding_mode))
        if batchnorm:
            layers.append(nn.BatchNorm3d(c_out, momentum=bn_momentum))
        layers.append(nn.LeakyReLU(leaky_slope))
        layers.append(_pool(pool))
        c_in, extent = c_out, _pooled(extent, pool)
    if global_pool:  # translation-invariant summary statistics of the field, one per channel
        layers.append(nn.AdaptiveAvgPool3d(1))
    layers.append(nn.Flatten())
    features = c_in * (1 if global_pool else extent ** 3)
    if head_norm:  # standardise the summaries across the batch: small parameter effects become O(1)
        layers.append(nn.BatchNorm1d(features, momentum=0.1))
    for width in dense:
        layers += [nn.Linear(features, width), nn.LeakyReLU(leaky_slope)]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        features = width
    layers += [nn.Linear(features, n_outputs), nn.Tanh(), OutputScale(output_scale)]
    return nn.Sequential(*layers)


def conv_channels(n_conv: int, base_filters: int, max_filters: int) -> list[int]:
    """Output channels of each conv layer: ``base·2^i`` capped at ``max_filters``."""
    return [min(base_filters * 2 ** i, max_filters) for i in range(n_conv)]


def build_model(input_size: int = 128, in_channels: int = 4, n_conv: int = 5, base_filters: int = 32,
                max_filters: int = 512, kernel_size: int = 3, pool: Literal["max", "avg"] = "max",
                dense: Sequence[int] = (128, 64), n_outputs: int = 4, dropout: float = 0.5,
                batchnorm: bool = False, leaky_slope: float = 0.3, output_scale: float = 1.2,
                init: Init = "glorot", bn_momentum: float = 0.01, global_pool: bool = False,
                head_norm: bool = False, padding_mode: str = "zeros",
                power_spectrum: bool = False, spectrum_stats: SpectrumStats = "batch",
                ridge_start: bool = False, ridge_probe: RidgeProbe = "trained",
                ridge_cross: bool = False) -> nn.Module:
    """The MLPerf HPC CosmoFlow reference (defaults: 128³, 8,907,556 parameters) or a resized variant.

    ``global_pool`` replaces the flatten by a global average (the head then sees one summary per
    channel, which generalises from far fewer samples) and ``head_norm`` standardises those summaries
    across the batch; both are off in the reference model. ``padding_mode="circular"`` pads each conv
    periodically: the simulated universes are periodic boxes, so a voxel at a face has real neighbours
    on the opposite face (split over ranks, the halos wrap around); the reference pads with zeros.

    ``input_size`` must be divisible by 2^n_conv (each max-pool halves it); a 64³ demo model is e.g.
    ``build_model(64, n_conv=4)`` or ``build_model(64, base_filters=8)``. With ``batchnorm`` the convs
    lose their bias (BatchNorm's shift replaces it). ``power_spectrum`` adds a P(k) branch to the head
    (:class:`PowerSpectrumBranch`; the model is then no longer one ``Sequential``), whose features
    are standardised by the batch's statistics (``spectrum_stats="batch"``, BatchNorm1d) or by the
    training set's (``"running"``, :class:`RunningStandardize`). ``ridge_start`` gives the head the
    reference's features instead, with a linear probe beside it and the residual at zero
    (:class:`RidgeStarted`; :func:`start_at_ridge` loads the probe), which ``ridge_probe="fixed"``
    keeps at the ridge solution (:class:`FixedLinear`) rather than fine-tuning it, and ``ridge_cross``
    makes the reference the one that also reads the correlation between channels per shell.
    """
    if n_conv < 1:
        raise ValueError(f"n_conv must be at least 1, got {n_conv}")
    step = 2 ** n_conv
    if pool == "max" and (input_size < step or input_size % step):
        lower = input_size // step * step
        sizes = " or ".join(str(v) for v in (lower, lower + step) if v > 0)
        convs = ", ".join(str(n) for n in range(1, n_conv) if input_size % 2 ** n == 0) or "none"
        raise ValueError(f"input_size {input_size} is not divisible by 2^n_conv = {step} ({n_conv} "
                         f"max-pools halve it); input sizes that fit: {sizes}; n_conv that fit: {convs}")
    model = _build(input_size, in_channels, conv_channels(n_conv, base_filters, max_filters), kernel_size,
                   pool, dense, n_outputs, dropout, batchnorm, leaky_slope, output_scale, bn_momentum,
                   global_pool, head_norm, padding_mode)
    if power_spectrum and ridge_start:
        raise ValueError("power_spectrum and ridge_start both give the head spectrum features (the "
                         "growth branch or the reference's); choose one")
    if power_spectrum:
        model = with_power_spectrum(model, input_size, in_channels, spectrum_stats)
    if ridge_start:
        model = with_ridge_start(model, input_size, in_channels, ridge_probe, ridge_cross)
    _init(model, init, leaky_slope)
    if ridge_start:
        model.zero_residual()
    return model


def build_lbann_model(input_size: int = 512, in_channels: int = 4, n_conv: int | None = None,
                      base_filters: int = 16, max_filters: int = 256, kernel_size: int = 3,
                      dense: Sequence[int] = (2048, 256), n_outputs: int = 4, dropout: float = 0.5,
                      batchnorm: bool = False, leaky_slope: float = 0.3, output_scale: float = 1.2,
                      init: Init = "kaiming", bn_momentum: float = 0.01) -> nn.Sequential:
    """LBANN's CosmoFlow for large inputs: log2(W) − 2 conv layers (7 at 512³), avg-pool k3 s2 p1.

    The last conv output is 4³ whatever the input, so the first dense layer sees 4³·channels features.
    ``bn_momentum`` 0.01 is LBANN's decay 0.99 in torch's convention.
    """
    if input_size < 8 or input_size & (input_size - 1):
        raise ValueError(f"LBANN's model needs a power-of-two input_size >= 8, got {input_size}; "
                         "e.g. 128, 256 or 512")
    if n_conv is None:
        n_conv = int(math.log2(input_size)) - 2
    return build_model(input_size, in_channels, n_conv, base_filters, max_filters, kernel_size, "avg",
                       dense, n_outputs, dropout, batchnorm, leaky_slope, output_scale, init, bn_momentum)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def build_network(cfg: Config) -> nn.Module:
    """The network a training config builds: CosmoFlow's regressor (:func:`build_model` from the
    ``model`` section) or, for ``task: reconstruct``, the U-Net (:func:`cosmoflow.reconstruct.build_unet`).
    The one builder the trainer, the studies and :func:`build_model_from_export` share."""
    channels = cfg.data.channels
    if cfg.task == "reconstruct":
        from cosmoflow.reconstruct import build_unet  # noqa: PLC0415 (the U-Net task's own module)

        return build_unet(cfg, channels)
    m = cfg.model
    return build_model(cfg.data.sample_size, channels, m.n_conv, m.base_filters, m.max_filters, dense=m.dense,
                       dropout=m.dropout, batchnorm=m.batchnorm, global_pool=m.global_pool,
                       head_norm=m.head_norm, padding_mode=m.padding_mode, power_spectrum=m.power_spectrum,
                       spectrum_stats=m.spectrum_stats, ridge_start=m.ridge_start,
                       ridge_probe=m.ridge_probe, ridge_cross=m.ridge_cross)


def build_model_from_export(path: str | os.PathLike) -> nn.Module:
    """The model an export holds (``python -m hybridpar.checkpoint export RUN OUT[.safetensors]``), rebuilt
    from the run configuration the export carries and loaded with its weights, on the CPU, every key
    matching; nothing else is needed (no config file, no ``build_model`` arguments). An export without a
    configuration, or one this code cannot build, is one :class:`~cosmoflow.config.ConfigError` line.

    The configuration is a file's, so it is trusted no more than a config file: it passes the same
    checks, upper bounds on its sizes included (:mod:`cosmoflow.model_size`), before the weights are
    read or anything is built."""
    from cosmoflow.config import ConfigError, config_from_dict  # noqa: PLC0415 (config reads YAML)
    from hybridpar.checkpoint import CheckpointError, load_weights, read_config  # noqa: PLC0415

    try:
        tree = read_config(path)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    if tree is None:
        raise ConfigError(f"{path}: carries no run configuration (exported by an older version, or weights "
                          "from elsewhere): build the model with build_model(...) and load_state_dict")
    if isinstance(tree.get("train"), dict):  # how it trained (a CUDA graph) is no part of the model, and
        tree = {**tree, "train": {**tree["train"], "cuda_graphs": False}}  # must not refuse a CPU here
    cfg = config_from_dict(tree, f"{path}'s configuration")
    try:
        state = load_weights(path)
    except CheckpointError as err:
        raise ConfigError(str(err)) from None
    model = build_network(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: its weights do not fit the model its configuration builds "
                          f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model
