"""The 3D real FFT of a split volume, differentiable: ``rfftn`` to a :class:`Spectrum`, ``irfftn`` back.

Why: what a convolution cannot see is global (the power spectrum, the displacement field
ψ(k) = i k / k² δ(k), an FNO's spectral convolution), and on a split volume a global transform needs
every rank. A 3D FFT is three 1-D passes; each pass needs its dim whole on a rank, so between passes
the split moves to another dim: a pencil decomposition (P = p1 · p2 ranks; slabs when p2 = 1), the
transposes being ``hp.Redistribute`` between layouts of the same ranks, whose adjoint is its backward.
So autograd composes torch's own 1-D transforms with the redistributions, and the distributed
transform is the single-process one in another order of the same passes:

    input split (any)  ->  (p1, p2, 1): rfft along W  ->  (p1, 1, p2): fft along H
                       ->  (1, p1, p2): fft along D   =  Spectrum.data

``irfftn`` runs the inverse passes in reverse and returns the shard in the input's layout. Complex
values travel as real pairs beside the channels (N, C, 2, D, H, W), in the activation's dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridpar.comm.redistribute import infer_global_shape, local_box, redistribute
from hybridpar.geometry import pencil, redistribute_volume
from hybridpar.grid import ProcessGrid

__all__ = ["Spectrum", "irfftn", "rfftn", "transpose_elements", "wavenumbers"]


def transpose_elements(shape: tuple[int, int, int], split: tuple[int, int, int], channels_in: int,
                       channels_out: int = 0) -> int:
    """Real numbers per sample a rank receives in the transposes of one ``rfftn`` of ``channels_in``
    channels of a (D, H, W) field split ``split`` and, with ``channels_out``, of one ``irfftn`` back
    (the routes :func:`rfftn` and :func:`irfftn` take; each transpose at its most loaded rank): what
    ``explain`` shows and the performance model costs."""
    parts = math.prod(split)
    p1, p2 = pencil(parts)
    a, b, c = (p1, p2, 1), (p1, 1, p2), (1, p1, p2)
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    moves = [(shape, split, a, channels_in), (modes, a, b, 2 * channels_in), (modes, b, c, 2 * channels_in)]
    if channels_out:
        moves += [(modes, c, b, 2 * channels_out), (modes, b, a, 2 * channels_out),
                  (shape, a, split, channels_out)]
    return sum(width * redistribute_volume(extents, src, dst, parts)[0] for extents, src, dst, width in moves)


def _layouts(grid: ProcessGrid) -> tuple[ProcessGrid, ProcessGrid, ProcessGrid]:
    """The pencils of the three passes (W whole, H whole, D whole) on ``grid``'s spatial ranks."""
    p1, p2 = pencil(grid.spatial_size)
    return grid.with_spatial((p1, p2, 1)), grid.with_spatial((p1, 1, p2)), grid.with_spatial((1, p1, p2))


def _move(z: torch.Tensor, shape: tuple[int, int, int], src: ProcessGrid, dst: ProcessGrid) -> torch.Tensor:
    """A complex shard of a global (D, H, W) = ``shape`` field, from layout ``src`` to ``dst``."""
    if src.spatial_shape == dst.spatial_shape:
        return z
    # (N, C, d, h, w, 2): the real pairs travel as a trailing dim, so that the moved pairs are a complex
    # tensor again without a copy; an empty shard's pairs are built (view_as_real's backward cannot
    # view an empty gradient)
    pairs = torch.view_as_real(z) if z.numel() else torch.stack([z.real, z.imag], dim=-1)
    return torch.view_as_complex(redistribute(pairs, src, dst, shape, trailing=1))


def _pass(fn, z: torch.Tensor, dim: int, **kwargs) -> torch.Tensor:
    """One 1-D transform of a pencil. A pencil may be empty (more ranks along a dim than voxels), and
    MKL refuses an empty batch: the empty result is then made by hand, still read from ``z`` so that
    this rank's backward runs the transposes' collectives with the others."""
    if z.numel():
        return fn(z, dim=dim, **kwargs)
    probe = fn(torch.zeros(z.shape[dim], dtype=z.dtype), dim=0, **kwargs)  # the pass's length and dtype
    shape = [*z.shape]
    shape[dim] = probe.shape[0]
    link = z.sum() if probe.is_complex() else z.sum().real
    return torch.zeros(shape, dtype=probe.dtype, device=z.device) + link


def _check(x: torch.Tensor, what: str) -> None:
    if x.dim() != 5:
        raise ValueError(f"hybridpar.fft.{what}: expected an (N, C, D, H, W) shard, got shape "
                         f"{tuple(x.shape)}")


