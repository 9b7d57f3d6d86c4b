"""Hostile and mistaken configs (issue 36): each is one line naming the file or key, the value and what
would fit, with exit status 2 (a configuration error, which ``launch/slurm.sbatch`` never requeues),
no traceback, and nothing run or allocated on the way. Checked through ``cosmoflow.trainer.main``, the
entry of ``launch/train.py``, in process; one subprocess checks the real entry point's exit status."""

from __future__ import annotations

import dataclasses
import signal
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from cosmoflow import trainer
from cosmoflow.config import AT_LEAST, BELOW, Config, ConfigError, load_config

from forked import run_python

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _sigterm_restored():
    """``main`` ignores SIGTERM after a failure (``hybridpar.process.failure``); later children of this
    process would inherit that, so it is restored (as in test_failures.py)."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _fails(capsys, *argv: str) -> str:
    """``launch/train.py argv`` in process: exit 2 and one line on stderr, which is returned."""
    code = trainer.main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: "), err
    return lines[0]


def _write(tmp_path: Path, text: str, name: str = "cfg.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_python_tag_is_one_line_and_runs_nothing(tmp_path, capsys):
    sentinel = tmp_path / "ran"
    cfg = _write(tmp_path, f"run_dir: !!python/object/apply:os.system ['touch {sentinel}']\n")
    line = _fails(capsys, "--config", cfg)
    assert f"{cfg}: line 1" in line and "!!python/object/apply:os.system is not allowed" in line, line
    assert not sentinel.exists()
    other = _write(tmp_path, "data: {train: !include /etc/passwd}\n", "other.yaml")
    assert "the tag !include is not allowed" in _fails(capsys, "--config", other)
    assert "--set run_dir: line 1" in _fails(capsys, "--set", "run_dir=!!python/name:os.system")


def test_python_tag_exits_2_from_the_entry_point(tmp_path):
    """The real ``launch/train.py``: exit 2, so that slurm does not requeue a job that cannot start."""
    cfg = _write(tmp_path, "x: !!python/object/apply:os.system ['true']\n")
    out = run_python([str(ROOT / "launch/train.py"), "--config", cfg], timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"error: {cfg}: line 1, column 4: the tag !!python/object/apply:os.system is not allowed: a config "
        "holds plain values (numbers, strings, true/false, null, lists and mappings), never objects"]


def test_top_level_list_is_one_line(tmp_path, capsys):
    cfg = _write(tmp_path, "- run_dir: x\n- train: {epochs: 2}\n")
    line = _fails(capsys, "--config", cfg, "--set", "train.epochs=2")  # an override used to crash on it
    assert line == (f"error: {cfg}: the top level is a list; a config is a mapping of sections (run_dir, "
                    "data, model, train, ...) as in launch/configs/demo.yaml")


@pytest.mark.parametrize("assignment, expected", [
    ("model.dense=[a,b]", "model.dense[0]: expected int, got 'a' (default [128, 64])"),
    ("model.dense=[-4]", "model.dense[0]: -4 is out of range; it must be at least 1"),
    ("model.base_filters=0", "model.base_filters: 0 is out of range; it must be at least 1"),
    ("checkpoint.every_steps=-1",
     "checkpoint.every_steps: -1 is out of range; it must be at least 0 (0: no saves by step count)"),
    ("train.max_steps=-1", "train.max_steps: -1 is out of range; it must be at least 1"),
    ("train.max_steps=0", "train.max_steps: 0 is out of range; it must be at least 1"),
])
def test_bad_values_are_one_line(capsys, assignment, expected):
    assert _fails(capsys, "--set", assignment) == f"error: {expected}"


@pytest.mark.parametrize("assignment, match", [
    ("model.n_conv=-1", r"model.n_conv: -1 is out of range; it must be at least 1"),
    ("data.workers=-1", r"data.workers: -1 .* at least 0 \(0: read in the training process\)"),
    ("model.dropout=1", r"model.dropout: 1.0 is out of range; it must be below 1"),
    ("optimizer.base_lr=.nan", r"optimizer.base_lr: expected float, got nan"),
    ("optimizer.decay_factors=[0.5, -1]", r"optimizer.decay_factors\[1\]: -1.0 .* at least 0"),
    ("optimizer.decay_epochs=[5, 3]", r"decay_epochs: \[5.0, 3.0\] must increase"),
    ("train.seed=-3", r"train.seed: -3 .* at least 0"),
    ("train.epochs=true", r"train.epochs: expected int, got True"),
    ("data.augment=no", r"data.augment: expected str, got False"),
    ("run_dir=", r"run_dir: must not be empty"),
    ("checkpoint.keep_every=0", r"checkpoint.keep_every: 0 .* at least 1"),
    ("unet.smoothing=-2", r"unet.smoothing: -2.0 .* at least 0"),
    ("model=3", r"model: expected a mapping of keys to values, got 3"),
])
def test_every_field_is_type_and_range_checked(assignment, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [assignment])


def test_zero_means_off_where_documented():
    """0 stays valid where it means none or off; null where the type allows it."""
    cfg = load_config(None, ["data.workers=0", "checkpoint.every_steps=0", "checkpoint.every_minutes=null",
                             "train.precise_bn_batches=0", "optimizer.warmup_epochs=0", "model.dense=[]",
                             "train.max_steps=null", "logging.plots=0"])
    assert cfg.data.workers == 0 and cfg.checkpoint.every_steps == 0 and cfg.model.dense == []
    assert cfg.logging.plots is False


def test_bounds_name_real_fields():
    """Every key of the range tables is a field (a renamed field would silently lose its bound)."""
    cfg = Config()
    sections = [(s.name, getattr(cfg, s.name)) for s in dataclasses.fields(cfg)]
    names = {f"{name}.{f.name}" for name, section in sections if dataclasses.is_dataclass(section)
             for f in dataclasses.fields(section)}
    assert set(AT_LEAST) | set(BELOW) <= names


def test_alias_bomb_is_refused_quickly(tmp_path, capsys):
    """Nine levels of nine aliases (9^9 values from 350 bytes) are refused while parsing."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [{', '.join([f'*{prev}'] * 9)}]")
    cfg = _write(tmp_path, "\n".join(lines) + "\n")
    start = time.perf_counter()
    line = _fails(capsys, "--config", cfg)
    assert time.perf_counter() - start < 5
    assert line.startswith(f"error: {cfg}: line "), line
    assert "aliases expand to more than 10000 values" in line, line
    loop = _write(tmp_path, "model: &m {dense: *m}\n", "loop.yaml")
    assert "an alias refers to a value that contains it" in _fails(capsys, "--config", loop)
    deep = _write(tmp_path, "x: " + "[" * 3000 + "]" * 3000 + "\n", "deep.yaml")
    assert "nested too deeply" in _fails(capsys, "--config", deep)


