"""What a run leaves: ``gpu_check.md`` (the tables) and ``gpu_check.json`` (everything), rewritten atomically
after every row, with the versions the figures were measured with.

Why atomically and so often: a lease can end mid-run; what was measured by then must be on disk, whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch


def environment() -> dict[str, Any]:
    """GPU, driver, CUDA and torch versions (and the host's CPU facts)."""
    from hybridpar.profiling.hostinfo import machine_info

    env: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "machine": machine_info()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1),
                   capability=f"{p.major}.{p.minor}")
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            env["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    return env


def _atomic_write(path: Path, text: str) -> None:
    """Write through a temporary file and a rename: a run killed mid-write leaves the previous version."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write(results: dict[str, Any], out: Path) -> Path:
    """``out/gpu_check.md`` (the tables) and ``out/gpu_check.json`` (everything), both atomically."""
    from perf.common import print_table

    out.mkdir(parents=True, exist_ok=True)
    env = results["environment"]
    parts = [f"GPU suite on {env.get('gpu', 'CPU (smoke)')}: driver {env.get('driver', '-')}, CUDA "
             f"{env.get('cuda')}, torch {env['torch']}; budget {results['budget_s']:.0f} s, "
             f"{results.get('wall_s', 0):.0f} s used"]
    rows = [[name, s["status"], f"{s['seconds']:.1f}" if "seconds" in s else "-", f"{s['estimate_s']:.0f}",
             s.get("reason") or "",
             "; ".join(f"{k}: {v}" for k, v in s.get("skipped_rows", {}).items())]
            for name, s in results["sections"].items()]
    parts.append(print_table(["section", "status", "seconds", "estimate s", "reason", "rows skipped"], rows,
                             "Sections", echo=False))
    if "tests" in results:
        parts.append(f"tests: {results['tests']['summary']}")
    if results.get("cosmoflow"):
        rows = [[r["variant"], r.get("samples_per_s", "-"), r.get("compute_samples_per_s", "-"),
                 r.get("step_ms", "-"), r.get("mfu", "-"), r.get("data_wait_share", "-"), _problem(r)]
                for r in results["cosmoflow"]]
        parts.append(print_table(["variant", "samples/s", "steps alone /s", "step ms", "MFU", "data wait",
                                  "error / note"], rows,
                                 f"CosmoFlow {results['cosmoflow_size']}³ x 4, batch 1; samples/s end to end "
                                 f"(loader included), MFU of that", echo=False))
    if results.get("memory"):
        rows = [[r["ranks"], r["size"], r.get("peak_gib_per_rank", "-"), _problem(r)]
                for r in results["memory"]]
        parts.append(print_table(["ranks", "size", "peak GiB / rank", "error / note"], rows,
                                 "Peak memory, ranks sharing the GPU (None: not measured on CPU)",
                                 echo=False))
    c = results.get("checkpoint")
    if c:
        parts.append(print_table(["state GiB", "step ms", "reserve s (once)", "our stall s", "share of step",
                                  "torch.save s", "DCP async_save blocks s"],
                                 [[c["state_gib"], c["step_ms"], c.get("reserve_s", "-"), c["ours_stall_s"],
                                   c["ours_stall_share_of_step"], c["torch_save_s"],
                                   c["dcp_async_save_blocking_s"]]], "Checkpoint stall", echo=False))
    if results.get("unet"):
        rows = [[r["ranks"], r["size"], r.get("step_ms", "-"), r.get("peak_gib_per_rank", "-"),
                 _problem(r)] for r in results["unet"]]
        parts.append(print_table(["ranks", "size", "step ms", "peak GiB / rank", "error / note"], rows,
                                 "U-Net (reconstruct.yaml's), batch 1, bf16, fwd + bwd, ranks sharing the "
                                 "GPU (None: not measured on CPU)", echo=False))
    if results.get("scaling"):
        parts.append("scaling harness runs: " + ", ".join(f"{r['out']} (exit {r['returncode']})"
                                                         for r in results["scaling"]))
    _atomic_write(out / "gpu_check.md", "\n\n".join(parts) + "\n")
    path = out / "gpu_check.json"
    _atomic_write(path, json.dumps(results, indent=1) + "\n")
    return path


def _problem(row: dict[str, Any]) -> str:
    return row.get("error", row.get("note", ""))
