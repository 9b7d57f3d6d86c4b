"""A rank file's header as data: typed JSON for the state's non-tensor leaves, checked field by field.

Why: checkpoints travel (shared file systems, copied runs, versions kept for study), so reading one must
never run code, and a damaged or crafted one must fail as one :class:`CorruptFile` line: never a crash,
a hang or an allocation beyond the file's size. JSON parses into plain values only. Every leaf keeps its
type, so a Python RNG state (a tuple of ints), bytes and non-finite floats come back as they went in;
anything else (a set, a custom object, an ndarray) is refused when it is *saved*, naming its key, so a
save that succeeds is a save that loads.

The header (format 2)::

    {"format": 2,
     "tensors": [[key, dtype, shape, offset, nbytes, crc32], ...],   # in file order, back to back
     "tree": {"values": {key: leaf}, "containers": {path: [kind, [container key, ...]]}}}

A leaf is None, a bool, an int, a finite float, a str, a list of leaves, or a one-key object: ``{"t":
[...]}`` a tuple, ``{"b": base64}`` bytes, ``{"f": "inf" | "-inf" | "nan"}`` a non-finite float.
Container keys (dict keys; indices in sequences) are str, int, float, bool or None leaves. Dicts and
OrderedDicts are containers (:mod:`.tree`), never leaves.

Reading checks, before anything is allocated from it: every dtype is in :data:`DTYPES`; every shape is
non-negative and its element count times the dtype's size is the entry's byte count; the tensors tile
the data region exactly, in order (no gap, no overlap, nothing past the header); nesting stays within
:data:`MAX_DEPTH`; keys are as :func:`.tree.flatten` writes them (none empty, none repeated in one
container, a sequence's keys its indices, no key both a tensor and a value), since an empty key joins to
its container's own path and rebuilding the state would recurse forever.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hybridpar.checkpoint.tree import ROOT, SEP, Flat

FORMAT = 2
MAX_DEPTH = 64  # nesting of a leaf, and of a container path; real states are under 10 deep
MAX_DIMS = 32
KINDS = ("dict", "odict", "list", "tuple")
DTYPES: dict[str, torch.dtype] = {
    n: getattr(torch, n) for n in (
        "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "int64", "int32", "int16",
        "int8", "uint8", "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz")
    if isinstance(getattr(torch, n, None), torch.dtype)}
_KEY_TYPES = (str, int, float, bool, type(None))


class BadHeader(ValueError):
    """A header that is not what this module writes (the caller names the file)."""


@dataclass(frozen=True)
class TensorEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    crc: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------- writing
def _leaf(x: Any, key: str, where: str = "") -> Any:
    t = type(x)
    if x is None or t is bool or t is int or t is str:
        return x
    if t is float:
        return x if math.isfinite(x) else {"f": repr(x)}
    if isinstance(x, np.bool_ | np.integer | np.floating):  # a numpy number is stored as the number it is
        return _leaf(x.item(), key, where)
    if t is list:
        return [_leaf(v, key, f"{where}[{i}]") for i, v in enumerate(x)]
    if t is tuple:
        return {"t": [_leaf(v, key, f"{where}[{i}]") for i, v in enumerate(x)]}
    if t is bytes:
        return {"b": base64.b64encode(x).decode()}
    hint = {"set": "a sorted list", "frozenset": "a sorted list", "ndarray": "a tensor (torch.from_numpy)",
            "Size": "a tuple"}.get(t.__name__, "its parts as numbers, strings, lists or dicts")
    raise TypeError(f"checkpoint state key {key!r} holds a {t.__name__}{f' (at {where})' if where else ''}: "
                    f"a checkpoint stores tensors, None, bool, int, float, str, bytes, list, tuple and dict; "
                    f"save {hint}")


def _key(k: Any, path: str) -> Any:
    if not isinstance(k, _KEY_TYPES):
        raise TypeError(f"checkpoint state key {k!r} at {path or '<root>'!r} is a {type(k).__name__}: "
                        f"only str, int, float, bool and None keys can be stored")
    return _leaf(k, path)


def encode_tree(flat: Flat) -> bytes:
    """The non-tensor part of a state as header JSON (taken at save time, so later mutation cannot leak
    in); a TypeError naming the key if a leaf or a tensor's dtype cannot be stored."""
    for key, t in flat.tensors.items():
        if dtype_name(t.dtype) not in DTYPES:
            raise TypeError(f"checkpoint state key {key!r} is a tensor of dtype {dtype_name(t.dtype)}, which "
                            f"a checkpoint does not store (dtypes: {', '.join(DTYPES)})")
    doc = {"values": {k: _leaf(v, k) for k, v in flat.values.items()},
           "containers": {p: [kind, [_key(k, p) for k in keys]]
                          for p, (kind, keys) in flat.containers.items()}}
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def encode_header(table: Iterable[TensorEntry], tree: bytes) -> bytes:
    rows = [[e.key, e.dtype, list(e.shape), e.offset, e.nbytes, e.crc] for e in table]
    head = json.dumps({"format": FORMAT, "tensors": rows}, separators=(",", ":")).encode()
    return head[:-1] + b',"tree":' + tree + b"}"


