"""Whether a call or a torch layer keeps the samples of a batch apart: the one rule both planners read,
for every value that carries the batch (a volume, a volume's mean per sample and channel, a head's
features) where data parallelism or micro-batches hold it in parts.

Why: data parallelism and micro-batches hold the batch in parts, so a call that works across dim 0
(``g[:1]``, ``g.mean(0)``, ``g.sum()``, ``torch.cat([b, a])`` of two halves, ``g.flip(0)``) computes on
each part what one process computes on the whole batch: a different answer, silently. A forward run by
module swapping asks :mod:`hybridpar.planner.calls` first for a call on a split activation; the traced
graph asks this module of every call, and :mod:`hybridpar.nn.samples` of every torch layer. Per-sample
work (elementwise, along other dims, a layer or a matrix product applied to each sample) passes;
anything it cannot tell is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from hybridpar.nn import registry
from hybridpar.planner import calls
from hybridpar.planner.elementwise import elementwise

# Calls along given dims: the argument (position after the tensor, keyword) that names them, and what
# its absence means (None: the whole tensor, flattened; an int: that dim).
_ALONG: dict[str, tuple[int, str, int | None]] = {
    **{name: (1, "dim", None) for name in (
        "prod", "all", "any", "count_nonzero", "nansum", "nanmean", "median", "nanmedian", "var_mean",
        "std_mean", "argmax", "argmin", "logsumexp", "aminmax")},
    **{name: (pos, key or "dim", None) for name, (key, pos) in calls.REDUCTIONS.items()},
    **{name: (1, "dim", 0) for name in (*calls.JOINS, *calls.PIECES)},
    **{name: (1, "dim", -1) for name in ("softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin",
                                         "logcumsumexp", "sort", "argsort", "glu", "narrow", "select",
                                         "unflatten", "mode")},
    "diff": (2, "dim", -1),
    "normalize": (2, "dim", 1), "topk": (2, "dim", -1), "kthvalue": (2, "dim", -1),
    "quantile": (2, "dim", None), "nanquantile": (2, "dim", None), "roll": (2, "dims", None),
    "flip": (1, "dims", None), "chunk": (2, "dim", 0), "split": (2, "dim", 0), "tensor_split": (2, "dim", 0),
    "transpose": (1, "dim0", None), "swapaxes": (1, "axis0", None), "movedim": (1, "source", None),
    "unfold": (1, "dimension", None), "index_select": (1, "dim", None), "repeat_interleave": (2, "dim", None),
    "gather": (1, "dim", None), "take_along_dim": (2, "dim", None), "rot90": (2, "dims", (0, 1)),
    "cosine_similarity": (2, "dim", 1), "gradient": (-1, "dim", None),
    **{name: (1, "dim", None) for name in (
        "scatter", "scatter_add", "scatter_reduce", "index_add", "index_copy", "index_fill", "fft_fftshift",
        "fft_ifftshift")},
    **{name: (2, "dim", -1) for name in (
        "fft_fft", "fft_ifft", "fft_rfft", "fft_irfft", "fft_hfft", "fft_ihfft")},
    **{name: (2, "dim", None) for name in ("fft_fftn", "fft_ifftn", "fft_rfftn", "fft_irfftn")},
    **{name: (2, "dim", (-2, -1)) for name in ("fft_fft2", "fft_ifft2", "fft_rfft2", "fft_irfft2",
                                               "linalg_matrix_norm")},
    "linalg_norm": (2, "dim", None),
    **{name: (-1, "dim", -1) for name in ("trapezoid", "cumulative_trapezoid")},  # dim= by keyword only
}
_LAST_TWO = ("triu", "tril",  # along the last two dims: the matrices of a batch of them
             *(f"linalg_{n}" for n in ("pinv", "inv", "det", "slogdet", "matrix_exp", "svdvals", "eigvalsh",
                                       "cholesky", "matrix_rank")),
             "inverse", "pinverse", "det", "logdet", "slogdet", "matrix_exp")
_PER_SAMPLE = ("one_hot", "local_response_norm", "grid_sample", "affine_grid",  # a sample's own values: a
               # trailing class dim, channels, a sample's grid of its own (affine_grid: its theta's),
               *(f"{kind}max_pool{n}d_with_indices" for kind in ("", "adaptive_") for n in (1, 2, 3)),
               *(f"max_unpool{n}d" for n in (1, 2, 3)))  # each plane's own maxima and their places
_POOLS = tuple(f"{kind}_pool{n}d" for kind in ("max", "avg", "lp", "adaptive_avg", "adaptive_max")
               for n in (1, 2, 3))
"""Pools over the last dims of each channel apart (of each sample, where dim 0 holds the batch)."""
_CONVS = {f"{kind}{n}d": n for kind in ("conv", "conv_transpose") for n in (1, 2, 3)}
"""Convolutions over their last n dims, which mix dim 1 of an input of n + 2 dims (the channels of each
sample apart) but dim 0 of one of n + 1 (the channels of one sample, unbatched)."""
_INDEXED = {"gather": (2, "index"), "take_along_dim": (1, "indices"), "scatter": (2, "index"),
            "scatter_add": (2, "index"), "scatter_reduce": (2, "index")}
"""Calls along a dim that read an index tensor as wide as their input along every other dim: the samples
stay apart where the index has as many as the input (one with fewer would pick the first samples)."""
_ALONG_ANY = {*_ALONG, *_LAST_TWO, "diagonal"}
_PAIRS = {"transpose": (2, "dim1"), "swapaxes": (2, "axis1"), "movedim": (2, "destination")}
_RESHAPES = ("view", "reshape", "flatten", "squeeze", "unsqueeze", "contiguous", "expand", "repeat", "tile",
             "view_as", "reshape_as", "expand_as", "clone", "detach", "permute")
_IN_ORDER = ("view", "reshape", "flatten", "view_as", "reshape_as")
"""Reshapes that keep the elements in row-major order (unlike ``repeat`` or ``tile``, which copy the
batch whole after itself): see :func:`moves_samples`."""
_PRODUCTS = ("matmul", "mm", "__matmul__", "bmm", "linear")


def _along(name: str, args: tuple, kwargs: dict, nd: int) -> set[int] | None:
    """The dims of an ``nd``-dim input a call along given dims (``name`` in :data:`_ALONG`,
    :data:`_LAST_TWO` or ``diagonal``) works along, or None where not given as numbers (or all)."""
    if name in _LAST_TWO:
        return {nd - 2, nd - 1} if nd >= 2 else None
    if name == "diagonal":
        return _dims([calls._arg(args, kwargs, 2, "dim1", 0), calls._arg(args, kwargs, 3, "dim2", 1)], nd)
    pos, key, default = _ALONG[name]
    arg = kwargs.get(key, default) if pos < 0 else calls._arg(args, kwargs, pos, key, default)
    dims = _dims(arg, nd + 1 if name == "stack" else nd)
    if name in _PAIRS:
        other = _dims(calls._arg(args, kwargs, *_PAIRS[name]), nd)
        dims = None if dims is None or other is None else dims | other
    return dims


def _dims(dim: Any, nd: int) -> set[int] | None:
    if dim is None:
        return None
    dims = dim if isinstance(dim, list | tuple) else (dim,)
    return {d % nd for d in dims} if all(isinstance(d, int) for d in dims) else None


RANDOM = ("rand", "randn", "rand_like", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
          "normal", "multinomial", "poisson", "dropout", "alpha_dropout", "feature_alpha_dropout", "rrelu",
          "uniform_", "normal_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_",
          "random_")


DRAWN_PER_PART = ("dropout", "alpha_dropout", "feature_alpha_dropout", "dropout1d", "dropout2d", "dropout3d")
"""Random calls each part of a batch draws for its own samples, as DDP's replicas do: dropout masks, as the
dropout layers draw them."""


def draws(name: str) -> bool:
    """Whether the function called ``name`` draws random numbers: on a batch held in parts, each part
    would draw what the first samples draw on one process."""
    return name in RANDOM or name.strip("_") in RANDOM


def draws_alike(name: str) -> bool:
    """Whether the function called ``name`` draws random numbers that each part of a batch held in parts
    would draw alike, where one process draws them on: every draw but dropout's masks."""
    return draws(name) and name.strip("_") not in DRAWN_PER_PART


