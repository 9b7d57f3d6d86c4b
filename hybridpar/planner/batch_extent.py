"""The batch's extent read in a forward whose batch data parallelism or micro-batches hold in parts.

Why: each part reads its own extent (``x.shape[0]``, ``x.size(0)``, ``len(x)``, ``x.numel()``), which
is one process's only where it sizes a tensor along the batch (``h.view(x.size(0), -1)``,
``x.new_zeros(n, 4)``): every sample then gets what one process gives it. Read as a value
(``out / x.shape[0]``, ``torch.arange(len(x))``, ``torch.linspace(0, 1, n)``) it gives each sample
what its part's extent and place make of it, which no sample gets in one process: refused, naming the
call. Both planners ask :func:`misuse`: the traced one of the graph's nodes, a forward run by module
swapping of :class:`PartBatch` values, the extents its shape reads answer with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

SIZED_METHODS = ("view", "reshape", "expand", "repeat", "tile", "new_zeros", "new_ones", "new_empty",
                 "new_full")
"""Tensor methods whose arguments after the tensor are a shape or its factors (``new_full``: then its fill
value): a class token's ``expand(n, -1, -1)`` or ``repeat(n, 1, 1)``."""
SIZED_FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn")
"""Factories whose leading arguments are a shape (``full``: then its fill value)."""
SIZE_AT = {"new_full": 1, "full": 0, "affine_grid": 1}
"""Calls given a shape as one argument, at this place (``F.affine_grid(theta, list(h.shape))``)."""
SIZED = SIZED_METHODS + SIZED_FACTORIES + tuple(SIZE_AT)
"""Calls that may give dim 0 the batch's extent (:func:`sizes_batch`)."""
READS = ("shape", "size", "__len__", "numel", "nelement")
"""Reads of a tensor's extents: the batch's is dim 0's, or a factor of its number of elements."""


class PartBatch(int):
    """An extent that holds the batch's (a part's under data parallelism or micro-batches) to the power
    ``degree``, kept so through arithmetic (``n * 2``, ``1 / n``; ``x.numel() / x.size(0)``, of degree
    0, holds it no more), so that a use as a value is seen where it is made."""

    degree = 1

    def _keep(self, v: Any, degree: int) -> Any:
        if isinstance(v, bool) or not isinstance(v, int | float) or degree == 0:
            return v
        kept = PartBatch(v) if isinstance(v, int) else PartBatchFloat(v)
        kept.degree = degree
        return kept


class PartBatchFloat(float):
    """A :class:`PartBatch` divided (``1 / n``): still the batch's extent, as a value."""

    degree = 1
    _keep = PartBatch._keep


def combined(op: str, a: int, b: int, exponent: Any = None) -> int:
    """The degree in the batch's extent of ``op`` (``"mul"``, ``"truediv"``, ``"pow"``, ``"add"`` ...)
    of a left operand of degree ``a`` and a right one of degree ``b`` (0: a plain
    number): a product adds them, a quotient subtracts, a power multiplies; a sum keeps the one that
    is not 0 (1 where they differ otherwise: some use of the extent)."""
    if op == "mul":
        return a + b
    if op in ("truediv", "floordiv", "div"):
        return a - b
    if op == "pow":
        whole = isinstance(exponent, int) and not isinstance(exponent, bool)
        return a * exponent if whole else int(bool(a or b))
    return a if a == b or not b else b if not a else 1


def _arith(name: str) -> Callable[..., Any]:
    reflected = name.startswith("__r")

    def op(self: Any, *other: Any) -> Any:
        value = getattr(int if isinstance(self, int) else float, name)(self, *other)
        theirs = getattr(other[0], "degree", 0) if other else 0
        a, b = (theirs, self.degree) if reflected else (self.degree, theirs)
        base = name.removeprefix("__r").removeprefix("__").removesuffix("__")
        return self._keep(value, combined(base, a, b, other[0] if other and not reflected else None))
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__floordiv__",
              "__rfloordiv__", "__truediv__", "__rtruediv__", "__mod__", "__rmod__", "__pow__", "__rpow__",
              "__neg__", "__abs__"):
    setattr(PartBatch, _name, _arith(_name))
    setattr(PartBatchFloat, _name, _arith(_name))


def part_kind(a: Any) -> str | None:
    """:func:`misuse`'s ``kind`` for a forward run by module swapping: its extents are values."""
    return "extent" if isinstance(a, PartBatch | PartBatchFloat) else None


def followed(name: str, args: tuple, kwargs: dict, out: Any, held: bool) -> tuple[Any, str | None]:
    """A call of a forward run by module swapping, seen after it ran: its result (a read of the extents
    of a tensor that ``held`` the batch answers with :func:`read`'s), and why it is refused, if it is."""
    if held and name in READS:
        return read(name, args, kwargs, out)
    return out, (held and fixed_batch(name, args, kwargs, part_kind)) or misuse(name, args, kwargs, part_kind)


