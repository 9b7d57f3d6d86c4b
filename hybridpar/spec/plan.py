"""Resolve a spec against a model and a global input shape: one record per graph node, in forward order.

Why: ``parallelize`` and ``explain`` must agree on every decision (which split each layer runs
under, where the stages begin, where activations are redistributed), and every check that needs
the model (globs, halos, batch arithmetic) must run before any process starts. The model is traced
into a graph (:mod:`hybridpar.spec.graph`); shapes come from one forward pass on the meta device (no
memory, no FLOPs spent); what each layer is comes from the layer registry
(:mod:`hybridpar.nn.registry`), halos from :mod:`hybridpar.geometry`, the same arithmetic the
distributed layers run.

Split rules, in order: a layer rule (first matching glob) wins; window and resampling layers (conv,
pool, upsample) take the grid's spatial split; pointwise layers and elementwise functions (norms,
activations, ``+``, ``torch.cat`` along channels) keep the split of the activation they receive, so
they never add a redistribute; whole-volume reductions (global pooling) run on their input's split
and return a replicated output; everything else (Flatten, Linear) runs replicated, after a gather.
A gather inside a split region (a replicated node whose output is split again later) is what a
layer nobody registered would silently cost: it is flagged (``LayerPlan.gather``), warned about by
the engine and marked by ``explain``. An unregistered module on a split input is an error.
"""

from __future__ import annotations

import difflib
import fnmatch
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from hybridpar import flops as flop_count
from hybridpar import geometry
from hybridpar.nn import registry
from hybridpar.spec.config import GridSpec, LayerRule, ParallelSpec, SpecError, Split
from hybridpar.spec.graph import INPUT, ModelGraph, Node, UntraceableError, trace, trace_values

AXES = ("d", "h", "w")
BYTES_PER_ELEMENT = 4  # activations are planned in float32
REPLICATED: Split = (1, 1, 1)


@dataclass(frozen=True)
class LayerPlan:
    """What one node (a layer, or a function such as ``+`` or ``torch.cat``) runs as. Local shapes are
    those of the most loaded rank (shard 0) for one micro-batch; ``halo`` is, per dim (d, h, w), the
    widest (low, high) halo any rank receives. ``split`` is the layout the node computes in (its inputs
    are redistributed to it where they differ: ``redistribute``), ``out_split`` that of its output
    (replicated after a whole-volume reduction). ``inputs`` names the nodes it reads (``"(input)"``:
    the model input); ``gather`` marks a replicated node that gathers a split input inside a split
    region."""

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
    inputs: tuple[str, ...] = ()
    out_split: Split | None = None
    gather: bool = False

    @property
    def local_train_flops(self) -> float:
        """Training FLOPs one rank of this layer's stage runs per step (per data replica, per shard)."""
        return self.train_flops / math.prod(self.split)

    @property
    def replicated(self) -> bool:
        return self.split == REPLICATED

    @property
    def output_split(self) -> Split:
        return self.split if self.out_split is None else self.out_split


# ---------------------------------------------------------------------- the model's layers
def sequential_layers(model: nn.Module) -> tuple[list[tuple[str, nn.Module | None]], dict[str, int]]:
    """Nodes ``(name, module)`` in forward order (module None for a function), and each container's
    first node index. Any model torch.fx can trace (see :mod:`hybridpar.spec.graph`)."""
    graph = trace(model)
    return [(n.name, n.module) for n in graph.nodes], graph.containers


