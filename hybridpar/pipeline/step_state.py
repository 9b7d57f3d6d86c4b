"""State a training step over micro-batches would move more often than one process does.

Why: one process runs a forward once per batch, so a norm layer's running statistics, a step counter
or an EMA the forward keeps in a buffer move once per ``train_step``. The engine runs the forward once
per micro-batch: those buffers would move ``microbatches`` times per step, silently drifting from the
single-process run (a counter at 6 after 3 steps, eval predictions off). Both kinds are refused, in
one line naming the layer or buffer, alike on every rank:

* norm layers the engine knows (:func:`micro_batch_norms`): a BatchNorm (whose micro-batch statistics
  also differ from its batch's) and any norm tracking running statistics (InstanceNorm with
  ``track_running_stats=True``), unless the spec accepts per-micro-batch statistics
  (``pipeline: {micro_batch_stats: true}``, GPipe's);
* any other buffer the forward changes (:class:`BufferWatch`): found exactly by value, on the first
  micro-batched step in training mode. Its buffers are cloned before it and compared after it; a
  change restores the clones (the state is as before the step) and raises. It is checked once: a
  comparison every step would cost a copy of every buffer per step, and a forward that updates a
  buffer does so from its first training step in every model we know of (a buffer that only starts
  moving later is not caught).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from hybridpar.nn.buffer_state import Snapshot
from hybridpar.nn.families import moves_per_forward, uses_batch_statistics
from hybridpar.nn.sharing import return_rebound
from hybridpar.planner.terms import SpecError

Layers = Sequence[tuple[str | None, nn.Module]]


def _join(*parts: str | None) -> str:
    return ".".join(p for p in parts if p)


def micro_batch_norms(layers: Layers) -> list[tuple[str, nn.Module]]:
    """This stage's norm layers that micro-batches change, by name
    (:func:`~hybridpar.nn.families.moves_per_forward`)."""
    return [(_join(n, k), s) for n, m in layers for k, s in m.named_modules() if moves_per_forward(s)]


def refuse_micro_batch_norms(norms: list[tuple[str, nn.Module]], microbatches: int, what: str) -> None:
    """Raise :class:`SpecError` naming the first norm in training mode that micro-batches would change.

    Every rank of a stage holds the same layers, and every stage is checked before any collective, so
    each rank raises (a stage without such a norm passes, and its peers are refused at once)."""
    found = next(((n, s) for n, s in norms if s.training), None)
    if found is None:
        return
    name, s = found
    name = name or "the model"
    accept = ("or accept micro-batch statistics (GPipe's) with pipeline: {micro_batch_stats: true}")
    if uses_batch_statistics(s):
        raise SpecError(f"{what}: {name} is a BatchNorm, which would normalise each of the {microbatches} "
                        f"micro-batches by its own statistics, not its replica batch's; use "
                        f"pipeline.microbatches 1, GroupNorm or InstanceNorm, {accept}")
    raise SpecError(f"{what}: {name} ({type(s).__name__}) tracks running statistics, which would be "
                    f"updated once per each of the {microbatches} micro-batches, not once per batch as "
                    f"in one process; use pipeline.microbatches 1 or track_running_stats=False, {accept}")


class BufferWatch:
    """Refuses, once, a forward that changes a buffer other than the norms' (see module doc)."""

    def __init__(self) -> None:
        self.done = False
        self._before: Snapshot | None = None

    def start(self, layers: Layers, skip: Sequence[nn.Module]) -> None:
        """Record this stage's user buffers (the layers the model named; not those of ``skip``)."""
        skipped = {id(m) for m in skip}
        self._before = Snapshot((_join(n, mn), mod) for n, m in layers if n is not None
                                for mn, mod in m.named_modules() if id(mod) not in skipped)

    def finish(self, what: str, microbatches: int) -> None:
        """Compare, agree over the job (one exchange of names, once), restore and raise if any moved."""
        before, self._before, self.done = self._before, None, True
        changed = before.moved() if before is not None else []
        if before is not None:
            before.restore()
            return_rebound()  # the model's own slots as restored
        every: list[list[str]] = [changed]
        if dist.is_initialized() and dist.get_world_size() > 1:
            every = [[] for _ in range(dist.get_world_size())]
            dist.all_gather_object(every, changed)
        names = sorted({n for part in every for n in part})
        if names:
            plural = "s" * (len(names) > 1)
            raise SpecError(f"{what}: the forward changes buffer{plural} {', '.join(names)}, which would "
                            f"move once per each of the {microbatches} micro-batches, not once per batch "
                            f"as in one process (the step's buffers are restored); use "
                            f"pipeline.microbatches 1, or update it outside the forward (after train_step)")
