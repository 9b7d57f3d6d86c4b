"""Recovery without a person: how long from a killed rank to the first new training step.

A tiny CosmoFlow run on 4 local ranks (data 2 x spatial 2) under ``torchrun --max-restarts 1``; once
it has taken ``--kill-after`` steps, one worker is SIGKILLed from outside. Measured from the kill:

* ``restart``: until the agent has torn the attempt down and started the new workers (torchrun's
  monitor interval, SIGTERM to the survivors, the spawn);
* ``resumed``: until rank 0 prints that it resumed (imports, process group, plan, checkpoint read);
* ``first_step``: until the first step after the resumed one is in ``metrics_steps.csv``.

Configurations, alternated round by round: checkpoints straight to the run directory (L3) or first to
node-local storage (``checkpoint.local_dir``, L1, which the restart reads first). Medians over rounds.

    python -m perf recovery [--rounds 3] [--kill-after 6]
"""

from __future__ import annotations

import csv
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from perf.common import ROOT, parse, parser, print_table, write_json

PHASES = ("restart", "resumed", "first_step")


def _universes(d: Path, size: int) -> None:
    for split, n, seed in (("train", 8, 1), ("val", 2, 2)):
        subprocess.run([sys.executable, "-m", "cosmoflow.generate", "--out", str(d / split), "--universes",
                        str(n), "--size", str(size), "--seed", str(seed)], check=True, capture_output=True,
                       cwd=ROOT)


def _command(data: Path, run: Path, local: Path | None, size: int) -> list[str]:
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", f"data.sample_size={size // 2}",
            "data.workers=0", "model.n_conv=2", "model.base_filters=8", "model.dense=[16]",
            "model.dropout=0.0", "data.augment=none",  # crops: the demo's periodic rolls need whole universes
            "train.epochs=2", "train.batch_size=4", f"run_dir={run}",
            "logging.progress=false", "logging.plots=false", "logging.tensorboard=false",
            "checkpoint.every_steps=2", "parallel={grid: {data: 2, pipe: 1, spatial: [2, 1, 1]}}"]
    if local is not None:
        sets.append(f"checkpoint.local_dir={local}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
            "--max-restarts=1", "--monitor-interval=0.1", str(ROOT / "launch/train.py"),
            "--config", str(ROOT / "launch/configs/demo.yaml"), *[a for s in sets for a in ("--set", s)]]


def _steps(run: Path) -> list[int]:
    path = run / "metrics_steps.csv"
    try:
        with path.open() as f:
            return [int(r["step"]) for r in csv.DictReader(f) if r.get("step", "").isdigit()]
    except (OSError, ValueError):
        return []


def _workers(agent: int) -> dict[int, int]:
    """torchrun agent ``agent``'s training processes now: pid -> restart attempt."""
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != agent:
                    continue
                env = [e for e in (d / "environ").read_bytes().split(b"\0")
                       if e.startswith(b"TORCHELASTIC_RESTART_COUNT=")]
                if env:
                    found[int(d.name)] = int(env[0].split(b"=")[1])
            except (OSError, IndexError, ValueError):
                continue
    return found


def one_recovery(data: Path, work: Path, local: bool, kill_after: int, size: int) -> dict[str, float]:
    """One run killed after ``kill_after`` steps; seconds from the kill to each phase."""
    run = work / "run"
    cmd = _command(data, run, work / "local" if local else None, size)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                            cwd=ROOT)
    marks: dict[str, float] = {}
    resumed_step: list[int] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("resumed from step"):
                marks["resumed"] = time.monotonic()
                resumed_step.append(int(line.split()[3]))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    while len(_steps(run)) < kill_after:
        if proc.poll() is not None:
            raise RuntimeError(f"the run ended before step {kill_after}")
        time.sleep(0.01)
    workers = sorted(_workers(proc.pid))
    t0 = time.monotonic()
    os.kill(workers[-1], signal.SIGKILL)
    while "restart" not in marks and proc.poll() is None:
        if 1 in _workers(proc.pid).values():
            marks["restart"] = time.monotonic()
        time.sleep(0.005)
    while proc.poll() is None and "first_step" not in marks:
        if resumed_step and any(s > resumed_step[0] for s in _steps(run)[-2:]):
            marks["first_step"] = time.monotonic()
        time.sleep(0.005)
    proc.wait(timeout=300)
    reader.join(timeout=5)
    if proc.returncode != 0 or set(marks) != set(PHASES):
        raise RuntimeError(f"recovery run failed (exit {proc.returncode}, saw {sorted(marks)})")
    return {k: marks[k] - t0 for k in PHASES}


TINY = {"rounds": 1}  # --tiny: one recovery of each kind (the run is tiny already)


def main(argv: list[str] | None = None) -> None:
    ap = parser("recovery", __doc__, rounds=3)
    ap.add_argument("--kill-after", type=int, default=5, help="steps taken before the kill")
    ap.add_argument("--size", type=int, default=16, help="universe edge (voxels); samples are half of it")
    args = parse(ap, argv, TINY)
    configs = {"L3 (run directory)": False, "L1 (checkpoint.local_dir)": True}
    samples: dict[str, dict[str, list[float]]] = {c: {p: [] for p in PHASES} for c in configs}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        _universes(data, args.size)
        for r in range(args.rounds):
            for name, local in configs.items():
                work = Path(tmp) / f"r{r}-{int(local)}"
                for k, v in one_recovery(data, work, local, args.kill_after, args.size).items():
                    samples[name][k].append(v)
    medians = {c: {p: statistics.median(v) for p, v in s.items()} for c, s in samples.items()}
    print_table(["checkpoints", *(f"{p} (s)" for p in PHASES)],
                [[c, *(round(m[p], 2) for p in PHASES)] for c, m in medians.items()],
                title=f"kill -> recovery, 4 ranks under torchrun --max-restarts 1, medians of {args.rounds}")
    write_json(args, {"medians_s": medians, "samples_s": samples})


if __name__ == "__main__":
    main()
