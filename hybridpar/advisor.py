"""``python -m hybridpar.advisor``: choose the layout of a model on W ranks before spending the allocation.

Why: data, pipeline and spatial parallelism trade compute balance, halo traffic, pipeline bubbles,
gradient traffic and memory against each other, and which wins depends on the model, the volume, the
batch and the machine. This command enumerates layouts, predicts each one's step time and memory per
rank with :mod:`hybridpar.perfmodel` (halo exchange included: it is part of the model, not an
afterthought), keeps those that fit the device memory, and explains the choice against the
runners-up. It writes the chosen spec as YAML that :func:`hybridpar.load_spec` reads.

What it enumerates, for a global batch N on W ranks:

* the data degree ``d`` (dividing W and N), pipeline stages ``p`` (dividing W/d, 1F1B, stages
  balanced by :func:`hybridpar.planner.balance_stages`), micro-batches ``M`` (1, 2, 4, ... up to 8 per
  stage, dividing the replica batch);
* a spatial split of the stage's ``W/(d p)`` ranks for the convolutional part (every 3-factor split;
  only ``d >= h >= w`` ones when the volume is a cube), the dense head replicated;
* optionally a second split for the deeper window layers, from each pooling layer on: the main split
  with its largest factor halved, or replicated;
* activation recomputation, when memory is short.

Example::

    python -m hybridpar.advisor --model cosmoflow.model:build_lbann_model --input-shape 64,4,512,512,512 \\
        --world-size 256 --device-memory 16GB --machine v100 --out lbann512.yaml
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from hybridpar import perfmodel as pm
from hybridpar.planner import ParallelSpec, SpecError
from hybridpar.planner.cli_args import load_model, parse_shape
from hybridpar.planner.terms import Split

__all__ = ["Advice", "Candidate", "advise", "format_advice", "main", "parse_bytes"]

_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}
_CATEGORY_WHY = {"compute": "more compute per rank", "halo": "halo exchange and redistribution",
                 "pipeline": "pipeline bubble and stage sends", "grad_reduce": "gradient all-reduce",
                 "data_wait": "input slicing", "other": "fixed overheads"}


def parse_bytes(text: str) -> float:
    """``80GB`` (decimal), ``16GiB`` (binary), ``512MB``, or a plain number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"not a memory size: {text!r}; write e.g. 80GB, 16GiB or 512MB")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


@dataclass
class Candidate:
    """One layout and its prediction."""

    spec: ParallelSpec
    prediction: pm.Prediction
    deep: str = ""   # how the deeper window layers are split, in words

    @property
    def time(self) -> float:
        return self.prediction.step_time

    @property
    def memory(self) -> float:
        return self.prediction.memory["total"]

    @property
    def complexity(self) -> tuple[int, ...]:
        g = self.spec.grid
        return (g.pipe, g.stage_size, len(self.spec.layers), int(self.spec.pipeline.recompute))

    def describe(self) -> str:
        g, p = self.spec.grid, self.spec.pipeline
        parts = [f"data {g.data}"]
        if g.pipe > 1:
            parts.append(f"pipe {g.pipe} ({p.schedule}, M={p.microbatches})")
        elif p.microbatches > 1:
            parts.append(f"M={p.microbatches} ({p.schedule})")
        if g.stage_size > 1:
            parts.append("spatial " + "x".join(map(str, g.spatial)) + (f", {self.deep}" if self.deep else ""))
        if p.recompute:
            parts.append("recompute")
        return ", ".join(parts)


