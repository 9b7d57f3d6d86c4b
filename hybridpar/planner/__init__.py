"""The per-layer parallelism spec: how many replicas, stages and spatial shards, and for which layers.

Why a package of its own: the spec is the one place where a user's intent (a small YAML file) meets
the model and the world size, and every mistake it can hold should surface here, before a single
process starts, with a message that prints the arithmetic and says what would fit.

* :mod:`~hybridpar.planner.config`: YAML -> typed dataclasses (``GridSpec``, ``PipelineSpec``,
  ``LayerRule``, ``ParallelSpec``), validated when built.
* :mod:`~hybridpar.planner.graph`: the model traced by torch.fx into nodes with their inputs.
* :mod:`~hybridpar.planner.analysis`: a model on a global input analysed once (graph, shapes, FLOPs,
  memoised halos), so that many specs can be resolved against it.
* :mod:`~hybridpar.planner.stages`: where pipeline stages begin and what crosses each cut.
* :mod:`~hybridpar.planner.plan`: the spec resolved against a model and a global input shape, one
  ``LayerPlan`` per graph node (split, stage, shapes, halos, FLOPs, activation bytes).
* :mod:`~hybridpar.planner.explain`: that plan as a table (``python -m hybridpar.planner explain`` and
  ``Engine.explain()`` print it) and the three-line banner a run prints.
* :mod:`~hybridpar.planner.cli_args`: the ``--model`` and ``--input-shape`` arguments the commands share.

Example::

    grid: {data: 2, pipe: 2, spatial: [2, 1, 1]}   # -1 in one place = the ranks left over
    pipeline: {schedule: gpipe, microbatches: 4, stages: auto, recompute: false}
    layers:                                         # names or globs: an exact name, else the first glob
      "head.*": {spatial: replicate}
    strict: false   # true: refuse a layer too small to split instead of replicating it (marked ! in explain)
"""

from hybridpar.planner.analysis import sequential_layers
from hybridpar.planner.config import (
    REPLICATE,
    SCHEDULES,
    GridSpec,
    LayerRule,
    ParallelSpec,
    PipelineSpec,
    SpecError,
    load_spec,
)
from hybridpar.planner.explain import explain, format_plan
from hybridpar.planner.plan import build_plan
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.stages import balance_stages

__all__ = [
    "REPLICATE",
    "SCHEDULES",
    "GridSpec",
    "LayerPlan",
    "LayerRule",
    "ParallelSpec",
    "PipelineSpec",
    "SpecError",
    "balance_stages",
    "build_plan",
    "explain",
    "format_plan",
    "load_spec",
    "sequential_layers",
]
