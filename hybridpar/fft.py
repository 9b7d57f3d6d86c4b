"""The 3D real FFT of a split volume, differentiable: ``rfftn`` to a :class:`Spectrum`, ``irfftn`` back.

Why: what a convolution cannot see is global (the power spectrum, the displacement field
ψ(k) = i k / k² δ(k), an FNO's spectral convolution), and on a split volume a global transform needs
every rank. A 3D FFT is three 1-D passes; each pass needs its dim whole on a rank, so between passes
the split moves to another dim: a pencil decomposition (P = p1 · p2 ranks; slabs when p2 = 1), the
transposes being ``hp.Redistribute`` between layouts of the same ranks. The distributed transform is
torch's own 1-D transforms in another order of the same passes:

    input split (any)  ->  (p1, p2, 1): rfft along W  ->  (p1, 1, p2): fft along H
                       ->  (1, p1, p2): fft along D   =  Spectrum.data

``irfftn`` runs the inverse passes in reverse and returns the shard in the input's layout. Complex
values travel as real pairs (a trailing dim), in the activation's dtype.

Memory: a pass and a transpose each hold their input and output at once, so the whole chain run on
all channels together would peak at about twice the shard above what it keeps (as ``torch.fft`` does
in one process). The channels are independent, so the chain runs on :data:`GROUPS` groups of them in
turn, each written into the preallocated result: the transient shrinks by the group count, for as
many more (smaller) messages. Each direction is one autograd function whose backward is the other
direction (torch's adjoints of the real transforms: the W modes stored once for two are halved or
doubled), so backward runs grouped too, and is differentiable again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hybridpar.comm.redistribute import infer_global_shape, local_box, redistribute, redistribute_tensor
from hybridpar.device.eager import eager
from hybridpar.grid import ProcessGrid
from hybridpar.relayout import pencil, redistribute_volume

__all__ = ["GROUPS", "GROUP_BYTES", "Spectrum", "group_count", "irfftn", "rfftn", "transpose_elements",
           "wavenumbers"]

GROUPS = 4
"""Channel groups a transform runs in turn (fewer where N·C is smaller): the transient memory of the
passes and transposes is about 1/GROUPS of the shard's, for GROUPS times the messages."""
GROUP_BYTES = 1 << 20
"""No group smaller than this (bytes of the rank's shard): below it a group saves less memory than its
messages cost in latency, so a small transform runs in one piece."""


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
    # tensor again without a copy. Differentiable (the adjoint tests read it so); an empty shard's
    # pairs are built (view_as_real's backward cannot view an empty gradient)
    pairs = torch.view_as_real(z) if z.numel() else torch.stack([z.real, z.imag], dim=-1)
    return torch.view_as_complex(redistribute(pairs, src, dst, shape, trailing=1))


def _pass(fn, z: torch.Tensor, dim: int, **kwargs) -> torch.Tensor:  # noqa: ANN001
    """One 1-D transform of a pencil. A pencil may be empty (more ranks along a dim than voxels), and
    MKL refuses an empty batch: the empty result is then made by hand."""
    if z.numel():
        return fn(z, dim=dim, **kwargs)
    probe = fn(torch.zeros(z.shape[dim], dtype=z.dtype), dim=0, **kwargs)  # the pass's length and dtype
    shape = [*z.shape]
    shape[dim] = probe.shape[0]
    return torch.zeros(shape, dtype=probe.dtype, device=z.device)


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


