"""Seconds per synthetic universe (default 128³ × 4 redshifts), stage by stage, and with the HDF5 write.

Why: ``make demo`` and any synthetic training set are bounded by the generator, so its cost per
universe is what sizes them (a real-size 512³ universe costs about 64× a 128³ one: the FFTs are
N³ log N, the particle binning N³). One process, one thread: ``--workers K`` scales it by K processes.

    python -m perf generator [--size 128] [--repeats 5]

Prints a table and writes ``perf/results/generator.json`` (machine, versions, config, medians).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from cosmoflow.generate import write_universe
from cosmoflow.universe import (
    REDSHIFTS,
    Cosmology,
    box_size,
    draw_unit_params,
    growth_factor,
    linear_field_k,
    ngp_counts,
    zeldovich_displacement,
)
from perf import common


def _time_stages(size: int, seed: int) -> dict[str, float]:
    """Wall time of each generator stage for one universe (the same work ``make_universe`` does)."""
    t = [time.perf_counter()]
    cosmo = Cosmology.from_unit(draw_unit_params((seed, 0)))
    box = box_size(size, cosmo.h0)
    delta_k = linear_field_k(size, cosmo, (seed, 0), smoothing=2.0)
    t.append(time.perf_counter())
    psi = zeldovich_displacement(delta_k, size, box)
    t.append(time.perf_counter())
    for d in np.atleast_1d(growth_factor(np.asarray(REDSHIFTS), cosmo.omega_m)):
        ngp_counts(psi, float(d), box / size)
    t.append(time.perf_counter())
    return {"linear field": t[1] - t[0], "displacement": t[2] - t[1], "counts (4 z)": t[3] - t[2],
            "total": t[3] - t[0]}


TINY = {"size": 16, "repeats": 1}  # --tiny: seconds


def main(argv: list[str] | None = None) -> int:
    parser = common.parser("generator", __doc__)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = common.parse(parser, argv, TINY)
    torch.set_num_threads(1)

    _time_stages(args.size, seed=999)  # warm-up: imports, FFT plans, page faults
    stages = [_time_stages(args.size, seed) for seed in range(args.repeats)]
    with tempfile.TemporaryDirectory() as tmp:
        written = []
        for seed in range(args.repeats):
            path = Path(tmp) / f"u{seed}.h5"
            t0 = time.perf_counter()
            write_universe(path, args.size, seed, 0)
            written.append(time.perf_counter() - t0)
        with h5py.File(path, "r") as f:
            file_mib = os.path.getsize(path) / 2 ** 20
            shape = f["full"].shape

    medians = {k: statistics.median(s[k] for s in stages) for k in stages[0]}
    medians["generate + write HDF5"] = statistics.median(written)
    print(f"universe {shape} int16, {file_mib:.1f} MiB per file, median of {args.repeats}, 1 process")
    print(f"{'stage':<24} {'seconds':>8}")
    for name, sec in medians.items():
        print(f"{name:<24} {sec:>8.3f}")

    result = {
        "metric": "seconds per universe (median)",
        "seconds_per_universe": medians["total"],
        "seconds_per_universe_with_write": medians["generate + write HDF5"],
        "stages_median_s": medians,
        "runs": {"stages": stages, "generate_and_write_s": written},
        "config": {"size": args.size, "channels": len(REDSHIFTS), "redshifts": list(REDSHIFTS),
                   "repeats": args.repeats, "processes": 1, "smoothing_mpc_h": 2.0, "file_mib": file_mib},
        "libraries": {"numpy": np.__version__, "h5py": h5py.__version__},
        "load_avg_1m_at_end": os.getloadavg()[0],
    }
    common.write_json(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
