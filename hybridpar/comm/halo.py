"""Halo exchange between spatial neighbours, as a linear operator with its exact adjoint.

Why: a window layer on a spatial shard needs the voxels its neighbours own near the shared faces.
Exchanging dim by dim (depth, then height on the depth-extended tensor, then width) carries edges and
corners along in 6 messages instead of 26. The backward pass is the adjoint: halo gradients travel
back to their owners and are added there, in the reverse dim order. Boundary padding and trimming of
input a rank does not need are part of the same operator, so a layer runs its torch kernel on the
result with no padding at all. The padding is a fill (zero, or -inf for max pooling), halos across
the faces of a periodic box (``circular``: the last shard's upper neighbour is the first shard), or
copies of edge voxels (``replicate``/``reflect``, whose adjoint adds their gradients back into the
voxels they copy).

Memory format and dtype: every message, receive buffer and extended tensor is allocated in the
format of the shard (``channels_last_3d`` stays so, packed from strided views without a copy of the
shard) and travels in the shard's dtype (see :mod:`hybridpar.device.memfmt`,
:mod:`hybridpar.device.precision`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridpar.comm import background
from hybridpar.comm.transport import Transport
from hybridpar.device import memfmt
from hybridpar.device.eager import eager
from hybridpar.geometry import HaloPlan
from hybridpar.profiling import range as prange

_FWD_TAG, _ADJ_TAG = 100, 200

Message = tuple[int | None, torch.Tensor, int]      # (peer, tensor, tag)
Wanted = tuple[int | None, list[int], int]          # (peer, shape, tag)


@dataclass(frozen=True)
class DimExchange:
    """One tensor dim's plan and this rank's neighbours along the matching grid axis."""

    dim: int                 # tensor dim (2, 3, 4 for N, C, D, H, W)
    plan: HaloPlan
    lo: int | None           # global rank of the lower neighbour (across the face when periodic)
    hi: int | None

    @property
    def trivial(self) -> bool:
        p = self.plan
        return not (p.pad_lo or p.pad_hi or p.recv_lo or p.recv_hi or p.trim_lo or p.trim_hi
                    or p.send_lo[1] > p.send_lo[0] or p.send_hi[1] > p.send_hi[0])


def _sized(x: torch.Tensor, dim: int, extent: int) -> list[int]:
    shape = list(x.shape)
    shape[dim] = extent
    return shape


def _cat(pieces: list[torch.Tensor], like: torch.Tensor, dim: int) -> torch.Tensor:
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces, dim=dim) if pieces else memfmt.empty(_sized(like, dim, 0), like)


_INDICES: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _index(idx: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The index tensor of ``idx`` on ``device``, made once (no host-to-device copy per call)."""
    key = (tuple(idx), device)
    if key not in _INDICES:
        _INDICES[key] = torch.tensor(idx, dtype=torch.long, device=device)
    return _INDICES[key]


def _mapped(fetched: torch.Tensor, p: HaloPlan, d: int) -> torch.Tensor:
    """``fetched[p.index]`` along ``d``: edge copies beyond the faces, one contiguous run between."""
    idx = p.index or ()
    mid = len(idx) - p.pad_lo - p.pad_hi
    if mid == len(idx) and mid == fetched.shape[d]:
        return fetched
    pieces = []
    if p.pad_lo:
        pieces.append(memfmt.as_format(fetched.index_select(d, _index(idx[:p.pad_lo], fetched.device)),
                                       fetched))
    if mid > 0:
        pieces.append(fetched.narrow(d, idx[p.pad_lo], mid))
    if p.pad_hi:
        pieces.append(memfmt.as_format(
            fetched.index_select(d, _index(idx[len(idx) - p.pad_hi:], fetched.device)), fetched))
    return _cat(pieces, fetched, d)


def _unmapped(g: torch.Tensor, p: HaloPlan, d: int) -> torch.Tensor:
    """Adjoint of :func:`_mapped`: each voxel's gradient added into the fetched voxel it copies.

    One slice at a time beyond the faces (a few voxels) rather than ``index_add_``, whose CUDA kernel
    adds duplicates atomically in no fixed order.
    """
    idx = p.index or ()
    mid = len(idx) - p.pad_lo - p.pad_hi
    if mid == len(idx) and mid == p.fetched:
        return g
    out = memfmt.zeros(_sized(g, d, p.fetched), g)
    if mid > 0:
        out.narrow(d, idx[p.pad_lo], mid).copy_(g.narrow(d, p.pad_lo, mid))
    for k in (*range(p.pad_lo), *range(len(idx) - p.pad_hi, len(idx))):
        out.narrow(d, idx[k], 1).add_(g.narrow(d, k, 1))
    return out


