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
    """The engine's training flag, following the user's model's (its root module's ``training``).

    The model is held weakly: a pipeline stage lets go of the other stages' layers once built (see
    :meth:`~hybridpar.pipeline.engine.Engine._build`), so a user who drops the model drops them; the
    engine's own flag (``engine.train()``/``engine.eval()``) then governs alone."""

    def __init__(self, model: nn.Module) -> None:
        self._model = weakref.ref(model)
        self.training = model.training

    def follow(self) -> bool:
        """Take the model's flag (``model.train()``/``model.eval()`` since the last call); whether it
        changed. One attribute read per call: cheap enough for every step."""
        model = self._model()
        if model is None or model.training == self.training:
            return False
        self.training = model.training
        return True

    def set(self, mode: bool) -> None:
        """``engine.train(mode)``: the engine's flag and the model's, so that the two never disagree
        (the model's is what the next call follows)."""
        self.training = mode
        model = self._model()
        if model is not None:
            model.train(mode)