Wavenumbers = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def wavenumbers(shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device,
                box: tuple[tuple[int, int], ...] | None = None) -> Wavenumbers:
    """(kd, kh, kw) of the ``rfftn`` modes of a real (D, H, W) = ``shape`` field, or of the modes in
    ``box``: integer wave numbers as ``dtype`` tensors broadcastable to the modes' last three dims."""
    d, h, w = shape
    box = box or ((0, d), (0, h), (0, w // 2 + 1))
    on = {"dtype": dtype, "device": device}
    k = [torch.fft.fftfreq(d, 1 / d, **on), torch.fft.fftfreq(h, 1 / h, **on),
         torch.fft.rfftfreq(w, 1 / w, **on)]
    (d0, d1), (h0, h1), (w0, w1) = box
    return k[0][d0:d1].view(-1, 1, 1), k[1][h0:h1].view(1, -1, 1), k[2][w0:w1].view(1, 1, -1)


@dataclass(frozen=True)
class Spectrum:
    """This rank's modes of ``torch.fft.rfftn`` of the whole (N, C, D, H, W) field (unnormalised).

    ``data``: complex (N, C, d, h, w), the box of the (D, H, W // 2 + 1) modes ``layout`` gives this
    rank (D whole); ``shape``: the real field's global (D, H, W). Filters multiply ``data`` by a
    function of :meth:`wavenumbers` and :meth:`replace` it."""

    data: torch.Tensor
    shape: tuple[int, int, int]
    layout: ProcessGrid

    @property
    def modes(self) -> tuple[int, int, int]:
        """The global extents of the stored modes: (D, H, W // 2 + 1)."""
        d, h, w = self.shape
        return d, h, w // 2 + 1

    def box(self) -> tuple[tuple[int, int], ...]:
        """This rank's (lo, hi) range of stored modes per dim."""
        return local_box(self.modes, self.layout)

    def wavenumbers(self) -> Wavenumbers:
        """(kd, kh, kw): the global integer wave numbers of the held modes, as float tensors of the
        data's real dtype broadcastable to its last three dims (``fftfreq(n, 1/n)`` along D and H,
        ``rfftfreq(n, 1/n)`` along W)."""
        return wavenumbers(self.shape, self.data.real.dtype, self.data.device, self.box())

    def replace(self, data: torch.Tensor) -> Spectrum:
        """The same layout holding ``data`` (the same local shape but for N and C)."""
        if data.shape[2:] != self.data.shape[2:]:
            raise ValueError(f"Spectrum.replace: modes of shape {tuple(data.shape[2:])} for a layout holding "
                             f"{tuple(self.data.shape[2:])}")
        return Spectrum(data, self.shape, self.layout)


def rfftn(x: torch.Tensor, grid: ProcessGrid, shape: tuple[int, int, int] | None = None) -> Spectrum:
    """``torch.fft.rfftn(x_whole, dim=(-3, -2, -1))`` of the field whose shard ``x`` is (laid out as
    ``hp.scatter(x_whole, grid)`` lays it), as this rank's :class:`Spectrum`. Differentiable.
    ``shape``: the field's global (D, H, W) where the caller knows it (a layer does); otherwise it is
    inferred with a small all-gather."""
    _check(x, "rfftn")
    if shape is None:
        shape = infer_global_shape(x, grid) if grid.spatial_size > 1 else tuple(x.shape[2:])
    shape = tuple(shape)
    held = tuple(hi - lo for lo, hi in local_box(shape, grid))
    if tuple(x.shape[2:]) != held:  # a given shape this shard is not part of (no collective to check)
        raise ValueError(f"hybridpar.fft.rfftn: a shard of {tuple(x.shape[2:])} voxels is not this rank's "
                         f"{held} of a global {shape} split {grid.spatial_shape}")
    a, b, c = _layouts(grid)
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    # each step rebinds z, so that a pass's input is freed as soon as its output exists
    z = _pass(torch.fft.rfft, redistribute(x, grid, a, shape), -1)
    z = _move(z, modes, a, b)
    z = _pass(torch.fft.fft, z, -2)
    z = _move(z, modes, b, c)
    z = _pass(torch.fft.fft, z, -3)
    return Spectrum(z, shape, c)  # type: ignore[arg-type]


def irfftn(spectrum: Spectrum, grid: ProcessGrid) -> torch.Tensor:
    """The real field of ``spectrum`` (``torch.fft.irfftn(X, s=(D, H, W))`` of the whole), as this
    rank's shard in ``grid``'s layout (the one ``rfftn`` took it in). Differentiable."""
    _check(spectrum.data, "irfftn")
    a, b, c = _layouts(grid)
    if spectrum.layout.spatial_shape != c.spatial_shape:
        raise ValueError(f"hybridpar.fft.irfftn: a spectrum laid out {spectrum.layout.spatial_shape} for a "
                         f"grid whose spectra are laid out {c.spatial_shape}; pass the grid rfftn was given")
    shape, modes = spectrum.shape, spectrum.modes
    z = _pass(torch.fft.ifft, spectrum.data, -3)
    z = _move(z, modes, c, b)
    z = _pass(torch.fft.ifft, z, -2)
    z = _move(z, modes, b, a)
    x = _pass(torch.fft.irfft, z, -1, n=shape[2])
    del z
    return redistribute(x, a, grid, shape)
