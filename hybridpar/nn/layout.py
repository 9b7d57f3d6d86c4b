"""Layout changes as modules, so they can sit inside an ``nn.Sequential``."""

from __future__ import annotations

import torch
from torch import nn

from hybridpar.comm.redistribute import gather, redistribute, scatter
from hybridpar.grid import ProcessGrid


class Scatter(nn.Module):
    """Global tensor (the same on every rank) -> this rank's shard under ``grid``."""

    def __init__(self, grid: ProcessGrid) -> None:
        super().__init__()
        self.grid = grid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scatter(x, self.grid)


class Gather(nn.Module):
    """This rank's shard -> the global tensor, replicated on the spatial group (e.g. before a dense head).

    ``shape``: the global (D, H, W), if known (else inferred on every call with a small all-gather).
    """

    def __init__(self, grid: ProcessGrid, shape: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.grid, self.shape = grid, shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather(x, self.grid, self.shape)


class Redistribute(nn.Module):
    """Shard under ``src`` -> shard under ``dst`` (same stage ranks, another spatial split)."""

    def __init__(self, src: ProcessGrid, dst: ProcessGrid, shape: tuple[int, int, int] | None = None) -> None:
        super().__init__()
        self.src, self.dst, self.shape = src, dst, shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return redistribute(x, self.src, self.dst, self.shape)

    def extra_repr(self) -> str:
        return f"{self.src.spatial_shape} -> {self.dst.spatial_shape}"
