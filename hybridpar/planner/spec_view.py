"""What the planner reads of a spec: the few fields of :mod:`.config`'s dataclasses it uses, as protocols
those dataclasses satisfy.

Why not the dataclasses themselves: ``ParallelSpec.plan`` runs the planner, so a planner that named
the spec's module would make the two modules import each other. The planner depends on these fields
instead, and the spec on the planner.
"""

from __future__ import annotations

from typing import Protocol

from hybridpar.planner.terms import Split


class GridView(Protocol):
    """A process grid (:class:`~hybridpar.planner.config.GridSpec`)."""

    @property
    def data(self) -> int: ...

    @property
    def pipe(self) -> int: ...

    @property
    def spatial(self) -> Split: ...

    @property
    def is_resolved(self) -> bool: ...

    @property
    def arithmetic(self) -> str: ...


class PipelineView(Protocol):
    """How a batch flows through the stages (:class:`~hybridpar.planner.config.PipelineSpec`)."""

    @property
    def microbatches(self) -> int: ...

    @property
    def stages(self) -> str | tuple[str, ...]: ...

    @property
    def micro_batch_stats(self) -> bool: ...


class RuleView(Protocol):
    """A per-layer rule (:class:`~hybridpar.planner.config.LayerRule`)."""

    @property
    def pattern(self) -> str: ...

    @property
    def split(self) -> Split: ...


class SpecView(Protocol):
    """A whole spec (:class:`~hybridpar.planner.config.ParallelSpec`)."""

    @property
    def grid(self) -> GridView: ...

    @property
    def pipeline(self) -> PipelineView: ...

    @property
    def layers(self) -> tuple[RuleView, ...]: ...

    @property
    def strict(self) -> bool: ...

    def resolve_grid(self, world_size: int) -> SpecView: ...
