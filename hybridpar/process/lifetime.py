"""The process group's lifetime as the modules built on it see it: how long any wait for a peer may
last, and what to drop when the group ends.

Why a module of its own: the process grid creates sub-groups (which need the job's timeout) and caches
them (which must go when the group does), while :mod:`hybridpar.process.launchers`, which sets the
timeout and ends the group, imports the communication layer, which imports the grid. Keeping these two
facts here, with no imports from the package, lets the grid depend on them without depending on how the
job was launched.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

_TIMEOUT_S = [600.0]  # the job's collective timeout, set when init_distributed creates the group
_FORGET: list[Callable[[], None]] = []


def collective_timeout() -> timedelta:
    """How long any collective or transfer of this job waits for a peer: ``init_distributed``'s
    ``timeout_s``, given to every group hybridpar creates (``new_group`` would otherwise take
    torch's 30-minute default, not the default group's)."""
    return timedelta(seconds=_TIMEOUT_S[0])


def set_collective_timeout(seconds: float) -> None:
    """Record the job's collective timeout (``init_distributed`` does, when it creates the group)."""
    _TIMEOUT_S[0] = float(seconds)


def on_shutdown(forget: Callable[[], None]) -> None:
    """Have :func:`hybridpar.process.launchers.shutdown` call ``forget`` once the process group is
    destroyed: a module that caches what belongs to the group (the grids' sub-groups) drops it, so a
    later ``init_distributed`` makes its own."""
    _FORGET.append(forget)


def forget_group_state() -> None:
    """Run every hook given to :func:`on_shutdown` (the group is gone)."""
    for forget in _FORGET:
        forget()
