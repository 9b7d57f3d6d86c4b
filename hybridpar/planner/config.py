"""The parallelism spec as typed, frozen dataclasses, checked when they are built.

Why: a layout mistake found after N processes have started costs a queue wait and a hang; found
here it costs a line of text. Every dataclass validates itself in ``__post_init__``, so a spec that
exists is well formed however it was made (YAML, ``from_dict`` or the constructors), and each
message names the key, the value and what would fit. Checks that need the model or the world size
live in :mod:`hybridpar.planner.plan` and :meth:`ParallelSpec.resolve_grid`.

Vocabulary (as in :mod:`hybridpar.grid`): an *axis* is a process-grid axis (data, pipe, d, h, w);
a *dim* is a tensor dimension.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from hybridpar.axes import DATA, PIPE, LeftoverError, fill_leftover
from hybridpar.plain_yaml import YamlProblem, read_plain
from hybridpar.planner.schedule import SCHEDULES
from hybridpar.planner.terms import SpecError, Split, check_keys, did_you_mean

REPLICATE = "replicate"

_SPEC_KEYS = ("grid", "pipeline", "layers", "timeout_s", "strict")
_GRID_KEYS = ("data", "pipe", "spatial")
_PIPELINE_KEYS = ("schedule", "microbatches", "stages", "recompute", "micro_batch_stats")
_RULE_KEYS = ("spatial",)


def _mapping(where: str, value: Any) -> Mapping[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError(f"{where}: expected a mapping of keys to values, got {value!r}")
    return value


def _int(where: str, value: Any, minimum: int, minus_one: bool = False) -> int:
    """An int >= ``minimum`` (or -1 where the ranks left over are allowed); bools are not ints here."""
    if isinstance(value, bool) or not isinstance(value, int) or (
            value < minimum and not (minus_one and value == -1)):
        also = " or -1 (the ranks left over)" if minus_one else ""
        raise SpecError(f"{where}: expected an integer >= {minimum}{also}, got {value!r}")
    return value


def _split(where: str, value: Any, minus_one: bool = False, replicate: bool = False) -> Split | str:
    """Three sizes (d, h, w), or 'replicate' where allowed."""
    if replicate and value == REPLICATE:
        return REPLICATE
    what = "3 positive integers [d, h, w]" + (" with at most one -1" if minus_one else "")
    what += " or 'replicate'" if replicate else ""
    if isinstance(value, str) or not isinstance(value, Sequence) or len(value) != 3:
        raise SpecError(f"{where}: expected {what}, got {value!r}")
    try:
        return tuple(_int(where, v, 1, minus_one) for v in value)  # type: ignore[return-value]
    except SpecError:
        raise SpecError(f"{where}: expected {what}, got {list(value)!r}") from None


@dataclass(frozen=True)
class GridSpec:
    """data × pipe × spatial (d, h, w) ranks; one size may be -1, the ranks left over."""

    data: int = 1
    pipe: int = 1
    spatial: Split = (1, 1, 1)

    def __post_init__(self) -> None:
        _int("grid.data", self.data, 1, minus_one=True)
        _int("grid.pipe", self.pipe, 1, minus_one=True)
        object.__setattr__(self, "spatial", _split("grid.spatial", self.spatial, minus_one=True))
        if self.sizes.count(-1) > 1:
            raise SpecError(f"grid: at most one size may be -1 (the ranks left over), got "
                            f"{self.arithmetic}; fix all but one")

    @property
    def sizes(self) -> tuple[int, ...]:
        """(data, pipe, d, h, w)."""
        return (self.data, self.pipe, *self.spatial)

    @property
    def is_resolved(self) -> bool:
        """True when no size is -1."""
        return -1 not in self.sizes

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage of one replica: the product of the spatial split."""
        return math.prod(self.spatial)

    @property
    def arithmetic(self) -> str:
        """``data(2) * pipe(2) * spatial(2*1*1)``: the form every grid message prints."""
        d, h, w = self.spatial
        return f"data({self.data}) * pipe({self.pipe}) * spatial({d}*{h}*{w})"

    def resolve(self, world_size: int) -> GridSpec:
        """This grid on ``world_size`` ranks: the -1 filled, the product checked."""
        world = _int("world size", world_size, 1)
        sizes = list(self.sizes)
        if -1 in sizes:
            try:
                data, pipe, *spatial = fill_leftover(sizes, world)
            except LeftoverError as err:
                known = err.known
                raise SpecError(
                    f"grid: {self.arithmetic}: the fixed sizes multiply to {known}, which does not "
                    f"divide world size {world}; launch a multiple of {known} ranks, or make the fixed "
                    f"sizes multiply to a divisor of {world}") from None
            return GridSpec(data, pipe, tuple(spatial))  # type: ignore[arg-type]
        total = math.prod(sizes)
        if total != world:
            fits = []
            for i, axis in enumerate((DATA, PIPE)):
                rest = total // sizes[i]
                if world % rest == 0:
                    fits.append(f"{axis}: {world // rest}")
            rest = total // self.stage_size
            if world % rest == 0:
                fits.append(f"spatial: [{world // rest}, 1, 1]")
            fit = f"; grids that fit {world} ranks: {' or '.join(fits)}" if fits else ""
            raise SpecError(
                f"grid: {self.arithmetic} = {total} != world size {world}; launch {total} ranks, or "
                f"put -1 in one place to take the ranks left over{fit}")
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"data": self.data, "pipe": self.pipe, "spatial": list(self.spatial)}


