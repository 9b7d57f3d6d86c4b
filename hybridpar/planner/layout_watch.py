"""What a forward run by module swapping does to split activations, followed call by call: the
:class:`LayoutWatch` that plans such a forward on the volume (:mod:`hybridpar.planner.swapped`) and,
subclassed, runs it on shards (:mod:`hybridpar.pipeline.split_forward`).

Why apart from the plan: the plan (records per layer, FLOPs, what a forward returns) and the run both
follow the forward with this one mode, so what one accepts the other computes; the table of calls it
consults is :mod:`hybridpar.planner.calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar.nn import families, registry, torch_args
from hybridpar.nn.meta import meta_call, meta_state, unwatched
from hybridpar.nn.sound_values import UNKNOWN, SoundValues
from hybridpar.planner import batch_extent, calls, per_sample
from hybridpar.planner.analysis import KEPT_WHOLE, REPLICATED, dense_on_split, node_halos, splits_under
from hybridpar.planner.backward_calls import BackwardCalls
from hybridpar.planner.batch_extent import part_kind
from hybridpar.planner.batch_reads import BatchReads, picks
from hybridpar.planner.copies import REMADE, Copies
from hybridpar.planner.elementwise import broadcast_extents
from hybridpar.planner.fills import FILLS, born_split
from hybridpar.planner.layer_hooks import LayerHooks
from hybridpar.planner.space_maps import STEPS, NotLocal, close, on_shards, source_dims, step
from hybridpar.planner.terms import SpecError, Split
from hybridpar.user_lines import caller

Extents = tuple[int, ...]


class LayoutWatch(LayerHooks, BackwardCalls, BatchReads, TorchFunctionMode):
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
        self.batch_apart, self.batch, self.part = batch_apart, 0, 0  # the batch in parts of part each; N
        self.judging = False  # a registered layer's own forward (swapped.judge_registered)
        self.splits = split != REPLICATED  # False: a grid that splits nothing (every layer runs whole)
        self.on_function: Callable[[str, nn.Module, torch.Tensor, torch.Tensor, bool], None] | None = None
        self._extents: dict[tuple, Extents] = {}  # (module, input shape) -> output extents, per size
        self._fits: dict[tuple, bool] = {}  # (a call's layer, input shape) -> module_fits
        self._offers: list[Any] = []  # while entered: the Functions applied on this thread offered to it
        self.reset()

    def reset(self) -> None:
        self.depth, self.unsafe, self.gathered = 0, [], []  # gathered: calls run on the whole volume
        self.met: dict[tuple[str, str], int] = {}  # (what a call on split activations did, line) -> times
        # split activation -> global extents; tensors carrying a batch in parts; a reshape chain -> atoms;
        # what in one process would be views of split ones (:mod:`hybridpar.planner.copies`)
        self.split, self.batched, self.chains = (WeakIdKeyDictionary() for _ in range(3))
        self.roots = WeakIdKeyDictionary()  # a reshape chain -> the split activation it starts from
        self.copies, self.sound = Copies(), SoundValues()  # sound: constants of a run without NaN or inf
        self._versions: list[tuple[torch.Tensor, int]] = []  # the layer running: its inputs' versions
        self.reset_reads()

    def __enter__(self) -> LayoutWatch:
        self._offers.append(self.applications())  # a Function of the user's: BackwardCalls._applied
        self._offers[-1].__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        self.unsafe += self.copies.unsettled()
        self._offers.pop().__exit__(None, None, None)
        return super().__exit__(*exc)

    def _out_extents(self, m: nn.Module, lead: Sequence[int], extents: Extents, dtype: torch.dtype,
                     name: object = None) -> Extents:
        """``m``'s output's global extents on ``extents``, memoised by ``name`` (a stand-in's) or id."""
        key = (id(m) if name is None else name, tuple(lead), extents, dtype)
        if key not in self._extents:
            state, own = meta_state(m)
            if any(t.is_floating_point() for t in state.values()):
                dtype = own  # the layer's own: only the extents count
            with unwatched(m):  # a layer of the model's own: its hooks here would record a call
                out = meta_call(m, state, torch.empty((*lead, *extents), dtype=dtype, device="meta"))
            if not isinstance(out, torch.Tensor):  # as its split version would: one tensor
                raise SpecError(f"{type(m).__name__} (a registered layer) gives a {type(out).__name__}; a "
                                f"registered layer gives one tensor: register its parts apart")
            self._extents[key] = tuple(out.shape[-3:])
        return self._extents[key]

    def module_fits(self, m: nn.Module, x: torch.Tensor, key: object = None) -> bool:
        """Whether the layer ``m`` runs split on ``x`` (else it runs on the gathered volume, as a traced
        plan replicates a layer too small to split): registered as splittable, its geometry fits the
        split (a box of one plane does not split two ways). ``key``: what tells ``m`` apart (a layer's
        identity; by default, for a call's stand-in made anew at every call, its settings)."""
        entry = registry.lookup(m)
        if not self.splits:
            return True
        if entry is None or not entry.splittable or x.dim() != 5:  # a 3D layer on h.mean(1): on the whole
            return False
        extents, key = self.split[x], calls.module_key(m) if key is None else key
        memo = (key, tuple(x.shape[:2]), extents)
        if memo not in self._fits:  # a pointwise layer keeps its input's extents: no run needed
            out = extents if entry.role == "pointwise" else self._out_extents(m, x.shape[:-3], extents,
                                                                               x.dtype, name=key)
            self._fits[memo] = splits_under(m, entry, (*x.shape[:2], *extents), (*x.shape[:2], *out),
                                            self.grid_split)
        return self._fits[memo]

    def original(self, m: nn.Module) -> nn.Module:
        """The layer ``m`` stands for, which computes on the volume (here ``m`` itself)."""
        return m

    def mark(self, t: object, extents: Extents) -> None:
        """Say that ``t`` (a tensor, or each tensor of a tuple) is split, of global ``extents``."""
        self.split.update((x, tuple(extents)) for x in (t if isinstance(t, list | tuple) else (t,))
                          if isinstance(x, torch.Tensor) and x.dim() >= 3)

    def runs_split(self, m: nn.Module, x: torch.Tensor) -> bool:
        """Whether layer ``m`` runs split on ``x``: registered as splittable, on a split volume."""
        entry = registry.lookup(m)
        return self.splits and x.dim() == 5 and entry is not None and entry.splittable and x in self.split

    def after_layer(self, m: nn.Module, x: torch.Tensor, out: object, split: bool) -> None:
        """Mark layer ``m``'s output split where it ran split (not after a whole-volume reduction) or works
        voxel by voxel on a split input (a softmax over channels); one that reads its input whole
        (:meth:`needs_whole`: too small to split, a copy reading across the shards) gives a whole value."""
        self.carry([x], out)
        source = x if x in self.split else self.roots.get(x)
        if isinstance(out, torch.Tensor) and out._is_view() and source is not None and not split:
            # a view of the input read whole (nn.Flatten's), in one process a view of the split activation
            self.copies.take(out, f"the output of {type(m).__name__}, a view of its input read whole", source)
        elif x in self.copies.taken:  # a view of a copy (nn.Unflatten after nn.Flatten) is one too
            self.copies.after([self.copies.taken[x]], out)
        if not isinstance(out, torch.Tensor) or x not in self.split:
            return
        if out.dim() != 5 or x.dim() != 5:  # an activation on a shard of h.mean(1) keeps its layout
            if out.shape == x.shape and not self.needs_whole(m, x):
                self.mark(out, self.split[x])
            return
        entry = registry.lookup(m)
        if split and not entry.replicated_output(m):
            self.mark(out, self.layer_extents(m, x, out))
        elif not split and entry is not None and not entry.flattens and not self.needs_whole(m, x):
            self.mark(out, self.split[x])

    def layer_extents(self, m: nn.Module, x: torch.Tensor, out: torch.Tensor) -> Extents:
        """The global extents of a split layer's output (here the volume's: the output's own)."""
        return tuple(out.shape[-3:])

    def carry(self, inputs: list[torch.Tensor], out: object) -> None:
        """Where the batch runs in parts, mark what a call or layer made of a tensor carrying it."""
        if self.batch_apart and any(t in self.split or t in self.batched for t in inputs):
            self.batched.update((t, True) for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = calls.canonical(torch_args.complete(func, kwargs or {}))
        if self.depth:
            return func(*args, **kwargs)
        tensors = calls.tensors_in(args, kwargs)
        copied = [self.copies.taken[t] for t in tensors if t in self.copies.taken]
        name = calls.name_of(func)
        written = args[0] if args and isinstance(args[0], torch.Tensor) and (
            calls.in_place(name) or kwargs.get("inplace") is True) else None  # F.relu(h, inplace=True) too
        if isinstance(kwargs.get("out"), torch.Tensor):  # torch.tanh(a, out=b[:, :, 3:8]) writes b's box
            written = kwargs["out"]
        self.unsafe += self.copies.before(name, tensors, written, args[2] if len(args) > 2 else None)
        chained = [t for t in tensors if t in self.chains]  # read whole, gathered (unless a step)
        self.use(func, tensors)
        if (known := self.sound.read(func, args)) is not UNKNOWN:  # a check of finiteness, planned
            return known
        out = self._dispatch(func, args, kwargs, tensors)
        self.sound.after(func, args, out)
        self.copies.after(copied, out)
        if isinstance(out, torch.Tensor) and out._is_view():
            self._views_made(out, tensors, chained)
        self.carry(calls.carriers_of(func, tensors), out)
        return self.batch_read(name, args, kwargs, tensors, out) if self.batch_apart else out

    def _views_made(self, out: torch.Tensor, tensors: list, chained: list[torch.Tensor]) -> None:
        """A view a run makes of another tensor than one process: of a reshape read whole (gathered), of a
        replicated value laid out split (``g.expand_as(h)``): a copy, which a write into its source misses."""
        if chained and out not in self.chains and out not in self.split:
            if (root := self.roots.get(chained[0])) is not None:
                self.copies.take(out, f"a view of a reshape of a split activation read whole at "
                                 f"{caller()}", root)
        elif out in self.split:
            whole = next((t for t in tensors if t not in self.split and torch._C._is_alias_of(out, t)), None)
            if whole is not None:
                self.copies.take(out, f"a view of a whole value at {caller()}", whole)

    def _dispatch(self, func, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        if calls.name_of(func) == "register_hook" and args and isinstance(args[0], torch.Tensor):
            return self._hooked(func, args, kwargs)
        if calls.name_of(func) in FILLS and (made := born_split(self, func, args, kwargs)) is not None:
            return made
        if calls.name_of(func) in ("view_as", "reshape_as") and len(args) == 2 and (
                args[1] in self.split or args[1] in self.chains):
            return self._shaped_as(args[0], args[1])
        split = [t for t in tensors if t in self.split]
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        copy_written = first is not None and (first in self.chains or first in self.copies.taken)
        if any(t in self.chains for t in tensors):
            if calls.name_of(func) in STEPS and len(tensors) == 1:
                return self._step(func, args, kwargs, tensors[0])
            if calls.reads_shape(func):
                return self._chain_shape(func, args, kwargs)
            if calls.name_of(func) in calls.SAFE:
                return func(*args, **kwargs)
            if calls.in_place(calls.name_of(func)) and args[0] in self.chains:
                self.unsafe.append(f"{calls.name_of(func)} (writes in place into a reshape of a split "
                                   f"activation, h.flatten(2) or h.permute(...), whose places on a rank are "
                                   f"its shard's: write into the volume, h[:, :, a:b] = v, or reshape after "
                                   f"the write) at {caller()}")
                return func(*args, **kwargs)
            # read as a value of its own (x.view(N, -1) into a sum): the whole value, gathered
            args, kwargs = self.wholes(args, kwargs)
            split = [t for t in calls.tensors_in(args, kwargs) if t in self.split]
        if not split or (calls.name_of(func) in calls.LIKE_OF and args and args[0] not in self.split):
            # nothing split; or a replicated tensor made like a split one (p.to(x)): its dtype, not its layout
            out = self._run_replicated(func, args, kwargs)
            carriers = [t for t in tensors if t in self.batched] if self.batch_apart and not split else []
            if carriers and not self.sound.known(carriers) and (
                    why := per_sample.across(func, args, kwargs, carriers, out, self.batch)):
                self.refuse_or_hold(func, args, out, f"{why}, on values per sample of a batch in parts, at "
                                    f"{caller()}")
            elif self.batch_apart and isinstance(out, torch.Tensor) and per_sample.draws_per_sample(
                    calls.name_of(func), tuple(out.shape), self.batch,
                    batch_extent.sizes_batch(calls.name_of(func), args, kwargs, part_kind)):
                self.unsafe.append(f"{calls.name_of(func)} (draws random numbers per sample of the batch, "
                                   f"which each part would draw alike) at {caller()}")
            return out
        if calls.in_place(calls.name_of(func)) and args and isinstance(args[0], torch.Tensor) \
                and args[0] not in self.split:
            if copy_written:  # the copy of a split volume, not the volume: the write would reach neither
                self.unsafe.append(f"{calls.name_of(func)} (writes a split activation into a copy taken of "
                                   f"one, which the split activation does not share) at {caller()}")
                return func(*args, **kwargs)
            # a whole tensor (a zero frame a volume is padded into by hand, a buffer): written with the
            # whole value, alike on every rank, as one process writes it
            return self._run_whole(func, args, kwargs, calls.CallKind("whole"), split[0])
        kind = calls.classify(func, args, kwargs, split[0].dim(), self.split[split[0]])
        if kind.kind == "refuse" and (not calls.in_place(calls.name_of(func)) or split[0] is args[0]) or (
                kind.kind == "module" and not self.module_fits(kind.module, split[0])) or (
                kind.kind == "step" and split[0].dim() != 5):  # a reshape of h.mean(1), not N, C, D, H, W
            kind = calls.CallKind("whole", why=kind.why)  # computed on the gathered volume
        key = (calls.role_of(func, kind), caller())
        self.met[key] = self.met.get(key, 0) + 1
        if (why := calls.refusal_of(func, kind, tensors, split)) is not None:
            self.unsafe.append(f"{why} at {caller()}")
            return func(*args, **kwargs)
        if kind.kind == "value":
            raise SpecError(f"{calls.name_of(func)} at {caller()} reads the values of a split "
                            f"activation into Python; on each rank these are its shard's. Branch on "
                            f"configuration or on shapes (they answer the volume's extents)")
        if kind.kind == "step":
            return self._step(func, args, kwargs, split[0])
        across = kind.kind in ("reduce", "keep", "join", "pieces") and 0 in kind.dims and self.batch_apart \
            and split[0].dim() in (4, 5) and not self.sound.known(split)  # dim 0 the batch: N, (C,) D, H, W
        why = across and f"{per_sample.along_batch(func)} at {caller()}"
        if across and not picks(func, args):
            self.unsafe.append(why)
            return func(*args, **kwargs)
        if len(extents := {self.split[t] for t in split}) > 1 and kind.kind != "whole":
            wide = broadcast_extents(list(extents), self.grid_split) if kind.kind == "pointwise" else None
            if wide is None:
                self.unsafe.append(f"{calls.name_of(func)} (on split activations of different extents) at "
                                   f"{caller()}")
                return func(*args, **kwargs)
            split = [t for t in split if self.split[t] == wide]  # the output's extents: the widest
        out = getattr(self, f"_run_{kind.kind}")(func, args, kwargs, kind, split[0])
        if across:  # a pick of one sample: held back
            self.refuse_or_hold(func, args, out, why)
        if kind.kind == "module" and calls.name_of(func) == "__getitem__" and isinstance(out, torch.Tensor):
            self.copies.take(out, f"a box of slices at {caller()}", args[0])
        return out

    def _step(self, func, args: tuple, kwargs: dict, src: torch.Tensor) -> Any:
        """A reshape chain's step; a chain that one process holds as a copy of its split source (a
        reshape of a permuted volume) is one of :class:`Copies`, since a run makes a chain read whole
        again from its source: read after the source is written in place, it is refused."""
        out = self._run_step(func, args, kwargs, src)
        if isinstance(out, torch.Tensor) and out in self.chains:
            root = self.roots[out] = src if src in self.split else self.roots.get(src)
            if root is not None and not torch._C._is_alias_of(out, root):
                self.copies.take(out, f"a reshape of a split activation at {caller()}", root, REMADE)
        return out

    def global_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The shape ``t`` has on the volume (a split one's, or one part way through reshapes)."""
        return tuple(t.shape)

    def _shaped_as(self, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``t.view_as(like)`` of a split ``like``: a reshape to its shape on the volume (a step, where
        ``t`` is split too; else a whole value, laid out as ``like``: its shard's box of it)."""
        shape = self.global_shape(like)
        if t in self.split or t in self.chains:
            return self._dispatch(torch.Tensor.reshape, (t, shape), {}, [t])
        out = t.reshape(shape)
        return self._resplit(out, [self.split[like]]) if like in self.split else out

    def _run_whole(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        """A call that cannot run on shards (a flip, a cumulative sum along D, a plane picked): run on the
        gathered volume, the same on every rank, each result laid out as a volume of its inputs' extents
        taken back to the shard's box. Refused where the batch is held in parts and the call mixes its
        samples or draws random numbers (each part would draw the first samples' alike)."""
        name = calls.name_of(func)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        target = first if calls.in_place(name) and first is not None and first in self.split else None
        given = calls.tensors_in(args, kwargs)
        extents = [self.split[t] for t in given if t in self.split]
        carries = [not isinstance(t, nn.Parameter) for t in given]  # a weight carries none
        args, kwargs = tree_map(lambda a: self.whole(a) if isinstance(a, torch.Tensor) and a in self.split
                                else a, (args, kwargs))
        out = self._run_replicated(func, args, kwargs)
        if self.batch_apart:
            carriers = [t for t, c in zip(calls.tensors_in(args, kwargs), carries, strict=True)
                        if c and t.dim() in (4, 5)]
            why = f"{name} (draws random numbers, alike on every part of the batch)" if per_sample.draws(
                name) else carriers and per_sample.across(func, args, kwargs, carriers, out, self.batch)
            if why:
                self.unsafe.append(f"{why}, computed whole on a batch in parts, at {caller()}")
        self.gathered.append(f"{name} at {caller()}")
        if target is not None:  # written into the gathered volume: the shard's box of it, back into the shard
            self._write_back(target, args[0])
            return target if out is args[0] else out
        views = {id(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t._is_view()}
        out = self._resplit(out, extents, views)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (id(t) in views or t in self.copies.taken):
                self.copies.take(t, f"a view of the volume gathered for {name} at {caller()}", first)
        return out

    def _write_back(self, target: torch.Tensor, whole: torch.Tensor) -> None:
        """Put the shard's box of ``whole`` into split ``target`` (here, on the volume, the call did)."""

    def _resplit(self, out: Any, extents: list[Extents], views: set[int] = frozenset()) -> Any:
        """``out`` (whole values) with each tensor of a volume of one of ``extents`` in its last three
        dims as a split one: its shard's box of it (a view of a gathered volume, ``views``, stays one)."""
        def one(t: Any) -> Any:
            e = tuple(t.shape[-3:]) if isinstance(t, torch.Tensor) and t.dim() >= 3 else None
            if e is None or e not in extents:
                return t
            fitted = self._fit(t, e)
            if id(t) in views:
                self.copies.take(fitted, "a view of a gathered volume", None)
            elif not fitted.is_contiguous() and t.is_contiguous():  # as one process's result: a view of
                fitted = fitted.contiguous()  # it (h.view(n, -1)) needs that, which a box of it is not
            self.mark(fitted, e)
            return fitted
        return tree_map(one, out)

    def whole(self, t: torch.Tensor) -> torch.Tensor:  # a split activation's whole value (here: itself)
        return t

    def _fit(self, t: Any, extents: Extents | None) -> Any:  # a whole operand as a shard reads it (here: t)
        return t

    def closes(self, start: tuple[int, ...], steps: dict, out_shape: tuple[int, ...]) -> bool:
        """Whether a reshape chain from a volume of shape ``start`` that made ``out_shape`` by ``steps`` is a
        volume again, split (N, C, D, H, W, each shard's box onto its own output box under the grid's
        split); else it goes on as a chain, read whole where another call reads it (a permute to
        channels last, or the batch folded with the channels, ``h.reshape(n * c, 1, d, hh, w)``)."""
        with suppress(NotLocal):  # NotLocal: the batch mixed with other dims, read whole (gathered)
            return len(out_shape) == 5 and close("", steps, start, tuple(out_shape)).fits(self.grid_split)
        return False

    # --------------------------------------------------------- on the volume: the plan
    def _run_replicated(self, func, args, kwargs) -> Any:
        """A call on values whole on every rank (none of them split)."""
        return func(*args, **kwargs)

    def _run_shape(self, func, args, kwargs, kind: calls.CallKind | None = None, x: Any = None) -> Any:
        """Here, on the volume, as it comes: a shape read (the volume's own, part way through reshapes too),
        a reduction (the volume's value, alike on every rank: not split), a write in place (stays split)."""
        return func(*args, **kwargs)

    _chain_shape = _run_reduce = _run_assign = _run_shape

    def local(self, extents: Extents) -> Extents:  # this rank's box's extents (here the volume's own)
        return extents

    def _run_pointwise(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        out = func(*args, **kwargs)
        self.mark(out, self.split[x])
        return out

    _run_keep = _run_join = _run_pieces = _run_pointwise

    def _run_module(self, func, args, kwargs, kind: calls.CallKind, x: torch.Tensor) -> Any:
        out, m, name = func(*args, **kwargs), kind.module, calls.name_of(func)
        entry = registry.lookup(m)  # module_fits said it splits: a registered 3D layer on a split volume
        node_halos(name, m, entry, tuple(x.shape), tuple(out.shape), self.grid_split)
        if not entry.replicated_output(m):
            self.mark(out, tuple(out.shape[-3:]))
        if self.on_function is not None:
            self.on_function(name, m, x, out, True)
        return out

    def _run_step(self, func, args: tuple, kwargs: dict, src: torch.Tensor) -> Any:
        """Follow a reshape of a split volume (a pixel shuffle: :mod:`hybridpar.planner.space_maps`): a
        volume again is split where each shard's box maps to its own output box under the grid's
        split; anything else (a reshape the shards' extents do not take) is unsafe."""
        out, name = func(*args, **kwargs), calls.name_of(func)
        if not isinstance(out, torch.Tensor):
            return out
        start, steps, _ = self.chains.get(src, (tuple(src.shape), {}, None))
        try:
            last = steps[len(steps) - 1] if steps else source_dims(start)
            steps = {**steps, len(steps): (dims := step(name, args[1:], kwargs, last, out.shape))}
            if name in ("view", "reshape") and not on_shards(start, dims, self.grid_split):
                raise NotLocal  # a shard's extents the reshape's sizes do not divide (odd shards, a shuffle)
            if self.closes(start, steps, tuple(out.shape)):
                self.mark(out, tuple(out.shape[-3:]))
            else:
                self.chains[out] = (start, steps, tuple(out.shape))
        except NotLocal:
            self.unsafe.append(f"{name} (a reshape no shard makes of its own) at {caller()}")
        return out

    def wholes(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args``, ``kwargs`` with each volume part way through reshapes whole (a run gathers it)."""
        return args, kwargs

    def needs_whole(self, m: nn.Module, x: torch.Tensor) -> bool:
        """Whether layer ``m`` reads ``x`` whole: a split volume reshaped part way (``x.view(N, -1)``
        before a Linear), or a split volume read by a layer that needs the whole (a Linear over W), is
        too small to split (a bottleneck of fewer voxels than ranks, as a traced plan replicates it), or
        ran whole at the build (:data:`~hybridpar.planner.analysis.KEPT_WHOLE`)."""
        if x in self.chains:
            return True
        whole = self.original(m)
        entry = registry.lookup(whole)
        if x in self.split and x.dim() != 5:  # not a volume (h.mean(1)): only an activation runs on a shard
            return not families.elementwise(whole)
        return x in self.split and (dense_on_split(m, registry.lookup(m)) or hasattr(m, KEPT_WHOLE) or (
            entry is not None and entry.splittable and not self.module_fits(whole, x, key=id(whole))))
