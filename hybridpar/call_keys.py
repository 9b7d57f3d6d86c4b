"""The key of one call of a module: its path for the first call, ``path#k`` for its k-th further one.

Why a module of its own: a module without weights may be called more than once in a forward (one
``act`` after every conv). The traced graph, the module-swapping watch and the FLOP counter each name
such a call by this key, and the readers of a plan (the stage builder, the FLOP sums per leaf, a layer
rule's glob) take the module's path back out of it. Written and read here alone, the spelling cannot
drift between them. A root module rather than the planner's: :mod:`hybridpar.flops`, below the
planner, writes and reads it too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from torch import nn

SEP = "#"


class CallKey(NamedTuple):
    """One call of the module at ``path``; ``k`` calls of it came before (0: its first call)."""

    path: str
    k: int = 0

    def __str__(self) -> str:
        return self.path if not self.k else f"{self.path}{SEP}{self.k}"


def call_key(path: str, k: int) -> str:
    """The key of the call of the module at ``path`` that ``k`` calls of it came before (``k`` = 0:
    its path alone, as a module called once is named)."""
    return str(CallKey(path, k))


def parse_call_key(key: str) -> CallKey:
    """``key`` back as its module's path and ``k`` (a key without ``#k`` is a first call)."""
    path, sep, k = key.partition(SEP)
    return CallKey(path, int(k) if sep else 0)


def module_path(key: str) -> str:
    """The path in the model of the module a call's ``key`` names (what ``get_submodule`` and a layer
    rule's glob read)."""
    return key.partition(SEP)[0]


def call_path(root: nn.Module, module: nn.Module, path: str) -> str:
    """The path a call of ``module`` (first named ``path`` in ``root``) is keyed by: ``path``, or where it
    passes through a parametrization (a layer another layer's parametrization holds, the model's ``b``
    also named ``a.parametrizations.weight.0.src``), its first name that does not. The engine puts a
    layer's split version at the path its calls are keyed by, and a parametrization's modules are
    shared with the split version of the layer they parametrize, never replaced: a call keyed inside
    one would run the plain layer on a shard."""
    if "parametrizations" not in path.split("."):
        return path
    return next((n for n, m in root.named_modules(remove_duplicate=False)
                 if m is module and "parametrizations" not in n.split(".")), path)
