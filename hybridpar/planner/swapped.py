"""The plan of a model torch.fx cannot trace, run by module swapping (:mod:`hybridpar.pipeline.swap`).

Why: ``explain`` and the engine need a plan for such a model too. Without the graph, the layers are
found by a forward on the meta device with hooks on every module that runs as one layer: one record
per call, in call order, each registered layer under the grid's split (module swapping runs every
layer under one split), the rest replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from hybridpar import flops as flop_count
from hybridpar.nn import registry
from hybridpar.nn.meta import meta_call, meta_state
from hybridpar.planner.analysis import REPLICATED, leaf_flop_sums, node_halos
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
from hybridpar.planner.shard_rehearsal import check_shards_compute_alike
from hybridpar.planner.space_maps import STEPS, NotLocal, close, source_dims, step
from hybridpar.planner.terms import SpecError, Split


def leaves(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that run as one layer: registered ones (not traced into) and childless ones."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if registry.lookup(child) is not None or not any(True for _ in child.children()):
                out.append((path, child))
            else:
                walk(path, child)

    walk("", model)
    return out


def _tensors(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among a call's arguments (lists of them too: ``torch.cat``)."""
    flat = [*args, *(a for v in args if isinstance(v, list | tuple) for a in v), *kwargs.values()]
    return [a for a in flat if isinstance(a, torch.Tensor)]


def nested_block(m: nn.Module | None) -> bool:
    """Whether ``m``, a node of a traced graph, is a block torch.fx could not trace into: a module of the
    user's made of children, unregistered, holding no parameters or buffers of its own (the tracer's
    other reasons to keep a module whole). Such a block runs by module swapping inside itself."""
    if m is None or registry.lookup(m) is not None or type(m).__module__.startswith("torch.nn"):
        return False
    own = any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False))
    return not own and any(True for _ in m.children())


def constant_in_space(t: torch.Tensor) -> bool:
    """Whether ``t`` broadcasts over a volume's spatial dims (a gate pooled to one voxel)."""
    return all(e == 1 for e in t.shape[-3:])