def _groups(n: int, c: int, nbytes: int) -> list[tuple[slice, slice]]:
    """(samples, channels) index pairs of the groups the chain runs in turn on a shard of ``nbytes``:
    whole samples where there are at least as many as groups, else each sample's channels in up to
    ``ceil(groups / n)`` ranges; :data:`GROUPS` groups, fewer where each would hold less than
    :data:`GROUP_BYTES`."""
    count = max(1, min(GROUPS, nbytes // max(GROUP_BYTES, 1)))
    if count == 1:
        return [(slice(None), slice(None))]
    if n >= count:
        cuts = [n * i // count for i in range(count + 1)]
        return [(slice(a, b), slice(None)) for a, b in zip(cuts, cuts[1:], strict=False)]
    parts = min(c, -(-count // max(n, 1)))
    cuts = [c * i // parts for i in range(parts + 1)] if parts else [0, c]
    return [(slice(i, i + 1), slice(a, b)) for i in range(n) for a, b in zip(cuts, cuts[1:], strict=False)]


def group_count(n: int, c: int, nbytes: int) -> int:
    """How many groups a transform of ``n`` samples of ``c`` channels, ``nbytes`` on this rank, runs in
    turn (each transpose sends that many messages to each peer): what the performance model charges
    latency for."""
    return len(_groups(n, c, nbytes))


def _grouped(chain, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """``chain`` (shape-preserving in N and C) of ``x``'s channel groups, written into one result."""
    groups = _groups(x.shape[0], x.shape[1], x.numel() * x.element_size())
    if len(groups) <= 1:
        return chain(x)
    out = None
    for samples, channels in groups:
        piece = chain(x[samples, channels])
        if out is None:
            out = piece.new_empty((*x.shape[:2], *piece.shape[2:]))
        out[samples, channels] = piece
        del piece
    return out


def _forward_chain(x: torch.Tensor, grid: ProcessGrid, shape: tuple[int, int, int],
                   norm: str) -> torch.Tensor:
    """The three forward passes and their transposes: this rank's modes in layout ``c`` (no autograd)."""
    a, b, c = _layouts(grid)
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    # each step rebinds z, so that a pass's input is freed as soon as its output exists
    z = _pass(torch.fft.rfft, redistribute_tensor(x, shape, grid, a), -1, norm=norm)
    z = _move(z, modes, a, b)
    z = _pass(torch.fft.fft, z, -2, norm=norm)
    z = _move(z, modes, b, c)
    return _pass(torch.fft.fft, z, -3, norm=norm)


def _inverse_chain(z: torch.Tensor, grid: ProcessGrid, shape: tuple[int, int, int],
                   norm: str) -> torch.Tensor:
    """The inverse passes in reverse: this rank's real shard in ``grid``'s layout (no autograd)."""
    a, b, c = _layouts(grid)
    modes = (shape[0], shape[1], shape[2] // 2 + 1)
    z = _pass(torch.fft.ifft, z, -3, norm=norm)
    z = _move(z, modes, c, b)
    z = _pass(torch.fft.ifft, z, -2, norm=norm)
    z = _move(z, modes, b, a)
    x = _pass(torch.fft.irfft, z, -1, n=shape[2], norm=norm)
    del z
    return redistribute_tensor(x, shape, a, grid)


_FLIP = {"backward": "forward", "forward": "backward"}
"""The adjoint of a transform normalised one way is the opposite one normalised the other way:
unscaled forward <-> unscaled inverse, forward scaled by 1/N <-> inverse scaled by 1/N."""


def _twice_stored(layout: ProcessGrid, shape: tuple[int, int, int], device: torch.device) -> torch.Tensor:
    """Per held W mode: True where the real transform stores one mode for two (0 < kw < W / 2)."""
    (w0, w1) = local_box((shape[0], shape[1], shape[2] // 2 + 1), layout)[2]
    kw = torch.arange(w0, w1, device=device)
    return ((kw > 0) & (2 * kw != shape[2])).view(1, 1, -1)


class _Transform(torch.autograd.Function):
    """``rfftn`` (``inverse`` False) or ``irfftn`` of a split field, grouped. Backward is the other
    direction normalised the other way: the forward's is the inverse of the gradient with its twice
    stored W modes halved, the inverse's the forward of the gradient with them doubled (torch's
    adjoints of the real transforms); autograd functions both ways, so it differentiates again."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, grid: ProcessGrid, shape: tuple[int, int, int], norm: str,  # noqa: ANN205
                inverse: bool):
        ctx.meta = (grid, shape, norm, inverse)
        chain = _inverse_chain if inverse else _forward_chain
        return _grouped(lambda part: chain(part, grid, shape, norm), t)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # noqa: ANN205
        grid, shape, norm, inverse = ctx.meta
        twice = _twice_stored(_layouts(grid)[2], shape, g.device)
        if inverse:
            modes = _Transform.apply(g, grid, shape, _FLIP[norm], False)
            grad = torch.where(twice, modes * 2, modes)
        else:
            grad = _Transform.apply(torch.where(twice, g * 0.5, g), grid, shape, _FLIP[norm], True)
        return grad, None, None, None, None


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
    return Spectrum(_transform(x, grid, shape, inverse=False), shape, _layouts(grid)[2])


def irfftn(spectrum: Spectrum, grid: ProcessGrid) -> torch.Tensor:
    """The real field of ``spectrum`` (``torch.fft.irfftn(X, s=(D, H, W))`` of the whole), as this
    rank's shard in ``grid``'s layout (the one ``rfftn`` took it in). Differentiable."""
    _check(spectrum.data, "irfftn")
    a, b, c = _layouts(grid)
    if spectrum.layout.spatial_shape != c.spatial_shape:
        raise ValueError(f"hybridpar.fft.irfftn: a spectrum laid out {spectrum.layout.spatial_shape} for a "
                         f"grid whose spectra are laid out {c.spatial_shape}; pass the grid rfftn was given")
    return _transform(spectrum.data, grid, spectrum.shape, inverse=True)


@eager  # communication: runs eagerly under torch.compile (a graph break)
def _transform(t: torch.Tensor, grid: ProcessGrid, shape: tuple[int, int, int],
               inverse: bool) -> torch.Tensor:
    return _Transform.apply(t, grid, shape, "backward", inverse)
