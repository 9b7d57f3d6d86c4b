"""Nested training states as flat ``key -> leaf`` maps, and back.

Why: a checkpoint saved under one parallel layout must load under another, so every tensor is stored
under a key that names it in the *full* model (``model/conv1.weight``), not by its position on some
rank. Flattening also lets a pipeline stage read only the keys it needs, and lets the files written by
several stages be merged back into one nested state.

A key joins the path of dict keys and list indices with ``/`` (a ``/`` or ``%`` inside a dict key is
escaped as ``%2F`` / ``%25``). Dicts are always walked; lists and plain tuples are walked only when they
hold a tensor or a dict somewhere (so a Python RNG state, a tuple of 627 ints, stays one leaf); anything
else is a leaf kept by value (typed JSON in the file: :mod:`.header` says which values it stores).
Containers remember their type and the original keys, so int keys (optimizer states) and ``OrderedDict``
come back as they went in.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

SEP = "/"
ROOT = ""

KeyFilter = Callable[[str], bool]


def escape(part: str) -> str:
    return part.replace("%", "%25").replace(SEP, "%2F")


def join(path: str, part: str) -> str:
    return escape(part) if path == ROOT else f"{path}{SEP}{escape(part)}"


def top_key(key: str) -> str:
    """The first component of a key (the top-level entry of the state it belongs to), unescaped."""
    return key.split(SEP, 1)[0].replace("%2F", SEP).replace("%25", "%")


@dataclass
class Flat:
    """A nested state taken apart: tensor leaves, other leaves, and the containers that held them.

    ``containers[path] = (kind, keys)`` with kind one of ``dict``, ``odict``, ``list``, ``tuple`` and
    ``keys`` the container's original keys (indices for sequences), in order. The root path is ``""``.
    """

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    containers: dict[str, tuple[str, list]] = field(default_factory=dict)

    def keys(self) -> list[str]:
        return [*self.tensors, *self.values]


def _walk(obj: Any) -> bool:
    """Whether a list/tuple is worth walking into: it holds a tensor or a mapping somewhere."""
    for x in obj:
        if isinstance(x, torch.Tensor | Mapping):
            return True
        if type(x) in (list, tuple) and _walk(x):
            return True
    return False


def flatten(state: Mapping[str, Any]) -> Flat:
    """Take a nested state apart (see the module docstring for what becomes a leaf)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"a checkpoint state must be a mapping (dict of entries), got {type(state).__name__}")
    out = Flat()
    _flatten(state, ROOT, out)
    return out


def _flatten(obj: Any, path: str, out: Flat) -> None:
    if isinstance(obj, torch.Tensor):
        out.tensors[path] = obj
    elif isinstance(obj, Mapping):
        keys = list(obj.keys())
        seen: dict[str, Any] = {}
        for k in keys:
            if not isinstance(k, str | int | float | None):
                raise TypeError(f"checkpoint state key {k!r} at {path or '<root>'!r} is a "
                                f"{type(k).__name__}: only str, int, float, bool and None keys can be stored")
            if str(k) == "":  # it would join to this container's own path (the root's is the root again)
                raise ValueError(f"checkpoint state key {k!r} at {path or '<root>'!r} is empty; a checkpoint "
                                 f"names every entry, rename it")
            if str(k) in seen:
                raise ValueError(f"keys {seen[str(k)]!r} and {k!r} at {path or '<root>'!r} collide once "
                                 f"written as text; rename one of them")
            seen[str(k)] = k
        out.containers[path] = ("odict" if isinstance(obj, OrderedDict) else "dict", keys)
        for k in keys:
            _flatten(obj[k], join(path, str(k)), out)
    elif type(obj) in (list, tuple) and _walk(obj):
        out.containers[path] = (type(obj).__name__, list(range(len(obj))))
        for i, x in enumerate(obj):
            _flatten(x, join(path, str(i)), out)
    else:
        out.values[path] = obj