def test_unreadable_files_are_one_line(tmp_path, capsys):
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00 not text")
    assert "not UTF-8 text" in _fails(capsys, "--config", str(binary))
    keys = _write(tmp_path, "1: 2\n", "keys.yaml")
    assert "config: key 1 is not a name" in _fails(capsys, "--config", keys)


def test_data_that_cannot_be_trusted_stops_training_in_one_line(tmp_path, capsys):
    """The data probes through the training entry: a 2 KB file declaring 64 GiB used to hang the run;
    it is one line naming the file, exit 2 (running again would not help)."""
    data = tmp_path / "data"
    data.mkdir()
    with h5py.File(data / "big.h5", "w") as f:
        f.create_dataset("full", shape=(2048, 2048, 2048, 4), dtype=np.int16, chunks=(16, 16, 16, 4))
        f.create_dataset("unitPar", data=np.zeros(4, np.float32))
    line = _fails(capsys, "--set", f"data.train={data}", "--set", f"data.val={data}", "--set",
                  f"run_dir={tmp_path / 'run'}", "--set", "data.sample_size=64", "--set", "model.n_conv=2",
                  "--set", "parallel={grid: {data: 1}}")
    assert line.startswith(f"error: {data / 'big.h5'}: dataset 'full': declares (2048, 2048, 2048, 4) int16 "
                           "(64.0 GiB) but stores 0 of its 2097152 chunks"), line
