"""The run's reporting, without processes: a resumed run's CSV rows past its checkpoint go (no step
twice), the progress line redraws only on a terminal and is one plain line per ``every`` steps
otherwise, and a missing matplotlib or TensorBoard is said once, by the reporting rank only."""

from __future__ import annotations

import io
import re

import pytest

from cosmoflow import metrics
from cosmoflow.eta import Eta, duration
from cosmoflow.metrics import CsvLog, Reporter


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def _row(step: int, epoch: int = 0) -> dict:
    return {"step": step, "epoch": epoch, "loss": 1.0 / step, "lr": 0.1, "step_s": 0.5,
            "samples_per_s": 8.0, "gflops": 1.0, "data_wait_share": 0.1, "comm_share": 0.2}


def test_rewind_drops_rows_past_the_checkpoint(tmp_path):
    rep = Reporter(tmp_path, True, tensorboard=False, progress=False)
    for s in range(1, 7):
        rep.step(_row(s), 16)
    rep.epoch({"epoch": 1, "last_step": 4, "train_loss": 0.5, "val_loss": 0.4})
    rep.epoch({"epoch": 2, "last_step": 6, "train_loss": 0.3, "val_loss": 0.2})
    resumed = Reporter(tmp_path, True, tensorboard=False, progress=False)
    resumed.rewind(4)
    for s in range(5, 8):
        resumed.step(_row(s), 16)
    steps = CsvLog(tmp_path / "metrics_steps.csv").read()
    assert [int(r["step"]) for r in steps] == list(range(1, 8))
    assert list(steps[0]) == list(_row(1))  # the header survives the rewrite
    assert [r["last_step"] for r in CsvLog(tmp_path / "metrics_epochs.csv").read()] == ["4"]
    assert not (tmp_path / "metrics_steps.csv.tmp").exists()


def test_other_ranks_leave_the_files_alone(tmp_path):
    Reporter(tmp_path, True, tensorboard=False, progress=False).step(_row(3), 16)
    Reporter(tmp_path, False, tensorboard=False, progress=False).rewind(1)
    assert len(CsvLog(tmp_path / "metrics_steps.csv").read()) == 1


@pytest.mark.parametrize("tty", [True, False])
def test_progress_redraws_only_on_a_terminal(tmp_path, tty):
    out = _Stream(tty)
    rep = Reporter(tmp_path, True, tensorboard=False, progress=True, every=4, stream=out)
    for s in range(1, 11):
        rep.step(_row(s), 10)
    text = out.getvalue()
    if tty:
        assert text.count("\r") == 10 and "\n" not in text
    else:  # steps 4, 8 and the last one, each a line of its own
        assert "\r" not in text and text.count("\n") == 3
        assert re.findall(r"step (\d+)/10", text) == ["4", "8", "10"]


def test_missing_packages_are_said_once(tmp_path, monkeypatch, capsys):
    tensorboard = metrics.installed("tensorboard")
    monkeypatch.setattr(metrics, "installed", lambda package: False)
    Reporter(tmp_path, True, tensorboard=False, progress=False, plots=True)
    Reporter(tmp_path, False, tensorboard=False, progress=False, plots=True)  # another rank: quiet
    err = capsys.readouterr().err
    assert err.count("warning: no plots: matplotlib is not installed") == 1
    if not tensorboard:  # (its import fails for real)
        Reporter(tmp_path, True, tensorboard=True, progress=False)
        Reporter(tmp_path, False, tensorboard=True, progress=False)
        err = capsys.readouterr().err
        assert err.count("warning: no TensorBoard events") == 1 and "logging.tensorboard=false" in err


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_eta_counts_steps_at_this_runs_pace_and_validations_at_the_last_ones_length():
    """2 epochs of 4 steps, 1 s a step and 3 s a validation: after step 2 (pace from step 1 on) 6 steps
    and no validation length yet; after epoch 1's validation its 3 s count for the one left; the first
    step's warm-up and the validation's time stay out of the pace."""
    clock = _Clock()
    eta = Eta(8, 4, clock)
    clock.now += 50.0  # the first step's warm-up
    assert eta.step(1) is None
    clock.now += 1.0
    assert eta.step(2) == pytest.approx(6.0)
    assert [eta.validations_left(s) for s in (1, 4, 5, 8, 9)] == [2, 2, 1, 1, 0]
    for s in (3, 4):
        clock.now += 1.0
        eta.step(s)
    eta.validation_started()
    clock.now += 3.0
    assert eta.validation_ended() == pytest.approx(3.0)
    clock.now += 1.0
    assert eta.step(5) == pytest.approx(3 * 1.0 + 3.0)
    assert Eta(10, 4, clock).validations_left(9) == 1  # the cut last epoch: validated after step 10
    assert [duration(s) for s in (4.4, 65, 3725, float("nan"))] == ["4s", "1:05", "1:02:05", "?"]


@pytest.mark.parametrize("tty", [True, False])
def test_progress_and_validation_lines_count_epochs_from_1(tmp_path, tty, capsys):
    """The progress line shows the step's epoch from 1 of the run's epochs and the time left; each
    validation prints a start line and a result line (with its length) under the same number; on a
    terminal the redrawn line is ended once before them."""
    out, clock = _Stream(tty), _Clock()
    rep = Reporter(tmp_path, True, tensorboard=False, progress=True, stream=out, epochs=2,
                   steps_per_epoch=2, clock=clock)
    for s in (1, 2):
        clock.now += 1.0
        rep.step(_row(s, epoch=0), 4)
    rep.validating(1, 3)
    clock.now += 2.0
    rep.epoch({"epoch": 1, "last_step": 2, "train_loss": 0.5, "val_loss": 0.4})
    clock.now += 1.0
    rep.step(_row(3, epoch=1), 4)
    text = out.getvalue()
    assert re.findall(r"step (\d)/4 epoch (\d)/2 [^\r\n]* eta (\S+)", text) == [
        ("1", "1", "?"), ("2", "1", "2s"), ("3", "2", "3s")]
    assert text.count("\n") == (1 if tty else 3)  # a terminal's line ended once, before the validation
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "epoch 1: validating (3 batches)"
    assert printed[1] == "epoch 1: train loss 0.5000 val loss 0.4000 (validation 2s)"
