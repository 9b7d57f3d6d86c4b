"""The checkpoint package's pure parts, without a Checkpointer: key flattening, file format and checksums,
manifest, placement of files and partner copies, retention, and name-keyed optimizer state."""

from __future__ import annotations

import random
import zlib
from collections import OrderedDict

import numpy as np
import pytest
import torch

from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.file_placement import STAGE, Placement, rank_file, stage_file
from hybridpar.checkpoint.format import CorruptFile, RankFile, pack_tree, write_file
from hybridpar.checkpoint.retention import Policy, Record, keep, newest_per_step
from hybridpar.checkpoint.train_state import load_optimizer_state, optimizer_state
from hybridpar.checkpoint.tree import flatten, key_filter, keys_for, merge, select, unflatten


def _same(a, b) -> None:
    """Deep equality with tensors compared by dtype, shape and bits."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a, b.view(torch.uint8)
                           if b.dtype == torch.bool else b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, np.ndarray):
        assert np.array_equal(a, b)
    else:
        assert a == b


def nested_state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": OrderedDict([("conv.weight", torch.randn(2, 3, 3, generator=g)),
                              ("fc.bias", torch.randn(4, generator=g).to(torch.bfloat16))]),
        "optimizer": {"state": {0: {"momentum_buffer": torch.randn(5, generator=g), "step": 7}},
                      "param_groups": [{"lr": 0.1, "params": [0]}]},
        "odd/key%": {"x": torch.arange(6, dtype=torch.int64).reshape(2, 3),
                     "flag": torch.tensor([True, False])},
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 3),
        "rng": {"python": random.Random(1).getstate(), "torch": torch.Generator().manual_seed(4).get_state()},
        "mixed": [torch.ones(2, dtype=torch.int8), {"n": 3}, "text", None],
        "step": 12, "name": "run/α", "ratio": 0.25, "nothing": {},
    }


def test_flatten_round_trip_keeps_types_keys_and_order():
    s = nested_state()
    flat = flatten(s)
    assert "odd%2Fkey%25/x" in flat.tensors and "model/conv.weight" in flat.tensors
    assert "rng/python" in flat.values  # a tuple without tensors stays one leaf
    _same(s, unflatten(flat))


def test_select_and_merge_rebuild_a_stage_split():
    full = {"model": {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(4)}, "step": 3}
    stage0 = flatten({"model": {k: v for k, v in full["model"].items() if k < "layers.2"}, "step": 3})
    stage1 = flatten({"model": {k: v for k, v in full["model"].items() if k >= "layers.2"}})
    _same(full, unflatten(merge([stage0, stage1])))
    only = select(merge([stage0, stage1]), key_filter(["model/layers.3.weight", "step"]))
    _same({"model": {"layers.3.weight": full["model"]["layers.3.weight"]}, "step": 3}, unflatten(only))
    assert unflatten(select(stage0, key_filter(lambda k: False))) == {}


def test_keys_for_selects_a_stages_tensors_and_everything_else():
    keep = keys_for(["layers.3.weight", "a/b"])
    assert keep("model/layers.3.weight") and keep("optimizer/state/layers.3.weight/momentum_buffer")
    assert keep("optimizer/hyper/layers.3.weight/lr") and keep("model/a%2Fb")
    assert not keep("model/layers.30.weight") and not keep("optimizer/state/layers.4.weight/step")
    assert keep("rng/torch") and keep("step")


def test_flatten_rejects_what_cannot_round_trip():
    with pytest.raises(ValueError, match="collide"):
        flatten({"a": {1: torch.ones(1), "1": torch.ones(1)}})
    with pytest.raises(TypeError, match="only str, int, float, bool and None keys"):
        flatten({"a": {(1, 2): 3}})


def _write(path, state):
    flat = flatten(state)
    return write_file(path, list(flat.tensors.items()), pack_tree(flat))


def test_file_round_trip_and_every_damage_is_caught(tmp_path):
    s = nested_state()
    p = tmp_path / "f.bin"
    w = _write(p, s)
    with RankFile(p, w.size, w.header_crc) as f:
        f.verify()
        got = {k: f.read(k) for k in f.table}
    _same(flatten(s).tensors, got)
    data = bytearray(p.read_bytes())
    # a flipped byte in the first tensor: caught by that tensor's crc, on read and on verify
    data[8] ^= 0x40
    p.write_bytes(data)
    with RankFile(p, w.size, w.header_crc) as f:
        with pytest.raises(CorruptFile, match="fails its checksum"):
            f.read(next(iter(f.table)))
        with pytest.raises(CorruptFile, match="fails its checksum"):
            f.verify()
    # truncation: caught by the size in the manifest, and without it by the footer
    p.write_bytes(bytes(data[:-7]))
    with pytest.raises(CorruptFile, match="truncated"):
        RankFile(p, w.size, w.header_crc)
    with pytest.raises(CorruptFile, match="bad magic"):
        RankFile(p)
    # a header byte: caught by the header crc
    data[8] ^= 0x40
    data[-30] ^= 0x01
    p.write_bytes(data)
    with pytest.raises(CorruptFile, match="header"):
        RankFile(p, w.size, w.header_crc)


def test_manifest_is_atomic_and_checksummed(tmp_path):
    name = mf.version_name(42, "0123abcd", 3)
    assert mf.parse_name(name) == (42, "0123abcd", 3) and mf.parse_name("tmp") is None
    vdir = tmp_path / name
    vdir.mkdir()
    body = {"format": mf.FORMAT, "name": name, "step": 42, "time": 1.0, "metadata": {}, "bytes": 0,
            "layout": {"world": 1, "local": False, "node_of": [0]}, "files": {}}

    def crash():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mf.write(vdir, body, "t", before_rename=crash)
    assert mf.read(vdir) is None  # only the temp file exists: the version is not there
    mf.write(vdir, body, "t")
    assert mf.read(vdir) == body
    raw = (vdir / mf.MANIFEST).read_bytes().replace(b'"step": 42', b'"step": 43')
    (vdir / mf.MANIFEST).write_bytes(raw)
    with pytest.raises(CorruptFile, match="checksum"):
        mf.read(vdir)
    with pytest.raises(TypeError, match="holds a object"):
        mf.jsonable({"bad": object()})
    assert mf.jsonable({"x": np.float32(0.5), "t": torch.tensor(3)}) == {"x": 0.5, "t": 3}


class _Grid:
    """Just the arithmetic of hybridpar.ProcessGrid that placement uses."""

    def __init__(self, data, pipe, stage_size):
        self.data, self.pipe, self.stage_size = data, pipe, stage_size
        self.world_size = data * pipe * stage_size

    def global_rank(self, data, pipe, spatial_index):
        return (data * self.pipe + pipe) * self.stage_size + spatial_index


def test_placement_writes_each_stage_once_and_partners_replicas():
    # data=2 x pipe=2, two ranks per node: stage 0 = ranks 0, 2; stage 1 = ranks 1, 3
    p = Placement.from_grid(_Grid(2, 2, 1), (0, 0, 1, 1))
    assert [f.name for f in p.writes(0)] == ["global.bin", stage_file(0), rank_file(0)]
    assert [f.name for f in p.writes(1)] == [stage_file(1), rank_file(1)]
    assert [f.name for f in p.writes(3)] == [rank_file(3)]
    copies = {c.file.name: c for c in p.copies()}
    # stage files: the replica on the other node writes its own copy, nothing is sent
    assert (copies[stage_file(0)].holder, copies[stage_file(0)].self_made) == (2, True)
    assert (copies[stage_file(1)].holder, copies[stage_file(1)].self_made) == (3, True)
    assert (copies[rank_file(2)].holder, copies[rank_file(2)].self_made) == (0, False)
    assert all(p.node_of[c.holder] != p.node_of[c.file.writer] for c in copies.values())
    assert all(p.snapshots_replicated(r) for r in range(4))  # two writers and their self-made partners


def test_placement_sends_stage_files_without_an_off_node_replica():
    # pipe=2, 2 spatial ranks per stage, one stage per node: no replica of a stage off its node
    p = Placement.from_grid(_Grid(1, 2, 2), (0, 0, 1, 1))
    copies = {c.file.name: c for c in p.copies()}
    assert [c.self_made for c in copies.values() if c.file.kind == STAGE] == [False, False]
    assert copies[stage_file(0)].holder == 2 and copies[stage_file(1)].holder == 0
    assert [p.snapshots_replicated(r) for r in range(4)] == [True, False, True, False]
    assert Placement.from_grid(None, (0, 0)).copies() == []  # one node: no L2


def _rec(i, step=None, **meta):
    return Record(f"v{i:03d}", i if step is None else step, float(i), meta)


def test_retention_keeps_exactly_last_every_and_best():
    vs = [_rec(i, epoch=i // 2, metrics={"mae": abs(i - 4) + 0.5}) for i in range(1, 13)]
    assert keep(Policy(keep_last=3), vs) == {"v010", "v011", "v012"}
    assert keep(Policy(keep_last=2, keep_every=5), vs) == {"v005", "v010", "v011", "v012"}
    # every 2nd epoch: the newest version of epochs 0, 2, 4, 6
    assert keep(Policy(keep_last=1, keep_every=2, keep_every_on="epoch"), vs) == \
        {"v001", "v005", "v009", "v012"}
    assert keep(Policy(keep_last=1, best=("mae", "min")), vs) == {"v004", "v012"}
    assert keep(Policy(keep_last=1, best=("mae", "max")), vs) == {"v012"}
    assert keep(Policy(keep_last=None), vs) == {v.name for v in vs}
    with pytest.raises(ValueError, match="keep_last"):
        Policy(keep_last=0)


def test_retention_keeps_one_version_per_step():
    """A later save of a step replaces the earlier (a periodic save on an epoch's last step, then the
    epoch's save with its metrics): one version per step, and the replaced one takes no keep_last slot."""
    vs = [_rec(1), _rec(2), _rec(3, step=2, metrics={"mae": 9.0}), _rec(4, step=1), _rec(5)]
    assert [v.name for v in newest_per_step(vs)] == ["v003", "v004", "v005"]
    assert keep(Policy(keep_last=2), vs) == {"v004", "v005"}
    assert keep(Policy(keep_last=None), vs) == {"v003", "v004", "v005"}
    assert keep(Policy(keep_last=1, best=("mae", "min")), vs) == {"v003", "v005"}
    assert keep(Policy(keep_last=1, keep_every=1), vs) == {"v003", "v004", "v005"}


def test_optimizer_state_by_name_moves_between_stage_splits():
    torch.manual_seed(0)
    full = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(full.parameters(), lr=0.1, momentum=0.9)
    full(torch.randn(5, 3)).sum().backward()
    opt.step()
    saved = optimizer_state(full, opt)
    assert set(saved["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    # a "stage" holding only the second layer, under its full-model names
    stage = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Linear(4, 2))
    sopt = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.0)
    load_optimizer_state(stage, sopt, saved)
    assert sopt.param_groups[0]["lr"] == 0.1 and sopt.param_groups[0]["momentum"] == 0.9
    assert torch.equal(sopt.state[stage[1].weight]["momentum_buffer"],
                       opt.state[full[1].weight]["momentum_buffer"])
    with pytest.raises(KeyError, match="no entry"):
        load_optimizer_state(full, opt, {"state": {}, "hyper": {}})


def test_crc32_is_what_the_format_uses():
    assert zlib.crc32(b"hybridpar") == zlib.crc32(b"par", zlib.crc32(b"hybrid"))
