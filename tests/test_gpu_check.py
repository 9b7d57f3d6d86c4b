"""``python -m perf gpu_check`` does not rot on CPU, and keeps to its budget.

Checked against what the GPU run relies on: without CUDA the one command refuses in one line;
``--cpu-smoke`` runs every section's code at a tiny size (the CUDA tests' collection and its
subprocess, CosmoFlow at 16³ in fp32, bf16, bf16 + channels_last and compiled with aot_eager, the
memory and U-Net jobs on 1 and 2 ranks, the checkpoint stall at 1 MiB) and writes the table and the
JSON with each section's status; ``--dry-run`` prints the plan and runs nothing; a budget too small for
anything skips every section with its reason and still writes the JSON; a section past the budget is
marked timed out with its rows kept; the tests' subprocess is killed at its deadline; hybridpar imports
without the ``nvtx`` package (a GPU image lacks it)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from perf import gpu_check

from distributed import ROOT
from forked import run_python


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return run_python(["-m", "perf", "gpu_check", *args], env=env, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict, str]:
    """One ``--cpu-smoke`` run for the module: its process, its JSON and its table."""
    out = tmp_path_factory.mktemp("gpu_check")
    res = _run("--cpu-smoke", "--out", str(out))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res, json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_without_cuda_it_says_so_in_one_line():
    """The one command of perf/README.md (its flags), on a machine without CUDA: status 2, one line."""
    res = _run("--budget", "480", "--out", "/nonexistent/gpu")
    assert res.returncode == 2
    assert res.stderr.strip().count("\n") == 0
    assert "no CUDA device" in res.stderr and "--cpu-smoke" in res.stderr


def test_cpu_smoke_runs_every_section_and_writes_table_and_json(smoke):
    res, out, md = smoke
    assert {"torch", "cuda", "machine"} <= set(out["environment"])
    assert out["mode"] == "smoke" and out["budget_s"] == 480
    sections = out["sections"]
    assert list(sections) == list(gpu_check.SECTIONS)  # the order of value
    assert {n: s["status"] for n, s in sections.items()} == {
        "tests": "ran", "cosmoflow": "ran", "memory": "ran", "checkpoint": "ran", "unet": "ran",
        "scaling": "skipped"}
    assert sections["scaling"]["reason"] == "off unless --scaling"
    assert all(s["seconds"] >= 0 and s["estimate_s"] > 0 for s in sections.values() if s["status"] == "ran")
    assert "cuda" in out["tests"]["command"] and out["tests"]["returncode"] == 0
    assert re.search(r"\b\d+ skipped", out["tests"]["summary"]), out["tests"]  # found, and skipped here
    rows = {r["variant"]: r for r in out["cosmoflow"]}
    assert set(rows) == {"torch bf16+cl", "fp32", "bf16", "bf16+cl", "bf16+cl+compile"}
    assert all(r["samples_per_s"] > 0 and 0 <= r["data_wait_share"] <= 1 for r in rows.values())
    # end to end (loader included) is never faster than the steps alone
    assert all(r["samples_per_s"] <= r["compute_samples_per_s"] * 1.0001 for r in rows.values())
    assert out["checkpoint"]["reserve_s"] >= 0
    assert [r["ranks"] for r in out["memory"]] == [1, 2]
    assert out["checkpoint"]["ours_stall_s"] >= 0 and out["checkpoint"]["torch_save_s"] > 0
    unet = {r["ranks"]: r for r in out["unet"]}
    assert set(unet) == {1, 2} and all("error" not in r for r in unet.values())
    assert all(r["step_ms"] > 0 and r["steps"] == gpu_check.SMOKE.unet_steps for r in unet.values())
    assert all(r["peak_gib_per_rank"] is None for r in unet.values())  # torch counts no peak on CPU
    assert "| bf16+cl+compile" in md and "U-Net" in md and "| unet " in md
    assert "gpu_check: ran tests, cosmoflow, memory, checkpoint, unet; skipped scaling" in res.stdout


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path):
    """At the default budget every GPU section fits; at 120 s the compile variant and the late sections
    are skipped, each with its reason; nothing is written."""
    t0 = time.monotonic()
    res = _run("--dry-run", "--out", str(tmp_path / "gpu"))
    assert res.returncode == 0, res.stderr
    assert time.monotonic() - t0 < 60 and not (tmp_path / "gpu").exists()
    for name in gpu_check.SECTIONS:
        assert f" {name} " in res.stdout
    assert "--budget 480 s" in res.stdout and "not measurements" in res.stdout
    assert "bf16+cl+compile 40" in res.stdout and "skipped rows: none" in res.stdout
    assert "skip: off unless --scaling" in res.stdout
    res = _run("--dry-run", "--budget", "120")
    assert "bf16+cl+compile skipped: estimated 40 s > " in res.stdout
    assert "unet" in res.stdout.split("skipped sections:")[1]


def test_plan_fits_the_default_budget():
    """The estimates: every GPU section (not --scaling) fits in 480 s, with nothing skipped."""
    entries, used = gpu_check.plan("gpu", 480)
    assert used <= 480 and all(not e["skipped_rows"] for e in entries)
    assert [e["section"] for e in entries if e["skip"]] == ["scaling"]


def test_tiny_budget_skips_every_section_with_its_reason(tmp_path):
    res = _run("--cpu-smoke", "--budget", "1", "--out", str(tmp_path))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    out = json.loads((tmp_path / "gpu_check.json").read_text())
    for name, s in out["sections"].items():
        assert s["status"] == "skipped", (name, s)
        assert "budget" in s["reason"] or s["reason"] == "off unless --scaling"
        assert f"gpu_check: {name} skipped: " in res.stdout
    assert "cosmoflow" not in out and "tests" not in out
    assert "| tests      | skipped |" in (tmp_path / "gpu_check.md").read_text()


def test_a_section_past_the_budget_is_timed_out_and_keeps_its_rows(tmp_path, monkeypatch):
    """A section whose rows outlast the budget stops at its next check, ``timed_out``, rows kept, and the
    next row that does not fit is skipped with its reason; the JSON says so after the section."""
    results = {"environment": {"torch": torch.__version__}, "budget_s": 0.3,
               "sections": {n: {"status": "pending", "estimate_s": 1} for n in gpu_check.SECTIONS}}
    run = gpu_check.Run(0.3, tmp_path, "smoke", results)

    def slow_rows(run, sizes, rows, work):
        run.add("unet", {"ranks": 1, "size": 16, "step_ms": 1.0})
        time.sleep(0.4)
        run.check_deadline()

    monkeypatch.setitem(gpu_check.ESTIMATES["smoke"], "unet", (0, [("1 rank", 0.1)]))
    monkeypatch.setitem(gpu_check.RUNNERS, "unet", slow_rows)
    gpu_check.run_section(run, "unet", gpu_check.SMOKE, tmp_path, {})
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["sections"]["unet"]["status"] == "timed_out"
    assert "past the 0 s budget" in written["sections"]["unet"]["reason"]
    assert written["unet"] == [{"ranks": 1, "size": 16, "step_ms": 1.0}]
    assert not run.fits("memory", "2 ranks", 5)
    assert "> 0 s left" in results["sections"]["memory"]["skipped_rows"]["2 ranks"]


def test_the_tests_subprocess_is_killed_at_its_deadline(tmp_path):
    t0 = time.monotonic()
    result = gpu_check.run_tests(0.5, tmp_path / "tests.log")
    assert result["timed_out"] and result["returncode"] != 0
    assert time.monotonic() - t0 < 30 and (tmp_path / "tests.log").exists()


def test_hybridpar_ranges_work_without_nvtx(monkeypatch):
    """The ranges module loaded where ``import nvtx`` fails: no NVTX, the range still enters and exits."""
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    spec = importlib.util.spec_from_file_location("ranges_without_nvtx",
                                                  ROOT / "hybridpar/profiling/ranges.py")
    ranges = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ranges)
    assert ranges.nvtx is None and not ranges._NVTX_ON
    with ranges.range("conv1", "compute"):
        pass
