"""The plan of a model torch.fx cannot trace, run by module swapping (:mod:`hybridpar.pipeline.swap`).

Why: ``explain`` and the engine need a plan for such a model too. Without the graph, the layers are
found by a forward on the meta device with hooks on every module that runs as one layer: one record
per call, in call order, each registered layer under the grid's split (module swapping runs every
layer under one split), the rest replicated.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from hybridpar import flops as flop_count
from hybridpar.nn import registry
from hybridpar.nn.meta import meta_call, meta_state
from hybridpar.planner.analysis import REPLICATED, leaf_flop_sums, node_halos
from hybridpar.planner.records import BYTES_PER_ELEMENT, LayerPlan, local_shape, rank_share, transpose_bytes
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


class _Watch(TorchFunctionMode):
    """Sees every torch function the forward calls outside its layers and notes those that read a
    split activation and are not elementwise (they would compute on the shard what they compute on
    the whole volume). Split-ness follows the tensors: a layer's split output, and what elementwise
    functions make of it."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = 0
        self.split: dict[int, torch.Tensor] = {}  # id -> tensor (kept, so that ids are not reused)
        self.unsafe: list[str] = []
        self.extents_read = False  # a split activation's spatial extents read outside the layers

    def mark(self, t: torch.Tensor) -> None:
        self.split[id(t)] = t

    def _reads_extents(self, func, args: tuple, kwargs: dict) -> bool:
        """``x.shape``, ``x.size()`` or ``x.size(d)`` for a spatial ``d`` of a split activation: on a
        shard these are the shard's extents, not the volume's."""
        if self.depth or not args or not isinstance(args[0], torch.Tensor) or id(args[0]) not in self.split:
            return False
        if getattr(func, "__self__", None) is torch.Tensor.shape:
            return True
        if getattr(func, "__name__", "") != "size":
            return False
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return dim is None or dim % args[0].dim() >= 2

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.extents_read = self.extents_read or self._reads_extents(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.depth or not isinstance(out, torch.Tensor):
            return out
        flat = [*args, *(a for v in args if isinstance(v, list | tuple) for a in v), *kwargs.values()]
        if not any(isinstance(a, torch.Tensor) and id(a) in self.split for a in flat):
            return out
        name = getattr(func, "__name__", str(func)).strip("_")
        role = registry.function_role(func) or registry.function_role(name)
        if role == "concat":
            dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
            role = "pointwise" if isinstance(dim, int) and dim % out.dim() == 1 else None
        if name == "pad" and not any(args[1] if len(args) > 1 else kwargs.get("pad", (1,))):
            role = "pointwise"  # a pad by nothing (MONAI's UpCat when the shapes agree) is the identity
        if role == "pointwise":
            self.mark(out)
        else:
            self.unsafe.append(name)
        return out


def swapped_plan(model: nn.Module, input_shape: Sequence[int], split: Split,
                 micro: int) -> list[LayerPlan]:
    """One record per call of a leaf module on a meta forward of the global input, in call order:
    registered splittable layers under ``split``, the rest replicated. Fails with a :class:`SpecError`
    when the forward does not run on the meta device (it branches on tensor values) or a layer
    nobody registered reads a split activation."""
    records: list[LayerPlan] = []
    modules: list[nn.Module] = []  # the module of each record
    names = dict((m, n) for n, m in leaves(model))
    watch = _Watch()
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
        spatial = x.dim() == 5
        if entry is None and spatial and split_so_far[0]:
            raise SpecError(f"{names[m]} ({type(m).__name__}): {registry.unregistered(m)} and its "
                            f"input is split {list(split)}: register it (hybridpar.nn.register) so that the "
                            f"model can run by module swapping")
        s = split if spatial and entry is not None and entry.splittable else REPLICATED
        split_so_far[0] = split_so_far[0] or s != REPLICATED
        out_split = REPLICATED if out.dim() != 5 or entry is None or entry.replicated_output(m) else s
        if s != REPLICATED and not records:
            watch.mark(x)  # the model input is sharded like its first reader
        if out_split != REPLICATED:
            watch.mark(out)
        calls[names[m]] = calls.get(names[m], -1) + 1  # the k-th further call is "name#k", as in a graph
        modules.append(m)
        records.append(LayerPlan(
            name=names[m] if not calls[names[m]] else f"{names[m]}#{calls[names[m]]}",
            kind=type(m).__name__, stage=0, split=s, rule=None, input_shape=tuple(x.shape),
            output_shape=tuple(out.shape), local_input_shape=local_shape(tuple(x.shape), micro, s),
            local_output_shape=local_shape(tuple(out.shape), micro, out_split),
            halo=node_halos(names[m], m, entry, tuple(x.shape), tuple(out.shape), s),
            params=sum(p.numel() for p in m.parameters()), flops=0, activation_bytes=0, redistribute=False,
            inputs=(records[-1].name,) if records else ("(input)",), out_split=out_split))

    handles = [m.register_forward_pre_hook(enter) for m in names]
    handles += [m.register_forward_hook(hook) for m in names]
    state, dtype = meta_state(model)
    x = torch.empty(tuple(input_shape), dtype=dtype, device="meta")
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
    if watch.extents_read and (not dist.is_initialized() or dist.get_rank() == 0):
        warnings.warn(f"model ({type(model).__name__}): run by module swapping, its forward reads the "
                      f"spatial extents of a split activation outside any layer; there they are the "
                      f"shard's, not the volume's (a traced forward reads the volume's): check that what it "
                      f"computes from them does not depend on the split", stacklevel=3)
    if watch.unsafe:
        calls = ", ".join(sorted(set(watch.unsafe)))
        raise SpecError(f"model ({type(model).__name__}): run by module swapping, its forward calls {calls} "
                        f"on split activations outside any layer; on a shard these would not give what "
                        f"they give on the whole volume. Supported there: elementwise arithmetic and "
                        f"activations, torch.cat along channels; use a layer instead (nn.Flatten, "
                        f"nn.Upsample, nn.AdaptiveAvgPool3d), or make the forward traceable by torch.fx")
    sums = leaf_flop_sums(flop_count.count(model, tuple(input_shape)), [(r.name, None) for r in records])
    return [dataclasses.replace(r, flops=f[0], train_flops=f[0] + f[1] + f[2],
                                activation_bytes=BYTES_PER_ELEMENT * math.prod(r.local_output_shape),
                                rank_share=rank_share(m, r.input_shape, r.output_shape, r.local_output_shape,
                                                      r.split),
                                transpose_bytes=transpose_bytes(m, r.input_shape, r.split, micro))
            for r, f, m in zip(records, sums, modules, strict=True)]
