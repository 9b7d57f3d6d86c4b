"""Plain YAML: the values a configuration or spec file may hold, and nothing that could run or explode.

Why: a config is data. ``yaml.safe_load`` already refuses ``!!python`` tags, but its errors are
tracebacks and it expands aliases without limit: a 1 KB file of nested aliases ("billion laughs")
holds 10^9 values once read. :func:`read_plain` bounds the expansion and turns every problem into one
line naming where it is. It also reads a flow mapping written without spaces after its colons, as typed
on a command line (``--set 'parallel.grid={data:1,spatial:[1,2,1]}'``), as the user means it:
``{data: 1, spatial: [1, 2, 1]}``, where YAML alone reads one key ``'data:1'`` with no value, which no
configuration or spec ever means.
"""

from __future__ import annotations

import re
from typing import Any

import yaml


class YamlProblem(ValueError):
    """Text that is not plain YAML, or too large once its aliases are expanded; one line."""


MAX_YAML_NODES = 10_000
"""Most values a config may hold once its aliases are expanded: real ones hold about a hundred, and a
1 KB file of nested aliases ("billion laughs") would otherwise expand to 10^9 as it is validated."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.safe_load``'s loader (plain values only: a ``!!python`` or unknown tag is refused), which
    also refuses a document whose aliases expand it past :data:`MAX_YAML_NODES` values."""

    def get_single_node(self) -> yaml.Node | None:
        node = super().get_single_node()
        if node is not None:
            _expanded_size(node, {})
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int | None]) -> int:
    """Values under ``node`` with every alias expanded, each shared node sized once (None: in progress,
    so meeting it again is an alias inside its own anchor)."""
    key = id(node)
    if key in sizes:
        size = sizes[key]
        if size is None:
            raise yaml.YAMLError(f"line {node.start_mark.line + 1}: an alias refers to a value that contains "
                                 "it (an endless value)")
        return size
    sizes[key] = None
    children: list[yaml.Node] = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    total = 1
    for child in children:
        total += _expanded_size(child, sizes)
        if total > MAX_YAML_NODES:
            raise yaml.YAMLError(f"line {node.start_mark.line + 1}: its aliases expand to more than "
                                 f"{MAX_YAML_NODES} values (a configuration holds about a hundred)")
    sizes[key] = total
    return total


def read_plain(text: str) -> Any:
    """Plain YAML values from ``text`` (bounded, no tags), or :class:`YamlProblem` saying where and
    what is wrong. A flow mapping's ``key:value`` without a space is read as ``key: value``."""
    value = _read(text)
    if not _glued_keys(value):
        return value
    try:
        spaced = _read(_space_flow_colons(text))
    except YamlProblem:
        return value
    return value if _glued_keys(spaced) else spaced


def _glued_keys(value: Any) -> bool:
    """Whether ``value`` holds a mapping key like ``'data:1'`` with no value: a flow mapping's
    ``key:value`` typed without a space, which YAML reads as one key."""
    if isinstance(value, dict):
        return any((isinstance(k, str) and ":" in k and v is None) or _glued_keys(v)
                   for k, v in value.items())
    if isinstance(value, list):
        return any(_glued_keys(v) for v in value)
    return False


def _space_flow_colons(text: str) -> str:
    """``text`` with a space after the first colon of each entry of a flow mapping (``{a:1,b:[1,2]}`` ->
    ``{a: 1,b: [1,2]}``); quoted text and comments are copied as they are."""
    out: list[str] = []
    stack: list[list[Any]] = []  # per open bracket: [bracket, the entry's colon seen]
    quote = ""
    i = 0
    while i < len(text):
        c = text[i]
        out.append(c)
        if quote:
            if c == quote and quote == "'" and text[i + 1:i + 2] == "'":  # '' inside single quotes
                out.append("'")
                i += 1
            elif c == quote:
                quote = ""
            elif c == "\\" and quote == '"':
                out.append(text[i + 1:i + 2])
                i += 1
        elif c in "'\"":
            quote = c
        elif c == "#" and (i == 0 or text[i - 1].isspace()):
            end = text.find("\n", i)
            end = len(text) if end < 0 else end
            out.append(text[i + 1:end])
            i = end - 1
        elif c in "{[":
            stack.append([c, False])
        elif c in "}]" and stack:
            stack.pop()
        elif c == "," and stack:
            stack[-1][1] = False
        elif c == ":" and stack and stack[-1][0] == "{" and not stack[-1][1]:
            stack[-1][1] = True
            if text[i + 1:i + 2] not in ("", " ", "\t", "\n", ",", "}"):
                out.append(" ")
        i += 1
    return "".join(out)


def _read(text: str) -> Any:
    """:func:`read_plain` without the flow-colon reading."""
    loader = BoundedLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as err:
        raise YamlProblem(_yaml_problem(err)) from None
    except RecursionError:
        raise YamlProblem("nested too deeply to be a configuration") from None
    finally:
        loader.dispose()


def _yaml_problem(err: yaml.YAMLError) -> str:
    """One line for a YAML error: where, and what (a tag: that a config holds plain values only)."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return str(err)
    mark = err.problem_mark or err.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    problem = str(err.problem or err.context)
    tag = re.search(r"constructor for the tag '([^']*)'", problem)
    if tag:
        name = tag.group(1).replace("tag:yaml.org,2002:", "!!")
        return (f"{where}the tag {name} is not allowed: a config holds plain values (numbers, strings, "
                "true/false, null, lists and mappings), never objects")
    return f"{where}not valid YAML ({problem})"
