"""Which dims of a shape the user's line goes on to read: ``x.shape[0]``, ``x.shape[2:]``.

Why: a loss that reads ``o.shape`` on a part holds the part's extents; read along a dim the engine
cuts, that is no longer the whole's loss (:mod:`hybridpar.pipeline.loss_form` breaks it), but most
reads take one uncut dim (``o.view(o.shape[0], -1)``, ``n = o.shape[1]``). ``x.shape`` gives a
``torch.Size``, which cannot be subclassed to tell which of its items are read; the line's own
bytecode can: a constant index or slice right after the read. Anything else reads every dim.
"""

from __future__ import annotations

import dis
import functools
from types import CodeType, FrameType


def dims_read(frame: FrameType | None, ndim: int) -> list[int]:
    """The dims of an ``ndim``-dim shape that the instruction ``frame`` is running (the read) is
    followed by a constant subscript or slice of; every dim otherwise."""
    if frame is None:
        return list(range(ndim))
    picked = _after(frame.f_code, frame.f_lasti)
    if picked is None:
        return list(range(ndim))
    if isinstance(picked, slice):
        return list(range(ndim))[picked]
    return [picked % ndim] if -ndim <= picked < ndim else list(range(ndim))


@functools.cache
def _after(code: CodeType, at: int) -> int | slice | None:
    """The constant index or slice taken of what the instruction at offset ``at`` produced, or None."""
    ops = [i for i in dis.get_instructions(code) if i.offset > at and i.opname != "CACHE"][:4]
    names = [i.opname for i in ops]
    consts = [i.argval for i in ops]
    if names[:2] == ["LOAD_CONST", "BINARY_SUBSCR"] and isinstance(consts[0], int) \
            and not isinstance(consts[0], bool):
        return consts[0]
    bounds = consts[:2]
    if names[:2] == ["LOAD_CONST", "LOAD_CONST"] and all(b is None or type(b) is int for b in bounds) and (
            names[2:3] == ["BINARY_SLICE"] or names[2:4] == ["BUILD_SLICE", "BINARY_SUBSCR"]):
        return slice(*bounds)
    return None