def draws_per_sample(name: str, shape: tuple[int, ...] | None, batch: int, sized: bool = False) -> bool:
    """Whether a call named ``name`` that gave a tensor of ``shape`` (None: no tensor) from no value
    carrying the batch drew random numbers for each of its ``batch`` samples (``torch.randn(h.shape)``,
    ``torch.rand(h.shape[0], 1, 1, 1, 1)`` for stochastic depth): dim 0 of the draw is the batch's size,
    or (``sized``) an extent read off a value holding the samples (the rows of a fold, n * d of them)."""
    return draws_alike(name) and bool(shape) and (sized or shape[0] == batch > 1)


TRANSPOSES = ("t", "T", "mT", "H", "mH", "adjoint", "transpose", "swapaxes", "swapdims", "movedim",
              "moveaxis", "permute")


def transposed(name: str, args: tuple, kwargs: dict, nd: int, at: int) -> int | None:
    """Where dim ``at`` of an ``nd``-dim input goes in a call that reorders dims (``name`` in
    :data:`TRANSPOSES`, as called: ``m.t()``, ``m.T``, ``torch.swapdims(m, 0, 1)``), or None where its
    dims are not given as numbers."""
    order = list(range(nd))
    if name in ("t", "T", "H") and nd <= 2 or name in ("T", "H"):
        order.reverse()
    elif name in ("mT", "mH", "adjoint"):
        order[-2:] = order[:-3:-1]
    elif name in ("transpose", "swapaxes", "swapdims"):
        first, second = ("axis0", "axis1") if name == "swapaxes" else ("dim0", "dim1")
        pair = [calls._arg(args, kwargs, 1, first), calls._arg(args, kwargs, 2, second)]
        if not all(isinstance(d, int) for d in pair):
            return None
        a, b = (d % nd for d in pair)
        order[a], order[b] = order[b], order[a]
    elif name in ("movedim", "moveaxis"):
        src, dst = calls._arg(args, kwargs, 1, "source"), calls._arg(args, kwargs, 2, "destination")
        src, dst = ([v] if isinstance(v, int) else list(v) if isinstance(v, list | tuple) else None
                    for v in (src, dst))
        if src is None or dst is None or not all(isinstance(d, int) for d in src + dst):
            return None
        rest = iter(d for d in range(nd) if d not in {v % nd for v in src})
        placed = {d % nd: v % nd for v, d in zip(src, dst, strict=True)}
        order = [placed[k] if k in placed else next(rest) for k in range(nd)]
    elif name == "permute":
        listed = len(args) == 2 and isinstance(args[1], list | tuple)
        given = kwargs.get("dims", args[1] if listed else args[1:])
        if len(given) != nd or not all(isinstance(d, int) for d in given):
            return None
        order = [d % nd for d in given]
    return order.index(at)


