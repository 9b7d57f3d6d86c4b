"""launch/slurm.sbatch's recovery logic, run by bash with stand-ins for srun and scontrol: a failed
training step requeues the job (up to MAX_REQUEUES), a configuration error (exit 2) never does, and the
time-limit SIGTERM reaches the training, waits for its final checkpoint, then requeues."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distributed import ROOT

SRUN = """#!/bin/bash
trap 'echo "srun got TERM" >> "$LOG"; exit 0' TERM
echo "srun $*" >> "$LOG"
if [ "$FAKE_RC" = sleep ]; then sleep 30 >/dev/null 2>&1 & wait $!; fi
exit "$FAKE_RC"
"""


def _job(tmp_path: Path, rc: str, restarts: int) -> tuple[subprocess.Popen, Path]:
    bin_dir, submit = tmp_path / "bin", tmp_path / "submit"
    (submit / ".venv/bin").mkdir(parents=True)
    (submit / ".venv/bin/activate").write_text("")
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "srun").write_text(SRUN)
    (bin_dir / "scontrol").write_text('#!/bin/bash\necho "scontrol $*" >> "$LOG"\n')
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LOG": str(log), "FAKE_RC": rc,
           "SLURM_SUBMIT_DIR": str(submit), "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "2",
           "SLURM_RESTART_COUNT": str(restarts), "MAX_REQUEUES": "2"}
    # as Slurm starts it: SIGTERM not ignored (bash could not trap an inherited ignored signal)
    proc = subprocess.Popen(["bash", str(ROOT / "launch/slurm.sbatch")], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    return proc, log


@pytest.mark.parametrize("rc, restarts, requeued", [("1", 0, True), ("137", 1, True), ("1", 2, False),
                                                    ("2", 0, False), ("0", 0, False)])
def test_failed_step_requeues(tmp_path, rc, restarts, requeued):
    proc, log = _job(tmp_path, rc, restarts)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == int(rc), out
    calls = log.read_text()
    assert "launch/train.py" in calls
    assert ("scontrol requeue 4242" in calls) == requeued, f"exit {rc} after {restarts} requeues:\n{out}"


def test_time_limit_checkpoints_then_requeues(tmp_path):
    proc, log = _job(tmp_path, "sleep", 0)
    while not (log.exists() and "srun" in log.read_text()):
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    calls = log.read_text().splitlines()
    assert proc.returncode == 0, out
    assert calls[-2:] == ["srun got TERM", "scontrol requeue 4242"], calls
