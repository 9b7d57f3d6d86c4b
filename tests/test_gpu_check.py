"""``python -m perf gpu_check`` does not rot on CPU: without CUDA it refuses in one line;
``--cpu-smoke`` runs its CPU-testable parts (the CosmoFlow benchmark at 16³ in fp32, bf16,
bf16 + channels_last and compiled with aot_eager, and the checkpoint stall at 1 MiB) and writes the
table and the JSON."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from distributed import ROOT
from forked import run_python


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_python(["-m", "perf", "gpu_check", *args], env=env, timeout=600)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    res = _run()
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "no CUDA device" in res.stderr and "--cpu-smoke" in res.stderr


def test_cpu_smoke_writes_table_and_json(tmp_path):
    res = _run("--cpu-smoke", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {"torch", "cuda", "machine"} <= set(out["environment"])
    rows = {r["variant"]: r for r in out["cosmoflow"]}
    assert set(rows) == {"fp32", "bf16", "bf16+cl", "bf16+cl+compile"}
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 for r in rows.values())
    assert out["checkpoint"]["ours_stall_s"] >= 0 and out["checkpoint"]["torch_save_s"] > 0
    assert "| bf16+cl+compile" in (tmp_path / "gpu_check.md").read_text()
