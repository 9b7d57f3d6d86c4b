"""Reshapes that move data between channels and space (a 3D pixel shuffle), run on each shard.

Why: sub-pixel upsampling writes (N, C·r³, D, H, W) -> (N, C, D·r, H·r, W·r) with ``view``, ``permute``
and ``reshape``, and each output voxel then comes from one input voxel of the same neighbourhood: a
rank holding a box of the input can compute the box of the output scaled by r, with no halo and no
gather. Which chains of reshapes are of that kind is pure index arithmetic on the traced global
shapes, done here; the planner (:mod:`hybridpar.planner.plan`) gives such a chain its input's split
and the graph runner (:mod:`hybridpar.pipeline.stage_graph`) runs it with the local shapes
:meth:`SpaceMap.local_shape` gives. Run by module swapping, the forward reshapes each shard by the
extents it reads from it; the plan's watch (:class:`hybridpar.planner.layout_watch.LayoutWatch`) follows
the same steps (:func:`step`, :func:`close`) to accept only what :meth:`SpaceMap.fits`.

The arithmetic: every dim of a value is a row-major list of *atoms*, ``(source, stride, size)``: the
digit of stride ``stride`` and ``size`` values in the index of input dim ``source`` (``"n"``, ``"c"``,
or a spatial axis 0-2). The input's dims are one atom each; a ``view`` regroups the atoms in order
(splitting one where a new dim ends inside it; a chain where that is impossible is not followed), a
``permute`` reorders dims. Where the output's dim 2 + k starts with the outermost atom of spatial
axis k, the input box [a, b) of axis k (a and b multiples of that atom's stride s) becomes the output
box [a / s · R, b / s · R), R = the output extent per outer digit; every other atom is a channel or an
inner digit, which a shard holds whole. An axis whose outermost atom lands elsewhere (a transpose of
two axes) can only run unsplit, and the batch must stay the batch. The plan uses a chain only where
every rank's box is the one the output's split assigns it (:meth:`SpaceMap.fits`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridpar.geometry import shard_range, shard_ranges
from hybridpar.planner.graph import ModelGraph, Node

Atom = tuple[str | int, int, int]  # (source dim: "n", "c" or spatial axis 0-2, stride, size)
Dims = tuple[tuple[Atom, ...], ...]

RESHAPES = ("view", "reshape", torch.reshape)
PERMUTES = ("permute", torch.permute, "transpose", torch.transpose, "swapaxes", torch.swapaxes)
IDENTITIES = ("contiguous",)


class NotLocal(Exception):
    """The chain mixes data of different shards (or is not a reshape chain this module follows)."""


def source_dims(shape: Sequence[int]) -> Dims:
    """A chain's input (N, C, D, H, W): one atom per dim (none for a dim of 1)."""
    names: list[str | int] = ["n", "c", 0, 1, 2]
    return tuple(((names[d], 1, s),) if s > 1 else () for d, s in enumerate(shape))


def _regroup(dims: Dims, target: Sequence[int]) -> Dims:
    """``dims`` viewed as ``target`` (row-major): atoms taken in order, one split where a dim ends in it."""
    queue = deque(a for d in dims for a in d)
    out = []
    for t in target:
        group, rem = [], t
        while rem > 1:
            if not queue:
                raise NotLocal
            src, stride, size = queue.popleft()
            if size <= rem and rem % size == 0:
                group.append((src, stride, size))
                rem //= size
            elif size > rem and size % rem == 0 and src != "n":  # outer digits here, the inner ones next
                inner = size // rem
                group.append((src, stride * inner, rem))
                queue.appendleft((src, stride, inner))
                rem = 1
            else:
                raise NotLocal
        out.append(tuple(group))
    if queue:
        raise NotLocal
    return tuple(out)


def _ints(args: Sequence[Any]) -> list[int]:
    flat = list(args[0]) if len(args) == 1 and isinstance(args[0], list | tuple) else list(args)
    if not all(isinstance(a, int) for a in flat):
        raise NotLocal
    return flat


STEPS = ("view", "reshape", "flatten", "permute", "transpose", "swapaxes", "contiguous")  # by name, as called


