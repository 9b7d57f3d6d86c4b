"""numpy values in a format-1 header, rebuilt from an allow-list rather than from what the pickle says.

Why: a format-1 tree may hold a numpy array (numpy's RNG key) or a numpy number, which pickle rebuilds as
``_frombuffer(bytes, dtype, shape, order)`` and ``scalar(dtype, bytes)``, the dtype first rebuilt from a
state tuple the file supplies, item size included. numpy honours a stated item size for some dtypes and
ignores it for others, so a crafted dtype allocates without bound (2**40), fails deep inside numpy (-1),
or loads bytes under a dtype other than the one that wrote them (a float32 whose state says 8 bytes,
backed by 8 bytes an element). Here a dtype is only a name from :data:`NUMERIC` and a byte order; its
item size is numpy's own for that name, a state stating any other size is refused, and an array's or
number's bytes must be exactly its elements times that size. Every refusal is a :class:`BadHeader`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np

from hybridpar.checkpoint.header import MAX_DIMS, BadHeader

NUMERIC = frozenset(("b1", "i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16"))
"""The dtype names a format-1 header may rebuild (as numpy pickles them: kind and item size)."""
_ORDERS = frozenset("<>|=")


class DtypeSpec:
    """What a pickled ``numpy.dtype(name, align, copy)`` and its ``__setstate__`` said, kept as data until
    :meth:`dtype` makes the real dtype from the name alone."""

    def __init__(self, name: Any, align: Any = False, copy: Any = True) -> None:
        if type(name) is not str or name not in NUMERIC:
            raise BadHeader(f"header rebuilds numpy dtype {str(name)[:20]!r}, not one of {sorted(NUMERIC)}")
        self.name, self.order = name, "="

    def __setstate__(self, state: Any) -> None:
        """Check the state numpy pickles for a plain numeric dtype: ``(3, order, None, None, None, elsize,
        alignment, flags)``, with elsize -1 or the name's real item size and no fields or sub-arrays."""
        real = np.dtype(self.name).itemsize
        if type(state) is not tuple or len(state) not in (8, 9) or state[0] not in (3, 4) \
                or type(state[1]) is not str or state[1] not in _ORDERS \
                or any(v is not None for v in (*state[2:5], *state[8:])):
            raise BadHeader(f"header's numpy dtype {self.name} has state {str(state)[:60]}, not a plain "
                            f"numeric dtype's")
        elsize, alignment, flags = state[5:8]
        if type(elsize) is not int or elsize not in (-1, real):
            raise BadHeader(f"header's numpy dtype {self.name} states item size {str(elsize)[:24]}, its real "
                            f"size is {real}")
        if type(alignment) is not int or not -1 <= alignment <= 16 or type(flags) is not int or flags != 0:
            raise BadHeader(f"header's numpy dtype {self.name} states alignment {str(alignment)[:24]} and "
                            f"flags {str(flags)[:24]}, not a plain numeric dtype's")
        self.order = state[1]

    def dtype(self) -> np.dtype:
        """The real dtype: numpy's for the name, in the stated byte order."""
        dt = np.dtype(self.name)
        return dt.newbyteorder(self.order) if self.order in "<>" else dt


def _dtype(spec: Any) -> np.dtype:
    if type(spec) is not DtypeSpec:
        raise BadHeader(f"header rebuilds a numpy value with a {type(spec).__name__} as its dtype, not a "
                        f"numeric dtype")
    return spec.dtype()


def frombuffer(buf: Any, spec: Any, shape: Any, order: Any) -> np.ndarray:
    """What ``numpy._core.numeric._frombuffer`` does for a pickled array, once its dtype, shape and byte
    count agree exactly."""
    dt = _dtype(spec)
    if type(shape) is not tuple or len(shape) > MAX_DIMS or not all(type(d) is int and d >= 0 for d in shape):
        raise BadHeader(f"header's numpy array has shape {str(shape)[:60]}, not sizes")
    if type(buf) not in (bytes, bytearray) or order not in ("C", "F"):
        raise BadHeader("header's numpy array is not bytes in C or F order")
    want = math.prod(shape) * dt.itemsize
    if len(buf) != want:
        raise BadHeader(f"header's numpy array of shape {list(shape)[:8]} and dtype {dt} holds {want} bytes, "
                        f"its data is {len(buf)}")
    return np.frombuffer(buf, dtype=dt).reshape(shape, order=order)


def scalar(spec: Any, data: Any) -> np.generic:
    """What ``numpy._core.multiarray.scalar`` does for a pickled number, once its bytes are exactly one
    item of its dtype."""
    dt = _dtype(spec)
    if type(data) is not bytes or len(data) != dt.itemsize:
        raise BadHeader(f"header's numpy {dt} number is {len(data) if type(data) is bytes else '?'} bytes, "
                        f"not {dt.itemsize}")
    return np.frombuffer(data, dtype=dt)[0]


def resolve_dtypes(x: Any) -> Any:
    """``x`` with each bare :class:`DtypeSpec` (a dtype stored as a value) made a real dtype; nesting was
    bounded before (``legacy._height``)."""
    if type(x) is DtypeSpec:
        return x.dtype()
    if type(x) in (list, tuple):
        return type(x)(resolve_dtypes(v) for v in x)
    if type(x) in (dict, OrderedDict):
        return type(x)((resolve_dtypes(k), resolve_dtypes(v)) for k, v in x.items())
    return x
