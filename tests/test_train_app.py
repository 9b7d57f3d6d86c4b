"""The training application: config validation (no processes), and launch/train.py end to end under
torchrun on a tiny synthetic set (2 ranks, spatial split): metrics, checkpoints and summary are
written, a second start resumes from the newest checkpoint, and bad input is a one-line error."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cosmoflow.config import ConfigError, load_config

from distributed import ROOT, train_script


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match="'train.epoch'; did you mean 'epochs'"):
        load_config(None, ["train.epoch=3"])


def test_bad_values_say_what_fits(tmp_path):
    with pytest.raises(ConfigError, match="expected int"):
        load_config(None, ["train.epochs=many"])
    with pytest.raises(ConfigError, match="fits n_conv in"):
        load_config(None, ["data.sample_size=48", "model.n_conv=5"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.epochs"])


def test_overrides_reach_typed_fields():
    cfg = load_config(ROOT / "launch/configs/demo.yaml", ["train.epochs=3", "model.dense=[8, 4]",
                                                         "logging.plots=false"])
    assert cfg.train.epochs == 3 and cfg.model.dense == [8, 4] and cfg.logging.plots is False
    assert load_config(ROOT / "launch/configs/cosmoflow_128.yaml").data.sample_size == 128


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("universes")
    for split, n, seed in (("train", 4, 1), ("val", 2, 2)):
        subprocess.run([sys.executable, "-m", "cosmoflow.generate", "--out", str(d / split), "--universes",
                        str(n), "--size", "16", "--seed", str(seed)],
                       check=True, capture_output=True, cwd=ROOT)
    return d


def _args(data: Path, run: Path, *extra: str) -> list[str]:
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", "data.sample_size=8",
            "data.workers=0", "model.n_conv=2", "model.base_filters=4", "model.dense=[8]",
            "model.dropout=0.0",
            "train.batch_size=4", f"run_dir={run}", "logging.progress=false", "logging.plots=false",
            "logging.tensorboard=false", "checkpoint.every_steps=3",
            "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}}", *extra]
    return ["--config", str(ROOT / "launch/configs/demo.yaml"), *[a for s in sets for a in ("--set", s)]]


def test_train_resume_and_outputs(tiny_data, tmp_path):
    run = tmp_path / "run"
    first = train_script(_args(tiny_data, run, "train.epochs=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["baseline"]) == {"mae_Omega_m", "mae_sigma_8", "mae_n_s", "mae_H_0"}
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 8   # 32 samples / batch 4
    assert "validation MAE per parameter" in first.stdout
    second = train_script(_args(tiny_data, run, "train.epochs=2"))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 8" in second.stdout
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 16
    assert (run / "config.yaml").exists() and (run / "config.1.yaml").exists()   # nothing overwritten


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    res = train_script(_args(tiny_data, run, "train.epochs=2", "optimizer.base_lr=1e38",
                          "optimizer.warmup_epochs=0", "checkpoint.every_steps=1"))
    assert res.returncode != 0
    assert "non-finite" in res.stderr or "loss is nan" in res.stderr, res.stderr[-3000:]
    assert "step None" not in res.stderr and "lower optimizer.base_lr" in res.stderr, res.stderr[-3000:]
    assert re.search(r"on the batch of \S+/univ_s1_\d+\.h5: sample \d", res.stderr), res.stderr[-3000:]
    listing = subprocess.run([sys.executable, "-m", "hybridpar.checkpoint", "verify",
                              str(run / "checkpoints")], capture_output=True, text=True, cwd=ROOT)
    assert listing.returncode == 0, listing.stdout + listing.stderr


def test_missing_data_is_a_one_line_error(tmp_path):
    res = train_script(_args(tmp_path / "nowhere", tmp_path / "run", "train.epochs=1"), nproc=1, timeout=120)
    assert res.returncode != 0
    assert "error:" in res.stderr and "nowhere" in res.stderr
