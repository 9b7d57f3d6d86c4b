"""Convolution whose interior is computed while the halos are in flight, forward and backward.

Why: the halo exchange is latency the convolution can hide. Outputs that read only locally held
voxels (own shard and boundary padding) form an *interior* box; the rest is a shell of six slabs.

* forward: start the exchange, compute the interior from local data, wait, compute the shell.
* backward: the halo part of the input gradient comes only from shell outputs, so compute that part
  first, start sending it to its owners, and compute the weight gradient (the bulk of the work) and
  the interior's input gradient meanwhile; the weight-gradient all-reduce is in flight at the same time.

Unlike LBANN (forward only, one split dim), this works for any split and in both directions. The
arithmetic is that of :class:`torch.nn.Conv3d`; only the order of the work changes.

Under autocast the caller casts the shard (before the exchange); the weight and bias arrive in their
own dtype and are cast here, as autocast would cast them, so that their gradients leave in the
parameters' dtype and are summed over the shards in it. The kernels run with autocast off, on
explicit dtypes (the backward runs outside autocast anyway). Buffers keep the shard's memory format.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.nn.grad import conv3d_input, conv3d_weight

from hybridpar.comm.halo import HaloExchanger
from hybridpar.comm.reduce import all_reduce_async, grad_sync_enabled
from hybridpar.device import memfmt
from hybridpar.device.precision import no_autocast
from hybridpar.geometry import interior

Box = tuple[tuple[int, int], tuple[int, int], tuple[int, int]]


def _available(x: torch.Tensor, ex: HaloExchanger) -> tuple[torch.Tensor, list[int]]:
    """Locally held part of the extended input, and its offset in extended coordinates per dim."""
    offsets = []
    for d in ex.all_dims:
        p, dim = d.plan, d.dim
        own = x.shape[dim] - p.trim_lo - p.trim_hi
        pieces = []
        if p.recv_lo == 0 and p.pad_lo:
            pieces.append(memfmt.full((*x.shape[:dim], p.pad_lo, *x.shape[dim + 1:]), ex.fill, x))
        if own > 0:
            pieces.append(x.narrow(dim, p.trim_lo, own))
        if p.recv_hi == 0 and p.pad_hi:
            pieces.append(memfmt.full((*x.shape[:dim], p.pad_hi, *x.shape[dim + 1:]), ex.fill, x))
        x = torch.cat(pieces, dim) if len(pieces) > 1 else pieces[0]
        offsets.append(0 if p.recv_lo == 0 else p.pad_lo + p.recv_lo)
    return x, offsets


def _boxes(n_out: list[int], inner: list[tuple[int, int]]) -> tuple[Box | None, list[Box]]:
    """The interior box and the shell slabs (disjoint, covering the local output)."""
    full = [(0, n) for n in n_out]
    (d0, d1), (h0, h1), (w0, w1) = inner
    shell: list[Box] = [((0, d0), full[1], full[2]), ((d1, n_out[0]), full[1], full[2]),
                        ((d0, d1), (0, h0), full[2]), ((d0, d1), (h1, n_out[1]), full[2]),
                        ((d0, d1), (h0, h1), (0, w0)), ((d0, d1), (h0, h1), (w1, n_out[2]))]
    nonempty = lambda b: all(hi > lo for lo, hi in b)  # noqa: E731
    core = ((d0, d1), (h0, h1), (w0, w1))
    return (core if nonempty(core) else None), [b for b in shell if nonempty(b)]


def _window(box: Box, stride, dilation, kernel) -> Box:
    """Extended-input range read by an output box."""
    return tuple((lo * s, (hi - 1) * s + d * (k - 1) + 1)
                 for (lo, hi), s, d, k in zip(box, stride, dilation, kernel))  # type: ignore[return-value]


def _sl(box: Box, shift: list[int] | None = None) -> tuple[slice, ...]:
    shift = shift or [0, 0, 0]
    return (slice(None), slice(None), *(slice(lo - o, hi - o) for (lo, hi), o in zip(box, shift)))


def _param_grads(ext, weight, gy, stride, dilation, groups, has_bias: bool, master: torch.dtype):
    """Weight and bias gradients in the parameters' own dtype (summed over shards in it)."""
    gw = conv3d_weight(ext, weight.shape, gy, stride, 0, dilation, groups).to(master)
    gb = gy.sum(dim=(0, 2, 3, 4), dtype=torch.float32 if gy.dtype.itemsize < 4 else None).to(master) \
        if has_bias else None
    return gw, gb


