"""Hooks of the user's on the model's modules and parameters: refused, since the split model would not
run them as one process does.

Why: the engine runs the model's layers as Dist counterparts or copies of its own, and a traced graph
runs a block's forward without calling the block, so a forward hook on a layer (``register_forward_hook``,
``register_forward_pre_hook``, torch's old ``weight_norm``) would not run at all, and a backward hook
would see a shard's gradient. A hook on a parameter (``register_hook``,
``register_post_accumulate_grad_hook``) sees each shard's part of its gradient, before the engine sums
them over the shards and averages them over the replicas: a clamp or a norm of it differs from one
process's. Hooks the library registers itself (its own layers', its gradient reducer's) are its own
business and pass. A ``torch.jit`` scripted or traced module is refused alike: its compiled forward
calls nothing the engine could follow or swap.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.nn.modules import module as torch_module
from torch.utils.hooks import RemovableHandle

from hybridpar.nn import registry
from hybridpar.planner.terms import SpecError

_MODULE_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                 ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
_PARAM_HOOKS = (("_backward_hooks", "gradient hook (register_hook)"),
                ("_post_accumulate_grad_hooks", "post-accumulate-grad hook"))
_OLD_STYLE = {"WeightNorm": "torch.nn.utils.parametrizations.weight_norm",
              "SpectralNorm": "torch.nn.utils.parametrizations.spectral_norm"}


def _ours(fn: Callable) -> bool:
    return (getattr(fn, "__module__", None) or type(fn).__module__ or "").startswith("hybridpar.")


def _theirs(hooks: dict | None) -> list[Callable]:
    return [fn for fn in (hooks or {}).values() if not _ours(fn)]


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _advice(fn: Callable) -> str:
    old = _OLD_STYLE.get(type(fn).__name__)
    if old is not None:  # torch.nn.utils.weight_norm / spectral_norm: a pre-hook computing the weight
        return (f"it is torch's old-style {type(fn).__name__.lower().replace('norm', '_norm')}: use {old} "
                f"(run whole where the layer is replicated) or remove it")
    return "remove it (handle.remove()) and do its work in a forward, where the engine sees it"


def refuse_hooks(model: nn.Module, what: str) -> None:
    """Raise :class:`SpecError` naming the first hook of the user's on ``model``'s modules or parameters,
    or a global module hook (``torch.nn.modules.module.register_module_forward_hook``); ``what``: the
    call that found it."""
    for attr, kind in _MODULE_HOOKS:
        found = _theirs(getattr(torch_module, f"_global{attr}", None))
        if found:
            raise SpecError(f"{what}: a global module {kind} ({_name(found[0])}) would run on every split "
                            f"layer's shard; remove it while the engine runs")
    for name, m in model.named_modules():
        for attr, kind in _MODULE_HOOKS:
            found = _theirs(getattr(m, attr, None))
            if found:
                where = f"{name} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
                raise SpecError(f"{what}: {where} has a {kind} ({_name(found[0])}), which the split model "
                                f"would not run as one process does; {_advice(found[0])}")
    for name, p in model.named_parameters():
        for attr, kind in _PARAM_HOOKS:
            found = _theirs(getattr(p, attr, None))
            if found:
                raise SpecError(f"{what}: parameter {name} has a {kind} ({_name(found[0])}): it would see "
                                f"each shard's part of the gradient, not the whole; remove it and change "
                                f"the gradients after engine.train_step, where they are whole")


def refuse_unfollowed_forwards(model: nn.Module, what: str) -> None:
    """Raise :class:`SpecError` naming the first ``torch.jit`` scripted or traced module in ``model``: its
    compiled forward calls no Python the engine can follow or swap (its layers would run on shards as
    on whole volumes), and its state is not a module's (``_buffers`` is a compiled dict); or the first
    registered layer whose forward is set on the layer itself (``conv.forward = MethodType(f, conv)``),
    which its type's split version would replace silently."""
    for name, m in model.named_modules():
        if isinstance(m, torch.jit.ScriptModule):
            where = f"{name} ({m.original_name})" if name else f"the model ({m.original_name})"
            raise SpecError(f"{what}: {where} is a torch.jit.ScriptModule, whose compiled forward the engine "
                            f"cannot split; give parallelize the module before torch.jit.script or trace")
        if registry.lookup(m) is not None and any(f in vars(m) for f in registry.FORWARDS):
            where = f"{name} ({type(m).__name__})" if name else f"the model ({type(m).__name__})"
            raise SpecError(f"{what}: {where} has a forward set on the layer itself, which the split "
                            f"{type(m).__name__} would not run; define it in a subclass (class "
                            f"My{type(m).__name__}(nn.{type(m).__name__}): def forward(...)), which runs as "
                            f"written")


class HookWatch:
    """:func:`refuse_hooks` on the user's model (held weakly, as :class:`~.model_mode.ModelMode` holds
    it) before each step, scanning it again only when a hook has been registered anywhere since the
    last scan: torch numbers every hook's handle from one counter (``RemovableHandle.next_id``), so an
    unchanged counter costs a step one attribute read instead of a walk over every module."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self._seen = -1

    def check(self, what: str) -> None:
        now = RemovableHandle.next_id
        if now == self._seen:
            return
        model = self._model()
        if model is not None:
            refuse_hooks(model, what)
        self._seen = now
