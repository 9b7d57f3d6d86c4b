"""The engine's training mode, which follows the user's model's: ``model.train()`` and ``model.eval()``
govern ``predict`` and ``train_step`` as ``engine.train()`` and ``engine.eval()`` do.

Why: the model given to :func:`hybridpar.parallelize` stays the user's handle on the training, and
torch's way to validate is ``model.eval()`` then a forward. The engine runs its stage's own modules
(split layers holding the model's tensors), whose flags ``model.eval()`` does not reach: followed only
at ``parallelize``, a BatchNorm would normalise a validation batch by its own statistics and move its
running statistics, and a forward reading ``self.training`` take its training branch, all silently.
"""

from __future__ import annotations

import weakref

from torch import nn


class ModelMode:
    """The engine's training flags, following the user's model's: its root module's ``training`` (the
    mode a call runs in) and every submodule's (a BatchNorm frozen for fine-tuning with ``bn.eval()``, a
    Dropout switched off), which the stage's modules of the same name take.

    The model is held weakly: a pipeline stage lets go of the other stages' layers once built (see
    :meth:`~hybridpar.pipeline.engine.Engine._build`), so a user who drops the model drops them; the
    engine's own flag (``engine.train()``/``engine.eval()``) then governs alone."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.training = model.training
        self._flags = self._read()
        self._branches: dict[str, bool] = {}  # modules a traced graph went into, by name: their flags then

    def model(self) -> nn.Module | None:
        """The user's model, while the user holds it."""
        return self._model()

    def _read(self) -> tuple[bool, ...] | None:
        model = self._model()
        return None if model is None else tuple(m.training for m in model.modules())

    def follow(self) -> bool:
        """Take the model's flags (``model.train()``/``model.eval()``, a submodule's ``.eval()``, since the
        last call); whether any changed. One pass over the model's modules."""
        flags = self._read()
        if flags is None or flags == self._flags:
            return False
        self._flags, self.training = flags, self._model().training
        return True

    def set(self, mode: bool) -> None:
        """``engine.train(mode)``: the engine's flag and the model's, so that the two never disagree
        (the model's is what the next call follows)."""
        self.training = mode
        model = self._model()
        if model is not None:
            model.train(mode)
            self._flags = self._read()

    def apply(self, layers: list[tuple[str | None, nn.Module]]) -> None:
        """Give the stage's modules the flags of the model's modules of the same name (a layer holding
        more modules than its original, or named otherwise, takes its nearest named parent's)."""
        model = self._model()
        for name, layer in layers:
            orig = _submodule(model, name) if model is not None and name is not None else None
            if orig is None:
                layer.train(self.training)
                continue
            flags = {k: m.training for k, m in orig.named_modules()}
            for k, m in layer.named_modules():
                parent = k
                while parent not in flags and parent:
                    parent = parent.rpartition(".")[0]
                m.training = flags.get(parent, orig.training)

    def bind_branches(self, model: nn.Module, leaves: set[str]) -> None:
        """Note the flags of the modules a traced graph went into (not its leaves, nor inside one): a
        forward that reads ``self.training`` there holds the branch of those flags."""
        self._branches = {k: m.training for k, m in model.named_modules()
                          if k and not any(k == leaf or k.startswith(f"{leaf}.") for leaf in leaves)}

    def moved_branches(self) -> list[str]:
        """Those modules whose flag has changed since :meth:`bind_branches`."""
        model = self._model()
        if model is None or not self._branches:
            return []
        return [k for k, flag in self._branches.items() if (m := _submodule(model, k)) is not None
                and m.training != flag]


def _submodule(model: nn.Module, name: str) -> nn.Module | None:
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:  # a layer named by a call (``name#1``) or not the model's own
        return None
