"""Python control flow on the batch's extent, in a forward whose batch data parallelism or
micro-batches hold in parts.

Why: each part runs the forward on its own samples, and its shape reads answer its own extent
(``x.shape[0]``). A loop over it (``for i in range(x.shape[0])``) or a branch on it runs another program
on a part than one process runs on the whole batch: a value made from the loop's index
(``torch.tensor(float(i + 1))``, the i-th row of a table) is the sample's place in its part, which no
tag on the extent can follow (``range`` makes plain ints; :mod:`hybridpar.planner.batch_extent` follows
the extent itself). Such a forward is found by running it on the meta device on the whole batch and on
a part's: where its calls differ, it is refused, naming the first that does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridpar.nn.meta import OnMeta, meta_state, meta_stop, run_unseen
from hybridpar.planner.elementwise import name_of
from hybridpar.planner.terms import SpecError
from hybridpar.user_lines import line_of


def _calls(model: nn.Module, input_shape: Sequence[int], nested: bool) -> list[str]:
    """What the forward calls on a batch of ``input_shape``: each call's name and line, in order."""
    state, dtype = meta_state(model, grads=True)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if nested:  # as the watched run: a layer's output in training
        x = x.requires_grad_().clone()
    run = OnMeta(lines=True)
    run_unseen(model, state, (x,), run)
    return [f"{name_of(func)} at {line}" for func, line in run.lines or []]


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
    if whole == parts:
        return
    k = next((i for i, (a, b) in enumerate(zip(whole, parts)) if a != b), min(len(whole), len(parts)))
    said = [calls[k] if k < len(calls) else "nothing more" for calls in (whole, parts)]
    raise SpecError(f"model ({type(model).__name__}): its forward runs other calls on a part of the batch "
                    f"than on the whole, as data parallelism or micro-batches run it (call {k + 1}: on "
                    f"{input_shape[0]} samples {said[0]}, on {part} {said[1]}): Python control flow on the "
                    f"batch's extent, a loop over range(x.shape[0]) or a branch on it, gives each part what "
                    f"its own extent makes of it; compute on the whole batch (torch.arange, broadcasting) "
                    f"or use grid.data 1 and pipeline.microbatches 1")
