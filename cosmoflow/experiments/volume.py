"""Does training on larger volumes of the same universes measure cosmology better? One command::

    python -m cosmoflow.experiments.volume --config launch/configs/volume_study.yaml   (or make volume-study)

generates (or reuses) one set of synthetic universes, trains the same model family with the same
optimizer schedule and epochs on them at each input size of the config (crops of the universes, and
whole universes split over ranks), one run per size and seed, each under torchrun with the application's
own trainer (``launch/train.py``), and reports the validation MAE per parameter (crop sizes: the mean
prediction over a universe's crops) beside the predict-the-mean baseline: a markdown table (printed and
written next to the result file), a plot, and the result file (default
``perf/results/volume_study.json``). A run already finished with the same command and trainer config
is reused, an interrupted one resumes from its checkpoints, so the study can be stopped and started
again.

``--set KEY=VALUE`` changes the trainer config of every run (a fix tried at every size);
``--dry-run`` prints the plan (architectures, batches, grids, the commands) without running anything;
``--estimate STEPS`` times a few steps of every size and prints the projected time of the whole study.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from cosmoflow.config import ConfigError
from cosmoflow.data import open_dataset
from cosmoflow.experiments import reference
from cosmoflow.experiments.report import (
    UNITS,
    baseline,
    check_schema,
    plot,
    plot_curves,
    score_run,
    size_entry,
    table,
)
from cosmoflow.experiments.study import SizeRun, Study, load_study, prepare_data
from cosmoflow.metrics import CsvLog
from cosmoflow.model import count_parameters
from hybridpar.profiling.hostinfo import machine_info

TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train.py"


def architecture(study: Study, run: SizeRun) -> tuple[str, int]:
    """One line per size: the layers with the extent they produce, and the parameter count; the model
    is built by the trainer's own builder from the run's own config, so it is the one that trains."""
    import torch  # noqa: PLC0415

    from cosmoflow.model import build_network  # noqa: PLC0415 (the builder the trainer uses)

    cfg = study.trainer_config(run, study.seeds[0])
    model = build_network(cfg)
    branch = getattr(model, "spectrum", None)  # a P(k) branch: trunk and head around it
    probe = getattr(model, "probe", None)      # the reference's features and a ridge-started probe
    layers = [*model.trunk, *model.head] if branch is not None or probe is not None else list(model)
    x = torch.zeros(2, cfg.data.channels, run.size, run.size, run.size, device="meta")
    parts = [f"{cfg.data.channels}x{run.size}^3"]
    with torch.no_grad():
        for layer in layers:
            name = type(layer).__name__
            if x.dim() == 5 or name in ("Flatten",):
                x = layer.to("meta")(x)
            if name == "Conv3d":
                parts.append(f"conv{layer.kernel_size[0]} {layer.in_channels}->{layer.out_channels}")
            elif "Pool" in name:
                parts.append(f"{name.replace('3d', '').replace('Adaptive', 'global ')} -> {x.shape[-1]}^3"
                             if x.dim() == 5 else name)
            elif name == "Linear":
                if branch is not None and layer is model.head[0]:
                    parts.append(f"+ P(k) {len(branch.edges) - 1} shells x {cfg.data.channels}")
                if probe is not None and layer is model.head[0]:
                    parts.append(f"+ reference's {probe.in_features} features (ridge probe beside)")
                parts.append(f"dense {layer.in_features}->{layer.out_features}")
            elif name.startswith("BatchNorm"):
                parts.append(name)
    return " | ".join(parts), count_parameters(model)


def _command(study: Study, run: SizeRun, seed: int, run_dir: Path | None = None,
             extra: tuple[str, ...] = ()) -> list[str]:
    """torchrun (as ``python -m torch.distributed.run``) of the trainer for one size and seed."""
    run_dir = study.run_dir(run, seed) if run_dir is None else run_dir
    sets = [a for o in (*run.overrides(study, seed, run_dir), *extra) for a in ("--set", o)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.ranks}",
            str(TRAIN_SCRIPT), "--config", str(study.base_config()), *sets]


def _launch(cmd: list[str], log: Path, env: dict[str, str]) -> tuple[int, float]:
    """Run one trainer job with its output in ``log``; its exit code and wall time."""
    print(f"  torchrun {cmd[4]} {Path(cmd[5]).name} ... (log: {log})", flush=True)
    t0 = time.monotonic()
    with log.open("a") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    return rc, round(time.monotonic() - t0, 1)


def _failed(what: str, rc: int, log: Path) -> RuntimeError:
    tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
    return RuntimeError(f"{what} failed (exit {rc}); the end of {log}:\n{tail}")


def finished(study: Study, run: SizeRun, seed: int) -> bool:
    """Whether this size and seed's run finished with the study's current command and trainer config
    (its predictions and stamp exist and the stamp records the same settings): it is then reused."""
    run_dir = study.run_dir(run, seed)
    stamp = run_dir / "study_run.json"
    if not ((run_dir / "val_predictions.npz").exists() and stamp.exists()):
        return False
    settings = {"command": _command(study, run, seed), "training": study.base_config().read_text()}
    return {k: json.loads(stamp.read_text()).get(k) for k in settings} == settings


def part_of(spec: str) -> tuple[int, int]:
    """``"K/N"`` as (K, N), 1 <= K <= N: the K-th of N parts of a study's runs."""
    k, sep, n = spec.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ConfigError(f"--part {spec!r}: give K/N with 1 <= K <= N, e.g. --part 1/3")
    return int(k), int(n)


