"""A module's forward on the meta device: shapes and operations, no memory, no FLOPs.

Why one place: the planner, the trace check, module swapping's plan and ``set_global_shapes`` all run
a user's model with its state swapped for meta tensors (``torch.func.functional_call``). A model may
hold one module under two names (MONAI's DynUNet), or one tensor in two modules; swapping by tensor
(torch's ``tie_weights``) then restores the wrong tensor into a slot it visited twice, and the model
is left holding meta tensors. Here the state has one entry per module slot (each module object once),
tied slots sharing one meta tensor, and the swap is made slot by slot. A ``SyncBatchNorm`` runs as
the batch norm it is within one process: its own forward would reduce over the job's ranks, which a
meta tensor cannot.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridpar.nn.families import BATCH_NORM


def meta_state(module: nn.Module) -> tuple[dict[str, torch.Tensor], torch.dtype]:
    """``module``'s parameters and buffers as meta tensors, one entry per slot (see the module doc),
    and the floating dtype its input should have."""
    metas: dict[int, torch.Tensor] = {}
    state: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        for name, t in [*m._parameters.items(), *m._buffers.items()]:
            if t is not None:
                key = f"{prefix}.{name}" if prefix else name
                state[key] = metas.setdefault(id(t), torch.empty_like(t, device="meta"))
    floats = [t for t in (*module.parameters(), *module.buffers()) if t.is_floating_point()]
    return state, floats[0].dtype if floats else torch.get_default_dtype()


FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "arange", "linspace", "eye")


class OnMeta(TorchFunctionMode):
    """A tensor the forward makes from sizes alone (``torch.zeros(n, c, *x.shape[2:])``), without a
    device, is made on the meta device beside the forward's own, as on the device it runs on."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in FACTORIES and kwargs.get("device") is None \
                and not any(isinstance(a, torch.Tensor) for a in args) and _users_call():
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


def _users_call() -> bool:
    """Whether the innermost frame outside torch is the user's (the library's own arithmetic, a halo
    plan's taps, keeps the default device)."""
    f = sys._getframe(2)
    while f is not None and f"{os.sep}torch{os.sep}" in f.f_code.co_filename:
        f = f.f_back
    return f is not None and f"{os.sep}hybridpar{os.sep}" not in f.f_code.co_filename


def meta_call(module: nn.Module, state: dict[str, torch.Tensor], *args: Any) -> Any:
    """``module(*args)`` with ``state`` (from :func:`meta_state`) in place of its own."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(OnMeta())
        for m in module.modules():
            if isinstance(m, nn.SyncBatchNorm):
                m.forward = BATCH_NORM.forward.__get__(m)  # type: ignore[method-assign]
                stack.callback(vars(m).pop, "forward", None)
        return torch.func.functional_call(module, state, args, tie_weights=False)