class OverlappedConv3d(torch.autograd.Function):
    """``conv3d(halo(x), w, b)`` with the exchange hidden behind the interior (see module doc)."""

    @staticmethod
    def forward(ctx, x, weight, bias, ex: HaloExchanger, stride, dilation, groups, group):
        kernel = weight.shape[2:]
        master = weight.dtype
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
        pending = ex.start_forward(x)
        avail, offsets = _available(x, ex)
        n_out = [(p.out[1] - p.out[0]) for p in (d.plan for d in ex.all_dims)]
        inner = [interior(d.plan, n, k, s, dl) for d, n, k, s, dl in
                 zip(ex.all_dims, n_out, kernel, stride, dilation)]
        core, shell = _boxes(n_out, inner)
        y = memfmt.empty((x.shape[0], weight.shape[0], *n_out), x)
        conv = lambda t: F.conv3d(t, weight, bias, stride, 0, dilation, groups)  # noqa: E731
        with no_autocast(x.device.type):
            if core is not None:
                y[_sl(core)] = conv(avail[_sl(_window(core, stride, dilation, kernel), offsets)])
            ext = pending.result()
            for box in shell:
                y[_sl(box)] = conv(ext[_sl(_window(box, stride, dilation, kernel))])
        ctx.save_for_backward(ext, weight)
        ctx.meta = (ex, stride, dilation, groups, group, core, shell, bias is not None, tuple(x.shape),
                    master)
        return y

    @staticmethod
    @once_differentiable  # its backward runs collectives outside autograd: a second one is refused
    def backward(ctx, gy):
        ext, weight = ctx.saved_tensors
        ex, stride, dilation, groups, group, core, shell, has_bias, x_shape, master = ctx.meta
        gy = memfmt.dense(gy.to(ext.dtype))
        kernel = weight.shape[2:]
        if not ctx.needs_input_grad[0]:  # e.g. the first layer: no input gradient, no halo traffic
            gw, gb = _param_grads(ext, weight, gy, stride, dilation, groups, has_bias, master)
            if grad_sync_enabled():
                work = all_reduce_async([t for t in (gw, gb) if t is not None], group)
                if work is not None:
                    work.wait()
            return None, gw, gb, None, None, None, None, None
        # 1. Input gradient that comes from the shell: it holds every halo gradient.
        g_shell = torch.zeros_like(ext)
        for box in shell:
            win = _window(box, stride, dilation, kernel)
            size = (ext.shape[0], ext.shape[1], *(hi - lo for lo, hi in win))
            g_shell[_sl(win)] += conv3d_input(size, weight, gy[_sl(box)], stride, 0, dilation, groups)
        pending = ex.start_adjoint(g_shell)
        # 2. Meanwhile: weight and bias gradients (and their all-reduce), then the interior.
        gw, gb = _param_grads(ext, weight, gy, stride, dilation, groups, has_bias, master)
        reduce = all_reduce_async([t for t in (gw, gb) if t is not None], group) \
            if grad_sync_enabled() else None
        g_core = None
        if core is not None:
            win = _window(core, stride, dilation, kernel)
            size = (ext.shape[0], ext.shape[1], *(hi - lo for lo, hi in win))
            g_core = (win, conv3d_input(size, weight, gy[_sl(core)], stride, 0, dilation, groups))
        gx = pending.result()
        if g_core is not None:
            win, g = g_core
            src, dst = [slice(None)] * 2, [slice(None)] * 2
            for (lo, hi), d in zip(win, ex.all_dims):
                p = d.plan
                own0 = p.pad_lo + p.recv_lo
                own1 = own0 + x_shape[d.dim] - p.trim_lo - p.trim_hi
                a, b = max(lo, own0), min(hi, own1)
                src.append(slice(a - lo, b - lo))
                dst.append(slice(a - own0 + p.trim_lo, b - own0 + p.trim_lo))
            gx[tuple(dst)] += g[tuple(src)]
        if reduce is not None:
            reduce.wait()
        return gx, gw, gb, None, None, None, None, None