@dataclass(frozen=True)
class PipelineSpec:
    """How each replica's batch flows through the stages.

    ``stages`` is ``'auto'`` (balance by per-rank forward FLOPs) or the names of the layers where
    each stage starts, the first included, one per pipeline stage.
    """

    schedule: str = "gpipe"
    microbatches: int = 1
    stages: str | tuple[str, ...] = "auto"
    recompute: bool = False
    micro_batch_stats: bool = False  # BatchNorm may train on each micro-batch's statistics (GPipe's)

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            hint = did_you_mean(self.schedule, SCHEDULES)
            raise SpecError(f"pipeline.schedule: {self.schedule!r} is not a known schedule{hint}; "
                            f"use one of {', '.join(SCHEDULES)}")
        _int("pipeline.microbatches", self.microbatches, 1)
        if not isinstance(self.recompute, bool):
            raise SpecError(f"pipeline.recompute: expected true or false, got {self.recompute!r}")
        if not isinstance(self.micro_batch_stats, bool):
            raise SpecError(f"pipeline.micro_batch_stats: expected true or false, got "
                            f"{self.micro_batch_stats!r}")
        stages = self.stages
        if stages != "auto":
            if isinstance(stages, str) or not isinstance(stages, Sequence) or not stages or not all(
                    isinstance(s, str) and s for s in stages):
                raise SpecError(f"pipeline.stages: expected 'auto' or a list of layer names where each "
                                f"stage starts (first stage included), got {stages!r}")
            dup = sorted({s for s in stages if list(stages).count(s) > 1})
            if dup:
                raise SpecError(f"pipeline.stages: {', '.join(dup)} given more than once; "
                                f"each stage starts at a different layer")
            object.__setattr__(self, "stages", tuple(stages))

    def to_dict(self) -> dict[str, Any]:
        stages = self.stages if self.stages == "auto" else list(self.stages)
        out = {"schedule": self.schedule, "microbatches": self.microbatches, "stages": stages,
               "recompute": self.recompute}
        return {**out, "micro_batch_stats": True} if self.micro_batch_stats else out


@dataclass(frozen=True)
class LayerRule:
    """A per-layer override: leaves whose module name matches ``pattern`` (fnmatch) get ``spatial``."""

    pattern: str
    spatial: Split | str

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern:
            raise SpecError(f"layers: a pattern must be a non-empty module-name glob, got {self.pattern!r}")
        where = f"layers[{self.pattern!r}].spatial"
        object.__setattr__(self, "spatial", _split(where, self.spatial, replicate=True))

    @property
    def split(self) -> Split:
        """The split this rule asks for; 'replicate' is (1, 1, 1)."""
        return (1, 1, 1) if self.spatial == REPLICATE else self.spatial  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        return {"spatial": self.spatial if self.spatial == REPLICATE else list(self.spatial)}


