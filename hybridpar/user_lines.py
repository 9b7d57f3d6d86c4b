"""Where the user's code is: the innermost frame of the live stack outside torch and this package.

Why: a refusal names the line of the user's forward that made the call (``unet.py:41``), read while
that forward runs (module swapping's calls, the tracer's nodes). Reading the live frames costs
microseconds; a formatted traceback of the whole stack costs milliseconds per call.
"""

from __future__ import annotations

import os
import sys
import traceback


def ours(filename: str) -> bool:
    """Whether ``filename`` is torch's or this package's code (not the user's)."""
    return f"{os.sep}torch{os.sep}" in filename or f"{os.sep}hybridpar{os.sep}" in filename


def caller() -> str:
    """``file:line`` of the innermost frame outside torch and this package: the forward's line."""
    f = sys._getframe(1)
    while f is not None and ours(f.f_code.co_filename):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def in_torch_layer() -> bool:
    """Whether the innermost frame of the live stack outside this package and torch's functions is a
    torch layer's own code (``torch/nn/modules``: a GRU making its initial state), not the user's."""
    layers = f"{os.sep}torch{os.sep}nn{os.sep}modules{os.sep}"
    f = sys._getframe(1)
    while f is not None and ours(f.f_code.co_filename) and layers not in f.f_code.co_filename:
        f = f.f_back
    return f is not None and layers in f.f_code.co_filename


def line_of(err: BaseException) -> str:
    """``file:line`` of the innermost frame of ``err``'s traceback outside torch and this package."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not ours(f.filename)]
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"