def trace_shapes(model: nn.Module, leaves: list[tuple[str, nn.Module | None]],
                 input_shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(first tensor input, output) shape of every node from one forward on the meta device."""
    graph = trace(model)
    return _node_shapes(graph, trace_values(graph, tuple(input_shape)))


def _node_shapes(graph: ModelGraph, values: dict) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    shapes = []
    for n in graph.nodes:
        out = values[n.name]
        if not isinstance(out, torch.Tensor):
            raise SpecError(f"{n.name} ({n.kind}): returns {type(out).__name__}, not a tensor: values "
                            f"computed from shapes are not supported in a parallelized forward (the "
                            f"shapes of split tensors are local); write sizes as constants or scale "
                            f"factors")
        first = next((values[i] for i in n.inputs if isinstance(values.get(i), torch.Tensor)), None)
        shapes.append((tuple(first.shape) if first is not None else tuple(out.shape), tuple(out.shape)))
    return shapes


# ---------------------------------------------------------------------- per-layer arithmetic
def node_halos(name: str, m: nn.Module, entry: registry.LayerEntry | None, in_shape: tuple[int, ...],
           out_shape: tuple[int, ...], split: Split) -> tuple[tuple[int, int], ...]:
    """Widest (low, high) halo per dim; a split too fine for the layer raises what would fit."""
    if split == REPLICATED:
        return ((0, 0),) * 3
    try:
        if entry is not None and m is not None:
            return entry.halo_widths(m, name, in_shape, out_shape, split)
        for i, parts in enumerate(split):  # an elementwise function: every shard must be non-empty
            registry.check_extent(name, in_shape[2 + i], parts, i)
        return ((0, 0),) * 3
    except geometry.HaloError as err:
        size = "x".join(map(str, in_shape[2:]))
        kind = type(m).__name__ if m is not None else "function"
        raise SpecError(f"layers: {name} ({kind}) cannot run split {list(split)} on its input of {size} "
                        f"voxels: {err}") from None


def forward_flops(m: nn.Module | None, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> int:
    """Forward matmul FLOPs of one call, from the layer's registry entry (2 per multiply-accumulate, as
    FlopCounterMode counts); for a model that cannot be copied to the meta device."""
    entry = registry.lookup(m) if m is not None else None
    if entry is None:
        return 0
    x, y = torch.empty(in_shape, device="meta"), torch.empty(out_shape, device="meta")
    return entry.flops(m, x, y)[0].get("forward", 0)


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


def local_shape(shape: tuple[int, ...], micro: int, split: Split) -> tuple[int, ...]:
    """The most loaded rank's shape of a value of global ``shape`` under ``split``, per micro-batch."""
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
                stages: int, sends: Sequence[int] | None = None) -> list[int]:
    """``pipeline.stages: auto``: balance the training FLOPs each rank of a stage runs per
    micro-batch (a layer's FLOPs divided over its spatial shards), then the bytes sent between
    stages, then the activation memory each rank keeps (:func:`balance_stages`)."""
    per_rank = [-(-f // math.prod(s)) for f, s in zip(train_flops, splits, strict=True)]
    return balance_stages(per_rank, stages, sends=activation_bytes if sends is None else sends,
                          memory=activation_bytes)


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


@dataclass
class Analysis:
    """A model on a global input, analysed once: its graph, every node's shapes and FLOPs. Resolving
    a spec against it (:func:`resolve`) costs no tracing, so a planner can try thousands of specs."""

    model: nn.Module
    input_shape: tuple[int, ...]
    graph: ModelGraph
    leaves: list[tuple[str, nn.Module | None]]
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    flops: list[int]
    train_flops: list[int]
    count: flop_count.FlopCount | None

    @property
    def containers(self) -> dict[str, int]:
        return self.graph.containers


def check_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    """``input_shape`` as a tuple, if it is a global batch N, C, D, H, W."""
    shape = tuple(input_shape)
    if len(shape) != 5 or not all(isinstance(s, int) and s >= 1 for s in shape):
        raise SpecError(f"input shape must be 5 positive integers N, C, D, H, W (the global batch), got "
                        f"{list(shape)}")
    return shape


def analyse(model: nn.Module, input_shape: Sequence[int], graph: ModelGraph | None = None) -> Analysis:
    """Trace ``model`` (unless its ``graph`` is given), its shapes on a global input of
    ``input_shape`` (N, C, D, H, W) and its FLOPs."""
    shape = check_input_shape(input_shape)
    graph = trace(model) if graph is None else graph
    shapes = _node_shapes(graph, trace_values(graph, shape))
    leaves = [(n.name, n.module) for n in graph.nodes]
    try:
        counted: flop_count.FlopCount | None = flop_count.count(model, shape)
    except TypeError:
        counted = None
    if counted is None:
        fwd = [forward_flops(m, i, o) for (_, m), (i, o) in zip(leaves, shapes, strict=True)]
        train = [f * (2 if i == 0 else 3) for i, f in enumerate(fwd)]
    else:
        sums = leaf_flop_sums(counted, leaves)
        fwd, train = [s[0] for s in sums], [s[0] + s[1] + s[2] for s in sums]
    return Analysis(model, shape, graph, leaves, shapes, fwd, train, counted)


def _concat_dim(node: Node, ndim: int) -> int | None:
    dim = node.fx_node.kwargs.get("dim", node.fx_node.args[1] if len(node.fx_node.args) > 1 else 0)
    return dim % ndim if isinstance(dim, int) else None


def _role(node: Node, in_shape: tuple[int, ...]) -> tuple[str, registry.LayerEntry | None]:
    """How ``node`` meets a split input: a registry role, or ``"unregistered"``."""
    if node.module is not None:
        entry = registry.lookup(node.module)
        return (entry.role, entry) if entry is not None else ("unregistered", None)
    role = registry.function_role(node.target)
    if role == "concat":
        role = "pointwise" if _concat_dim(node, len(in_shape)) == 1 else "dense"
    return role or "dense", None


def _split_input(node: Node, out_split: dict[str, Split], input_split: Split | None) -> bool:
    """Whether some input of ``node`` is already split (the model input counts once a layer split it)."""
    return any((input_split or REPLICATED) != REPLICATED if n == INPUT else out_split[n] != REPLICATED
               for n in node.inputs)


def resolve(spec: ParallelSpec, a: Analysis, world_size: int | None = None,
            halos: Callable[..., tuple[tuple[int, int], ...]] = node_halos) -> list[LayerPlan]:
    """The plan of ``spec`` on an analysed model (see the module doc for the rules). ``halos`` computes
    one node's halos (the performance model passes a memoised, terser one)."""
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    elif not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
    grid, pipe = spec.grid, spec.pipeline
    micro = _batch(grid, pipe.microbatches, a.input_shape[0])
    nodes, leaves, shapes = a.graph.nodes, a.leaves, a.shapes
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

    out_split: dict[str, Split] = {}
    input_split: Split | None = None  # the layout the model input is sharded in: its first reader's
    splits: list[Split] = []
    halo_list = []
    gathers: list[bool] = []
    for i, node in enumerate(nodes):
        in_shape, out_shape = shapes[i]
        spatial_in = len(in_shape) == 5
        role, entry = _role(node, in_shape)
        # the layout an elementwise node keeps: its first split input's (shards must agree)
        layouts = [(input_split or grid.spatial) if n == INPUT else out_split[n] for n in node.inputs]
        producer = next((s for s in layouts if s != REPLICATED), REPLICATED)
        if node.name in rule_of:
            split = rule_of[node.name].split
            if split != REPLICATED and not (spatial_in and role not in ("dense", "unregistered")):
                why = "its input is not N, C, D, H, W" if not spatial_in else \
                    "it is not a conv, pool, norm, resampling or elementwise layer"
                raise SpecError(f"layers[{rule_of[node.name].pattern!r}]: {node.name} ({node.kind}) cannot "
                                f"be split spatially ({why}); use spatial: replicate for it")
        elif not spatial_in:
            split = REPLICATED
        elif role in ("window", "transposed", "resample"):
            # split by the grid; a layer on an already replicated input too small to split (after a
            # global pooling) stays replicated
            small = any(in_shape[2 + k] < p for k, p in enumerate(grid.spatial))
            split = REPLICATED if small and not _split_input(node, out_split, input_split) else grid.spatial
        elif role in ("pointwise", "reduce"):
            split = producer
        elif role == "unregistered" and _split_input(node, out_split, input_split):
            raise SpecError(f"{node.name} ({node.kind}): this layer type is not registered and its input is "
                            f"split {list(producer)}: register it (hybridpar.nn.register, see the README) "
                            f"so it can run split, or add a rule {{{node.name!r}: {{spatial: replicate}}}} "
                            f"to run it whole after a gather")
        else:
            split = REPLICATED
        if INPUT in node.inputs and input_split is None:
            input_split = split if spatial_in else REPLICATED
        replicated_out = entry is not None and entry.replicated_output(node.module)
        out_split[node.name] = REPLICATED if (replicated_out or len(out_shape) != 5) else split
        splits.append(split)
        halo_list.append(halos(node.name, node.module, entry, in_shape, out_shape, split))
        gathers.append(split == REPLICATED and spatial_in and _split_input(node, out_split, input_split))
    # a gather is flagged where the activation is split again after it (inside a split region)
    split_later = [False] * len(nodes)
    later = False
    for i in range(len(nodes) - 1, -1, -1):
        split_later[i] = later
        later = later or splits[i] != REPLICATED
    gathers = [g and s for g, s in zip(gathers, split_later, strict=True)]

    input_split = input_split or REPLICATED
    local_out = [local_shape(o, micro, out_split[n.name]) for n, (_, o) in zip(nodes, shapes, strict=True)]
    act = [BYTES_PER_ELEMENT * math.prod(lo) for lo in local_out]
    if pipe.stages == "auto":
        sends = _cut_bytes(a.graph, act, micro, a.input_shape, input_split)
        starts = auto_stages(a.train_flops, splits, act, grid.pipe, sends)
    else:
        starts = _named_stages(pipe.stages, leaves, a.containers)  # count checked by ParallelSpec
    stage_of = [sum(1 for s in starts if s <= i) - 1 for i in range(len(nodes))]

    index = a.graph.index()

    def redistributes(i: int) -> bool:
        node = nodes[i]
        if len(shapes[i][0]) != 5:
            return False
        srcs = [(input_split, a.input_shape) if n == INPUT else (out_split[n], shapes[index[n]][1])
                for n in node.inputs]
        return any(s != splits[i] and not broadcasts(s, shape) for s, shape in srcs)

    return [LayerPlan(
        name=node.name, kind=node.kind, stage=stage_of[i], split=splits[i],
        rule=rule_of[node.name].pattern if node.name in rule_of else None,
        input_shape=shapes[i][0], output_shape=shapes[i][1],
        local_input_shape=local_shape(shapes[i][0], micro, splits[i]), local_output_shape=local_out[i],
        halo=halo_list[i], params=sum(p.numel() for p in node.module.parameters()) if node.module else 0,
        flops=a.flops[i], activation_bytes=act[i], redistribute=redistributes(i),
        train_flops=a.train_flops[i], inputs=node.inputs, out_split=out_split[node.name], gather=gathers[i])
        for i, node in enumerate(nodes)]


def broadcasts(split: Split, shape: Sequence[int]) -> bool:
    """Whether a value of global ``shape`` in layout ``split`` is read by split computations as it is:
    a replicated one-voxel operand (a pooled gate) broadcasts against any shard, no redistribute."""
    return split == REPLICATED and len(shape) == 5 and all(e == 1 for e in shape[2:])


def live_across(graph: ModelGraph) -> list[list[str]]:
    """Per cut after node ``i``: the values a later stage still reads (the model input included), in
    forward order. What a pipeline carries from one stage to the next."""
    return live_values([n.name for n in graph.nodes], [n.inputs for n in graph.nodes], graph.output)


def live_values(names: Sequence[str], inputs: Sequence[tuple[str, ...]], output: str) -> list[list[str]]:
    """:func:`live_across` from each node's name and inputs (as a plan's records hold them)."""
    index = {name: i for i, name in enumerate(names)}
    index[INPUT] = -1
    last_use: dict[str, int] = {}
    for i, srcs in enumerate(inputs):
        for src in srcs:
            last_use[src] = i
    last_use[output] = len(names)
    order = [INPUT, *names]
    return [[v for v in order if index[v] <= i < last_use.get(v, -2)] for i in range(len(names))]


def _cut_bytes(graph: ModelGraph, act: list[int], micro: int, input_shape: tuple[int, ...],
               input_split: Split) -> list[int]:
    """Bytes per micro-batch a stage ending after node ``i`` sends on (every live value, skips too)."""
    index = graph.index()
    in_bytes = BYTES_PER_ELEMENT * math.prod(local_shape(input_shape, micro, input_split))
    return [sum(in_bytes if v == INPUT else act[index[v]] for v in live) for live in live_across(graph)]


def build_plan(spec: ParallelSpec, model: nn.Module, input_shape: Sequence[int],
               world_size: int | None = None, graph: ModelGraph | None = None) -> list[LayerPlan]:
    """Resolve ``spec`` for ``model`` (traced once more unless its ``graph`` is given) on a global
    input of ``input_shape`` (N, C, D, H, W)."""
    shape = check_input_shape(input_shape)
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    elif not spec.grid.is_resolved:
        raise SpecError(f"grid: {spec.grid.arithmetic} has a -1; give the world size to resolve it")
    micro = _batch(spec.grid, spec.pipeline.microbatches, shape[0])  # batch errors before any tracing
    try:
        return resolve(spec, analyse(model, shape, graph))
    except UntraceableError as err:
        if spec.grid.pipe != 1:
            raise SpecError(f"{err}. A pipeline cuts the traced graph; without one (pipe: 1) such a model "
                            f"runs by module swapping") from None
        if spec.layers:
            raise SpecError(f"{err}. Such a model runs by module swapping, every layer under the grid's "
                            f"split: per-layer rules (layers: {[r.pattern for r in spec.layers]}) need the "
                            f"traced graph") from None
    from hybridpar.spec.swapped import swapped_plan  # noqa: PLC0415 (it builds on this module)

    return swapped_plan(model, shape, spec.grid.spatial, micro)
