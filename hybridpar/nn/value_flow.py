"""What a user's split layer does with whole values, followed through its forward: the sum over the
volume (:meth:`~hybridpar.nn.spatial.SpatialLayer.volume_sum`) entering shard computations gets its
gradient summed over the shards, and in the first forward each parameter is checked to be applied as
its layer said (:meth:`~hybridpar.nn.spatial.SpatialLayer.applied_split`,
:meth:`~hybridpar.nn.spatial.SpatialLayer.applied_whole`).

Why: ``volume_sum``'s total is the same on every rank. Used on whole values (a pooled feature into a
weight), each rank's backward gives its whole gradient; used on the shard (a norm's mean subtracted
from it), each rank's gives its own shard's part only, and the parts must be summed over the shards
before they flow back through the sum, or every layer before trains on a fraction of its gradient,
silently. So where a whole value meets a shard value, it enters through
:func:`~hybridpar.comm.reduce.replicated_into_shards` (as the library's norms and the engine between
layers do). A parameter applied to the shard gets part of its gradient on each rank, summed over the
shards; one applied to whole values gets its whole gradient on every rank. One applied both ways (a
generalised mean's ``p``: ``volume_sum(x.pow(p)) ** (1 / p)``) has no count right for both parts, and a
statement that does not match the use trains it at a multiple or a fraction of its gradient: refused.

Values are followed by a ``TorchFunctionMode``: the layer's input and what is computed from its values
are the shard's (``x.new_tensor(...)`` is not); ``volume_sum``'s result and what is computed from it
without the shard are whole; what is computed from parameters and constants alone is neither, its
parameters not yet applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.comm.reduce import grad_split, replicated_into_shards
from hybridpar.nn.torch_args import complete

__all__ = ["check_uses", "follow_values", "unfollowed"]


class _Flow(TorchFunctionMode):
    """Follows one forward of a split layer: shard values, whole values, values made from parameters
    alone, and (``names`` given: the first forward) each parameter's uses."""

    def __init__(self, group: Any, names: dict[int, str]) -> None:
        super().__init__()
        self.group = group
        self.names = names  # id(parameter) -> its name: the parameters whose uses are recorded
        self.shard: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.whole: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.made_from: WeakIdKeyDictionary = WeakIdKeyDictionary()  # value -> parameters it is made of
        self.uses: dict[str, set[str]] = {n: set() for n in names.values()}

    paused = False
    """While set, calls run unfollowed (a check's reference run of the layer on the gathered volume, the
    layer run whole on a value that is not split)."""
    seen = False
    """Whether a call was followed: a forward run unfollowed throughout leaves the first check to come."""

    def summed(self, t: torch.Tensor) -> None:
        """``t`` is ``volume_sum``'s result: the same on every rank, whatever it was computed from."""
        self.shard.pop(t, None)
        self.whole[t] = True

    def _into_shards(self, t: Any) -> Any:
        return replicated_into_shards(t, self.group) if isinstance(t, torch.Tensor) and t in self.whole else t

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = complete(func, kwargs or {})
        if self.paused:
            return func(*args, **kwargs)
        self.seen = True
        given = [*args, *kwargs.values()]
        tensors = [t for t in [*given, *(a for v in given if isinstance(v, list | tuple) for a in v)]
                   if isinstance(t, torch.Tensor)]
        on_shard = any(t in self.shard for t in tensors)
        on_whole = any(t in self.whole for t in tensors)
        if on_shard and on_whole:  # each shard's part of the whole value's gradient, summed over them
            args, kwargs = tree_map(self._into_shards, (args, kwargs))
        params = {self.names[id(t)] for t in tensors if id(t) in self.names}
        params |= {p for t in tensors for p in self.made_from.get(t, ())}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "").startswith("new_"):  # x.new_tensor(n): made alike on every rank
            return out
        for t in out if isinstance(out, list | tuple) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            if on_shard:
                self.shard[t] = True
            elif on_whole:
                self.whole[t] = True
            elif params:
                self.made_from[t] = params  # a parameter's view, its reciprocal: not yet applied
        if on_shard or on_whole:
            for p in params:
                self.uses[p].add("shard" if on_shard else "whole")
        return out


@contextmanager
def unfollowed(d: nn.Module) -> Iterator[None]:
    """Run calls within unfollowed by ``d``'s forward's follower, if one is on."""
    flow = getattr(d, "_value_flow", None)
    if flow is None:
        yield
        return
    flow.paused = True
    try:
        yield
    finally:
        flow.paused = False


def follow_values(d: nn.Module) -> None:
    """Follow every forward of ``d`` (a user's split layer, a
    :class:`~hybridpar.nn.spatial.SpatialLayer`) as the module doc says: whole values entering the
    shard get their gradients summed over the shards; its first forward's parameter uses are checked
    (a ``ValueError`` naming ``d.layer_name`` and the parameter). The hooks read the module they are
    called for, so a copy of ``d`` is followed as itself."""
    if d.grid.spatial_size == 1:
        return  # whole values and the shard alike: nothing to sum, every count right
    d._value_flow, d._uses_checked = None, False
    d.register_forward_pre_hook(_enter)
    d.register_forward_hook(_leave, always_call=True)


def _enter(m: nn.Module, args: tuple) -> None:
    names = {} if m._uses_checked else {id(p): n for n, p in m.named_parameters()}
    mode = _Flow(m.grid.spatial_group, names)
    for a in args:
        if isinstance(a, torch.Tensor):
            mode.shard[a] = True
    m._value_flow = mode
    mode.__enter__()


def _leave(m: nn.Module, args: tuple, out: Any) -> None:
    mode, m._value_flow = m._value_flow, None
    mode.__exit__(None, None, None)
    if not m._uses_checked and mode.seen:
        m._uses_checked = True
        _check(m.layer_name, dict(m.named_parameters()), mode.uses)


def check_uses(d: nn.Module) -> None:
    """Refuse, as the end of ``d``'s first forward would, a parameter the forward so far applied
    otherwise than its layer said (for a check that would otherwise see only the gradient's error)."""
    flow = getattr(d, "_value_flow", None)
    if flow is not None and not d._uses_checked:
        _check(d.layer_name, dict(d.named_parameters()), flow.uses)


def _check(what: str, params: dict[str, nn.Parameter], uses: dict[str, set[str]]) -> None:
    for name, seen in uses.items():
        said = "shard" if grad_split(params[name]) > 1 else "whole"
        if seen == {"shard", "whole"}:
            raise ValueError(f"{what}: its parameter {name} is applied both to the shard (before "
                             f"volume_sum) and to whole values (after it), whose gradients add up "
                             f"differently; use two parameters, one for each side")
        if seen and seen != {said}:
            (use,) = seen
            fix = "applied_split" if use == "shard" else "applied_whole"
            words = {"shard": "the shard", "whole": "whole values"}
            raise ValueError(f"{what}: its parameter {name} is applied to {words[use]} but was said to be "
                             f"applied to {words[said]}; call self.{fix}(self.{name}) in its __init__")
