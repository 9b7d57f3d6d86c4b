"""The training application: config validation (no processes), and launch/train.py end to end on 2
ranks started as torchrun starts them (``distributed.train_script``), on a tiny synthetic set with a
spatial split: metrics, checkpoints and summary are written, a second start resumes from the newest
checkpoint, and bad input is a one-line error."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest
import torch

from cosmoflow.config import ConfigError, load_config
from cosmoflow.model import build_model_from_export
from hybridpar.checkpoint.faults import ENV

from distributed import ROOT, tiny_universes, train_script
from forked import run_python


def test_unknown_key_suggests_nearest():
    with pytest.raises(ConfigError, match=r"train: unknown key 'epoch' \(did you mean 'epochs'\?\)"):
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
    return tiny_universes(tmp_path_factory.mktemp("universes"))


def _args(data: Path, run: Path, *extra: str) -> list[str]:
    sets = [f"data.train={data / 'train'}", f"data.val={data / 'val'}", "data.sample_size=8",
            "data.workers=0", "model.n_conv=2", "model.base_filters=4", "model.dense=[8]",
            "model.dropout=0.0", "data.augment=none",  # crops: the demo's periodic rolls need whole universes
            "train.batch_size=4", f"run_dir={run}", "logging.progress=false", "logging.plots=false",
            "logging.tensorboard=false", "checkpoint.every_steps=3",
            "parallel={grid: {data: 1, pipe: 1, spatial: [2, 1, 1]}}", *extra]
    return ["--config", str(ROOT / "launch/configs/demo.yaml"), *[a for s in sets for a in ("--set", s)]]


# Warm-up over the first half epoch, decay by 10 from epoch 1.5: both edges fall inside the two epochs
# (8 steps each) of the resume test, and so does each epoch's last step.
SCHEDULE = ("optimizer.base_lr=0.08", "optimizer.base_batch=64", "optimizer.warmup_epochs=0.5",
            "optimizer.decay_epochs=[1.5]", "optimizer.decay_factors=[0.1]")


def _expected_lr(step: int) -> float:
    """The rate of the step after ``step`` done, written out: from 0.08 to 0.08 * 4 / 64 over 4 steps,
    then that peak until step 12, then a tenth of it."""
    peak = 0.08 * 4 / 64
    if step < 4:
        return 0.08 + (peak - 0.08) * step / 4
    return peak if step < 12 else peak * 0.1


def test_train_resume_and_outputs(tiny_data, tmp_path):
    """Also pins every step's learning rate over both epochs (the first run and its resumed second),
    the epochs' last steps included."""
    run = tmp_path / "run"
    first = train_script(_args(tiny_data, run, "train.epochs=1", *SCHEDULE))
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert set(summary["baseline"]) == {"mae_Omega_m", "mae_sigma_8", "mae_n_s", "mae_H_0"}
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 8   # 32 samples / batch 4
    assert "validation MAE per parameter" in first.stdout
    banner = [line for line in first.stdout.splitlines() if line.startswith("layout: ")]
    assert len(banner) == 3 and "spatial(2*1*1) = 2 ranks" in banner[0], first.stdout[:2000]
    layout = (run / "layout.txt").read_text()  # the explain table, rank 0's only
    assert "halo d h w" in layout and "Conv3d" in layout and "2x1x1" in layout
    second = train_script(_args(tiny_data, run, "train.epochs=2", *SCHEDULE))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 8" in second.stdout
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 16
    with open(run / "metrics_steps.csv") as f:
        rates = {int(r["step"]): float(r["lr"]) for r in csv.DictReader(f)}
    assert sorted(rates) == list(range(1, 17))
    for step, lr in rates.items():  # the row of step s is the step run after s - 1 were done
        assert lr == pytest.approx(_expected_lr(step - 1), rel=1e-12), (step, lr, _expected_lr(step - 1))
    assert (run / "config.yaml").exists() and (run / "config.1.yaml").exists()   # nothing overwritten
    done = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    again = train_script(_args(tiny_data, run, "train.epochs=2", *SCHEDULE))  # a finished run started again
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from step 16" in again.stdout and "validation MAE per parameter" in again.stdout
    assert json.loads((run / "summary.json").read_text()) == done
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 16