def share(total: int, part: tuple[int, int]) -> list[int]:
    """The runs (indices into the study's size-major list of ``total``) that part (K, N) runs: every N-th
    from the K-th, so each part gets a mix of sizes and the parts take about equal time."""
    k, n = part
    return list(range(k - 1, total, n))


def _train(study: Study, run: SizeRun, seed: int, env: dict[str, str]) -> dict[str, Any]:
    """One training run (reused when it already finished with the same command and trainer config); its
    record."""
    run_dir = study.run_dir(run, seed)
    cmd = _command(study, run, seed)
    stamp = run_dir / "study_run.json"
    settings = {"command": cmd, "training": study.base_config().read_text()}  # what makes a run this one
    if finished(study, run, seed):
        print(f"  reusing {run_dir} (finished with the same command and config)", flush=True)
        wall = json.loads(stamp.read_text()).get("wall_s")
    else:
        if stamp.exists():  # finished, but with other settings: its checkpoints must not be resumed
            print(f"  {run_dir} holds a run with other settings: starting it afresh", flush=True)
            shutil.rmtree(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # an interrupted run resumes from its checkpoints
        log = run_dir / "train.log"
        rc, wall = _launch(cmd, log, env)
        if rc != 0 or not (run_dir / "val_predictions.npz").exists():
            raise _failed(f"the {run.size}^3 run of seed {seed}", rc, log)
        stamp.write_text(json.dumps({**settings, "wall_s": wall}, indent=1))
    scores = score_run(run_dir, run.crops)
    return {"seed": seed, **scores, "crops": run.crops, "n_conv": run.n_conv, "batch_size": run.batch_size,
            "ranks": run.ranks, "grid": {"data": run.data, "spatial": list(run.spatial)},
            "run_dir": str(run_dir), "wall_s": wall}


def estimate(study: Study, steps: int, env: dict[str, str]) -> tuple[float, float]:
    """Time ``steps`` training steps of every size on the study's universes and project the whole study
    (seconds), from the median step and from the fastest (what a machine nobody else uses would give);
    a forward-only pass (validation, precise BN) is taken as a third of a step."""
    u, cfg = study.universes, study.trainer_config(study.runs[0], study.seeds[0])
    total = fastest = 0.0
    for run in study.runs:
        run_dir = Path(study.out) / "estimate" / str(run.size)
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        cmd = _command(study, run, study.seeds[0], run_dir,
                       (f"train.max_steps={steps}", "train.epochs=1", "checkpoint.every_steps=null"))
        rc, wall = _launch(cmd, run_dir / "train.log", env)
        rows = CsvLog(run_dir / "metrics_steps.csv").read()
        if rc != 0 or len(rows) < 2:
            raise _failed(f"timing {steps} steps at {run.size}^3", rc, run_dir / "train.log")
        times = [float(r["step_s"]) for r in rows]
        train_steps = u.train * run.crops // run.batch_size
        forward_steps = (u.val * run.crops / run.batch_size + cfg.train.precise_bn_batches) / 3 \
            / cfg.train.val_every  # a validation every val_every epochs, spread over them
        step_s, best_s = float(np.median(times[1:])), min(times[1:])  # the first step warms up
        start_s = max(wall - sum(times) - forward_steps * step_s, 0.0)  # what the timed run did besides
        epoch_s = (train_steps + forward_steps) * step_s
        per_run = start_s + cfg.train.epochs * epoch_s
        total += per_run * len(study.seeds)
        fastest += (start_s + cfg.train.epochs * (train_steps + forward_steps) * best_s) * len(study.seeds)
        print(f"  {run.size}^3: {step_s:.2f} s/step median ({step_s / study.batch_universes:.2f} s per "
              f"universe's voxels; fastest {best_s:.2f}), epoch ~{epoch_s:.0f} s with validation, run "
              f"~{per_run / 60:.1f} min", flush=True)
    print(f"projected study: ~{total / 60:.0f} min from the median steps, ~{fastest / 60:.0f} min from the "
          f"fastest, for {len(study.runs)} sizes x {len(study.seeds)} seeds (the universes exist now)",
          flush=True)
    return total, fastest


def _plan(study: Study) -> dict[int, tuple[str, int]]:
    """Print what will run; the architecture line and parameter count of each size."""
    u = study.universes
    archs = {}
    print(f"universes: {u.train} train + {u.val} validation, {u.size}^3 x {u.channels} channels "
          f"({u.split_dir('train')}, {u.split_dir('val')}); seeds {study.seeds}", flush=True)
    for run in study.runs:
        arch, n = archs[run.size] = architecture(study, run)
        grid = f"data {run.data} x spatial {'x'.join(map(str, run.spatial))}"
        print(f"{run.size}^3: {run.crops} crop(s)/universe, batch {run.batch_size} crops, {run.ranks} ranks "
              f"({grid}), {run.n_conv} conv/pool levels, {n:,} parameters\n    {arch}", flush=True)
    return archs


def run_study(study: Study, command: str, dry_run: bool = False, estimate_steps: int = 0,
              part: tuple[int, int] = (1, 1)) -> dict[str, Any] | None:
    """Run (or reuse) every size and seed and write the report; returns the result document (None for a
    dry run, an estimate, or a part whose study still has runs to do).

    ``part`` (K, N): run only every N-th (size, seed) run starting at the K-th, so that a study too long
    for one sitting is N commands; the report is written by whichever part finds every run finished."""
    archs = _plan(study)
    if dry_run:
        for run in study.runs:
            print(shlex.join(["python", *_command(study, run, study.seeds[0])[1:]]), flush=True)
        return None
    prepare_data(study)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if estimate_steps:
        estimate(study, estimate_steps, env)
        return None
    sizes: dict[str, Any] = {}
    pairs = [(r, s) for r in study.runs for s in study.seeds]
    total = len(pairs)
    mine = share(total, part)
    if part[1] > 1:
        print(f"part {part[0]}/{part[1]}: runs " + ", ".join(f"{pairs[i][0].size}^3 seed {pairs[i][1]}"
                                                              for i in mine), flush=True)
    records: dict[int, dict[str, Any]] = {}
    for i in mine:
        run, seed = pairs[i]
        print(f"[{i + 1}/{total}] {run.size}^3, seed {seed}", flush=True)
        records[i] = _train(study, run, seed, env)
    left = [f"{r.size}^3 seed {s}" for r, s in pairs if not finished(study, r, s)]
    if left:
        print(f"part {part[0]}/{part[1]} done; the report waits for the runs of the other parts: "
              + ", ".join(left), flush=True)
        return None
    for i, (run, seed) in enumerate(pairs):
        arch, n = archs[run.size]
        rec = records[i] if i in records else _train(study, run, seed, env)  # another part's: reused
        sizes.setdefault(str(run.size), []).append({**rec, "architecture": arch, "parameters": n})
        rec = sizes[str(run.size)][-1]
        print(f"  sigma_8 MAE {rec['mae']['sigma_8']:.4f}, Omega_m {rec['mae']['Omega_m']:.4f} "
              f"({rec['wall_s']} s)", flush=True)
    u = study.universes
    train_labels = open_dataset(u.split_dir("train"), channels=u.channels).labels
    val_labels = open_dataset(u.split_dir("val"), channels=u.channels).labels
    doc = {"sizes": {s: size_entry(recs) for s, recs in sizes.items()},
           "baseline": baseline(train_labels, val_labels), "command": command, "machine": machine_info(),
           "units": UNITS, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
    check_schema(doc)
    print("the power-spectrum reference (no network) on the same inputs:", flush=True)
    sizes_run = [r.size for r in study.runs]
    ref = reference.reference(u.split_dir("train"), u.split_dir("val"), sizes_run, u.channels, u.workers)
    cross = reference.reference(u.split_dir("train"), u.split_dir("val"), sizes_run, u.channels, u.workers,
                                cross=True) if u.channels > 1 else None
    write_report(doc, Path(study.results), ref, cross)
    return doc


def write_report(doc: dict[str, Any], results: Path, ref: dict[str, Any] | None = None,
                 cross: dict[str, Any] | None = None) -> None:
    """The result file, the references beside it (``_reference.json``; with the correlation between
    channels, ``_reference_cross.json``), the table (``.md``), the plot (``_mae.png``) and the learning
    curves (``_curves.png``); the table printed."""
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text(json.dumps(doc, indent=2) + "\n")
    for doc_ref, with_cross in ((ref, False), (cross, True)):
        if doc_ref is not None:
            reference.path_for(results, with_cross).write_text(json.dumps(doc_ref, indent=2) + "\n")
    text = table(doc, ref, cross)
    results.with_suffix(".md").write_text(text)
    print("\n" + text, flush=True)
    png = plot(doc, results.with_name(results.stem + "_mae.png"), ref, cross)
    print(f"plot: {png}" if png else "plot: none (matplotlib is not installed: pip install matplotlib); "
          "the table above holds the same numbers", flush=True)
    curves = plot_curves(doc, results.with_name(results.stem + "_curves.png"))
    if curves:
        print(f"learning curves: {curves}", flush=True)
    print(f"results: {results}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="python -m cosmoflow.experiments.volume",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="launch/configs/volume_study.yaml", help="the study's YAML")
    ap.add_argument("--out", help="directory for the universes' runs and logs (default: the config's out)")
    ap.add_argument("--results", help="the result JSON (default: the config's results); .md and _mae.png "
                    "are written beside it")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="override the trainer config of every run (repeatable), e.g. --set "
                         "model.batchnorm=true; give such a study its own --out and --results")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the commands; run nothing")
    ap.add_argument("--part", default="1/1", metavar="K/N",
                    help="run the K-th of N shares of the study's runs (every N-th, from the K-th); the "
                         "part that finds every run finished writes the report")
    ap.add_argument("--estimate", type=int, default=0, metavar="STEPS",
                    help="generate the universes, time STEPS training steps per size, print the projected "
                         "time of the whole study, and stop")
    args = ap.parse_args(argv)
    try:
        study = load_study(args.config, args.out, args.results, args.sets)
        run_study(study, " ".join(["python -m cosmoflow.experiments.volume", *argv]), args.dry_run,
                  args.estimate, part_of(args.part))
    except (ConfigError, RuntimeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2 if isinstance(err, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