def moves_samples(name: str, args: tuple, kwargs: dict, nd: int, batch: int,
                  out_shape: tuple[int, ...] | None, samples: int | None = None) -> str | None:
    """What a reshape or a call along given dims (``name``, as called) does to dim 0 of an ``nd``-dim
    input whose ``batch`` rows along dim 0 each belong to one of the ``samples`` (default: one row
    each), from its arguments and its output's shape alone (what a traced graph knows of a node), or
    None if it keeps them apart or is not such a call.

    A reshape reads and writes in row-major order, where each sample's elements are one run: an output
    row never straddles two samples when the output's dim 0 is a multiple of their number (other dims
    folded into the samples' dim, ``h.permute(0, 2, 1, 3, 4).reshape(n * d, c, hh, w)``, and back).
    The rows a part makes of its own samples are then those one process makes of them, as long as the
    fold is sized with the part's extent (:func:`hybridpar.planner.batch_extent.fixed_batch` refuses a
    number there)."""
    if name in TRANSPOSES and name not in _PAIRS:
        return None if transposed(name, args, kwargs, nd, 0) == 0 else f"{name} (moves the samples' dim)"
    if name in _RESHAPES:
        lead = out_shape[0] if out_shape else None
        kept = lead == batch or name in _IN_ORDER and bool(lead) and lead % (samples or batch) == 0
        return None if kept else f"{name} (moves the samples' dim)"
    if name not in _ALONG_ANY or (name in ("max", "min") and len(args) > 1 and not isinstance(args[1], int)):
        return None  # torch.max(a, b): elementwise
    dims = _along(name, args, kwargs, nd)
    if dims is None or 0 in dims:
        return f"{name} ({'over' if name in calls.REDUCTIONS else 'along'} the samples' dim)"
    return None


