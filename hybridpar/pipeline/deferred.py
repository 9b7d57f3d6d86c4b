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

Cost: pass 1 retains the graph until pass 2, and the gradients of the kept outputs live between
the passes. The engine splits only a stage's *last* backward. Where the schedule holds two or more
micro-batches at once on that stage, by then at least one micro-batch's activations have been
freed, and the whole stage is split. Where it holds one (GPipe with M = 1, 1F1B's last stage), a
whole-stage split would raise the stage's peak (by 5.3-5.7 MiB on the benchmark's stage of 3
convolutions, measured), so only a *prefix* is split (:func:`prefix_end`: up to the first deferrable
layer): the rest of the stage runs its ordinary backward first (pass 0, down to the prefix's output,
its graph freed as it goes), and the prefix then holds what an ordinary backward would hold at that
point, its own graph and its output's gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hybridpar.planner.schedule import all_weights_wait

Kept = list[tuple[torch.Tensor, list[nn.Parameter]]]
Prefix = tuple[torch.Tensor, torch.Tensor]  # the split prefix's output, and the leaf the rest ran on

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


def prefix_end(modules: Sequence[nn.Module], defer: Sequence[bool]) -> int | None:
    """End of the shortest prefix that holds a deferrable layer, or None.

    The prefix also takes the in-place modules right after that layer: they rewrite its output,
    which must stay the tensor pass 0 stops at. None when the module after the prefix is a
    container (an in-place child could not be seen).
    """
    first = next((i for i, d in enumerate(defer) if d), None)
    if first is None:
        return None
    end = first + 1
    while end < len(modules) and getattr(modules[end], "inplace", False):
        end += 1
    if end < len(modules) and next(modules[end].children(), None) is not None:
        return None
    return end


def split_end(modules: Sequence[nn.Module], defer: Sequence[bool], in_flight: int) -> int | None:
    """End of the part of a stage whose last backward runs in two passes, or None (see module doc):
    the whole stage where the schedule holds ``in_flight`` >= 2 micro-batches on it, else the prefix
    up to its first deferrable layer (:func:`prefix_end`)."""
    if not any(defer):
        return None
    return len(modules) if all_weights_wait(in_flight) else prefix_end(modules, defer)


def run_keeping(modules: Sequence[nn.Module], defer: Sequence[bool], x: torch.Tensor,
                upto: int | None = None) -> tuple[torch.Tensor, Kept, Prefix | None]:
    """Run the modules in turn; keep each deferred module's output in the split prefix (the first
    ``upto`` modules; all when None) with its parameters.

    With a proper prefix, the modules after it run on a detached copy of its output (a leaf of the
    same storage), so that pass 0 stops there and leaves the prefix's graph whole: returns
    (prefix output, that leaf) as the third item, else None.
    """
    upto = len(modules) if upto is None else upto
    kept: Kept = []
    prefix: Prefix | None = None
    for i, (m, d) in enumerate(zip(modules, defer)):
        x = m(x)
        if i < upto and d and x.requires_grad:
            kept.append((x, [p for p in m.parameters() if p.requires_grad]))
        if i == upto - 1 and upto < len(modules) and x.requires_grad:
            prefix = (x, x.detach().requires_grad_())
            x = prefix[1]
    return x, kept, prefix


def rest_pass(out: torch.Tensor, grad: torch.Tensor | None, prefix: Prefix,
              params: Sequence[nn.Parameter]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass 0 (prefix split only): the ordinary backward of the modules after the prefix, their
    weights included, its graph freed as it goes. Returns (prefix output, its gradient): the root
    of pass 1."""
    y, leaf = prefix
    torch.autograd.backward(out, grad, inputs=[leaf, *params])
    return y, leaf.grad if leaf.grad is not None else torch.zeros_like(y)


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
