"""Who writes which file, and who keeps which partner copy: pure geometry, no communication.

Why: every rank must agree, without talking, on which files a version has, who writes them and where the
L2 copies go; and the answers must be testable without spawning a process. In hybridpar the weights and
optimizer state are replicated over the spatial group and over data replicas, and only pipeline stages
hold different layers, so a version holds:

* ``stage-PPP.bin``: the *replicated* entries (model, optimizer) of pipeline stage P, written once, by
  the stage rank with data index 0 and spatial index 0;
* ``rank-RRRRR.bin``: the *per-rank* entries of rank R (its RNG states), written by every rank;
* ``global.bin``: the entries that are the same on every rank (step, loader position), written by rank 0.

L2 (VeloC's partner copy): each file also lives on a rank of *another node*. A stage writer's partner
is, when there is one, a rank of the same stage on another node: it holds the same weights in memory,
so it writes its own copy of the stage file and nothing crosses the network ("a replica is already a
copy"). Other files, and stage files with no replica off-node, are sent to the partner, which is the
rank with the same local index on the next node.
"""

from __future__ import annotations

from dataclasses import dataclass

GLOBAL = "global"
STAGE = "stage"
RANK = "rank"


@dataclass(frozen=True)
class FileRole:
    """One file of a version: its name, kind, the stage it belongs to (stage files) and its writer."""

    name: str
    kind: str
    stage: int | None
    writer: int


@dataclass(frozen=True)
class Copy:
    """An L2 copy of ``file`` held by ``holder``; ``self_made``: the holder writes it from its own memory."""

    file: FileRole
    holder: int
    self_made: bool


def stage_file(stage: int) -> str:
    return f"stage-{stage:03d}.bin"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.bin"


GLOBAL_FILE = "global.bin"


@dataclass(frozen=True)
class Placement:
    """The ranks of a job seen as (pipeline stage, node) pairs, and the stage writers.

    ``stage_of[r]`` is rank r's pipeline stage, ``node_of[r]`` its node, ``writers[p]`` the rank that
    writes stage p's replicated entries.
    """

    stage_of: tuple[int, ...]
    node_of: tuple[int, ...]
    writers: tuple[int, ...]

    @classmethod
    def from_grid(cls, grid, node_of: tuple[int, ...]) -> Placement:
        """From a :class:`hybridpar.ProcessGrid` (or None: every rank a data-parallel replica)."""
        world = len(node_of)
        if grid is None:
            return cls((0,) * world, node_of, (0,))
        if grid.world_size != world:
            raise ValueError(f"Placement: grid has {grid.world_size} ranks, node map {world}")
        stage_of = tuple((r // grid.stage_size) % grid.pipe for r in range(world))
        writers = tuple(grid.global_rank(0, p, 0) for p in range(grid.pipe))
        return cls(stage_of, node_of, writers)

    @property
    def world(self) -> int:
        return len(self.stage_of)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    def writes(self, rank: int) -> list[FileRole]:
        """The files ``rank`` writes at L1 (and flushes to L3)."""
        out = [FileRole(GLOBAL_FILE, GLOBAL, None, 0)] if rank == 0 else []
        out += [FileRole(stage_file(p), STAGE, p, rank) for p, w in enumerate(self.writers) if w == rank]
        out.append(FileRole(rank_file(rank), RANK, None, rank))
        return out

    def files(self) -> list[FileRole]:
        """Every file of a version."""
        return [f for r in range(self.world) for f in self.writes(r)]

    def _next_node_peer(self, rank: int) -> int | None:
        nodes = sorted(set(self.node_of))
        if len(nodes) < 2:
            return None
        mine = nodes.index(self.node_of[rank])
        local = [r for r in range(self.world) if self.node_of[r] == self.node_of[rank]].index(rank)
        other = [r for r in range(self.world) if self.node_of[r] == nodes[(mine + 1) % len(nodes)]]
        return other[local % len(other)]

    def copies(self) -> list[Copy]:
        """Every L2 copy (empty on a single node: a partner on the same node protects nothing)."""
        out = []
        for f in self.files():
            holder = self._next_node_peer(f.writer)
            if holder is None:
                return []
            self_made = False
            if f.kind == STAGE:
                order = [(f.writer + i) % self.world for i in range(1, self.world)]
                replica = [r for r in order if self.stage_of[r] == f.stage
                           and self.node_of[r] != self.node_of[f.writer]]
                if replica:
                    holder, self_made = replica[0], True
            out.append(Copy(f, holder, self_made))
        return out

    def snapshots_replicated(self, rank: int) -> bool:
        """Whether ``rank`` must copy out its stage's replicated entries: as writer or self-made partner."""
        return rank in self.writers or any(c.self_made and c.holder == rank for c in self.copies())
