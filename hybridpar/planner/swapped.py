"""The plan of a model torch.fx cannot trace, run by module swapping (:mod:`hybridpar.pipeline.swap`).

Why: ``explain`` and the engine need a plan for such a model too. Without the graph, the layers are
found by a forward on the meta device with hooks on every module that runs as one layer: one record
per call, in call order, each registered layer on a split input under the grid's split (module
swapping runs every layer under one split), the rest replicated. The calls between the layers are
met as :mod:`hybridpar.planner.calls` says, the same table the run follows
(:mod:`hybridpar.pipeline.split_forward`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar import flops as flop_count
from hybridpar.call_keys import call_key
from hybridpar.nn import registry
from hybridpar.nn.meta import CarriedState, meta_call, meta_state
from hybridpar.nn.spatial import SpatialLayer
from hybridpar.planner import calls, per_sample
from hybridpar.planner.analysis import REPLICATED, leaf_flop_sums, node_halos
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.space_maps import STEPS, NotLocal, close, source_dims, step
from hybridpar.planner.terms import SpecError, Split

users = registry.users_own  # the user's own module: its calls followed one by one (planner.calls)


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that run as one layer: registered ones (not traced into), split layers (a registered
    layer's counterpart after swapping, which may hold modules of its own: neuraloperator's spectral
    weights), and childless ones not of the user's own type (:func:`users`: whose calls are followed
    one by one). The plan walks the model and a run its swapped copy: both must see the same layers."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            parent = any(True for _ in child.children())
            if registry.lookup(child) is not None or isinstance(child, SpatialLayer) or not (
                    parent or users(child)):
                out.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return out


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments (lists of them too: ``torch.cat``)."""
    given = [*args, *kwargs.values()]
    flat = [*given, *(a for v in given if isinstance(v, list | tuple) for a in v)]
    return [a for a in flat if isinstance(a, torch.Tensor)]


def nested_block(m: nn.Module | None) -> bool:
    """Whether ``m``, a node of a traced graph, is a module of the user's own type that the graph keeps
    whole (torch.fx could not trace into it, or it holds parameters or buffers of its own): it runs
    its own forward, split, by module swapping inside itself (:mod:`hybridpar.pipeline.split_forward`)."""
    return m is not None and users(m)


Extents = tuple[int, ...]


def dense_on_split(m: nn.Module, entry: registry.LayerEntry | None) -> bool:
    """Whether a registered layer that does not split (``nn.Linear``, ``nn.Softmax`` over a dim of the
    volume) would read a split volume: it needs the whole volume, so the forward is refused (a
    ``Flatten`` gathers its input first, a softmax over channels works voxel by voxel)."""
    if entry is None or entry.splittable or entry.flattens:
        return False
    dim = getattr(m, "dim", None)  # a softmax's or a GLU's
    return not (entry.op == "pointwise" and isinstance(dim, int) and dim % 5 < 2)


