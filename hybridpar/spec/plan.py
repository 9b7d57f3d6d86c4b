"""Resolve a spec against a model and a global input shape: one record per layer, in forward order.

Why: ``parallelize`` and ``explain`` must agree on every decision (which split each layer runs
under, where the stages begin, where activations are redistributed), and every check that needs
the model (globs, halos, batch arithmetic) must run before any process starts. Shapes come from
one forward pass on the meta device (no memory, no FLOPs spent); halos from
:mod:`hybridpar.geometry`, the same arithmetic the distributed layers run.

Split rules, in order: a layer rule (first matching glob) wins; window layers (conv, pool) take the
grid's spatial split; pointwise layers (BatchNorm3d, activations, dropout) keep the split of the
activation they receive, so they never add a redistribute; everything else (Flatten, Linear, custom
modules) runs replicated, after an automatic gather.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridpar import flops as flop_count
from hybridpar import geometry
from hybridpar.spec.config import GridSpec, LayerRule, ParallelSpec, SpecError, Split

WINDOW = (nn.Conv3d, nn.ConvTranspose3d, nn.MaxPool3d, nn.AvgPool3d)
POINTWISE = (nn.BatchNorm3d, nn.Identity, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.PReLU, nn.ELU, nn.SELU,
             nn.CELU, nn.GELU, nn.SiLU, nn.Mish, nn.Sigmoid, nn.Tanh, nn.Hardtanh, nn.Hardswish,
             nn.Hardsigmoid, nn.Softplus, nn.Dropout, nn.Dropout3d, nn.AlphaDropout)
AXES = ("d", "h", "w")
BYTES_PER_ELEMENT = 4  # activations are planned in float32


@dataclass(frozen=True)
class LayerPlan:
    """What one leaf layer runs as. Local shapes are those of the most loaded rank (shard 0) for one
    micro-batch; ``halo`` is, per dim (d, h, w), the widest (low, high) halo any rank receives."""

    name: str
    kind: str
    stage: int
    split: Split
    rule: str | None
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    local_input_shape: tuple[int, ...]
    local_output_shape: tuple[int, ...]
    halo: tuple[tuple[int, int], ...]
    params: int
    flops: int
    activation_bytes: int
    redistribute: bool
    train_flops: int = 0  # forward + input gradient + weight gradient, whole global batch

    @property
    def local_train_flops(self) -> float:
        """Training FLOPs one rank of this layer's stage runs per step (per data replica, per shard)."""
        return self.train_flops / math.prod(self.split)

    @property
    def replicated(self) -> bool:
        return self.split == (1, 1, 1)


# ---------------------------------------------------------------------- the model's layers
def _require_sequential(module: nn.Module, name: str) -> None:
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        what = f"{name} ({type(module).__name__})"
        raise SpecError(
            f"{what}: only sequential models are supported (an nn.Sequential, or nested ones, whose "
            f"forward feeds each child's output to the next child); a custom forward may do anything. "
            f"Wrap the model: nn.Sequential(OrderedDict(features=model.features, head=model.head)) if "
            f"its forward applies those children in order, or nn.Sequential(model) to run it whole as "
            f"one replicated layer")


def sequential_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module]], dict[str, int]]:
    """Leaf layers ``(name, module)`` in forward order, and each container's first leaf index."""
    _require_sequential(model, "model")
    leaves: list[tuple[str, nn.Module]] = []
    containers: dict[str, int] = {}

    def walk(prefix: str, seq: nn.Sequential) -> None:
        for child_name, child in seq.named_children():
            name = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, nn.Sequential):
                _require_sequential(child, name)
                containers[name] = len(leaves)
                walk(name, child)
            else:
                leaves.append((name, child))

    walk("", model)
    if not leaves:
        raise SpecError("model: the sequential model has no layers")
    return leaves, {k: v for k, v in containers.items() if v < len(leaves)}


