"""A user's split version of a layer (``to_dist`` registered for a layer of the user's own) checked on
its first forward against the layer it splits, with one verdict on every rank of the split.

Why: ``hp.nn.register(..., to_dist=)`` trusts the user's Dist class to give this rank's shard of what
the layer gives on the volume (and a layer registered without one, to run alike on each shard). A Dist
class that runs the layer's own forward on each shard (a resample that picks every other plane of its
shard, not of the volume: on odd splits another plane set) or that forgets ``with_halos`` gives an
output of the right extents and other values, silently; one whose output extents differ from the plan's
makes the next layer's halo exchange fail on one rank while the others wait. So its first forward is
compared: the output's extents with this rank's box of the layer's output on the volume (a run on the
meta device), and, where one sample of its input is small enough to gather (:data:`GATHER_LIMIT`
elements), the values with the layer run on the batch (one sample if the batch is not) gathered whole;
in training, also that its output depends on every parameter the layer's does (a weight kept detached
would get no gradient), and then its gradients there, for one cotangent: a Dist class whose forward is
right can still train wrong (a sum over the shards done by hand with ``dist.all_reduce``, which autograd
does not see, gives each shard its own part of the mean's gradient). Again at each new extent of the
volume a split version is told (right at one size, a layer may not be at another).
The ranks agree on each verdict before any raises.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map

from hybridpar.comm.flags import any_rank
from hybridpar.comm.redistribute import gather, infer_global_shape
from hybridpar.comm.reduce import grad_split, sum_to_replicated
from hybridpar.device.eager import eager
from hybridpar.geometry import shard_box
from hybridpar.grid import ProcessGrid
from hybridpar.nn.meta import meta_state, unwatched
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.value_flow import check_uses, unfollowed
from hybridpar.planner.terms import SpecError

__all__ = ["GATHER_LIMIT", "watch_split_version"]

GATHER_LIMIT = 1 << 24
"""Elements of one sample of the layer's input up to which the values are checked (64 MiB in float32,
once); past it, the extents alone."""

_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}  # any other dtype: 1e-2


def watch_split_version(d: nn.Module, original: nn.Module, what: str, replicated: bool = False,
                        grid: ProcessGrid | None = None) -> None:
    """Check ``d``'s first forward on a split input against ``original`` (the layer it stands for; its
    output whole on every rank where ``replicated``: a reduction over the volume), and again at each new
    extent of the volume a split version is told (a layer right at one size may not be at another).
    ``grid``: where ``d`` is a copy of ``original`` run on each shard (no split version of its own). The
    check wraps ``d.forward`` on the instance, so a caller that later runs the layer whole on a value that
    is not split (module swapping's) calls around it."""
    inner = d.forward
    done: set[Any] = set()

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key = getattr(d, "global_input_shape", None) if grid is None else None
        key = None if key is None else tuple(key)
        first = isinstance(x, torch.Tensor) and x.dim() == 5 and key not in done
        before = {id(b): b.detach().clone() for b in original.buffers()} if first else {}
        out = inner(x, *args, **kwargs)
        if first and isinstance(out, torch.Tensor):
            done.add(key)
            reached = _reached(out) if out.grad_fn is not None else None  # its parameters, in training
            call = _Call(d, original, inner, grid or d.grid, x, args, kwargs, out, before)
            with torch.no_grad():
                _check(call, what, replicated, reached)
        return out

    d.forward = forward


class _Call:
    """One forward of a split version (or copy) ``d`` of ``original`` on its shard ``x``, as checked: its
    other inputs, output, and the buffers' values before it ran (by the buffer's id)."""

    def __init__(self, d: nn.Module, original: nn.Module, inner: Any, grid: ProcessGrid, x: torch.Tensor,
                 args: tuple, kwargs: dict, out: torch.Tensor, before: dict[int, torch.Tensor]) -> None:
        self.d, self.original, self.inner, self.grid = d, original, inner, grid
        self.x, self.args, self.kwargs, self.out, self.before = x, args, kwargs, out, before
        self.copied = not isinstance(d, SpatialLayer)
        self.extents = tuple(infer_global_shape(x, grid) if self.copied else d.global_shape(x))
        # the whole batch where it fits (a layer may read across it: a running statistic), else one sample
        self.take = x.shape[0] if x.shape[0] * x.shape[1] * math.prod(self.extents) <= GATHER_LIMIT else 1
        self.split_args = all(_is_shard(a, x) for a in tree_leaves((args, kwargs))
                              if isinstance(a, torch.Tensor))

    def reference(self) -> nn.Module:
        """A copy of the layer with its buffers as they were before this call."""
        layer = copy.deepcopy(self.original)
        with torch.no_grad():
            for (_, b), own in zip(layer.named_buffers(), self.original.buffers(), strict=True):
                if id(own) in self.before:
                    b.copy_(self.before[id(own)])
        return layer

    def whole_args(self, x: torch.Tensor) -> tuple[tuple, dict]:
        """The call's inputs as the layer reads them on the volume: ``x`` (the samples checked,
        gathered) and the other split inputs' same samples, gathered."""
        def whole(a: Any) -> Any:
            return gather(a[:self.take].detach(), self.grid, self.extents) if isinstance(a, torch.Tensor) \
                else a
        return (x, *tree_map(whole, self.args)), tree_map(whole, self.kwargs)

    @contextmanager
    def buffers_before(self) -> Iterator[None]:
        """``d`` holding copies of its buffers as they were before the call (the real ones untouched:
        the call's backward may need them as they are)."""
        held = [(m, k, b) for m in self.d.modules() for k, b in m._buffers.items()
                if b is not None and id(b) in self.before]
        for m, k, b in held:
            m._buffers[k] = self.before[id(b)].clone()
        try:
            yield
        finally:
            for m, k, b in held:
                m._buffers[k] = b


def _is_shard(a: torch.Tensor, x: torch.Tensor) -> bool:
    return a.dim() == 5 and a.shape[0] == x.shape[0] and a.shape[2:] == x.shape[2:]


@eager  # collectives and a copy of the layer, once per size: never part of a compiled graph
def _check(call: _Call, what: str, replicated: bool, reached: set[int] | None) -> None:
    grid, x, extents = call.grid, call.x, call.extents
    group = grid.spatial_group if grid.spatial_size > 1 else None
    small = call.split_args and x.shape[1] * math.prod(extents) <= GATHER_LIMIT
    why = ""
    try:
        one = not call.args and not call.kwargs  # the layer's extents on the meta device: one input
        whole = tuple(_meta_out(call.original, x, extents).shape[1:]) if one else ()
        box = None if replicated or not one else shard_box(whole[1:], grid.spatial_shape, grid.spatial_coord)
        local = whole if box is None else (whole[0], *(hi - lo for lo, hi in box))
        if one and reached is not None and (lost := _unused(call, reached)):
            why = (f"its output does not depend on its parameter {lost[0]}, where the layer's does (a copy "
                   f"detached or kept from another call?): it would get no gradient")
        elif one and tuple(call.out.shape[1:]) != local:
            why = (f"its output on rank {grid.rank} is {_dims(call.out.shape[1:])} where the layer gives "
                   f"{_dims(local)}{'' if box is None else f' of its {_dims(whole[1:])}'} on the volume")
    except Exception as err:  # noqa: BLE001 - the user's layer: agreed on below, then raised on every rank
        why = f"checking it failed: {type(err).__name__}: {err}"
    _refuse_if(call, what, _agree(why, group), "outputs")  # agreed before the ranks gather together
    if not small:
        return
    try:
        why = _values(call, replicated)
    except Exception as err:  # noqa: BLE001
        why = f"checking it failed: {type(err).__name__}: {err}"
    _refuse_if(call, what, _agree(why, group), "outputs")
    if reached is None:
        return
    try:  # a parameter applied otherwise than said: named so, not by its gradient's error
        check_uses(call.d)
        why = ""
    except ValueError as err:
        why = str(err)
    if said := _agree(why, group):
        raise ValueError(said)
    try:
        why = _gradients(call, replicated)
    except Exception as err:  # noqa: BLE001
        why = f"checking its gradients failed: {type(err).__name__}: {err}"
    _refuse_if(call, what, _agree(why, group), "gradients")


def _refuse_if(call: _Call, what: str, said: str, kind: str) -> None:
    if not said:
        return
    if call.copied:
        raise SpecError(f"{what}: run as a copy on each shard (registered without to_dist), it does not give "
                        f"the layer's {kind} on the volume: {said}; its forward must not depend on where the "
                        f"shard lies nor on its extents (a branch on x.shape), or register a split version "
                        f"(to_dist)")
    fix = ("its forward must give this rank's box of that output (halos from self.with_halos(x) for a "
           "window, a resample's planes counted from the volume's origin), or register the layer without "
           "to_dist") if kind == "outputs" else (
           "sum over the volume with self.volume_sum (differentiable), and say self.applied_whole(p) of a "
           "parameter applied to whole values (hybridpar.nn.SpatialLayer)")
    gives = "shards of the layer's output" if kind == "outputs" else "layer's gradients"
    raise SpecError(f"{what}: its split version {type(call.d).__name__} (the registered to_dist) does not "
                    f"give the {gives} on the volume: {said}; {fix}")


def _reached(out: torch.Tensor) -> set[int]:
    """The leaf tensors (by id) ``out``'s autograd graph reaches."""
    found, seen, todo = set(), set(), [out.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            found.add(id(fn.variable))
        todo.extend(f for f, _ in fn.next_functions)
    return found


def _unused(call: _Call, reached: set[int]) -> list[str]:
    """The names of the parameters the call's output (its graph reached ``reached``) does not depend on
    while the layer's output on the volume does (run on the meta device, with gradients)."""
    original, x, extents = call.original, call.x, call.extents
    own = {id(q) for q in call.d.parameters()}
    lost = [n for n, p in original.named_parameters()
            if p.requires_grad and id(p) not in reached and id(p) in own]
    if not lost:
        return []
    state, dtype = meta_state(original)
    for name in lost:
        state[name].requires_grad_(True)
    probe = torch.empty((1, x.shape[1], *extents), dtype=dtype, device="meta")
    with unwatched(original), torch.enable_grad():
        used = _reached(torch.func.functional_call(original, state, (probe,)))
    return [n for n in lost if id(state[n]) in used]


def _meta_out(original: nn.Module, x: torch.Tensor, extents: tuple[int, ...]) -> torch.Tensor:
    state, dtype = meta_state(original)
    probe = torch.empty((1, x.shape[1], *extents), dtype=x.dtype if x.is_floating_point() else dtype,
                        device="meta")
    with unwatched(original):
        return torch.func.functional_call(original, state, (probe,))


def _values(call: _Call, replicated: bool) -> str:
    """Why this rank's output differs from its box (all, where ``replicated``) of the layer's on the
    samples checked, gathered, or ""."""
    layer = call.reference()
    whole = gather(call.x[:call.take].detach(), call.grid, call.extents)
    args, kwargs = call.whole_args(whole)
    with unwatched(layer), unfollowed(call.d), torch.random.fork_rng(devices=[]):
        want = layer(*args, **kwargs)
    box = None if replicated else shard_box(want.shape[2:], call.grid.spatial_shape, call.grid.spatial_coord)
    if box is not None:
        want = want[(..., *(slice(lo, hi) for lo, hi in box))]
    got = call.out[:call.take].detach()
    if got.shape != want.shape:
        return (f"its output on rank {call.grid.rank} is {_dims(got.shape[1:])} where the layer gives "
                f"{_dims(want.shape[1:])} on the volume")
    got = got.to(want.dtype)
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if err > _RTOL.get(want.dtype, 1e-2) * scale:
        return (f"on rank {call.grid.rank} its values differ from the layer's on the volume by up to "
                f"{err:.3g} (largest value {scale:.3g}), in its first forward at this size")
    return ""


def _gradients(call: _Call, replicated: bool) -> str:
    """Why the call's gradients on the samples checked (this rank's shard) differ from the layer's on them
    gathered, for one cotangent drawn alike on every rank: the input's (this rank's box), and each
    parameter's (summed over the shards where it says each gives a part), or ""."""
    d, grid = call.d, call.grid
    mine = call.x[:call.take].detach().requires_grad_()
    flow = getattr(d, "_value_flow", None)  # the forward's own follower (nn/value_flow.py): mine is a shard
    if flow is not None:
        flow.shard[mine] = True
    rest = tree_map(lambda a: a[:call.take].detach() if isinstance(a, torch.Tensor) else a,
                    (call.args, call.kwargs))
    # saved tensors kept as they are: not by a torch.utils.checkpoint the layer runs in (its count)
    with torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        with call.buffers_before(), torch.enable_grad(), torch.random.fork_rng(devices=[]):
            out = call.inner(mine.clone(), *rest[0], **rest[1])  # a write in place writes the clone
        with unfollowed(d):
            layer = call.reference()
            names = [n for n, q in call.original.named_parameters()
                     if q.requires_grad and any(q is p for p in d.parameters())]
            ours = [call.original.get_parameter(n) for n in names]
            whole = gather(mine.detach(), grid, call.extents).requires_grad_()
            args, kwargs = call.whole_args(whole)
            with unwatched(layer), torch.enable_grad(), torch.random.fork_rng(devices=[]):
                want = layer(*args, **kwargs)
            cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            cot = cot.to(want)
            box = None if replicated else shard_box(want.shape[2:], grid.spatial_shape, grid.spatial_coord)
            mine_cot = cot if box is None else cot[(..., *(slice(lo, hi) for lo, hi in box))]
            got = torch.autograd.grad(out, [mine, *ours], mine_cot, allow_unused=True)
            ref = torch.autograd.grad(want, [whole, *(layer.get_parameter(n) for n in names)], cot,
                                      allow_unused=True)
            in_box = (..., *(slice(*r) for r in shard_box(call.extents, grid.spatial_shape,
                                                          grid.spatial_coord)))
            pairs = [("its input", got[0], ref[0][in_box] if ref[0] is not None else None, mine)]
            for n, q, g, r in zip(names, ours, got[1:], ref[1:], strict=True):
                if g is not None and grad_split(q) > 1:
                    g = sum_to_replicated(g, grid.spatial_group)
                pairs.append((f"its parameter {n}", g, r, q))
            return _differ(pairs, grid.rank)


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t


Grads = list[tuple[str, torch.Tensor | None, torch.Tensor | None, torch.Tensor]]


def _differ(pairs: Grads, rank: int) -> str:
    """The first of (what, got, wanted, like) whose got differs from wanted (None: zeros like ``like``),
    relative to the largest wanted gradient, or ""."""
    pairs = [(w, torch.zeros_like(t) if g is None else g, torch.zeros_like(t) if r is None else r, t)
             for w, g, r, t in pairs]
    scale = max([1e-30, *(float(r.abs().max()) for _, _, r, _ in pairs if r.numel())])
    for what, g, r, _ in pairs:
        err = float((g.to(r.dtype) - r).abs().max()) if r.numel() else 0.0
        if err > _RTOL.get(r.dtype, 1e-2) * scale:
            return (f"on rank {rank} the gradient of {what} differs by up to {err:.3g} (largest gradient "
                    f"{scale:.3g}), in its first forward at this size")
    return ""


def _agree(why: str, group: dist.ProcessGroup | None) -> str:
    """The first rank's reason among the ranks of ``group`` that found one, on every rank ("" if none)."""
    if group is None:
        return why
    if not any_rank(bool(why), group):
        return ""
    every: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(every, why, group=group)
    return next(w for w in every if w)


def _dims(shape: Any) -> str:
    return "x".join(str(int(s)) for s in shape)
