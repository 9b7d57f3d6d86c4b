"""What a run reports: a progress line, per-step and per-epoch metrics in CSV and TensorBoard, plots.

Why: a scientist watches a run live (progress bar on rank 0), compares runs later (CSV, TensorBoard
event files) and looks at what the model learned (loss curves, predicted against true per
parameter). CSV rows are appended and flushed as they come, so nothing is lost if the job dies; no
step's row is written twice: a run resumed from a checkpoint first drops the rows of the steps it will
run again, and a run that starts from step 0 where an earlier start left rows (it died before its first
checkpoint) sets those rows aside and starts the CSV files anew, saying so. The progress line
redraws itself on a terminal and is one plain line per ``every`` steps otherwise (log files, mpirun),
with the time left (:mod:`cosmoflow.eta`); each validation pass says when it starts and what it scored.
Epochs are counted from 1 in every line a person reads (the CSV files keep their own columns).
TensorBoard and matplotlib are optional: without them the run still writes CSV, and says so once.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from cosmoflow.eta import Eta, duration
from cosmoflow.universe import PARAM_NAMES

PARAMS = PARAM_NAMES  # the generator's order, the outputs' order


class CsvLog:
    """Append-only CSV whose columns are fixed by the first row."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: list[str] | None = None
        if path.exists() and path.stat().st_size:
            with path.open() as f:
                self.fields = next(csv.reader(f), None)

    def write(self, row: dict[str, Any]) -> None:
        new = not self.path.exists() or not self.path.stat().st_size
        if self.fields is None:
            self.fields = list(row)
        with self.path.open("a", newline="") as f:
            w = csv.DictWriter(f, self.fields, extrasaction="ignore")
            if new:
                w.writeheader()
            w.writerow(row)

    def read(self) -> list[dict[str, str]]:
        if not self.path.exists():
            return []
        with self.path.open() as f:
            return list(csv.DictReader(f))

    def truncate_after(self, column: str, last: int) -> int:
        """Drop the rows whose ``column`` is past ``last`` (atomically); returns how many went."""
        rows = self.read()
        keep = [r for r in rows if r.get(column) in (None, "") or float(r[column]) <= last]
        if len(keep) == len(rows):
            return 0
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w", newline="") as f:
            w = csv.DictWriter(f, self.fields or list(rows[0]), extrasaction="ignore")
            w.writeheader()
            w.writerows(keep)
        os.replace(tmp, self.path)
        return len(rows) - len(keep)


def _numbered(path: Path, n: int) -> Path:
    """``metrics_steps.csv`` -> ``metrics_steps.N.csv`` (as ``config.N.yaml`` keeps a run's configs)."""
    return path.with_name(f"{path.stem}.{n}{path.suffix}")


