"""neuraloperator's layers on split volumes: its 3-D ``SpectralConv`` on :mod:`hybridpar.fft`, its
pointwise pieces as they are, its positional grid built from the global shape; what does not split,
refused in one line naming it.

Why: ``neuralop.models.FNO`` is the FNO most users run. Its forward (keyword arguments, a loop over
``FNOBlocks`` called once per layer) is not one ``torch.fx`` can trace, so ``hp.parallelize`` runs it
by module swapping: its own forward on shards, each registered layer swapped for its split version.
What each of its layers does on a shard:

* ``SpectralConv`` (dense weight, 3-D, real data): global. :class:`DistSpectralConv` keeps the modes
  theirs keeps (after their ``fftshift``: ``-(m // 2) <= k < m - m // 2`` along D and H, ``k < m``
  along W, ``m`` the weight's extent there) times the same weight entries, each rank mixing the modes
  it holds. Version 2.0.0 puts the modes back with ``fftshift`` again (not ``ifftshift``), which on an
  odd extent moves every mode one place down; the split version does the same, as a phase after that
  dim's inverse pass (no communication), where :func:`rolls_odd_extents` finds the installed version
  doing it (a check on a small volume, once), and refuses a version that computes neither way. The
  composite transform does not depend on ``fft_norm`` (a scale there is undone back). One difference:
  theirs collects the mixed modes in a complex64 buffer whatever the input's dtype (``out_dtype =
  torch.cfloat``); this one keeps the input's precision (complex128 for float64).
* ``ChannelMLP``, ``Flattened1dConv`` (a ``"linear"`` skip), ``SoftGating``: voxel by voxel; they run
  as they are on the shards (pointwise), their parameters' gradients summed over the shards.
* ``GridEmbeddingND`` (the default ``positional_embedding="grid"``): theirs builds coordinates from
  the input's shape, a shard's on a shard; :class:`DistGridEmbeddingND` builds the global grid's
  values at this rank's voxels, the same numbers.
* refused in one line naming the layer when the plan is made (its registry ``halos``): factorized
  weights (``factorization="tucker"`` ...), ``complex_data``, ``fno_block_precision`` other than
  ``"full"``, ``resolution_scaling_factor`` (a resampled output is another split), subclasses that
  change the forward; a per-call ``output_shape`` when it runs. ``domain_padding`` pads inside FNO's
  forward (``DomainPadding.pad``, a method, not a layer): module swapping refuses its ``F.pad`` on a
  split activation, in its own one line.

On one process (a grid with one spatial rank) every layer is theirs, unchanged.

Registration happens the first time the layer registry looks up a type from ``neuralop``
(:data:`hybridpar.nn.registry.LAZY_ADAPTERS`), or at once where ``neuralop`` was imported before
hybridpar, so that ``import hybridpar`` does not pay neuralop's import (seconds: tensorly, wandb) where
it is installed but not used. :func:`register` does it by hand.
"""

from __future__ import annotations

import math
import sys
from functools import lru_cache
from typing import Any

import torch
from torch import nn

from hybridpar import fft as hfft
from hybridpar.comm.redistribute import local_box, redistribute
from hybridpar.comm.reduce import mark_grad_split, sync_grads
from hybridpar.grid import ProcessGrid
from hybridpar.nn.formulas import LayerGeometry, Work
from hybridpar.nn.sharing import sharing_copy
from hybridpar.nn.spatial import DIM_NAMES, SpatialLayer
from hybridpar.nn.spectral import kept_indices

__all__ = ["DistGridEmbeddingND", "DistSpectralConv", "register"]


def _refuse(layer: str, what: str, fits: str) -> ValueError:
    return ValueError(f"{layer}: {what} does not run on a split volume; {fits}")


