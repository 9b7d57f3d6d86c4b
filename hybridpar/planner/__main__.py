"""``python -m hybridpar.planner explain SPEC --model MODULE:FACTORY --input-shape N,C,D,H,W``.

Why a command: the plan (splits, halos, stage balance, memory per rank) should be checked on a
laptop before a job is queued; this prints it from the spec and the model alone, launching nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridpar.planner.cli_args import load_model, parse_shape
from hybridpar.planner.config import load_spec
from hybridpar.planner.explain import explain
from hybridpar.planner.terms import SpecError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridpar.planner", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("explain", help="print the resolved per-layer plan; launches nothing")
    ex.add_argument("spec", help="the YAML spec file")
    ex.add_argument("--model", required=True, help="MODULE:FACTORY (dotted module or .py path)")
    ex.add_argument("--input-shape", required=True, type=parse_shape, help="global input N,C,D,H,W")
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