def select(flat: Flat, keep: KeyFilter) -> Flat:
    """The part of ``flat`` whose leaves pass ``keep`` (containers are kept when something inside is)."""
    out = Flat({k: v for k, v in flat.tensors.items() if keep(k)},
               {k: v for k, v in flat.values.items() if keep(k)})
    live = set(out.tensors) | set(out.values)
    needed: set[str] = {ROOT}
    for k in live:
        while k:
            k = k.rsplit(SEP, 1)[0] if SEP in k else ROOT
            if k in needed:
                break
            needed.add(k)
    for path, (kind, keys) in flat.containers.items():
        if path in needed or (not keys and keep(path)):
            out.containers[path] = (kind, keys)
            needed.add(path)
    return out


def merge(parts: Iterable[Flat]) -> Flat:
    """One Flat from several (the files of several stages); the first part wins where leaves repeat."""
    out = Flat()
    for p in parts:
        for k, v in p.tensors.items():
            out.tensors.setdefault(k, v)
        for k, v in p.values.items():
            out.values.setdefault(k, v)
        for path, (kind, keys) in p.containers.items():
            if path not in out.containers:
                out.containers[path] = (kind, list(keys))
                continue
            have_kind, have = out.containers[path]
            if kind in ("list", "tuple") or have_kind in ("list", "tuple"):
                n = max(len(have), len(keys))
                out.containers[path] = (have_kind, list(range(n)))
            else:
                known = {str(k) for k in have}
                have.extend(k for k in keys if str(k) not in known)
    return out


def unflatten(flat: Flat) -> dict[str, Any]:
    """Rebuild the nested state (the inverse of :func:`flatten`, after any :func:`select`/:func:`merge`)."""
    if ROOT not in flat.containers:
        return {}
    return _build(flat, ROOT)


def _build(flat: Flat, path: str) -> Any:
    kind, keys = flat.containers[path]
    items: list[tuple[Any, Any]] = []
    for k in keys:
        child = join(path, str(k))
        if child in flat.tensors:
            items.append((k, flat.tensors[child]))
        elif child in flat.values:
            items.append((k, flat.values[child]))
        elif child in flat.containers:
            items.append((k, _build(flat, child)))
    if kind == "dict":
        return dict(items)
    if kind == "odict":
        return OrderedDict(items)
    seq = [v for _, v in items]
    return tuple(seq) if kind == "tuple" else seq


def key_filter(keys: KeyFilter | Iterable[str] | None) -> KeyFilter:
    """A predicate from what ``load(keys=...)`` accepts: None (everything), a predicate, or key names.

    A name selects that leaf and everything below it: ``"model"`` selects every model tensor,
    ``"model/conv1.weight"`` one of them.
    """
    if keys is None:
        return lambda k: True
    if callable(keys):
        return keys
    if isinstance(keys, str):
        keys = [keys]
    names = set(keys)
    prefixes = tuple(n + SEP for n in names)
    return lambda k: k in names or k.startswith(prefixes)


def keys_of(state: Mapping[str, Any]) -> list[str]:
    """The leaf keys of a nested state, e.g. to load exactly what a stage's own state holds."""
    return flatten(state).keys()


def keys_for(names: Iterable[str], entries: Iterable[str] = ("model", "optimizer")) -> KeyFilter:
    """What a pipeline stage loads: within ``entries``, only the leaves of its own tensors ``names``
    (full-model names, e.g. ``model.state_dict().keys()``); everything outside ``entries`` in full.

    A leaf belongs to a name when the name is one component of its key: ``model/<name>`` and
    ``optimizer/state/<name>/momentum_buffer`` (from :func:`hybridpar.checkpoint.optimizer_state`) alike.
    """
    own = {escape(n) for n in names}
    scoped = set(entries)
    return lambda k: top_key(k) not in scoped or any(p in own for p in k.split(SEP)[1:])
