"""A stage's backward in two passes: input gradient first, weight gradients after (the B/W split).

Why: in a pipeline, the previous stage waits for this stage's *input* gradient; the weight
gradients are needed only when the step ends. A convolution's backward is two products of about
equal cost (input gradient, weight gradient), so a stage that computes its input gradient first and
sends it before its weight gradients lets the previous stage start that much earlier. This is the
B/W split of zero-bubble pipelining (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024);
applied to the last backward of a stage, it shortens the drain of GPipe and 1F1B by the weight
gradients of that backward, at every stage boundary along the chain.

How, in eager PyTorch and without computing anything twice:

* forward keeps the output ``y`` of each *deferrable* layer (convolutions and linear layers whose
  weights appear in no other layer);
* pass 1: ``autograd.backward(out, inputs=[stage input, every kept y, the other layers'
  parameters], retain_graph=True)``. Autograd asks each convolution node only for the outputs the
  call needs (its input), so no weight gradient of a deferred layer is computed; each kept ``y``
  receives its gradient in ``y.grad``;
* the stage input's gradient is sent;
* pass 2, per deferred layer: ``autograd.backward(y, y.grad, inputs=its parameters)`` walks that
  layer's nodes alone and accumulates into ``.grad`` (post-accumulate hooks fire, so the bucketed
  gradient reduction starts as before).

Cost: the gradients of the kept outputs live from pass 1 to pass 2 (at most about one
micro-batch's activations of the stage). The engine splits only a stage's *last* backward, and only
where the schedule holds two or more micro-batches at once on that stage, so by then at least one
micro-batch's activations have been freed: the stage's peak memory does not rise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

Kept = list[tuple[torch.Tensor, list[nn.Parameter]]]

# Layers whose weight gradient is an autograd node of its own (asked only for what a call needs).
_DEFERRABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
               nn.ConvTranspose3d, nn.Linear)


def deferrable(modules: Sequence[nn.Module]) -> list[bool]:
    """Per module: whether its weight gradients can wait for pass 2.

    Not: modules without trainable parameters; custom autograd functions that compute input and
    weight gradients in one call (the overlapped halo convolution), which would run twice; and
    parameters shared with another module, whose other uses pass 2 would not see.
    """
    owners: dict[int, int] = {}
    for m in modules:
        for p in m.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    out = []
    for m in modules:
        params = [p for p in m.parameters() if p.requires_grad]
        out.append(isinstance(m, _DEFERRABLE) and not getattr(m, "overlap", False) and bool(params)
                   and all(owners[id(p)] == 1 for p in m.parameters()))
    return out


def run_keeping(modules: Sequence[nn.Module], defer: Sequence[bool], x: torch.Tensor
                ) -> tuple[torch.Tensor, Kept]:
    """Run the modules in turn; keep each deferred module's output with its parameters."""
    kept: Kept = []
    for m, d in zip(modules, defer):
        x = m(x)
        if d and x.requires_grad:
            kept.append((x, [p for p in m.parameters() if p.requires_grad]))
    return x, kept


def input_pass(out: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor, kept: Kept,
               others: Sequence[nn.Parameter]) -> None:
    """Pass 1: ``inp.grad``, the kept outputs' ``.grad`` and the other parameters' ``.grad``."""
    targets = [inp, *(y for y, _ in kept), *others]
    torch.autograd.backward(out, grad, retain_graph=True, inputs=targets)


def weight_pass(kept: Kept) -> None:
    """Pass 2: the deferred layers' weight gradients, each from its output's gradient alone."""
    for y, params in kept:
        if y.grad is not None:
            g, y.grad = y.grad, None
            torch.autograd.backward(y, g, inputs=params)
