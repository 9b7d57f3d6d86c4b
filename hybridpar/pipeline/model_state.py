"""A pipelined model's state dict under the original model's keys, whatever the layout.

Why: a checkpoint must load into any layout (another pipeline cut, another split), so it is kept in
the original model's terms: each stage holds the entries of its own layers (split layers hold whole
weights: only activations are split), and the whole is their union in the original key order. A
model may register one module under two names (MONAI's DynUNet keeps its blocks in two lists), and
``model.state_dict()`` then has both keys for one tensor; a stage holds it under the name its forward
reached it by, so every other name is filled in from it (:class:`ModelKeys`). Entries of modules the
forward never calls are read from the model's own tensors.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.grid import ProcessGrid

Layers = list[tuple[str | None, nn.Module]]
"""A stage's layers: (name in the original model, or None for one the engine made, module)."""


class ModelKeys:
    """The original model's state-dict keys in order, which of them name one tensor (aliases), and
    the entries no stage holds (of modules the forward never calls)."""

    def __init__(self, model: nn.Module, run: set[str] | None) -> None:
        """``run``: the modules the stages run (qualified names), or None: all of them."""

        def held(key: str) -> bool:
            parts = key.split(".")
            return run is None or any(".".join(parts[:k]) in run for k in range(len(parts)))

        entries = model.state_dict(keep_vars=True)
        self.keys = list(entries)
        groups: dict[int, list[str]] = {}
        for k, v in entries.items():
            groups.setdefault(id(v), []).append(k)
        self.names = {k: g for g in groups.values() for k in g}  # key -> every key of its tensor
        # the model's own tensors: an optimizer over model.parameters() may still change them (decay)
        self.unheld = {g[0]: _detached(entries[g[0]]) for g in groups.values() if not any(held(k) for k in g)}

    def ordered(self, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``entries`` in the model's key order; after them, those the model had no key for at the
        build (a buffer registered empty, ``register_buffer("prev", None)``, that the forward fills)."""
        return {**{k: entries[k] for k in self.keys if k in entries},
                **{k: v for k, v in entries.items() if k not in self.names}}

    def complete(self, entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``entries`` with every other name of each of their tensors."""
        return {a: v for k, v in entries.items() for a in self.names.get(k, [k])}


def local_state(layers: Layers, keys: ModelKeys | None = None, first: bool = True) -> dict[str, torch.Tensor]:
    """This stage's entries (a layer named None is one the original model does not have), under every
    name the model gives them; the first stage also has the entries no stage holds."""
    own = {f"{name}.{k}" if name else k: v for name, m in layers if name is not None
           for k, v in m.state_dict().items()}
    if keys is None:
        return own
    return keys.ordered(keys.complete({**own, **(keys.unheld if first else {})}))


def full_state(layers: Layers, grid: ProcessGrid, keys: ModelKeys) -> dict[str, torch.Tensor]:
    """Every stage's entries, gathered over the pipeline (on CPU), in the original model's keys."""
    local = {k: _on_cpu(v) for k, v in local_state(layers).items()}
    parts = [local]
    if grid.pipe > 1:
        parts = [None] * grid.pipe
        dist.all_gather_object(parts, local, group=grid.pipe_group)
    unheld = {k: _on_cpu(v) for k, v in keys.unheld.items()}
    return keys.ordered(keys.complete({**unheld, **{k: v for p in parts for k, v in p.items()}}))


def _detached(v: Any) -> Any:
    """A state entry without its autograd history; an entry that is no tensor (neuraloperator's
    models keep their constructor arguments under ``_metadata``) as it is."""
    return v.detach() if isinstance(v, torch.Tensor) else v


def _on_cpu(v: Any) -> Any:
    """A CPU copy of a state entry (one that is no tensor: a deep copy)."""
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def load_state(layers: Layers, state: dict[str, torch.Tensor]) -> None:
    """Load the original model's entries into this stage's layers."""
    for name, m in layers:
        if name is None:
            continue
        prefix = f"{name}." if name else ""
        sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not name:  # a graph stage holds only its own stage's layers
            sub = {k: v for k, v in sub.items() if k in m.state_dict()}
        m.load_state_dict(sub)
