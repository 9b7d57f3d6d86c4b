"""``hybridpar.parallelize``: the user's entry point, an ordinary model and a spec -> an :class:`Engine`.

Why above the engine: the spec may be ``"auto"``, which asks the advisor (:mod:`hybridpar.auto_layout`,
over the performance model, which itself builds engines to calibrate); the engine's own package stays
below both.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import nn

from hybridpar.auto_layout import auto_spec
from hybridpar.pipeline.engine import Engine
from hybridpar.planner import ParallelSpec, load_spec


def parallelize(model: nn.Module, spec: ParallelSpec | dict | str | Path, loss_fn: Callable | None = None,
                *, input_shape: Sequence[int] | None = None, overlap: bool = False,
                bucket_bytes: int = 25 << 20, defer_weight_grads: bool = True,
                memory_format: torch.memory_format = torch.contiguous_format,
                spec_out: str | Path | None = None) -> Engine:
    """Make ``model`` hybrid-parallel per ``spec``.

    ``spec`` is a :class:`ParallelSpec`, a dict of the YAML's shape, a path to the YAML file, or
    ``"auto"``: the layout :mod:`hybridpar.advisor` predicts fastest for ``input_shape`` on this job's
    ranks, device memory and machine calibration (:mod:`hybridpar.auto_layout`), printed by the first
    rank with the runners-up and, given ``spec_out``, written there as YAML. The
    engine is built from ``input_shape`` (global N, C, D, H, W) or from the first batch it sees.
    ``defer_weight_grads``: a stage's last backward sends its input gradient before computing its
    weight gradients, where that costs no peak memory (:mod:`hybridpar.pipeline.deferred`); False
    runs every backward in one pass.
    ``HYBRIDPAR_TRANSPORT=mpi`` selects MPI for stage-to-stage traffic as it does for halos (ranks
    started by mpirun; between CPU ranks of one host it copies through shared memory, where gloo goes
    through TCP loopback). The job's process group must exist:
    ``hybridpar.init_distributed()`` first (a plain process gets a one-rank group).
    ``memory_format``: ``torch.channels_last_3d`` runs the activations NDHWC (input shards and
    activations received from the previous stage are in it; the layers keep it).

    Every rank's parameters and buffers of ``model`` become those of rank 0 (a broadcast, as DDP does at
    construction), so ranks that seeded or loaded their own weights still train one model; load a
    checkpoint into the engine (``load_full_state_dict``) or into the model on every rank before this call.
    """
    if isinstance(spec, str) and spec == "auto":
        spec = auto_spec(model, input_shape, spec_out)
    elif isinstance(spec, (str, Path)):
        spec = load_spec(spec)
    elif isinstance(spec, dict):
        spec = ParallelSpec.from_dict(spec)
    return Engine(model, spec, loss_fn, input_shape, overlap, bucket_bytes, defer_weight_grads, memory_format)
