"""Which per-layer setting applies to a layer: the one precedence rule of layer-name globs.

Why one module: a spec's ``layers:`` rules and ``count_sharded``'s splits both map module names or
globs (``"features.*"``) to a setting; one YAML must mean one thing in both. The rule: a setting
given under a layer's exact name wins; otherwise the first glob, in the order given, that matches it
(``fnmatch``, case-sensitive). Torch-free and import-free, so both the planner and the FLOP counter
read it without depending on each other.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence


def rule_for(name: str, patterns: Sequence[str]) -> int | None:
    """The index in ``patterns`` of the one that rules ``name`` (see the module doc), or None."""
    for i, pattern in enumerate(patterns):
        if pattern == name:
            return i
    return next((i for i, pattern in enumerate(patterns) if fnmatch.fnmatchcase(name, pattern)), None)


def matches(name: str, pattern: str) -> bool:
    """Whether ``pattern`` (a name or a glob) selects ``name``."""
    return pattern == name or fnmatch.fnmatchcase(name, pattern)
