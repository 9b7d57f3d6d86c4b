"""Plain YAML: the values a configuration or spec file may hold, and nothing that could run or explode.

Why: a config is data. ``yaml.safe_load`` already refuses ``!!python`` tags, but its errors are
tracebacks and it expands aliases without limit: a 1 KB file of nested aliases ("billion laughs")
holds 10^9 values once read. :func:`read_plain` bounds the expansion and turns every problem into one
line naming where it is.
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
    what is wrong."""
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
