"""Measuring layers at the exact shapes a workload runs them, and the engine's own overhead.

Why: on CPUs a kernel's rate depends on its exact shape (batch 1 vs 4 of the same conv differ up to
4x in FLOP/s), which no smooth fit (:mod:`.calibrate`) captures. Times measured here, keyed by
:func:`hybridpar.perfmodel.workload.layer_key`, replace the fit in ``Machine.measured``. This and
:mod:`.calibrate` are the only parts of the model that run kernels; the engine is imported only
inside the functions that time it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.nn import registry
from hybridpar.perfmodel.calibrate import median_time

__all__ = ["layer_callables", "measure_engine_overhead", "measure_layer", "measure_layers"]


def runnable(m: nn.Module, shape: Sequence[int],
              wrap: bool | None = None) -> tuple[nn.Module, tuple[int, ...]]:
    """``m`` as a rank runs it, and the input that makes its kernel see ``shape``.

    A window layer's kernel runs on its padding-extended shard (``kernel_shape``), so it is fed
    ``shape`` less its padding (from its registry entry's window). With ``wrap`` (default: when a
    one-rank process group is initialised), a layer that has a distributed counterpart runs as that,
    on a one-rank grid, so the time includes what the distributed layer adds around the kernel
    (assembling the extended input, autograd plumbing); without it, the torch layer itself, padding
    included.
    """
    import torch.distributed as dist  # noqa: PLC0415

    entry = registry.lookup(m)
    if entry is None or entry.role not in ("window", "transposed") or len(shape) != 5:
        return copy.deepcopy(m).float().train(), tuple(shape)
    pads = [(0, 0) if w.transposed else (w.pad_lo, w.pad_hi) for w in entry.windows_of(m)]  # crops, not pads
    inner = (*shape[:2], *(n - lo - hi for n, (lo, hi) in zip(shape[2:], pads)))
    if wrap is None:
        wrap = dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1
    if wrap and entry.to_dist is not None:
        from hybridpar.grid import ProcessGrid  # noqa: PLC0415
        from hybridpar.pipeline.convert import to_distributed  # noqa: PLC0415

        k = to_distributed(m.float(), ProcessGrid().with_spatial((1, 1, 1)))
        k.global_input_shape = tuple(inner[2:])
        return k.float().train(), inner
    return copy.deepcopy(m).float().train(), inner


def measure_layer(m: nn.Module, shape: Sequence[int], input_grad: bool, repeats: int = 5,
                  wrap: bool | None = None) -> tuple[float, float]:
    """Forward and backward seconds of ``m`` whose kernel runs on ``shape`` (this thread).

    See :func:`runnable` for what is timed and ``wrap``. The backward is (forward + backward) -
    forward. Each is the fastest of ``repeats`` calls: on a shared machine other processes only ever
    add time, so the minimum is the estimate of the layer alone.
    """
    forward, both = layer_callables(m, shape, input_grad, wrap)
    fwd = median_time(forward, repeats, warmup=2, stat=min)
    if both is None:
        return fwd, 0.0
    return fwd, max(median_time(both, repeats, warmup=1, stat=min) - fwd, 0.0)


def layer_callables(m: nn.Module, shape: Sequence[int], input_grad: bool,
                    wrap: bool | None = None) -> tuple[Callable[[], Any], Callable[[], Any] | None]:
    """(forward, forward + backward) of ``m``'s kernel on a random input (see :func:`runnable`);
    the second is None for a layer with nothing to differentiate."""
    k, real = runnable(m, shape, wrap)
    x = torch.randn(real, requires_grad=input_grad)
    params = [p for p in k.parameters() if p.requires_grad]
    wrt = ([x] if input_grad else []) + params
    forward = lambda: k(x if input_grad else x.detach())  # noqa: E731
    if not wrt:
        return forward, None
    g = torch.randn_like(k(x))
    return forward, lambda: torch.autograd.grad(k(x), wrt, g)


def measure_engine_overhead(repeats: int = 20) -> tuple[float, float]:
    """(per step, per micro-batch) seconds of a one-rank engine step on a model of almost no work.

    Needs an initialised process group (one rank). What it times: ``shard_batch``, ``train_step``
    (schedule, loss, autograd, gradient bucketing) and an SGD step, with 1 and 4 micro-batches.
    """
    import torch.nn.functional as F  # noqa: PLC0415

    from hybridpar.pipeline import Engine  # noqa: PLC0415
    from hybridpar.planner import ParallelSpec  # noqa: PLC0415

    times = {}
    for m in (1, 4):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv3d(1, 1, 1), nn.Flatten(), nn.Linear(8, 4))
        spec = ParallelSpec.from_dict({"pipeline": {"microbatches": m}})
        engine = Engine(model, spec, F.mse_loss, input_shape=(4, 1, 2, 2, 2))
        x, y = torch.randn(4, 1, 2, 2, 2), torch.randn(4, 4)
        opt = torch.optim.SGD(engine.parameters(), lr=1e-3, momentum=0.9)

        def step(engine=engine, opt=opt, x=x, y=y) -> None:
            xl, yl = engine.shard_batch(x, y)
            engine.train_step(xl, yl)
            opt.step()
            opt.zero_grad(set_to_none=True)

        # the three layers' own cost is part of the measured layer times: subtract it
        layers = sum(sum(measure_layer(layer, s, i > 0, repeats)) for i, (layer, s) in enumerate(
            [(model[0], (4 // m, 1, 2, 2, 2)), (model[2], (4 // m, 8))]))
        times[m] = median_time(step, repeats, warmup=3) - m * layers
    per_micro = max((times[4] - times[1]) / 3, 0.0)
    return max(times[1] - per_micro, 0.0), per_micro



def measure_layers(entries: Iterable[tuple[str, nn.Module, tuple[int, ...], bool]], repeats: int = 5,
                   threads: int = 1, skip: Iterable[str] = ()) -> dict[str, tuple[float, float]]:
    """Measure each distinct entry of :func:`layer_entries` once (``threads`` intra-op threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    done = set(skip)
    table: dict[str, tuple[float, float]] = {}
    try:
        torch.manual_seed(0)
        for key, m, shape, needs in entries:
            if key in done or key in table:
                continue
            table[key] = measure_layer(m, shape, needs, repeats)
    finally:
        torch.set_num_threads(before)
    return table
