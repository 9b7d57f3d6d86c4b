"""The Checkpointer in one plain process (no process group): round trip, lineage metadata, fallback past
damaged or incomplete versions, retention, the overlapped copy, L1 + L3 levels, and the CLI. Each test
checks what ``load``/``versions``/``latest`` or the directory tree say against what was saved."""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_checkpoint_units import _same, nested_state

from hybridpar.checkpoint import Checkpointer, CheckpointError, faults, keys_of
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.__main__ import main as cli
from hybridpar.checkpoint.faults import ENV

from forked import run_python

pytestmark = pytest.mark.timeout(60)


def _state(step: int) -> dict:
    s = nested_state()
    s["model"]["conv.weight"] += step
    s["step"] = step
    return s


def _dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if mf.parse_name(p.name))


def _newest(root: Path) -> Path:
    return root / _dirs(root)[-1]


def test_round_trip_versions_and_lineage(tmp_path):
    with Checkpointer(tmp_path, keep_last=None, config={"lr": 0.1}) as ck:
        assert ck.load() is None and ck.latest() is None
        for step in (5, 10):
            ck.save(step, _state(step), {"epoch": step // 5, "metrics": {"mae": 1.0 / step}})
        ck.wait()
        assert ck.latest() == 10
        v = ck.versions()
        assert [x.step for x in v] == [5, 10] and all(x.levels == ("L3",) for x in v)
        assert v[1].epoch == 2 and v[1].metrics == {"mae": 0.1} and v[1].parent == v[0].name
        assert v[0].parent is None and v[0].metadata["config_hash"] and "code_version" in v[0].metadata
        assert v[1].bytes == sum(f.stat().st_size for f in (tmp_path / v[1].name).glob("*.bin"))
        _same(_state(10), ck.load())
        _same(_state(5), ck.load(5))
        part = ck.load(keys=["model/fc.bias", "step"])
        _same({"model": OrderedDict([("fc.bias", _state(5)["model"]["fc.bias"])]), "step": 10}, part)
        assert set(keys_of(part)) == {"model/fc.bias", "step"}
        with pytest.raises(CheckpointError, match="no checkpoint of step 7"):
            ck.load(7)
    # a new run resuming from the newest version records it as its parent
    with Checkpointer(tmp_path, keep_last=None) as ck2:
        ck2.load()
        ck2.save(11, _state(11))
        ck2.wait()
        assert ck2.versions()[-1].parent == v[1].name


def _damage(kind: str, vdir: Path) -> None:
    f = vdir / "stage-000.bin"
    if kind == "truncated":
        os.truncate(f, f.stat().st_size - 100)
    elif kind == "flipped":
        data = bytearray(f.read_bytes())
        data[20] ^= 0x10
        f.write_bytes(data)
    elif kind == "no-manifest":
        (vdir / mf.MANIFEST).unlink()
    elif kind == "bad-manifest":
        raw = (vdir / mf.MANIFEST).read_bytes()
        (vdir / mf.MANIFEST).write_bytes(raw.replace(b'"bytes": ', b'"bytes": 1'))


@pytest.mark.parametrize("kind,says", [("truncated", "truncated"), ("flipped", "fails its checksum"),
                                       ("no-manifest", "no manifest"), ("bad-manifest", "checksum")])
def test_damaged_newest_falls_back_with_a_warning(tmp_path, kind, says):
    with Checkpointer(tmp_path, keep_last=None) as ck:
        for step in (1, 2):
            ck.save(step, _state(step))
        ck.wait()
        _damage(kind, _newest(tmp_path))
        with pytest.warns(UserWarning, match=says):
            got = ck.load()
        _same(_state(1), got)
        if kind in ("no-manifest", "bad-manifest"):
            assert ck.latest() == 1 and [v.step for v in ck.versions()] == [1]
        else:
            with pytest.raises(CheckpointError, match=says):
                ck.load(2)
        # and every version damaged: an error, not a silent fresh start
        _damage("flipped" if kind == "flipped" else "truncated", tmp_path / _dirs(tmp_path)[0])
        if kind in ("truncated", "flipped"):
            with pytest.raises(CheckpointError, match="no intact checkpoint"):
                ck.load()


def _hold(monkeypatch, point: str, step: int) -> tuple[threading.Event, threading.Event, threading.Event]:
    """Stop the writer thread at fault point ``point`` of ``step`` until the test sets ``release``:
    an order the test controls instead of a sleep it must outrun. ``reached``: the writer got there;
    ``expired``: nobody released it within 20 s (the writer then fails the save)."""
    reached, release, expired = threading.Event(), threading.Event(), threading.Event()
    hit = faults.hit

    def held(p: str, s: int, rank: int = 0) -> None:
        if (p, s) == (point, step):
            reached.set()
            if not release.wait(20):
                expired.set()
                raise OSError(f"the test never released {point} of step {step}")
        hit(p, s, rank)

    monkeypatch.setattr(faults, "hit", held)
    return reached, release, expired


def test_latest_never_names_a_version_being_written(tmp_path, monkeypatch):
    with Checkpointer(tmp_path) as ck:
        ck.save(1, _state(1))
        ck.wait()
        reached, release, _ = _hold(monkeypatch, "manifest", 2)
        ck.save(2, _state(2))
        assert reached.wait(10)
        assert list(tmp_path.glob("*/.MANIFEST.json.*.tmp"))  # all files written, manifest not yet
        assert ck.latest() == 1 and [v.step for v in ck.versions()] == [1]
        release.set()
        ck.wait()
        assert ck.latest() == 2


def test_a_failed_save_is_reported_and_the_next_one_works(tmp_path, monkeypatch):
    with Checkpointer(tmp_path, keep_last=None) as ck:
        ck.save(1, _state(1))
        monkeypatch.setenv(ENV, "persist:raise:2")
        ck.save(2, _state(2))
        with pytest.raises(CheckpointError, match="step 2.*injected fault"):
            ck.wait()
        assert ck.latest() == 1
        ck.save(3, _state(3))
        monkeypatch.setenv(ENV, "persist:raise:4")
        ck.save(4, _state(4))
        with pytest.warns(UserWarning, match="step 4.*injected fault"):  # save() warns and goes on
            ck.save(5, _state(5))
        ck.wait()
        assert [v.step for v in ck.versions()] == [1, 3, 5]
        assert len(_dirs(tmp_path)) == 3  # the failed saves' directories were swept


def test_retention_keeps_exactly_what_it_says(tmp_path):
    stale = tmp_path / mf.version_name(99, "ffffffff", 0)  # a crashed earlier run's incomplete save
    stale.mkdir(parents=True)
    (stale / "rank-00000.bin").write_bytes(b"x")
    maes = [0.9, 0.5, 0.2, 0.6, 0.7, 0.8, 0.95, 0.99, 1.0]
    with Checkpointer(tmp_path, keep_last=2, keep_every=4, best=("mae", "min")) as ck:
        for step, mae in enumerate(maes, start=1):
            ck.save(step, {"model": {"w": torch.full((3,), float(step))}}, {"metrics": {"mae": mae}})
        ck.wait()
        assert [v.step for v in ck.versions()] == [3, 4, 8, 9]  # best (0.2), every 4th, last two
        assert len(_dirs(tmp_path)) == 4 and not stale.exists()
    with Checkpointer(tmp_path, keep_last=1, keep_every=3, keep_every_on="epoch") as ck:
        for step in range(10, 17):
            ck.save(step, {"model": {}}, {"epoch": step // 2})
        ck.wait()
        # epochs 5..8: every 3rd epoch is epoch 6 (newest: step 13); plus the last (16)
        assert [v.step for v in ck.versions()] == [13, 16]


def _waits_for(release: threading.Event, call) -> None:
    """``call()`` (on a thread) is still blocked while ``release`` is unset and returns once it is set."""
    t = threading.Thread(target=call)
    t.start()
    t.join(0.2)
    assert t.is_alive()
    release.set()
    t.join(10)
    assert not t.is_alive()


def test_overlapped_copy_waits_only_at_the_update(tmp_path, monkeypatch):
    w = torch.arange(1 << 16, dtype=torch.float32)
    held = {step: _hold(monkeypatch, "copy", step) for step in (1, 2, 3)}
    with Checkpointer(tmp_path, overlap_min_bytes=1024) as ck:
        ck.save(1, {"model": {"w": w}, "small": torch.ones(2)}, overlap=True)
        reached, release, expired = held[1]
        assert not expired.is_set()  # returned while the copy is held (one that waited for it could not)
        assert reached.wait(10)
        _waits_for(release, ck.before_update)  # the optimizer step would wait here ...
        w.add_(1)  # ... and then change the weights
        ck.wait()
        assert torch.equal(ck.load()["model"]["w"], torch.arange(1 << 16, dtype=torch.float32))
        # an in-place change before before_update(): the save fails loudly instead of tearing
        ck.save(2, {"model": {"w": w}}, overlap=True)
        w.add_(1)
        held[2][1].set()
        with pytest.raises(CheckpointError, match="changed in place.*before_update"):
            ck.wait()
        assert ck.latest() == 1
        # attach(): optimizer.step() itself waits for the copy
        p = torch.nn.Parameter(torch.zeros(1 << 12))
        opt = torch.optim.SGD([p], lr=1.0)
        ck.attach(opt)
        ck.save(3, {"model": {"p": p}}, overlap=True)
        p.grad = torch.ones_like(p)
        _waits_for(held[3][1], opt.step)
        ck.wait()
        assert torch.equal(ck.load()["model"]["p"], torch.zeros(1 << 12))


def test_reserve_allocates_the_buffers_saves_reuse(tmp_path):
    """``reserve(state)`` allocates every host buffer a save of ``state`` copies into: the saves after it
    allocate none (the same buffer objects), and what they store is the state's value at each save."""
    state = _state(1)
    with Checkpointer(tmp_path, keep_last=None) as ck:
        ck.reserve(state)
        reserved = {k: id(b) for k, b in ck._buffers._bufs.items()}
        n_tensors = sum(isinstance(t, torch.Tensor) for part in state.values() if isinstance(part, dict)
                        for t in part.values())
        assert len(reserved) >= n_tensors > 0
        for step in (1, 2):
            state["model"]["conv.weight"] += 1
            ck.save(step, state)
            ck.wait()
            assert {k: id(b) for k, b in ck._buffers._bufs.items()} == reserved
            _same(ck.load(step)["model"], state["model"])


def test_local_and_shared_levels(tmp_path):
    root, local = tmp_path / "shared", tmp_path / "local"
    with Checkpointer(root, keep_last=3, local_dir=local, keep_local=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, _state(step))
        ck.wait()
        assert [(v.step, v.levels) for v in ck.versions()] == [(1, ("L3",)), (2, ("L3",)), (3, ("L1", "L3"))]
        assert _dirs(local / "L1") == [_dirs(root)[-1]] and not (local / "L2").exists()  # one node: no L2
        _damage("flipped", _newest(local / "L1"))
        with pytest.warns(UserWarning, match="L1 copy.*fails its checksum"):
            _same(_state(3), ck.load())  # the same version, from its intact L3 copy
        (_newest(root) / mf.MANIFEST).unlink()  # L1 still has the manifest: mixing levels is fine
        with pytest.warns(UserWarning, match="L1 copy"):
            _same(_state(3), ck.load())
        (_newest(root) / "stage-000.bin").unlink()
        with pytest.warns(UserWarning, match="no intact copy"):
            _same(_state(2), ck.load())


def test_cli_ls_verify_export_diff(tmp_path, capsys):
    model = torch.nn.Linear(3, 2)
    with Checkpointer(tmp_path, keep_last=None) as ck:
        ck.save(1, {"model": model.state_dict(), "step": 1}, {"epoch": 0, "metrics": {"mae": 0.5}})
        with torch.no_grad():
            model.weight.mul_(2)
        ck.save(2, {"model": model.state_dict(), "step": 2}, {"epoch": 1})
    assert cli(["ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "mae=0.5" in out and out.count("ok") == 2 and "L3" in out
    assert cli(["verify", str(tmp_path), "2"]) == 0
    assert cli(["export", str(tmp_path), str(tmp_path / "m.pt")]) == 0
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(torch.load(tmp_path / "m.pt"))
    assert torch.equal(fresh.weight, model.weight)
    capsys.readouterr()
    assert cli(["diff", str(tmp_path), "1", "2"]) == 0
    out = capsys.readouterr().out
    rel = [line.split() for line in out.splitlines() if line.startswith(("weight", "bias"))]
    assert {r[0]: float(r[3]) for r in rel} == {"weight": 1.0, "bias": 0.0}
    _damage("flipped", _newest(tmp_path))
    assert cli(["verify", str(tmp_path)]) == 1
    assert "UNUSABLE" in capsys.readouterr().out
    # and as a module, the way users run it
    res = run_python(["-m", "hybridpar.checkpoint", "ls", "--full", str(tmp_path)], timeout=30)
    assert res.returncode == 0 and "BAD" in res.stdout, res.stderr


def test_metadata_must_be_json(tmp_path):
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(TypeError, match="metadata holds a"):
            ck.save(1, {"model": {}}, {"when": object()})
        ck.save(1, {"model": {}}, {"loss": torch.tensor(0.5)})
        ck.wait()
        assert ck.versions()[0].metadata["loss"] == 0.5
        assert json.loads((_newest(tmp_path) / mf.MANIFEST).read_text())["manifest"]["step"] == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Checkpointer(tmp_path / "empty").load() is None
