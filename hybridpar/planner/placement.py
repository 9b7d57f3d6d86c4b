"""Where each node of a traced model runs: the walk that places every node in a split, in forward order.

Why apart from the plan: placing a node is the planner's one decision with many rules (a layer rule, the
grid's split for window layers, the producer's for pointwise ones, replicated where too small, a
reshape chain kept on shards; :mod:`hybridpar.planner.plan` says them in order); the plan then sizes,
stages and records what the walk decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridpar.nn import registry, samples
from hybridpar.planner import batch_extent, calls, per_sample
from hybridpar.planner.analysis import REPLICATED, Analysis, TooSmallToSplit
from hybridpar.planner.batch_reads import picks, read_for_shape
from hybridpar.planner.elementwise import elementwise
from hybridpar.planner.graph import INPUT, OUTPUT, Node
from hybridpar.planner.space_maps import SpaceMap
from hybridpar.planner.spec_view import RuleView, SpecView
from hybridpar.planner.swapped import nested_block, nested_output_split
from hybridpar.planner.terms import SpecError, Split


def _concat_dim(node: Node, ndim: int) -> int | None:
    dim = node.fx_node.kwargs.get("dim", node.fx_node.args[1] if len(node.fx_node.args) > 1 else 0)
    return dim % ndim if isinstance(dim, int) else None


def _keeps_space(node: Node) -> bool:
    """Whether a ``repeat``/``expand``/``tile`` of a 5-D tensor leaves its spatial dims alone (a
    channel repeat): then it is pointwise in space and runs on the shard."""
    sizes = node.fx_node.args[1:] if node.op == "method" else node.fx_node.args[1:2]
    if len(sizes) == 1 and isinstance(sizes[0], list | tuple):
        sizes = sizes[0]
    keep = -1 if node.target == "expand" else 1
    return len(sizes) >= 3 and all(isinstance(s, int) and s == keep for s in sizes[-3:])


def _role(node: Node, in_shape: tuple[int, ...], values: set[str]) -> tuple[str, registry.LayerEntry | None]:
    """How ``node`` meets a split input: a registry role, or ``"unregistered"``. ``values``: the nodes
    whose value is not a tensor (a ``getattr`` that returns a tensor, ``x.T``, is no shape read)."""
    if node.module is not None:
        entry = registry.lookup(node.module)
        if entry is None and nested_block(node.module):
            return "nested", None
        return (entry.role, entry) if entry is not None else ("unregistered", None)
    if node.name == OUTPUT:  # the outputs, each in its own layout: the split ones in one
        return "output", None
    if calls.volume_reduction(node.target, node.fx_node.args, dict(node.fx_node.kwargs), len(in_shape)):
        return "volume_reduction", None  # over D, H, W per sample: split, its value replicated
    role = registry.function_role(node.target) or ("pointwise" if elementwise(node.target) else None)
    if role == "shape" and node.name not in values:
        role = "dense"
    if node.target in ("repeat", "expand", "tile", torch.tile) and len(in_shape) == 5:
        role = "pointwise" if _keeps_space(node) else "dense"
    if role == "concat":
        role = "pointwise" if _concat_dim(node, len(in_shape)) == 1 else "dense"
    return role or "dense", None


def _check_nested(node: Node, in_shape: tuple[int, ...], split: Split, micro: int) -> bool:
    """Refuse a module of the user's that the graph keeps whole unless it runs split by its own forward
    (every layer in it registered and wide enough, every call between them one that runs split:
    :mod:`hybridpar.planner.calls`); whether its output is split."""
    try:
        return nested_output_split(node.module, in_shape, split, micro)
    except TooSmallToSplit:
        raise
    except SpecError as err:
        raise SpecError(f"{node.name} ({node.kind}), run by module swapping inside as torch.fx cannot trace "
                        f"it: {err}; or add a rule {{{node.name!r}: {{spatial: replicate}}}} to run it "
                        f"whole") from None


def _too_small(in_shape: tuple[int, ...], out_shape: tuple[int, ...], split: Split,
               err: TooSmallToSplit) -> str:
    """Why a node cannot run under ``split`` (``err``: its halo check's, or that of a layer inside it),
    in a few words for ``explain``: its own extents where they are fewer than the split, else the
    halo check's reason."""
    for what, shape in (("input", in_shape), ("output", out_shape)):
        for k, parts in enumerate(split):
            if len(shape) == 5 and shape[2 + k] < parts:
                size = "x".join(map(str, shape[2:]))
                return f"its {what} of {size} voxels is fewer than the split {list(split)} along {'dhw'[k]}"
    return f"split {list(split)} of its input of {'x'.join(map(str, in_shape[2:]))} voxels: {err.reason}"


@dataclass
class Walk:
    """The layouts decided so far, node by node in forward order (the rules: the module doc). Each node
    is placed from the layouts of the nodes it reads, so one pass decides them all."""

    spec: SpecView
    a: Analysis
    rule_of: dict[str, RuleView]
    micro: int
    index: dict[str, int] = field(init=False)
    input_split: Split | None = None  # the layout the model input is sharded in: its first reader's
    out_split: dict[str, Split] = field(default_factory=dict)
    chain_split: dict[str, Split | None] = field(default_factory=dict)  # a reshape chain's, by its first node
    splits: list[Split] = field(default_factory=list)
    halos: list[tuple[tuple[int, int], ...]] = field(default_factory=list)
    gathers: list[bool] = field(default_factory=list)
    auto: dict[str, str] = field(default_factory=dict)  # node -> why the planner replicated it (_too_small)
    whole_out: set[str] = field(default_factory=set)  # user modules run split whose output is replicated
    samples_at: dict[str, int] = field(default_factory=dict)  # values with the samples along a dim but 0
    folded: set[str] = field(default_factory=set)  # values whose dim 0 holds each sample in several rows
    derived: set[str] = field(default_factory=lambda: {INPUT})  # values computed from the input
    fx_names: dict[torch.fx.Node, str] = field(default_factory=dict)  # each node's, by its fx node
    extents: dict[torch.fx.Node, int | str] = field(default_factory=dict)  # batch extent's degree; "shape"

    def __post_init__(self) -> None:
        self.index = self.a.graph.index()

    @property
    def input_layout(self) -> Split:
        """The layout the model input is sharded in (replicated where no node reads it split)."""
        return self.input_split or REPLICATED

    def place(self, i: int, node: Node) -> None:
        """Decide node ``i``'s layout and record it."""
        in_shape, out_shape = self.a.shapes[i]
        if INPUT in node.inputs or any(n in self.derived for n in node.inputs):
            self.derived.add(node.name)
        self._refuse_across_samples(node, in_shape, out_shape)
        role, entry = _role(node, in_shape, self.a.graph.values)
        mapped = self._chain(node)
        split = mapped if mapped is not None else self._asked(node, role, in_shape)
        split = self._fitted(i, node, role, entry, split, mapped is not None)
        self._note_replicated_input(node, split, out_shape)
        self._record(i, node, role, entry, split, mapped is not None)

    def _refuse_across_samples(self, node: Node, in_shape: tuple[int, ...], out_shape: tuple[int, ...]
                               ) -> None:
        """Refuse a call across the samples of a batch that data parallelism or micro-batches split
        (each part would give its own answer, unlike one process), as a forward run by module swapping
        refuses it: whatever is not known to keep the samples apart."""
        batch = self.a.input_shape[0]
        if self.micro >= batch:
            return
        name, nd = calls.name_of(node.target).strip("_"), len(in_shape)
        args, kwargs = tuple(node.fx_node.args), dict(node.fx_node.kwargs)
        if name == "getattr" and len(args) > 1 and args[1] in per_sample.TRANSPOSES:
            name = args[1]  # m.T, m.mT: a transpose
        first = node.inputs[0] if node.inputs else None
        held = bool(in_shape) and (in_shape[0] == batch or first in self.folded)  # its first input's samples
        if any(n in self.samples_at for n in node.inputs) or node.op != "module" and nd >= 2 and \
                held and (name in ("stack", "unsqueeze") or name in per_sample.TRANSPOSES):
            self._follow_samples(node, name, args, kwargs, out_shape)
            return
        if node.name == OUTPUT:
            return
        if why := self._batch_extent(node, name, args, kwargs, batch):
            raise SpecError(f"{node.name}: {why} at {_line(node)}")
        carried = self._carriers(node, batch)
        if node.op == "module":
            shape = tuple(carried[0].shape) if carried else ()
            if carried and (why := samples.single_values(node.module, shape, self.micro, batch)):
                raise SpecError(f"{node.name}: {why} at {_line(node)}")
            why = samples.module_across(node.module, carried[0]) if carried else None
            if why:
                raise SpecError(f"{node.name}: {why} at {_line(node)}: works across the samples of the "
                                f"batch, which data parallelism or micro-batches hold apart (each part would "
                                f"give its own answer)")
        else:
            self._refuse_call_across(node, name, args, kwargs, nd, held, out_shape, batch)
        # a layer or call that keeps the rows of a fold apart gives rows again, judged as samples after it
        if carried and node.name in self.derived and len(out_shape) >= 1 and isinstance(out_shape[0], int) \
                and out_shape[0] != batch and out_shape[0] % batch == 0:
            self.folded.add(node.name)

    def _refuse_call_across(self, node: Node, name: str, args: tuple, kwargs: dict, nd: int, held: bool,
                            out_shape: tuple[int, ...], batch: int) -> None:
        """Refuse a function or method node that draws random numbers per sample or works across the
        samples (:meth:`_refuse_across_samples` for a call)."""
        if picks(node.target, args) and read_for_shape(node.fx_node):
            return self.derived.discard(node.name)  # h[0].numel(): a sample picked for its shape holds none
        drawn = out_shape if all(isinstance(d, int) for d in out_shape) else None  # several shapes: no draw
        sized = batch_extent.sizes_batch(name, args, kwargs, self._kind)
        if per_sample.draws_per_sample(name, drawn, batch, sized) or (  # randn(h.shape), randn_like(h)
                nd >= 2 and held and per_sample.draws_alike(name)):
            raise SpecError(f"{node.name} ({calls.name_of(node.target)}) at {_line(node)}: draws random "
                            f"numbers for the samples of a batch that data parallelism or micro-batches hold "
                            f"apart (each part would draw what one process draws for the first samples); "
                            f"draw them outside the forward, or run without splitting the batch")
        why = self._across(node, batch)
        if why:
            raise SpecError(f"{node.name}: {why} at {_line(node)}: works across the samples of the batch, "
                            f"which data parallelism or micro-batches hold apart (each part would give its "
                            f"own answer): work on each sample, e.g. reduce over dim=(1, 2, 3, 4)")

    def _batch_extent(self, node: Node, name: str, args: tuple, kwargs: dict, batch: int) -> str | None:
        """Follow the batch's extent read off a value holding the batch (``x.shape[0]``, ``x.size(0)``,
        ``numel()``, arithmetic on them: its degree, :func:`hybridpar.planner.batch_extent.combined`);
        why ``node`` uses it as a value, where it does (:func:`hybridpar.planner.batch_extent.misuse`)."""
        found = self._degree
        fx, dim = node.fx_node, args[1] if len(args) > 1 else kwargs.get("dim")
        if name in batch_extent.READS + ("getattr",) and node.op != "module" and self._carriers(node, batch):
            if name == "getattr" and dim == "shape" or name == "size" and dim is None:
                self.extents[fx] = "shape"
            elif name in ("numel", "nelement") or name == "size" and dim == 0:
                self.extents[fx] = 1
            return None
        if name == "getitem" and found(args[0]) == "shape":
            if dim == 0 or isinstance(dim, slice) and dim.start in (None, 0) and dim.stop != 0:
                self.extents[fx] = 1 if dim == 0 else "shape"
            return None
        value = self.a.graph.traced[tuple(self.a.input_shape)][node.name]
        read = [a for a in fx.all_input_nodes if found(a)]
        first = args[0] if args else None
        first = first[0] if isinstance(first, list | tuple) and first else first
        if read and name == "add" and isinstance(value, list | tuple) and read == [first]:
            self.extents[fx] = "shape"  # [b, c] + [1] * 3 (MONAI's squeeze-excitation): a shape it leads
            return None
        if read and isinstance(value, int | float) and not isinstance(value, bool):
            degrees = [found(a) if found(a) != "shape" else 1 for a in (*args, 0, 0)[:2]]
            self.extents[fx] = batch_extent.combined(name, *degrees, args[1] if len(args) > 1 else None)
            return None  # n * 2, x.numel() / x.size(0): its degree in the extent
        return (self._carriers(node, batch) and batch_extent.fixed_batch(name, args, kwargs, self._kind)) or \
            batch_extent.misuse(name, args, kwargs, self._kind)

    def _degree(self, a: Any) -> int | str:
        """What a node's argument holds of the batch's extent: its degree (0: none), or ``"shape"``."""
        return self.extents.get(a, 0) if isinstance(a, torch.fx.Node) else 0

    def _kind(self, a: Any) -> str | None:
        """:func:`hybridpar.planner.batch_extent.misuse`'s ``kind`` of a node's argument."""
        return "shape" if self._degree(a) == "shape" else "extent" if self._degree(a) else None

    def _across(self, node: Node, batch: int) -> str | None:
        """What a function or method node does across the samples of the values it reads that carry
        them (along dim 0), judged as a forward run by module swapping judges the same call
        (:func:`hybridpar.planner.per_sample.across`, on the meta values the trace gave): anything not
        known to keep the samples apart is refused, never run per part."""
        carriers = self._carriers(node, batch)
        if not carriers:
            return None
        values = self.a.graph.traced[tuple(self.a.input_shape)]
        if not self.fx_names:
            self.fx_names.update({n.fx_node: n.name for n in self.a.graph.nodes})
        value = lambda a: values[self.fx_names.get(a, INPUT)]  # noqa: E731 (the placeholder: the input)
        args = torch.fx.node.map_arg(tuple(node.fx_node.args), value)
        kwargs = torch.fx.node.map_arg(dict(node.fx_node.kwargs), value)
        func: object = node.target
        if calls.name_of(func) == "getattr":  # an attribute: a shape, a dtype (alike on every part), m.T
            func = args[1]
            if func == "shape":
                return None
        return per_sample.across(func, args, calls.canonical(kwargs), carriers, values[node.name], batch)

    def _carriers(self, node: Node, batch: int) -> list[torch.Tensor]:
        """The values (meta tensors, as traced) ``node`` reads that were computed from the input and
        hold the ``batch`` samples along dim 0."""
        values = self.a.graph.traced[tuple(self.a.input_shape)]
        return [values[n] for n in dict.fromkeys(node.inputs) if n in self.derived and isinstance(
            values[n], torch.Tensor) and values[n].dim() >= 1 and (values[n].shape[0] == batch
                                                                    or n in self.folded)]

    def _follow_samples(self, node: Node, name: str, args: tuple, kwargs: dict, out_shape: tuple[int, ...]
                        ) -> None:
        """Follow the samples of a batch along a dim other than 0 (``torch.stack(feats, 0)``, then a mean
        over the new dim: :func:`hybridpar.planner.per_sample.samples_to`); refuse what works across
        them, or reads them along different dims counted from the right."""
        batch = self.a.input_shape[0]
        carried = [(len(shape), self.samples_at.get(n, 0)) for n in node.inputs
                   if len(shape := self._value_shape(n)) >= 2 and (n in self.samples_at or shape[0] == batch
                                                                  or n in self.folded)]
        if not carried:
            return
        nd, at = carried[0]
        entry = registry.lookup(node.module) if node.op == "module" else None
        if len({a - n for n, a in carried}) > 1:
            where: int | str = f"{name} (reads the samples along different dims)"
        elif node.op == "module":  # a layer: only one working voxel by voxel keeps them where they are
            where = at + len(out_shape) - nd if entry is not None and entry.role == "pointwise" else \
                f"{node.kind} (not known to keep the samples apart)"
        else:
            where = per_sample.samples_to(name, args, kwargs, nd, at,
                                          len(out_shape) if node.name != OUTPUT else None)
        if where and not isinstance(where, str) and node.name == self.a.graph.output:
            where = f"{name} (returns the samples along dim {where}, not 0)"
        if isinstance(where, str):
            raise SpecError(f"{node.name}: {where} at {_line(node)}: works across the samples of the batch, "
                            f"which data parallelism or micro-batches hold apart (each part would give its "
                            f"own answer): work on each sample, e.g. reduce over dim=(1, 2, 3, 4)")
        if where:
            self.samples_at[node.name] = where

    def _value_shape(self, name: str) -> tuple[int, ...]:
        """The global shape of the value node ``name`` (or the model input) gives."""
        return self.a.input_shape if name == INPUT else self.a.shapes[self.index[name]][1]

    def _first_reader(self, node: Node) -> bool:
        """Whether ``node`` is the first to read the model input (whose layout it then decides)."""
        return INPUT in node.inputs and self.input_split is None

    def _split_input(self, node: Node) -> bool:
        """Whether some input of ``node`` is already split (the model input counts once a layer split it)."""
        return any(self.input_layout != REPLICATED if n == INPUT else self.out_split[n] != REPLICATED
                   for n in node.inputs)

    def _producer(self, node: Node) -> Split:
        """The layout an elementwise node keeps: its first split input's (shards must agree)."""
        layouts = [(self.input_split or self.spec.grid.spatial) if n == INPUT else self.out_split[n]
                   for n in node.inputs]
        return next((s for s in layouts if s != REPLICATED), REPLICATED)

    def _chain(self, node: Node) -> Split | None:
        """The split of the reshape chain (channels to space) ``node`` is in, decided at its first node."""
        space_map = self.a.space_maps.get(node.name)
        if space_map is None:
            return None
        if node.name == space_map.nodes[0]:
            self.chain_split[node.name] = _space_map_split(space_map, self._producer(node), self.rule_of)
        return self.chain_split.get(space_map.nodes[0])

    def _asked(self, node: Node, role: str, in_shape: tuple[int, ...]) -> Split:
        """The split a layer rule or ``node``'s role asks for, before the check that it fits."""
        spatial_in = len(in_shape) == 5
        if node.name in self.rule_of:
            return self._ruled(node, role, spatial_in)
        if not spatial_in:
            return REPLICATED
        if role in ("window", "transposed", "resample", "nested"):
            return self._grid_split(node, in_shape)
        if role in ("pointwise", "reduce", "shape", "volume_reduction"):  # a shape read: as it is
            return self._producer(node)
        if role == "output":
            return self._output_split(node)
        if role == "unregistered" and self._split_input(node):
            raise SpecError(f"{node.name} ({node.kind}): {registry.unregistered(node.module)} and its "
                            f"input is split {list(self._producer(node))}: register it "
                            f"(hybridpar.nn.register, see the README) so it can run split, or add a rule "
                            f"{{{node.name!r}: {{spatial: replicate}}}} to run it whole after a gather")
        return REPLICATED

    def _ruled(self, node: Node, role: str, spatial_in: bool) -> Split:
        """A layer rule's split, refused where ``node`` cannot run split at all."""
        rule = self.rule_of[node.name]
        if rule.split != REPLICATED and not (spatial_in and role not in ("dense", "unregistered")):
            why = "its input is not N, C, D, H, W" if not spatial_in else \
                "it is not a conv, pool, norm, resampling or elementwise layer"
            raise SpecError(f"layers[{rule.pattern!r}]: {node.name} ({node.kind}) cannot "
                            f"be split spatially ({why}); use spatial: replicate for it")
        return rule.split

    def _grid_split(self, node: Node, in_shape: tuple[int, ...]) -> Split:
        """The grid's split; a layer on an already replicated input too small to split (after a global
        pooling) stays replicated. The model input is not such an input: a grid finer than it is
        refused by the layer that would split it first, as any split that empties a shard."""
        grid = self.spec.grid.spatial
        small = any(in_shape[2 + k] < p for k, p in enumerate(grid))
        replicate = small and not self._first_reader(node) and not self._split_input(node)
        return REPLICATED if replicate else grid

    def _output_split(self, node: Node) -> Split:
        """Split outputs stay split where one share of the volume weighs them all (5-D, same extents)."""
        extents = {self._value_shape(n)[2:] for n in node.inputs}
        ranks = {len(self._value_shape(n)) if n != INPUT else 5 for n in node.inputs}
        return self._producer(node) if len(extents) == 1 and ranks == {5} else REPLICATED

    def _fitted(self, i: int, node: Node, role: str, entry: registry.LayerEntry | None, split: Split,
                mapped: bool) -> Split:
        """``split``, or replicated where the node is too small to split there (its halos, or a layer
        inside a user's module run split); a rule's split, ``strict`` and the model input's first
        reader are never changed, only refused by the halo check that follows."""
        in_shape, out_shape = self.a.shapes[i]
        free = not mapped and not self.spec.strict and node.name not in self.rule_of \
            and not self._first_reader(node)
        if split != REPLICATED and free:
            try:
                self.a.halos(i, entry, split)
                if role == "nested":
                    self._nest(node, in_shape, split)
            except TooSmallToSplit as err:
                self.auto[node.name] = _too_small(in_shape, out_shape, split, err)
                split = REPLICATED
        elif role == "nested" and split != REPLICATED:
            self._nest(node, in_shape, split)
        if role == "nested" and split == REPLICATED and self.micro < self.a.input_shape[0]:
            _check_nested(node, in_shape, REPLICATED, self.micro)  # what it does across the samples
        return split

    def _nest(self, node: Node, in_shape: tuple[int, ...], split: Split) -> None:
        """Check a user's module run split by its own forward; note it where its output is replicated."""
        if not _check_nested(node, in_shape, split, self.micro):
            self.whole_out.add(node.name)

    def _note_replicated_input(self, node: Node, split: Split, out_shape: tuple[int, ...]) -> None:
        """A node replicated because what it reads was: say which (a region too small to split runs
        replicated until a window layer's input is large enough again)."""
        if split == REPLICATED and len(out_shape) == 5 and node.name not in self.rule_of \
                and node.name not in self.auto:
            from_auto = next((n for n in node.inputs if n in self.auto), None)
            if from_auto is not None:
                self.auto[node.name] = f"reads {from_auto}, replicated"

    def _record(self, i: int, node: Node, role: str, entry: registry.LayerEntry | None, split: Split,
                mapped: bool) -> None:
        """Keep node ``i``'s split, its output's layout, its halos and whether it gathers."""
        in_shape, out_shape = self.a.shapes[i]
        spatial_in = len(in_shape) == 5
        if self._first_reader(node):
            self.input_split = split if spatial_in else REPLICATED
        replicated_out = node.name in self.whole_out or role == "volume_reduction" or \
            (entry is not None and entry.replicated_output(node.module))
        self.out_split[node.name] = split if mapped else \
            REPLICATED if (replicated_out or len(out_shape) != 5) else split
        self.splits.append(split)
        self.halos.append(((0, 0),) * 3 if mapped else self.a.halos(i, entry, split))
        self.gathers.append(split == REPLICATED and spatial_in and self._split_input(node)
                            and node.name not in self.auto)

    def redistributes(self, i: int) -> bool:
        """Whether node ``i`` reads a 5-D value in another layout than its own (one that does not
        broadcast): its input is then redistributed."""
        if len(self.a.shapes[i][0]) != 5:
            return False
        srcs = [(self.input_layout if n == INPUT else self.out_split[n], self._value_shape(n))
                for n in self.a.graph.nodes[i].inputs]
        return any(s != self.splits[i] and not broadcasts(s, shape, self.splits[i])
                   for s, shape in srcs if len(shape) == 5)


def _space_map_split(space_map: SpaceMap, producer: Split, rule_of: dict[str, RuleView]) -> Split | None:
    """The split a chain of reshapes between channels and space runs in: its input's, where every
    rank's output box is then the one that split gives it (:meth:`SpaceMap.fits`) and no rule names
    a node of it; None where it runs as any other dense node (replicated, after a gather)."""
    if producer == REPLICATED or any(n in rule_of for n in space_map.nodes):
        return None
    return producer if space_map.fits(producer) else None


def broadcasts(split: Split, shape: Sequence[int], reader: Split) -> bool:
    """Whether a value of global ``shape`` in layout ``split`` is read by a computation split ``reader``
    without a redistribute: a replicated operand of extent 1 along a dim the reader splits (a pooled
    gate, one slice ``h[:, :, -1:]``) broadcasts along it against any shard, and is cut to the shard's
    box along the dims it spans (a redistribute would cut its one voxel into empty shards)."""
    return split == REPLICATED and len(shape) == 5 and any(
        e == 1 for e, parts in zip(shape[2:], reader, strict=True) if parts > 1)


def _line(node: Node) -> str:
    """``file:line`` of the user's code that made ``node`` (the tracer's ``meta["line"]``)."""
    return node.fx_node.meta.get("line", "?")
