"""A layer and its split counterpart holding the same tensors, not copies.

Why: users build an optimizer on ``model.parameters()`` and read ``model.state_dict()`` after training,
as FSDP2's ``fully_shard`` lets them; so whatever runs on the shards (a Dist layer, or a copy of a layer
that works voxel by voxel) must hold the user's own parameters and buffers. Both the converter
(:mod:`hybridpar.pipeline.convert`) and layers that run a torch layer as it is on a shard
(:mod:`hybridpar.nn.neuralop`) need this, so it lives with the layers.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch
from torch import nn

from hybridpar.comm.reduce import grad_split, is_marked, mark_grad_split

TORCH_OWN = frozenset(vars(nn.Module()))
"""What torch keeps in every module's ``__dict__`` (parameters, buffers, children, hooks, ``training``):
not the user's own attributes."""

# Each copy's original and the original's plain attributes as last followed (by identity), per copy.
_ORIGINALS: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, dict[str, Any]]] = \
    weakref.WeakKeyDictionary()


def sharing_copy(m: nn.Module) -> nn.Module:
    """A copy of ``m`` whose parameters, buffers and plain tensor attributes are ``m``'s own tensors, and
    whose modules follow their originals' plain attributes (:func:`follow_originals`).

    Why: a copy runs the user's forward on shards (module swapping, a block run whole), and that
    forward reads what the training loop sets on the user's model: a temperature annealed
    (``model.tau = 0.5``), a tensor filled in place, a dropout rate. A copy frozen at ``parallelize``
    would train silently on the old values."""
    own = [t for sub in m.modules() for k, t in vars(sub).items()
           if k not in TORCH_OWN and isinstance(t, torch.Tensor)]
    twin = copy.deepcopy(m, {id(t): t for t in (*m.parameters(), *m.buffers(), *own)})
    for orig, mine in zip(m.modules(), twin.modules(), strict=True):
        _ORIGINALS[mine] = (weakref.ref(orig), _plain(orig))
    return twin


def _plain(m: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(m).items() if k not in TORCH_OWN}


def follow_originals() -> None:
    """Give every live copy its original's plain attributes that were set since they were last
    followed (rebound: compared by identity, so a tensor filled in place, shared already, costs
    nothing). Attributes hybridpar set on a copy itself stay, unless the user sets the same one. Run
    before each step and prediction: a walk over the copies' attribute dicts."""
    for mine, (ref, seen) in list(_ORIGINALS.items()):
        orig = ref()
        if orig is None:
            continue
        for k, v in vars(orig).items():
            if k not in TORCH_OWN and seen.get(k, _MISSING) is not v:
                mine.__dict__[k] = seen[k] = v


_MISSING = object()


def share_state(src: nn.Module, dst: nn.Module) -> None:
    """Make ``dst``'s state-dict entries ``src``'s own tensors (the two have the same keys and shapes),
    with what ``dst`` recorded of its own (how many shards contribute to a parameter's gradient)."""
    own = dst.state_dict(keep_vars=True)
    for key, t in src.state_dict(keep_vars=True).items():
        if key not in own or own[key].shape != t.shape:
            raise ValueError(f"{type(dst).__name__}: has no state entry {key} of shape {list(t.shape)} "
                             f"like {type(src).__name__}'s")
        path, _, name = key.rpartition(".")
        holder = dst.get_submodule(path)
        if name in holder._parameters:
            if is_marked(own[key]):
                mark_grad_split([t], grad_split(own[key]))
            holder._parameters[name] = t
        else:
            holder._buffers[name] = t