def _scores(run: Path, keys: tuple[str, ...] = ("val_", "mae_", "step", "epoch")) -> dict[str, float]:
    """The run's summary entries whose names start with one of ``keys``."""
    summary = json.loads((run / "summary.json").read_text())
    return {k: v for k, v in summary.items() if k.startswith(keys)}


def _version_steps(run: Path, capsys) -> list[int]:
    """The steps of the versions ``python -m hybridpar.checkpoint ls RUN`` lists, oldest first."""
    from hybridpar.checkpoint.__main__ import main as checkpoint_cli

    capsys.readouterr()
    assert checkpoint_cli(["ls", str(run)]) == 0
    return [int(row.split()[1]) for row in capsys.readouterr().out.splitlines()[2:]]


def test_killed_in_the_last_validation_resumes_to_the_same_report(tiny_data, tmp_path, capsys):
    """Killed while validating after the last step (its step-8 checkpoint saved: validation waits a
    second first, so the overlapped write is done; the epoch's validation not): the resumed run trains
    no step, validates, and reports what the uninterrupted run did. Step 8 is saved twice in each run
    (every 4 steps, then after the validation): one version of it remains, the later, with the
    metrics."""
    sets = ("train.epochs=1", "checkpoint.every_steps=4")
    whole = train_script(_args(tiny_data, tmp_path / "whole", *sets))
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = train_script(_args(tiny_data, tmp_path / "cut", *sets),
                          env={ENV: "validate:sleep1,validate:kill"})
    assert killed.returncode != 0 and not (tmp_path / "cut" / "summary.json").exists()
    resumed = train_script(_args(tiny_data, tmp_path / "cut", *sets))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 8 (epoch 1 trained, its validation next)" in resumed.stdout, resumed.stdout
    assert _scores(tmp_path / "cut") == _scores(tmp_path / "whole")
    for run in ("whole", "cut"):
        assert _version_steps(tmp_path / run, capsys) == [4, 8], run


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    run = tmp_path / "run"
    res = train_script(_args(tiny_data, run, "train.epochs=2", "optimizer.base_lr=1e38",
                          "optimizer.warmup_epochs=0", "checkpoint.every_steps=1"))
    assert res.returncode != 0
    assert "non-finite" in res.stderr or "loss is nan" in res.stderr, res.stderr[-3000:]
    assert "step None" not in res.stderr and "lower optimizer.base_lr" in res.stderr, res.stderr[-3000:]
    assert re.search(r"on the batch of \S+/univ_s1_\d+\.h5: sample \d", res.stderr), res.stderr[-3000:]
    listing = run_python(["-m", "hybridpar.checkpoint", "verify", str(run / "checkpoints")])
    assert listing.returncode == 0, listing.stdout + listing.stderr


def test_missing_data_is_a_one_line_error(tmp_path):
    one_rank = "parallel={grid: {data: 1, pipe: 1, spatial: [1, 1, 1]}}"  # the layout is checked first
    res = train_script(_args(tmp_path / "nowhere", tmp_path / "run", "train.epochs=1", one_rank), nproc=1,
                       timeout=120)
    assert res.returncode != 0
    assert "error:" in res.stderr and "nowhere" in res.stderr


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_data_parallel_resume_is_bit_identical(tiny_data, tmp_path):
    """data = 2 with BatchNorm in the body and the head, precise-BN re-estimation off (it would hide
    replicas' diverging running statistics): a run killed by SIGKILL in its step-6 save (mid-epoch;
    the newest checkpoint is step 3) and then resumed validates bit-identically to the uninterrupted
    run, reports the same train loss for the interrupted epoch (over all its steps), and lists every
    step once in metrics_steps.csv with the same losses. Both runs' progress goes to a pipe: plain
    lines, no carriage returns."""
    sets = ("train.epochs=2", "model.batchnorm=true", "model.head_norm=true", "train.precise_bn_batches=0",
            "parallel={grid: {data: 2, pipe: 1, spatial: [1, 1, 1]}}", "logging.progress=true")
    whole = train_script(_args(tiny_data, tmp_path / "whole", *sets))
    assert whole.returncode == 0, whole.stderr[-3000:]
    killed = train_script(_args(tiny_data, tmp_path / "cut", *sets), env={ENV: "snapshot:kill:6"})
    assert killed.returncode != 0 and len(_rows(tmp_path / "cut" / "metrics_steps.csv")) == 6
    resumed = train_script(_args(tiny_data, tmp_path / "cut", *sets))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 3" in resumed.stdout
    assert _scores(tmp_path / "cut", ("val_", "mae_")) == _scores(tmp_path / "whole", ("val_", "mae_"))
    def columns(name: str, *cols: str) -> list[list[tuple[str, ...]]]:
        return [[tuple(r[c] for c in cols) for r in _rows(tmp_path / d / name)] for d in ("whole", "cut")]

    epochs = columns("metrics_epochs.csv", "epoch", "train_loss", "val_loss")
    assert epochs[0] == epochs[1] and len(epochs[0]) == 2
    steps = columns("metrics_steps.csv", "step", "loss")
    assert steps[0] == steps[1] and [int(s) for s, _ in steps[1]] == list(range(1, 17))
    for run in (whole, resumed):
        assert "\r" not in run.stderr and "step 16/16 epoch 2/2 " in run.stderr
        assert re.search(r"step 16/16 epoch 2/2 .* eta \S+\n", run.stderr), run.stderr[-2000:]
        validation = r"^epoch 2: validating \(\d+ batch(es)?\)\nepoch 2: train loss .*\(validation \S+\)$"
        assert re.search(validation, run.stdout, re.MULTILINE), run.stdout[-2000:]


