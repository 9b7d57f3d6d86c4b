"""The models the harness sweeps, built the same way in the parent (for the model's plan) and in every rank.

Why their own module: the rank jobs, the state probe and the calibration all build them, and a
configuration must mean the same network wherever it is built (seeded, head sized for its input).
"""

from __future__ import annotations

import torch
from torch import nn


def _resize_head(model: nn.Sequential, shape: tuple[int, ...]) -> nn.Sequential:
    """Replace the first Linear after Flatten so that it takes this input shape's flattened features."""
    layers = list(model)
    i = next(k for k, m in enumerate(layers) if isinstance(m, nn.Flatten))
    with torch.device("meta"):
        feats = nn.Sequential(*layers[:i + 1])(torch.empty(shape, device="meta")).shape[1]
    j = next(k for k in range(i, len(layers)) if isinstance(layers[k], nn.Linear))
    if layers[j].in_features != feats:
        torch.manual_seed(1)
        layers[j] = nn.Linear(feats, layers[j].out_features)
    return nn.Sequential(*layers)


def build_model(name: str, shape: tuple[int, ...], seed: int = 0) -> nn.Sequential:
    """``synthetic``: 3 x [Conv3d k3 p1 -> LeakyReLU(0.3) -> MaxPool3d(2)], channels 8, 16, 32, then
    Flatten -> Linear 32 -> LeakyReLU -> Linear 4. ``cosmoflow``: the MLPerf CosmoFlow network resized
    (3 conv blocks, 16-64 filters, dense 64 -> 32, dropout 0.5). The first dense layer is sized for the
    flattened features of ``shape`` (weak spatial scaling elongates the volume)."""
    torch.manual_seed(seed)
    c_in = shape[1]
    if name == "synthetic":
        layers: list[nn.Module] = []
        for c_out in (8, 16, 32):
            layers += [nn.Conv3d(c_in, c_out, 3, padding=1), nn.LeakyReLU(0.3), nn.MaxPool3d(2)]
            c_in = c_out
        layers += [nn.Flatten(), nn.Linear(1, 32), nn.LeakyReLU(0.3), nn.Linear(32, 4)]
        model = nn.Sequential(*layers)
    elif name == "cosmoflow":
        from cosmoflow.model import build_model as cosmo  # noqa: PLC0415

        size = min(shape[2:])
        model = cosmo(size, c_in, n_conv=3, base_filters=16, max_filters=64, dense=(64, 32))
    else:
        raise ValueError(f"unknown model {name!r}; use synthetic or cosmoflow")
    return _resize_head(model, shape)
