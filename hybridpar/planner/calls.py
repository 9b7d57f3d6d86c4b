"""What a call made outside any layer does to a split activation: the one table that a forward run by
module swapping is planned by (:class:`hybridpar.planner.layout_watch.LayoutWatch`, on the global volume)
and run by (:class:`hybridpar.pipeline.split_forward.SplitForward`, on shards).

Why one table: the plan decides before any step whether each call can run split, and the run then
does exactly what the plan accepted; two sets of rules would leave holes where a call is accepted by
one and computed otherwise by the other. The functions a traced graph may call are the registry's
(:func:`hybridpar.nn.registry.function_role`, :func:`~hybridpar.nn.registry.function_module`); this
module adds what only a forward outside a graph meets: reductions over the volume, joins and pieces
along channels, indexing, and reads of a tensor's values.

A split activation here is a tensor whose last three dims are a volume's D, H, W, split over the
grid (its leading dims, batch and channels, are whole on every rank).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hybridpar.nn import registry, slicing
from hybridpar.nn.functions import WEIGHTED, weighted_module
from hybridpar.planner.elementwise import elementwise, name_of
from hybridpar.planner.space_maps import STEPS


@dataclass(frozen=True)
class CallKind:
    """How one call meets its split inputs. ``kind``: ``shape`` (reads a shape, answered with global
    extents), ``step`` (a reshape chain's step, :mod:`hybridpar.planner.space_maps`), ``module`` (stands
    for a registered layer, ``F.interpolate``, run as its split counterpart), ``reduce`` (over the whole
    volume: the global value, replicated), ``keep`` (works along leading dims only: a channel mean),
    ``pointwise`` (elementwise, broadcasting), ``join`` (``cat``/``stack`` along a leading dim),
    ``pieces`` (``chunk``/``split``/``unbind`` along a leading dim), ``assign`` (``h[box] = v``: each
    shard its part of a box of the volume), ``value`` (reads values into Python: a shard's, not the
    volume's), ``refuse`` (gathered where it can be) or ``never`` (a derivative inside the forward)."""

    kind: str
    module: nn.Module | None = None  # ``module``: the layer the call stands for
    reduce: str = ""  # ``reduce``: sum, mean, amax, amin, norm, var, std, logsumexp, any or all
    dims: tuple[int, ...] = ()  # ``reduce``: the dims reduced; ``keep``: the dims worked along
    keepdim: bool = False
    ord: float = 2.0  # ``reduce`` ``norm``: its order
    correction: int = 1  # ``reduce`` ``var``, ``std``: Bessel's correction
    why: str = ""  # ``refuse``: what would be needed


SHAPE_READS = ("size", "numel", "nelement", "__len__")
DERIVATIVES = (torch.autograd.grad, torch.autograd.backward)  # taken inside a forward (a potential's)
LAYOUT_READS = ("stride", "storage_offset")
"""Reads of a tensor's memory layout: the gathered volume's are one process's where it is contiguous."""
VALUE_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "__array__")
SAFE = ("dim", "ndimension", "is_contiguous", "is_floating_point", "is_complex", "element_size",
        "requires_grad_", "retain_grad", "register_hook", "data_ptr", "get_device", "__format__",
        "__repr__", "__hash__",
        # attributes the same on every shard (``torch.zeros(..., dtype=x.dtype, device=x.device)``)
        "dtype", "device", "ndim", "requires_grad", "is_cuda", "is_leaf", "layout", "is_sparse",
        "is_quantized", "is_meta", "is_nested", "grad_fn", "names",
        # a tensor made from sizes (global ones, read from the volume): replicated, narrowed to the shard
        # where it meets one; of one value at a split activation's extents, made split (planner/fills.py)
        "new_zeros", "new_ones", "new_full", "new_empty")
LIKE_OF = ("to", "type_as")
"""Calls whose other tensor lends only its dtype and device: the result is laid out as ``self``."""
FROM_DATA = ("new_tensor",)
"""Calls whose tensor lends only its dtype and device to values given as data (``h.new_tensor(sizes)``)."""


def tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments (lists of them too: ``torch.cat``)."""
    given = [*args, *kwargs.values()]
    flat = [*given, *(a for v in given if isinstance(v, list | tuple) for a in v)]
    return [a for a in flat if isinstance(a, torch.Tensor)]


def carriers_of(func: Any, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Of a call's ``tensors``, those whose samples its result holds: ``p.to(x)`` holds ``p``'s, and
    ``h.new_tensor(data)`` none of ``h``'s."""
    name = name_of(func)
    return tensors[:1] if name in LIKE_OF else [] if name in FROM_DATA else tensors


# Along which dims (``None``: all): how each reduction names them.
REDUCTIONS = {"sum": ("dim", 1), "mean": ("dim", 1), "amax": ("dim", 1), "amin": ("dim", 1),
              "max": (None, 1), "min": (None, 1), "norm": ("dim", 2), "linalg_vector_norm": ("dim", 2),
              "var": ("dim", 1), "std": ("dim", 1), "any": ("dim", 1), "all": ("dim", 1)}
JOINS = ("cat", "concat", "concatenate", "stack")
PIECES = ("chunk", "split", "tensor_split", "unbind")
KEEP = ("softmax", "log_softmax", "normalize", "cumsum", "cumprod", "argmax", "argmin", "logsumexp", "glu",
        "narrow", "select")
"""Along one dim, given: kept split where it is a leading dim."""


def reads_shape(func: Any) -> bool:
    """``x.shape`` (the property's getter), ``x.size()``, ``x.numel()``, ``len(x)`` (``len(h[0, 0])``: the
    depth, where it is split): answered with global extents."""
    return getattr(func, "__self__", None) is torch.Tensor.shape or name_of(func) in SHAPE_READS


def answer_shape_read(func: Any, args: tuple, kwargs: dict, whole: torch.Size) -> Any:
    """What a shape read (:func:`reads_shape`; in a traced graph ``x.nbytes`` too) gives of a value of
    shape ``whole`` (the volume's, where a run holds a shard of it). ``func`` is the call or its name."""
    if name_of(func) in ("numel", "nelement"):
        return math.prod(whole)
    if name_of(func) == "nbytes":
        return math.prod(whole) * args[0].element_size()
    if name_of(func) == "__len__":
        return whole[0]
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    return whole if dim is None else whole[dim]


ALIASES = {"axis": "dim", "keepdims": "keepdim"}
"""NumPy's names torch accepts for an argument (``torch.cat(ts, axis=1)``, ``x.sum(axis=2)``)."""


def canonical(kwargs: dict) -> dict:
    """``kwargs`` with NumPy's argument names (:data:`ALIASES`) as torch's own, so that one lookup finds
    a dim however it was given; the call then runs with them (torch takes either)."""
    if not any(k in ALIASES for k in kwargs):
        return kwargs
    return {ALIASES.get(k, k): v for k, v in kwargs.items()}


IN_PLACE_DUNDERS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__")


def in_place(name: str) -> bool:
    """Whether the call named ``name`` writes its first argument (``add_``, ``x[...] = v``, ``x += v``)."""
    return (name.endswith("_") and not name.endswith("__")) or name in IN_PLACE_DUNDERS


def module_key(m: nn.Module) -> str:
    """What tells apart the layers calls stand for: the type and every public setting, not only its
    ``repr`` (an ``nn.Upsample``'s omits ``align_corners``, an ``nn.AvgPool3d``'s ``count_include_pad``),
    so that two calls that differ only there never share a split counterpart."""
    public = sorted((k, repr(v)) for k, v in vars(m).items() if not k.startswith("_") and k != "training")
    return f"{m!r} {public}"


def _arg(args: tuple, kwargs: dict, pos: int, key: str, default: Any = None) -> Any:
    return kwargs[key] if key in kwargs else args[pos] if len(args) > pos else default


def _dims(dim: Any, nd: int) -> tuple[int, ...] | None:
    """``dim`` (an int, a sequence, None or ``()``: all) normalised against a tensor of ``nd`` dims."""
    if dim is None or (isinstance(dim, list | tuple) and not dim):
        return None
    dims = dim if isinstance(dim, list | tuple) else (dim,)
    if not all(isinstance(d, int) for d in dims):
        raise TypeError
    return tuple(sorted({d % nd for d in dims}))


