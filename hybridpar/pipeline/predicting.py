"""Predicting with an engine: the last stage's outputs of an inference pass, whole or left split,
handed to every stage.

Why a part of its own: training ends in a loss every rank already agrees on; inference ends in
volumes, which the user wants whole on every rank (``gather=True``) or, for a box too big for one
rank, left split exactly as ``shard_batch`` lays out a target (``gather=False``). What goes where is
this module's business; running the forwards is the stepping part's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_unflatten

from hybridpar.call_keys import module_path
from hybridpar.comm.redistribute import gather as gather_volume
from hybridpar.nn import samples
from hybridpar.pipeline.batch import split_sizes
from hybridpar.pipeline.building import Built
from hybridpar.pipeline.model_mode import ModelMode
from hybridpar.pipeline.stage import REPLICATED, swapped_outputs
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.terms import Split

Returned = tuple[list[LayerPlan], TreeSpec | None, Split]


def returned_in(built: Built, size: tuple[int, ...], training: bool, caller: str,
                batch: int | None = None) -> Returned:
    """The rows, structure and split of what the forward returns at ``size`` (C, D, H, W) in mode
    ``training``: the stage's, unless a forward run by module swapping was built in the other mode,
    where what it returns may differ (deep supervision's outputs at several scales in training, one
    volume in eval); then as the model's copy on the meta device returns it in this mode (memoised).
    ``batch``: this replica's, whose parts are checked first (:func:`refuse_other_batch`)."""
    if batch is not None:
        refuse_other_batch(built, size, batch, training, caller)
    stage, sizes = built.stage, built.sizes
    if stage.output_rows is not None or sizes.model is None or sizes.model.training == training:
        return stage.outputs, stage.output_spec, stage.output_split
    key = (tuple(size), training)
    if key not in built.returns:
        with sizes.in_mode(training):
            sizes.check_mode(size, caller)
            last = sizes.at(size, caller)[-1]
            built.returns[key] = swapped_outputs(sizes.model, last, stage.input_split, sizes.shape(size))
    return built.returns[key]


def refuse_other_batch(built: Built, size: tuple[int, ...], batch: int, training: bool, caller: str) -> None:
    """Refuse a forward whose parts of this replica's ``batch`` (its micro-batches; with the other
    replicas', the global batch) run other calls than the whole global batch, where that batch is not
    the build's (whose parts the build compared), in mode ``training``."""
    sizes = built.sizes
    whole = batch * built.layout.axes.data
    parts = sorted(set(split_sizes(batch, sizes.spec.pipeline.microbatches)) - {whole})
    if not parts or sizes.model is None or whole == sizes.batch:  # the build's (or check_mode's) batch
        return
    sizes.check_batch(size, whole, parts, training, caller)


def refuse_other_returns(built: Built, size: tuple[int, ...], training: bool, batch: int,
                         mode: ModelMode | None = None, caller: str = "Engine.train_step") -> None:
    """Refuse a training step in the mode the engine was not built in where the forward then returns
    other outputs (another structure, shape or split): its loss, targets and gradients are laid out
    for the built mode's; one whose parts of this replica's ``batch`` run other calls; and one where a
    batch norm of the model (``mode``'s, while the user holds it) sees one value per channel on a part."""
    refuse_single_values(built, size, batch, training, mode.model() if mode is not None else None, caller)
    got = returned_in(built, size, training, caller, batch)
    stage = built.stage
    if got[1:] != (stage.output_spec, stage.output_split) or [r.output_shape for r in got[0]] != [
            r.output_shape for r in stage.outputs]:
        built_in, now = ("eval", "training") if training else ("training", "eval")
        raise ValueError(f"{caller}: the model's forward returns other outputs in {now} mode than in "
                         f"{built_in} mode, which the engine was built in (its loss and targets are laid out "
                         f"for those); train in {built_in} mode (model.train({not training}))")


