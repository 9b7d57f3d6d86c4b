"""Fault soak: the training application on 4 ranks (2 data-parallel replicas x a 2-way spatial split,
BatchNorm on, no precise-BN re-estimation to hide drift), restarted as ``torchrun --max-restarts``
restarts it (:func:`forked.run_python`'s ``restarts``), killed at random moments — after an optimizer
step, while a checkpoint is being written, in the middle of validation, and once by an outside SIGKILL
at a random time — resumes by itself each time. Checked against an uninterrupted run of the same config:
every tensor of every rank's final checkpoint (weights, optimizer state, BatchNorm running statistics,
RNG and loader state) and the final validation metrics are equal bit for bit. The kill moments are drawn
from a seed printed on failure. (torchrun's own restart, its agent's store and a fresh group, is
test_launch_grid's.)"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar.checkpoint.faults import ENV
from hybridpar.checkpoint.levels import Levels, available, scan
from hybridpar.checkpoint.restore import read_version
from hybridpar.checkpoint.tree import key_filter

from distributed import ROOT, tiny_universes, train_script

STEPS_PER_EPOCH = 8      # 4 universes x 8 crops of 8^3 / global batch 4
EPOCHS = 3
EVERY = 2                # checkpoint every 2 steps
KILL_WITHIN_S = 1.0      # the outside kill comes this long at most after attempt 3's first step


@pytest.fixture(scope="module")
def universes(tmp_path_factory):
    return tiny_universes(tmp_path_factory.mktemp("soak-universes"))


def _args(data: Path, run: Path) -> list[str]:
    """launch/train.py's arguments: the config both runs train."""
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", "data.sample_size=8",
            "data.workers=0", "model.n_conv=2", "model.base_filters=4", "model.dense=[8]",
            "model.dropout=0.0", "model.batchnorm=true", "train.precise_bn_batches=0",
            "data.augment=none",  # crops: the demo's periodic rolls need whole universes
            f"train.epochs={EPOCHS}", "train.batch_size=4", f"run_dir={run}", "logging.progress=false",
            "logging.plots=false", "logging.tensorboard=false", f"checkpoint.every_steps={EVERY}",
            "checkpoint.keep_last=2", "parallel={grid: {data: 2, pipe: 1, spatial: [2, 1, 1]}}"]
    return ["--config", str(ROOT / "launch/configs/demo.yaml"), *[a for s in sets for a in ("--set", s)]]


def _env(faults: str = "") -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop(ENV, None)
    if faults:
        env[ENV] = faults
    return env


def _final_state(run: Path) -> dict[str, torch.Tensor | object]:
    """Every leaf of every rank's view of the newest complete version, keyed by rank and path."""
    levels = Levels(run / "checkpoints")
    found = sorted((f for f in scan(levels).values() if f.manifest is not None and available(levels, f)),
                   key=lambda f: f.order)
    assert found, f"no complete checkpoint under {run}"
    out: dict[str, torch.Tensor | object] = {}
    for rank in range(4):
        flat, _ = read_version(levels, found[-1].manifest, rank, key_filter(None))
        out.update({f"rank{rank}/{k}": v for k, v in flat.tensors.items()})
        out.update({f"rank{rank}/{k}": v for k, v in flat.values.items()})
    out["step"] = found[-1].step
    return out


def _same(a: object, b: object) -> bool:
    """Bit-for-bit equality of two checkpoint leaves (tensors, numpy arrays, plain values)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict | list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(  # type: ignore[arg-type]
            _same(x, y) for x, y in (zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)))
    return a == b


def _plan(seed: int) -> tuple[str, float]:
    """The injected faults, one per attempt (attempts 0-2), and the outside kill's delay after attempt 3
    has logged its first step. Attempt 3 has at least one epoch's end ahead of it, whose validation
    pauses for longer than the delay: the kill cannot come after that attempt ended, however fast the
    machine (it may come during that validation or after the last step's checkpoint, both moments a real
    kill can hit)."""
    rng = random.Random(seed)
    after_step = rng.randint(1, 5)                              # killed right after this optimizer step
    mid_save = rng.randrange(after_step + (after_step % 2) + EVERY, 13, EVERY)   # a later checkpoint
    faults = ",".join([f"step:kill:{after_step}:{rng.randrange(4)}:0",
                       f"persist:kill:{mid_save}:{rng.randrange(4)}:1",
                       f"validate:kill:*:{rng.randrange(4)}:2",
                       f"validate:sleep{KILL_WITHIN_S + 0.5}:*:*:3"])
    return faults, rng.uniform(0.0, KILL_WITHIN_S)


@pytest.mark.timeout(300)
def test_killed_and_restarted_run_equals_uninterrupted(universes, tmp_path):
    reference = train_script(_args(universes, tmp_path / "reference"), nproc=4, env=_env())
    assert reference.returncode == 0, reference.stderr[-3000:]

    seed = int(os.environ.get("SOAK_SEED", random.randrange(1 << 30)))
    faults, delay = _plan(seed)
    context = (f"soak seed {seed} (SOAK_SEED={seed} repeats it): faults {faults}, "
               f"outside kill after {delay:.2f} s")
    run = tmp_path / "faulted"
    started: dict[int, list[int]] = {}  # attempt -> its workers' pids
    killed: list[int] = []
    done = threading.Event()

    def watch() -> None:  # in attempt 3 (after the injected faults), once it has logged a step: a kill
        while not done.is_set() and 3 not in started:
            time.sleep(0.02)
        since, csv = time.time(), run / "metrics_steps.csv"
        while not done.is_set() and not (csv.exists() and csv.stat().st_mtime > since):
            time.sleep(0.02)
        if not done.wait(delay) and started.keys() == {0, 1, 2, 3}:
            victim = random.Random(seed).choice(started[3])
            os.kill(victim, signal.SIGKILL)
            killed.append(victim)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        res = train_script(_args(universes, run), nproc=4, env=_env(faults), restarts=4,
                           on_start=started.__setitem__)
    finally:
        done.set()
        watcher.join(timeout=10)
    log = res.stdout + res.stderr
    (tmp_path / "faulted.log").write_text(log)
    context += f"; its output: {tmp_path / 'faulted.log'}"
    assert res.returncode == 0, f"{context}\n{log[-4000:]}"
    expected = set(range(4 + len(killed)))  # one attempt per fault, and the one that finished
    assert killed, f"{context}: the run ended before the outside kill"
    assert set(started) == expected, f"{context}: attempts {sorted(started)}, expected {sorted(expected)}\n" \
        f"{log[-3000:]}"

    want, got = _final_state(tmp_path / "reference"), _final_state(run)
    assert want["step"] == got["step"] == STEPS_PER_EPOCH * EPOCHS, context
    assert set(want) == set(got), f"{context}: keys differ: {sorted(set(want) ^ set(got))[:8]}"
    differ = [k for k in want if not _same(want[k], got[k])]
    assert not differ, f"{context}: {len(differ)} leaves differ from the uninterrupted run: {differ[:6]}"
    summary = json.loads((run / "summary.json").read_text())
    reference_summary = json.loads((tmp_path / "reference" / "summary.json").read_text())
    assert {k: v for k, v in summary.items() if k != "plots"} == \
        {k: v for k, v in reference_summary.items() if k != "plots"}, context