def step(name: str, rest: Sequence[Any], kwargs: dict, dims: Dims, out_shape: Sequence[int]) -> Dims:
    """The atoms after ``name`` (one of :data:`STEPS`) with arguments ``rest`` (after the tensor)
    turned ``dims`` into a value of ``out_shape``."""
    n = len(dims)
    if name in ("view", "reshape", "flatten"):
        return _regroup(dims, tuple(out_shape))
    if name == "permute":
        order = [d % n for d in _ints(kwargs.get("dims", rest))]
        if sorted(order) != list(range(n)):
            raise NotLocal
        return tuple(dims[d] for d in order)
    if name in ("transpose", "swapaxes"):
        a, b = (d % n for d in _ints(rest[:2]))
        out = list(dims)
        out[a], out[b] = out[b], out[a]
        return tuple(out)
    return dims


# Per dim of a value in a chain: (holds the batch, ((spatial axis, stride), ...) of the outermost
# digits it holds, the product of its other atoms): its size is the batch (if held) times each axis's
# extent / stride times the rest, on the whole volume and on a shard alike.
Form = tuple[tuple[bool, tuple[tuple[int, int], ...], int], ...]


def form_shape(form: Form, batch: int, extents: Sequence[int]) -> tuple[int, ...]:
    """The shape of a value of ``form`` for ``batch`` samples of a volume (or shard) of ``extents``."""
    return tuple((batch if b else 1) * math.prod(extents[k] // s for k, s in outers) * fixed
                 for b, outers, fixed in form)


def form_of(dims: Dims, in_shape: Sequence[int]) -> Form:
    """Dims ``dims`` of a chain from a volume of ``in_shape``, in terms that hold at any input size."""
    out = []
    for d in dims:
        batch, outers, fixed = False, [], 1
        for src, stride, n in d:
            if src == "n":
                batch = True
            elif isinstance(src, int) and stride * n == in_shape[2 + src]:  # the outermost digit
                outers.append((src, stride))
            else:
                fixed *= n
        out.append((batch, tuple(outers), fixed))
    return tuple(out)


@dataclass(frozen=True)
class SpaceMap:
    """A chain of reshapes from split volume ``source`` (global ``in_shape``) to a volume of global
    ``out_shape``, each shard staying on its rank (see the module doc). ``dims``: every node's output
    atoms; ``strides``: per axis, the input voxels per outermost digit (r for a pixel unshuffle, 1 for
    a shuffle), and ``aligns`` what every shard boundary of the input must be a multiple of."""

    source: str
    nodes: tuple[str, ...]
    dims: dict[str, Dims]
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    strides: tuple[int, int, int]
    aligns: tuple[int, int, int]

    def fits(self, split: tuple[int, int, int]) -> bool:
        """Whether under ``split`` every rank's output box is the one the output's split gives it."""
        for k, parts in enumerate(split):
            g, e, s = self.in_shape[2 + k], self.out_shape[2 + k], self.strides[k]
            per = e * s // g  # output voxels per outermost input digit
            for i in range(parts):
                a, b = shard_range(g, parts, i)
                if b <= a or a % self.aligns[k] or b % self.aligns[k]:
                    return False
                if shard_range(e, parts, i) != (a // s * per, b // s * per):
                    return False
        return True

    def form(self, node: str) -> Form:
        """Node ``node``'s output dims in terms that hold at any input size (see :data:`Form`)."""
        return form_of(self.dims[node], self.in_shape)

    def local_shape(self, node: str, batch: int, extents: Sequence[int]) -> tuple[int, ...]:
        """Node ``node``'s output shape on a rank holding ``extents`` (D, H, W) of the input volume."""
        return form_shape(self.form(node), batch, extents)

    def loaded_shape(self, node: str, batch: int, split: tuple[int, int, int]) -> tuple[int, ...]:
        """Node ``node``'s output shape on the most loaded rank (shard 0) under ``split``."""
        first = [shard_range(self.in_shape[2 + k], split[k], 0) for k in range(3)]
        return self.local_shape(node, batch, [hi - lo for lo, hi in first])


def _follow(graph: ModelGraph, values: dict[str, Any], chain: list[Node]) -> SpaceMap:
    """The map of ``chain`` (its first node reads a 5-D volume, its last returns one), or NotLocal."""
    source = next(i for i in chain[0].inputs if i not in graph.values)  # its one tensor input
    in_shape = tuple(values[source].shape)
    dims, all_dims = source_dims(in_shape), {}
    for node in chain:
        name = node.target if isinstance(node.target, str) else node.target.__name__
        dims = step(name, node.fx_node.args[1:], dict(node.fx_node.kwargs), dims, values[node.name].shape)
        all_dims[node.name] = dims
    return close(source, all_dims, in_shape, tuple(values[chain[-1].name].shape))


def close(source: str, all_dims: dict[str, Dims], in_shape: tuple[int, ...],
          out_shape: tuple[int, ...]) -> SpaceMap:
    """The map of a chain from ``source`` (``in_shape``) whose steps made ``all_dims`` (in order, the
    last of ``out_shape``), or NotLocal where the batch does not stay the batch."""
    dims = list(all_dims.values())[-1]
    if dims[0] != source_dims(in_shape)[0] or any(a[0] == "n" for d in dims[1:] for a in d):
        raise NotLocal  # the batch must stay the batch
    strides, aligns = [], []
    for k in range(3):
        g = in_shape[2 + k]
        lead = dims[2 + k][0] if dims[2 + k] else None
        # the outermost digit leading its own axis scales the box; anywhere else the axis is mixed
        # with others and runs whole (a stride of the whole extent: only one shard fits)
        outer = lead is not None and lead[0] == k and lead[1] * lead[2] == g
        strides.append(lead[1] if outer else g)
        seen = [a[1] for node_dims in all_dims.values() for d in node_dims for a in d
                if a[0] == k and a[1] * a[2] == g]
        aligns.append(math.lcm(*seen, strides[-1]))
    return SpaceMap(source, tuple(all_dims), all_dims, in_shape, out_shape, tuple(strides), tuple(aligns))


def find_space_maps(graph: ModelGraph, values: dict[str, Any]) -> dict[str, SpaceMap]:
    """Every chain of reshapes in ``graph`` that keeps shards local, by the name of each of its nodes."""
    readers: dict[str, list[str]] = {}
    for n in graph.nodes:
        for i in n.inputs:
            readers.setdefault(i, []).append(n.name)
    by_name = {n.name: n for n in graph.nodes}
    found: dict[str, SpaceMap] = {}

    def tensor_input(n: Node) -> str | None:
        tensors = [i for i in n.inputs if i not in graph.values]
        return tensors[0] if len(tensors) == 1 else None

    def reshaping(n: Node) -> bool:
        return (n.op in ("method", "function") and n.module is None and tensor_input(n) is not None
                and (n.target in RESHAPES or n.target in PERMUTES or n.target in IDENTITIES)
                and isinstance(values.get(n.name), torch.Tensor))

    for n in graph.nodes:
        if n.name in found or not reshaping(n) or values[tensor_input(n)].dim() != 5:
            continue
        chain = [n]
        while chain and values[chain[-1].name].dim() != 5:
            nxt = readers.get(chain[-1].name, [])
            chain = chain + [by_name[nxt[0]]] if len(nxt) == 1 and reshaping(by_name[nxt[0]]) else []
        if not chain or all(c.target in IDENTITIES for c in chain):
            continue
        try:
            space_map = _follow(graph, values, chain)
        except NotLocal:
            continue
        found.update({c.name: space_map for c in chain})
    return found


def on_shards(start: tuple[int, ...], dims: Any, split: tuple[int, int, int]) -> bool:
    """Whether every shard under ``split`` of a volume of shape ``start`` takes a reshape to ``dims`` (as a
    run makes it, its sizes taken at the shard's extents): the sizes the volume's are divided by, a pixel
    shuffle's factor, divide each shard's extents too (18 voxels split 9 | 9 do not unshuffle by 2)."""
    form = form_of(dims, start)
    for box in itertools.product(*(shard_ranges(e, p) for e, p in zip(start[2:], split, strict=True))):
        local = [hi - lo for lo, hi in box]
        if math.prod(form_shape(form, start[0], local)) != math.prod((*start[:2], *local)):
            return False
    return True