# ---------------------------------------------------------------------- the spectral convolution
@lru_cache(maxsize=256)
def kept_modes(extent: int, lo: int, hi: int, kept: int,
               half: bool) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Of the stored modes ``lo:hi`` along a dim of ``extent`` voxels (``half``: the halved W dim),
    those neuraloperator's ``SpectralConv`` keeps with ``kept`` weight entries there: their local
    positions and their index in the weight (``k + kept // 2`` along D and H, ``k`` along W)."""
    pos, idx = [], []
    for i in range(lo, hi):
        k = i if half or i < (extent + 1) // 2 else i - extent
        j = k if half else k + kept // 2
        if 0 <= j < kept:
            pos.append(i - lo)
            idx.append(j)
    return tuple(pos), tuple(idx)


def weight_slices(fft_size: tuple[int, ...], n_modes: list[int], max_n_modes: list[int],
                  separable: bool) -> tuple[slice, ...]:
    """The slices of the weight their forward uses for a field of ``fft_size`` stored modes (their
    rule, for ``n_modes`` below ``max_n_modes`` or above the modes there are)."""
    starts = [mx - min(size, n) for size, n, mx in zip(fft_size, n_modes, max_n_modes)]
    slices = [slice(s // 2, -s // 2) if s else slice(s, None) for s in starts[:-1]]
    slices.append(slice(None, -starts[-1]) if starts[-1] else slice(None))
    return (slice(None),) * (1 if separable else 2) + tuple(slices)


def check_kept(layer: str, shape: tuple[int, ...], kept: tuple[int, ...], n_modes: list[int]) -> None:
    """Refuse kept modes their centred slice would run off the stored ones with (theirs fails there)."""
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    for i, (n, m) in enumerate(zip(modes, kept)):
        low, high = (n // 2 - m // 2, n // 2 + m - m // 2) if i < 2 else (0, m)
        if low < 0 or high > n:
            most = n if i < 2 else 2 * (n - 1)
            raise ValueError(f"{layer}: dim {DIM_NAMES[i]} of extent {shape[i]} has {n} modes, fewer than "
                             f"the {m} kept (n_modes {n_modes}); use n_modes of at most {most} along "
                             f"{DIM_NAMES[i]}")


def mix(z: torch.Tensor, modes: tuple[int, int, int], box: tuple[tuple[int, int], ...], weight: torch.Tensor,
        separable: bool, out_channels: int) -> torch.Tensor:
    """The held modes ``z`` (``box`` of the global ``modes``) of the wave numbers theirs keeps, times
    their entries of ``weight`` (sliced by :func:`weight_slices`), every other mode zero."""
    picks, index = kept_indices(kept_modes, modes, box, tuple(weight.shape[-3:]), z.device)
    zk = z.index_select(2, picks[0]).index_select(3, picks[1]).index_select(4, picks[2])
    w = weight.index_select(-3, index[0]).index_select(-2, index[1]).index_select(-1, index[2])
    mixed = torch.einsum("nixyz,ixyz->nixyz" if separable else "nixyz,ioxyz->noxyz", zk, w)
    out = z.new_zeros((z.shape[0], out_channels, *z.shape[2:]))
    out[:, :, picks[0].view(-1, 1, 1), picks[1].view(1, -1, 1), picks[2].view(1, 1, -1)] = mixed
    return out


def _phase(n: int, z: torch.Tensor, dim: int) -> torch.Tensor:
    """``exp(-2 pi i x / n)`` along ``dim`` (whole there) of ``z``: the inverse transform of modes
    moved one place down (``Z'[k] = Z[k + 1]``), which is what ``fftshift`` applied twice does to an
    odd extent (neuraloperator 2.0 shifts the modes back with ``fftshift``, not ``ifftshift``)."""
    x = torch.arange(n, device=z.device, dtype=z.real.dtype)
    shape = [1] * z.dim()
    shape[dim] = n
    return torch.polar(torch.ones_like(x), -2 * math.pi * x / n).view(shape)


def inverse(spec: hfft.Spectrum, grid: ProcessGrid, roll: tuple[bool, bool]) -> torch.Tensor:
    """``hp.fft.irfftn`` of ``spec``, the modes moved one place down along D (``roll[0]``) and H
    (``roll[1]``): a phase after the inverse pass of that dim, which holds it whole there."""
    a, b, c = hfft._layouts(grid)
    shape, modes = spec.shape, spec.modes
    z = hfft._pass(torch.fft.ifft, spec.data, -3)
    if roll[0]:
        z = z * _phase(shape[0], z, -3)
    z = hfft._pass(torch.fft.ifft, hfft._move(z, modes, c, b), -2)
    if roll[1]:
        z = z * _phase(shape[1], z, -2)
    x = hfft._pass(torch.fft.irfft, hfft._move(z, modes, b, a), -1, n=shape[2])
    return redistribute(x, a, grid, shape)


def whole(conv: nn.Module, x: torch.Tensor, roll_odd: bool) -> torch.Tensor:
    """What :class:`DistSpectralConv` computes, on a whole volume with ``torch.fft`` (the check of the
    installed version's convention, :func:`rolls_odd_extents`)."""
    shape = tuple(x.shape[2:])
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    weight = conv.weight.tensor[weight_slices(modes, conv.n_modes, conv.max_n_modes, conv.separable)]
    out = mix(torch.fft.rfftn(x, dim=(-3, -2, -1)), modes, tuple((0, n) for n in modes), weight,
              conv.separable, conv.out_channels)
    for dim, n in ((-3, shape[0]), (-2, shape[1])):
        out = torch.fft.ifft(out, dim=dim)
        if roll_odd and n % 2:
            out = out * _phase(n, out, dim)
    y = torch.fft.irfft(out, n=shape[2], dim=-1)
    return y if conv.bias is None else y + conv.bias


@lru_cache(maxsize=8)
def rolls_odd_extents(cls: type) -> bool | None:
    """How the installed ``SpectralConv`` puts its modes back (checked once on a small volume of odd
    extents): True where it shifts them one place along odd D and H (``fftshift`` twice, version
    2.0), False where it does not (``ifftshift``), None where it computes neither (another forward:
    refused)."""
    # on the CPU whatever the default device; their constructor draws from the global generator
    with torch.device("cpu"), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        conv = cls(2, 2, (3, 4, 4))
        x = torch.randn(1, 2, 5, 7, 6)
        with torch.no_grad():
            want = conv(x)
            for roll in (True, False):
                got = whole(conv, x, roll)
                if (got - want).abs().max() <= 1e-4 * want.abs().max():
                    return roll
    return None


class DistSpectralConv(SpatialLayer):
    """neuraloperator's ``SpectralConv`` (3-D, real data, dense weight, full precision) of a split
    volume: ``hp.fft`` on the shards, each rank mixing the modes it holds; the output is split as the
    input. State as theirs (``weight.tensor``, complex, and ``bias``); after backward their gradients
    are the whole volume's on every rank."""

    def __init__(self, conv: nn.Module, *, grid: ProcessGrid) -> None:
        import copy  # noqa: PLC0415

        super().__init__()
        self.init_spatial(grid, None)
        why = refusal(conv)
        if why is not None:
            raise ValueError(f"{type(conv).__name__}: {why}")
        self.roll_odd = rolls_odd_extents(type(conv))
        if self.roll_odd is None:
            raise _refuse(type(conv).__name__, f"neuraloperator {_version()}'s SpectralConv, which computes "
                          f"other than the one this split version follows,", "pin neuraloperator==2.0.0")
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.n_modes, self.max_n_modes = list(conv.n_modes), list(conv.max_n_modes)
        self.separable = bool(conv.separable)
        self.weight = copy.deepcopy(conv.weight)  # their DenseTensor: the state key weight.tensor
        self.bias = None if conv.bias is None else nn.Parameter(conv.bias.detach().clone())
        mark_grad_split(self.parameters(), grid.spatial_size)

    def forward(self, x: torch.Tensor, output_shape: Any = None) -> torch.Tensor:
        if output_shape is not None:
            raise _refuse(self.layer_name, "output_shape (a resampled output)", "call it without one")
        shape = self.global_shape(x)
        modes = (shape[0], shape[1], shape[2] // 2 + 1)
        group = self.grid.spatial_group if self.grid.spatial_size > 1 else None
        tensor, bias = sync_grads(group, self.weight.tensor, self.bias)
        weight = tensor[weight_slices(modes, self.n_modes, self.max_n_modes, self.separable)]
        check_kept(self.layer_name, shape, tuple(weight.shape[-3:]), self.n_modes)
        spec = hfft.rfftn(x, self.grid, shape)
        out = mix(spec.data, modes, tuple(map(tuple, spec.box())), weight, self.separable, self.out_channels)
        roll = (self.roll_odd and shape[0] % 2 == 1, self.roll_odd and shape[1] % 2 == 1)
        y = inverse(spec.replace(out), self.grid, roll)
        return y if bias is None else y + bias

    def transform(self, x: torch.Tensor, output_shape: Any = None) -> torch.Tensor:
        """Their resampling of a skip connection: the identity (resampling is refused)."""
        if output_shape is not None:
            raise _refuse(self.layer_name, "output_shape (a resampled output)", "call it without one")
        return x

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, n_modes={self.n_modes}"
                f"{', separable' if self.separable else ''}, split={self.grid.spatial_shape}")


def _version() -> str:
    import neuralop  # noqa: PLC0415

    return getattr(neuralop, "__version__", "?")


def refusal(conv: nn.Module) -> str | None:
    """Why a ``SpectralConv`` does not split (what it is, and what would fit), or None where the split
    version computes what theirs computes."""
    from neuralop.layers.spectral_convolution import SpectralConv  # noqa: PLC0415
    from tltorch.factorized_tensors import DenseTensor  # noqa: PLC0415

    if type(conv).forward is not SpectralConv.forward:
        what, fits = "a SpectralConv subclass with its own forward", "use neuralop's SpectralConv"
    elif conv.order != 3:
        what, fits = f"a {conv.order}-D spectral convolution", "split 3-D (N, C, D, H, W) volumes"
    elif not isinstance(conv.weight, DenseTensor):
        what, fits = (f"a factorized weight (factorization={conv.factorization!r})",
                      "use factorization=None (a dense weight)")
    elif conv.complex_data:
        what, fits = "complex_data=True (a complex field)", "use complex_data=False"
    elif conv.fno_block_precision != "full":
        what, fits = f"fno_block_precision={conv.fno_block_precision!r}", "use 'full'"
    elif any(r != 1 for r in _flat(conv.resolution_scaling_factor or [])):
        what, fits = (f"resolution_scaling_factor={conv.resolution_scaling_factor} (a resampled output)",
                      "use resolution_scaling_factor=None")
    else:
        return None
    return f"{what} does not run on a split volume; {fits}"


def _spectral_halos(m: nn.Module, name: str, in_shape: tuple[int, ...], out_shape: tuple[int, ...],
                    split: tuple[int, int, int]) -> tuple[tuple[int, int], ...]:
    """No halo (the transposes happen inside); a layer that does not split is refused when planned."""
    from hybridpar.geometry import HaloError  # noqa: PLC0415
    from hybridpar.nn.registry import check_extent  # noqa: PLC0415

    if any(p > 1 for p in split):
        why = refusal(m)
        if why is not None:
            raise HaloError(why)
    for i, parts in enumerate(split):
        check_extent(name, in_shape[2 + i], parts, i)
    return ((0, 0),) * 3


def _flat(v: Any) -> list[float]:
    return [x for item in v for x in _flat(item)] if isinstance(v, list | tuple) else [v]


def spectral_conv_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, None]:
    """The mode mixing as matmul FLOPs (8 real per complex multiply-add over the kept modes) and the
    transforms as other work (5 N log2 N per complex transform of N points)."""
    shape = tuple(x.shape[2:])
    modes = (*shape[:-1], shape[-1] // 2 + 1)
    kept = math.prod(min(n, k) for n, k in zip(modes, m.n_modes)) if len(shape) == len(m.n_modes) else 0
    channels = m.in_channels if m.separable else m.in_channels * m.out_channels
    mix = 8 * x.shape[0] * kept * channels
    volume = math.prod(shape)
    transforms = int(5 * x.shape[0] * (m.in_channels + m.out_channels) * volume * math.log2(max(2, volume)))
    trainable = any(p.requires_grad for p in m.parameters())
    return {"forward": mix, "input_grad": mix if x.requires_grad else 0,
            "weight_grad": mix if trainable else 0,
            "forward_other": transforms + (y.numel() if m.bias is not None else 0),
            "backward_other": transforms}, None


def _spectral_conv(m: nn.Module, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    if grid.spatial_size == 1:
        return sharing_copy(m)  # where the volume is not split: theirs, sharing its tensors
    return DistSpectralConv(m, grid=grid)


# ---------------------------------------------------------------------- the positional grid
class DistGridEmbeddingND(SpatialLayer):
    """neuraloperator's ``GridEmbeddingND`` (3-D) of a split volume: the input's channels followed by
    the coordinates of the *global* regular grid (``linspace(start, stop, n + 1)[:-1]`` along each
    dim, as theirs builds it) at this rank's voxels; split as the input."""

    def __init__(self, embedding: nn.Module, *, grid: ProcessGrid) -> None:
        super().__init__()
        self.init_spatial(grid, None)
        if embedding.dim != 3:
            raise _refuse(type(embedding).__name__, f"a {embedding.dim}-D grid embedding",
                          "split 3-D (N, C, D, H, W) volumes")
        self.in_channels, self.dim = embedding.in_channels, embedding.dim
        self.grid_boundaries = embedding.grid_boundaries
        self._grids: dict[tuple, list[torch.Tensor]] = {}

    @property
    def out_channels(self) -> int:
        return self.in_channels + self.dim

    def forward(self, data: torch.Tensor, batched: bool = True) -> torch.Tensor:
        if not batched:
            raise _refuse(self.layer_name, "batched=False", "pass an (N, C, D, H, W) shard")
        shape = self.global_shape(data)
        key = (shape, data.dtype, data.device)
        if key not in self._grids:
            box = local_box(shape, self.grid)
            axes = [torch.linspace(start, stop, n + 1)[:-1][lo:hi]
                    for n, (start, stop), (lo, hi) in zip(shape, self.grid_boundaries, box)]
            self._grids[key] = [g.to(data.device).to(data.dtype)[None, None]
                                for g in torch.meshgrid(*axes, indexing="ij")]
        grids = [g.repeat(data.shape[0], 1, 1, 1, 1) for g in self._grids[key]]
        return torch.cat((data, *grids), dim=1)

    def extra_repr(self) -> str:
        return f"in_channels={self.in_channels}, split={self.grid.spatial_shape}"


def _grid_embedding(m: nn.Module, grid: ProcessGrid, overlap: bool = False) -> nn.Module:
    if grid.spatial_size == 1:
        return sharing_copy(m)  # where the volume is not split: theirs, sharing its tensors
    return DistGridEmbeddingND(m, grid=grid)


# ---------------------------------------------------------------------- pointwise pieces
def channel_mlp_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    """2 per weight per voxel (1x1 convolutions) and the nonlinearities between them."""
    voxels = x.numel() // x.shape[1]
    fcs = m.fcs if hasattr(m, "fcs") else [m.conv]
    fwd = sum(2 * voxels * fc.weight.numel() for fc in fcs)
    other = sum(voxels * fc.out_channels for fc in fcs[:-1])
    trainable = any(p.requires_grad for p in m.parameters())
    return {"forward": fwd, "input_grad": fwd if x.requires_grad else 0,
            "weight_grad": fwd if trainable else 0,
            "forward_other": other, "backward_other": other}, LayerGeometry("pointwise")


def gating_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    n = y.numel() * (1 if m.bias is None else 2)
    return {"forward_other": n, "backward_other": 2 * n}, LayerGeometry("pointwise")


def no_flops(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[Work, LayerGeometry | None]:
    return {}, LayerGeometry("pointwise")


# ---------------------------------------------------------------------- registration
_DONE: list[bool] = []


def register() -> None:
    """Register neuraloperator's layers (idempotent; needs ``neuralop`` importable)."""
    if _DONE:
        return
    from neuralop.layers.channel_mlp import ChannelMLP  # noqa: PLC0415
    from neuralop.layers.embeddings import GridEmbeddingND  # noqa: PLC0415
    from neuralop.layers.skip_connections import Flattened1dConv, SoftGating  # noqa: PLC0415
    from neuralop.layers.spectral_convolution import SpectralConv  # noqa: PLC0415

    from hybridpar.nn import registry  # noqa: PLC0415

    # transposes(m, input_shape, split): real numbers per sample the FFT's transposes bring a rank
    registry.register(SpectralConv, role="pointwise", op="conv", flops=spectral_conv_flops,
                      to_dist=_spectral_conv, halos=_spectral_halos,
                      transposes=lambda m, shape, split: hfft.transpose_elements(
                          shape[2:], split, m.in_channels, m.out_channels))
    registry.register(GridEmbeddingND, role="pointwise", op="free", flops=no_flops, to_dist=_grid_embedding)
    # no Dist class: the converter runs a copy on the shard and sums its parameters' shard gradients
    for t in (ChannelMLP, Flattened1dConv):
        registry.register(t, role="pointwise", op="conv", flops=channel_mlp_flops)
    registry.register(SoftGating, role="pointwise", op="pointwise", flops=gating_flops)
    _DONE.append(True)


if "neuralop" in sys.modules:  # its layers exist already: no lookup has to miss first
    register()