def samples_to(name: str, args: tuple, kwargs: dict, nd: int, at: int, out_nd: int | None) -> int | str:
    """Where the samples land in the output of a call (``name``, as called) on an ``nd``-dim input that
    holds them along dim ``at`` (its output has ``out_nd`` dims; None: not one tensor), or why the call
    works across them. Followed: a new dim put before them (``torch.stack(feats, 0)`` and a mean over it,
    as MONAI's registration blocks do; ``unsqueeze(0)``), elementwise work (broadcasting aligns dims from
    the right) and calls along other dims; anything else is refused."""
    if out_nd is None or name in _PRODUCTS:
        return f"{name} (not known to keep the samples apart)"
    if name in TRANSPOSES:
        to = transposed(name, args, kwargs, nd, at)
        return f"{name} (of dims not given as numbers)" if to is None else to
    if name in ("contiguous", "clone", "detach", *_PER_SAMPLE) or elementwise(name):
        return at if name in _PER_SAMPLE else out_nd - (nd - at)
    if name == "unsqueeze" or name == "stack":
        pos, key = (1, "dim") if name == "unsqueeze" else _ALONG[name][:2]
        new = _dims(calls._arg(args, kwargs, pos, key, 0), nd + 1)
        return f"{name} (along a dim not given as a number)" if new is None else \
            at + 1 if min(new) <= at else at
    if name not in _ALONG_ANY or name in _RESHAPES or name in _INDEXED:  # an index's samples: not seen here
        return f"{name} (not known to keep the samples apart)"
    dims = _along(name, args, kwargs, nd)
    if dims is None or at in dims:
        return f"{name} ({'over' if name in calls.REDUCTIONS else 'along'} the samples' dim)"
    if out_nd == nd:  # along the dims, or reduced keeping them
        return at
    if out_nd == nd - len(dims) or name == "diagonal" and out_nd == nd - 1:  # its diagonal put last
        return at - sum(d < at for d in dims)
    return f"{name} (not known to keep the samples apart)"


def along_batch(func: Any) -> str:
    """Why ``func`` on a split volume, along its dim 0, is refused where the batch is held in parts."""
    name = calls.name_of(func)
    what = "over" if name.strip("_") in calls.REDUCTIONS else "across the samples of"
    return (f"{name} ({what} the batch, which data parallelism or micro-batches hold apart: work on each "
            f"sample, e.g. reduce over dim=(1, 2, 3, 4))")


def across(func: Any, args: tuple, kwargs: dict, carriers: list[torch.Tensor], out: Any,
           samples: int | None = None) -> str | None:
    """What ``func(*args, **kwargs)`` (which gave ``out``) does across the samples of ``carriers``, its
    tensors that carry the batch (at least one), or None if it works on each sample apart. The batch is
    held in parts by data parallelism or micro-batches. ``samples``: their number, where dim 0 of a
    carrier may hold each in several rows (a fold, :func:`moves_samples`), each row then judged as a
    sample: what keeps the rows apart keeps the samples apart."""
    name = calls.name_of(func).strip("_") if calls.name_of(func) not in calls.VALUE_READS else \
        calls.name_of(func)
    batched, others = carriers[0], len(carriers) - 1
    first = args[0] if args else kwargs.get("input")  # F.conv3d(input=x, weight=k): by keyword
    if calls.in_place(calls.name_of(func)) and not any(first is t for t in carriers):
        return f"{calls.name_of(func)} (writes per-sample values into a tensor the replicas share)"
    if calls.reads_shape(func) or {name, calls.name_of(func)} & {*calls.SAFE, *calls.FROM_DATA}:
        return None
    if name == "getitem":
        return None if not calls.indexes_batch(args[1]) else "indexing (picks among the samples)"
    if name == "stride":  # a contiguous tensor's strides are its sizes past dim 0's: alike on every part
        return None if batched.is_contiguous() else "stride (of a layout whose strides count the samples)"
    if name == "setitem" and first is batched:  # h[:, :, :2] = v, h[h > 0] = v: per sample, v alike
        index, value = args[1], args[2] if len(args) > 2 else None
        mask = isinstance(index, torch.Tensor) and index.dtype == torch.bool and index.shape == batched.shape
        ok = mask or not (isinstance(index, torch.Tensor) or calls.indexes_batch(index))
        ok = ok and (not isinstance(value, torch.Tensor) or value.dim() < batched.dim() or (
            not mask and value.shape[0] in (1, batched.shape[0])))
        return None if ok else "__setitem__ (writes across the samples)"
    if name in _INDEXED and (first is not batched or getattr(calls._arg(args, kwargs, *_INDEXED[name]),
                                                             "shape", (0,))[:1] != batched.shape[:1]):
        return f"{name} (with an index of other samples than its input's)"
    if name in _PER_SAMPLE or first is batched and not others and _windowed(name, args, kwargs,
                                                                             batched.dim()):
        return None
    if name == "scaled_dot_product_attention":  # within each sample: every dim but the last two is a batch's
        return None if all(t.dim() >= 3 for t in carriers) else \
            "scaled_dot_product_attention (a 2-d input attends across its rows, the samples)"
    if name in _RESHAPES or name in _ALONG_ANY or name in TRANSPOSES:
        n = batched.shape[0] if batched.dim() else 1
        return moves_samples(name, args, kwargs, max(batched.dim(), 1), n,
                             tuple(out.shape) if isinstance(out, torch.Tensor) else None, samples)
    if name in _PRODUCTS:  # x @ W; or q @ k of two alike that hold the samples along dim 0 (bmm's batch)
        operands = [a for a in args if isinstance(a, torch.Tensor)]
        paired = len(operands) == len(carriers) == 2 and all(
            t.dim() == batched.dim() >= 3 and t.shape[0] == batched.shape[0] for t in carriers)
        return None if first is batched and batched.dim() >= 2 and others == 0 or paired else \
            f"{name} (mixes samples: only a per-sample product, x @ W or q @ k of batches alike, keeps " \
            f"them apart)"
    if name == "batch_norm" and calls._arg(args, kwargs, 5, "training", False):
        return "batch_norm (statistics over the samples)"
    if name in ("layer_norm", "rms_norm"):  # over its last len(normalized_shape) dims
        return None if len(calls._arg(args, kwargs, 1, "normalized_shape", ())) < batched.dim() else \
            f"{name} (over the samples' dim)"
    if name in ("group_norm", "instance_norm"):
        return None
    if name == "einsum":
        return _einsum(args, carriers)
    if name == "tensordot":  # a's dims left uncontracted lead the output: dim 0 where it is not contracted
        dims = calls._arg(args, kwargs, 2, "dims", 2)
        nd = batched.dim()
        contracted = set(range(nd - dims, nd)) if isinstance(dims, int) else _dims(
            dims[0], nd) if isinstance(dims, list | tuple) and len(dims) == 2 else None
        return None if first is batched and not others and contracted is not None and 0 not in contracted \
            else "tensordot (contracts the samples' dim, or of operands that both carry them)"
    if name == "bucketize":  # each element against boundaries alike on every part
        return None if first is batched and not others else "bucketize (of boundaries per sample)"
    if name == "renorm":  # each slice along dim, normed over every other dim: per sample along dim 0 only
        dim = calls._arg(args, kwargs, 2, "dim")
        return None if first is batched and isinstance(dim, int) and dim % max(batched.dim(), 1) == 0 else \
            "renorm (norms each slice along its dim over the others, the samples' among them)"
    if registry.function_role(func) == "shape" or registry.function_role(name) == "shape" or \
            elementwise(func) or elementwise(name):
        return None
    if _module(func, args, kwargs) is not None:
        return None
    return f"{calls.name_of(func)} (not known to keep the samples apart)"


