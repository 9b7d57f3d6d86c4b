"""Reading format-1 files, whose header is a pickle, without ever running code from them.

Why: versions written before the header became JSON (:mod:`.header`) are kept for study and resumed
from, and an unpickler calls whatever a file names. So the pickle is read by an unpickler that admits
only the globals a real format-1 header holds, and is scanned first so that no length in it can make the
unpickler allocate beyond the header's own bytes. Anything else is one line naming the global it asked
for: "header references posix.system, refused (a checkpoint is data)".

What a real header references: ``TensorEntry`` (the table), and in the state tree ``numpy.dtype`` with
``numpy._core.numeric._frombuffer`` (``numpy.core`` before numpy 2) for an ndarray such as numpy's RNG
key, ``numpy._core.multiarray.scalar`` for a numpy number, and ``collections.OrderedDict``. The numpy
ones are rebuilt by :mod:`.legacy_numpy`, from an allow-list of dtypes with their real item sizes. Not
admitted:
``numpy.ndarray`` and ``_reconstruct`` (protocol-2 arrays), which allocate from a declared shape before
any byte backs it; format-1 files were always written with protocol 5, which never uses them.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from typing import Any

from hybridpar.checkpoint.header import (
    MAX_DEPTH,
    BadHeader,
    TensorEntry,
    check_containers,
    check_keys,
    check_table,
)
from hybridpar.checkpoint.legacy_numpy import DtypeSpec, frombuffer, resolve_dtypes, scalar
from hybridpar.checkpoint.tree import Flat

FORMAT = 1


def _admitted() -> dict[tuple[str, str], Any]:
    """The globals a format-1 header may name, each mapped to what is called in its place: the numpy ones
    to :mod:`.legacy_numpy`'s checked rebuilds (a dtype from an allow-list, with its real item size)."""
    out: dict[tuple[str, str], Any] = {("hybridpar.checkpoint.format", "TensorEntry"): TensorEntry,
                                       ("collections", "OrderedDict"): OrderedDict,
                                       ("numpy", "dtype"): DtypeSpec}
    for prefix in ("numpy._core", "numpy.core"):
        out[(f"{prefix}.numeric", "_frombuffer")] = frombuffer
        out[(f"{prefix}.multiarray", "scalar")] = scalar
    return out


ADMITTED = _admitted()


def _admit(module: str, name: str) -> Any:
    found = ADMITTED.get((module, name))
    if found is None:
        raise BadHeader(f"header references {module}.{name}, refused (a checkpoint is data)")
    return found


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return _admit(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise BadHeader("header holds a persistent id, refused (a checkpoint is data)")


def _loads(raw: bytes) -> Any:
    """Unpickle with only :data:`ADMITTED` globals, after checking every opcode's length lies within ``raw``
    (the C unpickler allocates a declared length before reading it)."""
    try:
        for op, arg, _ in pickletools.genops(io.BytesIO(raw)):
            if op.name == "GLOBAL":  # protocol <= 3 names the global inline: refuse before unpickling
                module, _, name = str(arg).partition(" ")
                _admit(module, name)
    except BadHeader:
        raise
    except Exception as e:  # noqa: BLE001 (pickletools raises ValueError and others on a bad stream)
        raise BadHeader(f"header is not a readable pickle ({type(e).__name__}: {str(e)[:80]})") from None
    try:
        return _Unpickler(io.BytesIO(raw)).load()
    except BadHeader:
        raise
    except Exception as e:  # noqa: BLE001 (what an admitted global or a malformed stream raises)
        raise BadHeader(f"header does not unpickle ({type(e).__name__}: {str(e)[:80]})") from None


def _height(x: Any, done: dict[int, int], path: set[int]) -> int:
    """How deep ``x`` nests (a pickle may share or cycle containers: each is walked once); BadHeader past
    MAX_DEPTH or on a cycle, which a state never has."""
    if type(x) not in (list, tuple, dict, OrderedDict):
        return 0
    if id(x) in done:
        return done[id(x)]
    if id(x) in path or len(path) > MAX_DEPTH:
        raise BadHeader(f"a leaf nests deeper than {MAX_DEPTH}, or holds itself")
    path.add(id(x))
    items = list(x.keys()) + list(x.values()) if isinstance(x, dict) else x
    h = 1 + max((_height(v, done, path) for v in items), default=0)
    path.discard(id(x))
    if h > MAX_DEPTH:
        raise BadHeader(f"a leaf nests deeper than {MAX_DEPTH}")
    done[id(x)] = h
    return h


def decode_header(raw: bytes, data_start: int, data_end: int) -> tuple[dict[str, TensorEntry], Flat]:
    """The tensor table and tree of a format-1 header, by the same checks as format 2's."""
    doc = _loads(raw)
    if type(doc) is not dict or doc.get("format") != FORMAT or type(doc.get("tensors")) is not list \
            or type(doc.get("tree")) is not bytes:
        raise BadHeader("header is not a format-1 {format, tensors, tree}")
    fields = set(TensorEntry.__dataclass_fields__)
    if not all(type(e) is TensorEntry and set(vars(e)) == fields for e in doc["tensors"]):
        raise BadHeader("the tensor table holds something other than tensor entries")
    table = check_table(doc["tensors"], data_start, data_end)
    tree = _loads(doc["tree"])
    if type(tree) is not tuple or len(tree) != 2 or type(tree[0]) is not dict \
            or not all(type(k) is str for k in tree[0]):
        raise BadHeader("the tree is not (values, containers)")
    _height(tree[0], {}, set())
    flat = Flat({}, resolve_dtypes(tree[0]), check_containers(tree[1], decode_keys=False))
    check_keys(table, flat)
    return table, flat
