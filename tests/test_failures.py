"""One clear line per failure, end to end on launch/train.py with 2 ranks and tiny sizes: a bad config,
a resume with another model, a damaged universe (and ``data.skip_bad``), and a rank that stops
answering. Each is printed once per job (a line starting ``error:``), and the exit code tells a
configuration error (2) from a runtime fault (1); torchrun's report shows that line as the root cause
(run under torchrun for a configuration error and a runtime fault: one path writes both reports)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import pytest

from cosmoflow.generate import generate
from cosmoflow.trainer import main

from distributed import ROOT, free_port, train_script


@pytest.fixture(autouse=True)
def _sigterm_restored():
    """``main`` is a process's entry: on failure it ignores SIGTERM for the rest of the process (see
    ``hybridpar.process.failure``). Run in this process, restore it, or every later child (which inherits the
    ignored signal, and a bash script cannot trap it back) would be deaf to SIGTERM."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("universes")
    generate(d / "train", universes=4, size=16, seed=1, progress=False, linear=False)
    generate(d / "val", universes=2, size=16, seed=2, progress=False, linear=False)
    damaged = d / "damaged"
    damaged.mkdir()
    for p in (d / "train").iterdir():
        (damaged / p.name).write_bytes(p.read_bytes())
    bad = damaged / "univ_s1_00002.h5"
    with h5py.File(bad, "r") as f:
        at = f["full"].id.get_chunk_info(0).byte_offset + 100
    raw = bytearray(bad.read_bytes())
    raw[at:at + 16] = bytes(b ^ 0xFF for b in raw[at:at + 16])
    bad.write_bytes(bytes(raw))
    return d


def _args(data: Path, run: Path, *extra: str, train: str = "train") -> list[str]:
    sets = [f"data.train={data / train}", f"data.val={data / 'val'}", "data.sample_size=8", "data.workers=0",
            "model.n_conv=2", "model.base_filters=4", "model.dense=[8]", "model.dropout=0.0",
            "data.augment=none",  # crops: the demo's periodic rolls need whole universes
            "train.batch_size=4", "train.epochs=1", f"run_dir={run}", "logging.progress=false",
            "logging.plots=false", "logging.tensorboard=false", "checkpoint.every_steps=3",
            "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}}", *extra]
    return ["--config", str(ROOT / "launch/configs/demo.yaml"), *[a for s in sets for a in ("--set", s)]]


def _one_error(res: subprocess.CompletedProcess, code: int) -> str:
    """The job's one ``error:`` line; torchrun's report names it as the root cause, with its exit code."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, res.stderr[-4000:]
    root = res.stderr[res.stderr.index("Root Cause"):]
    assert f"traceback : {lines[0]}" in root and re.search(rf"exitcode\s*: {code} ", root), res.stderr[-4000:]
    assert "To enable traceback" not in res.stderr, res.stderr[-4000:]
    assert res.stderr.count("Traceback (most recent call last)") == 1, res.stderr  # torchrun's own only
    return lines[0]


def test_config_error_is_one_line_exit_2(data, tmp_path, capsys):
    assert main(_args(data, tmp_path / "run", "train.epochs=many")) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: train.epochs: expected int, got 'many' (default 8)"]
    bad_timeout = "parallel={grid: {data: 1}, timeout_s: -1}"
    assert main(_args(data, tmp_path / "run", bad_timeout)) == 2
    assert "timeout_s: -1 is not a positive number of seconds" in capsys.readouterr().err
    res = train_script(_args(data, tmp_path / "run", "train.epochs=many"), timeout=120, torchrun=True)
    assert "expected int, got 'many'" in _one_error(res, 2)
    # Rank 1 either reached the same error (and points at rank 0) or was still starting when rank 0
    # left and torchrun stopped it; which one depends on the machine's load, not on our code.
    assert "stopped because rank 0 failed" in res.stderr or "Signal 15 (SIGTERM)" in res.stderr, res.stderr


def _one_line(res, code: int) -> str:
    """The job's one ``error:`` line where its ranks were started as torchrun starts them (the report
    torchrun makes of that line is :func:`_one_error`'s, checked by the tests that run torchrun)."""
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and code in res.codes, (res.codes, res.stderr[-4000:])
    assert "Traceback (most recent call last)" not in res.stderr, res.stderr[-4000:]
    return lines[0]


def test_resume_with_another_model_names_the_keys(data, tmp_path):
    run = tmp_path / "run"
    first = train_script(_args(data, run, "train.max_steps=3"))
    assert first.returncode == 0, first.stderr[-3000:]
    res = train_script(_args(data, run, "model.base_filters=8"))
    line = _one_line(res, 2)
    assert "cannot resume" in line and "(step 3) holds another model" in line, line
    assert "9 shape mismatches (trunk.0.weight (4, 4, 3, 3, 3) saved, (8, 4, 3, 3, 3) now;" in line, line
    assert "and 6 more" in line and "--set checkpoint.resume=false" in line, line
    assert "size mismatch" not in res.stderr
    fresh = train_script(_args(data, run, "model.base_filters=8", "checkpoint.resume=false",
                               "train.max_steps=1"))
    assert fresh.returncode == 0 and "resumed" not in fresh.stdout, fresh.stderr[-3000:]


