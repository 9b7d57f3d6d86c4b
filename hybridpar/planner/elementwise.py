"""Which calls work element by element: the one rule the traced plan, a forward run by module swapping
and the per-sample check read alike.

Why a module of its own: an elementwise call runs on shards as it runs on the whole volume and keeps
the samples of a batch apart, so every planner lets it through; a list kept in each would differ, and
where they differ a model runs in one path and is refused in the other. torch tags its elementwise
operators (``torch.Tag.pointwise``), so the rule covers the operators no list names (``torch.atan2``,
``x.frac()``); the list adds what the tag leaves out: conversions (``x.long()``, ``x.to``), the
operator dunders, views of a complex tensor's parts and tensors made alike another.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hybridpar.nn import registry

LIKE = ("zeros_like", "ones_like", "empty_like", "full_like", "detach", "clone", "to", "float", "expand_as",
        "double", "half", "bfloat16", "type", "type_as", "cpu", "cuda", "__neg__", "__pos__", "__abs__",
        "__invert__", "pow", "__pow__", "__rpow__", "where", "masked_fill", "lerp", "addcmul", "addcdiv",
        "maximum", "minimum", "sqrt", "rsqrt", "log", "sin", "cos", "sign", "softsign", "tanhshrink",
        "reciprocal", "exp2", "expm1", "floor", "ceil", "round", "erf", "hardsigmoid", "logsigmoid",
        "log_sigmoid", "hardswish", "isclose",
        "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
        "__floordiv__", "__rfloordiv__", "floor_divide", "floordiv", "__mod__", "__rmod__", "mod",
        "and_", "or_", "xor", "invert", "remainder", "fmod", "float_power", "copysign",
        "__gt__", "__lt__", "__ge__", "__le__", "__ne__", "__eq__", "gt", "lt", "ge", "le", "ne", "eq",
        "__and__", "__or__", "__xor__", "logical_and", "logical_or", "logical_not", "clamp_min",
        "clamp_max", "nan_to_num", "__iadd__", "__isub__", "__imul__", "__itruediv__", "sub_", "div_",
        "clamp_", "sigmoid_", "tanh_", "fill_", "zero_", "copy_", "leaky_relu", "leaky_relu_",
        "long", "int", "short", "bool", "byte", "char", "real", "imag", "conj", "resolve_conj", "as_tensor",
        "data")
"""Elementwise calls by name, beyond torch's tag: in-place forms only where listed (the planners follow
these writes)."""


def name_of(func: Any) -> str:
    """A function's name as it is called (``torch.mean``, ``Tensor.mean`` and ``F.softmax`` alike); an
    attribute's getter (``x.dtype``, whose function is named ``__get__``) by the attribute's name."""
    name = getattr(func, "__name__", None)
    owner = getattr(func, "__self__", None)
    if name in (None, "__get__") and owner is not None:
        return getattr(owner, "__name__", str(func))
    return str(func) if name is None else name


@functools.cache
def _tagged(name: str) -> bool:
    """Whether torch tags the operator ``name`` elementwise: its main overload (``.default`` or
    ``.Tensor``); an in-place form or one that draws random numbers is not taken from the tag."""
    if not name or name.endswith("_") or name.startswith("_"):
        return False
    try:
        packet = getattr(torch.ops.aten, name, None)
    except RuntimeError:  # a name the operator registry cannot look up
        return False
    overload = getattr(packet, "default", None) or getattr(packet, "Tensor", None)
    tags = getattr(overload, "tags", ())
    return torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags


def elementwise(func: Any) -> bool:
    """Whether a call of ``func`` (a function, a tensor method, or its name) works element by element,
    broadcasting its tensors: registered so (:func:`hybridpar.nn.registry.function_role`), listed in
    :data:`LIKE`, or tagged by torch."""
    name = func if isinstance(func, str) else name_of(func)
    if registry.function_role(func) == "pointwise" or registry.function_role(name) == "pointwise":
        return True
    return name in LIKE or _tagged(name)


def broadcast_extents(extents: list[tuple[int, ...]], split: tuple[int, int, int]) -> tuple[int, ...] | None:
    """The global (D, H, W) an elementwise call on split operands of these global ``extents`` gives
    where each rank's shards broadcast as the volumes do and one operand spans it, else None: the
    operands agree along every dim the grid splits (each holds the same box there), and along an
    unsplit one every rank holds the whole extent, so a plane ``h[:, :, -1:]`` broadcasts against ``h``
    on a shard as on the volume. An extent of 1 along a split dim is one rank's alone: not broadcast."""
    out = []
    for k, parts in enumerate(split):
        sizes = {e[k] for e in extents}
        if len(sizes) > 1 and (parts > 1 or len(sizes - {1}) > 1):
            return None
        out.append(max(sizes))
    return tuple(out) if tuple(out) in extents else None
