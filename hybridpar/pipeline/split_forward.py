"""A forward torch.fx cannot trace, run on shards exactly: the model's own forward, at the top level or
as a block inside a traced graph, with its layers swapped for their split counterparts
(:func:`hybridpar.pipeline.swap.swap`) and every call between them met as
:mod:`hybridpar.planner.calls` says.

Why: the Python between the layers sees tensors, and on a rank those are shards. Left alone, ``x.shape``
would give the shard's extents (a branch on depth would go the other way on a shard), ``x.mean()`` the
shard's mean, and ``F.interpolate(x, size=skip.shape[2:])`` would resample each shard on its own. Here a
``TorchFunctionMode`` follows the split activations and their global extents (those of the input, of
each layer's output, of what calls make of them) and answers as the volume would:

* shape reads (``x.shape``, ``x.size(d)``, ``x.numel()``) give the volume's extents;
* a call that stands for a layer (``interpolate``, ``pad``, functional pools and convs) runs as that
  layer's split counterpart, the layer a traced graph would run;
* a reduction over the volume (``mean``, ``sum``, ``amax``, ``norm``) gives its global value on every rank,
  so that Python branching on it takes the same branch everywhere;
* elementwise calls, ``cat``/``stack`` and pieces along leading dims run on the shards, a replicated
  operand that spans the volume taken at the shard's box, and any replicated operand with a gradient
  entered through :func:`~hybridpar.comm.reduce.replicated_into_shards`, so its gradient is the sum
  of every shard's part (a parameter of the model, a squeeze-and-excitation gate);
* reshape chains given the volume's sizes (a pixel shuffle) run with the shard's.

The plan refuses, before any step, what none of these covers (``planner/layout_watch.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.comm.redistribute import gather
from hybridpar.comm.reduce import grad_split, max_to_replicated, replicated_into_shards, sum_to_replicated
from hybridpar.device.eager import eager
from hybridpar.geometry import shard_box
from hybridpar.grid import ProcessGrid
from hybridpar.nn import slicing
from hybridpar.nn.families import moves_per_forward
from hybridpar.nn.functions import SUMMED, WEIGHTED, weighted_args
from hybridpar.nn.layout import Gather
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.nn.value_flow import unfollowed
from hybridpar.pipeline.rebound_buffers import whole_buffers
from hybridpar.planner import calls
from hybridpar.planner.layout_watch import Extents, LayoutWatch
from hybridpar.planner.space_maps import form_of, form_shape, source_dims, step
from hybridpar.planner.swapped import leave_whole, leaves, unsafe_error
from hybridpar.planner.terms import SpecError

ToDist = Callable[[nn.Module, ProcessGrid], nn.Module]


class SplitForward(LayoutWatch):
    """The layouts of a forward followed on this rank's shards (see the module doc). ``whole``: per
    split layer, the module that computes as it does on the volume (its output extents come from a
    meta run of it); ``to_dist(module, grid)``: the split counterpart of a layer a call stands for."""

    def __init__(self, grid: ProcessGrid, whole: dict[nn.Module, nn.Module], to_dist: ToDist) -> None:
        super().__init__(grid.spatial_shape)
        self.grid, self.originals, self.to_dist = grid, whole, to_dist
        self.group = grid.spatial_group if grid.spatial_size > 1 else None
        self.input_extents: Extents = ()
        self._dist: dict[str, nn.Module] = {}  # a call's layer -> its split counterpart, built once
        self.replays = WeakIdKeyDictionary()  # a chain -> (its split source, its extents, the steps)
        self.following = False  # within the forward (not a recomputation torch.utils.checkpoint runs)

    def reset(self) -> None:
        super().reset()
        self.replays = WeakIdKeyDictionary()

    def bind(self, input_shape: Sequence[int]) -> None:
        """The global shape of the forward's input (at build, and whenever the engine runs another size)."""
        self.input_extents = tuple(input_shape[2:])

    # ------------------------------------------------------------------ geometry
    def box(self, extents: Extents) -> tuple[tuple[int, int], ...]:
        return shard_box(extents, self.grid.spatial_shape, self.grid.spatial_coord)

    def local(self, extents: Extents) -> Extents:
        return tuple(hi - lo for lo, hi in self.box(extents))

    def _fit(self, t: Any, extents: Extents | None) -> Any:
        """A replicated operand as a split computation on a volume of ``extents`` reads it: its dims that
        span the volume narrowed to this shard's box (``extents`` None: an operand that does not span
        it, a functional conv's weight), its gradient summed over the shards; a split layer's own
        parameter (``F.conv3d(h, self.conv.weight)``) keeps its partial gradient, which the engine's
        reduction sums over the shards as it sums the layer's."""
        if isinstance(t, list | tuple):
            return type(t)(self._fit(a, extents) for a in t)
        if not isinstance(t, torch.Tensor) or t in self.split:
            return t
        if t.requires_grad and grad_split(t) == 1:
            t = replicated_into_shards(t, self.group)
        if extents is None:
            return t
        for k, (lo, hi) in enumerate(self.box(extents)):
            d = t.dim() - 3 + k
            if d >= 0 and t.shape[d] == extents[k] and hi - lo != extents[k]:
                t = t.narrow(d, lo, hi - lo)
        return t

    def _fitted(self, args: tuple, kwargs: dict, extents: Extents) -> tuple[tuple, dict]:
        return tuple(self._fit(a, extents) for a in args), {k: self._fit(v, extents)
                                                             for k, v in kwargs.items()}

    def _run_replicated(self, func, args, kwargs) -> Any:
        """A call on whole values, the same on every rank: a split layer's own parameter read there
        (``h.mean((2, 3, 4)) * self.conv.bias``) gives every rank the whole of its gradient, of which
        each keeps its share, since the engine's reduction sums that parameter over the shards."""
        name = calls.name_of(func)
        if not torch.is_grad_enabled() or calls.in_place(name) or name in calls.SAFE \
                or calls.reads_shape(func):
            return func(*args, **kwargs)  # nothing differentiable made (in place, or a read)
        share = lambda t: _shared(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        each = lambda a: type(a)(map(share, a)) if isinstance(a, list | tuple) else share(a)  # noqa: E731
        return func(*map(each, args), **{k: each(v) for k, v in kwargs.items()})

    # ------------------------------------------------------------------ layers
    def before_layer(self, m: nn.Module, args: tuple) -> tuple | None:
        """A split layer runs on the volume its input is a shard of; a layer is given gathered what it
        reads whole (:meth:`read_whole`)."""
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:
            return None
        read = self.read_whole(m, args)
        if any(read):
            return tuple(self.whole(a) if r else a for a, r in zip(args, read, strict=True))
        if x not in self.split:
            return None
        if isinstance(m, SpatialLayer):
            m.global_input_shape = self.split[x]
        elif isinstance(m, Gather):
            m.shape = self.split[x]
        return None

    def whole(self, t: torch.Tensor) -> torch.Tensor:
        """The whole value of a split activation, or of one part way through reshapes (its source
        gathered, the steps replayed with the volume's sizes), on every rank of the split."""
        if t in self.split:
            return gather(t, self.grid, self.split[t])
        src, extents, replay = self.replays[t]
        w = gather(src, self.grid, extents)
        for func, rest, kwargs in replay:
            w = func(w, *rest, **kwargs)
        return w

    def wholes(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        pick = lambda a: self.whole(a) if isinstance(a, torch.Tensor) and a in self.chains else a  # noqa: E731
        args = tuple(type(a)(map(pick, a)) if isinstance(a, list | tuple) else pick(a) for a in args)
        return args, {k: pick(v) for k, v in kwargs.items()}

    def original(self, m: nn.Module) -> nn.Module:
        return self.originals.get(m, m)

    def layer_extents(self, m: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Extents:
        original = self.original(m)
        padding = getattr(m, "output_padding", None)  # a ConvTranspose3d's, set by the call's output_size
        if padding is not None and tuple(original.output_padding) != tuple(padding):
            original.output_padding = tuple(padding)  # the swapped copy's layer: the user's is left alone
        return self._out_extents(original, x.shape[:-3], self.split[x], x.dtype, name=(id(original), padding))

    # ------------------------------------------------------------------ calls, on shards
    def _run_shape(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is None or t not in self.split or not calls.reads_shape(func):
            return func(*args, **kwargs)
        return calls.answer_shape_read(func, args, kwargs, torch.Size((*t.shape[:-3], *self.split[t])))

    def _run_pointwise(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        extents = self.split[x]
        args, kwargs = self._fitted(args, kwargs, extents)
        out = func(*args, **kwargs)
        self.mark(out, extents)
        return out

    _run_keep = _run_join = _run_pieces = _run_pointwise

    def _write_back(self, target: torch.Tensor, whole: torch.Tensor) -> None:
        target.copy_(self._fit(whole, self.split[target]))

    def _run_assign(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        """``x[box] = value``: the shard's part of the box written (an empty part where it misses)."""
        extents = self.split[x]
        value = self._fit(args[2], None)  # a value with a gradient gets every shard's part of it
        return func(x, slicing.shard_index(args[1], extents, self.box(extents)), value, *args[3:], **kwargs)

    def _run_reduce(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        return reduce_over_volume(kind, x, self.split[x], self.group)

    def _run_hook(self, func, args: tuple, kwargs: dict) -> Any:
        """``h.register_hook(fn)``: ``fn`` given the volume's gradient, gathered on every rank of the
        split (each reaches the hook at the same place of the same backward), and its result's shard
        box handed back."""
        hook = args[1] if len(args) > 1 else kwargs["hook"]
        extents = self.split[args[0]]

        def whole_grad(grad: torch.Tensor) -> torch.Tensor | None:
            out = hook(gather(grad, self.grid, extents))
            return None if out is None else self._fit(out, extents)

        return func(args[0], whole_grad)

    def _run_module(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        m = kind.module
        key = calls.module_key(m)
        d = self._dist.get(key)
        if d is None:
            d = self._dist[key] = self.to_dist(m, self.grid)
            if isinstance(d, SpatialLayer):
                d.weights_agreed()  # it holds no weights of its own: a functional conv's come per call
        extents = self.split[x]
        if isinstance(d, SpatialLayer):
            d.global_input_shape = extents
        if func in WEIGHTED:
            given = weighted_args(func, args, kwargs)
            fit = _shared if func in SUMMED else lambda t: self._fit(t, None)
            state = {k: fit(given[k]) for k in ("weight", "bias") if given.get(k) is not None}
            out = torch.func.functional_call(d, state, (x,))
        else:
            out = d(x)
            out = out.view_as(out) if out is x else out  # a new tensor object: x keeps its extents
        if calls.name_of(func) == "__getitem__" and out._is_view():  # a box the forward may write
            out = out.clone()  # in place (h[:, :, a:b] += 2), which a view a Function made forbids
        if not _replicates(m):
            self.mark(out, self._out_extents(m, x.shape[:-3], extents, x.dtype, name=key))
        return out

    def _run_step(self, func, args: tuple, kwargs: dict, src: torch.Tensor) -> Any:
        """A reshape chain's step, its sizes given as the volume's, run with the shard's (the plan
        checked that every shard maps onto its own output shard)."""
        name = calls.name_of(func)
        if src in self.split:
            start, steps = (*src.shape[:-3], *self.split[src]), {}
            replay = (src, self.split[src], [])
        else:
            start, steps, _ = self.chains[src]
            replay = self.replays[src]
        replay = (*replay[:2], [*replay[2], (func, args[1:], kwargs)])
        before = steps[len(steps) - 1] if steps else source_dims(start)
        whole = _whole_shape(name, args, kwargs, before)
        dims = step(name, args[1:], kwargs, before, whole)
        steps = {**steps, len(steps): dims}
        if name in ("view", "reshape"):
            local = [hi - lo for lo, hi in self.box(start[2:])]
            out = func(args[0], form_shape(form_of(dims, start), start[0], local))  # the chain's samples
        else:
            out = func(*args, **kwargs)
        if self.closes(start, steps, whole):
            self.mark(out, whole[2:])
        else:
            self.chains[out] = (start, steps, whole)
            self.replays[out] = replay
        return out

    def _chain_shape(self, func, args, kwargs) -> Any:
        return calls.answer_shape_read(func, args, kwargs, torch.Size(self.chains[args[0]][2]))

    def global_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        if t in self.split:
            return (*t.shape[:-3], *self.split[t])
        return tuple(self.chains[t][2]) if t in self.chains else tuple(t.shape)


def _shared(t: torch.Tensor) -> torch.Tensor:
    """A weight given to a split layer that returns its gradient whole on every rank (a norm's): where
    the engine sums that weight over the shards (a split layer's own), each rank keeps its share."""
    return _ShareGrad.apply(t, grad_split(t)) if t.requires_grad and grad_split(t) > 1 else t


class _ShareGrad(torch.autograd.Function):
    """Identity forward; backward: this rank's share, ``1 / split``, of a gradient every rank of the
    split holds whole."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, split: int) -> torch.Tensor:
        ctx.split = split
        return t.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.split, None


def reduce_over_volume(kind: calls.CallKind, x: torch.Tensor, extents: Extents,
                       group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    """The reduction ``kind`` (over all of D, H, W) of the volume whose shard on this rank is ``x`` (the
    volume of global ``extents``, split over ``group``): its global value, replicated on every rank."""
    nd, dims, keep = x.dim(), kind.dims, kind.keepdim
    if kind.reduce in ("amax", "amin"):
        sign = 1 if kind.reduce == "amax" else -1
        local = (sign * x).amax(dim=dims, keepdim=True)
        ties = ((sign * x).detach() == local.detach()).sum(dim=dims, keepdim=True)
        if not keep:
            local, ties = local.squeeze(dims), ties.squeeze(dims)
        return sign * max_to_replicated(local, group, ties)
    if kind.reduce in ("any", "all"):  # all: no element false anywhere
        flip = kind.reduce == "all"
        found = (x.logical_not() if flip else x).any(dim=dims, keepdim=keep).to(torch.uint8)
        found = max_to_replicated(found, group).bool()
        return found.logical_not() if flip else found
    if kind.reduce == "norm":
        part = x.abs().pow(kind.ord).sum(dim=dims, keepdim=keep)
        return sum_to_replicated(part, group).pow(1 / kind.ord)
    if kind.reduce == "logsumexp":  # shifted by the volume's maximum, as torch shifts by its own
        top = max_to_replicated(x.detach().amax(dim=dims, keepdim=True), group)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        total = sum_to_replicated((x - top).exp().sum(dim=dims, keepdim=True), group)
        out = total.log() + top
        return out if keep else out.squeeze(dims)
    count = math.prod(extents[d - nd + 3] if d >= nd - 3 else x.shape[d] for d in dims)
    if kind.reduce in ("var", "std"):  # two passes, as torch computes it: the mean, then the squares
        mean = sum_to_replicated(x.sum(dim=dims, keepdim=True), group) / count
        mean = replicated_into_shards(mean, group)  # every shard's part of its gradient, summed
        squares = sum_to_replicated((x - mean).square().sum(dim=dims, keepdim=keep), group)
        var = squares / max(count - kind.correction, 0)
        return var.sqrt() if kind.reduce == "std" else var
    total = sum_to_replicated(x.sum(dim=dims, keepdim=keep), group)
    return total / count if kind.reduce == "mean" else total


def _whole_shape(name: str, args: tuple, kwargs: dict, dims: Any) -> tuple[int, ...]:
    """The shape a step makes of the volume's value (its atoms ``dims``): a view's sizes, -1 resolved."""
    sizes = [math.prod(a[2] for a in d) for d in dims]
    if name in ("view", "reshape"):
        shape = list(args[1:] if len(args) > 1 else kwargs.get("shape", ()))
        shape = list(shape[0]) if len(shape) == 1 and isinstance(shape[0], list | tuple) else shape
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(sizes) // known
        return tuple(shape)
    if name == "flatten":
        a = kwargs.get("start_dim", args[1] if len(args) > 1 else 0) % len(sizes)
        b = kwargs.get("end_dim", args[2] if len(args) > 2 else -1) % len(sizes)
        return (*sizes[:a], math.prod(sizes[a:b + 1]), *sizes[b + 1:])
    if name == "permute":
        order = kwargs.get("dims", args[1:])
        order = order[0] if len(order) == 1 and isinstance(order[0], list | tuple) else order
        return tuple(sizes[d % len(sizes)] for d in order)
    if name in ("transpose", "swapaxes"):
        a, b = (d % len(sizes) for d in args[1:3])
        sizes[a], sizes[b] = sizes[b], sizes[a]
    return tuple(sizes)


def _replicates(m: nn.Module) -> bool:
    from hybridpar.nn import registry

    entry = registry.lookup(m)
    return entry is not None and entry.replicated_output(m)


def follow(swapped: nn.Module, grid: ProcessGrid, whole: dict[nn.Module, nn.Module], to_dist: ToDist,
           input_shape: Sequence[int]) -> SplitForward:
    """Run ``swapped`` (:func:`~hybridpar.pipeline.swap.swap`'s) split under ``grid`` with its forward's
    calls followed (see the module doc), its input a shard of a volume of global ``input_shape``
    (:meth:`SplitForward.bind` changes it). Returns the mode, kept as ``swapped._hybridpar_block``."""
    mode = SplitForward(grid, whole, to_dist)
    mode.bind(input_shape)
    mode.hook([m for _, m in leaves(swapped)])
    for d, original in whole.items():
        _whole_on_replicated(mode, d, original)
    inner = swapped.forward

    @eager  # the mode's layouts live in Python state a compiled graph would not consult again
    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        mode.reset()
        mode.mark(x, mode.input_extents)
        mode.following = True
        try:
            with mode:
                out = inner(x, *args, **kwargs)
            whole_buffers(swapped, mode)
            if mode.unsafe:  # a path the plan's run did not take (a branch on the mode): never run unsplit
                raise unsafe_error(swapped, mode)
            if mode.sound.left:  # a check on values that the plan took to come out as in a sound run
                raise SpecError(f"model ({type(swapped).__name__}): its forward left the path it was planned "
                                f"on: {'; '.join(mode.sound.left)}")
            # a value returned part way through reshapes (torch.flatten(h, 1)) leaves whole, and every
            # split one where they are not alike (leave_whole: the plan's rule)
            shapes = [mode.global_shape(t) if isinstance(t, torch.Tensor) and t in mode.split else None
                      for t in tree_leaves(out)]
            whole = leave_whole(shapes)
            return tree_map(lambda t: mode.whole(t) if isinstance(t, torch.Tensor) and (
                t in mode.chains or (whole and t in mode.split)) else t, out)
        finally:
            mode.following = False
            mode.reset()

    swapped.forward = forward  # an attribute of this copy only: its class and state dict keys unchanged
    swapped._hybridpar_block = mode
    return mode


def _whole_on_replicated(mode: SplitForward, d: nn.Module, original: nn.Module) -> None:
    """Make the split layer ``d`` compute as ``original`` (the layer it stands for) when it is given a
    value that is not split: a layer called on the volume and again on a pooled or gathered value (a
    decoder block reused by a VAE branch, a squeeze-and-excitation gate in a block), which on that
    value must not exchange halos nor count its shards. Every rank computes the whole of that call's
    gradient, each keeping its share where the engine sums the layer's parameters over the shards
    (:func:`_shared`). A recomputation by ``torch.utils.checkpoint`` (on shards, unfollowed) runs split
    (the plan refuses such a layer on a value not split there)."""
    if not isinstance(d, SpatialLayer) and all(grad_split(p) == 1 for p in d.parameters()):
        return  # a copy that computes as its original on any value (a dense head)
    split_forward = d.forward
    own = dict(d.named_modules())  # the original is out of the model: it runs in the copy's mode
    twins = [(sub, own.get(name, d)) for name, sub in original.named_modules()]
    owner = {name: original.get_submodule(name.rpartition(".")[0]) for name, _ in original.named_buffers()}

    def forward(*args: Any, **kwargs: Any) -> Any:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if not mode.following or x is None or x in mode.split or x in mode.chains:
            return split_forward(*args, **kwargs)
        for sub, twin in twins:
            sub.training = twin.training
        state = {name: _shared(p) for name, p in original.named_parameters()}
        # buffers as copies, written back in training where the call wrote them (the copy's version, or a
        # torch norm's uncounted statistics): one only read (saved by a split call) is not; no host read
        copies = {name: b.detach().clone() for name, b in original.named_buffers()}
        with unfollowed(d):
            out = torch.func.functional_call(original, {**state, **copies}, args, kwargs)
        with torch.no_grad():
            for name, b in original.named_buffers() if any(m.training for m in original.modules()) else ():
                if copies[name]._version or moves_per_forward(owner[name]):
                    b.copy_(copies[name])
        return out

    d.forward = forward  # this copy's own: its class and state dict keys unchanged


def bind_nested(m: nn.Module, input_shape: Sequence[int]) -> bool:
    """Give a forward made by :func:`follow` the global ``input_shape`` it now runs on; False for any
    other module."""
    mode = getattr(m, "_hybridpar_block", None)
    if mode is None:
        return False
    mode.bind(input_shape)
    return True