def _reduction(name: str, args: tuple, kwargs: dict, nd: int) -> CallKind:
    key, pos = REDUCTIONS[name]
    dim = None if key is None else _arg(args, kwargs, pos, key)
    if name in ("max", "min") and len(args) + len(kwargs) > 1:
        dim = _arg(args, kwargs, 1, "dim")
        if isinstance(dim, int) and dim % nd < nd - 3:  # along channels: voxel by voxel, indices too
            return CallKind("keep")
        return CallKind("refuse", why=f"{name} along {dim!r}: a dim of the volume or another tensor; on a "
                                      f"shard its indices are the shard's (amax/amin over D, H, W run split)")
    if name in ("norm", "linalg_vector_norm"):
        p = _arg(args, kwargs, 1, "p" if name == "norm" else "ord", 2)
        p = 2 if p in ("fro", None) else p
        if not isinstance(p, int | float) or not 0 < p < float("inf"):
            return CallKind("refuse", why=f"{name} of order {p!r}: only finite positive orders")
        keep = bool(_arg(args, kwargs, 3, "keepdim", False))
        ord_ = float(p)
    elif name in ("var", "std"):  # (dim, unbiased, keepdim) or (dim, *, correction, keepdim)
        unbiased = args[2] if len(args) > 2 and isinstance(args[2], bool) else kwargs.get("unbiased", True)
        correction = kwargs.get("correction", 1 if unbiased else 0)
        keep = bool(kwargs.get("keepdim", args[3] if len(args) > 3 else False))
        if not isinstance(correction, int | float):
            return CallKind("refuse", why=f"{name} with correction {correction!r}")
        ord_ = float(correction)
    else:
        keep, ord_ = bool(_arg(args, kwargs, 2, "keepdim", False)), 2.0
    if name in ("sum", "mean") and _arg(args, kwargs, 3, "dtype") is not None:
        return CallKind("refuse", why=f"{name} with a dtype")
    try:
        dims = _dims(dim, nd)
    except TypeError:
        return CallKind("refuse", why=f"{name} along named dims")
    spatial = set(range(nd - 3, nd))
    if dims is None or spatial <= set(dims):
        same = {"max": "amax", "min": "amin", "linalg_vector_norm": "norm"}
        return CallKind("reduce", reduce=same.get(name, name),
                        dims=tuple(range(nd)) if dims is None else dims, keepdim=keep, ord=ord_,
                        correction=int(ord_) if name in ("var", "std") else 1)
    if spatial & set(dims):
        return CallKind("refuse", why=f"{name} over some of the volume's dims {list(dims)} but not all "
                                      f"(D, H, W are {sorted(spatial)}): reduce over all three, or none")
    return CallKind("keep", dims=dims, keepdim=keep)


def _along(name: str, dim: Any, nd: int) -> CallKind:
    """A join or pieces along ``dim`` of tensors of ``nd`` dims (a stack makes one more)."""
    if not isinstance(dim, int):
        return CallKind("refuse", why=f"{name} along {dim!r}")
    d = dim % (nd + 1 if name == "stack" else nd)
    if d < nd - 3 or (name == "stack" and d <= nd - 3):
        # the dim it works along (a stack makes a new one: it mixes no samples)
        return CallKind("join" if name in JOINS else "pieces", dims=() if name == "stack" else (d,))
    return CallKind("refuse", why=f"{name} along dim {dim}, a split dim of the volume (the leading "
                                  f"{nd - 3} are whole on every rank)")


def _volume_dims(dim: Any, nd: int) -> bool:
    """Whether ``dim`` (as a reduction takes it) names every one of D, H, W of an ``nd``-dim tensor."""
    try:
        dims = _dims(dim, nd)
    except TypeError:
        return False
    return dims is not None and set(range(nd - 3, nd)) <= set(dims)


def index_keeps_space(index: Any, nd: int) -> bool:
    """Whether ``x[index]`` leaves the last three dims of an ``nd``-dim ``x`` whole (``x[:, :3]``, or one
    list of channels, ``x[:, [0, 2]]``: a single advanced index keeps its dim's place)."""
    items = list(index) if isinstance(index, tuple) else [index]
    advanced = [i for i in items if isinstance(i, torch.Tensor | list)]
    if any(i is None for i in items) or len(advanced) > 1 or any(
            isinstance(i, torch.Tensor) and (i.dtype == torch.bool or i.dim() != 1) for i in advanced):
        return False
    per_dim = slicing.per_dim_index(index, nd)
    return per_dim is not None and all(isinstance(i, slice) and i == slice(None) for i in per_dim[nd - 3:])