def refuse_single_values(built: Built, size: tuple[int, ...], batch: int, training: bool,
                         model: nn.Module | None, caller: str) -> None:
    """Refuse a training step where a batch norm would see one value per channel on a part of this
    replica's ``batch`` (its smallest micro-batch) that the plan, made at the build's batch and mode,
    did not meet (a smaller batch; a model put in training after an eval build): it would fail inside
    the forward after the norms before it moved their statistics (:func:`samples.single_values`). The
    modes are ``model``'s, or ``training`` for each of the meta copy's; once per size, part and mode."""
    sizes = built.sizes
    part = min(split_sizes(batch, sizes.spec.pipeline.microbatches))
    key = ("single values", tuple(size), part, training)
    if not training or sizes.model is None or key in sizes.checked:
        return
    modules, plan = dict((model or sizes.model).named_modules()), sizes.at(size, caller)
    with sizes.in_mode(training):
        for row in plan:
            m = modules.get(module_path(row.name))
            if m is not None and type(m).__name__ == row.kind and (
                    why := samples.single_values(m, tuple(row.input_shape), part, sizes.batch)):
                raise ValueError(f"{caller}: {row.name}: {why}")
    sizes.checked.add(key)


def outputs(built: Built, returned: Returned, outs: list[list[Any]], batch: int, gather: bool,
            dtype: torch.dtype, device: torch.device) -> Any:
    """The model's outputs (``returned``: their rows, structure and split, :func:`returned_in`), in the
    structure it returns them in, from ``outs`` (the last stage's outputs of each micro-batch,
    flattened; empty on other stages): on the last stage, the micro-batches joined and split volumes
    gathered where ``gather``; on the other stages, received from the last one, except split volumes
    left split (those stages hold None in their place)."""
    grid = built.layout.grid
    rows, spec, out_split = returned
    last = grid.pipe_index == grid.pipe - 1
    ys = []
    for k, rec in enumerate(rows):
        split = out_split != REPLICATED and len(rec.output_shape) == 5
        batched = _carries_batch(rec, built.sizes.batch)
        if last:
            y = _joined([leaves[k] for leaves in outs], k, batched)
            if split and gather:  # whole volumes
                y = gather_volume(y, built.layout.of(out_split), tuple(rec.output_shape[2:]))
        elif split and not gather:
            y = None  # the last stage holds the shards
        else:
            shape = (batch, *rec.output_shape[1:]) if batched else tuple(rec.output_shape)
            y = torch.empty(shape, dtype=dtype, device=device)
        if grid.pipe > 1 and (gather or not split):
            dist.broadcast(y, built.transport.peer(grid.pipe - 1), group=grid.pipe_group)
        ys.append(y)
    return ys[0] if spec is None else tree_unflatten(ys, spec)


def _carries_batch(rec: LayerPlan, batch: int) -> bool:
    """Whether returned value ``rec`` holds the batch along dim 0: planned at the built batch, its dim 0
    is that batch (a value of no batch, a shape vector or a penalty of the weights, has its own)."""
    return len(rec.output_shape) >= 1 and rec.output_shape[0] == batch


def _joined(parts: list[torch.Tensor], k: int, batched: bool) -> torch.Tensor:
    """Output ``k`` of each micro-batch joined along the batch where it holds one (``batched`` and its
    parts add up to it); any other (a 0-d penalty of the weights, the volume's extents as a vector) is
    one value for all of them, refused where the micro-batches give different ones (one process
    computes it over the whole batch, which no micro-batch holds); a value that is not a tensor (the
    None a VAE returns for its loss in eval) is returned as it is."""
    if not isinstance(parts[0], torch.Tensor):
        return parts[0]
    if batched and parts[0].dim():
        return torch.cat(parts)
    if any(p.shape != parts[0].shape or not torch.equal(p, parts[0]) for p in parts[1:]):
        raise ValueError(f"Engine.predict: output {k} of shape {tuple(parts[0].shape)}, which does not hold "
                         f"the batch along dim 0, differs between the micro-batches (one process computes "
                         f"it over the whole batch, which no micro-batch holds); return it per sample, "
                         f"(N, ...)")
    return parts[0]