def read(name: str, args: tuple, kwargs: dict, out: Any) -> tuple[Any, str | None]:
    """``out`` of a read of the extents (:data:`READS`) of a tensor holding the batch along dim 0, with
    the batch's extent a :class:`PartBatch` (dim 0 of a shape, ``size(0)``, ``numel()``); and why the
    read is refused: ``len(x)``, whose int Python makes anew, so that no use of it can be told."""
    if name == "__len__":
        return out, ("len (of a tensor holding the batch: the part's extent, which Python's len makes "
                     "a plain int whose uses cannot be followed; size a tensor along the batch with "
                     "x.shape[0])")
    if name in ("shape", "size") and isinstance(out, tuple) and out:
        return type(out)((PartBatch(out[0]), *out[1:])), None
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if isinstance(out, int) and not isinstance(out, bool) and (name != "size" or dim in (0, -len_of(args))):
        return PartBatch(out), None
    return out, None


def len_of(args: tuple) -> int:
    """The number of dims of the tensor a read is made of (0 where it cannot be told)."""
    return args[0].dim() if args and hasattr(args[0], "dim") else 0


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, list | tuple):
        return [leaf for v in value for leaf in _leaves(v)]
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def sizes_of(name: str, args: tuple, kwargs: dict) -> list[Any]:
    """The shape a sized call (:data:`SIZED_METHODS`, :data:`SIZED_FACTORIES`) is given, as a list."""
    if "size" in kwargs or "shape" in kwargs:
        given = kwargs.get("size", kwargs.get("shape"))
    elif name in SIZE_AT:
        given = args[SIZE_AT[name]] if len(args) > SIZE_AT[name] else ()
    else:
        given = args[1:] if name in SIZED_METHODS else args
    if isinstance(given, list | tuple) and len(given) == 1 and isinstance(given[0], list | tuple):
        given = given[0]
    return list(given) if isinstance(given, list | tuple) else [given]


def sizes_batch(name: str, args: tuple, kwargs: dict, kind: Callable[[Any], str | None]) -> bool:
    """Whether a sized call gives dim 0 the batch's extent (``torch.ones(n)``, ``t.expand(n, -1)``): its
    result holds a part's samples along dim 0, so that what sums or scans along it is judged as a
    call across the samples (``torch.ones(n).sum()`` is the part's extent again)."""
    if name not in SIZED:
        return False
    sizes = sizes_of(name, args, kwargs)
    return bool(sizes) and (kind(sizes[0]) == "extent" or kind(sizes[0]) == "shape" and len(sizes) == 1)


def fixed_batch(name: str, args: tuple, kwargs: dict, kind: Callable[[Any], str | None]) -> str | None:
    """Why a reshape of a tensor holding the batch gives dim 0 a size of its own (None where it gives
    -1 or the batch's extent, ``kind`` as in :func:`misuse`): ``h.reshape(4, -1)``, written for a batch
    of 4, makes rows of half samples on a part of 2, which a mean or a softmax along them then reads
    as one process never does, silently."""
    if name not in ("view", "reshape") or not (sizes := sizes_of(name, args, kwargs)):
        return None
    lead = sizes[0]
    if kind(lead) in ("extent", "shape") or lead == -1 and not kind(lead):
        return None
    return (f"{name} (gives the batch's dim a size of its own, {lead!r}, where data parallelism or "
            f"micro-batches give each part its own number of samples: write -1 or x.shape[0] there)")


def misuse(name: str, args: tuple, kwargs: dict, kind: Callable[[Any], str | None]) -> str | None:
    """Why call ``name`` reads the batch's extent as a value (None where it reads none, or sizes a
    tensor along the batch with it). ``kind(a)``: ``"extent"`` for an argument that is the batch's
    extent, ``"shape"`` for a shape that holds it at dim 0, else None."""
    found = [a for a in _leaves((args, kwargs)) if kind(a)]
    if not found:
        return None
    if name in SIZED_METHODS + SIZED_FACTORIES + tuple(SIZE_AT):
        sizes = sizes_of(name, args, kwargs)
        lead = sizes[0] if sizes else None
        if (kind(lead) == "extent" or kind(lead) == "shape" and len(sizes) == 1) and found == [lead]:
            return None
    return (f"{name} (reads the batch's extent, x.shape[0], len(x) or x.numel(), as a value: with data "
            f"parallelism or micro-batches each part reads its own, which sizes a tensor along the batch "
            f"as one process does, h.view(x.size(0), -1), but as a value gives each sample another answer)")