@dataclass
class Advice:
    """The ranked candidates that fit, the fastest ones that do not, and the chosen one."""

    workload: pm.Workload
    machine: pm.Machine
    world: int
    memory_limit: float
    fits: list[Candidate]
    too_big: list[Candidate]
    evaluated: int
    invalid: int
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.fits[0]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _splits(size: int, cube: bool) -> Iterator[Split]:
    """Every (sd, sh, sw) with product ``size``; for a cube only sd >= sh >= sw."""
    for sd in _divisors(size):
        for sh in _divisors(size // sd):
            sw = size // (sd * sh)
            if cube and not sd >= sh >= sw:
                continue
            yield (sd, sh, sw)


def _halve(split: Split) -> Split:
    i = max(range(3), key=lambda k: split[k])
    out = list(split)
    out[i] //= 2
    return out[0], out[1], out[2]


def _microbatches(per_replica: int, pipe: int) -> list[int]:
    """Powers of two dividing the replica batch: 1-8 without a pipeline (accumulation saves memory),
    from ``pipe`` to ``8 pipe`` with one (fewer micro-batches than stages only idles them)."""
    lo, hi = (1, 8) if pipe == 1 else (pipe, 8 * pipe)
    hi = min(hi, per_replica)
    vals = [m for m in (2 ** k for k in range(12)) if lo <= m <= hi and per_replica % m == 0]
    return vals or [per_replica]


def _deep_options(workload: pm.Workload, split: Split) -> list[tuple[str, dict[str, dict]]]:
    """Rules for a second split of the deeper window layers: from each pooling layer on, halved or
    replicated (only window layers whose input is still a volume)."""
    if split == (1, 1, 1):
        return [("", {})]
    out: list[tuple[str, dict[str, dict]]] = [("", {})]
    names = [lf.name for lf in workload.layers]
    window = [i for i, lf in enumerate(workload.layers) if lf.window and len(workload.shapes[i][0]) == 5]
    pools = [i for i in window if workload.layers[i].op == "pool"]
    for cut in pools[:-1] if len(pools) > 1 else []:
        deep = [names[i] for i in window if i > cut]
        if not deep:
            continue
        options = {_halve(split): "x".join(map(str, _halve(split))), (1, 1, 1): "replicated"}
        for target, word in options.items():
            if target == split or (target == (1, 1, 1) and word != "replicated"):
                continue
            value = "replicate" if target == (1, 1, 1) else list(target)
            out.append((f"{word} from layer {deep[0]}", {n: {"spatial": value} for n in deep}))
    return out


def _candidate_specs(workload: pm.Workload, world: int, recompute: str, max_pipe: int
                     ) -> Iterator[tuple[ParallelSpec, str]]:
    batch = workload.batch
    cube = len(set(workload.input_shape[2:])) == 1
    n_layers = len(workload.layers)
    for d in _divisors(world):
        if batch % d:
            continue
        per = batch // d
        for p in _divisors(world // d):
            if p > max_pipe or p > n_layers or (p > 1 and per < 2):
                continue
            s = world // (d * p)
            for split in _splits(s, cube):
                for m in _microbatches(per, p):
                    schedule = "1f1b" if (p > 1 or m > 1) else "gpipe"
                    for words, rules in _deep_options(workload, split):
                        spec = ParallelSpec.from_dict({
                            "grid": {"data": d, "pipe": p, "spatial": list(split)},
                            "pipeline": {"schedule": schedule, "microbatches": m,
                                         "recompute": recompute == "on"},
                            "layers": rules})
                        yield spec, words


def advise(model: nn.Module | pm.Workload, input_shape: Sequence[int] | None, world: int, memory_limit: float,
           machine: pm.Machine | str = "h100", *, optimizer_states: int = 1, recompute: str = "auto",
           max_pipe: int = 16) -> Advice:
    """Enumerate layouts of ``model`` on ``world`` ranks, predict each, rank those within the memory.

    Raises :class:`SpecError` naming the smallest memory per rank any layout needs (and the layout)
    when none fits ``memory_limit`` bytes.
    """
    workload = model if isinstance(model, pm.Workload) else pm.Workload(model, input_shape)
    machine = pm.get_machine(machine)
    fits, too_big = [], []
    evaluated = invalid = 0
    for spec, words in _candidate_specs(workload, world, recompute, max_pipe):
        try:
            pred = pm.predict(workload, spec, machine, world, optimizer_states=optimizer_states)
        except (SpecError, ValueError):
            invalid += 1
            continue
        evaluated += 1
        if pred.memory["total"] > memory_limit and recompute == "auto":  # recomputation saves memory
            spec = dataclasses.replace(spec, pipeline=dataclasses.replace(spec.pipeline, recompute=True))
            evaluated += 1
            slow = pm.predict(workload, spec, machine, world, optimizer_states=optimizer_states)
            if slow.memory["total"] <= memory_limit:
                fits.append(Candidate(slow.spec, slow, words))
        cand = Candidate(pred.spec, pred, words)
        (fits if cand.memory <= memory_limit else too_big).append(cand)
    key = lambda c: (round(c.time, 9), c.complexity, c.memory)  # noqa: E731
    fits.sort(key=key)
    too_big.sort(key=key)
    advice = Advice(workload, machine, world, memory_limit, fits, too_big, evaluated, invalid)
    if not fits:
        if not too_big:
            raise SpecError(f"no layout of {world} ranks can run input {list(workload.input_shape)}: every "
                            f"candidate was invalid (the batch {workload.batch} and the volume must split "
                            f"over the ranks); try another world size or batch")
        small = min(too_big, key=lambda c: c.memory)
        raise SpecError(
            f"no layout of {world} ranks fits {_gib(memory_limit)} per rank: the smallest need is "
            f"{_gib(small.memory)} per rank ({small.describe()}: "
            + ", ".join(f"{k} {_gib(v)}" for k, v in small.prediction.memory.items() if k != "total" and v)
            + f"). What would fit: --device-memory {math.ceil(small.memory / 2**30 * 10) / 10}GiB or more"
            + _more_ranks_hint(workload, world, memory_limit, machine, optimizer_states, recompute, max_pipe)
            + f", or a smaller global batch than {workload.batch}")
    return advice


def _more_ranks_hint(workload: pm.Workload, world: int, limit: float, machine: pm.Machine,
                     optimizer_states: int, recompute: str, max_pipe: int) -> str:
    """``, or N ranks`` when doubling the world (up to 16x) gives a layout within ``limit``."""
    for factor in (2, 4, 8, 16):
        w = world * factor
        for spec, _ in _candidate_specs(workload, w, recompute, max_pipe):
            if spec.grid.data > 1:
                continue  # more data replicas do not shrink a rank's share
            try:
                pred = pm.predict(workload, spec, machine, w, optimizer_states=optimizer_states)
            except (SpecError, ValueError):
                continue
            if pred.memory["total"] <= limit:
                return f", or {w} ranks (e.g. {Candidate(pred.spec, pred).describe()})"
    return ""


def _why(c: Candidate, best: Candidate) -> str:
    """The categories in which ``c`` loses most time against ``best``."""
    if c is best:
        return "chosen"
    diffs = {k: c.prediction.breakdown.get(k, 0.0) - best.prediction.breakdown.get(k, 0.0)
             for k in best.prediction.breakdown}
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])
    dt = c.time - best.time
    if dt <= 1e-9 * max(best.time, 1e-12):
        return "as fast; more complex (more stages/shards/rules) or more memory"
    parts = [f"+{1e3 * v:.2f} ms {_CATEGORY_WHY[k]}" for k, v in worst[:2] if v > 0.05 * dt]
    if c.prediction.bubble > 0 and any(k == "pipeline" for k, v in worst[:2] if v > 0.05 * dt):
        parts[-1] += f" (bubble {c.prediction.bubble:.0%})"
    return "; ".join(parts) or f"+{1e3 * dt:.2f} ms"