class HaloExchanger:
    """Extends a local shard by its halos (``forward``) and returns halo gradients (``adjoint``).

    ``rank``: this process's global rank. A periodic dim split once makes the rank its own neighbour
    across both faces: its messages to itself are handed over in memory (torch.distributed refuses
    to send to oneself). :attr:`dims` are the dims that exchange anything, :attr:`all_dims` every dim
    given, in order (a layer reads its per-dim plans there).
    """

    def __init__(self, dims: list[DimExchange], transport: Transport, fill: float = 0.0,
                 rank: int | None = None) -> None:
        self.all_dims = list(dims)
        self.dims = [d for d in dims if not d.trivial]
        self.transport = transport
        self.fill = fill
        self.rank = rank

    def _swap(self, sends: list[Message], wanted: list[Wanted], like: torch.Tensor,
              what: str) -> list[torch.Tensor]:
        """Post ``sends``, return what arrives for ``wanted`` in its order.

        A message to this rank itself is the sent tensor (no copy). The rest go to the transport in
        tag order on both sides: transports that pair messages per peer in posting order (NCCL
        ignores tags) then pair them as the tags do, which matters with two shards along a periodic
        dim, whose left and right neighbour are one rank sending two messages.
        """
        mine = {tag: t for peer, t, tag in sends if peer == self.rank}
        got, recvs = [], []
        for peer, shape, tag in wanted:
            if peer == self.rank:
                got.append(mine[tag])
            else:
                buf = memfmt.empty(shape, like)
                got.append(buf)
                recvs.append((peer, buf, tag))
        with prange("halo_pack", "halo"):  # faces into dense messages: copies, apart from the wait
            out = [(peer, memfmt.dense(t), tag) for peer, t, tag in sends if peer != self.rank]
        if out or recvs:
            with prange(what, "halo"):
                self.transport.exchange(sorted(out, key=lambda m: m[2]), sorted(recvs, key=lambda m: m[2]))
        return got

    # ------------------------------------------------------------------ forward
    def _forward_dim(self, x: torch.Tensor, ex: DimExchange) -> torch.Tensor:
        p, d = ex.plan, ex.dim
        tag = _FWD_TAG + 2 * d               # tag: sent upwards (to hi), tag + 1: sent downwards
        (a, b), (c, e) = p.send_lo, p.send_hi
        sends = [(ex.lo, x.narrow(d, a, b - a), tag + 1)] if b > a else []
        sends += [(ex.hi, x.narrow(d, c, e - c), tag)] if e > c else []
        wanted = [(ex.lo, _sized(x, d, p.recv_lo), tag)] if p.recv_lo else []
        wanted += [(ex.hi, _sized(x, d, p.recv_hi), tag + 1)] if p.recv_hi else []
        got = self._swap(sends, wanted, x, "halo_exchange")
        lo_buf = got[0] if p.recv_lo else None
        hi_buf = got[-1] if p.recv_hi else None
        fill = p.index is None
        pieces = []
        if fill and p.pad_lo:
            pieces.append(memfmt.full(_sized(x, d, p.pad_lo), self.fill, x))
        if lo_buf is not None:
            pieces.append(lo_buf)
        if p.kept:
            pieces.append(x.narrow(d, p.trim_lo, p.kept))
        if hi_buf is not None:
            pieces.append(hi_buf)
        if fill and p.pad_hi:
            pieces.append(memfmt.full(_sized(x, d, p.pad_hi), self.fill, x))
        with prange("halo_unpack", "halo"):  # the extended tensor assembled: a copy of the shard
            y = _cat(pieces, x, d)
            return y if fill else _mapped(y, p, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The extended local input: own shard, neighbours' halos, boundary padding, surplus trimmed."""
        for ex in self.dims:
            x = self._forward_dim(x, ex)
        return x

    # ------------------------------------------------------------------ adjoint
    def _adjoint_dim(self, g: torch.Tensor, ex: DimExchange) -> torch.Tensor:
        p, d = ex.plan, ex.dim
        n_own = p.own[1] - p.own[0]
        tag = _ADJ_TAG + 2 * d
        if p.index is not None:
            g, off = _unmapped(g, p, d), 0
        else:
            off = p.pad_lo
        sends = [(ex.lo, g.narrow(d, off, p.recv_lo), tag + 1)] if p.recv_lo else []
        sends += [(ex.hi, g.narrow(d, off + p.recv_lo + p.kept, p.recv_hi), tag)] if p.recv_hi else []
        lo_w, hi_w = p.send_lo[1] - p.send_lo[0], p.send_hi[1] - p.send_hi[0]
        wanted = [(ex.lo, _sized(g, d, lo_w), tag)] if lo_w > 0 else []
        wanted += [(ex.hi, _sized(g, d, hi_w), tag + 1)] if hi_w > 0 else []
        got = self._swap(sends, wanted, g, "halo_adjoint")
        lo_buf = got[0] if lo_w > 0 else None
        hi_buf = got[-1] if hi_w > 0 else None
        if p.kept == n_own and lo_buf is None and hi_buf is None:
            return g.narrow(d, off + p.recv_lo, n_own)
        with prange("halo_unpack", "halo"):  # halo gradients added into the own shard's
            out = memfmt.zeros(_sized(g, d, n_own), g)
            if p.kept:
                out.narrow(d, p.trim_lo, p.kept).add_(g.narrow(d, off + p.recv_lo, p.kept))
            if lo_buf is not None:
                out.narrow(d, p.send_lo[0], lo_w).add_(lo_buf)
            if hi_buf is not None:
                out.narrow(d, p.send_hi[0], hi_w).add_(hi_buf)
            return out

    def adjoint(self, g: torch.Tensor) -> torch.Tensor:
        """Gradient w.r.t. the own shard from the gradient w.r.t. the extended input."""
        for ex in reversed(self.dims):
            g = self._adjoint_dim(g, ex)
        return g  # may be a view of the extended gradient (no copy): autograd takes strided grads

    # ------------------------------------------------------------------ overlap
    def start_forward(self, x: torch.Tensor):
        """``forward`` beside the caller's computation; ``.result()`` gives the extended input."""
        return background.start(self.forward, x, device=x.device)

    def start_adjoint(self, g: torch.Tensor):
        """``adjoint`` beside the caller's computation; ``.result()`` gives the own-shard gradient."""
        return background.start(self.adjoint, g, device=g.device)


class HaloExchange(torch.autograd.Function):
    """Autograd wrapper: forward extends by halos, backward returns halo gradients to their owners."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, exchanger: HaloExchanger) -> torch.Tensor:
        ctx.exchanger = exchanger
        return exchanger.forward(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return HaloSum.apply(g, ctx.exchanger), None


class HaloSum(torch.autograd.Function):
    """The exchange's adjoint (halo gradients summed into their owners) as an autograd function of its
    own, whose backward is the exchange: so a gradient of a gradient crosses the halos too."""

    @staticmethod
    def forward(ctx, g: torch.Tensor, exchanger: HaloExchanger) -> torch.Tensor:
        ctx.exchanger = exchanger
        return exchanger.adjoint(memfmt.dense(g))

    @staticmethod
    def backward(ctx, gg: torch.Tensor):
        return HaloExchange.apply(memfmt.dense(gg), ctx.exchanger), None


@eager
def halo_exchange(x: torch.Tensor, exchanger: HaloExchanger) -> torch.Tensor:
    """Differentiable halo exchange (see :class:`HaloExchanger`).

    Runs eagerly under ``torch.compile`` (a graph break): it is communication, the one thing a
    compiled graph of a split layer leaves out. An exchanger with nothing to exchange (an unsplit
    layer padded by its kernel) returns ``x`` without breaking the graph (see :func:`exchange`).
    """
    return HaloExchange.apply(x, exchanger)


def exchange(x: torch.Tensor, exchanger: HaloExchanger) -> torch.Tensor:
    """:func:`halo_exchange`, or ``x`` itself where there is nothing to exchange, pad or trim."""
    return halo_exchange(x, exchanger) if exchanger.dims else x