# ---------------------------------------------------------------------------------------- reading
def _no_constants(name: str) -> Any:
    raise BadHeader(f"header holds {name}, which JSON does not have")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise BadHeader("header repeats a key in one object")
    return out


def _unleaf(x: Any, depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        raise BadHeader(f"a leaf nests deeper than {MAX_DEPTH}")
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    if t is list:
        return [_unleaf(v, depth + 1) for v in x]
    if t is dict and len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "t" and type(v) is list:
            return tuple(_unleaf(e, depth + 1) for e in v)
        if tag == "b" and type(v) is str:
            try:
                return base64.b64decode(v, validate=True)
            except binascii.Error:
                raise BadHeader("a bytes leaf is not base64") from None
        if tag == "f" and v in ("inf", "-inf", "nan"):
            return float(v)
    raise BadHeader(f"a leaf of unknown form ({str(x)[:40]})")


def _int(x: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if type(x) is not int or not lo <= x <= hi:
        span = "0..2**62" if (lo, hi) == (0, 1 << 62) else f"{lo}..{hi}"
        raise BadHeader(f"{what} is {repr(x)[:40]}, not an integer in {span}")
    return x


def check_table(entries: Iterable[Any], data_start: int, data_end: int) -> dict[str, TensorEntry]:
    """The tensor table, every entry checked against the data region ``[data_start, data_end)`` (the bytes
    between the magic and the header): dtype known, shape non-negative, bytes = elements x item size, and
    the tensors back to back, in order, filling the region exactly."""
    table: dict[str, TensorEntry] = {}
    at = data_start
    for e in entries:
        if type(e.key) is not str or e.key in table:
            raise BadHeader(f"tensor key {str(e.key)[:60]!r} is not a string, or repeats")
        name = f"tensor {e.key[:80]!r}"
        if type(e.dtype) is not str or e.dtype not in DTYPES:
            raise BadHeader(f"{name} has dtype {str(e.dtype)[:40]!r}, not one a checkpoint stores")
        if type(e.shape) not in (list, tuple) or len(e.shape) > MAX_DIMS:
            raise BadHeader(f"{name} has shape {str(e.shape)[:60]}, not a list of at most {MAX_DIMS} sizes")
        shape = tuple(_int(d, f"{name} has shape {str(e.shape)[:60]}: a size") for d in e.shape)
        offset = _int(e.offset, f"{name} offset")
        nbytes = _int(e.nbytes, f"{name} byte count")
        crc = _int(e.crc, f"{name} crc32", hi=0xFFFFFFFF)
        want = math.prod(shape) * DTYPES[e.dtype].itemsize
        if want != nbytes:
            raise BadHeader(f"{name} of shape {list(shape)[:8]} and dtype {e.dtype} holds {want} bytes, its "
                            f"entry says {nbytes}")
        if offset != at or offset + nbytes > data_end:
            raise BadHeader(f"{name} at bytes {offset}..{offset + nbytes} is not where the data region "
                            f"{data_start}..{data_end} has room for it (overlap, gap, or past the end)")
        table[e.key] = TensorEntry(e.key, e.dtype, shape, offset, nbytes, crc)
        at += nbytes
    if at != data_end:
        raise BadHeader(f"the tensors end at byte {at}, the data region at {data_end}")
    return table


def check_containers(containers: Any, decode_keys: bool) -> dict[str, tuple[str, list]]:
    """The container map of a tree, checked: paths are strings no deeper than :data:`MAX_DEPTH`, kinds
    known, keys scalar."""
    if type(containers) is not dict:
        raise BadHeader("the tree's containers are not a map")
    out: dict[str, tuple[str, list]] = {}
    for path, spec in containers.items():
        if type(path) is not str or path.count(SEP) > MAX_DEPTH:
            raise BadHeader(f"container path {str(path)[:60]!r} is not a string within {MAX_DEPTH} levels")
        if type(spec) not in (list, tuple) or len(spec) != 2 or spec[0] not in KINDS \
                or type(spec[1]) is not list:
            raise BadHeader(f"container {path[:60]!r} is {str(spec)[:60]}, not [kind, keys]")
        keys = [_unleaf(k) for k in spec[1]] if decode_keys else spec[1]
        if not all(isinstance(k, _KEY_TYPES) for k in keys):
            raise BadHeader(f"container {path[:60]!r} has a key that is not a str, int, float, bool or None")
        _check_container_keys(path, spec[0], keys)
        out[path] = (spec[0], keys)
    return out


def _check_container_keys(path: str, kind: str, keys: list) -> None:
    """A container's keys as :func:`.tree.flatten` writes them: a sequence's are its indices, a dict's are
    neither empty nor repeated once written as text. Why: an empty key joins to its container's own path
    (at the root, the root again: rebuilding the state would recurse forever), and a repeated one would
    rebuild a state that was never saved."""
    where = path[:60] or "<root>"
    if kind in ("list", "tuple"):
        if keys != list(range(len(keys))) or not all(type(k) is int for k in keys):
            raise BadHeader(f"{kind} container {where!r} has keys {str(keys)[:60]}, not its indices")
        return
    seen: set[str] = set()
    for k in keys:
        text = str(k)
        if text == "":
            raise BadHeader(f"container {where!r} has an empty key, which no saved state holds")
        if text in seen:
            raise BadHeader(f"container {where!r} repeats the key {text[:60]!r}")
        seen.add(text)


def check_keys(table: dict[str, TensorEntry], flat: Flat) -> None:
    """Every leaf key non-empty and either a tensor's or a value's, never both (:func:`check_containers`
    checks the containers' own keys); BadHeader naming the first that is not."""
    for key in (*table, *flat.values):
        if key == ROOT:
            raise BadHeader("a leaf has the empty key, which no saved state holds")
    both = set(table) & set(flat.values)
    if both:
        raise BadHeader(f"key {min(both)[:80]!r} is both a tensor and a value")


def decode_header(raw: bytes, data_start: int, data_end: int) -> tuple[dict[str, TensorEntry], Flat]:
    """The tensor table and the non-tensor tree of a format-2 header; BadHeader on anything else."""
    try:
        doc = json.loads(raw, parse_constant=_no_constants, object_pairs_hook=_pairs)
    except RecursionError:
        raise BadHeader(f"header nests deeper than {MAX_DEPTH}") from None
    except UnicodeDecodeError:
        raise BadHeader("header is not UTF-8 text") from None
    except ValueError as e:  # json.JSONDecodeError, and ints too long to read
        if isinstance(e, BadHeader):
            raise
        raise BadHeader(f"header is not JSON ({str(e)[:80]})") from None
    if type(doc) is not dict or set(doc) != {"format", "tensors", "tree"}:
        raise BadHeader("header is not {format, tensors, tree}")
    if doc["format"] != FORMAT:
        raise BadHeader(f"header format {str(doc['format'])[:20]}, this reader knows {FORMAT}")
    rows, tree = doc["tensors"], doc["tree"]
    if type(rows) is not list or not all(type(r) is list and len(r) == 6 for r in rows):
        raise BadHeader("the tensor table is not a list of [key, dtype, shape, offset, nbytes, crc32]")
    table = check_table((TensorEntry(*r) for r in rows), data_start, data_end)
    if type(tree) is not dict or set(tree) != {"values", "containers"} or type(tree["values"]) is not dict:
        raise BadHeader("the tree is not {values, containers}")
    values = {k: _unleaf(v) for k, v in tree["values"].items()}
    flat = Flat({}, values, check_containers(tree["containers"], decode_keys=True))
    check_keys(table, flat)
    return table, flat
