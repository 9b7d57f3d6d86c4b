"""The plan of a model torch.fx cannot trace, run by module swapping (:mod:`hybridpar.pipeline.swap`).

Why: ``explain`` and the engine need a plan for such a model too. Without the graph, the layers are
found by a forward on the meta device with hooks on every module that runs as one layer: one record
per call, in call order, each registered layer on a split input under the grid's split (module
swapping runs every layer under one split), the rest replicated. The calls between the layers are
met as :mod:`hybridpar.planner.calls` says, followed by the same
:class:`~hybridpar.planner.layout_watch.LayoutWatch` the run subclasses
(:mod:`hybridpar.pipeline.split_forward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten

from hybridpar import flops as flop_count
from hybridpar.call_keys import call_key
from hybridpar.nn import families, registry
from hybridpar.nn.meta import CarriedState, meta_call, meta_hint, meta_state, meta_stop
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.planner import calls
from hybridpar.planner.analysis import REPLICATED, leaf_flop_sums, node_halos
from hybridpar.planner.batch_flow import refuse_batch_flow
from hybridpar.planner.layout_watch import LayoutWatch
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.terms import SpecError, Split
from hybridpar.user_lines import line_of

users = registry.users_own  # the user's own module: its calls followed one by one (planner.calls)


def leave_whole(shapes: list[tuple[int, ...] | None]) -> bool:
    """Whether what a forward returns (per leaf, the global shape of a split tensor, None for any other
    value) leaves whole, every split one gathered: split tensors of different extents, one that is
    not N, C, D, H, W (a channel squeezed away), or split ones beside values that are not (deep
    supervision's outputs at several scales). The loss then reads them whole, as a traced forward's
    (whose graph gathers such outputs); one extent over every output stays split."""
    split = [s for s in shapes if s is not None]
    return bool(split) and (len(split) != len(shapes) or len({s[-3:] for s in split}) > 1
                            or any(len(s) != 5 for s in split))


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that run as one layer: registered ones (not traced into), split layers (a registered
    layer's counterpart after swapping, which may hold modules of its own: neuraloperator's spectral
    weights), childless ones not of the user's own type (:func:`users`: whose calls are followed
    one by one), and torch's layers that hold modules yet compute as one (attention:
    :func:`hybridpar.nn.families.one_layer_with_children`), as a traced graph sees them: what they do
    across the samples is :func:`hybridpar.nn.samples.module_across`'s to say, not the transposes
    inside. The plan walks the model and a run its swapped copy: both must see the same layers."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            parent = any(True for _ in child.children())
            if registry.lookup(child) is not None or isinstance(child, SpatialLayer) or \
                    families.one_layer_with_children(child) or not (parent or users(child)):
                out.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return out


def nested_block(m: nn.Module | None) -> bool:
    """Whether ``m``, a node of a traced graph, is a module of the user's own type that the graph keeps
    whole (torch.fx could not trace into it, or it holds parameters or buffers of its own): it runs
    its own forward, split, by module swapping inside itself (:mod:`hybridpar.pipeline.split_forward`)."""
    return m is not None and users(m)


def swapped_plan(model: nn.Module, input_shape: Sequence[int], split: Split,
                 micro: int, nested: bool = False, strict: bool = False) -> list[LayerPlan]:
    """One record per call of a leaf module, or of a function that stands for a layer
    (``F.interpolate``), on a meta forward of the global input, in call order: those on a split
    input under ``split``, the rest replicated. Fails with a :class:`SpecError` naming the call and
    its line when the forward does not run on the meta device (it branches on tensor values), a
    layer nobody registered reads a split activation, or a call outside the layers cannot run split
    (:mod:`hybridpar.planner.calls`). The input is split under ``split``; shape reads answer with
    global extents at run time (:mod:`hybridpar.pipeline.split_forward`), as a traced graph's do.
    ``nested``: ``model`` is a block inside a traced graph. A layer too small to split runs whole on
    the gathered volume, as a traced plan replicates it; ``strict`` refuses it instead."""
    records, modules, _, _ = _follow(model, input_shape, split, micro, nested, strict)
    sums = leaf_flop_sums(flop_count.count(model, tuple(input_shape)), [(r.name, None) for r in records])
    return [dataclasses.replace(r, flops=f[0], train_flops=f[0] + f[1] + f[2],
                                activation_bytes=BYTES_PER_ELEMENT * math.prod(r.local_output_shape),
                                rank_share=rank_share(m, r.input_shape, r.output_shape, r.local_output_shape,
                                                      r.split),
                                transpose_bytes=transpose_bytes(m, r.input_shape, r.split, micro))
            for r, f, m in zip(records, sums, modules, strict=True)]


def calls_met(model: nn.Module, input_shape: Sequence[int], split: Split, micro: int) -> list[str]:
    """What each call outside the layers of a forward run by module swapping does to split activations
    (:func:`hybridpar.planner.calls.role_of`), with its line and count, in first-call order: the rows
    ``explain`` prints beside the layers."""
    watch = _follow(model, input_shape, split, micro)[2]
    return [f"{what} at {line}" + (f" (x{n})" if n > 1 else "") for (what, line), n in watch.met.items()]


def refuse_parts(model: nn.Module, input_shape: Sequence[int], split: Split, part: int) -> None:
    """Refuse a forward whose parts of ``part`` samples of a batch of ``input_shape`` compute otherwise
    than the whole batch (the :class:`SpecError` of :func:`swapped_plan` on them, batch flow included)."""
    _follow(model, input_shape, split, part)


def nested_output_split(block: nn.Module, input_shape: Sequence[int], split: Split, micro: int) -> bool:
    """Check that ``block``, a node of a traced graph run by module swapping on a split input of global
    ``input_shape``, runs split (the :class:`SpecError` of :func:`swapped_plan` if not), and say whether
    its output is split (a block ending in a reduction over the volume returns a replicated value). A
    layer in it too small to split is refused (:class:`~hybridpar.planner.analysis.TooSmallToSplit`):
    the traced plan around the block then replicates the block, or refuses it where the spec is strict."""
    return bool(_follow(block, input_shape, split, micro, nested=True, strict=True)[3][1][:1] == [True])


def judge_registered(m: nn.Module, input_shape: Sequence[int], micro: int, name: str) -> None:
    """Refuse layer ``m`` (:func:`hybridpar.nn.samples.judged_by_forward`), met on an input of global
    ``input_shape`` whose batch runs in micro-batches of ``micro``, where its own forward works across
    the samples (as a BatchNorm would, refused there alike: ``pipeline/step_state.py``)."""
    _JUDGING.append(True)
    try:
        _follow(m, input_shape, REPLICATED, micro, nested=True, strict=True)
    except SpecError as err:
        raise SpecError(f"{name} ({type(m).__name__}), a registered layer whose own forward works across "
                        f"the samples of the batch, which micro-batches hold apart (its split layer would "
                        f"see one micro-batch's; use pipeline.microbatches 1, or accept per-micro-batch "
                        f"statistics with pipeline: {{micro_batch_stats: true}}): {err}") from None
    finally:
        _JUDGING.pop()


def returned(model: nn.Module, input_shape: Sequence[int], split: Split
             ) -> tuple[list[Any], list[bool], TreeSpec]:
    """What a forward run by module swapping returns on the volume of ``input_shape`` (meta tensors,
    as leaves of their structure), and whether each is split under ``split`` (a volume the forward
    reduced, flattened or gathered is not)."""
    return _follow(model, input_shape, split, input_shape[0])[3]


Followed = tuple[  # the records, their modules, the watch, what the forward returns
    list[LayerPlan], list[nn.Module], LayoutWatch, tuple[list[Any], list[bool], TreeSpec]]
_JUDGING: list[bool] = []  # within judge_registered: a registered layer's own forward followed
_FOLLOWED: list[dict] = []  # within one_plan: each forward followed, by its arguments


@contextlib.contextmanager
def one_plan() -> Iterator[None]:
    """Within it, a forward is followed once for each set of arguments: a build asks of one forward
    what it calls (the plan), then what it returns (the stage) and whether a block's output is split
    (each node of the graph that holds it), and the model does not change while it is built."""
    _FOLLOWED.append({})
    try:
        yield
    finally:
        _FOLLOWED.pop()


def _follow(model: nn.Module, input_shape: Sequence[int], split: Split, micro: int, nested: bool = False,
            strict: bool = False
            ) -> Followed:
    """The records of :func:`swapped_plan` (FLOPs not counted), their modules, the watch that
    followed the forward, and what it returns (:func:`returned`); raises what the forward does that
    cannot run split. ``nested``: a node of a traced graph, which may call no layer at all."""
    key = (id(model), tuple(input_shape), tuple(split), micro, nested, strict,
           tuple(m.training for m in model.modules()))  # a forward may branch on self.training
    if _FOLLOWED and key in _FOLLOWED[-1]:
        return _FOLLOWED[-1][key][1]
    found = _follow_once(model, input_shape, split, micro, nested, strict)
    if _FOLLOWED:  # the model kept with it: no other object takes its id while the plan is made
        _FOLLOWED[-1][key] = (model, found)
    return found


def _follow_once(model: nn.Module, input_shape: Sequence[int], split: Split, micro: int, nested: bool,
                 strict: bool
                 ) -> Followed:
    records: list[LayerPlan] = []
    modules: list[nn.Module] = []  # the module of each record
    names = dict((m, n) for n, m in leaves(model))
    watch = LayoutWatch(split, batch_apart=micro < input_shape[0])
    watch.judging, watch.part = bool(_JUDGING), micro
    count: dict[str, int] = {}

    def add(name: str, m: nn.Module, x: torch.Tensor, out: torch.Tensor, runs_split: bool, halo) -> None:
        entry = registry.lookup(m)
        s = split if runs_split else REPLICATED
        out_split = REPLICATED if out.dim() != 5 or entry is None or entry.replicated_output(m) else s
        count[name] = count.get(name, -1) + 1  # the k-th further call is "name#k", as in a graph
        modules.append(m)
        records.append(LayerPlan(
            name=call_key(name, count[name]),
            kind=type(m).__name__, stage=0, split=s, rule=None, input_shape=tuple(x.shape),
            output_shape=tuple(out.shape), local_input_shape=local_shape(tuple(x.shape), micro, s),
            local_output_shape=local_shape(tuple(out.shape), micro, out_split),
            halo=halo,
            params=sum(p.numel() for p in m.parameters()), flops=0, activation_bytes=0, redistribute=False,
            inputs=(records[-1].name,) if records else ("(input)",), out_split=out_split))

    def function(name: str, m: nn.Module, x: torch.Tensor, out: torch.Tensor, runs_split: bool) -> None:
        if isinstance(out, torch.Tensor):
            s = split if runs_split else REPLICATED
            add(name, m, x, out, runs_split,
                node_halos(name, m, registry.lookup(m), tuple(x.shape), tuple(out.shape), s))

    def record(m: nn.Module, args: tuple, out: object) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and not isinstance(out, torch.Tensor):  # a GRU's (output, state): no record
            watch.after_layer(m, x, out, False)
        if x is None or not isinstance(out, torch.Tensor):
            return
        entry = registry.lookup(m)
        if entry is None and any(isinstance(a, torch.Tensor) and a in watch.split for a in args):
            raise SpecError(f"{names[m]} ({type(m).__name__}): {registry.unregistered(m)} and its "
                            f"input is split {list(split)}: register it (hybridpar.nn.register) so that the "
                            f"model can run by module swapping")
        # runs whole on the gathered volume (or on a whole first input, any split one after it gathered)
        gathers = watch.needs_whole(m, x) or x not in watch.split and any(watch.read_whole(m, args))
        if gathers and strict and entry is not None and entry.splittable and x in watch.split:
            node_halos(names[m], m, entry, tuple(x.shape), tuple(out.shape), split)  # says what would fit
        runs_split = watch.runs_split(m, x) and not gathers  # on a replicated input (a pooled gate), whole
        if watch.splits and not runs_split and entry is not None and entry.splittable and x.dim() == 5 \
                and not watch.unsafe and calls.in_checkpoint():  # a recomputation sees no split
            raise SpecError(f"model ({type(model).__name__}): {names[m]} ({type(m).__name__}) runs on a "
                            f"value that is not split inside torch.utils.checkpoint, whose recomputation in "
                            f"the backward runs it as on a shard (checkpoint it on the split volume only, or "
                            f"use pipeline.recompute)")
        watch.after_layer(m, x, out, runs_split)
        try:
            halo = node_halos(names[m], m, entry, tuple(x.shape), tuple(out.shape),
                              split if runs_split else REPLICATED)
        except SpecError:  # on what a function unsafe on shards computed (x.mean(...)): that is the error;
            if watch.unsafe and x not in watch.split:  # on a split activation, the layer's own refusal
                raise unsafe_error(model, watch) from None
            raise
        add(names[m], m, x, out, runs_split, halo)
        if gathers:
            records[-1] = dataclasses.replace(records[-1], gather=True)

    watch.on_function = function
    handles = watch.hook(names, on_leave=record)
    state, dtype = meta_state(model, grads=True)  # as a training step: hooks, grad_fn, requires_grad
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if nested:  # a block's input is a layer's output in training: it has a gradient, and is no leaf
        x = x.requires_grad_().clone()
    if split != REPLICATED:
        watch.mark(x, tuple(input_shape[2:]))
    if watch.batch_apart:
        watch.batched[x], watch.batch = True, input_shape[0]
    try:
        with watch:
            outs, spec = tree_flatten(meta_call(model, state, x))
        watch.kept_picks(outs)
        shapes = [tuple(t.shape) if isinstance(t, torch.Tensor) and t in watch.split else None for t in outs]
        whole = leave_whole(shapes)
        out_split = (outs, [s is not None and not whole for s in shapes], spec)
    except (SpecError, CarriedState) as err:
        raise err if isinstance(err, SpecError) else SpecError(str(err)) from None
    except Exception as err:
        where = records[-1].name if records else "its first layer"
        why, hint = meta_stop(err) or (f"{type(err).__name__}: {err}", meta_hint(str(err)))
        raise SpecError(f"model ({type(model).__name__}): neither torch.fx nor a run on the meta device can "
                        f"follow its forward (after {where}, at {line_of(err)}: {why}); {hint}"
                        ) from err
    finally:
        for h in handles:
            h.remove()
    if not records and not nested:
        raise SpecError(f"model ({type(model).__name__}): no layer ran in its forward")
    if watch.unsafe:
        raise unsafe_error(model, watch)
    if watch.batch_apart:  # a part runs the forward on its samples: the same calls as on the whole?
        refuse_batch_flow(model, input_shape, micro, nested, watch.followed())
    if watch.gathered and (not dist.is_initialized() or dist.get_rank() == 0):  # said once per job
        calls_ = ", ".join(dict.fromkeys(watch.gathered))
        warnings.warn(f"hybridpar: model ({type(model).__name__}), run by module swapping, calls {calls_} on "
                      f"split activations, which cannot run on shards: each runs on the volume gathered onto "
                      f"every rank (exact, but each holds the whole volume there)", stacklevel=3)
    return records, modules, watch, out_split


def unsafe_error(model: nn.Module, watch: LayoutWatch) -> SpecError:
    what = ", ".join(dict.fromkeys(watch.unsafe))
    return SpecError(f"model ({type(model).__name__}): run by module swapping, its forward calls {what} "
                     f"on split activations outside any layer, which neither shards nor the gathered volume "
                     f"compute as one process does (hybridpar/README.md says what may be called there); use "
                     f"a layer instead, or make the forward traceable by torch.fx")
