"""The README's code runs as written: every fenced code block in README.md is a verbatim excerpt (a run
of whole lines) of a script under ``launch/examples/``, and every example runs, here at its own small
size, under the launch line at its top, printing its result against one process.

Why: a snippet kept beside the code it shows drifts away from it; one cut from a script that CI runs
cannot. The Python examples start as torchrun starts their ranks (``forked.run_python``) and print
``max |split - one process| = E``, checked here in float64; the shell examples run as a user runs them.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forked import run_python

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "launch" / "examples"
SCRIPTS = sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh"))
LAUNCH = re.compile(r"^#\s+(torchrun --nproc-per-node (\d+)|bash) (launch/examples/\S+)")
ERROR = re.compile(r"max \|split - one process\|[^=]*= ([0-9.eE+-]+)")


def readme_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(line number, lines) of each fenced code block."""
    blocks, lines, start = [], text.splitlines(), None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start = i
            else:
                blocks.append((start + 2, lines[start + 1:i]))
                start = None
    return blocks


def excerpt_of(block: list[str], script: list[str]) -> bool:
    return any(script[i:i + len(block)] == block for i in range(len(script) - len(block) + 1))


def launch_line(path: Path) -> re.Match:
    found = next((m for m in map(LAUNCH.match, path.read_text().splitlines()[:3]) if m), None)
    assert found, f"{path.name}: no launch line ('# torchrun --nproc-per-node N launch/examples/…' or " \
                  f"'# bash launch/examples/…') in its first lines"
    assert found.group(3).startswith(f"launch/examples/{path.name}"), f"{path.name}: its launch line runs " \
                                                                     f"{found.group(3)}"
    return found


def test_every_readme_block_is_an_example_excerpt():
    scripts = {p.name: p.read_text().splitlines() for p in SCRIPTS}
    blocks = readme_blocks((ROOT / "README.md").read_text())
    assert blocks, "README.md has no code block"
    for line, block in blocks:
        assert any(excerpt_of(block, s) for s in scripts.values()), (
            f"README.md line {line}: this block is not a verbatim excerpt of a script under launch/examples/ "
            f"(first line: {block[0]!r})")


@pytest.mark.parametrize("path", [p for p in SCRIPTS if p.suffix == ".py"], ids=lambda p: p.name)
def test_python_example_matches_one_process(path):
    ranks = int(launch_line(path).group(2))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = run_python([str(path)], env=env, ranks=ranks, timeout=240)
    assert res.returncode == 0, f"{path.name} on {ranks} ranks failed:\n{res.stdout}\n{res.stderr}"
    errors = [float(e) for e in ERROR.findall(res.stdout)]
    assert errors, f"{path.name} printed no 'max |split - one process| = E' line:\n{res.stdout}"
    assert max(errors) <= 1e-9, f"{path.name}: split differs from one process:\n{res.stdout}"


def test_quick_start_targets_exist():
    """``make demo`` takes minutes and ``make test`` is CI itself: here each target must exist (make -n)."""
    path = EXAMPLES / "quick_start.sh"
    launch_line(path)
    targets = [m.group(1) for m in map(re.compile(r"^make (\S+)").match, path.read_text().splitlines()) if m]
    assert targets
    for target in targets:
        res = subprocess.run(["make", "-n", target], cwd=ROOT, capture_output=True, text=True)
        assert res.returncode == 0, f"quick_start.sh: make {target}: {res.stderr}"


def test_train_example_runs(tmp_path):
    """The training example as a user runs it (torchrun, 4 ranks), at a small size and four steps: its
    run must end with the validation table."""
    path = EXAMPLES / "train_cosmoflow.sh"
    launch_line(path)
    small = ["run_dir=" + str(tmp_path / "run"), "data.sample_size=32", "data.augment=none", "data.workers=0",
             "model.n_conv=2", "model.base_filters=4", "model.dense=[8]", "train.batch_size=32",
             "train.epochs=1", "train.max_steps=4", "logging.plots=false", "logging.tensorboard=false",
             "logging.progress=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run(["bash", str(path), *[a for s in small for a in ("--set", s)]], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, f"train_cosmoflow.sh failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert "validation MAE per parameter" in res.stdout, res.stdout[-3000:]
