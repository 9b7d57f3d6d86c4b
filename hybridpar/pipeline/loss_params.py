"""The model's parameters that ``loss_fn`` reads itself (not through the output): their gradients summed
exactly over the ranks that evaluate the loss.

Why: a loss may read parameters of the model: a penalty on a learnable gate (``0.1 * model.gamma.abs()``),
a learnable loss weight (Kendall's ``mse * exp(-s) / 2 + s / 2``, ``s`` used nowhere else), weight decay
written into the loss. The engine evaluates ``loss_fn`` on each rank's output shard, weighted by its share,
so each rank holds a part of such a parameter's gradient; the gradient reduction, which knows how each
layer applies a parameter in the forward, averaged those parts: 0.5x on two ranks, the ranks' copies of a
parameter no layer uses drifting apart, and silently.

A gradient hook the loss registers (``p.register_hook``), or an autograd.Function of its own it applies
to the output, would see a part's gradient: either is refused as the loss makes it.

How: while ``loss_fn`` runs (:meth:`LossReads.watch`), a ``TorchFunctionMode`` hands every operation that
takes one of the model's parameters itself an alias of it whose gradient goes aside, not into ``.grad``.
After the step (:meth:`LossReads.finish`) the ranks agree on which parameters were read (one all-reduce
of a flag per parameter over the job, every step), sum the parts over the stage (one all-reduce per
dtype) and add ``P / n`` of the sum to ``.grad`` (``P`` ranks share one replica's output, whose parts
sum to the replica's gradient; ``n`` ranks in the stage, ``n / P`` copies of each replica's part): the
gradient of one process, averaged over the data-parallel replicas as every other gradient is. Refused,
in one line on every rank after the step: a pipeline (the loss's stage does not hold the other stages'
parameters and its parts would reach no other stage), ranks that read different parameters, a step
captured as a CUDA graph (its replays run no Python, so nothing would be added).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn.torch_args import complete
from hybridpar.planner import applied
from hybridpar.user_lines import caller


class _Aside(torch.autograd.Function):
    """The parameter itself forward; its gradient to ``reads`` (not to ``.grad``) backward."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, reads: LossReads) -> torch.Tensor:
        ctx.reads, ctx.p = reads, p
        return p.view_as(p)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None]:
        ctx.reads.add(ctx.p, g)
        return None, None


def is_alias(t: torch.Tensor) -> bool:
    """Whether ``t`` is the alias :class:`LossReads` hands a call in place of a parameter."""
    return getattr(t.grad_fn, "_forward_cls", None) is _Aside


