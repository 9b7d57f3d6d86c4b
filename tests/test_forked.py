"""tests/forked.py's ``run_python`` behaves as ``python ARGS`` (and as torchrun with ``ranks``) does
for what the end-to-end tests read: output, exit status, ``atexit``, the environment, a failed rank
stopping the others, torchrun's restarts, and a timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from forked import run_python

SCRIPT = """
import atexit, os, sys, time
rank = int(os.environ.get("RANK", "0"))
atexit.register(lambda: print("atexit ran", flush=True))
print("argv", sys.argv[1:], "rank", rank, "of", os.environ.get("WORLD_SIZE"), "HELLO",
      os.environ.get("HELLO"))
print("to stderr", file=sys.stderr)
mode = sys.argv[1]
if mode == "exit3":
    sys.exit(3)
ready = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-printed")
if mode == "rank1-fails" and rank == 0:
    open(ready, "w").close()  # rank 1 fails only once rank 0 has printed (a loaded machine starts it late)
if mode == "rank1-fails" and rank == 1:
    end = time.monotonic() + 20
    while not os.path.exists(ready) and time.monotonic() < end:
        time.sleep(0.05)
    os._exit(2)
if mode in ("rank1-fails", "hang"):
    time.sleep(60)
if mode == "fail-twice":
    sys.exit(5 if rank == 1 and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < 2 else 0)
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("forked") / "prog.py"
    path.write_text(SCRIPT)
    return path


def test_output_status_and_atexit_as_python_gives_them(script):
    ours = run_python([str(script), "exit3"], env={"HELLO": "hi"})
    theirs = subprocess.run([sys.executable, str(script), "exit3"], env={"HELLO": "hi"}, capture_output=True,
                            text=True)
    assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr)
    assert ours.returncode == 3 and "atexit ran" in ours.stdout and "HELLO hi" in ours.stdout


def test_a_failed_rank_stops_the_others(script, monkeypatch):
    monkeypatch.setattr("forked.STOP_GRACE_S", 5.0)
    (script.parent / "rank0-printed").unlink(missing_ok=True)
    t0 = time.monotonic()
    res = run_python([str(script), "rank1-fails"], ranks=2)
    assert time.monotonic() - t0 < 30                               # not the 60 s rank 0 sleeps
    assert res.returncode == 1 and res.codes[1] == 2 and res.codes[0] != 0, res.codes   # torchrun's 1
    assert "rank 0 of 2" in res.stdout and "rank 1 of 2" in res.stdout


def test_timeout_kills_and_keeps_the_output(script):
    with pytest.raises(subprocess.TimeoutExpired) as err:
        run_python([str(script), "hang"], timeout=3)
    assert "argv ['hang']" in err.value.output and "to stderr" in err.value.stderr


def test_restarts_start_every_rank_again_with_the_next_count(script):
    started: list[tuple[int, list[int]]] = []
    res = run_python([str(script), "fail-twice"], ranks=2, restarts=3, on_start=lambda *a: started.append(a))
    assert res.returncode == 0 and [a for a, _ in started] == [0, 1, 2], (res.codes, started)
    assert len({p for _, pids in started for p in pids}) == 6          # fresh processes every attempt
    assert res.stdout.count("rank 0 of 2") == 3                       # every attempt's output, in order
    failed = run_python([str(script), "fail-twice"], ranks=2, restarts=1)
    assert failed.returncode == 1 and failed.codes[1] == 5, failed.codes   # out of restarts: the last's
