"""In-place operations in a traced graph, made explicit: later readers of the changed value read the
operation's result.

Why: torch.fx records ``h.sigmoid_()``, ``F.leaky_relu_(h)`` or ``h.masked_fill_(m, v)`` as a node
whose result nobody reads when the forward does not assign it; the layers after it read ``h`` itself,
the node before the change. One process sees the change through the tensor they share. A plan does
not run on that tensor: where it gathers ``h`` for the operation (an operation it runs whole), the
change lands on the gathered copy and the next layer reads the shard unchanged, a wrong answer with no
error. Here every reader of ``h`` after the in-place node reads the node instead, which is what the
tensor holds then. A value that is a view of another (``h[:, :2].zero_()``) changes its base, whose
readers the graph does not tie to the view: such a forward is not traced (:class:`ViewChanged`) and
runs by module swapping, on the shards themselves.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

from torch import fx, nn

_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
              operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift,
              operator.irshift, operator.imatmul}
# methods and functions whose result is a view of their first argument: changing it changes that
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "narrow", "select", "permute", "transpose", "t",
          "expand", "expand_as", "squeeze", "unsqueeze", "flatten", "unflatten", "movedim", "moveaxis",
          "swapaxes", "swapdims", "diagonal", "as_strided", "unfold", "detach", "chunk", "split",
          "tensor_split", "unbind", "split_with_sizes", "getitem", "real", "imag", "view_as_real",
          "view_as_complex", "contiguous", "align_as", "T", "mT", "H", "mH"}


class ViewChanged(RuntimeError):
    """An in-place operation changes a view of another value, which a traced graph does not follow."""


def _name(n: fx.Node) -> str:
    target = n.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def changes_first(n: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``n`` writes into its first argument: a method or function named ``..._`` (not
    ``__x__``), ``x += y`` and its kin, a call with ``inplace=True``, a module built ``inplace=True``."""
    if not n.args or not isinstance(n.args[0], fx.Node):
        return False
    if n.op == "call_module":
        return getattr(modules.get(str(n.target)), "inplace", False) is True
    if n.op not in ("call_method", "call_function"):
        return False
    name = _name(n)
    if n.op == "call_function" and n.target in _OPERATORS:
        return True
    if name.endswith("_") and not name.endswith("__"):
        return True
    if n.kwargs.get("inplace") is True:
        return True
    if n.op == "call_function" and callable(n.target):
        try:
            bound = inspect.signature(n.target).bind(*n.args, **n.kwargs)
        except (TypeError, ValueError):
            return False
        return bound.arguments.get("inplace") is True
    return False


def _written(n: fx.Node, modules: dict[str, nn.Module]) -> fx.Node | None:
    """The value ``n`` writes into: its ``out=`` tensor (``torch.tanh(h, out=buf[:, :, 3:8])``, whose
    result is that tensor), or its first argument where it changes it; None where it writes nothing.
    Several ``out=`` tensors (``torch.max(h, 1, out=(v, i))``) are not followed: refused."""
    out = n.kwargs.get("out") if n.op in ("call_method", "call_function") else None
    if isinstance(out, fx.Node):
        return out
    if isinstance(out, list | tuple) and any(isinstance(o, fx.Node) for o in out):
        raise ViewChanged(f"{_name(n)} writes into several tensors (out={out}), which a traced graph "
                          f"does not follow")
    return n.args[0] if changes_first(n, modules) else None


def _view_of(n: fx.Node) -> bool:
    """Whether ``n``'s value may share memory with another value of the graph."""
    if n.op in ("call_method", "call_function"):
        return _name(n) in _VIEWS
    return False


# what may hand back its input itself in some mode (eval): an alias as much as a view
_ALIASING_CALLS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout"}
_ALIASING_MODULES = (nn.Flatten, nn.Unflatten, nn.Identity, nn.modules.dropout._DropoutNd)


def _aliases(value: fx.Node, modules: dict[str, nn.Module]) -> list[fx.Node]:
    """The nodes whose value may share memory with ``value``'s: views of it, views of those, layers
    that hand back a view of their input (``nn.Flatten``) or the input itself."""
    found: list[fx.Node] = []
    todo = [value]
    while todo:
        node = todo.pop()
        for u in node.users:
            if u not in found and u.args and u.args[0] is node and _aliasing(u, modules):
                found.append(u)
                todo.append(u)
    return found


def _aliasing(n: fx.Node, modules: dict[str, nn.Module]) -> bool:
    """Whether ``n``'s value may share memory with its first argument's: a view, or a layer or call that
    hands back a view of its input or the input itself."""
    module = modules.get(str(n.target)) if n.op == "call_module" else None
    return _view_of(n) or _name(n) in _ALIASING_CALLS or isinstance(module, _ALIASING_MODULES)


def make_explicit(graph: fx.Graph, root: Any) -> None:
    """Rewire ``graph`` so that every read of a value after an in-place operation on it reads that
    operation's result (see module doc); raise :class:`ViewChanged` where another value sharing its
    memory (its base, a view of it) is read after the operation."""
    modules = dict(root.named_modules()) if isinstance(root, nn.Module) else {}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for n in list(graph.nodes):
        value = _written(n, modules)
        if value is None:
            continue
        base = value
        while _aliasing(base, modules) and base.args and isinstance(base.args[0], fx.Node):
            base = base.args[0]  # the value whose memory ``value`` is part of
        for other in (base, *_aliases(base, modules)):
            later = any(order[u] > order[n] for u in other.users)
            if other is not value and order[other] < order[n] and later:
                raise ViewChanged(f"the forward changes {value} in place ({_name(n)}) and reads {other}, "
                                  f"which shares its memory ({_name(other)}), after it: a traced graph does "
                                  f"not carry the change from one to the other")
        for user in list(value.users):
            if user is not n and order[user] > order[n]:
                user.replace_input_with(value, n)