class LayoutWatch(TorchFunctionMode):
    """Follows, through a forward run by module swapping, which tensors are split (a split layer's
    output, and what elementwise functions make of it) and which are replicated (a whole-volume
    reduction's output, and what is computed from replicated tensors alone), and sees every torch
    function the forward calls outside its layers.

    A function that reads a split activation and is not elementwise would compute on the shard what
    it computes on the whole volume: noted in ``unsafe``. An elementwise one that broadcasts a
    replicated tensor constant in space into a split one (a squeeze-and-excitation gate) is a
    ``gate``: each shard's part of the replicated operand's gradient must be summed over the shards,
    which :meth:`into_shards` arranges (the plan's watch leaves the operand as it is). Reshapes of a
    split volume back into a volume (a pixel shuffle) are split where every shard maps onto its own
    output shard. Layers are seen by hooks (:meth:`hook`): a registered layer on a replicated input
    runs whole on it.
    """

    def __init__(self, split: Split) -> None:
        super().__init__()
        self.grid_split = split
        self.splits = split != REPLICATED  # False: a grid that splits nothing (every layer runs whole)
        self.depth = 0
        self.split = WeakIdKeyDictionary()
        self.replicated = WeakIdKeyDictionary()
        self.chains = WeakIdKeyDictionary()  # a split volume part way through reshapes: their atoms
        self.unsafe: list[str] = []
        self.gates = 0
        self.extents_read = False  # a split activation's spatial extents read outside the layers

    def reset(self) -> None:
        self.depth, self.gates, self.unsafe = 0, 0, []
        self.split, self.replicated = WeakIdKeyDictionary(), WeakIdKeyDictionary()
        self.chains = WeakIdKeyDictionary()

    def mark(self, t: torch.Tensor, split: bool = True) -> None:
        (self.split if split else self.replicated)[t] = True

    def runs_split(self, m: nn.Module, x: torch.Tensor) -> bool:
        """Whether layer ``m`` runs split on ``x``: registered as splittable, on a volume that is not
        replicated (the model input, before any layer, is split like its first reader)."""
        entry = registry.lookup(m)
        return self.splits and x.dim() == 5 and entry is not None and entry.splittable \
            and x not in self.replicated

    def after_layer(self, m: nn.Module, x: torch.Tensor, out: object, split: bool) -> None:
        """Mark layer ``m``'s output: split where it ran split (replicated after a whole-volume
        reduction), replicated where its input was, or where it gathers it (``Flatten``)."""
        if not isinstance(out, torch.Tensor):
            return
        entry = registry.lookup(m)
        if split:
            self.mark(out, out.dim() == 5 and not entry.replicated_output(m))
        elif x in self.replicated or (entry is not None and entry.extra.get("flattens")):
            self.mark(out, False)

    def into_shards(self, t: torch.Tensor) -> torch.Tensor:
        """The replicated operand of a gate as the split computation reads it (as it is, here)."""
        return t

    def _reads_extents(self, func, args: tuple, kwargs: dict) -> bool:
        """``x.shape``, ``x.size()`` or ``x.size(d)`` for a spatial ``d`` of a split activation: on a
        shard these are the shard's extents, not the volume's."""
        if not args or not isinstance(args[0], torch.Tensor) or args[0] not in self.split:
            return False
        if getattr(func, "__self__", None) is torch.Tensor.shape:
            return True
        if getattr(func, "__name__", "") != "size":
            return False
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return dim is None or dim % args[0].dim() >= 2

    @staticmethod
    def _role(func, args: tuple, kwargs: dict, first: torch.Tensor) -> str | None:
        name = getattr(func, "__name__", str(func)).strip("_")
        role = registry.function_role(func) or registry.function_role(name)
        if role == "concat":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            role = "pointwise" if isinstance(dim, int) and dim % first.dim() == 1 else None
        if name == "pad" and not any(args[1] if len(args) > 1 else kwargs.get("pad", (1,))):
            role = "pointwise"  # a pad by nothing (MONAI's UpCat when the shapes agree) is the identity
        return role

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.depth:
            return func(*args, **kwargs)
        self.extents_read = self.extents_read or self._reads_extents(func, args, kwargs)
        tensors = _tensors(args, kwargs)
        name = getattr(func, "__name__", "")
        if name in STEPS and len(tensors) == 1 and (tensors[0] in self.chains or (
                tensors[0] in self.split and tensors[0].dim() == 5)):
            out = func(*args, **kwargs)
            self._reshaped(name, args, kwargs, tensors[0], out)
            return out
        split = any(t in self.split for t in tensors)
        replicated = [t for t in tensors if t in self.replicated]
        pointwise = split and self._role(func, args, kwargs, tensors[0]) == "pointwise"
        gate = pointwise and bool(replicated) and all(constant_in_space(t) for t in replicated)
        if gate:
            self.gates += 1
            swap = {id(t): self.into_shards(t) for t in replicated}
            pick = lambda a: swap.get(id(a), a) if isinstance(a, torch.Tensor) else a  # noqa: E731
            args = tuple(type(a)(map(pick, a)) if isinstance(a, list | tuple) else pick(a) for a in args)
            kwargs = {k: pick(v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if any(t in self.chains for t in tensors):  # a reshape of a split volume left part way
            self.unsafe.append(f"{name} (on a split volume reshaped to {tensors[0].dim()} dims)")
            return out
        if not split:
            if tensors and len(replicated) == len(tensors):
                self.mark(out, False)
        elif pointwise and (gate or not replicated):
            self.mark(out)
        else:
            name = getattr(func, "__name__", str(func)).strip("_")
            self.unsafe.append(f"{name} (on a split and a replicated volume)" if pointwise else name)
        return out

    def _reshaped(self, name: str, args: tuple, kwargs: dict, src: torch.Tensor, out: object) -> None:
        """Follow a reshape of a split volume (a pixel shuffle: :mod:`hybridpar.planner.space_maps`): a
        volume again is split where each shard's box maps to its own output box under the grid's
        split (the forward reshapes the shard by the shard's extents it reads); anything else is
        unsafe."""
        if not isinstance(out, torch.Tensor):
            return
        start, steps = self.chains.get(src, (tuple(src.shape), {}))
        try:
            before = steps[len(steps) - 1] if steps else source_dims(start)
            steps = {**steps, len(steps): step(name, args[1:], kwargs, before, out.shape)}
            if out.dim() != 5:
                self.chains[out] = (start, steps)
            elif close("", steps, start, tuple(out.shape)).fits(self.grid_split):
                self.mark(out)
            else:
                raise NotLocal
        except NotLocal:
            self.unsafe.append(f"{name} (a reshape whose shards do not map onto the output's shards)")

    def hook(self, modules: list[nn.Module]) -> list:
        """Hooks that follow ``modules`` (the model's leaves): inside one, functions are the layer's."""
        def enter(m: nn.Module, args: tuple) -> None:
            self.depth += 1

        def leave(m: nn.Module, args: tuple, out: object) -> None:
            try:  # still inside the layer: what is read here is not the forward's
                x = next((a for a in args if isinstance(a, torch.Tensor)), None)
                if x is not None and self.depth == 1:
                    self.after_layer(m, x, out, self.runs_split(m, x))
            finally:
                self.depth -= 1

        return [m.register_forward_pre_hook(enter) for m in modules] + \
            [m.register_forward_hook(leave, always_call=True) for m in modules]


def swapped_plan(model: nn.Module, input_shape: Sequence[int], split: Split,
                 micro: int, nested: bool = False) -> list[LayerPlan]:
    """One record per call of a leaf module on a meta forward of the global input, in call order:
    registered splittable layers under ``split`` (those on a replicated input, a pooled gate, whole),
    the rest replicated. Fails with a :class:`SpecError` when the forward does not run on the meta
    device (it branches on tensor values), a layer nobody registered reads a split activation, or
    what it computes from a split activation's extents differs on a shard
    (:mod:`hybridpar.planner.shard_rehearsal`).
    ``nested``: ``model`` is a block inside a traced graph, whose input is split and whose shape reads
    answer with global extents (:mod:`hybridpar.pipeline.global_extents`), as a traced graph's do."""
    records, modules, watch = _follow(model, input_shape, split, micro, nested)
    if watch.extents_read and not nested:  # there they read the shard's: it must not matter
        outputs: dict[str, list] = {}
        for r in records:
            outputs.setdefault(r.name.split("#")[0], []).append((tuple(r.output_shape), r.out_split))
        check_shards_compute_alike(model, dict((m, n) for n, m in leaves(model)), input_shape, split, outputs)
    sums = leaf_flop_sums(flop_count.count(model, tuple(input_shape)), [(r.name, None) for r in records])
    return [dataclasses.replace(r, flops=f[0], train_flops=f[0] + f[1] + f[2],
                                activation_bytes=BYTES_PER_ELEMENT * math.prod(r.local_output_shape),
                                rank_share=rank_share(m, r.input_shape, r.output_shape, r.local_output_shape,
                                                      r.split),
                                transpose_bytes=transpose_bytes(m, r.input_shape, r.split, micro))
            for r, f, m in zip(records, sums, modules, strict=True)]


def swapped_gates(model: nn.Module, input_shape: Sequence[int], split: Split) -> int:
    """How many calls of the forward broadcast a replicated tensor into a split one (gates): where
    there are any, the engine follows the layouts at run time (:mod:`hybridpar.pipeline.swap`)."""
    return _follow(model, input_shape, split, 1)[2].gates


def _follow(model: nn.Module, input_shape: Sequence[int], split: Split, micro: int,
            nested: bool = False) -> tuple[list[LayerPlan], list[nn.Module], LayoutWatch]:
    """The records of :func:`swapped_plan` (FLOPs not counted), their modules, and the watch that
    followed the forward; raises what the forward does that cannot run split."""
    records: list[LayerPlan] = []
    modules: list[nn.Module] = []  # the module of each record
    names = dict((m, n) for n, m in leaves(model))
    watch = LayoutWatch(split)
    split_so_far = [False]
    calls: dict[str, int] = {}

    def enter(m: nn.Module, args: tuple) -> None:
        watch.depth += 1

    def hook(m: nn.Module, args: tuple, out: object) -> None:
        try:  # still inside the layer for the watch: what the hook reads is not the forward's
            record(m, args, out)
        finally:
            watch.depth -= 1

    def record(m: nn.Module, args: tuple, out: object) -> None:
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None or not isinstance(out, torch.Tensor):
            return
        entry = registry.lookup(m)
        if x in watch.chains:  # a split volume reshaped part way (x.view(N, -1) before a Linear)
            watch.unsafe.append(f"{names[m]} ({type(m).__name__}, on a split volume reshaped to "
                                f"{x.dim()} dims)")
            raise _unsafe(model, watch)
        if entry is None and x.dim() == 5 and split_so_far[0] and x not in watch.replicated:
            raise SpecError(f"{names[m]} ({type(m).__name__}): {registry.unregistered(m)} and its "
                            f"input is split {list(split)}: register it (hybridpar.nn.register) so that the "
                            f"model can run by module swapping")
        runs_split = watch.runs_split(m, x)  # on a replicated input (a pooled gate), whole
        s = split if runs_split else REPLICATED
        split_so_far[0] = split_so_far[0] or runs_split
        out_split = REPLICATED if out.dim() != 5 or entry is None or entry.replicated_output(m) else s
        if runs_split and not records and not nested:
            watch.mark(x)  # the model input is sharded like its first reader
        watch.after_layer(m, x, out, runs_split)
        try:
            halo = node_halos(names[m], m, entry, tuple(x.shape), tuple(out.shape), s)
        except SpecError:  # on what a function unsafe on shards computed (x.mean(...)): that is the error
            if watch.unsafe:
                raise _unsafe(model, watch) from None
            raise
        calls[names[m]] = calls.get(names[m], -1) + 1  # the k-th further call is "name#k", as in a graph
        modules.append(m)
        records.append(LayerPlan(
            name=names[m] if not calls[names[m]] else f"{names[m]}#{calls[names[m]]}",
            kind=type(m).__name__, stage=0, split=s, rule=None, input_shape=tuple(x.shape),
            output_shape=tuple(out.shape), local_input_shape=local_shape(tuple(x.shape), micro, s),
            local_output_shape=local_shape(tuple(out.shape), micro, out_split),
            halo=halo,
            params=sum(p.numel() for p in m.parameters()), flops=0, activation_bytes=0, redistribute=False,
            inputs=(records[-1].name,) if records else ("(input)",), out_split=out_split))

    handles = [m.register_forward_pre_hook(enter) for m in names]
    handles += [m.register_forward_hook(hook) for m in names]
    state, dtype = meta_state(model)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
    if nested and split != REPLICATED:
        watch.mark(x)
        split_so_far[0] = True
    try:
        with watch:
            meta_call(model, state, x)
    except SpecError:
        raise
    except Exception as err:
        where = records[-1].name if records else "its first layer"
        raise SpecError(f"model ({type(model).__name__}): neither torch.fx nor a run on the meta device can "
                        f"follow its forward (after {where}: {type(err).__name__}: {err}); branch on "
                        f"configuration, not on tensor values") from err
    finally:
        for h in handles:
            h.remove()
    if not records:
        raise SpecError(f"model ({type(model).__name__}): no layer ran in its forward")
    if watch.unsafe:
        raise _unsafe(model, watch)
    return records, modules, watch


def _unsafe(model: nn.Module, watch: LayoutWatch) -> SpecError:
    calls = ", ".join(sorted(set(watch.unsafe)))
    return SpecError(f"model ({type(model).__name__}): run by module swapping, its forward calls {calls} "
                     f"on split activations outside any layer; on a shard these would not give what "
                     f"they give on the whole volume. Supported there: elementwise arithmetic and "
                     f"activations, torch.cat along channels; use a layer instead (nn.Flatten, "
                     f"nn.Upsample, nn.AdaptiveAvgPool3d), or make the forward traceable by torch.fx")
