"""``python -m hybridpar.spec explain SPEC --model MODULE:FACTORY --input-shape N,C,D,H,W``.

Why a command: the plan (splits, halos, stage balance, memory per rank) should be checked on a
laptop before a job is queued; this prints it from the spec and the model alone, launching nothing.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

from torch import nn

from hybridpar.spec.config import SpecError, load_spec
from hybridpar.spec.explain import explain


def load_model(ref: str) -> nn.Module:
    """``MODULE:FACTORY`` -> the model. MODULE is a dotted module or a ``.py`` path; FACTORY a
    (dotted) attribute that is an ``nn.Module`` or a callable needing no arguments."""
    mod_name, sep, attr = ref.rpartition(":")
    if not sep or not mod_name or not attr:
        raise SpecError(f"--model: expected MODULE:FACTORY (e.g. cosmoflow.model:build), got {ref!r}")
    if mod_name.endswith(".py") or "/" in mod_name:
        path = Path(mod_name)
        loader = importlib.util.spec_from_file_location(f"_hybridpar_model_{path.stem}", path)
        if loader is None or not path.is_file():
            raise SpecError(f"--model: no Python file at {mod_name!r}")
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)  # type: ignore[union-attr]
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


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N,C,D,H,W integers, got {text!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridpar.spec", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the resolved per-layer plan; launches nothing")
    ex.add_argument("spec", help="the YAML spec file")
    ex.add_argument("--model", required=True, help="MODULE:FACTORY (dotted module or .py path)")
    ex.add_argument("--input-shape", required=True, type=_shape, help="global input N,C,D,H,W")
    ex.add_argument("--world-size", type=int, default=None,
                    help="ranks to plan for (default: the grid's product; needed when it has a -1)")
    args = parser.parse_args(argv)
    try:
        print(explain(load_spec(args.spec), load_model(args.model), args.input_shape, args.world_size))
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
