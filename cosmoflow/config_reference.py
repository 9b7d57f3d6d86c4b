"""Every configuration key with its type, default, range and meaning: ``launch/train.py --help-config``
and ``docs/config.md``.

Why generated: the keys, types and defaults are the dataclasses of :mod:`cosmoflow.config`, the ranges
its :data:`~cosmoflow.config.AT_LEAST`, :data:`~cosmoflow.config.BELOW` and
:data:`~cosmoflow.config.ZERO_MEANS`, and each key's meaning is the comment beside its declaration (a
section's, its class docstring). Read from there, the reference cannot drift from what the loader
accepts; ``tests/test_config_reference.py`` checks that every key has a meaning and that the committed
``docs/config.md`` and ``cosmoflow/config_reference.txt`` are this module's output.

    python -m cosmoflow.config_reference --markdown > docs/config.md
    python -m cosmoflow.config_reference > cosmoflow/config_reference.txt   # what --help-config prints
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import json
import math
import sys
import textwrap
import tokenize
import types
from dataclasses import dataclass
from functools import cache
from typing import Any, Union, get_args, get_origin, get_type_hints

from cosmoflow import config as config_module
from cosmoflow.config import AT_LEAST, BELOW, ZERO_MEANS, Config, describe_type


@dataclass(frozen=True)
class Key:
    """One configuration key, as the reference shows it."""

    name: str      # dotted, e.g. train.epochs
    type: str      # int, float or null, list[int], ...
    default: str   # as YAML would write it
    range: str     # ">= 1", ">= 0 (0: off)", "< 1", or ""
    meaning: str


@dataclass(frozen=True)
class Section:
    """A section of the config (the top level: name "")."""

    name: str
    meaning: str
    keys: tuple[Key, ...]


@cache
def _comments() -> dict[str, str]:
    """``Class.field`` -> the comment beside its declaration in :mod:`cosmoflow.config`, with the
    comment-only lines that continue it (read once from the module's source)."""
    source = inspect.getsource(config_module)
    lines = source.splitlines()
    comment_at = {tok.start[0]: tok.string.lstrip("#").strip()
                  for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                  if tok.type == tokenize.COMMENT}
    found: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = [n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]
        for i, field in enumerate(body):
            end = field.end_lineno or field.lineno
            parts = [comment_at[n] for n in range(field.lineno, end + 1) if n in comment_at]
            stop = body[i + 1].lineno if i + 1 < len(body) else len(lines) + 1
            n = end + 1
            while n < stop and lines[n - 1].strip().startswith("#"):
                parts.append(comment_at[n])
                n += 1
            found[f"{node.name}.{field.target.id}"] = " ".join(parts).replace("``", "`")
    return found


def _range_text(name: str, typ: Any) -> str:
    """The range :func:`cosmoflow.config.validate` enforces on a number (or a list of numbers)."""
    inner = [a for a in get_args(typ) if a is not type(None)] if get_origin(typ) in (Union, types.UnionType) \
        else [typ]
    inner = [get_args(a)[0] if get_origin(a) is list else a for a in inner]
    if not any(a in (int, float) for a in inner):
        return ""
    low = AT_LEAST.get(name, 0)
    text = f">= {low}" + (f" (0: {ZERO_MEANS[name]})" if low == 0 and name in ZERO_MEANS else "")
    high = BELOW.get(name, math.inf)
    if not math.isfinite(high):
        return text
    return f"{text}, < {int(high) if float(high).is_integer() else high}"


def _default_text(value: Any) -> str:
    return json.dumps(value) if value is not None else "null"


def sections() -> list[Section]:
    """The config's sections in declaration order, the top level's plain keys first."""
    top: list[Key] = []
    out: list[Section] = []
    hints = get_type_hints(Config)
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(hints[f.name]):
            section = hints[f.name]
            keys = tuple(_key(section, g.name, f"{f.name}.") for g in dataclasses.fields(section))
            out.append(Section(f.name, _doc(section), keys))
        else:
            top.append(_key(Config, f.name, ""))
    return [Section("", _doc(Config), tuple(top)), *out]


def _key(cls: type, field: str, prefix: str) -> Key:
    """The reference entry of ``cls``'s ``field``, named ``prefix + field``."""
    typ, name = get_type_hints(cls)[field], prefix + field
    return Key(name, describe_type(typ, prose=False), _default_text(getattr(cls(), field)),
               _range_text(name, typ), _comments().get(f"{cls.__name__}.{field}", ""))


def _doc(cls: type) -> str:
    """A section's meaning: its class docstring, in one line, with single backquotes."""
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split()).replace("``", "`")


def text() -> str:
    """The reference as ``--help-config`` prints it: one block per section, one line per key."""
    rows = [k for s in sections() for k in s.keys]
    width = max(len(k.name) for k in rows) + 2
    typed = max(len(k.type) for k in rows) + 2
    out = ["Every configuration key: set in the YAML file (section: {key: value}) or with "
           "--set section.key=value.", ""]
    for s in sections():
        out.append(f"{s.name or 'top level'}: {s.meaning}")
        for k in s.keys:
            limits = f" [{k.range}]" if k.range else ""
            out.append(f"  {k.name:<{width}}{k.type:<{typed}}default {k.default}{limits}")
            out.append(textwrap.fill(k.meaning, 100, initial_indent=" " * (width + 2),
                                     subsequent_indent=" " * (width + 2)))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def markdown() -> str:
    """The reference as ``docs/config.md``: a table per section."""
    out = ["# Configuration reference", "",
           "Generated by `python -m cosmoflow.config_reference --markdown > docs/config.md` from "
           "`cosmoflow/config.py` (`launch/train.py --help-config` prints the same). Set a key in the YAML "
           "file (`section: {key: value}`) or with `--set section.key=value`; a value out of its range, of "
           "another type or an unknown key stops the run in its first second with one line.", ""]
    for s in sections():
        out += [f"## {s.name or 'Top level'}", "", s.meaning, "",
                "| key | type | default | range | meaning |", "|---|---|---|---|---|"]
        for k in s.keys:
            cells = [f"`{k.name}`", k.type, f"`{k.default}`", k.range, k.meaning]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--markdown"]):
        print("usage: python -m cosmoflow.config_reference [--markdown]", file=sys.stderr)
        return 2
    sys.stdout.write(markdown() if args else text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