def trace_shapes(model: nn.Module, leaves: list[tuple[str, nn.Module]],
                 input_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(input, output) shape of every leaf from one forward on the meta device.

    ``functional_call`` swaps in meta parameters, so the user's model is neither copied nor moved.
    """
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    current = ["(model input)"]

    def pre(name: str):
        return lambda _m, _args: current.__setitem__(0, name)

    def post(_m, args, out):
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"{current[0]}: returns {type(out).__name__}; a sequential layer must "
                            f"return one tensor")
        shapes.append((tuple(args[0].shape), tuple(out.shape)))

    handles = []
    for name, module in leaves:
        handles.append(module.register_forward_pre_hook(pre(name)))
        handles.append(module.register_forward_hook(post))
    state = {k: torch.empty_like(v, device="meta")
             for k, v in [*model.named_parameters(), *model.named_buffers()]}
    try:
        dtype = next((t.dtype for t in state.values() if t.is_floating_point()), torch.get_default_dtype())
        torch.func.functional_call(model, state, (torch.empty(input_shape, device="meta", dtype=dtype),))
    except SpecError:
        raise
    except Exception as err:  # the user's model failed on this shape: say where
        raise SpecError(f"the model does not run on input shape {list(input_shape)}: at layer "
                        f"{current[0]}: {type(err).__name__}: {err}") from err
    finally:
        for h in handles:
            h.remove()
    return shapes


# ---------------------------------------------------------------------- per-layer arithmetic
def _triple(v) -> tuple[int, int, int]:
    return tuple(v) if isinstance(v, tuple | list) else (v, v, v)  # type: ignore[return-value]


def _window_args(m: nn.Module) -> list[dict]:
    """Per dim keyword arguments for :func:`geometry.window_plans` / ``transposed_plans``."""
    k = _triple(m.kernel_size)
    if isinstance(m, nn.ConvTranspose3d):
        return [dict(kernel=k[i], stride=_triple(m.stride)[i], padding=_triple(m.padding)[i],
                     dilation=_triple(m.dilation)[i], output_padding=_triple(m.output_padding)[i])
                for i in range(3)]
    stride = _triple(m.stride if m.stride is not None else m.kernel_size)  # pools: None = kernel
    dil = _triple(getattr(m, "dilation", 1))
    pad = m.padding
    if pad == "same":
        lohi = [geometry.same_padding(k[i], dil[i]) for i in range(3)]
    elif pad == "valid":
        lohi = [(0, 0)] * 3
    else:
        lohi = [(p, p) for p in _triple(pad)]
    return [dict(kernel=k[i], stride=stride[i], pad_lo=lohi[i][0], pad_hi=lohi[i][1], dilation=dil[i],
                 ceil_mode=bool(getattr(m, "ceil_mode", False))) for i in range(3)]


def _halos(name: str, m: nn.Module, in_shape: tuple[int, ...], split: Split) -> tuple[tuple[int, int], ...]:
    """Widest (low, high) halo per dim; a split too fine for the layer raises what would fit."""
    halo = []
    for i, parts in enumerate(split):
        if parts == 1:
            halo.append((0, 0))
            continue
        extent = in_shape[2 + i]
        try:
            if isinstance(m, WINDOW):
                args = _window_args(m)[i]
                if isinstance(m, nn.ConvTranspose3d):
                    plans, _ = geometry.transposed_plans(extent, parts, layer=name, dim=AXES[i], **args)
                else:
                    plans = geometry.window_plans(extent, parts, layer=name, dim=AXES[i], **args)
                halo.append((max(p.halo[0] for p in plans), max(p.halo[1] for p in plans)))
            else:  # pointwise: only needs every shard non-empty
                if extent < parts:
                    raise geometry.HaloError(f"{name}: dim {AXES[i]} has extent {extent}, too small to "
                                             f"split over {parts} ranks; use a split of at most {extent}")
                halo.append((0, 0))
        except geometry.HaloError as err:
            size = "x".join(map(str, in_shape[2:]))
            raise SpecError(f"layers: {name} ({type(m).__name__}) cannot run split {list(split)} on its "
                            f"input of {size} voxels: {err}") from None
    return tuple(halo)


def forward_flops(m: nn.Module, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int:
    """Forward FLOPs, 2 per multiply-accumulate; conv and linear only (as FlopCounterMode counts)."""
    if isinstance(m, nn.ConvTranspose3d):
        return 2 * math.prod(in_shape) * (m.out_channels // m.groups) * math.prod(_triple(m.kernel_size))
    if isinstance(m, nn.Conv3d | nn.Conv2d | nn.Conv1d):
        per_out = (m.in_channels // m.groups) * math.prod(m.kernel_size)
        return 2 * math.prod(out_shape) * per_out
    if isinstance(m, nn.Linear):
        return 2 * math.prod(out_shape) * m.in_features
    return 0


def leaf_flop_sums(counted: flop_count.FlopCount, leaves: list[tuple[str, nn.Module]]) -> list[list[int]]:
    """``[forward, input_grad, weight_grad, forward_other]`` per leaf, from one
    :func:`hybridpar.flops.count`: a conv inside a custom module is credited to that module's leaf."""
    index = {name: i for i, (name, _) in enumerate(leaves)}
    sums = [[0, 0, 0, 0] for _ in leaves]
    for rec in counted.per_layer:
        parts = rec.name.split("#", 1)[0].split(".")
        for k in range(len(parts), 0, -1):
            leaf = index.get(".".join(parts[:k]))
            if leaf is not None:
                s = sums[leaf]
                s[0] += rec.forward
                s[1] += rec.input_grad
                s[2] += rec.weight_grad
                s[3] += rec.forward_other
                break
    return sums


def layer_flops(model: nn.Module, leaves: list[tuple[str, nn.Module]], input_shape: tuple[int, ...],
                shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[int]:
    """Forward matmul FLOPs per leaf (see :func:`layer_flop_costs`)."""
    return layer_flop_costs(model, leaves, input_shape, shapes)[0]


def layer_flop_costs(model: nn.Module, leaves: list[tuple[str, nn.Module]], input_shape: tuple[int, ...],
                     shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[list[int], list[int]]:
    """Per leaf: forward matmul FLOPs, and training FLOPs (forward + input gradient + weight
    gradient), from :func:`hybridpar.flops.count` (one counting convention for the whole project).

    Stages are balanced on the training FLOPs, since that is what a stage spends per micro-batch:
    the first layer computes no input gradient, so balancing forward FLOPs leaves the first stage
    light. Falls back to :func:`forward_flops` when the model cannot be copied to the meta device
    (a training step then counts as 3x forward, 2x for the first layer).
    """
    try:
        counted = flop_count.count(model, input_shape)
    except TypeError:
        fwd = [forward_flops(m, i, o) for (_, m), (i, o) in zip(leaves, shapes, strict=True)]
        return fwd, [f * (2 if i == 0 else 3) for i, f in enumerate(fwd)]
    sums = leaf_flop_sums(counted, leaves)
    return [s[0] for s in sums], [s[0] + s[1] + s[2] for s in sums]


def _shard(extent: int, parts: int) -> int:
    """Extent held by the most loaded rank (balanced split, the first shards take the remainder)."""
    return -(-extent // parts)


def _local(shape: tuple[int, ...], micro: int, split: Split) -> tuple[int, ...]:
    if len(shape) != 5:
        return (micro, *shape[1:])
    return (micro, shape[1], *(_shard(shape[2 + i], split[i]) for i in range(3)))


# ---------------------------------------------------------------------- stages
def _prefix(values: Sequence[int]) -> list[int]:
    pre = [0]
    for v in values:
        pre.append(pre[-1] + v)
    return pre


def balance_stages(costs: Sequence[int], stages: int, sends: Sequence[int] | None = None,
                   memory: Sequence[int] | None = None) -> list[int]:
    """Start index of each of ``stages`` contiguous, non-empty stages, minimising the costliest stage.

    Among partitions with that minimum, the one sending the fewest bytes across boundaries wins
    (``sends[i]``: bytes layer ``i`` would send if a stage ended after it), so that a boundary falls
    after a pooling layer rather than before it: those bytes are time on every micro-batch. Among
    those, the one whose largest stage ``memory`` (bytes kept for backward per micro-batch) is
    smallest. Two exact dynamic programmes, O(stages * n^2); the second is exact because its key
    (bytes sent, largest memory) only grows, in order, as stages are appended.
    """
    n = len(costs)
    if stages > n:
        raise SpecError(f"grid.pipe: {stages} stages need at least {stages} layers; the model has {n}")
    sends = [0] * n if sends is None else list(sends)
    pre_c, pre_m = _prefix(costs), _prefix([0] * n if memory is None else memory)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            best[k][i] = min(max(best[k - 1][j], pre_c[i] - pre_c[j]) for j in range(k - 1, i))
    bound = best[stages][n]
    key: list[list[tuple[float, float]]] = [[(inf, inf)] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    key[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if pre_c[i] - pre_c[j] > bound or key[k - 1][j][0] == inf:
                    continue
                sent, mem = key[k - 1][j]
                cand = (sent + (sends[j - 1] if j else 0), max(mem, pre_m[i] - pre_m[j]))
                if cand < key[k][i]:
                    key[k][i], back[k][i] = cand, j
    starts, i = [], n
    for k in range(stages, 0, -1):
        i = back[k][i]
        starts.append(i)
    return starts[::-1]


def auto_stages(train_flops: Sequence[int], splits: Sequence[Split], activation_bytes: Sequence[int],
                stages: int) -> list[int]:
    """``pipeline.stages: auto``: balance the training FLOPs each rank of a stage runs per
    micro-batch (a layer's FLOPs divided over its spatial shards), then the bytes sent between
    stages, then the activation memory each rank keeps (:func:`balance_stages`)."""
    per_rank = [-(-f // math.prod(s)) for f, s in zip(train_flops, splits, strict=True)]
    return balance_stages(per_rank, stages, sends=activation_bytes, memory=activation_bytes)


def _named_stages(names: Sequence[str], leaves: list[tuple[str, nn.Module]],
                  containers: dict[str, int]) -> list[int]:
    index = {name: i for i, (name, _) in enumerate(leaves)} | containers
    starts = []
    for name in names:
        if name not in index:
            near = difflib.get_close_matches(name, list(index), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise SpecError(f"pipeline.stages: {name!r} is not a layer of the model{hint}; layer names "
                            f"look like {_some(leaves)}")
        starts.append(index[name])
    if starts[0] != 0:
        raise SpecError(f"pipeline.stages: the first stage must start at the first layer "
                        f"{leaves[0][0]!r}, not {names[0]!r}; list where every stage starts, the first "
                        f"included")
    for a, b, na, nb in zip(starts, starts[1:], names, names[1:], strict=False):
        if b <= a:
            raise SpecError(f"pipeline.stages: {nb!r} does not come after {na!r} in forward order; "
                            f"list stage starts in forward order")
    return starts


def _some(leaves: list[tuple[str, nn.Module]], k: int = 6) -> str:
    names = [n for n, _ in leaves]
    shown = names if len(names) <= k else [*names[: k - 1], "...", names[-1]]
    return f"{', '.join(shown)} ({len(names)} layers)"


# ---------------------------------------------------------------------- the plan
def _batch(grid: GridSpec, microbatches: int, batch: int) -> int:
    """Micro-batch size, after the checks that make data parallelism and the pipeline well defined."""
    if batch % grid.data:
        fits = ", ".join(str(d) for d in range(1, batch + 1) if batch % d == 0)
        raise SpecError(f"global batch {batch} does not split evenly over data({grid.data}) replicas; use "
                        f"a global batch that is a multiple of {grid.data}, or data in {{{fits}}}")
    per = batch // grid.data
    if per == 1 and (grid.pipe > 1 or microbatches > 1):
        raise SpecError(
            f"a pipeline (pipe={grid.pipe}, microbatches={microbatches}) was asked of a per-replica batch "
            f"of 1 (global batch {batch} / data({grid.data})): one sample cannot be split into "
            f"micro-batches, so the stages would run one after another. Volumes this large often fit "
            f"one sample per device when split spatially: use spatial parallelism (e.g. grid.spatial "
            f"[{grid.pipe * grid.spatial[0]}, {grid.spatial[1]}, {grid.spatial[2]}], pipe 1) or data "
            f"parallelism, with microbatches: 1")
    if per % microbatches:
        fits = ", ".join(str(m) for m in range(1, per + 1) if per % m == 0)
        raise SpecError(f"pipeline.microbatches: {microbatches} does not divide the per-replica batch "
                        f"{per} (global batch {batch} / data({grid.data})); counts that would: {fits}")
    return per // microbatches


def build_plan(spec: ParallelSpec, model: nn.Module, input_shape: Sequence[int],
               world_size: int | None = None) -> list[LayerPlan]:
    """Resolve ``spec`` for ``model`` on a global input of ``input_shape`` (N, C, D, H, W)."""
    shape = tuple(input_shape)
    if len(shape) != 5 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise SpecError(f"input shape must be 5 positive integers N, C, D, H, W (the global batch), got "
                        f"{list(shape)}")
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    elif not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
    grid, pipe = spec.grid, spec.pipeline
    micro = _batch(grid, pipe.microbatches, shape[0])
    leaves, containers = sequential_layers(model)

    rule_of: dict[str, LayerRule] = {}
    for rule in spec.layers:
        hits = [n for n, _ in leaves if fnmatch.fnmatchcase(n, rule.pattern)]
        if not hits:
            near = difflib.get_close_matches(rule.pattern, [n for n, _ in leaves], n=3, cutoff=0.5)
            hint = f" (close: {', '.join(near)})" if near else ""
            raise SpecError(f"layers[{rule.pattern!r}]: the glob matches no layer{hint}; layer names look "
                            f"like {_some(leaves)}")
        for n in hits:
            rule_of.setdefault(n, rule)  # first match wins

    shapes = trace_shapes(model, leaves, shape)
    splits: list[Split] = []
    halos = []
    for (name, m), (in_shape, _) in zip(leaves, shapes, strict=True):
        spatial_in = len(in_shape) == 5
        splittable = spatial_in and isinstance(m, WINDOW + POINTWISE)
        if name in rule_of:
            split = rule_of[name].split
            if split != (1, 1, 1) and not splittable:
                why = "its input is not N, C, D, H, W" if not spatial_in else "it is not a conv, pool, " \
                      "BatchNorm3d or elementwise layer"
                raise SpecError(f"layers[{rule_of[name].pattern!r}]: {name} ({type(m).__name__}) cannot "
                                f"be split spatially ({why}); use spatial: replicate for it")
        elif isinstance(m, WINDOW) and spatial_in:
            split = grid.spatial
        elif isinstance(m, POINTWISE) and spatial_in:
            split = splits[-1] if splits else grid.spatial
        else:
            split = (1, 1, 1)
        splits.append(split)
        halos.append(_halos(name, m, in_shape, split))

    flops, train_flops = layer_flop_costs(model, leaves, shape, shapes)
    local_out = [_local(o, micro, s) for (_, o), s in zip(shapes, splits, strict=True)]
    act = [BYTES_PER_ELEMENT * math.prod(lo) for lo in local_out]
    if pipe.stages == "auto":
        starts = auto_stages(train_flops, splits, act, grid.pipe)
    else:
        starts = _named_stages(pipe.stages, leaves, containers)  # count checked by ParallelSpec
    stage_of = [sum(1 for s in starts if s <= i) - 1 for i in range(len(leaves))]

    return [LayerPlan(
        name=name, kind=type(m).__name__, stage=stage_of[i], split=splits[i],
        rule=rule_of[name].pattern if name in rule_of else None,
        input_shape=shapes[i][0], output_shape=shapes[i][1],
        local_input_shape=_local(shapes[i][0], micro, splits[i]), local_output_shape=local_out[i],
        halo=halos[i], params=sum(p.numel() for p in m.parameters()), flops=flops[i],
        activation_bytes=act[i], redistribute=i > 0 and splits[i] != splits[i - 1],
        train_flops=train_flops[i])
        for i, (name, m) in enumerate(leaves)]
