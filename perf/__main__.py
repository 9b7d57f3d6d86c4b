"""``python -m perf NAME [flags]`` runs one benchmark; ``python -m perf list`` names them all.

Why one entry point: every benchmark shares the same flags (``perf.common.parser``), launcher and
result writer, and CI runs each with ``--tiny`` (``tests/test_perf_suite.py``) by the same name.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module in perf/, what it measures)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "halo": ("bench_halo", "halo-exchange overhead of a split CosmoFlow-like stack against one process"),
    "scaling": ("bench_scaling", "strong scaling: 2 ranks x 1 thread against 1 process x 2 threads"),
    "dtensor": ("bench_dtensor", "DTensor Shard conv3d against ours: correctness cases and timing"),
    "pipeline": ("bench_pipeline", "pipeline efficiency against the bubble bound of the same stages"),
    "pipeline_breakdown": ("pipeline_breakdown", "per stage: compute in the pipeline against alone, waiting"),
    "deferred": ("bench_deferred", "B/W split of the last backward, on against off, paired"),
    "transports": ("bench_transports", "pipeline transfers over MPI against gloo, paired (mpiexec)"),
    "p2p_latency": ("bench_p2p_latency", "one-way message time: gloo (and MPI with --mpi)"),
    "vs_torch_pipelining": ("bench_vs_torch_pipelining", "our GPipe against torch.distributed.pipelining"),
    "hybrid_vs_dp": ("bench_hybrid_vs_dp", "spatial x pipeline against data parallelism, 2 ranks"),
    "fft": ("bench_fft", "distributed 3D FFT (rfftn + irfftn) on 2 and 4 ranks against one process"),
    "unet": ("bench_unet", "3D U-Net: activation memory and step time per rank against one process"),
    "infer": ("bench_infer", "whole-box U-Net inference: one process, 4 ranks split, MONAI sliding window"),
    "infer_split": ("bench_infer_split", "U-Net inference at equal cores: 2 ranks split, one process, MONAI"),
    "loader": ("bench_loader", "sharded loader: bytes read per rank, data wait with worker processes"),
    "generator": ("bench_generator", "synthetic universe generation time"),
    "checkpoint": ("bench_checkpoint", "checkpoint stall against torch.save and dcp.async_save"),
    "recovery": ("bench_recovery", "kill a rank under torchrun: time to the new attempt's first step"),
    "profile": ("bench_profile", "per layer, where a step and an inference pass go; bytes, collectives"),
    "shardtensor": ("bench_shardtensor", "PhysicsNeMo ShardTensor against ours: exactness, step time, heap"),
    "advisor": ("bench_advisor", "the layout advisor's choice against every candidate it ranked, measured"),
    "harness": ("harness", "scaling sweep 1-8 ranks with the performance model's predictions"),
    "gpu_check": ("gpu_check", "the GPU suite: CUDA tests and accelerator benchmarks (--cpu-smoke on CPU)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("list", "-h", "--help"):
        width = max(map(len, BENCHMARKS))
        print("python -m perf NAME [flags]   (NAME --help for its flags; --tiny: seconds, what CI runs)\n")
        for name, (_, what) in BENCHMARKS.items():
            print(f"  {name.ljust(width)}  {what}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"python -m perf: no benchmark {name!r}; one of {', '.join(BENCHMARKS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"perf.{BENCHMARKS[name][0]}")
    return module.main(rest) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
