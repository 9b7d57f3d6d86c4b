"""Arguments torch drops on the way to a ``TorchFunctionMode``, put back.

Why: a mode sees a call as ``func(*args, **kwargs)`` and runs it so; torch's ``F.l1_loss`` hands the
mode its ``input``, ``target`` and reduction but not its ``weight`` (torch 2.13), so under any mode a
weighted L1 loss ran unweighted, silently. Every mode of ours that runs a user's code (a loss, a
forward) completes the call here first. The value is the one the call was given: read from the frame
of the function that handed the call over.
"""

from __future__ import annotations

import sys
from typing import Any

import torch.nn.functional as F

DROPPED = {F.l1_loss: ("weight",)}
"""Functions whose named arguments torch's dispatch to a mode leaves out (found by reading
``torch.nn.functional``: each ``handle_torch_function`` call against its signature)."""


def complete(func: Any, kwargs: dict) -> dict:
    """``kwargs`` of a call of ``func`` reaching a mode, with what torch dropped put back."""
    names = DROPPED.get(func)
    if names is None:
        return kwargs
    frame = sys._getframe(1)
    while frame is not None and frame.f_code is not func.__code__:
        frame = frame.f_back
    if frame is None:
        return kwargs
    given = {k: frame.f_locals[k] for k in names if k not in kwargs and frame.f_locals.get(k) is not None}
    return {**kwargs, **given} if given else kwargs
