"""What a sweep runs: one :class:`Config` per (sweep, world size, layout), and the time categories every
rank's step breakdown is reported in.

Why apart from the jobs: the parent plans and skips configurations, the ranks run them and the
analysis reads them back (``--reanalyse`` rebuilds them from a stored run's flags), so the mapping from
flags to configurations must be one function.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

CATEGORIES = ("compute", "halo", "pipeline", "grad_reduce", "data_wait", "other")
FAMILIES = ("data", "spatial", "pipe", "hybrid")


@dataclass
class Config:
    sweep: str           # strong | weak
    family: str          # single | data | spatial | pipe | hybrid
    label: str           # d2.p1.s2x1x1
    world: int
    spec: dict[str, Any]
    input_shape: tuple[int, ...]
    model: str

    @property
    def key(self) -> str:
        return f"{self.sweep}/{self.world}/{self.label}"


def _split3(n: int) -> tuple[int, int, int]:
    """A balanced 3D split of n ranks (powers of two): 2 -> 2x1x1, 4 -> 2x2x1, 8 -> 2x2x2."""
    s = [1, 1, 1]
    i = 0
    while n > 1:
        if n % 2:
            s[i % 3] *= n
            break
        s[i % 3] *= 2
        n //= 2
        i += 1
    return tuple(s)  # type: ignore[return-value]


def layouts(world: int, families: list[str]) -> list[tuple[str, int, int, tuple[int, int, int]]]:
    """(family, data, pipe, spatial) of each layout of ``world`` ranks."""
    if world == 1:
        return [("single", 1, 1, (1, 1, 1))]
    out = []
    for fam in families:
        if fam == "data":
            out.append(("data", world, 1, (1, 1, 1)))
        elif fam == "spatial":
            out.append(("spatial", 1, 1, _split3(world)))
        elif fam == "pipe":
            out.append(("pipe", 1, world, (1, 1, 1)))
        elif fam == "hybrid":
            if world == 4:
                out += [("hybrid", 2, 1, (2, 1, 1)), ("hybrid", 2, 2, (1, 1, 1))]
            elif world >= 8:
                out += [("hybrid", 2, 2, _split3(world // 4)), ("hybrid", world // 4, 1, _split3(4))]
        else:
            raise ValueError(f"unknown layout family {fam!r}; use {', '.join(FAMILIES)}")
    return out


def make_configs(args: argparse.Namespace) -> list[Config]:
    out = []
    s = args.size
    for sweep in (["strong", "weak"] if args.sweep == "both" else [args.sweep]):
        for world in args.ranks:
            for fam, d, p, sp in layouts(world, args.layouts):
                if sweep == "strong":
                    batch, shape3 = args.batch, (s, s, s)
                else:  # the per-rank problem stays fixed
                    batch = args.weak_batch * d * p
                    shape3 = tuple(s * k for k in sp)
                per_replica = batch // d
                m = 1
                if p > 1:  # micro-batches: up to 2 per stage, dividing the replica batch
                    m = max(k for k in range(1, min(per_replica, 2 * p) + 1) if per_replica % k == 0)
                spec = {"grid": {"data": d, "pipe": p, "spatial": list(sp)},
                        "pipeline": {"schedule": "gpipe", "microbatches": m}}
                label = f"d{d}.p{p}.s{'x'.join(map(str, sp))}" + (f".m{m}" if p > 1 else "")
                out.append(Config(sweep, fam, label, world, spec, (batch, 4, *shape3), args.model))
    return out


def parallel_spec(cfg: Config):
    """The configuration's :class:`hybridpar.planner.ParallelSpec` (what the model plans and predicts)."""
    from hybridpar.planner import ParallelSpec  # noqa: PLC0415

    return ParallelSpec.from_dict(cfg.spec)
