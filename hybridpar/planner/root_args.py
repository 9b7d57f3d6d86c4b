"""A model's forward traced as the engine calls it: with its one input, every other argument left at
its default (``forward(self, x, cond=None)``).

Why: a conditioning or mask argument that defaults to None is a common way to write a model that
also runs unconditioned, and the engine calls ``model(x)``. fx traces such an argument as a
placeholder specialised to its default, guarded by an assertion on the value passed; this module
gives fx those defaults and takes the placeholders and their guards out again, so the graph has
the one input the engine feeds.
"""

from __future__ import annotations

import inspect
import operator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from hybridpar.planner.terms import SpecError


def defaults(model: nn.Module) -> dict[str, Any]:
    """The arguments of ``model.forward`` after its first, each with its default; {} where it takes
    one. An argument without a default is not the engine's to fill: refused, named."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature (a builtin): fx says what it sees
        return {}
    named = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [p.name for p in named[1:] if p.default is p.empty]
    if missing:
        raise SpecError(f"model ({type(model).__name__}): forward takes {', '.join(missing)} besides its "
                        f"input, with no default; the engine calls model(x) with one tensor: give "
                        f"{missing[0]} a default (e.g. {missing[0]}=None) or wrap the model in a module "
                        f"whose forward takes one")
    return {p.name: p.default for p in named[1:]}


def strip(graph: fx.Graph, fixed: dict[str, Any]) -> None:
    """Take out of ``graph`` the placeholders fx made for the ``fixed`` arguments and the guards on
    them; any other use of such a placeholder is refused (the graph would read an input it lacks)."""
    if not fixed:
        return
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for ph in placeholders[1:]:
        for user in list(ph.users):
            if user.op == "call_function" and user.target is fx._symbolic_trace._assert_is_none:
                graph.erase_node(user)
            elif user.op == "call_function" and user.target is operator.eq and \
                    all(u.target is torch._assert for u in user.users):
                for guard in list(user.users):
                    graph.erase_node(guard)
                graph.erase_node(user)
        if ph.users:
            raise SpecError(f"forward argument {ph.target} is read as a value of the graph, not as its "
                            f"default; give the model one tensor input")
        graph.erase_node(ph)
