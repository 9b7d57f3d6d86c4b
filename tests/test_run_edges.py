"""Issue 46's edges of a run, each checked in process in well under a second (a subprocess each for
``--help`` and ``--help-config``): nothing is replaced that we did not write, and every failure is
one line.

* ``SplitHdf5``, which ``python -m cosmoflow.infer`` writes through: every file it will create (the
  rank files of a split write too) is checked before any work, an existing one refused without
  ``overwrite`` and a directory always, the file left as it was; a failure, in the loop or in the final
  rename, leaves no temporary or rank file; one writer writes one self-contained file, not a virtual
  dataset pointing into a rank file.
* ``cosmoflow.infer``'s command line: an output that is a directory (with ``--overwrite``) and an input
  that is a directory are one line each, exit 2, nothing written; the checkpointer's notes are one line
  each on rank 0; a checkpoint read on more ranks than saved it says once that its per-rank state was
  not needed (``restore.read_version``), where a resume that needs it still names the rank.
* ``launch/train.py``: ``--help`` and ``--help-config`` import no torch (the second reads the committed
  reference, in well under 2 s); ``--set`` reads a flow mapping typed without spaces as meant; the
  checks across keys fail before any process group or model exists.
* Rank files an earlier, more split write left beside the output (``out.rank0003.h5``): refused without
  ``overwrite``, removed with it once the new output is in place (and listed), nothing else touched.
* torchrun's error file (``TORCHELASTIC_ERROR_FILE``): an exception that escapes an entry point is
  recorded there by ``@record`` (``failure.run_main``), and ``cosmoflow.infer``'s one line for bad
  input is what the file names, with exit status 2.
* ``metrics_steps.csv``: a start from step 0 over an earlier start's rows sets them aside, says so in
  one line, and writes no step twice.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from cosmoflow import infer, trainer
from cosmoflow.config import load_config
from cosmoflow.metrics import Reporter
from cosmoflow.train_args import REFERENCE
from hybridpar.checkpoint.file_placement import RANK, rank_file
from hybridpar.checkpoint.restore import read_version
from hybridpar.checkpoint.tree import key_filter
from hybridpar.data.split_hdf5 import SplitHdf5, _remove_stale, check_targets, rank_files_beside
from hybridpar.plain_yaml import read_plain
from hybridpar.process import failure

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _sigterm_restored():
    """A failed entry point ignores SIGTERM afterwards (``hybridpar.process.failure``); restored."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_one_writer_writes_one_self_contained_file(tmp_path):
    """One process: the output holds the data itself (no virtual dataset, no rank file, no temporary)."""
    data = np.arange(2 * 1 * 4 * 3 * 2, dtype="float32").reshape(2, 1, 4, 3, 2)
    with SplitHdf5(tmp_path / "out.h5", "y", data.shape) as out:
        for n in range(2):
            out[n, :, 0:4, 0:3, 0:2] = data[n]
    assert _left(tmp_path) == ["out.h5"]
    with h5py.File(tmp_path / "out.h5") as f:
        assert not f["y"].is_virtual
        np.testing.assert_array_equal(f["y"][...], data)


def test_every_file_it_will_create_is_checked(tmp_path):
    """On 2 ranks (rank files): an existing rank file is refused without overwrite, left as it was;
    a directory in the output's or a rank file's place is refused even with overwrite."""
    out = tmp_path / "out.h5"
    part = tmp_path / "out.rank0001.h5"
    part.write_bytes(b"not ours")
    with pytest.raises(ValueError, match=r"rank file .*out\.rank0001\.h5 exists .*pass --overwrite") as err:
        check_targets(out, 2, "files", overwrite=False)
    assert "\n" not in str(err.value) and part.read_bytes() == b"not ours"
    check_targets(out, 2, "files", overwrite=True)
    with pytest.raises(ValueError, match=r"out\.rank0001\.h5 of an earlier split write exists"):
        check_targets(out, 1, "files", overwrite=False)  # one process writes none: an earlier write's
    part.unlink()
    part.mkdir()
    with pytest.raises(ValueError, match=r"rank file .*out\.rank0001\.h5 is a directory"):
        check_targets(out, 2, "files", overwrite=True)
    out.mkdir()
    with pytest.raises(ValueError, match=r"^output .*out\.h5 is a directory; name a file"):
        SplitHdf5(out, "y", (1, 1, 2, 2, 2), overwrite=True)
    assert _left(tmp_path) == ["out.h5", "out.rank0001.h5"]


