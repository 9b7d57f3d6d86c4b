"""Measuring this host: fitted per-op-class compute costs and alpha-beta links.

Why a module of its own: this is the part of the performance model that runs torch kernels and
talks to other processes; everything else computes from shapes. Kernels are timed on one thread
per rank (as the harness runs them) and fitted to ``flops / flop_rate + bytes / byte_rate +
overhead`` per op class; links are timed as ping-pong and as a halo-like exchange right after
computing (:func:`exchange_after_compute`), which on a CPU host can cost far more than a ping-pong.
Layer times at exact shapes are in :mod:`.calibrate_layers`.
"""

from __future__ import annotations

import itertools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.perfmodel.machine import Compute, Cost, Link, Machine

__all__ = ["CONV_CASES", "ELEMENTWISE_CASES", "LINEAR_CASES", "calibrate_compute", "exchange_after_compute",
           "fit_cost", "fit_link", "link_from_samples", "local_machine", "median_time", "pingpong",
           "time_loop"]


def fit_cost(samples: Iterable[tuple[float, float, float]]) -> Cost:
    """Least-squares fit of ``t = a*flops + b*bytes + c`` to ``(flops, bytes, seconds)`` samples.

    Relative errors are minimised (each row is divided by its time), and the coefficients must not be
    negative: every subset of the three terms is fitted and the best non-negative one kept.
    """
    rows = [(float(f), float(b), float(t)) for f, b, t in samples if t > 0]
    if not rows:
        raise ValueError("fit_cost: no samples with a positive time")
    best: tuple[float, list[float]] | None = None
    for mask in itertools.product((0, 1), repeat=3):
        if not any(mask):
            continue
        cols = [i for i in range(3) if mask[i]]
        a = torch.tensor([[(f, b, 1.0)[i] / t for i in cols] for f, b, t in rows], dtype=torch.float64)
        y = torch.ones(len(rows), 1, dtype=torch.float64)
        try:
            coef = torch.linalg.lstsq(a, y, driver="gelsd").solution.flatten().tolist()
        except RuntimeError:
            continue
        if any(c < 0 for c in coef):
            continue
        full = [0.0, 0.0, 0.0]
        for i, c in zip(cols, coef):
            full[i] = c
        err = sum(((full[0] * f + full[1] * b + full[2]) / t - 1) ** 2 for f, b, t in rows)
        if best is None or err < best[0] - 1e-12:
            best = (err, full)
    assert best is not None
    a, b, c = best[1]
    return Cost(1 / a if a > 0 else math.inf, 1 / b if b > 0 else math.inf, c)


def fit_link(samples: Iterable[tuple[int, float]]) -> Link:
    """Alpha-beta fit of one-way message times ``(bytes, seconds)`` (relative least squares)."""
    cost = fit_cost((0.0, n, t) for n, t in samples)
    return Link(cost.overhead, cost.byte_rate)


def link_from_samples(samples: Sequence[tuple[int, float]], small: int = 1 << 15) -> Link:
    """A robust alpha-beta link from noisy ``(bytes, seconds)`` samples: alpha is the median time of
    the messages up to ``small`` bytes, the bandwidth what the largest message adds to it (falling
    back to :func:`fit_link` when that is not positive)."""
    lat = statistics.median(t for n, t in samples if n <= small)
    n_max, t_max = max(samples)
    if t_max > lat:
        return Link(lat, n_max / (t_max - lat))
    return fit_link(samples)