class _Watch(TorchFunctionMode):
    def __init__(self, reads: LossReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = complete(func, kwargs or {})
        if getattr(func, "__name__", None) == "register_hook":
            raise ValueError(f"loss_fn registers a gradient hook at {caller()}: the engine evaluates "
                             f"the loss on each rank's part of the output (of a volume split, of a batch in "
                             f"parts), whose gradient alone the hook would see; register it in the model's "
                             f"forward, where a hook on a split activation is given the whole gradient")
        swap = self.reads.alias
        return func(*tree_map(swap, args), **tree_map(swap, kwargs))


def _refuse_function(cls: type, apply: Any, args: tuple, kwargs: dict) -> Any:
    if cls.__module__.startswith("torch.") or not any(
            isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves((args, kwargs))):
        return applied.PASS
    raise ValueError(f"loss_fn applies an autograd.Function of its own ({cls.__qualname__}.apply) at "
                     f"{caller()}: the engine evaluates the loss on each rank's part of the output "
                     f"(of a volume split, of a batch in parts), whose gradient alone its backward would "
                     f"see; apply it in the model's forward, where it runs on the gathered volume")


class LossReads:
    """The model's parameters ``loss_fn`` reads, and their gradients from those reads (see module doc).

    ``named``: every parameter of the model with its name (held weakly: a pipeline's other stages'
    parameters may be freed)."""

    def __init__(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        self.index: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its place in ``names``
        self.names: list[str] = []
        for name, p in named:
            if p not in self.index:  # a parameter two modules share: its first name
                self.index[p] = len(self.names)
                self.names.append(name)
        self.read: dict[int, torch.Tensor] = {}  # the step's: index -> parameter
        self.grads: dict[int, torch.Tensor] = {}  # index -> the gradient its reads gave

    def alias(self, t: Any) -> Any:
        """``t``, or where it is one of the model's parameters that requires grad, its alias."""
        if isinstance(t, nn.Parameter) and t.requires_grad and t in self.index:
            self.read[self.index[t]] = t
            return _Aside.apply(t, self)
        return t

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        i = self.index[p]
        self.grads[i] = g if i not in self.grads else self.grads[i] + g

    def start(self) -> None:
        """A step begins: nothing read yet (a step that raised may have left reads)."""
        self.read, self.grads = {}, {}

    def refuse_captured(self, what: str) -> None:
        """In a step being captured as a CUDA graph (no collective may start there): a read refused,
        alike on every rank (they run the same code), since the replays would run no Python."""
        if self.read:
            names = ", ".join(self.names[i] for i in sorted(self.read))
            self.start()
            raise ValueError(f"{what}: loss_fn reads parameter(s) {names} itself (not through the model's "
                             f"output), whose gradient the engine sums over the ranks after the step, "
                             f"which a captured CUDA graph does not replay: add the term after train_step "
                             f"or do not capture the step")

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Around a ``loss_fn`` call: parameters it reads take the alias; a gradient hook it registers,
        or an autograd.Function of its own it applies to what has a gradient, is refused."""
        with _Watch(self), applied.watching(_refuse_function):
            yield


    def finish(self, stage: dist.ProcessGroup | None, shards: int, device: torch.device, pipeline: bool,
               what: str) -> None:
        """The step's parts summed over ``stage`` and added to ``.grad`` (see module doc); ``shards``
        ranks share one replica's output; ``device``: the collectives'. Raises the same line on every rank
        where that cannot be exact."""
        read, grads = dict(sorted(self.read.items())), self.grads
        self.read, self.grads = {}, {}
        mine = torch.zeros(len(self.names), dtype=torch.float32)
        mine[list(read)] = 1.0
        told = torch.cat([mine, -mine])  # MAX: which any rank read, and which every rank read
        if dist.is_initialized() and dist.get_world_size() > 1:
            told = _all_reduce(told, dist.ReduceOp.MAX, None, device)
        some, every = told[:len(mine)] > 0, told[len(mine):] < 0
        if not some.any():
            return
        names = ", ".join(n for n, r in zip(self.names, some.tolist(), strict=True) if r)
        head = (f"{what}: loss_fn reads parameter(s) {names} itself (not through the model's output), "
                f"whose gradient the engine sums over the ranks that evaluate the loss")
        if pipeline:
            raise ValueError(f"{head}, which a pipeline cannot: the loss's stage does not hold the other "
                             f"stages' parameters; add the term to the gradients after train_step "
                             f"(term.backward() before optimizer.step()) or use grid.pipe 1")
        if not torch.equal(some, every):
            raise ValueError(f"{head}, and not every rank read them all: read the same parameters on every "
                             f"rank, whatever the data")
        n = dist.get_world_size(stage) if stage is not None else 1
        parts = {i: grads.get(i, torch.zeros_like(p)) for i, p in read.items()}  # a read without a gradient
        for dtype in sorted({g.dtype for g in parts.values()}, key=str):
            these = [i for i, g in parts.items() if g.dtype == dtype]
            flat = torch.cat([parts[i].reshape(-1) for i in these]).mul_(shards / n)
            if n > 1:
                flat = _all_reduce(flat, dist.ReduceOp.SUM, stage, flat.device)
            for i, part in zip(these, flat.split([parts[i].numel() for i in these]), strict=True):
                p = read[i]
                part = part.view_as(p)
                p.grad = part.clone() if p.grad is None else p.grad.add_(part)


def _all_reduce(t: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None,
                device: torch.device | None) -> torch.Tensor:
    """``t`` all-reduced with ``op`` over ``group``, on ``device`` (the backend's; back where it was)."""
    moved = t.to(device) if device is not None else t
    dist.all_reduce(moved, op=op, group=group)
    return moved.to(t.device)
