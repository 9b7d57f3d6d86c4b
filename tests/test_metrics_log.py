"""The run's reporting, without processes: a resumed run's CSV rows past its checkpoint go (no step
twice), the progress line redraws only on a terminal and is one plain line per ``every`` steps
otherwise, and a missing matplotlib or TensorBoard is said once, by the reporting rank only."""

from __future__ import annotations

import io
import re

import pytest

from cosmoflow import metrics
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
