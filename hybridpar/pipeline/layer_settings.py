"""What the engine was built from, watched: the model's modules, its tensors and its layers' settings.

Why: the engine builds its split layers from the model once (a DistBatchNorm3d takes the BatchNorm's
``momentum`` and ``eps``, a DistDropout its ``p``) and runs them on the model's own tensors. A training
loop that then changes a layer's setting (a momentum schedule), replaces a submodule (a new head for
transfer learning) or rebinds a buffer (``model.scale = torch.full_like(...)``) changes what one process
computes but not what the built split layers do. Each step checks, in one pass over the model, that none of
these changed since the build, and refuses the step in one line naming what did (alike on every rank
that changed it alike); a tensor changed in place, which the layers share, is followed.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from hybridpar.call_keys import module_path
from hybridpar.nn import registry
from hybridpar.nn.sharing import TORCH_OWN, returned
from hybridpar.planner.analysis import REPLICATED
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.terms import SpecError


def _settings(m: nn.Module) -> dict[str, Any]:
    """A torch layer's public plain settings (``eps``, ``momentum``, ``p``, ``padding_mode``)."""
    return {k: v for k, v in vars(m).items() if k not in TORCH_OWN and not k.startswith("_")
            and isinstance(v, int | float | str | bool | tuple | type(None))}


class LayerSettings:
    """The model's modules, parameters, buffers and its split layers' settings as the build saw them.
    The settings are those of the layers ``plan`` splits by a split class of their own (on every stage
    alike), which took them at the build; a layer run as a copy of itself (an activation, a dropout, a
    replicated layer) reads its original's at each call (:func:`~hybridpar.nn.sharing.follow_originals`),
    so a change there is followed."""

    def __init__(self, model: nn.Module, plan: list[LayerPlan]) -> None:
        split = {module_path(r.name) for r in plan if r.split != REPLICATED}
        self._model = weakref.ref(model)
        self._modules = {k: weakref.ref(m) for k, m in model.named_modules()}
        self._tensors = {k: weakref.ref(t) for k, t in (*model.named_parameters(remove_duplicate=False),
                                                        *model.named_buffers(remove_duplicate=False))}
        self._settings = {k: _settings(m) for k, m in model.named_modules()  # run by a class of hybridpar's
                          if k in split and (e := registry.lookup(m)) is not None and e.to_dist is not None}

    def check(self, what: str) -> None:
        """Refuse (``what``, e.g. ``"Engine.train_step"``, leading the line) a model whose modules,
        tensors or layer settings changed since the build."""
        model = self._model()
        if model is None:
            return
        for k, m in model.named_modules():
            ref = self._modules.get(k)
            if ref is None or ref() is not m:
                raise SpecError(f"{what}: model.{k} ({type(m).__name__}) is not the module the engine was "
                                f"built from (replaced or added since); parallelize the model anew")
            then = self._settings.get(k)
            if then is not None and (now := _settings(m)) != then:
                key = next(a for a in {*then, *now} if then.get(a) != now.get(a))
                raise SpecError(f"{what}: model.{k} ({type(m).__name__}).{key} is {now.get(key)!r}, "
                                f"{then.get(key)!r} when the engine was built, whose split layer holds that; "
                                f"set it before the first batch, or parallelize the model anew")
        for k, t in (*model.named_parameters(remove_duplicate=False),
                     *model.named_buffers(remove_duplicate=False)):
            ref = self._tensors.get(k)
            if (ref is None or ref() is not t) and _returned(model, k) is t:
                self._tensors[k] = ref = weakref.ref(t)  # the engine's own (a forward rebound it)
            if ref is None or ref() is not t:
                raise SpecError(f"{what}: model.{k} is another tensor than the engine was built on (rebound "
                                f"since, model.{k} = ...); change it in place (.copy_(), .fill_()), or "
                                f"parallelize the model anew")


def _returned(model: nn.Module, key: str) -> object:
    """What the engine last put into the buffer slot ``key`` of ``model`` (:func:`returned`), or None."""
    path, _, slot = key.rpartition(".")
    return returned(model.get_submodule(path), slot)
