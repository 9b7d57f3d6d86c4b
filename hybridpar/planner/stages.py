"""Where a pipeline's stages begin, and what crosses each cut between them.

Why a module of its own: stage placement is the one decision of a plan that is an optimisation
(:func:`balance_stages`) rather than a rule, and what a cut carries (:func:`live_across`) is read by
the planner (to place stages), the engine (to send values on), ``explain`` and the performance
model (to cost the sends). All of it is arithmetic on node names, inputs and sizes.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Sequence

from torch import nn

from hybridpar.planner.graph import INPUT, ModelGraph
from hybridpar.planner.terms import SpecError


def _prefix(values: Sequence[int]) -> list[int]:
    pre = [0]
    for v in values:
        pre.append(pre[-1] + v)
    return pre


def balance_stages(costs: Sequence[int], stages: int, sends: Sequence[int] | None = None,
                   memory: Sequence[int] | None = None, blocked: Collection[int] = ()) -> list[int]:
    """Start index of each of ``stages`` contiguous, non-empty stages, minimising the costliest stage;
    no stage but the first starts at an index in ``blocked``.

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
    starts = lambda k, i: [j for j in range(k - 1, i) if j == 0 or j not in blocked]  # noqa: E731
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            best[k][i] = min((max(best[k - 1][j], pre_c[i] - pre_c[j]) for j in starts(k, i)), default=inf)
    bound = best[stages][n]
    if bound == inf:
        raise SpecError(f"grid.pipe: every way to cut the model into {stages} stages cuts where no cut "
                        f"may fall")
    key: list[list[tuple[float, float]]] = [[(inf, inf)] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    key[0][0] = (0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in starts(k, i):
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


def auto_stages(rank_flops: Sequence[float], activation_bytes: Sequence[int], stages: int,
                sends: Sequence[int] | None = None, blocked: Collection[int] = ()) -> list[int]:
    """``pipeline.stages: auto``: balance the training FLOPs the most loaded rank of a stage runs
    per micro-batch (``rank_flops``, per layer: its FLOPs times ``LayerPlan.rank_share``), then the
    bytes sent between stages, then the activation memory each rank keeps (:func:`balance_stages`);
    no stage starts at a node in ``blocked``."""
    per_rank = [round(f) for f in rank_flops]
    return balance_stages(per_rank, stages, sends=activation_bytes if sends is None else sends,
                          memory=activation_bytes, blocked=blocked)


def named_stages(names: Sequence[str], leaves: Sequence[tuple[str, nn.Module | None]],
                 containers: dict[str, int]) -> list[int]:
    """``pipeline.stages`` given as layer (or container) names: each stage's first node index."""
    index = {name: i for i, (name, _) in enumerate(leaves)} | containers
    starts = []
    for name in names:
        if name not in index:
            near = difflib.get_close_matches(name, list(index), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise SpecError(f"pipeline.stages: {name!r} is not a layer of the model{hint}; layer names "
                            f"look like {describe_layers(leaves)}")
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


def describe_layers(leaves: Sequence[tuple[str, nn.Module | None]], k: int = 6) -> str:
    """A few layer names and their count, for error messages that say what names look like."""
    names = [n for n, _ in leaves]
    shown = names if len(names) <= k else [*names[: k - 1], "...", names[-1]]
    return f"{', '.join(shown)} ({len(names)} layers)"


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


def live_bytes(graph: ModelGraph, value_bytes: Sequence[int], input_bytes: int) -> list[int]:
    """Bytes a stage ending after node ``i`` sends on per micro-batch: every live value, skips too.
    ``value_bytes[i]``: node ``i``'s output on the sending rank; ``input_bytes``: the model input's."""
    index = graph.index()
    return [sum(input_bytes if v == INPUT else value_bytes[index[v]] for v in live)
            for live in live_across(graph)]