def test_damaged_universe_is_named_or_skipped(data, tmp_path):
    res = train_script(_args(data, tmp_path / "a", train="damaged"), torchrun=True)
    line = _one_error(res, 1)
    assert re.search(r"damaged/univ_s1_00002\.h5: sample \d \(sub-cube .*\), region d \d+:\d+, h \d+:\d+, "
                     r"w \d+:\d+: checksum mismatch \(Fletcher-32\)", line), line
    skipped = train_script(_args(data, tmp_path / "b", "data.skip_bad=true", train="damaged"))
    assert skipped.returncode == 0, skipped.stderr[-3000:]
    warned = [ln for ln in skipped.stderr.splitlines() if ln.startswith("warning: data.skip_bad")]
    assert len(warned) == 1 and "univ_s1_00002.h5: sample" in warned[0], skipped.stderr[-3000:]
    assert "skipped 8 bad samples (data.skip_bad)" in skipped.stdout  # the whole 16³ universe is one chunk


def test_a_rank_that_stops_answering_ends_the_job(data, tmp_path, monkeypatch):
    """Rank 1 SIGSTOPs itself (a fault hook, at its save of step 3); rank 0, waiting for its halo,
    ends within parallel.timeout_s and names the operation and the silent rank. (torchrun would add
    its 30 s grace before killing rank 1: the launcher here waits 1 s.)"""
    monkeypatch.setattr("forked.STOP_GRACE_S", 1.0)
    spec = "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}, timeout_s: 3}"
    pids: list[int] = []
    seen: set[str] = set()  # the states rank 1 was seen in
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if pids:
                try:
                    seen.add(Path(f"/proc/{pids[1]}/stat").read_text().rsplit(")", 1)[1].split()[0])
                except OSError:
                    pass
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        res = train_script(_args(data, tmp_path / "run", spec), timeout=120,
                           env={"HYBRIDPAR_CKPT_FAULT": "snapshot:stop:3:1"},
                           on_start=lambda _, started: pids.extend(started))
    finally:
        done.set()
        watcher.join(timeout=5)
    assert "T" in seen, f"rank 1 was seen in states {seen}, never stopped"
    assert res.codes == [1, -signal.SIGKILL], res.stderr[-3000:]
    err = res.stderr
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [ln for ln in err.strip().splitlines() if not ln.startswith("warning")][-1:], err[-3000:]
    # the first exchange of a step: the split's random streams compared, a halo, or the P(k) branch's FFT
    # transpose (the demo's model has one)
    assert re.fullmatch(r"error: rank 0 gave up waiting in (random_streams|halo_exchange|redistribute), "
                        r"step 3: Timed out waiting 3000ms for recv operation to complete \(timeout_s = 3\); "
                        r"rank 1 stopped answering", lines[0]), lines[0]


def test_a_killed_rank_is_named_with_its_signal(data, tmp_path):
    """Rank 1 SIGKILLs itself after step 2 (a fault hook); rank 0's collective fails at once with gloo's
    "Connection reset by peer". Its one line names rank 1, its pid and its signal (read from the
    unreaped process, as torchrun's report reads its exit status), not itself and not gloo's advice."""
    args = _args(data, tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "HYBRIDPAR_CKPT_FAULT": "step:kill:2:1"}
    cmd = [sys.executable, str(ROOT / "launch/train.py"), *args]
    ranks = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (1, 0)]
    try:
        _, err = ranks[1].communicate(timeout=120)
    finally:
        ranks[0].kill()
        ranks[0].communicate()
    assert ranks[0].returncode == -signal.SIGKILL and ranks[1].returncode == 1, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert re.fullmatch(rf"error: rank 1 \(pid {ranks[0].pid}\) died: killed by SIGKILL; rank 0 was waiting "
                        r"for it in \w+(, step \d+)?", lines[0]), lines[0]


_LATE_RANK = """
import sys, time
import torch.distributed as dist
from hybridpar.process import failure
from hybridpar.process.launchers import init_distributed
init_distributed("gloo")
if dist.get_rank() == 1:
    time.sleep(1.5)  # meets the same error later: rank 0, which serves the store, must still be there
failure.leave(failure.report("error: " + sys.argv[1], failure.CONFIG_ERROR))
"""


def test_a_configuration_error_met_late_by_a_rank_is_still_one_line(tmp_path):
    """Under mpirun or srun rank 0 serves the rendezvous store: it stays until every rank has read the
    job's line, so a rank slower to meet the same configuration error prints nothing of its own."""
    script = tmp_path / "late.py"
    script.write_text(_LATE_RANK)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    env.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    ranks = [subprocess.Popen([sys.executable, str(script), "the same for every rank"], cwd=ROOT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (0, 1)]
    errs = [p.communicate(timeout=60)[1] for p in ranks]
    assert [p.returncode for p in ranks] == [2, 2], errs
    assert errs[0].splitlines() == ["error: the same for every rank"] and errs[1] == "", errs
