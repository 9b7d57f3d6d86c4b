"""A process-wide on/off switch with a context manager that flips it for a block.

Why process-wide rather than thread-local: on CUDA the autograd engine runs backward on its own
threads, which must see the switch the training loop set (gradient sync off during micro-batches,
"recomputing" during activation recomputation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Switch:
    """``switch.on`` is the current state; ``with switch.set(value):`` changes it for a block."""

    def __init__(self, on: bool) -> None:
        self.on = on

    @contextlib.contextmanager
    def set(self, on: bool) -> Iterator[None]:
        prev, self.on = self.on, on
        try:
            yield
        finally:
            self.on = prev
