"""A layer and its split counterpart holding the same tensors, not copies.

Why: users build an optimizer on ``model.parameters()`` and read ``model.state_dict()`` after training,
as FSDP2's ``fully_shard`` lets them; so whatever runs on the shards (a Dist layer, or a copy of a layer
that works voxel by voxel) must hold the user's own parameters and buffers. Both the converter
(:mod:`hybridpar.pipeline.convert`) and layers that run a torch layer as it is on a shard
(:mod:`hybridpar.nn.neuralop`) need this, so it lives with the layers.
"""

from __future__ import annotations

import copy

from torch import nn

from hybridpar.comm.reduce import grad_split, is_marked, mark_grad_split


def sharing_copy(m: nn.Module) -> nn.Module:
    """A copy of ``m`` whose parameters and buffers are ``m``'s own tensors."""
    return copy.deepcopy(m, {id(t): t for t in (*m.parameters(), *m.buffers())})


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