def warn(message: str) -> None:
    """One line on stderr (the reporter's, so rank 0's only)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def installed(package: str) -> bool:
    """Whether ``package`` can be imported (without importing it)."""
    return importlib.util.find_spec(package) is not None


class Reporter:
    """Rank 0's outputs: progress line, CSV, TensorBoard. Other ranks get a reporter that does nothing.

    ``plots``: whether the run will draw plots at its end (only to say now if matplotlib is missing).
    ``every``: without a terminal, the progress line is printed every this many steps.
    ``epochs``, ``steps_per_epoch``: the run's length, for the progress line's epoch count and time left.
    """

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, progress: bool, *,
                 plots: bool = False, every: int = 1, stream: TextIO | None = None, epochs: int = 0,
                 steps_per_epoch: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled, self.progress = enabled, progress and enabled
        self.run_epochs, self.steps_per_epoch, self.clock = epochs, steps_per_epoch, clock
        self.eta: Eta | None = None
        self.line_open = False  # a redrawn progress line not yet ended
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = max(int(every), 1)
        self.steps = CsvLog(run_dir / "metrics_steps.csv")
        self.epochs = CsvLog(run_dir / "metrics_epochs.csv")
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 (optional)

                self.tb = SummaryWriter(str(run_dir / "tensorboard"))
            except ImportError as err:
                warn(f"no TensorBoard events: {err} (pip install tensorboard, or set "
                     f"logging.tensorboard=false); the metrics still go to CSV")
        if enabled and plots and not installed("matplotlib"):
            warn("no plots: matplotlib is not installed (pip install matplotlib, or set logging.plots=false)")
        self.t0 = time.monotonic()

    def rewind(self, step: int) -> None:
        """A run resumed at ``step``: drop the rows of later steps (and epochs ended after it), which it
        runs again, so that no step appears twice."""
        if self.enabled:
            self.steps.truncate_after("step", step)
            self.epochs.truncate_after("last_step", step)

    def start_afresh(self, why: str = "no checkpoint to resume from") -> str | None:
        """A run starting from step 0 over a run directory whose CSV files hold an earlier start's rows
        (it saved no checkpoint, or ``checkpoint.resume`` is false): its steps run again, from new
        weights, so its rows are moved to ``metrics_steps.N.csv`` and ``metrics_epochs.N.csv`` (the
        first free N; nothing is deleted) and the CSV files start anew. Prints and returns the line
        that says so, with ``why`` the run starts from step 0 (None: nothing to set aside)."""
        if not self.enabled:
            return None
        logs = [log for log in (self.steps, self.epochs) if log.read()]
        if not logs:
            return None
        n = 1
        while any(_numbered(log.path, n).exists() for log in (self.steps, self.epochs)):
            n += 1
        moved = []
        for log in logs:
            rows = len(log.read())
            os.replace(log.path, _numbered(log.path, n))
            log.fields = None
            moved.append(f"{rows} row{'s' if rows != 1 else ''} of {log.path.name} to "
                         f"{_numbered(log.path, n).name}")
        line = f"starting the metrics anew from step 1 ({why}): moved {' and '.join(moved)}"
        print(line, flush=True)
        return line

    def step(self, row: dict[str, Any], total_steps: int) -> None:
        """Log one step's ``row`` (``epoch``: the epochs done before it, as the CSV keeps it)."""
        if not self.enabled:
            return
        if self.eta is None:
            self.eta = Eta(total_steps, self.steps_per_epoch or total_steps, self.clock)
        self.eta.total = total_steps
        left = self.eta.step(row["step"])
        self.steps.write(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"train/{k}", v, row["step"])
        if self.progress and (self.tty or row["step"] % self.every == 0 or row["step"] >= total_steps):
            self.stream.write(progress_line(row, total_steps, self.tty, left=left, epochs=self.run_epochs))
            self.stream.flush()
            self.line_open = self.tty

    def _end_line(self) -> None:
        if self.line_open:
            self.stream.write("\n")
            self.stream.flush()
            self.line_open = False

    def validating(self, epoch: int, batches: int) -> None:
        """Say that the validation after (1-based) ``epoch`` starts, over ``batches`` batches."""
        if self.eta is not None:
            self.eta.validation_started()
        if not self.enabled:
            return
        self._end_line()
        if self.progress:
            print(f"epoch {epoch}: validating ({batches} batch{'es' if batches != 1 else ''})", flush=True)

    def epoch(self, row: dict[str, Any], number: int | None = None) -> None:
        """Log a validation's ``row`` and print its result; ``number``: the 1-based epoch it followed,
        when that is not ``row["epoch"]`` (an epoch cut short by ``train.max_steps``)."""
        took = self.eta.validation_ended() if self.eta is not None else None
        if not self.enabled:
            return
        self.epochs.write(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "epoch" and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"val/{k}", v, row["epoch"])
            self.tb.flush()
        self._end_line()
        shown = row["epoch"] if number is None else number
        line = f"epoch {shown}: train loss {row['train_loss']:.4f} val loss {row['val_loss']:.4f}"
        if "val_mae" in row:
            maes = " ".join(f"{p}={row[f'mae_{p}']:.4f}" for p in PARAMS if f"mae_{p}" in row)
            line += f" val MAE {row['val_mae']:.4f} ({maes})"
        else:  # every other validation figure as it comes, e.g. the reconstruction's r(k) summaries
            line += "".join(f" {k[4:]} {v:.4f}" for k, v in row.items()
                            if k.startswith("val_") and k != "val_loss" and isinstance(v, float))
        if took is not None:
            line += f" (validation {duration(took)})"
        print(line, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def progress_line(row: dict[str, Any], total_steps: int, tty: bool, *, left: float | None = None,
                  epochs: int = 0) -> str:
    """One step's progress: redrawn in place (``\\r``) on a terminal, a whole line otherwise. The epoch
    shown is the one the step belongs to, from 1 (``row["epoch"]`` counts the epochs done before it);
    ``left``: seconds to the run's end (None: not known yet, after the first step)."""
    done = row["step"] / max(total_steps, 1)
    bar = "#" * int(30 * done)
    of = f"/{epochs}" if epochs else ""
    text = (f"[{bar:<30}] step {row['step']}/{total_steps} epoch {row['epoch'] + 1}{of} "
            f"loss {row['loss']:.4f} {row['samples_per_s']:.1f} samples/s {row['gflops']:.2f} GFLOP/s "
            f"data {100 * row['data_wait_share']:.0f}% comm {100 * row['comm_share']:.0f}% "
            f"eta {'?' if left is None else duration(left)}")
    return f"\r{text}  " if tty else f"{text}\n"


def mae(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """Mean absolute error per parameter (unitPar units), keyed by name (Omega_m, sigma_8, n_s, H_0)."""
    err = np.abs(np.asarray(pred, dtype=np.float64) - np.asarray(true, dtype=np.float64)).mean(axis=0)
    return {name: float(e) for name, e in zip(PARAMS, err)}


def mae_per_parameter(pred: np.ndarray, true: np.ndarray) -> dict[str, float]:
    """:func:`mae` under the metric names ``mae_<parameter>`` the logs and summaries use."""
    return {f"mae_{name}": e for name, e in mae(pred, true).items()}


def save_predictions(path: Path, pred: np.ndarray, true: np.ndarray, sample: np.ndarray,
                     dataset: Any) -> None:
    """Every validation sample's prediction and target, with where it came from, as ``.npz``.

    Why: a crop's prediction alone is not the fair score when a universe was cut into crops; the mean
    over all crops of one universe is (:mod:`cosmoflow.experiments.averaging`). ``path`` names the HDF5
    file each sample was read from, which for raw universes (cut into sub-cubes by ``sample_size``) is
    the universe itself, and ``local`` its sub-cube number there. Rows come in no particular order.
    """
    where = [dataset.locate(int(i)) for i in sample]
    np.savez(path, pred=np.asarray(pred, dtype=np.float64), true=np.asarray(true, dtype=np.float64),
             sample=np.asarray(sample, dtype=np.int64),
             path=np.asarray([e.path for e, _ in where], dtype=str),
             local=np.asarray([k for _, k in where], dtype=np.int64))


def plot_run(run_dir: Path, pred: np.ndarray | None, true: np.ndarray | None) -> list[Path]:
    """Loss curves and predicted-against-true scatter plots as PNG; nothing if matplotlib is absent."""
    try:
        import matplotlib  # noqa: PLC0415 (optional)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return []
    out = []
    steps = CsvLog(run_dir / "metrics_steps.csv").read()
    epochs = CsvLog(run_dir / "metrics_epochs.csv").read()
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([int(r["step"]) for r in steps], [float(r["loss"]) for r in steps], lw=0.8,
                label="train (step)")
        if epochs:
            ax.plot([int(r["last_step"]) for r in epochs], [float(r["val_loss"]) for r in epochs], "o-",
                    label="validation (epoch)")
        ax.set(xlabel="step", ylabel="MSE loss", yscale="log", title="training")
        ax.legend()
        fig.tight_layout()
        out.append(run_dir / "plots" / "loss.png")
        out[-1].parent.mkdir(exist_ok=True)
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    if pred is not None and true is not None:
        fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
        for i, (ax, name) in enumerate(zip(axes, PARAMS)):
            ax.scatter(true[:, i], pred[:, i], s=6, alpha=0.6)
            ax.plot([-1.2, 1.2], [-1.2, 1.2], "k--", lw=0.7)
            ax.set(title=name, xlabel="true (unitPar)", ylabel="predicted", xlim=(-1.2, 1.2),
                   ylim=(-1.2, 1.2))
        fig.tight_layout()
        out.append(run_dir / "plots" / "predicted_vs_true.png")
        out[-1].parent.mkdir(exist_ok=True)
        fig.savefig(out[-1], dpi=120)
        plt.close(fig)
    return out