@dataclass(frozen=True)
class ParallelSpec:
    """The whole spec: the grid, the pipeline, and per-layer rules (which applies: :mod:`hybridpar.globs`)."""

    grid: GridSpec = field(default_factory=GridSpec)
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    layers: tuple[LayerRule, ...] = ()
    timeout_s: float | None = None
    """How long a rank waits for a peer in any collective before the job ends naming the ranks that
    stopped answering (``hybridpar.init_distributed(timeout_s=...)``); None: its default."""
    strict: bool = False
    """Refuse a layer too small to split (a shard thinner than its halo, an extent smaller than the
    split) instead of replicating it and the layers after it until the volume is large again."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(self.layers))
        if not isinstance(self.strict, bool):
            raise SpecError(f"strict: expected true or false, got {self.strict!r} (true refuses a layer too "
                            f"small to split instead of replicating it)")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, int | float) or not t > 0):
            raise SpecError(f"timeout_s: {t!r} is not a positive number of seconds (how long a rank waits "
                            f"for a peer before the job ends)")
        stages, pipe = self.pipeline.stages, self.grid.pipe
        if stages != "auto" and pipe != -1 and len(stages) != pipe:
            raise SpecError(
                f"pipeline.stages: {len(stages)} stage start(s) given ({', '.join(stages)}) but "
                f"grid.pipe is {pipe}; list exactly {pipe} layer names (the first layer included), "
                f"or use stages: auto")
        if -1 not in self.grid.spatial:
            for rule in self.layers:
                n = math.prod(rule.split)
                if self.grid.stage_size % n:
                    raise SpecError(
                        f"layers[{rule.pattern!r}].spatial: a split {rule.spatial} uses {n} ranks, which "
                        f"does not divide the {self.grid.stage_size} ranks of a stage (grid.spatial "
                        f"{list(self.grid.spatial)}); use a split whose product divides "
                        f"{self.grid.stage_size}")

    # ------------------------------------------------------------------ from and to plain data
    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ParallelSpec:
        """Build from plain data (as YAML gives it); missing sections take their defaults."""
        d = _mapping("spec", d)
        check_keys("spec", d, _SPEC_KEYS)
        grid = _mapping("grid", d.get("grid"))
        check_keys("grid", grid, _GRID_KEYS)
        pipeline = _mapping("pipeline", d.get("pipeline"))
        check_keys("pipeline", pipeline, _PIPELINE_KEYS)
        rules = []
        for pattern, body in _mapping("layers", d.get("layers")).items():
            pattern = str(pattern) if isinstance(pattern, int) and not isinstance(pattern, bool) else pattern
            where = f"layers[{pattern!r}]"
            body = _mapping(where, body)
            check_keys(where, body, _RULE_KEYS)
            if "spatial" not in body:
                raise SpecError(f"{where}: missing key 'spatial'; give spatial: [d, h, w] or "
                                f"spatial: replicate")
            rules.append(LayerRule(pattern, body["spatial"]))
        return cls(GridSpec(**grid), PipelineSpec(**pipeline), tuple(rules), d.get("timeout_s"),
                   d.get("strict", False))

    @classmethod
    def from_yaml(cls, text: str, source: str = "<string>") -> ParallelSpec:
        """Parse YAML text; errors are prefixed with ``source``."""
        try:
            data = read_plain(text)
        except YamlProblem as err:
            raise SpecError(f"{source}: {err}") from None
        try:
            return cls.from_dict(data)
        except SpecError as err:
            raise SpecError(f"{source}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data that ``from_dict`` turns back into an equal spec."""
        out = {"grid": self.grid.to_dict(), "pipeline": self.pipeline.to_dict(),
               "layers": {r.pattern: r.to_dict() for r in self.layers}}
        if self.timeout_s is not None:
            out["timeout_s"] = self.timeout_s
        return {**out, "strict": True} if self.strict else out

    def to_yaml(self) -> str:
        """YAML that ``load_spec`` / ``from_yaml`` turns back into an equal spec."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None)

    # ------------------------------------------------------------------ checks needing more
    def resolve_grid(self, world_size: int) -> ParallelSpec:
        """This spec on ``world_size`` ranks: -1 filled, product == world size, rules re-checked."""
        return replace(self, grid=self.grid.resolve(world_size))

    def plan(self, model: Any, input_shape: Sequence[int], world_size: int | None = None) -> list[Any]:
        """Per-layer plan records (:class:`hybridpar.planner.records.LayerPlan`) in forward order, after every
        check that needs the model, the global input shape and the world size."""
        from hybridpar.planner.plan import build_plan  # noqa: PLC0415 (plan imports torch; config must not)

        return build_plan(self, model, input_shape, world_size)


def load_spec(path: str | Path) -> ParallelSpec:
    """Read a YAML spec file; errors name the file."""
    path = Path(path)
    return ParallelSpec.from_yaml(path.read_text(), source=str(path))