def test_a_failure_leaves_no_temporary_file(tmp_path):
    """An error while writing, and a final rename that fails (a directory made in the output's place
    meanwhile), each remove every temporary file; the second is one line naming the output."""
    out = tmp_path / "out.h5"
    with pytest.raises(RuntimeError), SplitHdf5(out, "y", (1, 1, 2, 2, 2)) as w:
        w[0, :, 0:2, 0:2, 0:2] = np.zeros((1, 2, 2, 2), "float32")
        raise RuntimeError("the model failed")
    assert _left(tmp_path) == []
    with pytest.raises(ValueError, match=r"out\.h5") as err, SplitHdf5(out, "y", (1, 1, 2, 2, 2)) as w:
        w[0, :, 0:2, 0:2, 0:2] = np.zeros((1, 2, 2, 2), "float32")
        out.mkdir()
    assert "\n" not in str(err.value)
    assert _left(tmp_path) == ["out.h5"] and not any(out.iterdir())


@pytest.fixture()
def run_dir(tmp_path):
    """A reconstruct run's directory: its config alone (the checks below come before the checkpoint)."""
    cfg = load_config(None, ["task=reconstruct", "data.sample_size=8", "data.channels=1", "unet.width=4",
                             "unet.levels=3", "unet.max_width=8", "unet.groups=2",
                             "checkpoint.best_metric=val_loss", f"run_dir={tmp_path / 'run'}"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return tmp_path / "run"


def _one_line(capsys, code: int, pattern: str) -> None:
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: ") and pytest.importorskip("re").search(pattern, lines[0]), err


def test_infer_directories_are_one_line(run_dir, tmp_path, capsys):
    """``--overwrite`` onto a directory, and ``--input`` naming a directory: one line, exit 2, and
    nothing written beside the output."""
    folder = tmp_path / "outputs"
    (folder / "pred.h5").mkdir(parents=True)
    code = infer.main([str(run_dir), "--input", str(tmp_path / "in.h5"), "--output", str(folder / "pred.h5"),
                       "--overwrite"])
    _one_line(capsys, code, r"output .*pred\.h5 is a directory")
    assert _left(folder) == ["pred.h5"]
    code = infer.main([str(run_dir), "--input", str(folder), "--output", str(tmp_path / "new.h5")])
    _one_line(capsys, code, r"input .*outputs is a directory")
    assert not (tmp_path / "new.h5").exists()


def test_checkpoint_notes_are_one_line_each(run_dir, monkeypatch, capsys):
    """What the checkpointer warns while inference loads (a warning and its source line) is printed
    as one line each on rank 0."""
    note = ("checkpoint step_00000005: saved on 2 rank(s): its per-rank state (loader, rng) was not "
            "needed here")

    class Loads:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def load(self, step, keys):
            warnings.warn(note, stacklevel=2)
            return {"model": {}, "step": 5}

        def close(self) -> None:
            pass

    monkeypatch.setattr(infer, "Checkpointer", Loads)
    assert infer.load_model_state(run_dir, None, 0)["step"] == 5
    assert capsys.readouterr().err.splitlines() == [note]
    infer.load_model_state(run_dir, None, 1)
    assert capsys.readouterr().err == ""


def test_per_rank_state_not_needed_is_one_note():
    """A version saved on 2 ranks read on ranks 2 and 3: inference (model and step) gets one note,
    the same on every rank (so printed once), saying the per-rank state was not needed; a resume, which
    needs it, still names the rank."""
    body = {"name": "step_00000005", "layout": {"world": 2}, "order": [],
            "files": {rank_file(r): {"kind": RANK, "entries": ["rng", "loader"]} for r in range(2)}}
    infer_keys = key_filter(("model", "step"))
    notes = {n for r in (2, 3) for n in read_version(None, body, r, infer_keys)[1]}
    assert notes == {"saved on 2 rank(s): its per-rank state (loader, rng) was not needed here"}
    assert read_version(None, body, 2, key_filter(None))[1] == [
        "rank 2 did not exist when step_00000005 was saved (world 2): its per-rank entries are not restored"]


def test_help_imports_no_torch():
    """``launch/train.py --help`` answers from argparse alone: torch is not imported."""
    probe = ("import runpy, sys\nsys.argv = ['launch/train.py', '--help']\ntry:\n"
             "    runpy.run_path('launch/train.py', run_name='__main__')\nexcept SystemExit as e:\n"
             "    print('exit', e.code)\nprint('torch imported:', 'torch' in sys.modules)\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "--help-config" in res.stdout and "exit 0" in res.stdout, res.stdout + res.stderr
    assert "torch imported: False" in res.stdout, res.stdout


def test_flow_mapping_without_spaces():
    """``{data:1,spatial:[1,2,1]}`` is the mapping the user typed, not one key 'data:1'; quoted text,
    URLs and a glued key inside quotes are left as YAML reads them."""
    assert read_plain("{data:1,spatial:[1,2,1]}") == {"data": 1, "spatial": [1, 2, 1]}
    assert read_plain("grid: {data:-1, pipe:1}") == {"grid": {"data": -1, "pipe": 1}}
    assert read_plain("{a: 'x:y', url: http://h/p}") == {"a": "x:y", "url": "http://h/p"}
    assert read_plain("[a:b]") == ["a:b"]
    assert read_plain('{"k:z"}') == {"k:z": None}


def test_cross_checks_run_before_the_process_group(monkeypatch, capsys):
    """The grid against the world size, micro-batches against the batch and the split against the
    sample: one line each, exit 2, with no process group started and no model built."""
    def never(*args, **kwargs):
        raise AssertionError("reached the process group or the model")

    monkeypatch.setattr(trainer.hp, "init_distributed", never)
    monkeypatch.setattr(trainer, "build_network", never)
    _one_line(capsys, trainer.main(["--set", "parallel.grid={data:1,spatial:[1,2,1]}"]),
              r"parallel\.grid: data\(1\) \* pipe\(1\) \* spatial\(1\*2\*1\) = 2 != world size 1")
    _one_line(capsys, trainer.main(["--set", "parallel={grid:{data:1},pipeline:{microbatches:3}}",
                                    "--set", "train.batch_size=4"]),
              r"parallel\.pipeline\.microbatches: 3 does not divide the per-replica batch 4")
    monkeypatch.setattr(trainer, "launch_world_size", lambda: 4)
    _one_line(capsys, trainer.main(["--set", "parallel.grid={data:1,spatial:[4,1,1]}",
                                    "--set", "data.sample_size=2", "--set", "model.n_conv=1"]),
              r"parallel\.grid\.spatial: \[4, 1, 1\] splits the d dim in 4, but data\.sample_size is 2")


def test_start_from_scratch_sets_earlier_rows_aside(tmp_path, capsys):
    """An earlier start that died before its first checkpoint left steps 1-3: a new start from step 0
    moves them to metrics_steps.1.csv (one line says so) and writes step 1 once."""
    steps = tmp_path / "metrics_steps.csv"
    with steps.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss"])
        w.writerows([[s, 1.0] for s in (1, 2, 3)])
    reporter = Reporter(tmp_path, True, tensorboard=False, progress=False)
    line = reporter.start_afresh()
    assert capsys.readouterr().out.strip() == line and "metrics_steps.1.csv" in line, line
    reporter.step({"step": 1, "epoch": 0, "loss": 0.5}, 3)
    with steps.open() as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1"]
    with (tmp_path / "metrics_steps.1.csv").open() as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2", "3"]
    assert Reporter(tmp_path / "none", True, tensorboard=False, progress=False).start_afresh() is None


def test_help_config_imports_no_torch():
    """``launch/train.py --help-config`` prints the committed reference, under 2 s, without torch."""
    probe = ("import runpy, sys\nsys.argv = ['launch/train.py', '--help-config']\ntry:\n"
             "    runpy.run_path('launch/train.py', run_name='__main__')\nexcept SystemExit as e:\n"
             "    print('exit', e.code)\nprint('torch imported:', 'torch' in sys.modules)\n")
    started = time.monotonic()
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    took = time.monotonic() - started
    assert res.stdout.startswith(REFERENCE.read_text()), res.stdout[:300] + res.stderr
    assert res.stdout.endswith("exit 0\ntorch imported: False\n"), res.stdout[-300:] + res.stderr
    assert took < 2, f"--help-config took {took:.1f} s"


def _stale_folder(tmp_path: Path) -> Path:
    """A folder where a 4-rank write of out.h5 was: its rank files, and names that are not its rank files."""
    folder = tmp_path / "preds"
    folder.mkdir()
    for name in ("out.rank0000.h5", "out.rank0003.h5", "out.rank3.h5", "out.rank0001.h5.bak",
                 "other.rank0001.h5", "xout.rank0002.h5"):
        (folder / name).write_bytes(b"earlier")
    (folder / "out.rank0002.h5").mkdir()  # not a file: never removed
    return folder


def test_stale_rank_files_refused_without_overwrite(tmp_path):
    """A rank file of the output that this write would not create (one process writes none) is
    refused in one line without overwrite; every file is left as it was."""
    folder = _stale_folder(tmp_path)
    before = {p.name: p.is_dir() or p.read_bytes() for p in folder.iterdir()}
    assert [p.name for p in rank_files_beside(folder / "out.h5")] == [
        "out.rank0000.h5", "out.rank0002.h5", "out.rank0003.h5"]
    with pytest.raises(ValueError, match=r"rank file .*out\.rank0000\.h5 and 2 more of an earlier split "
                       r"write exists; pass --overwrite") as err:
        check_targets(folder / "out.h5", 1, "files", overwrite=False)
    assert "\n" not in str(err.value)
    assert {p.name: p.is_dir() or p.read_bytes() for p in folder.iterdir()} == before


def test_stale_rank_files_removed_with_overwrite(tmp_path):
    """With overwrite, one writer's self-contained output replaces the earlier write: its rank files go
    (listed in ``removed``), a directory under such a name and every other name stay; a split write keeps
    the rank files it wrote."""
    folder = _stale_folder(tmp_path)
    data = np.ones((1, 1, 2, 2, 2), "float32")
    with SplitHdf5(folder / "out.h5", "y", data.shape, overwrite=True) as out:
        out[0, :, 0:2, 0:2, 0:2] = data[0]
    assert [p.name for p in out.removed] == ["out.rank0000.h5", "out.rank0003.h5"]
    assert _left(folder) == ["other.rank0001.h5", "out.h5", "out.rank0001.h5.bak", "out.rank0002.h5",
                             "out.rank3.h5", "xout.rank0002.h5"]
    with h5py.File(folder / "out.h5") as f:
        np.testing.assert_array_equal(f["y"][...], data)
    for r in (0, 1, 3):
        (folder / f"out.rank{r:04d}.h5").write_bytes(b"x")
    removed = _remove_stale(folder / "out.h5", ["out.rank0000.h5", "out.rank0001.h5"])
    assert [p.name for p in removed] == ["out.rank0003.h5"]
    assert (folder / "out.rank0000.h5").exists() and (folder / "out.rank0001.h5").exists()


def test_infer_refuses_a_stale_rank_file(run_dir, tmp_path, capsys):
    """``cosmoflow.infer`` on one process over an earlier split write's rank file: one line, exit 2."""
    stale = tmp_path / "pred.rank0003.h5"
    stale.write_bytes(b"earlier")
    code = infer.main([str(run_dir), "--input", str(tmp_path / "in.h5"),
                       "--output", str(tmp_path / "pred.h5")])
    _one_line(capsys, code, r"rank file .*pred\.rank0003\.h5 of an earlier split write exists")
    assert stale.read_bytes() == b"earlier"


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # pytest's captured stderr has no fd
def test_run_main_records_what_escapes(run_dir, tmp_path, monkeypatch, capsys):
    """``failure.run_main`` (how launch/train.py, ``cosmoflow.infer`` and ``cosmoflow.reconstruct`` run): an
    exception the entry point lets escape is written to torchrun's error file by ``@record`` and ends
    with exit status 1; ``cosmoflow.infer``'s one line for bad input is what the file names, and its
    status 2 is passed on (``leave`` stubbed: it would end the process)."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    codes: list[int] = []

    class Left(BaseException):
        pass

    def leave(code: int) -> None:
        codes.append(code)
        raise Left

    def bug() -> int:
        raise RuntimeError("a bug nobody foresaw")

    monkeypatch.setattr(failure, "leave", leave)
    with pytest.raises(Left):
        failure.run_main(bug)
    recorded = json.loads(error_file.read_text())["message"]
    assert recorded["message"] == "RuntimeError: a bug nobody foresaw"
    assert "Traceback" in recorded["extraInfo"]["py_callstack"] and "a bug nobody" in capsys.readouterr().err
    error_file.unlink()
    (tmp_path / "in.h5").mkdir()
    with pytest.raises(Left):
        failure.run_main(lambda: infer.main([str(run_dir), "--input", str(tmp_path / "in.h5"),
                                             "--output", str(tmp_path / "pred.h5")]))
    lines = capsys.readouterr().err.strip().splitlines()
    assert codes == [1, 2] and len(lines) == 1 and "is a directory" in lines[0], lines
    assert json.loads(error_file.read_text())["message"]["message"] == lines[0]