def indexes_batch(index: Any) -> bool:
    """Whether ``x[index]`` picks among dim 0's entries (``x[0]``, ``x[:1]``, ``x[[1, 0]]``) rather than
    keeping them all (``x[:, :3]``, ``x[..., ::2]`` is another matter: see :func:`index_keeps_space`)."""
    first = index[0] if isinstance(index, tuple) and index else index
    return not (first is Ellipsis or (isinstance(first, slice) and first == slice(None)))


def classify(func: Any, args: tuple, kwargs: dict, nd: int, extents: tuple[int, ...] | None = None
             ) -> CallKind:
    """How a call of ``func(*args, **kwargs)`` meets its split inputs, the first of ``nd`` dims; the
    arguments as the volume's forward gives them (sizes read from shapes are global), ``extents``
    the volume's (D, H, W) where known (an index's box is resolved against them)."""
    name = name_of(func).strip("_") if name_of(func) not in VALUE_READS else name_of(func)
    if func in DERIVATIVES:
        return CallKind("never", why="a derivative taken inside the forward, of values on shards, which "
                        "the split backward does not follow")
    if name_of(func) in LAYOUT_READS and args and isinstance(args[0], torch.Tensor):
        t = args[0]  # the volume's value, as one process lays it out in memory
        return CallKind("whole") if t.is_contiguous() and t.storage_offset() == 0 else CallKind(
            "never", why="the memory layout of a view of a split activation (one process's strides or "
                         "offset, which neither a shard nor the gathered volume has)")
    if reads_shape(func):
        return CallKind("shape")
    if name_of(func) in VALUE_READS:
        return CallKind("value")
    if name == "flatten" and _leading(name, args, kwargs, nd).kind == "keep":
        return CallKind("keep")
    if name in STEPS:
        return CallKind("step")
    try:
        module = registry.function_module(func, args, kwargs)
    except (TypeError, ValueError, NotImplementedError) as err:
        return CallKind("refuse", why=str(err))
    if module is not None:
        return CallKind("module", module=module)
    if func in WEIGHTED:
        return _functional_layer(func, args, kwargs)
    if name in REDUCTIONS:
        return _reduction(name, args, kwargs, nd)
    if name in JOINS:
        return _along(name, _arg(args, kwargs, 1, "dim", 0), nd)
    if name in PIECES:  # unbind(input, dim); chunk, split, tensor_split(input, what, dim)
        return _along(name, _arg(args, kwargs, 1 if name == "unbind" else 2, "dim", 0), nd)
    if name == "einsum":
        return _einsum(args, nd)
    if name == "setitem":
        return _assign(args, nd, extents)
    if name == "getitem":
        ok = index_keeps_space(args[1], nd)
        if not ok and nd == 5 and extents is not None and (box := slicing.box_of(args[1], extents)):
            return CallKind("module", module=box)  # a crop or a strided box: a window layer
        return CallKind("keep" if ok else "refuse", dims=(0,) if ok and indexes_batch(args[1]) else (),
                        why="" if ok else "indexing into the volume's dims other than by a box of slices "
                                          "(x[:, :, a:b, c:d, e:f], steps too) that keeps every sample")
    if name in ("repeat", "expand", "tile"):
        return _leading(name, args, kwargs, nd)
    if name == "logsumexp" and _volume_dims(_arg(args, kwargs, 1, "dim"), nd):
        return CallKind("reduce", reduce="logsumexp", dims=_dims(_arg(args, kwargs, 1, "dim"), nd),
                        keepdim=bool(_arg(args, kwargs, 2, "keepdim", False)))
    if name in KEEP:
        default = {"normalize": 1, "glu": -1}.get(name)
        dim = _arg(args, kwargs, 2 if name == "normalize" else 1, "dim", default)
        ok = isinstance(dim, int) and dim % nd < nd - 3
        return CallKind("keep", dims=(dim % nd,)) if ok else \
            CallKind("refuse", why=f"{name} along a dim of the volume")
    if name in ("unsqueeze", "squeeze", "flatten", "movedim"):
        return _leading(name, args, kwargs, nd)
    role = registry.function_role(func) or registry.function_role(name)
    if role == "concat":
        return _along("cat", _arg(args, kwargs, 1, "dim", 0), nd)
    if role == "pointwise" or elementwise(func):
        return CallKind("pointwise")
    if name_of(func) in SAFE or name in SAFE or role == "shape":
        return CallKind("shape")
    return CallKind("refuse")


