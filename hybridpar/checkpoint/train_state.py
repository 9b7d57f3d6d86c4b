"""Layout-independent pieces of a training state: RNG states, and optimizer state keyed by parameter name.

Why: ``optimizer.state_dict()`` numbers parameters by their position in *this rank's* optimizer, so the
numbers mean different tensors under another pipeline split. Keyed by the parameter's full-model name,
the optimizer state of all stages merges into one, and each stage of a new layout picks its own
parameters back out. Hyperparameters are stored per parameter for the same reason (a group's index is
layout-specific too). RNG states are per rank: restoring them makes a resumed run bit-identical. Numpy's
key (624 uint32 words) is kept as an int32 tensor of the same bits: a checkpoint stores tensors and plain
values, never arrays (:mod:`.header`).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from: Python, numpy, torch CPU and (if present) CUDA."""
    name, key, pos, has_gauss, gauss = np.random.get_state()
    numpy = {"bit_generator": name, "key": torch.from_numpy(key.view(np.int32).copy()), "pos": int(pos),
             "has_gauss": int(has_gauss), "gauss": float(gauss)}
    out: dict[str, Any] = {"python": random.getstate(), "numpy": numpy, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (CUDA only when both sides have it)."""
    random.setstate(state["python"])
    saved = state["numpy"]
    if isinstance(saved, dict):
        key = saved["key"].numpy().view(np.uint32)
        saved = (saved["bit_generator"], key, saved["pos"], saved["has_gauss"], saved["gauss"])
    np.random.set_state(saved)  # a tuple: what format-1 checkpoints hold
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Full-model names of the optimizer's parameters, in ``state_dict`` numbering order."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in by_id:
                raise ValueError("optimizer holds a parameter that the model does not name: pass the module "
                                 "whose named_parameters() cover every optimized tensor")
            out.append(by_id[id(p)])
    return out


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"state": {param name: {...}}, "hyper": {param name: {lr, momentum, ...}}}``."""
    sd = optimizer.state_dict()
    names = _names(model, optimizer)
    state = {names[i]: s for i, s in sd["state"].items()}
    hyper = {}
    i = 0
    for g in sd["param_groups"]:
        h = {k: v for k, v in g.items() if k != "params"}
        for _ in g["params"]:
            hyper[names[i]] = h
            i += 1
    return {"state": state, "hyper": hyper}


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         saved: dict[str, Any], strict: bool = True) -> None:
    """Load what :func:`optimizer_state` saved (possibly merged over stages) into this rank's optimizer.

    With ``strict``, every parameter of the optimizer must appear in ``saved``.
    """
    names = _names(model, optimizer)
    missing = [n for n in names if n not in saved["hyper"]]
    if strict and missing:
        raise KeyError(f"optimizer state has no entry for {len(missing)} parameter(s), e.g. {missing[:3]}: "
                       f"was it saved from another model?")
    sd = optimizer.state_dict()
    i = 0
    for g in sd["param_groups"]:
        first = next((names[j] for j in range(i, i + len(g["params"])) if names[j] in saved["hyper"]), None)
        if first is not None:
            g.update({k: v for k, v in saved["hyper"][first].items() if k != "params"})
        i += len(g["params"])
    sd["state"] = {i: saved["state"][n] for i, n in enumerate(names) if n in saved["state"]}
    optimizer.load_state_dict(sd)