class LayoutWatch(TorchFunctionMode):
    """Follows, through a forward run by module swapping, which tensors are split activations (the
    input, a split layer's output, what the calls of :mod:`hybridpar.planner.calls` make of them) and
    their global extents, and meets every torch function the forward calls outside its layers as
    that table says.

    This class plans, on the global volume (the meta device): a call the table refuses is noted in
    ``unsafe`` with its line; a call that stands for a layer (``F.interpolate``) is checked against the
    split and handed to ``on_function``. :class:`hybridpar.pipeline.split_forward.SplitForward` runs the
    same forward on shards by overriding the ``_run_*`` methods, so that whatever the plan accepted
    runs split and exact. Layers are seen by hooks (:meth:`hook`): a registered layer on a split input
    runs split, on any other whole.
    """

    def __init__(self, split: Split, batch_apart: bool = False) -> None:
        super().__init__()
        self.grid_split = split
        self.batch_apart = batch_apart  # the batch runs in parts (data parallel, micro-batches)
        self.splits = split != REPLICATED  # False: a grid that splits nothing (every layer runs whole)
        self.on_function: Callable[[str, nn.Module, torch.Tensor, torch.Tensor, bool], None] | None = None
        self.reset()

    def reset(self) -> None:
        self.depth, self.unsafe = 0, []
        self.met: dict[tuple[str, str], int] = {}  # (what a call on split activations did, line) -> times
        # split activation -> global extents; tensors carrying a batch in parts; a reshape chain -> atoms
        self.split, self.batched, self.chains = (WeakIdKeyDictionary() for _ in range(3))

    def mark(self, t: object, extents: Extents) -> None:
        """Say that ``t`` (a tensor, or each tensor of a tuple) is split, of global ``extents``."""
        for x in t if isinstance(t, list | tuple) else (t,):
            if isinstance(x, torch.Tensor) and x.dim() >= 3:
                self.split[x] = tuple(extents)

    def runs_split(self, m: nn.Module, x: torch.Tensor) -> bool:
        """Whether layer ``m`` runs split on ``x``: registered as splittable, on a split volume."""
        entry = registry.lookup(m)
        return self.splits and x.dim() == 5 and entry is not None and entry.splittable and x in self.split

    def after_layer(self, m: nn.Module, x: torch.Tensor, out: object, split: bool) -> None:
        """Mark layer ``m``'s output split where it ran split (not after a whole-volume reduction), or
        where it works voxel by voxel on a split input (a softmax over channels)."""
        self.carry([x], out)
        if not isinstance(out, torch.Tensor) or x not in self.split or out.dim() != 5:
            return
        entry = registry.lookup(m)
        if split and not entry.replicated_output(m):
            self.mark(out, self.layer_extents(m, x, out))
        elif not split and entry is not None and not entry.flattens \
                and not dense_on_split(m, entry):
            self.mark(out, self.split[x])

    def layer_extents(self, m: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Extents:
        """The global extents of a split layer's output (here the volume's: the output's own)."""
        return tuple(out.shape[-3:])

    def carry(self, inputs: list[torch.Tensor], out: object) -> None:
        """Where the batch runs in parts, mark what a call or layer made of a tensor carrying it."""
        if self.batch_apart and any(t in self.split or t in self.batched for t in inputs):
            self.batched.update((t, True) for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = calls.canonical(kwargs or {})
        if self.depth:
            return func(*args, **kwargs)
        tensors = _tensors(args, kwargs)
        out = self._dispatch(func, args, kwargs, tensors)
        self.carry(tensors[:1] if calls.name_of(func) in calls.LIKE_OF else tensors, out)  # p.to(x): p's
        return out

    def _dispatch(self, func, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        split = [t for t in tensors if t in self.split]
        if any(t in self.chains for t in tensors):
            if calls.name_of(func) in STEPS and len(tensors) == 1:
                return self._run_step(func, args, kwargs, tensors[0])
            if calls.reads_shape(func):
                return self._chain_shape(func, args, kwargs)
            if calls.name_of(func) in calls.SAFE:
                return func(*args, **kwargs)
            # read as a value of its own (x.view(N, -1) into a sum): the whole value, gathered
            args, kwargs = self.wholes(args, kwargs)
            split = [t for t in _tensors(args, kwargs) if t in self.split]
        if not split or (calls.name_of(func) in calls.LIKE_OF and args and args[0] not in self.split):
            # nothing split; or a replicated tensor made like a split one (p.to(x), p.type_as(x)): it
            # takes the split one's dtype and device, not its layout
            out = self._run_replicated(func, args, kwargs)
            carriers = [t for t in tensors if t in self.batched] if self.batch_apart and not split else []
            if carriers and (why := per_sample.across(func, args, kwargs, carriers, out)):
                self.unsafe.append(f"{why}, on values per sample of a batch in parts, at {calls.caller()}")
            return out
        if calls.in_place(calls.name_of(func)) and args and isinstance(args[0], torch.Tensor) \
                and args[0] not in self.split:
            self.unsafe.append(f"{calls.name_of(func)} (writes a split activation into a whole tensor in "
                               f"place: each rank would fill its own part only) at {calls.caller()}")
            return func(*args, **kwargs)
        kind = calls.classify(func, args, kwargs, split[0].dim())
        key = (calls.role_of(func, kind), calls.caller())
        self.met[key] = self.met.get(key, 0) + 1
        if (why := calls.refusal_of(func, kind, tensors, split)) is not None:
            self.unsafe.append(f"{why} at {calls.caller()}")
            return func(*args, **kwargs)
        if kind.kind == "value":
            raise SpecError(f"{calls.name_of(func)} at {calls.caller()} reads the values of a split "
                            f"activation into Python; on each rank these are its shard's. Branch on "
                            f"configuration or on shapes (they answer the volume's extents)")
        if kind.kind == "step":
            return self._run_step(func, args, kwargs, split[0])
        batch = split[0].dim() in (4, 5)  # dim 0 is the batch (N, C, D, H, W, or a channel reduced)
        across = kind.kind in ("reduce", "keep", "join", "pieces") and 0 in kind.dims
        if across and batch and self.batch_apart:
            what = "over" if calls.name_of(func).strip("_") in calls.REDUCTIONS else "across the samples of"
            self.unsafe.append(f"{calls.name_of(func)} ({what} the batch, which data parallelism or "
                               f"micro-batches hold apart: work on each sample, e.g. reduce over "
                               f"dim=(1, 2, 3, 4)) at {calls.caller()}")
            return func(*args, **kwargs)
        if len({self.split[t] for t in split}) > 1:
            self.unsafe.append(f"{calls.name_of(func)} (on split activations of different extents) at "
                               f"{calls.caller()}")
            return func(*args, **kwargs)
        return getattr(self, f"_run_{kind.kind}")(func, args, kwargs, kind, split[0])

    # --------------------------------------------------------- on the volume: the plan
    def _run_replicated(self, func, args, kwargs) -> Any:
        """A call on values whole on every rank (none of them split)."""
        return func(*args, **kwargs)

    def _run_shape(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        return func(*args, **kwargs)

    def _chain_shape(self, func, args, kwargs) -> Any:
        """A shape read of a split volume part way through reshapes (here the volume's own)."""
        return func(*args, **kwargs)

    def _run_reduce(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        return func(*args, **kwargs)  # the volume's value, the same on every rank: not split

    def _run_pointwise(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        out = func(*args, **kwargs)
        self.mark(out, self.split[x])
        return out

    _run_keep = _run_join = _run_pieces = _run_pointwise

    def _run_module(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        out = func(*args, **kwargs)
        m = kind.module
        entry = registry.lookup(m)
        name = calls.name_of(func)
        split = self.splits and x.dim() == 5 and entry is not None and entry.splittable
        if split:
            node_halos(name, m, entry, tuple(x.shape), tuple(out.shape), self.grid_split)
            if not entry.replicated_output(m):
                self.mark(out, tuple(out.shape[-3:]))
        else:
            self.unsafe.append(f"{name} (its layer {type(m).__name__} needs the whole volume) at "
                               f"{calls.caller()}")
        if self.on_function is not None:
            self.on_function(name, m, x, out, split)
        return out

    def _run_step(self, func, args: tuple, kwargs: dict, src: torch.Tensor) -> Any:
        """Follow a reshape of a split volume (a pixel shuffle: :mod:`hybridpar.planner.space_maps`): a
        volume again is split where each shard's box maps to its own output box under the grid's
        split; anything else is unsafe."""
        out = func(*args, **kwargs)
        name = calls.name_of(func)
        if not isinstance(out, torch.Tensor):
            return out
        start, steps, _ = self.chains.get(src, (tuple(src.shape), {}, None))
        try:
            before = steps[len(steps) - 1] if steps else source_dims(start)
            steps = {**steps, len(steps): step(name, args[1:], kwargs, before, out.shape)}
            if out.dim() != 5:
                self.chains[out] = (start, steps, tuple(out.shape))
            elif close("", steps, start, tuple(out.shape)).fits(self.grid_split):
                self.mark(out, tuple(out.shape[-3:]))
            else:
                raise NotLocal
        except NotLocal:
            self.unsafe.append(f"{name} (a reshape whose shards do not map onto the output's shards) at "
                               f"{calls.caller()}")
        return out

    def wholes(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with every volume part way through reshapes as its whole value (here,
        on the volume, it is that already; a run gathers it)."""
        return args, kwargs

    def needs_whole(self, m: nn.Module, x: torch.Tensor) -> bool:
        """Whether layer ``m`` reads ``x`` whole: a split volume reshaped part way (``x.view(N, -1)``
        before a Linear), or a split volume read by a layer that needs the whole (a Linear over W)."""
        return x in self.chains or (x in self.split and dense_on_split(m, registry.lookup(m)))

    def hook(self, modules: Iterable[nn.Module],
             on_leave: Callable[[nn.Module, tuple, object], None] | None = None) -> list:
        """Hooks that follow ``modules`` (the model's leaves): inside one, functions are the layer's and
        this mode lets them pass (its ``depth``). ``on_leave(m, args, out)`` runs as a layer ends, still
        inside it, so that what it reads is not the forward's (default: :meth:`after_layer` on the
        outermost layer). The one place this mode is paused inside layers."""
        def enter(m: nn.Module, args: tuple) -> tuple | None:  # before_layer's own calls pass too
            self.depth += 1
            return self.before_layer(m, args) if self.depth == 1 else None

        def leave(m: nn.Module, args: tuple, out: object) -> None:
            try:
                (on_leave or self._left)(m, args, out)
            finally:
                self.depth -= 1

        modules = list(modules)
        return [m.register_forward_pre_hook(enter) for m in modules] + \
            [m.register_forward_hook(leave, always_call=True) for m in modules]

    def _left(self, m: nn.Module, args: tuple, out: object) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is not None and self.depth == 1:
            self.after_layer(m, x, out, self.runs_split(m, x))

    def before_layer(self, m: nn.Module, args: tuple) -> tuple | None:
        """Called as layer ``m`` starts on ``args``; new arguments, or None (the plan needs nothing
        here; a run sets extents and gathers what a layer reads whole)."""
        return None


def swapped_plan(model: nn.Module, input_shape: Sequence[int], split: Split,
                 micro: int, nested: bool = False) -> list[LayerPlan]:
    """One record per call of a leaf module, or of a function that stands for a layer
    (``F.interpolate``), on a meta forward of the global input, in call order: those on a split
    input under ``split``, the rest replicated. Fails with a :class:`SpecError` naming the call and
    its line when the forward does not run on the meta device (it branches on tensor values), a
    layer nobody registered reads a split activation, or a call outside the layers cannot run split
    (:mod:`hybridpar.planner.calls`). The input is split under ``split``; shape reads answer with
    global extents at run time (:mod:`hybridpar.pipeline.split_forward`), as a traced graph's do.
    ``nested``: ``model`` is a block inside a traced graph."""
    records, modules, _, _ = _follow(model, input_shape, split, micro, nested)
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


def nested_output_split(block: nn.Module, input_shape: Sequence[int], split: Split, micro: int) -> bool:
    """Check that ``block``, a node of a traced graph run by module swapping on a split input of global
    ``input_shape``, runs split (the :class:`SpecError` of :func:`swapped_plan` if not), and say whether
    its output is split (a block ending in a reduction over the volume returns a replicated value)."""
    return bool(_follow(block, input_shape, split, micro, nested=True)[3][1][:1] == [True])


def returned(model: nn.Module, input_shape: Sequence[int], split: Split
             ) -> tuple[list[Any], list[bool], TreeSpec]:
    """What a forward run by module swapping returns on the volume of ``input_shape`` (meta tensors,
    as leaves of their structure), and whether each is split under ``split`` (a volume the forward
    reduced, flattened or gathered is not)."""
    return _follow(model, input_shape, split, input_shape[0])[3]


def _follow(model: nn.Module, input_shape: Sequence[int], split: Split, micro: int, nested: bool = False
            ) -> tuple[list[LayerPlan], list[nn.Module], LayoutWatch, tuple[list[Any], list[bool], TreeSpec]]:
    """The records of :func:`swapped_plan` (FLOPs not counted), their modules, the watch that
    followed the forward, and what it returns (:func:`returned`); raises what the forward does that
    cannot run split. ``nested``: a node of a traced graph, which may call no layer at all."""
    records: list[LayerPlan] = []
    modules: list[nn.Module] = []  # the module of each record
    names = dict((m, n) for n, m in leaves(model))
    watch = LayoutWatch(split, batch_apart=micro < input_shape[0])
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
        if x is None or not isinstance(out, torch.Tensor):
            return
        entry = registry.lookup(m)
        if x in watch.split and entry is None:
            raise SpecError(f"{names[m]} ({type(m).__name__}): {registry.unregistered(m)} and its "
                            f"input is split {list(split)}: register it (hybridpar.nn.register) so that the "
                            f"model can run by module swapping")
        gathers = watch.needs_whole(m, x)  # runs whole on the gathered volume
        runs_split = watch.runs_split(m, x) and not gathers  # on a replicated input (a pooled gate), whole
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
    state, dtype = meta_state(model)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if split != REPLICATED:
        watch.mark(x, tuple(input_shape[2:]))
    if watch.batch_apart:
        watch.batched[x] = True
    try:
        with watch:
            outs, spec = tree_flatten(meta_call(model, state, x))
        out_split = (outs, [isinstance(t, torch.Tensor) and t in watch.split for t in outs], spec)
        bent = [tuple(t.shape) for t, s in zip(outs, out_split[1], strict=True) if s and t.dim() != 5]
        if bent:
            raise SpecError(f"model ({type(model).__name__}): its forward returns a split activation of "
                            f"shape {bent[0]}, not N, C, D, H, W (a channel reduced or picked): return "
                            f"it with its channel dim kept (h.mean(1, keepdim=True), h[:, :1])")
    except (SpecError, CarriedState) as err:
        raise err if isinstance(err, SpecError) else SpecError(str(err)) from None
    except Exception as err:
        where = records[-1].name if records else "its first layer"
        raise SpecError(f"model ({type(model).__name__}): neither torch.fx nor a run on the meta device can "
                        f"follow its forward (after {where}, at {calls.line_of(err)}: {type(err).__name__}: "
                        f"{err}); branch on configuration, not on tensor values") from err
    finally:
        for h in handles:
            h.remove()
    if not records and not nested:
        raise SpecError(f"model ({type(model).__name__}): no layer ran in its forward")
    if watch.unsafe:
        raise unsafe_error(model, watch)
    return records, modules, watch, out_split


def unsafe_error(model: nn.Module, watch: LayoutWatch) -> SpecError:
    what = ", ".join(dict.fromkeys(watch.unsafe))
    return SpecError(f"model ({type(model).__name__}): run by module swapping, its forward calls {what} "
                     f"on split activations outside any layer, which cannot run split. Supported there: "
                     f"elementwise arithmetic, interpolate, pad, functional pools and convs, reductions over "
                     f"the whole volume, cat/stack/chunk along channels or batch, shape reads (they answer "
                     f"the volume's extents); use a layer instead (nn.Flatten), or make the forward "
                     f"traceable by torch.fx")