def _windowed(name: str, args: tuple, kwargs: dict, nd: int) -> bool:
    """Whether a pool, a convolution, a pad or a PReLU (``name``, as called) of an ``nd``-dim input that holds
    the samples along dim 0 works on each sample apart: a convolution of a batched input (else dim 0 is
    one sample's channels, which it mixes), a pad of fewer dims than the input's, a PReLU's weight along
    dim 1, any pool (each channel apart)."""
    if name in _CONVS:
        return nd == _CONVS[name] + 2
    if name in ("pad", "constant_pad_nd"):  # the last pair pads the first dim padded: dim 0's, by none
        pad = calls._arg(args, kwargs, 1, "pad", ())
        return isinstance(pad, list | tuple) and (len(pad) // 2 < nd or len(pad) // 2 == nd and
                                                  tuple(pad[-2:]) == (0, 0))
    return name in _POOLS or name == "prelu" and nd >= 2


def _einsum(args: tuple, carriers: list[torch.Tensor]) -> str | None:
    """``einsum`` keeps the samples apart where every operand that carries them names dim 0 with one
    letter that leads the output and that no other operand names (``"nc,c->nc"``, ``"nc,dc->nd"``)."""
    eq, ops = args[0], list(args[1] if len(args) == 2 and isinstance(args[1], list | tuple) else args[1:])
    ins, _, out = eq.replace(" ", "").partition("->") if isinstance(eq, str) else ("", "", "")
    terms = ins.split(",")
    carried = [any(op is t for t in carriers) for op in ops]
    if not out or "." in ins or len(terms) != len(ops) or not all(terms) or not any(carried):
        return "einsum (not known to keep the samples apart)"
    letters = {t[0] for t, c in zip(terms, carried, strict=True) if c}
    alone = all(next(iter(letters)) not in t for t, c in zip(terms, carried, strict=True) if not c)
    return None if len(letters) == 1 and out[0] in letters and alone else "einsum (mixes samples)"


def _module(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        return registry.function_module(func, args, kwargs)
    except (TypeError, ValueError, NotImplementedError):
        return None

