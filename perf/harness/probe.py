"""The machine's state, probed: the reference step of a small problem stored with the calibration, and the
probe run right before every configuration (drift, contention, the link).

Why: on a shared host the machine a configuration runs on is not the one that was calibrated; the
prediction for each configuration takes the state measured just before it (``--state``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from hybridpar import perfmodel as pm
from perf import common
from perf.harness.configs import Config
from perf.harness.models import build_model


def state_probe(rank: int, world: int, probe: tuple, window: float = 0.5) -> dict[str, Any]:
    """The machine's state right before a configuration, from ranks 0 and 1 (the others sleep, and a
    sleeping rank costs nothing): the plain model's training step on the per-rank problem on rank 0
    alone (``alone_s``: the host's speed now, against the calibration's, is the drift), its slowdown
    when two ranks run it at once (contention), and the cost of a halo-like exchange right after
    computing (the link the model uses). A world of one measures the first only."""
    import torch.distributed as dist  # noqa: PLC0415

    name, shape = probe
    model = build_model(name, shape)
    x = torch.randn(shape)

    def both() -> None:  # a whole training step's memory traffic, not one kernel's
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()

    if world == 1:
        both()
        return {"alone_s": statistics.median(pm.time_loop(both, window) for _ in range(2)),
                "contention": None, "contention_samples": [], "exchange": None}
    pair = _pair_group()
    ratios, alones = [], []
    for _ in range(2):
        alone = pm.time_loop(both, window) if rank == 0 else time.sleep(window + 0.3)
        dist.barrier()
        together = pm.time_loop(both, window) if rank <= 1 else time.sleep(window + 0.3)
        dist.barrier()
        if rank == 0:
            ratios.append(together / alone)
            alones.append(alone)
    exchange = pm.exchange_after_compute(1 - rank, repeats=16, group=pair) if rank <= 1 else None
    everyone = [None] * world
    dist.all_gather_object(everyone, (exchange, ratios, alones))
    (ex0, ratios, alones), (ex1, _, _) = everyone[0], everyone[1]
    mean = [(n, (a + b) / 2) for (n, a), (_, b) in zip(ex0, ex1)]
    dist.barrier()
    return {"alone_s": statistics.median(alones), "contention": statistics.median(ratios),
            "contention_samples": ratios, "exchange": mean}


_PAIR: list = []


def _pair_group():
    """Ranks 0 and 1 (created once per process: every rank must take part in creating it)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not _PAIR:
        _PAIR.append(dist.new_group([0, 1]))
    return _PAIR[0]


def reference_job(rank: int, world: int, probe: tuple, window: float) -> float:
    """The probe problem's step on one rank: the reference its later timings are compared with (timed
    over twice a state probe's window: every later drift is a ratio against it)."""
    return state_probe(rank, 1, probe, window=2 * window)["alone_s"]


def calibration_reference(path: Path, probe: tuple, window: float) -> float:
    """The probe problem's one-rank step time stored with the calibration (measured now and stored
    when missing, i.e. right after a fresh calibration): what the drift of later runs is against."""
    data = json.loads(path.read_text())
    ref = data.get("probe_reference")
    key = [probe[0], list(probe[1])]
    if ref is None or ref.get("problem") != key:
        alone = common.launch(reference_job, 1, probe, window)
        ref = {"problem": key, "alone_s": alone, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
               "load": common.loadavg()}
        data["probe_reference"] = ref
        path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"reference: the probe problem {key} takes {1e3 * ref['alone_s']:.1f} ms a step on one rank",
          flush=True)
    return ref["alone_s"]


def probe_problem(cfgs: list[Config]) -> tuple[str, tuple[int, ...]]:
    """What the state probe runs: the smallest one-rank problem of the sweep (the weak per-rank one)."""
    ones = [c for c in cfgs if c.world == 1] or cfgs
    small = min(ones, key=lambda c: c.input_shape[0] * c.input_shape[2] * c.input_shape[3] * c.input_shape[4])
    return small.model, small.input_shape