def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 1,
                stat: Callable = statistics.median) -> float:
    """``stat`` (default: the median) of ``repeats`` timed calls of ``fn`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return stat(times)


def time_loop(fn: Callable[[], Any], seconds: float, warmup: int = 1) -> float:
    """Median seconds per call of ``fn`` called repeatedly for ``seconds`` of wall time."""
    for _ in range(warmup):
        fn()
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


CONV_CASES = ((4, 8, 32, 1), (4, 8, 16, 2), (4, 16, 16, 1), (8, 16, 16, 1), (8, 16, 8, 2), (16, 32, 8, 1),
              (16, 32, 16, 1), (32, 64, 8, 1), (32, 64, 4, 2), (4, 32, 16, 1), (64, 64, 4, 1))
"""(C_in, C_out, S, N) of the calibration convolutions (k3, padding 1, on N x C_in x S^3)."""
ELEMENTWISE_CASES = ((8, 32, 1), (16, 16, 2), (32, 16, 1), (64, 8, 1), (4, 32, 1), (32, 8, 2))
"""(C, S, N) of the calibration pooling and activation layers."""
LINEAR_CASES = ((1, 4096, 32), (4, 4096, 32), (2, 16384, 128), (8, 512, 64))
"""(N, in, out) of the calibration linear layers."""


def _conv_samples(repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    fwd, bwd = [], []
    for c_in, c_out, s, n in CONV_CASES:
        conv = nn.Conv3d(c_in, c_out, 3, padding=1)
        for needs_grad in (False, True):
            x = torch.randn(n, c_in, s + 2, s + 2, s + 2, requires_grad=needs_grad)
            conv_nopad = nn.Conv3d(c_in, c_out, 3)  # distributed convs run unpadded on extended inputs
            conv_nopad.load_state_dict(conv.state_dict())
            y = conv_nopad(x)
            g = torch.randn_like(y)
            f = 2 * y.numel() * c_in * 27
            nbytes = 4 * (x.numel() + y.numel() + conv.weight.numel())
            if not needs_grad:
                fwd.append((f, nbytes, median_time(lambda c=conv_nopad, x=x: c(x), repeats)))
            params = list(conv_nopad.parameters())

            def backward(c=conv_nopad, x=x, g=g, params=params) -> None:
                out = c(x)
                torch.autograd.grad(out, [x, *params] if x.requires_grad else params, g)

            t = median_time(backward, repeats) - median_time(lambda c=conv_nopad, x=x: c(x), repeats)
            bwd.append((f * (2 if needs_grad else 1), nbytes * (2 if needs_grad else 1), max(t, 1e-6)))
    return {"conv_fwd": fwd, "conv_bwd": bwd}


def _elementwise_samples(repeats: int) -> dict[str, list[tuple[float, float, float]]]:
    pool, point = [], []
    for c, s, n in ELEMENTWISE_CASES:
        x = torch.randn(n, c, s, s, s, requires_grad=True)
        for layer in (nn.MaxPool3d(2), nn.AvgPool3d(3, 2, 1)):
            y = layer(x)
            g = torch.randn_like(y)
            k = layer.kernel_size
            taps = math.prod(k) if isinstance(k, tuple) else k ** 3
            pool.append((taps * y.numel(), 4 * (x.numel() + y.numel()),
                         median_time(lambda layer=layer, x=x: layer(x.detach()), repeats)))
            t = median_time(lambda layer=layer, x=x, g=g: torch.autograd.grad(layer(x), x, g), repeats)
            t -= pool[-1][2]
            pool.append((0.0, 4 * (x.numel() + 2 * y.numel()), max(t, 1e-6)))
        act = nn.LeakyReLU(0.3)
        g = torch.randn_like(x)
        point.append((0.0, 4 * 2 * x.numel(), median_time(lambda x=x, a=act: a(x.detach()), repeats)))
        t = median_time(lambda x=x, g=g, a=act: torch.autograd.grad(a(x), x, g), repeats) - point[-1][2]
        point.append((0.0, 4 * 3 * x.numel(), max(t, 1e-6)))
    return {"pool": pool, "pointwise": point}


def _linear_samples(repeats: int) -> list[tuple[float, float, float]]:
    out = []
    for n, fin, fout in LINEAR_CASES:
        lin = nn.Linear(fin, fout)
        x = torch.randn(n, fin, requires_grad=True)
        f = 2 * n * fin * fout
        nbytes = 4 * (x.numel() + n * fout + lin.weight.numel())
        t = median_time(lambda lin=lin, x=x: lin(x.detach()), repeats)
        out.append((f, nbytes, t))
        g = torch.randn(n, fout)
        tb = median_time(lambda lin=lin, x=x, g=g: torch.autograd.grad(lin(x), [x, *lin.parameters()], g),
                          repeats) - t
        out.append((2 * f, 2 * nbytes, max(tb, 1e-6)))
    return out


def calibrate_compute(repeats: int = 5, threads: int = 1) -> tuple[Compute, dict[str, Any]]:
    """Time conv/pool/activation/linear layers at a few sizes on this host; fit a :class:`Cost` each.

    Runs with ``threads`` intra-op threads (the harness runs one per rank). Returns the fitted
    :class:`Compute` and the raw samples with the fit's relative error per sample (for the record).
    About 10-30 s on a laptop core.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    try:
        samples = _conv_samples(repeats)
        samples.update(_elementwise_samples(repeats))
        samples["linear"] = _linear_samples(repeats)
    finally:
        torch.set_num_threads(before)
    costs = {k: fit_cost(v) for k, v in samples.items()}
    compute = Compute(**costs, dtype_bytes=4)
    record = {k: [{"flops": f, "bytes": b, "seconds": t, "fit_ratio": costs[k].time(f, b) / t}
                  for f, b, t in v] for k, v in samples.items()}
    return compute, record


