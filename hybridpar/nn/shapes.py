"""Tell every split layer of a model the global shape of its input, once, instead of on every call.

Why: a split layer sees only its shard, but its halos depend on the global extent. Unless told, it
infers the extent on every forward with a small all-gather over its spatial group: one more
collective per layer and call, which also makes every rank of the group wait for the slowest one
at every layer. The engine (``hp.parallelize``) sets the shapes from its plan;
:func:`set_global_shapes` does the same for a model a user assembles from the layers themselves.

How: one forward on the meta device (no memory, no communication), in which every split layer runs
as its torch counterpart on the *global* volume and layout modules (Scatter, Gather, Redistribute)
pass the global tensor through; a pre-hook records each split layer's input shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import ExitStack

import torch
from torch import nn

from hybridpar.nn.layout import Gather, Redistribute, Scatter
from hybridpar.nn.meta import meta_call, meta_state
from hybridpar.nn.pool import DistGlobalAvgPool3d
from hybridpar.nn.spatial import SpatialLayer


def _torch_forward(m: SpatialLayer):
    """The forward of the torch layer ``m`` stands for (its first base class outside hybridpar)."""
    if isinstance(m, DistGlobalAvgPool3d):
        return lambda x: x.mean(dim=(2, 3, 4), keepdim=True)
    for base in type(m).__mro__[1:]:
        if issubclass(base, nn.Module) and not issubclass(base, SpatialLayer) and "forward" in vars(base):
            return vars(base)["forward"].__get__(m)
    raise TypeError(f"hybridpar.set_global_shapes: {type(m).__name__} has no torch counterpart to trace")


def set_global_shapes(model: nn.Module, input_shape: Sequence[int]) -> dict[str, tuple[int, int, int]]:
    """Set ``global_input_shape`` on every split layer of ``model`` for a global input of
    ``input_shape`` (N, C, D, H, W; the whole volume, not this rank's shard), and the global shape of
    every Redistribute and Gather that lacks one. Returns ``{layer name: (D, H, W)}``.

    Call again if the global volume changes: a stale shape gives wrong halos or an error from the
    halo plan, not a silent result. Every rank must call it alike (it communicates nothing).
    """
    shape = tuple(int(s) for s in input_shape)
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(f"hybridpar.set_global_shapes: input_shape must be 5 positive ints N, C, D, H, W "
                         f"(the global volume), got {list(input_shape)}")
    seen: dict[str, tuple[int, int, int]] = {}
    layouts: dict[str, tuple[int, int, int]] = {}
    with ExitStack() as stack:
        for name, m in model.named_modules():
            if isinstance(m, SpatialLayer):
                m.forward = _torch_forward(m)  # type: ignore[method-assign]
                stack.callback(vars(m).pop, "forward", None)
                hook = m.register_forward_pre_hook(
                    lambda _m, args, name=name: seen.__setitem__(name, tuple(args[0].shape[-3:])))
                stack.callback(hook.remove)
            elif isinstance(m, (Scatter, Gather, Redistribute)):
                m.forward = lambda x, name=name: layouts.__setitem__(name, tuple(x.shape[-3:])) or x
                stack.callback(vars(m).pop, "forward", None)
        meta, dtype = meta_state(model)
        meta_call(model, meta, torch.empty(shape, dtype=dtype, device="meta"))
    modules = dict(model.named_modules())
    for name, dhw in seen.items():
        modules[name].global_input_shape = dhw
    for name, dhw in layouts.items():
        m = modules[name]
        if isinstance(m, Redistribute) and m.shape is None:
            m.shape = dhw
        elif isinstance(m, Gather):
            m.shape = dhw
    return seen
