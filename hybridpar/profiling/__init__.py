"""Where the time of a training step goes: NVTX ranges, light per-category timers and chrome traces.

Why a package of its own: every part of the engine (layers, halo exchange, pipeline schedule, gradient
reduction, data loader, checkpointer) marks its work with the same :class:`range`, and three consumers
read those marks: Nsight Systems (through NVTX, the ``nvtx`` package: nearly free when no tool listens,
and unlike ``torch.cuda.nvtx`` it works on CPU-only builds), the per-step breakdown of a
:class:`StepTimer` (cheap enough to leave on), and torch.profiler chrome traces (:func:`trace`, on
request). ``python -m hybridpar.profiling.timeline`` merges the per-rank outputs. :mod:`.ranges`
holds the marks and the trace, :mod:`.timer` the accounting.

Accounting rules
----------------
* A range has a name and optionally one of :data:`CATEGORIES`. Time goes to the **innermost**
  category: entering ``halo`` inside ``compute`` pauses ``compute``; nothing is counted twice. A
  range without a category (e.g. one per layer) inherits the enclosing one.
* ``other`` is the step time not inside any categorised range, so a breakdown always sums to the
  step time.
* A timer is active in the thread that runs its step only; ranges on other threads (an async
  checkpoint writer) emit NVTX but are not timed, since their time overlaps the step's.
* Clocks: ``"cpu"`` reads ``time.perf_counter`` (host time: on a GPU it measures launches unless the
  code synchronises or ``sync=True``); ``"cuda"`` records a ``torch.cuda.Event`` at each category change
  and reads the device stream's timeline when the step is resolved: without ``sync`` that happens
  at a later step, when the events have completed (``poll``), or when :meth:`StepTimer.breakdown` is
  asked, which waits. ``"auto"`` picks ``"cuda"`` when CUDA is initialised.
"""

from hybridpar.profiling.ranges import CATEGORIES, current_timer, range, trace, where
from hybridpar.profiling.timer import StepRecord, StepTimer

__all__ = ["CATEGORIES", "StepRecord", "StepTimer", "range", "trace", "current_timer", "where"]