def pingpong(peer: int, sizes: Sequence[int] = (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22, 1 << 24),
             repeats: int = 20, group: Any = None) -> list[tuple[int, float]]:
    """One-way message times ``(bytes, seconds)`` between this rank and ``peer`` (half a round trip).

    Call on both ranks of an initialised process group (the lower rank sends first).
    """
    import torch.distributed as dist  # noqa: PLC0415

    me = dist.get_rank()
    out = []
    for n in sizes:
        buf = torch.zeros(max(n // 4, 1), dtype=torch.float32)
        reps = max(3, repeats if n <= 1 << 20 else repeats // 4)
        times = []
        for i in range(reps + 2):
            t0 = time.perf_counter()
            if me < peer:
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
            else:
                dist.recv(buf, peer, group=group)
                dist.send(buf, peer, group=group)
            if i >= 2:
                times.append((time.perf_counter() - t0) / 2)
        out.append((buf.numel() * 4, statistics.median(times)))
    return out


def exchange_after_compute(peer: int, sizes: Sequence[int] = (8, 1 << 12, 1 << 15, 1 << 17, 1 << 19, 1 << 21),
                           busy: float = 3e-3, repeats: int = 12,
                           group: Any = None) -> list[tuple[int, float]]:
    """Seconds of a halo-like exchange (``batch_isend_irecv``, one message each way) right after
    ``busy`` seconds of computation, per message size; median over ``repeats``.

    This is what a halo exchange costs between layers, which ping-pong does not show: a rank that
    finishes first blocks, and on a virtual machine waking its idle core again can take milliseconds.
    Call on both ranks of an initialised process group.
    """
    import torch.distributed as dist  # noqa: PLC0415

    a = torch.randn(96, 96)
    out = []
    for n in sizes:
        send, recv = torch.zeros(max(n // 4, 1)), torch.zeros(max(n // 4, 1))
        times = []
        for i in range(repeats + 2):
            end = time.perf_counter() + busy
            while time.perf_counter() < end:
                torch.mm(a, a)
            t0 = time.perf_counter()
            ops = [dist.P2POp(dist.irecv, recv, peer, group), dist.P2POp(dist.isend, send, peer, group)]
            for req in dist.batch_isend_irecv(ops):
                req.wait()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out.append((send.numel() * 4, statistics.median(times)))
    return out


def local_machine(compute: Compute, link: Link, contention: float = 1.0, step_overhead: float = 0.0,
                  micro_overhead: float = 0.0, description: str = "", sources: str = "") -> Machine:
    """This host as a :class:`Machine`: one node whose ranks share its cores over loopback."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Machine("local", description or f"{platform.node()}: {cores} cores, gloo over loopback",
                   compute, link, link, 1 << 30, float(mem), cores, contention, 0.0, step_overhead,
                   micro_overhead, sources or "measured: calibrate_compute, measure_layers and "
                   "measure_engine_overhead (1 thread per rank), pingpong over gloo")
