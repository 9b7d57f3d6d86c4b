"""The planner's shared terms: the ``Split`` of a layer, ``SpecError`` and the helpers of its one-line
messages.

Why a module of its own: every part of the planner (reading the spec, tracing, analysing, planning,
staging) raises the same error and speaks of the same split; kept here, below all of them, none has to
import the spec reader (:mod:`.config`) to say so, and the spec reader can import the planner.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any

from hybridpar.axes import Split as Split  # re-exported: planner modules spell a split from here


class SpecError(ValueError):
    """A spec that cannot run as written; the message says where, why, and what would fit."""


def did_you_mean(word: Any, choices: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest choice, ignoring case; empty when nothing is near."""
    lower = {c.lower(): c for c in choices}
    near = difflib.get_close_matches(str(word).lower(), list(lower), n=1)
    return f" (did you mean {lower[near[0]]!r}?)" if near else ""


def check_keys(where: str, given: Mapping[Any, Any], valid: Sequence[str],
               error: type[ValueError] = SpecError) -> None:
    """Reject keys not in ``valid``, suggesting the nearest one (typos are the common case).

    Every YAML-to-dataclass reader checks its keys here (the spec's, the application's config with its
    own ``error`` type), so a typo reads the same wherever it is made.
    """
    for key in given:
        if key not in valid:
            hint = did_you_mean(key, valid)
            raise error(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")
