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
* any other buffer the forward changes (:class:`BufferWatch`): found exactly by value on the first
  micro-batched step in training mode, whose buffers are cloned before it and compared after it; a
  change restores the clones (the state is as before the step) and raises. Every later such step
  follows the slots and version counters (no copy): a buffer first written then (a warm-up's counter)
  is refused too, its values as the micro-batches left them. Only the slots the first step wrote with
  the values they held (a coordinate grid rewritten alike) are compared by value every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist
from torch import nn

from hybridpar.comm.flags import any_rank
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
    """Refuses a forward that changes a buffer other than the norms' (see module doc)."""

    def __init__(self) -> None:
        self.done = False  # the first micro-batched training step compared every buffer by value
        self._before: Snapshot | None = None
        self._alike: set[tuple[int, str]] = set()  # (module, slot) that step wrote with the values it held

    def start(self, layers: Layers, skip: Sequence[nn.Module]) -> None:
        """Record this stage's user buffers (the layers the model named; not those of ``skip``): every
        one's values at the first step, afterwards those of the slots that step wrote alike."""
        skipped = {id(m) for m in skip}
        compare = (lambda m, slot: (id(m), slot) in self._alike) if self.done else None
        self._before = Snapshot(((_join(n, mn), mod) for n, m in layers if n is not None
                                 for mn, mod in m.named_modules() if id(mod) not in skipped), compare)

    def finish(self, what: str, microbatches: int) -> None:
        """Compare, agree over the job, restore and raise if any moved: at the first step by value (one
        exchange of names), afterwards by version counter and slot (one all-reduce of a flag)."""
        before, self._before = self._before, None
        first, self.done = not self.done, True
        if before is None:
            return
        changed, touched = before.moved(), before.touched()
        if first:
            self._alike = {(id(m), slot) for m, slot, _ in touched}
        late = [name for m, slot, name in touched if (id(m), slot) not in self._alike]
        before.restore()
        return_rebound()  # the model's own slots as restored
        names, late = _every(changed + late, first), set(_every(late, first))
        if not names:
            return
        plural = "s" * (len(names) > 1)
        if late:
            it = "they" if plural else "it"
            raise SpecError(f"{what}: the forward changed buffer{plural} {', '.join(names)} at this step, "
                            f"not at the first micro-batched one: {it} moved once per "
                            f"each of the {microbatches} micro-batches, not once per batch as in one process "
                            f"(the values written in place are not restored: resume from a checkpoint); use "
                            f"pipeline.microbatches 1, or update it outside the forward (after train_step)")
        raise SpecError(f"{what}: the forward changes buffer{plural} {', '.join(names)}, which would "
                        f"move once per each of the {microbatches} micro-batches, not once per batch "
                        f"as in one process (the step's buffers are restored); use "
                        f"pipeline.microbatches 1, or update it outside the forward (after train_step)")


def _every(names: list[str], exchange: bool) -> list[str]:
    """``names`` found on any rank of the job, sorted: exchanged, or (``exchange`` False) exchanged only
    where any rank has one (:func:`~hybridpar.comm.flags.any_rank`)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sorted(set(names))
    if not exchange and not any_rank(bool(names)):
        return []
    every: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, names)
    return sorted({n for part in every for n in part})
