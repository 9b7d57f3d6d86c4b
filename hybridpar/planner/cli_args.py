"""What the planning commands read from a command line: a model reference and a shape.

Why a module of its own: ``python -m hybridpar.planner explain`` and ``python -m hybridpar.advisor``
take the same ``--model MODULE:FACTORY`` and ``--input-shape N,C,D,H,W`` arguments, and a command
module (``__main__``) is not something another module should import from.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
from pathlib import Path

from torch import nn

from hybridpar.planner.terms import SpecError

__all__ = ["load_model", "parse_shape"]


def load_model(ref: str) -> nn.Module:
    """``MODULE:FACTORY`` -> the model. MODULE is a dotted module or a ``.py`` path; FACTORY a
    (dotted) attribute that is an ``nn.Module`` or a callable needing no arguments."""
    mod_name, sep, attr = ref.rpartition(":")
    if not sep or not mod_name or not attr:
        raise SpecError(f"--model: expected MODULE:FACTORY (e.g. cosmoflow.model:build), got {ref!r}")
    if mod_name.endswith(".py") or "/" in mod_name:
        path = Path(mod_name)
        loader = importlib.util.spec_from_file_location(f"_hybridpar_model_{path.stem}", path)
        if loader is None or loader.loader is None or not path.is_file():
            raise SpecError(f"--model: no Python file at {mod_name!r}")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        module = importlib.import_module(mod_name)
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise SpecError(f"--model: {mod_name} has no attribute {attr!r}")
        obj = getattr(obj, part)
    model = obj if isinstance(obj, nn.Module) else obj() if callable(obj) else obj
    if not isinstance(model, nn.Module):
        raise SpecError(f"--model: {ref} gave a {type(model).__name__}, not an nn.Module")
    return model


def parse_shape(text: str) -> tuple[int, ...]:
    """``4,1,64,64,64`` or ``4x1x64x64x64`` -> a shape (an argparse ``type``)."""
    try:
        return tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,C,D,H,W integers, got {text!r}") from None
