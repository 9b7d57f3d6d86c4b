"""The GPU suite: CUDA parity tests, then the accelerator benchmarks, within a time budget; one table and
one JSON.

    PYTHONPATH=. python3 -m perf gpu_check --budget 480 --out "$OUT/gpu"   # the one command on a GPU machine
    make gpu-check                                       # the same, into perf/results/gpu/
    python -m perf gpu_check --dry-run --budget 300      # the plan: sections, estimates, what is skipped
    python -m perf gpu_check --cpu-smoke --out DIR       # the same code on CPU at a tiny size (= --tiny)

Why one script with a budget: a GPU is lent for short sessions (minutes, start-up included), so
everything that needs one runs in one call that must end inside the lease, and leaves its figures
beside the versions they were measured with (GPU, driver, CUDA, torch) in ``OUT/gpu_check.{md,json}``
(``--out``; default a scratch folder, ``perf/results/gpu`` with ``--record``), with the tests' full log
in ``OUT/gpu_check_tests.log``. It installs nothing: a GPU image has its own torch and no package
registry (``nvtx`` is optional in :mod:`hybridpar.profiling.ranges`).

Sections run in order of value, so that a short lease still returns the figures that matter most:

1. ``tests``: every pytest test marked ``cuda`` (layer parity on CUDA in float64 and under bf16
   autocast, channels_last_3d, ranks sharing the GPU through the staged transport, engine layouts
   with a pipeline cut and a spatial split, the sync-free step).
2. ``cosmoflow``: the MLPerf CosmoFlow reference model, 128³ x 4 channels, batch 1, one GPU, fed by
   ``hybridpar.data.VolumeLoader`` from HDF5 (synthetic universes; int16 counts onto the GPU, log1p
   there): training samples/s end to end (data wait included) and of the steps alone, MFU against
   the GPU's dense bf16 peak, the loader's data-wait share, for fp32, bf16, bf16 + channels_last,
   + torch.compile (inductor), + CUDA graphs; beside them plain PyTorch (bf16 + channels_last, input
   already on the GPU), the baseline.
3. ``memory``: LBANN's CosmoFlow variant at 256³, batch 1: peak memory per rank with 1, 2 and 4
   ranks sharing the GPU, split along depth.
4. ``checkpoint``: a >= 2 GiB state on the GPU: how long training stalls for our overlapped
   checkpoint (snapshot to pinned host memory while the next step runs; host buffers reserved before
   the loop, two saves, the worse counted) against ``torch.save`` and
   ``torch.distributed.checkpoint.async_save`` (the time its call blocks).
5. ``unet``: the reconstruction U-Net (:class:`cosmoflow.unet.UNet3d`, the ``reconstruct.yaml``
   configuration) at 128³ x 4, bf16: training step time (forward and backward, slowest rank) and peak
   memory per rank, 1 rank against 2 ranks sharing the GPU.
6. ``scaling`` (only with ``--scaling``: it takes the machine's CPUs for a while): the scaling harness
   (``perf/harness/``) on the host's cores, one rank per core up to 8 ranks, twice.

The budget (``--budget``, seconds from the start) is spent by estimates (:data:`ESTIMATES`): a section
starts only if its set-up and first row fit in the time left, and each later row (a variant, a rank
count) only if its own estimate fits; what does not is skipped with one printed line and its reason
in the JSON. A section that runs past the budget is stopped (the tests' subprocess is killed; the
benchmarks stop at their next step or rank job) and marked ``timed_out``, keeping the rows it measured.
The JSON and the table are rewritten (atomically) after every row and section, so a run killed from
outside still leaves what it measured; its ``sections`` say for each one ``ran``, ``skipped``,
``timed_out``, ``failed`` (with the reason and seconds), ``pending`` (not reached) or ``running`` (the
one it was killed in).

Without CUDA (and without ``--cpu-smoke`` or ``--dry-run``) it says so in one line and exits with
status 2. The exit status is 1 when a section failed, a CUDA test failed or a row has an error;
skipped and timed-out sections leave it 0 (they are the budget's doing, and recorded).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from perf.gpu import ROOT
from perf.gpu.budget import ESTIMATES, GPU, SECTIONS, SMOKE, Run, estimate_s, plan, print_plan, sections_off
from perf.gpu.cuda_tests import run_tests
from perf.gpu.report import environment
from perf.gpu.sections import RUNNERS, run_section

# what tests/test_gpu_check.py reaches through this module, the suite's entry point
__all__ = ["ESTIMATES", "RUNNERS", "SECTIONS", "SMOKE", "Run", "main", "plan", "run_section", "run_tests"]


def _failed(results: dict[str, Any]) -> bool:
    """A failed section, a failed CUDA test or a row with an error (not a skip or a timeout)."""
    rows = [r for key in ("cosmoflow", "memory", "unet") for r in results.get(key, [])]
    tests = results.get("tests", {})
    return bool(any(s["status"] == "failed" for s in results["sections"].values())
                or (not tests.get("timed_out") and tests.get("returncode", 0))
                or any("error" in r for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu-smoke", "--tiny", dest="cpu_smoke", action="store_true",
                    help="the same code on CPU at a tiny size")
    ap.add_argument("--budget", type=float, default=480.0,
                    help="seconds for the whole run; sections and rows that would not fit are skipped")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan and the estimated seconds per section at --budget; run nothing")
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for gpu_check.{json,md} and the tests' log (default: a scratch folder; "
                         "with --record perf/results/gpu)")
    ap.add_argument("--record", action="store_true",
                    help="write into perf/results/gpu (tracked: the figures the READMEs quote)")
    ap.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help=f"run only these sections, comma-separated ({', '.join(SECTIONS)})")
    ap.add_argument("--scaling", action="store_true", help="also run the scaling harness twice on the CPUs")
    args = ap.parse_args(argv)
    if args.out is None:
        from perf.common import SCRATCH  # noqa: PLC0415 (perf.common is imported where used, as in perf.gpu)

        args.out = ROOT / "perf/results/gpu" if args.record else SCRATCH / "gpu"
    mode = "smoke" if args.cpu_smoke else "gpu"
    if args.budget <= 0:
        print(f"gpu_check: --budget must be a positive number of seconds, got {args.budget:g}",
              file=sys.stderr)
        return 2
    try:
        off = sections_off(args.skip_tests, args.scaling, args.only)
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        print_plan(mode, args.budget, off)
        return 0
    if mode == "gpu" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); run it on a GPU machine, or "
              f"with --cpu-smoke for its CPU-testable parts", file=sys.stderr)
        return 2
    results: dict[str, Any] = {
        "environment": environment(), "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "mode": mode, "budget_s": args.budget,
        "sections": {name: {"status": "pending", "estimate_s": estimate_s(mode, name)} for name in SECTIONS}}
    run = Run(args.budget, args.out, mode, results)
    sizes = GPU if mode == "gpu" else SMOKE
    with tempfile.TemporaryDirectory() as tmp:
        for name in SECTIONS:
            run_section(run, name, sizes, Path(tmp), off)
    path = run.save()
    counts = {s: [n for n, r in results["sections"].items() if r["status"] == s]
              for s in ("ran", "skipped", "timed_out", "failed")}
    summary = "; ".join(f"{status} {', '.join(names)}" for status, names in counts.items() if names)
    print(f"gpu_check: {summary}; {results['wall_s']:.0f} s of the {args.budget:.0f} s budget; wrote {path}",
          flush=True)
    return 1 if _failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