def format_advice(advice: Advice, top: int = 5) -> str:
    w = advice.workload
    best = advice.best
    lines = [
        f"model: {len(w.layers)} layers, {w.params:,} parameters, input {'x'.join(map(str, w.input_shape))} "
        f"(global batch {w.batch}), {w.total_flops / w.batch / 1e9:.1f} GFLOP per sample per step",
        f"machine: {advice.machine.name} ({advice.machine.description}); {advice.world} ranks, "
        f"{_gib(advice.memory_limit)} per rank",
        f"evaluated {advice.evaluated} layouts ({advice.invalid} invalid for this shape), "
        f"{len(advice.fits)} fit in memory",
        "",
        f"{'#':>2}  {'layout':<58} {'step ms':>9} {'samples/s':>10} {'mem/rank':>10}  why not chosen",
    ]
    for i, c in enumerate(advice.fits[:top]):
        lines.append(f"{i + 1:>2}  {c.describe():<58} {1e3 * c.time:>9.2f} "
                     f"{c.prediction.samples_per_s:>10.1f} {_gib(c.memory):>10}  {_why(c, best)}")
    faster = [c for c in advice.too_big if c.time < best.time][:3]
    if faster:
        lines.append("")
        lines.append("faster layouts that do not fit:")
        for c in faster:
            lines.append(f"    {c.describe():<58} {1e3 * c.time:>9.2f} {c.prediction.samples_per_s:>10.1f} "
                         f"{_gib(c.memory):>10}  needs {_gib(c.memory)} > {_gib(advice.memory_limit)}")
    bd = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in best.prediction.breakdown.items() if v > 0)
    lines += ["", f"chosen: {best.describe()}", f"  predicted {1e3 * best.time:.2f} ms/step ({bd} ms), "
              f"{best.prediction.flops_per_s / 1e12:.2f} TFLOP/s in total, "
              f"bubble {best.prediction.bubble:.0%}",
              "  memory per rank: " + ", ".join(f"{k} {_gib(v)}" for k, v in best.prediction.memory.items()
                                                if k != "total") + f" = {_gib(best.memory)}"]
    return "\n".join(lines)


def spec_yaml(advice: Advice) -> str:
    """The chosen spec as YAML with the prediction in a comment header."""
    best = advice.best
    head = (f"# written by python -m hybridpar.advisor for {advice.world} ranks on {advice.machine.name}: "
            f"predicted {1e3 * best.time:.2f} ms/step, {_gib(best.memory)} per rank\n")
    return head + best.spec.to_yaml()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridpar.advisor", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="MODULE:FACTORY (dotted module or .py path)")
    ap.add_argument("--input-shape", required=True, type=parse_shape, help="global input N,C,D,H,W")
    ap.add_argument("--world-size", required=True, type=int)
    ap.add_argument("--device-memory", required=True, type=parse_bytes, help="per rank, e.g. 80GB or 16GiB")
    ap.add_argument("--machine", default="h100",
                    help=f"preset ({', '.join(pm.PRESETS)}), 'local' (this host's calibration) or a .json")
    ap.add_argument("--optimizer", choices=("sgd", "momentum", "adam"), default="momentum",
                    help="optimizer state per parameter: sgd 0, momentum 1, adam 2")
    ap.add_argument("--recompute", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--max-pipe", type=int, default=16)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the chosen spec here (default: print it)")
    args = ap.parse_args(argv)
    try:
        machine = pm.get_machine(args.machine)
        model = load_model(args.model)
        advice = advise(model, args.input_shape, args.world_size, args.device_memory, machine,
                        optimizer_states={"sgd": 0, "momentum": 1, "adam": 2}[args.optimizer],
                        recompute=args.recompute, max_pipe=args.max_pipe)
    except (SpecError, ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_advice(advice, args.top))
    text = spec_yaml(advice)
    if args.out is not None:
        args.out.write_text(text)
        print(f"\nwrote {args.out}")
    else:
        print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