def _einsum(args: tuple, nd: int) -> CallKind:
    """``torch.einsum`` voxel by voxel (``"ncdhw,oc->nodhw"``): the output and every operand of the split
    one's dims end in D, H, W's letters, which no other operand reads."""
    eq = args[0] if args and isinstance(args[0], str) else None
    operands = list(args[1]) if len(args) == 2 and isinstance(args[1], list | tuple) else list(args[1:])
    if eq is None or "->" not in eq or "." in eq:
        return CallKind("refuse", why="einsum without an explicit output (a->b) or with an ellipsis")
    terms, out = eq.replace(" ", "").split("->")
    space, terms = out[-3:], terms.split(",")
    ok = len(out) >= 3 and len(set(space)) == 3 and not set(out[:-3]) & set(space) and all(
        t.endswith(space) if getattr(o, "ndim", 0) == nd else not set(t) & set(space)
        for t, o in zip(terms, operands, strict=False))
    return CallKind("pointwise") if ok else CallKind(
        "refuse", why=f"einsum {eq!r} other than voxel by voxel (the output and every volume operand ending "
                      f"in D, H, W, no other operand reading them)")


def _assign(args: tuple, nd: int, extents: tuple[int, ...] | None) -> CallKind:
    """``h[index] = value`` on a split ``h``: along channels or the batch, on shards; into a box of slices
    (``h[:, :, :2] = 0``) a value of extent 1 along D, H, W, each shard writing its part of the box."""
    index, value = args[1], args[2] if len(args) > 2 else None
    if index_keeps_space(index, nd):
        return CallKind("keep", dims=(0,) if indexes_batch(index) else ())
    uniform = not isinstance(value, torch.Tensor) or all(s == 1 for s in value.shape[-3:])
    if nd == 5 and extents is not None and uniform and slicing.box_of(index, extents) is not None:
        return CallKind("assign")
    return CallKind("refuse", why="writing into the volume's dims other than a box of slices with a value "
                                  "the same at every voxel (h[:, :, :2] = 0)")


def _leading(name: str, args: tuple, kwargs: dict, nd: int) -> CallKind:
    """``unsqueeze``/``squeeze``/``flatten``/``movedim`` along leading dims only."""
    if name in ("repeat", "expand", "tile"):
        sizes = args[1:] if len(args) > 1 else kwargs.get("size", kwargs.get("dims", ()))
        sizes = list(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], list | tuple) else list(sizes)
        keep = -1 if name == "expand" else 1
        ok = len(sizes) >= 3 and all(isinstance(v, int) and v in (keep, 1) for v in sizes[-3:])
        return CallKind("keep" if ok else "refuse", why="" if ok else f"{name} along a dim of the volume")
    if name == "unsqueeze":
        d = _arg(args, kwargs, 1, "dim")
        ok = isinstance(d, int) and (d % (nd + 1)) <= nd - 3
    elif name == "squeeze":
        d = _arg(args, kwargs, 1, "dim")
        ok = isinstance(d, int) and d % nd < nd - 3
    elif name == "flatten":
        a, b = _arg(args, kwargs, 1, "start_dim", 0), _arg(args, kwargs, 2, "end_dim", -1)
        ok = isinstance(a, int) and isinstance(b, int) and b % nd < nd - 3
    else:
        src, dst = _arg(args, kwargs, 1, "source"), _arg(args, kwargs, 2, "destination")
        ok = all(isinstance(v, int) and v % nd < nd - 3 for v in (src, dst))
    return CallKind("keep" if ok else "refuse", why="" if ok else f"{name} that moves a dim of the volume")