def test_augmented_training_rolls_whole_universes_only(tiny_data, tmp_path):
    """data.augment: the cube's symmetries and periodic rolls train on whole universes split over two
    ranks; asking for rolls of crops is one configuration error naming the key."""
    run = tmp_path / "run"
    ok = train_script(_args(tiny_data, run, "train.epochs=1", "data.sample_size=16",
                            "data.augment=symmetries+shifts"))
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (run / "metrics_steps.csv").read_text().count("\n") == 1 + 1   # 4 universes / batch 4
    bad = train_script(_args(tiny_data, tmp_path / "bad", "data.augment=symmetries+shifts"))
    errors = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]   # once per job
    assert bad.returncode != 0 and 2 in bad.codes, (bad.codes, bad.stderr[-3000:])   # a config error
    assert len(errors) == 1 and "data.augment: symmetries+shifts rolls samples periodically" in errors[0]


def test_init_from_exported_weights(tiny_data, tmp_path):
    """Weights go both ways: a run's checkpoint exported as safetensors starts another run
    (``model.init_from``), which at learning rate 0 ends with exactly those weights; a file of another
    model is one line with exit 2."""
    from safetensors.torch import load_file

    from hybridpar.checkpoint.__main__ import main as checkpoint_cli

    first = train_script(_args(tiny_data, tmp_path / "a", "train.epochs=1"))
    assert first.returncode == 0, first.stderr[-3000:]
    exported = tmp_path / "a.safetensors"
    assert checkpoint_cli(["export", str(tmp_path / "a"), str(exported), "--format", "safetensors"]) == 0
    frozen = ("optimizer.base_lr=0.0", "optimizer.momentum=0.0", "train.epochs=1")
    second = train_script(_args(tiny_data, tmp_path / "b", f"model.init_from={exported}", *frozen))
    assert second.returncode == 0, second.stderr[-3000:]
    again = tmp_path / "b.safetensors"
    assert checkpoint_cli(["export", str(tmp_path / "b"), str(again), "--format", "safetensors"]) == 0
    want, got = load_file(str(exported)), load_file(str(again))
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    rebuilt = build_model_from_export(exported).state_dict()  # from the file alone: its config, its weights
    assert set(rebuilt) == set(want) and all(torch.equal(rebuilt[k], v) for k, v in want.items())
    other = train_script(_args(tiny_data, tmp_path / "c", f"model.init_from={exported}", "model.dense=[16]"))
    # each rank meets the error and exits 2, or is stopped (SIGTERM, as torchrun stops it) once another
    # did: which one depends on the machine's load
    assert 2 in other.codes and set(other.codes) <= {2, -15}, (other.codes, other.stderr[-3000:])
    lines = [ln for ln in other.stderr.splitlines() if "model.init_from" in ln]
    assert len(lines) == 1 and "holds another model than this config builds" in lines[0], other.stderr[-3000:]
    assert "Traceback" not in other.stderr, other.stderr[-3000:]
