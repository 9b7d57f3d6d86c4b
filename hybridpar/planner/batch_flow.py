"""Python control flow on the batch's extent, in a forward whose batch data parallelism or
micro-batches hold in parts.

Why: each part runs the forward on its own samples, and its shape reads answer its own extent
(``x.shape[0]``). A loop over it (``for i in range(x.shape[0])``) or a branch on it runs another program
on a part than one process runs on the whole batch: a value made from the loop's index
(``torch.tensor(float(i + 1))``, the i-th row of a table) is the sample's place in its part, which no
tag on the extent can follow (``range`` makes plain ints; :mod:`hybridpar.planner.batch_extent` follows
the extent itself). A value Python makes of the extent gives a part the same calls given other numbers
(``2.0 if x.shape[0] == 4 else 1.0``, ``min(n, 3)``, ``int(n)``, ``0.9 ** n``, ``math.log(n)``), which
no tag follows either. Such a forward is found by running it on the meta device on the whole batch and
on a part's: where its calls, or the numbers they are given, differ, it is refused, naming the first
that does; a size given to the batch's dim (``h.view(n, -1)``, ``x.new_zeros(x.shape)``) is each
part's own, as one process sizes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hybridpar.nn.meta import OnMeta, meta_state, meta_stop, run_unseen
from hybridpar.planner import batch_extent
from hybridpar.planner.elementwise import name_of
from hybridpar.planner.terms import SpecError
from hybridpar.user_lines import line_of


def _calls(model: nn.Module, input_shape: Sequence[int], nested: bool) -> list[tuple[str, str, Any]]:
    """What the forward calls on a batch of ``input_shape``: each call's name, line and what it was given
    besides tensors (:func:`hybridpar.nn.meta.given_plainly`), in order."""
    state, dtype = meta_state(model, grads=True)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if nested:  # as the watched run: a layer's output in training
        x = x.requires_grad_().clone()
    run = OnMeta(lines=True)
    run_unseen(model, state, (x,), run)
    return [(name_of(func), line, given) for func, line, given in run.lines or []]


def _leaves(value: Any) -> list[Any]:
    return [leaf for v in value for leaf in _leaves(v)] if isinstance(value, tuple) else [value]


def _sized_alike(name: str, whole: Any, part: Any, sizes: tuple[int, int]) -> bool:
    """Whether a call's arguments on the whole batch (``whole``) and on a part differ only in the size
    they give the batch's dim, ``sizes`` (the whole batch's, the part's): ``h.view(n, -1)``."""
    if name not in batch_extent.SIZED_METHODS + batch_extent.SIZED_FACTORIES + tuple(batch_extent.SIZE_AT):
        return False
    leads = [(batch_extent.sizes_of(name, *run) or [None])[0] for run in (whole, part)]
    a, b = _leaves(whole), _leaves(part)
    return tuple(leads) == sizes and len(a) == len(b) and [(x, y) for x, y in zip(a, b) if x != y] == [sizes]


def _differs(whole: tuple[str, str, Any], part: tuple[str, str, Any], sizes: tuple[int, int]) -> bool:
    return whole[:2] != part[:2] or (
        whole[2] != part[2] and not _sized_alike(whole[0], whole[2], part[2], sizes))


def _said(call: tuple[str, str, Any] | None) -> str:
    if call is None:
        return "nothing more"
    numbers = [v for v in _leaves(call[2]) if isinstance(v, int | float) and not isinstance(v, bool)]
    return f"{call[0]}" + (f"({', '.join(map(repr, numbers))})" if numbers else "") + f" at {call[1]}"


def refuse_batch_flow(model: nn.Module, input_shape: Sequence[int], part: int, nested: bool) -> None:
    """Refuse ``model``'s forward where it calls other functions on a part's ``part`` samples than on
    the batch of ``input_shape`` (``nested``: a block of a traced graph, its input a layer's output)."""
    try:
        whole = _calls(model, input_shape, nested)
        parts = _calls(model, (part, *input_shape[1:]), nested)
    except Exception as err:  # noqa: BLE001 - the forward's own error, named in the refusal
        why = (meta_stop(err) or (f"{type(err).__name__}: {err}",))[0]
        raise SpecError(f"model ({type(model).__name__}): its forward fails on a part of the batch, "
                        f"{part} of {input_shape[0]} samples, as data parallelism or micro-batches run it "
                        f"(at {line_of(err)}: {why})") from None
    sizes = (input_shape[0], part)
    k = next((i for i, (a, b) in enumerate(zip(whole, parts)) if _differs(a, b, sizes)),
             min(len(whole), len(parts)))
    if k == len(whole) == len(parts):
        return
    said = [_said(calls[k] if k < len(calls) else None) for calls in (whole, parts)]
    raise SpecError(f"model ({type(model).__name__}): its forward runs other calls on a part of the batch "
                    f"than on the whole, as data parallelism or micro-batches run it (call {k + 1}: on "
                    f"{input_shape[0]} samples {said[0]}, on {part} {said[1]}): Python control flow on the "
                    f"batch's extent, a loop over range(x.shape[0]), a branch on it or a number made of it, "
                    f"gives each part what its own extent makes of it; compute on the whole batch "
                    f"(torch.arange, broadcasting) or use grid.data 1 and pipeline.microbatches 1")