def _functional_layer(func: Any, args: tuple, kwargs: dict) -> CallKind:
    """``F.conv3d(x, weight, bias, ...)``, ``F.group_norm(x, groups, weight, bias)``: the layer of that
    weight's shape, run split with the call's own weight and bias (see :func:`weighted_module`)."""
    try:
        return CallKind("module", module=weighted_module(func, args, kwargs))
    except (TypeError, ValueError) as err:
        return CallKind("refuse", why=str(err))


ROLES = {"shape": "reads the volume's extents", "step": "reshapes shard by shard",
         "module": "runs as its split layer", "keep": "works along channels or batch, on shards",
         "pointwise": "elementwise, on shards", "join": "joins along channels or batch, on shards",
         "pieces": "cuts along channels or batch, on shards", "value": "reads values (refused)",
         "assign": "writes each shard's part of a box", "whole": "computed on the gathered volume",
         "hook": "given the gathered gradient",
         "refuse": "refused", "never": "refused"}
"""What each kind of call does to a split activation, as ``explain`` says it."""


def role_of(func: Any, kind: CallKind) -> str:
    """One line of what a call does on split activations: its name, and its kind's role (a reduction's
    all-reduce, the layer a call stands for)."""
    name = name_of(func)
    if kind.kind == "reduce":
        return f"{name}: {kind.reduce} over D, H, W, the volume's value on every rank (all-reduce)"
    if kind.kind == "module" and kind.module is not None:
        return f"{name}: {ROLES['module']} ({type(kind.module).__name__})"
    return f"{name}: {ROLES[kind.kind]}"


def describe(func: Any, kind: CallKind) -> str:
    """The call's name and why it cannot run split, for a refusal."""
    return f"{name_of(func)}: {kind.why}" if kind.why else name_of(func)


def in_checkpoint() -> bool:
    """Whether the user's forward runs the caller inside ``torch.utils.checkpoint``: its recomputation
    in the backward runs the same Python again without the engine's ``TorchFunctionMode``, on the bare
    shards. Frames are read up to the engine's own code that called the forward, so the engine's own
    recomputation (``pipeline.recompute``, which enters the mode again) is not the user's."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").startswith("hybridpar."):  # the modes' dispatch
        f = f.f_back
    while f is not None:
        module = f.f_globals.get("__name__", "")
        if module == "torch.utils.checkpoint":
            return True
        if module.startswith("hybridpar.") and f.f_code.co_name != "__torch_function__":  # not a mode's
            return False
        f = f.f_back
    return False


def refusal_of(func: Any, kind: CallKind, tensors: list[torch.Tensor],
               split: list[torch.Tensor]) -> str | None:
    """Why a call on split activations (``split`` of its ``tensors``) cannot run split, or None: a call
    classified ``refuse``; inside ``torch.utils.checkpoint``, any call the bare shards would run
    otherwise than the engine (anything but work along leading dims or elementwise on split operands
    only: the engine cuts a whole operand to the shard's box and answers shape reads with the
    volume's extents, a recomputation would do neither)."""
    if kind.kind in ("refuse", "never"):
        return describe(func, kind)
    alike = kind.kind in ("keep", "join", "pieces") or (
        kind.kind == "pointwise" and len(split) == len(tensors)) or (
        kind.kind == "shape" and name_of(func) not in ("shape", *SHAPE_READS))  # .device
    if not alike and in_checkpoint():
        return (f"{name_of(func)} inside torch.utils.checkpoint, whose recomputation in the backward runs "
                f"on the bare shards (checkpoint layers only, or use pipeline.recompute)")
    return None


def volume_reduction(func: Any, args: tuple, kwargs: dict, nd: int) -> CallKind | None:
    """The reduction a call makes over the whole volume of an ``nd``-dim split input, per sample (its
    dims hold D, H, W and not the batch, which data parallelism may split), or None: what a traced
    graph runs split (:func:`hybridpar.pipeline.split_forward.reduce_over_volume`) rather than gathered."""
    if nd != 5 or name_of(func).strip("_") not in REDUCTIONS:
        return None
    kind = _reduction(name_of(func).strip("_"), args, kwargs, nd)
    return kind if kind.kind == "reduce" and 0 not in kind.dims else None
