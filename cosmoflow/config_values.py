"""A config's values as plain data, each checked against its declared type: the YAML text read, ``--set``
assignments applied, fields coerced, and the one error every check raises.

Why apart from the dataclasses (:mod:`cosmoflow.config`): this is typing of plain values, and it knows
no section or key of its own (any dataclass can be built from a mapping here), so the config's schema and
its cross-key checks read without it; and :class:`ConfigError` lives here, below both, so that every
module raising it imports it without a cycle (:mod:`cosmoflow.config` re-exports it and the readers).
"""

from __future__ import annotations

import dataclasses
import math
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from hybridpar.plain_yaml import YamlProblem, read_plain
from hybridpar.planner.config import check_keys


class ConfigError(ValueError):
    """A configuration key or value that cannot work; the message says what would."""


def read_yaml(text: str, source: str) -> Any:
    """Plain YAML values from ``text`` (bounded, no tags); a :class:`ConfigError` naming ``source``,
    the line and the problem otherwise."""
    try:
        return read_plain(text)
    except YamlProblem as err:
        raise ConfigError(f"{source}: {err}") from None


def describe_type(typ: Any, prose: bool = True) -> str:
    """A config type in words: for messages (``prose``: ``int or null``, ``a list of float like [1, 2]``,
    ``true or false``) or for the reference's type column (``list[float]``, ``bool``, ``mapping``)."""
    if get_origin(typ) in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe_type(a, prose) for a in get_args(typ))
    if get_origin(typ) is list:
        inner = describe_type(get_args(typ)[0], prose)
        return f"a list of {inner} like [1, 2]" if prose else f"list[{inner}]"
    if get_origin(typ) is dict or typ is dict:
        return "a mapping" if prose else "mapping"
    return "true or false" if prose and typ is bool else typ.__name__


def _coerce(where: str, value: Any, typ: Any, default: Any) -> Any:
    """Check (and, for strings from ``--set``, convert) one value against its declared type: ``bool``,
    ``int``, ``float`` (finite), ``str``, ``list[...]`` of those, ``dict``, and ``X | None``."""
    wrong = ConfigError(f"{where}: expected {describe_type(typ)}, got {_shown(value)} (default {default!r})")
    if get_origin(typ) in (Union, types.UnionType):
        if value is None and type(None) in get_args(typ):
            return None
        (typ,) = [a for a in get_args(typ) if a is not type(None)]
    if value is None:
        raise ConfigError(f"{where}: must not be empty; expected {describe_type(typ)} (default {default!r})")
    if get_origin(typ) is list:
        if isinstance(value, str):
            value = read_yaml(value, where)
        if not isinstance(value, list):
            raise wrong
        return [_coerce(f"{where}[{i}]", v, get_args(typ)[0], default) for i, v in enumerate(value)]
    if get_origin(typ) is dict or typ is dict:
        if not isinstance(value, dict):
            raise wrong
        return value
    if typ is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise wrong
    if isinstance(value, bool):
        raise wrong  # true is neither a number nor a name
    if typ is str:
        if not isinstance(value, str | int | float):
            raise wrong
        if not str(value).strip():
            raise ConfigError(f"{where}: must not be empty; expected {describe_type(typ)} "
                              f"(default {default!r})")
        return str(value)
    if typ is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                raise wrong from None
        if not isinstance(value, int):
            raise wrong
        return value
    if typ is float:
        try:
            number = float(value) if isinstance(value, int | float | str) else math.nan
        except ValueError:
            raise wrong from None
        if not math.isfinite(number):
            raise wrong
        return number
    raise wrong


def build_section(cls: type, data: dict[str, Any], where: str) -> Any:
    """An instance of dataclass ``cls`` from a plain mapping, each value checked against its field's type
    (subsections recursively); ``where`` is the dotted path of ``data``, for messages."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'}: expected a mapping of keys to values, got {_shown(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"{where or 'config'}: key {_shown(key)} is not a name; valid keys: "
                              f"{', '.join(fields)}")
    check_keys(where or "config", data, list(fields), ConfigError)
    hints = get_type_hints(cls)
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        f, typ = fields[key], hints[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = build_section(typ, value, path)
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs[key] = _coerce(path, value, typ, default)
    return cls(**kwargs)


def _shown(value: Any) -> str:
    """``repr(value)``, cut short for a one-line message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def set_key(tree: dict[str, Any], assignment: str) -> None:
    """Apply one ``--set`` assignment (``section.key=value``, the value read as YAML) to a config tree."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected key=value, e.g. train.epochs=4")
    key, value = assignment.split("=", 1)
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part!r} is not a section")
    node[parts[-1]] = read_yaml(value, f"--set {key}")


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read: real ones are a few KB."""


def config_text(p: Path) -> str:
    """The text of config file ``p``: at most :data:`MAX_CONFIG_BYTES`, UTF-8."""
    try:
        with p.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(f"{p}: cannot be read ({err.strerror or err})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES >> 10} KiB; a config is a few KB of YAML")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{p}: not UTF-8 text (byte {err.start}); a config is YAML text") from None
