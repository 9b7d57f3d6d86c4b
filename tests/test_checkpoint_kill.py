"""SIGKILL a real (tiny, CPU, deterministic) training run at the moments a save is most fragile, then
resume it: the final weights must be bit-identical to those of an uninterrupted run, and the killed
save must never be named by ``latest()``. The kills come from the writer's own fault hooks
(``HYBRIDPAR_CKPT_FAULT``), so each lands exactly at its point; the killed runs go in parallel."""

from __future__ import annotations

import os
import signal
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ckpt_train_script
import pytest
import torch

from hybridpar.checkpoint import Checkpointer
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.faults import ENV

from forked import run_python

SCRIPT = Path(__file__).with_name("ckpt_train_script.py")

# (fault, script flags, step latest() must name after the kill); saves happen after steps 2, 5, 8, 11
CASES = {
    "before-snapshot": ("snapshot:kill:5", [], 2),
    "during-overlapped-copy": ("copy:kill:5", ["--overlap"], 2),
    "mid-persist": ("persist:kill:8", ["--overlap"], 5),
    "before-manifest-rename": ("manifest:kill:8", [], 5),
    # complete at L1, so resume from there; the killed run stops at step 9 so that no later save can
    # overtake the (killed) flush and the newest version is the same whatever the machine's load
    "mid-L3-flush": ("flush:kill:8", ["--local", "{local}"], 8),
}
KILLED_RUN_STEPS = {"mid-L3-flush": ["--steps", "10"]}


@pytest.mark.timeout(90)
def test_killed_runs_resume_bit_identical(tmp_path):
    reference = ckpt_train_script.main([str(tmp_path / "reference")])
    runs = {}
    with ThreadPoolExecutor(len(CASES)) as pool:
        for name, (fault, flags, _) in CASES.items():
            flags = [f.format(local=tmp_path / name / "local") for f in flags]
            args = [str(SCRIPT), str(tmp_path / name / "root"), *flags, *KILLED_RUN_STEPS.get(name, [])]
            runs[name] = (pool.submit(run_python, args, env={**os.environ, ENV: fault}, timeout=60), flags)
    for name, (killed_run, flags) in runs.items():
        proc = killed_run.result()
        assert proc.returncode == -signal.SIGKILL, f"{name}: exit {proc.returncode}\n{proc.stderr}"
        root = tmp_path / name / "root"
        local = flags[1] if "--local" in flags else None
        ck = Checkpointer(root, local_dir=local)
        assert ck.latest() == CASES[name][2], f"{name}: latest() is {ck.latest()}"
        if name in ("mid-persist", "before-manifest-rename", "mid-L3-flush"):
            killed = [p for p in root.iterdir() if mf.parse_name(p.name) and mf.parse_name(p.name)[0] == 8]
            assert killed and not (killed[0] / mf.MANIFEST).exists(), f"{name}: no half-written save left"
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resumed = ckpt_train_script.main([str(root), *flags])
        if name in ("mid-persist", "before-manifest-rename"):  # load() names what it skipped
            assert any("000000000008" in str(w.message) and "no manifest" in str(w.message) for w in seen)
        for k, v in reference.items():
            assert torch.equal(v, resumed[k]), f"{name}: {k} differs after resuming"
        ck.close()
