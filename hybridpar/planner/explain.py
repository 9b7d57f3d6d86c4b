"""The resolved plan as a table a person can check before spending a single rank-hour.

Why: a spec is a promise about memory and balance; printing what each rank will hold (local
shapes, halos, activation bytes) and what each stage will cost turns that promise into numbers that
can be compared with the device's memory and with each other, without launching any process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from torch import nn

from hybridpar.axes import Axes
from hybridpar.planner.config import ParallelSpec
from hybridpar.planner.graph import UntraceableError, trace
from hybridpar.planner.plan import build_plan
from hybridpar.planner.records import LayerPlan
from hybridpar.planner.schedule import microbatches_in_flight
from hybridpar.planner.stages import live_values
from hybridpar.planner.swapped import calls_met
from hybridpar.planner.terms import Split

COLUMNS = ("layer", "type", "stage", "split", "local input", "halo d h w", "params", "FLOPs", "act/rank")


def _si(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:g}"


def _bytes(x: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if x >= scale:
            return f"{x / scale:.1f} {unit}"
    return f"{x:g} B"


def _split(split: Split) -> str:
    return "x".join(map(str, split)) if split != (1, 1, 1) else "repl"


def _starts_replication(r: LayerPlan, by_name: dict[str, LayerPlan]) -> bool:
    """Whether ``r`` is the first node of a region the planner replicated (its inputs were not)."""
    return bool(r.auto_replicated) and not any(by_name[n].auto_replicated for n in r.inputs if n in by_name)


def auto_replicated(records: Sequence[LayerPlan]) -> list[LayerPlan]:
    """The nodes the planner replicated because they are too small to split, and those that read them
    until the volume is split again."""
    return [r for r in records if r.auto_replicated]


def banner(spec: ParallelSpec, records: Sequence[LayerPlan]) -> str:
    """Three lines a run prints at start: the grid, the stages, and which layers run split (the ones
    the planner replicated marked ``!``). ``spec`` must have a resolved grid."""
    g = spec.grid
    stages = "; ".join(f"{s}: {recs[0].name} .. {recs[-1].name} ({len(recs)})"
                       for s in range(g.pipe) if (recs := [r for r in records if r.stage == s]))
    volume = [r for r in records if len(r.input_shape) == 5]
    split = [r for r in volume if not r.replicated]
    layouts = sorted({r.split for r in split})
    auto = auto_replicated(records)
    names = ", ".join(f"{r.name}!" for r in auto[:6]) + (", ..." if len(auto) > 6 else "")
    marked = f"; {len(auto)} replicated as too small to split: {names}" if auto else ""
    return "\n".join([
        f"layout: grid {g.arithmetic} = {g.data * g.pipe * g.stage_size} ranks",
        f"layout: {g.pipe} stage(s), {spec.pipeline.schedule} x {spec.pipeline.microbatches} "
        f"micro-batch(es): {stages}",
        f"layout: {len(split)} of {len(volume)} volume layers split "
        f"{', '.join(_split(s) for s in layouts) or '(none)'}{marked}"])


def _halo(rec: LayerPlan) -> str:
    if rec.replicated or len(rec.input_shape) != 5:
        return "-"
    return " ".join(f"{lo}/{hi}" for lo, hi in rec.halo)


def format_plan(spec: ParallelSpec, records: Sequence[LayerPlan], input_shape: Sequence[int]) -> str:
    """Header (grid, batch arithmetic), one row per layer, redistributes, and a per-stage summary.

    ``spec`` must have a resolved grid. FLOPs are forward FLOPs of the whole global batch on the
    un-sharded model; local shapes and activation bytes are per rank and per micro-batch.
    """
    g, p = spec.grid, spec.pipeline
    n = input_shape[0]
    micro = n // g.data // p.microbatches
    lines = [
        f"grid: {g.arithmetic} = {g.data * g.pipe * g.stage_size} ranks",
        f"axes: {Axes.of(g.sizes).describe(r.split for r in records)}",
        f"pipeline: {p.schedule}, {p.microbatches} micro-batch(es) of {micro} sample(s) "
        f"(global batch {n} / data({g.data}) = {n // g.data} per replica), "
        f"recompute {'on' if p.recompute else 'off'}",
        f"input: {'x'.join(map(str, input_shape))} (global); local shapes and act/rank are per rank and "
        f"micro-batch on the most loaded rank; FLOPs are forward, whole global batch",
        banner(spec, records).splitlines()[-1].removeprefix("layout: "),
        "",
    ]
    rows = [COLUMNS]
    by_name = {r.name: r for r in records}
    for i, r in enumerate(records):
        previous = records[i - 1].name if i else "(input)"
        if r.inputs and r.inputs != (previous,):  # a graph: say where the node's inputs come from
            rows.append((f"  <- {', '.join(r.inputs)}",))
        if r.redistribute:
            srcs = sorted({_split(by_name[n].output_split) if n in by_name else "input" for n in r.inputs})
            rows.append((f"  ~ redistribute {', '.join(srcs)} -> {_split(r.split)}",))
        if r.transpose_bytes:
            rows.append((f"  ⇄ FFT transposes (pencils): {_bytes(r.transpose_bytes)} received per rank per "
                         f"micro-batch forward, as much again backward",))
        if _starts_replication(r, by_name):
            rows.append((f"  ! replicated from here ({r.auto_replicated}) until a layer can split again; "
                         f"strict: true refuses instead",))
        if r.gather:
            rows.append(("  ! gathers a split activation inside a split region: every rank holds the whole "
                         "volume here (register the layer to split it)",))
        split = _split(r.split) + ("!" if r.auto_replicated else "")
        rows.append((r.name, r.kind, str(r.stage), split, "x".join(map(str, r.local_input_shape)),
                     _halo(r), _si(r.params), _si(r.flops), _bytes(r.activation_bytes)))
    widths = [max(len(row[c]) for row in rows if len(row) > 1) for c in range(len(COLUMNS))]
    for row in rows:
        lines.append(row[0] if len(row) == 1 else
                     "  ".join(v.ljust(w) if c < 6 else v.rjust(w)
                               for c, (v, w) in enumerate(zip(row, widths, strict=True))).rstrip())
    lines.append("")
    for s in range(g.pipe):
        recs = [r for r in records if r.stage == s]
        rank_flops = sum(r.flops * r.rank_share * p.microbatches for r in recs)
        rank_train = sum(r.train_flops * r.rank_share * p.microbatches for r in recs)
        act = sum(r.activation_bytes for r in recs)
        kept = microbatches_in_flight(p.schedule, g.pipe, p.microbatches, s)
        lines.append(
            f"stage {s}: {recs[0].name} .. {recs[-1].name} ({len(recs)} layers): "
            f"{_si(sum(r.params for r in recs))} params, {_si(rank_flops)} FLOPs fwd "
            f"({_si(rank_train)} fwd+bwd) per step on the most loaded rank, "
            f"activations {_bytes(act)} per rank per micro-batch ({_bytes(act * kept)} with {kept} in "
            f"flight under {p.schedule}{', before recompute' if p.recompute else ''})")
    lines += _carried(records, g.pipe)
    lines.append(f"total: {_si(sum(r.params for r in records))} params, "
                 f"{_si(sum(r.flops for r in records))} FLOPs forward, "
                 f"{_si(sum(r.train_flops for r in records))} forward + backward")
    lines += [f"note: {n}" for n in cpu_notes(records)]
    return "\n".join(lines)


def _carried(records: Sequence[LayerPlan], stages: int) -> list[str]:
    """What each cut carries to the next stage when it is more than one tensor (skips of a graph)."""
    if stages < 2 or all(r.inputs == ((records[i - 1].name,) if i else ("(input)",))
                         for i, r in enumerate(records)):
        return []
    live = live_values([r.name for r in records], [r.inputs for r in records], records[-1].name)
    by_name = {r.name: r for r in records}
    lines = []
    for s in range(stages - 1):
        end = max(i for i, r in enumerate(records) if r.stage == s)
        names = live[end]
        size = sum(by_name[n].activation_bytes for n in names if n in by_name)
        lines.append(f"cut {s} -> {s + 1} carries {', '.join(names)} ({_bytes(size)} per rank per "
                     f"micro-batch)")
    return lines


# oneDNN takes a float32 conv on CPU only when N > 1 or N*C*D*H > 20480 (torch's ConvParams::use_mkldnn);
# below that, Conv3d runs aten::slow_conv3d, several times slower per call than a batch of 2 takes.
SLOW_CONV3D_ELEMENTS = 20480


def cpu_notes(records: Sequence[LayerPlan]) -> list[str]:
    """Warnings that only matter on CPU: 1-sample micro-batches whose local conv input is small
    enough for torch to fall off oneDNN onto its slow reference kernel."""
    slow = [r for r in records if r.kind in ("Conv3d", "ConvTranspose3d") and len(r.local_input_shape) == 5
            and r.local_input_shape[0] == 1 and math.prod(r.local_input_shape[:4]) <= SLOW_CONV3D_ELEMENTS]
    if not slow:
        return []
    names = ", ".join(r.name for r in slow[:4]) + (", ..." if len(slow) > 4 else "")
    return [f"on CPU, {len(slow)} conv(s) ({names}) get a 1-sample local input with N*C*D*H <= "
            f"{SLOW_CONV3D_ELEMENTS}: torch runs them on slow_conv3d instead of oneDNN (about 3x slower "
            f"per call); use micro-batches of 2 or more samples (fewer micro-batches) or a smaller "
            f"spatial split there. No effect on GPUs."]


def explain(spec: ParallelSpec, model: nn.Module, input_shape: Sequence[int],
            world_size: int | None = None) -> str:
    """Validate ``spec`` for ``model`` and return the plan table (raises :class:`SpecError`)."""
    records = build_plan(spec, model, input_shape, world_size)
    if world_size is not None:
        spec = spec.resolve_grid(world_size)
    table = format_plan(spec, records, tuple(input_shape))
    try:
        trace(model)
    except UntraceableError:  # run by module swapping: its calls between the layers, each as it runs
        micro = input_shape[0] // (spec.grid.data * spec.pipeline.microbatches)
        met = calls_met(model, tuple(input_shape), spec.grid.spatial, micro)
        table += "\n\ncalls between the layers (the model runs by module swapping):\n" + \
            "\n".join(f"  {line}" for line in met)
    return table
