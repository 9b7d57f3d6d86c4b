"""A user's split version of a layer (``to_dist`` registered for a layer of the user's own) checked on
its first forward against the layer it splits, with one verdict on every rank of the split.

Why: ``hp.nn.register(..., to_dist=)`` trusts the user's Dist class to give this rank's shard of what
the layer gives on the volume. A Dist class that runs the layer's own forward on each shard (a
resample that picks every other plane of its shard, not of the volume: on odd splits another plane
set) or that forgets ``with_halos`` gives an output of the right extents and other values, silently;
one whose output extents differ from the plan's makes the next layer's halo exchange fail on one rank
while the others wait. So its first forward is compared: the output's extents with this rank's box of
the layer's output on the volume (a run on the meta device), and, where one sample of its input is
small enough to gather (:data:`GATHER_LIMIT` elements), the values with the layer run on that sample
gathered whole; in training, also that its output depends on every parameter the layer's does (a weight
kept detached would get no gradient), and then its gradients on that sample, for one cotangent: a Dist
class whose forward is right can still train wrong (a sum over the shards done by hand with
``dist.all_reduce``, which autograd does not see, gives each shard its own part of the mean's
gradient). The ranks agree on each verdict before any raises.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hybridpar.comm.flags import any_rank
from hybridpar.comm.redistribute import gather
from hybridpar.comm.reduce import grad_split, sum_to_replicated
from hybridpar.device.eager import eager
from hybridpar.geometry import shard_box
from hybridpar.nn.buffer_state import same_values
from hybridpar.nn.meta import meta_state, unwatched
from hybridpar.nn.value_flow import check_uses, unfollowed
from hybridpar.planner.terms import SpecError

__all__ = ["GATHER_LIMIT", "watch_split_version"]

GATHER_LIMIT = 1 << 24
"""Elements of one sample of the layer's input up to which the values are checked (64 MiB in float32,
once); past it, the extents alone."""

_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4}  # any other dtype: 1e-2


def watch_split_version(d: nn.Module, original: nn.Module, what: str, replicated: bool = False) -> None:
    """Check ``d``'s first forward on a split input against ``original`` (the layer it stands for; its
    output whole on every rank where ``replicated``: a reduction over the volume). The check wraps
    ``d.forward`` on the instance, so a caller that later runs the layer whole on a value that is not
    split (module swapping's) calls around it."""
    inner = d.forward
    pending = [True]

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        out = inner(x, *args, **kwargs)
        if pending and isinstance(x, torch.Tensor) and x.dim() == 5 and isinstance(out, torch.Tensor):
            pending.clear()
            reached = _reached(out) if out.grad_fn is not None else None  # its parameters, in training
            with torch.no_grad():
                _check(d, original, what, inner, x, out, replicated, reached)
        return out

    d.forward = forward


@eager  # collectives and a copy of the layer, once: never part of a compiled graph
def _check(d: nn.Module, original: nn.Module, what: str, inner: Any, x: torch.Tensor, out: torch.Tensor,
           replicated: bool, reached: set[int] | None) -> None:
    grid = d.grid
    extents = tuple(d.global_shape(x))
    why = ""
    try:
        whole = tuple(_meta_out(original, x, extents).shape[1:])
        box = None if replicated else shard_box(whole[1:], grid.spatial_shape, grid.spatial_coord)
        local = whole if box is None else (whole[0], *(hi - lo for lo, hi in box))
        if reached is not None and (lost := _unused(d, original, x, extents, reached)):
            why = (f"its output does not depend on its parameter {lost[0]}, where the layer's does (a copy "
                   f"detached or kept from another call?): it would get no gradient")
        elif tuple(out.shape[1:]) != local:
            why = (f"its output on rank {grid.rank} is {_dims(out.shape[1:])} where the layer gives "
                   f"{_dims(local)}{'' if box is None else f' of its {_dims(whole[1:])}'} on the volume")
        elif x.shape[1] * math.prod(extents) <= GATHER_LIMIT:
            why = _values(d, original, x, out, extents, box)
    except Exception as err:  # noqa: BLE001 - the user's layer: agreed on below, then raised on every rank
        why = f"checking it failed: {type(err).__name__}: {err}"
    group = grid.spatial_group if grid.spatial_size > 1 else None
    said = _agree(why, group)
    if said:
        raise SpecError(f"{what}: its split version {type(d).__name__} (the registered to_dist) does not "
                        f"give the shards of the layer's output on the volume: {said}; its forward must give "
                        f"this rank's box of that output (halos from self.with_halos(x) for a window, a "
                        f"resample's planes counted from the volume's origin), or register the layer "
                        f"without to_dist")
    if reached is None or x.shape[1] * math.prod(extents) > GATHER_LIMIT:
        return
    check_uses(d)  # a parameter applied otherwise than said: named as such, not by its gradient's error
    try:
        why = _gradients(d, original, inner, x, extents, box)
    except Exception as err:  # noqa: BLE001
        why = f"checking its gradients failed: {type(err).__name__}: {err}"
    said = _agree(why, group)
    if said:
        raise SpecError(f"{what}: its split version {type(d).__name__} (the registered to_dist) does not "
                        f"give the layer's gradients on the volume: {said}; sum over the volume with "
                        f"self.volume_sum (differentiable), and say self.applied_whole(p) of a parameter "
                        f"applied to whole values (hybridpar.nn.SpatialLayer)")


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


def _unused(d: nn.Module, original: nn.Module, x: torch.Tensor, extents: tuple[int, ...],
            reached: set[int]) -> list[str]:
    """The names of the parameters ``d``'s output (its graph reached ``reached``) does not depend on
    while ``original``'s output on the volume does (run on the meta device, with gradients)."""
    own = {id(q) for q in d.parameters()}
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


def _values(d: nn.Module, original: nn.Module, x: torch.Tensor, out: torch.Tensor,
            extents: tuple[int, ...], box: tuple[tuple[int, int], ...] | None) -> str:
    """Why this rank's output differs from its box (None: all) of the layer's on the first sample
    gathered, or ""."""
    whole = gather(x[:1].detach(), d.grid, extents)
    layer = copy.deepcopy(original)  # its buffers (running statistics) left as they are
    with unwatched(layer), unfollowed(d), torch.random.fork_rng(devices=[]):
        want = layer(whole)
    if box is not None:
        want = want[(..., *(slice(lo, hi) for lo, hi in box))]
    got = out[:1].detach().to(want.dtype)
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if err > _RTOL.get(want.dtype, 1e-2) * scale:
        return (f"on rank {d.grid.rank} its values differ from the layer's on the volume by up to {err:.3g} "
                f"(largest value {scale:.3g}), on the first sample of its first forward")
    return ""


def _gradients(d: nn.Module, original: nn.Module, inner: Any, x: torch.Tensor, extents: tuple[int, ...],
               box: tuple[tuple[int, int], ...] | None) -> str:
    """Why the gradients of ``d`` on the first sample (this rank's shard) differ from ``original``'s on
    the sample gathered, for one cotangent drawn alike on every rank: the input's (this rank's box), and
    each parameter's (summed over the shards where it says each gives a part), or ""."""
    grid = d.grid
    mine = x[:1].detach().requires_grad_()
    flow = getattr(d, "_value_flow", None)  # the forward's own follower (nn/value_flow.py): mine is a shard
    if flow is not None:
        flow.shard[mine] = True
    buffers = [b.clone() for b in d.buffers()]
    with torch.enable_grad(), torch.random.fork_rng(devices=[]):
        out = inner(mine.clone())  # a forward that writes its input in place writes the clone
    with unfollowed(d):
        with torch.no_grad():  # a buffer the check's forward changed (a running statistic) set back
            for b, kept in zip(d.buffers(), buffers, strict=True):
                if not same_values(b, kept):  # one it only read may be saved for the backward: untouched
                    b.copy_(kept)
        layer = copy.deepcopy(original)  # its buffers (running statistics) left as they are
        names = [n for n, q in original.named_parameters()
                 if q.requires_grad and any(q is p for p in d.parameters())]
        ours = [original.get_parameter(n) for n in names]
        whole = gather(mine.detach(), grid, extents).requires_grad_()
        with unwatched(layer), torch.enable_grad(), torch.random.fork_rng(devices=[]):
            want = layer(whole)
        cot = torch.randn(want.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        cot = cot.to(want)
        mine_cot = cot if box is None else cot[(..., *(slice(lo, hi) for lo, hi in box))]
        got = torch.autograd.grad(out, [mine, *ours], mine_cot, allow_unused=True)
        ref = torch.autograd.grad(want, [whole, *(layer.get_parameter(n) for n in names)], cot,
                                  allow_unused=True)
        in_box = (..., *(slice(*r) for r in shard_box(extents, grid.spatial_shape, grid.spatial_coord)))
        pairs = [("its input", got[0], ref[0][in_box] if ref[0] is not None else None, mine)]
        for n, q, g, r in zip(names, ours, got[1:], ref[1:], strict=True):
            if g is not None and grad_split(q) > 1:
                g = sum_to_replicated(g, grid.spatial_group)
            pairs.append((f"its parameter {n}", g, r, q))
        return _differ(pairs, grid.rank)


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
                    f"{scale:.3g}), on the first sample of its first forward")
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
