"""Which values a reduce layer's split version applies each of its parameters to, seen in its first
forward, against what it said (:meth:`~hybridpar.nn.spatial.SpatialLayer.applied_split`,
:meth:`~hybridpar.nn.spatial.SpatialLayer.applied_whole`).

Why: a parameter applied to the shard (before :meth:`~hybridpar.nn.spatial.SpatialLayer.volume_sum`)
gets part of its gradient on each rank, summed over the shards; one applied to whole values (after it)
gets its whole gradient on every rank. One parameter applied both ways (a generalised mean's ``p``:
``volume_sum(x.pow(p)) ** (1 / p)``) has no count that is right for both parts, and a statement that
does not match the use trains it at a multiple or a fraction of its gradient, silently. So the first
forward follows the values (the input and what is computed from it are the shard's; ``volume_sum``'s
result and what is computed from it alone are whole) and refuses what does not add up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.comm.reduce import grad_split
from hybridpar.planner.terms import SpecError

__all__ = ["watch_first_forward"]


class _Uses(TorchFunctionMode):
    """Follows one forward: shard values, values made from parameters alone, and each parameter's uses."""

    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.names = names  # id(parameter) -> its name
        self.shard: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.made_from: WeakIdKeyDictionary = WeakIdKeyDictionary()  # value -> parameters it is made of
        self.uses: dict[str, set[str]] = {n: set() for n in names.values()}

    def whole(self, t: Any) -> None:
        """``t`` is the same on every rank (``volume_sum``'s result), whatever it was computed from."""
        if isinstance(t, torch.Tensor):
            self.shard.pop(t, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = [*args, *kwargs.values()]
        tensors = [t for t in [*given, *(a for v in given if isinstance(v, list | tuple) for a in v)]
                   if isinstance(t, torch.Tensor)]
        params = {self.names[id(t)] for t in tensors if id(t) in self.names}
        params |= {p for t in tensors for p in self.made_from.get(t, ())}
        on_shard = any(t in self.shard for t in tensors)
        others = any(t not in self.made_from and id(t) not in self.names for t in tensors)
        results = out if isinstance(out, list | tuple) else (out,)
        for t in results:
            if not isinstance(t, torch.Tensor):
                continue
            if on_shard:
                self.shard[t] = True
            elif params and not others:
                self.made_from[t] = params  # a parameter's view, its reciprocal: not yet applied
        if on_shard or others:
            for p in params:
                self.uses[p].add("shard" if on_shard else "whole")
        return out


def watch_first_forward(d: nn.Module, what: str) -> None:
    """Check, in ``d``'s first forward, that each of its parameters is applied as it said (see the
    module doc); a ``SpecError`` naming ``what`` and the parameter otherwise. ``d``: a reduce layer's
    split version (a :class:`~hybridpar.nn.spatial.SpatialLayer`)."""
    if not any(True for _ in d.parameters()):
        return
    handles: list[Any] = []

    def enter(m: nn.Module, args: tuple) -> None:
        mode = _Uses({id(p): n for n, p in d.named_parameters()})  # the model's, shared by now
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None:
            mode.shard[x] = True
        d._param_uses = mode
        mode.__enter__()

    def leave(m: nn.Module, args: tuple, out: Any) -> None:
        mode = d._param_uses
        mode.__exit__(None, None, None)
        d._param_uses = None
        for h in handles:
            h.remove()
        _check(what, dict(d.named_parameters()), mode.uses)

    handles += [d.register_forward_pre_hook(enter), d.register_forward_hook(leave, always_call=True)]


def _check(what: str, params: dict[str, nn.Parameter], uses: dict[str, set[str]]) -> None:
    for name, seen in uses.items():
        said = "shard" if grad_split(params[name]) > 1 else "whole"
        if seen == {"shard", "whole"}:
            raise SpecError(f"{what}: its parameter {name} is applied both to the shard (before "
                            f"volume_sum) and to whole values (after it), whose gradients add up "
                            f"differently; use two parameters, one for each side")
        if seen and seen != {said}:
            (use,) = seen
            fix = "applied_split" if use == "shard" else "applied_whole"
            words = {"shard": "the shard", "whole": "whole values"}
            raise SpecError(f"{what}: its parameter {name} is applied to {words[use]} but was said to be "
                            f"applied to {words[said]}; call self.{fix}(self.{name}) in its __init__")
