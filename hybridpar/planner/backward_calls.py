"""What a forward run by module swapping hands to its backward: an autograd.Function of the user's own
and a gradient hook on an activation (``h.register_hook(fn)``), met by the watch that follows it
(:class:`hybridpar.planner.layout_watch.LayoutWatch`).

Why apart from the calls table: both run code of the user's in the backward, where no mode follows
the shards. On a split activation that code would see a shard's gradient, and a reduction in it
(``g / g.norm()``, a mean subtracted) would reduce over the shard, silently. So:

* a Function applied to split activations runs on the gathered volume, each result taken back to the
  shard's box: its forward and its backward both see whole values, as in one process (a Function that
  writes its input in place is refused: the write would reach the gathered copy only);
* a hook on a split activation is given the gathered gradient and hands back its shard's box of what
  it returns (a hook on a reshape part way through, ``h.flatten(2)``, is refused);
* where the batch is held in parts (data parallelism, micro-batches), either is refused on values that
  carry the batch: each part's backward sees its own samples' gradient, scaled as its part's loss is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.planner import applied, calls
from hybridpar.user_lines import caller


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


class BackwardCalls:
    """The Function and hook side of a watch; the watch gives ``depth``, ``unsafe``, ``met``, ``split``,
    ``chains``, ``batched`` and ``batch_apart``."""

    depth: int
    unsafe: list[str]
    met: dict[tuple[str, str], int]
    split: WeakIdKeyDictionary
    chains: WeakIdKeyDictionary
    batched: WeakIdKeyDictionary
    picked: WeakIdKeyDictionary  # samples picked off a batch in parts (planner/batch_reads.py)
    batch_apart: bool
    judging: bool  # a registered layer's forward, judged only for its calls across the samples
    _run_replicated: Callable[[Any, tuple, dict], Any]  # a call on whole values (the watch's)

    def applications(self) -> Any:
        """The context in which this watch is offered every Function applied on its thread."""
        return applied.watching(self._applied)

    def _carries(self, t: torch.Tensor) -> bool:
        return t in self.split or t in self.chains or t in self.batched or t in self.picked

    def _applied(self, cls: type, apply: Any, args: tuple, kwargs: dict) -> Any:
        """``cls.apply(*args, **kwargs)`` seen from the forward: on split activations, met as any call
        the table does not know (the watch's ``__torch_function__``: run on the gathered volume, refused
        where a checkpoint would recompute it); refused on what carries a batch held in parts."""
        if self.depth or cls.__module__.startswith("torch.") or self.judging:  # in a layer; checkpoint's
            return applied.PASS  # own (calls.py); a registered layer's, its forward's calls followed
        tensors = _tensors(args, kwargs)
        carried = any(self._carries(t) for t in tensors)
        if self.batch_apart and (carried or any(t.requires_grad for t in tensors)):  # a weight's too: its
            self.unsafe.append(f"{cls.__qualname__}.apply (an autograd.Function of the model's own on values "
                               f"whose gradient data parallelism or micro-batches compute in parts: its "
                               f"backward would see each part's gradient; one that works voxel by voxel "
                               f"can be a module of its own, registered with role 'pointwise') at "
                               f"{caller()}")  # gradient sums over the samples, a clamp of it does not
            return apply(*args, **kwargs)
        if not carried:  # as any call on whole values: a split layer's weight given to it, each rank's share
            return self._run_replicated(apply, args, kwargs)
        wrote: list[torch.Tensor] = []

        def run(*a: Any, **k: Any) -> Any:
            given = _tensors(a, k)
            if has_torch_function(given):  # each mode in turn, this watch among them, sets itself aside
                return handle_torch_function(run, given, *a, **k)
            with torch._C.DisableTorchFunction():  # the watch's bookkeeping, not the forward's reads
                before = [t._version for t in given]
            out = apply(*a, **k)
            with torch._C.DisableTorchFunction():
                wrote.extend(t for t, v in zip(given, before, strict=True) if t._version != v)
            return out

        run.__name__ = f"{cls.__qualname__}.apply"
        out = run(*args, **kwargs)  # met by the watch as a call
        if wrote:
            self.unsafe.append(f"{run.__name__} (writes its input in place, which runs on the volume "
                               f"gathered for it, not on the shards) at {caller()}")
        return out

    def _hooked(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``t.register_hook(fn)``: on a split activation, ``fn`` given the whole gradient."""
        t = args[0]
        if self.batch_apart and not self.judging and (self._carries(t) or t.requires_grad):
            self.unsafe.append(f"register_hook (on a value whose gradient data parallelism or micro-batches "
                               f"compute in parts, a weight's summed over each part's samples: the hook "
                               f"would see each part's gradient) at {caller()}")
        elif t in self.chains:
            self.unsafe.append(f"register_hook (on a reshape of a split activation part way, whose gradient "
                               f"on a rank is its shard's: hook the volume before the reshape) at "
                               f"{caller()}")
        elif t in self.split:
            key = (f"register_hook: {calls.ROLES['hook']}", caller())
            self.met[key] = self.met.get(key, 0) + 1
            return self._run_hook(func, args, kwargs)
        return func(*args, **kwargs)

    def _run_hook(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Register the hook (here, on the volume, as it is: a plan runs no backward)."""
        return func(*args, **kwargs)
