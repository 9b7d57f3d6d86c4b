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
# Each buffer slot of a copy or split layer: its original's module and slot, and the tensor both held
# when last alike.
_BUFFER_SLOTS: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[weakref.ref, str, weakref.ref]]] = \
    weakref.WeakKeyDictionary()
# The tensors put back into an original's slot by :func:`return_rebound` (the user did not rebind them).
_RETURNED: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref]] = weakref.WeakKeyDictionary()


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
        for slot in mine._buffers:
            _link_buffer(mine, slot, orig, slot)
    return twin


def _link_buffer(mine: nn.Module, slot: str, orig: nn.Module, orig_slot: str) -> None:
    t = mine._buffers[slot]
    held = _none if t is None else weakref.ref(t)  # a slot filled later (``if self.buf is None``) is rebound
    _BUFFER_SLOTS.setdefault(mine, {})[slot] = (weakref.ref(orig), orig_slot, held)


def _none() -> None:
    return None


def return_rebound() -> None:
    """Put into each original's buffer slot the tensor its copy's forward rebound the copy's slot to
    (``self.ema = 0.9 * self.ema + ...``). Why: the copy and the original shared the tensor until the
    forward replaced it in the copy alone, so ``model.state_dict()`` would keep the value the build saw
    while the engine's state moves on. Only a slot the copy rebound is returned: one the user rebound on
    the original is not overwritten (the engine refuses that change, see
    :mod:`hybridpar.pipeline.layer_settings`). Run after each step and prediction: a walk over the slots."""
    for mine, slots in list(_BUFFER_SLOTS.items()):
        for slot, (ref, orig_slot, last) in slots.items():
            orig, now = ref(), mine._buffers.get(slot)
            if orig is not None and now is not None and now is not last():
                orig._buffers[orig_slot] = now
                slots[slot] = (ref, orig_slot, weakref.ref(now))
                _RETURNED.setdefault(orig, {})[orig_slot] = weakref.ref(now)


def returned(module: nn.Module, slot: str) -> torch.Tensor | None:
    """The tensor :func:`return_rebound` last put into ``module``'s buffer ``slot``, if it is alive."""
    ref = _RETURNED.get(module, {}).get(slot)
    return None if ref is None else ref()


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
            _link_buffer(holder, name, src.get_submodule(path), name)
