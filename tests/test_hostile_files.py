"""Checkpoints written by someone else: a crafted file never runs code, a malformed one is one line, and
nothing outside a version folder or a run directory is read or deleted.

Checked against:
* a sentinel file: crafted format-1 headers (``os.system``, ``builtins.exec``, ``subprocess.Popen`` by
  ``__reduce__``, in the header and in its state tree, and one that keeps the file's size and the
  manifest's header crc32 by forcing four bytes) go through ``ls``, ``ls --full``, ``verify``, ``export``,
  ``diff``, ``Checkpointer.load`` and a resumed training run, and the sentinel never appears;
* the resumed run's final weights equal an uninterrupted run's: resume fell back to the intact version;
* 500+ malformed files generated from one small valid file (truncations, flipped bytes, lengths past the
  end, 2^62 and negative, overlapping offsets, wrong magic, crc-forged headers of garbage, wrong types
  and absurd shapes, in both formats): each is exactly one CorruptFile line naming the file, and nothing
  is allocated beyond the file's size (``torch.empty`` guarded, Python's heap traced);
* manifests naming files outside their folder, symlinks out, and retention beside a symlinked version;
* exports that ``torch.load(weights_only=True)`` and safetensors read into ``load_state_dict(strict=True)``;
* save-time refusal of values a checkpoint does not store, naming the key.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import random
import subprocess
import tracemalloc
import zlib
from collections import OrderedDict
from pathlib import Path

import ckpt_train_script
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hybridpar.checkpoint import Checkpointer, CheckpointError, CorruptFile, load_weights, rng_state
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.__main__ import main as cli
from hybridpar.checkpoint.format import END, FOOTER, MAGIC, MAGIC_V1, RankFile, pack_tree, write_file
from hybridpar.checkpoint.header import TensorEntry
from hybridpar.checkpoint.levels import remove_version
from hybridpar.checkpoint.tree import flatten

from forked import run_python

pytestmark = pytest.mark.timeout(120)


# ------------------------------------------------------------------------------------------- crafting
def force_crc(prefix: bytes, target: int) -> bytes:
    """Four bytes that, appended to ``prefix``, make ``zlib.crc32`` equal ``target`` (crc32 is affine in
    its input over GF(2): solve for the four bytes)."""
    base = zlib.crc32(prefix + bytes(4))
    basis: list[tuple[int, int]] = []  # (image, combination of input bits), reduced by leading bit
    for i in range(32):
        v, c = zlib.crc32(prefix + (1 << i).to_bytes(4, "little")) ^ base, 1 << i
        for bv, bc in basis:
            if v ^ bv < v:
                v, c = v ^ bv, c ^ bc
        if v:
            basis.append((v, c))
            basis.sort(reverse=True)
    want, x = target ^ base, 0
    for bv, bc in basis:
        if want ^ bv < want:
            want, x = want ^ bv, x ^ bc
    assert want == 0
    out = x.to_bytes(4, "little")
    assert zlib.crc32(prefix + out) == target
    return out


def split(raw: bytes) -> tuple[bytes, bytes, bytes]:
    """(magic, data region, header) of a rank file."""
    hlen, _, _ = FOOTER.unpack(raw[-FOOTER.size:])
    start = len(raw) - FOOTER.size - hlen
    return raw[:8], raw[8:start], raw[start:-FOOTER.size]


def assemble(magic: bytes, data: bytes, header: bytes) -> bytes:
    return magic + data + header + FOOTER.pack(len(header), zlib.crc32(header), END)


class Run:
    """A ``__reduce__`` payload: unpickled unrestricted, it calls ``fn(*args)``."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def payloads(sentinel: Path) -> dict[str, Run]:
    return {"os.system": Run(os.system, f"touch {sentinel}"),
            "builtins.exec": Run(builtins.exec, f"open({str(sentinel)!r}, 'w').close()"),
            "subprocess": Run(subprocess.Popen, ["touch", str(sentinel)]),
            "builtins.eval": Run(builtins.eval, f"open({str(sentinel)!r}, 'w')")}


def legacy_pickle(obj) -> bytes:
    """``pickle.dumps`` as format 1 wrote it: TensorEntry under the module name old headers use."""
    old = TensorEntry.__module__
    TensorEntry.__module__ = "hybridpar.checkpoint.format"
    try:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    finally:
        TensorEntry.__module__ = old


def legacy_header(path: Path, values: dict | None = None, payload=None, in_tree: bool = False) -> bytes:
    """A format-1 header for the tensors of the rank file at ``path``: its table and tree (``values``
    replacing the tree's values), with ``payload`` in the header itself or in its tree."""
    with RankFile(path) as f:
        table, tree = list(f.table.values()), f.flat_tree
    vals = dict(tree.values if values is None else values)
    if payload is not None and in_tree:
        vals["payload"] = payload
    doc = {"format": 1, "tensors": table, "tree": legacy_pickle((vals, tree.containers))}
    if payload is not None and not in_tree:
        doc["payload"] = payload
    return legacy_pickle(doc)


def rewrite(vdir: Path, fname: str, raw: bytes) -> None:
    """Replace a file of a version and record its new size and header crc in the manifest (a crafted
    version whose manifest agrees with its files)."""
    (vdir / fname).write_bytes(raw)
    hlen, hcrc, _ = FOOTER.unpack(raw[-FOOTER.size:])
    body = json.loads((vdir / mf.MANIFEST).read_text())["manifest"]
    body["files"][fname].update(size=len(raw), header_crc=hcrc)
    body["bytes"] = sum(r["size"] for r in body["files"].values())
    write_manifest(vdir, body)


def write_manifest(vdir: Path, body: dict) -> None:
    (vdir / mf.MANIFEST).write_bytes(mf.encode(body))


def versions(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if mf.parse_name(p.name)), key=lambda p: p.name)


def craft(vdir: Path, variant: str, sentinel: Path) -> None:
    """Make ``vdir``'s stage file hostile (see the module docstring)."""
    path = vdir / "stage-000.bin"
    raw = path.read_bytes()
    magic, data, header = split(raw)
    pay = payloads(sentinel)
    if variant == "pickle-header":
        rewrite(vdir, path.name, assemble(MAGIC_V1, data, legacy_header(path, payload=pay["os.system"])))
    elif variant == "pickle-tree":
        rewrite(vdir, path.name, assemble(MAGIC_V1, data, legacy_header(path, payload=pay["builtins.exec"],
                                                                         in_tree=True)))
    elif variant == "pickle-forged-crc":  # same size, same header crc32: the manifest is left as it was
        evil = pickle.dumps({"format": 1, "x": pay["subprocess"]})  # an unrestricted reader runs it at once
        assert len(evil) + 4 <= len(header)
        evil += b"\0" * (len(header) - len(evil) - 4)
        evil += force_crc(evil, zlib.crc32(header))
        forged = MAGIC_V1 + data + evil + raw[-FOOTER.size:]
        assert len(forged) == len(raw) and zlib.crc32(evil) == zlib.crc32(header)
        path.write_bytes(forged)
    elif variant == "json-absurd-shape":  # format 2, crc valid: a 4 TiB tensor declared in a small file
        doc = json.loads(header)
        doc["tensors"][0][2] = [1 << 40]
        doc["tensors"][0][4] = (1 << 40) * 4
        rewrite(vdir, path.name, assemble(MAGIC, data, json.dumps(doc).encode()))
    else:
        raise AssertionError(variant)


# ------------------------------------------------------------------------- (a) + (c): every read path
@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[str, torch.Tensor]:
    return ckpt_train_script.main([str(tmp_path_factory.mktemp("ref") / "root"), "--steps", "9"])


def _one_line_errors(capsys) -> str:
    cap = capsys.readouterr()
    assert "Traceback" not in cap.err and len(cap.err.strip().splitlines()) <= 1, cap.err
    return cap.err


VARIANTS = ["pickle-header", "pickle-tree", "pickle-forged-crc", "json-absurd-shape"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_crafted_newest_never_runs_code_and_resume_falls_back(tmp_path, variant, reference, capsys):
    root, sentinel = tmp_path / "root", tmp_path / "SENTINEL"
    ckpt_train_script.main([str(root), "--steps", "6"])  # saves after steps 2 and 5
    old, new = versions(root)
    craft(new, variant, sentinel)
    says = "refused" if variant.startswith("pickle") else "has room for it"

    assert cli(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "BAD" in out and says in out
    assert cli(["ls", "--full", str(root)]) == 0
    assert cli(["verify", str(root)]) == 1
    assert "UNUSABLE" in capsys.readouterr().out
    assert cli(["export", str(root), str(tmp_path / "m.pt")]) == 1
    assert f"the newest version {new.name} is damaged" in _one_line_errors(capsys)
    assert cli(["diff", str(root), "2", "5"]) == 1
    assert says in _one_line_errors(capsys)
    assert cli(["export", str(root), str(tmp_path / "m.pt"), "--step", "2"]) == 0
    assert old.name in capsys.readouterr().out
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match=f"skipped.*{new.name}.*{says}"):
        assert ck.load()["step"] == 2
    with pytest.warns(UserWarning, match=says):
        resumed = ckpt_train_script.main([str(root), "--steps", "9"])
    for k, v in reference.items():
        assert torch.equal(v, resumed[k]), k
    assert not sentinel.exists()


def test_the_cli_as_users_run_it_reports_one_line(tmp_path):
    root, sentinel = tmp_path / "root", tmp_path / "SENTINEL"
    ckpt_train_script.main([str(root), "--steps", "6"])
    craft(versions(root)[-1], "pickle-forged-crc", sentinel)
    res = run_python(["-m", "hybridpar.checkpoint", "export", str(root), str(tmp_path / "m.pt")], timeout=60)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "refused (a checkpoint is data)" in res.stderr and "subprocess.Popen" in res.stderr
    assert not sentinel.exists()


# ---------------------------------------------------------------------------------- (b) malformed files
def small_file(path: Path) -> bytes:
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
             "m": torch.tensor([True, False, True]), "i": torch.arange(4).reshape(2, 2),
             "od": OrderedDict([(1, torch.ones(2, dtype=torch.float64)), ("k", (1, 2.5, None, "s"))]),
             "raw": b"\x00\xff", "inf": float("-inf"), "nested": [[1, 2], (3, [4])], "f": {0.5: True}}
    flat = flatten(state)
    write_file(path, list(flat.tensors.items()), pack_tree(flat))
    return path.read_bytes()


def _dump(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def malformed(base: bytes, rng: random.Random, sentinel: Path) -> list[tuple[str, bytes]]:
    """Every way of breaking ``base`` that the test tries (each must be refused)."""
    magic, data, header = split(base)
    doc = json.loads(header)
    n = len(base)
    cases: list[tuple[str, bytes]] = []
    add = lambda name, raw: cases.append((name, raw))
    forged = lambda name, head, m=MAGIC: add(name, assemble(m, data, head))

    for cut in sorted(set(rng.sample(range(n), min(n, 80))) | {0, 7, 8, 9, n - 17, n - 16, n - 1}):
        add(f"truncated at {cut}", base[:cut])
    for i in range(150):
        pos, bit = rng.randrange(n), 1 << rng.randrange(8)
        add(f"flipped bit {bit} of byte {pos} ({i})", base[:pos] + bytes([base[pos] ^ bit]) + base[pos + 1:])
    for m in (b"HPCKPT03", b"\0" * 8, b"PK\x03\x04\0\0\0\0", b"HPCKEND1", b"hpckpt02"):
        add(f"magic {m!r}", m + base[8:])
    add("wrong end marker", base[:-8] + b"HPCKEND2")
    hcrc = zlib.crc32(header)
    for hlen in (n - 16 + 1, n, 1 << 62, (1 << 64) - 1, 1 << 63, len(header) + 1, len(header) - 1, 0):
        add(f"header length {hlen}", magic + data + header + FOOTER.pack(hlen, hcrc, END))
    add("file grown after the footer", base + b"\0" * 16)
    add("empty", b"")

    # crc-forged format-2 headers: the checksum passes, the content must not
    for text in (b"", b"{", b"[]", b"null", b"1", b'"x"', b"\xff\xfe{}", b"{}", b"[" * 100000 + b"]" * 100000,
                 b'{"format":2,"tensors":[],"tree":' + b"[" * 5000 + b"]" * 5000 + b"}",
                 b'{"format":2,"tensors":' + b"9" * 5000 + b',"tree":{}}',
                 header.replace(b'"format":2', b'"format":NaN'),
                 header.replace(b'"format":2', b'"format":1e999'),
                 header.replace(b'"format":2', b'"format":2,"format":2'), header + b"x", b" " + header[1:-1],
                 bytes(rng.randrange(256) for _ in range(len(header)))):
        forged(f"header text {text[:40]!r}", text)
    for fmt in (1, 3, "2", None, True, [2]):
        forged(f"format {fmt!r}", _dump({**doc, "format": fmt}))
    for key in ("tensors", "tree"):
        forged(f"no {key}", _dump({k: v for k, v in doc.items() if k != key}))
        for bad in (None, 5, "x", {}, [[]], [None]):
            forged(f"{key} = {bad!r}", _dump({**doc, key: bad}))
    forged("an extra key", _dump({**doc, "extra": 1}))
    rows = doc["tensors"]
    big, huge = 1 << 62, 1 << 64
    bad_fields = {
        0: [None, 5, ["k"], {"k": 1}],
        1: ["float128", "torch.float32", "object", "qint8", "", None, 7, ["float32"], "complex32", "str"],
        2: [[-1], [big], [big, big], [huge], ["2"], [True], [1.5], "3", [1] * 40, None, [-3, -4], {"0": 1},
            [0], [1 << 40], [2, 1 << 61], [3, -4, -1]],
        3: [-1, 0, 7, big, huge, -big, 1.0, None, "8", True],
        4: [-1, 0, big, huge, None, 1.0, "4", True],
        5: [-1, 1 << 32, "x", None, 1.5, True],
    }
    for i in range(len(rows)):
        for field, bads in bad_fields.items():
            for bad in bads:
                rows2 = [list(r) for r in rows]
                rows2[i][field] = bad
                forged(f"tensor {i} field {field} = {str(bad)[:30]}", _dump({**doc, "tensors": rows2}))
        rows2 = [list(r) for r in rows]
        rows2[i][5] ^= 1
        forged(f"tensor {i} crc off by one bit", _dump({**doc, "tensors": rows2}))
        rows2 = [list(r) for r in rows]
        rows2[i][4] += 1
        forged(f"tensor {i} one byte longer", _dump({**doc, "tensors": rows2}))
        if i:
            rows2 = [list(r) for r in rows]
            rows2[i][3] = rows2[i - 1][3]  # overlapping the tensor before it
            forged(f"tensor {i} overlaps tensor {i - 1}", _dump({**doc, "tensors": rows2}))
            rows2 = [list(r) for r in rows]
            rows2[i][0] = rows2[i - 1][0]
            forged(f"tensor {i} repeats a key", _dump({**doc, "tensors": rows2}))
            rows2 = [list(r) for r in rows]
            rows2[i - 1], rows2[i] = rows2[i], rows2[i - 1]
            forged(f"tensors {i - 1} and {i} swapped", _dump({**doc, "tensors": rows2}))
        rows2 = [list(r) for r in rows]
        del rows2[i]
        forged(f"tensor {i} missing (a gap)", _dump({**doc, "tensors": rows2}))
        rows2 = [list(r) for r in rows]
        rows2[i] = rows2[i][:5]
        forged(f"tensor {i} row of 5", _dump({**doc, "tensors": rows2}))
    past = ["x", "uint8", [4], len(data) + 8, 4, 0]
    forged("a tensor past the data", _dump({**doc, "tensors": [*rows, past]}))
    tree = doc["tree"]
    leaves = [{"x": 1}, {"b": "!!"}, {"f": "1.0"}, {"t": 5}, {"t": [1], "b": ""}, {}, {"f": "inf", "x": 1},
              {"b": 5}, {"t": [{"x": 1}]}]
    deep: object = 1
    for _ in range(200):
        deep = [deep]
    leaves.append(deep)
    for leaf in leaves:
        values = {**tree["values"], "z": leaf}
        forged(f"leaf {str(leaf)[:30]}", _dump({**doc, "tree": {**tree, "values": values}}))
    deep_path = "/".join(["a"] * 100)
    for name, containers in (("not a map", []), ("kind set", {"": ["set", []]}),
                             ("spec of 3", {"": ["dict", [], 1]}), ("keys not a list", {"": ["dict", "k"]}),
                             ("list key", {"": ["dict", [[1]]]}), ("object key", {"": ["dict", [{"x": 1}]]}),
                             ("spec not a list", {"": ["dict", []], "1": 1}),
                             ("path too deep", {deep_path: ["dict", []]})):
        forged(f"containers {name}", _dump({**doc, "tree": {**tree, "containers": containers}}))
    for t in (None, [], {"values": {}}, {"values": [], "containers": {}}, {**tree, "x": 1}):
        forged(f"tree {str(t)[:30]}", _dump({**doc, "tree": t}))

    # crc-forged format-1 (pickled) headers: refused globals, lengths past the end, bad entries
    for name, pay in payloads(sentinel).items():
        forged(f"pickle calls {name}", pickle.dumps({"format": 1, "x": pay}), MAGIC_V1)
        forged(f"pickle protocol 0 calls {name}", pickle.dumps({"format": 1, "x": pay}, protocol=0), MAGIC_V1)
    for name, raw in (("BINBYTES8 of 2^62", b"\x80\x05\x8e" + (1 << 62).to_bytes(8, "little") + b"xx."),
                      ("BINUNICODE8 of 2^63-1", b"\x80\x05\x8d" + (2**63 - 1).to_bytes(8, "little") + b"."),
                      ("BYTEARRAY8 of 2^40", b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little") + b"."),
                      ("LONG4 of 2^31-1", b"\x80\x05\x8b\xff\xff\xff\x7f."),
                      ("truncated pickle", pickle.dumps({"format": 1})[:-3]), ("not a pickle", b"garbage"),
                      ("STOP only", b"."), ("a list", pickle.dumps([1])),
                      ("nested 100000", b"\x80\x05" + b"]" * 1 + b"(]" * 100000 + b"."),
                      ("persistent id", b"\x80\x05\x8c\x01xQ."),
                      ("ndarray reconstruct", pickle.dumps(np.zeros(3), protocol=2)),
                      ("no tensors", pickle.dumps({"format": 1, "tensors": [], "tree": b""}))):
        forged(f"pickle: {name}", raw, MAGIC_V1)
    entries = [TensorEntry(*r) for r in rows]
    for field, bads in bad_fields.items():
        for bad in bads[:5]:
            es = list(entries)
            e = entries[0]
            vals = [e.key, e.dtype, e.shape, e.offset, e.nbytes, e.crc]
            vals[field] = tuple(bad) if field == 2 and isinstance(bad, list) else bad
            es[0] = TensorEntry(*vals)
            forged(f"pickled tensor 0 field {field} = {str(bad)[:30]}",
                   legacy_pickle({"format": 1, "tensors": es, "tree": pickle.dumps(({}, {}))}), MAGIC_V1)
    cyc: list = []
    cyc.append(cyc)
    for name, tree_obj in (("values a list", ([], {})), ("cycle", ({"a": cyc}, {})),
                           ("deep", ({"a": deep}, {})), ("containers bad", ({}, {"": ("set", [])})),
                           ("calls exec", ({"a": payloads(sentinel)["builtins.exec"]}, {}))):
        forged(f"pickled tree {name}", legacy_pickle({"format": 1, "tensors": entries,
                                                      "tree": pickle.dumps(tree_obj)}), MAGIC_V1)
    return cases


def test_500_malformed_files_each_one_line_naming_the_file(tmp_path, monkeypatch):
    base = small_file(tmp_path / "valid.bin")
    with RankFile(tmp_path / "valid.bin") as f:  # the base itself is valid
        f.verify()
    sentinel = tmp_path / "SENTINEL"
    cases = malformed(base, random.Random(36), sentinel)
    assert len(cases) >= 500, len(cases)
    path = tmp_path / "case.bin"
    size = [0]
    empty = torch.empty

    def guarded(*shape, **kw):  # nothing a header declares is allocated before it is checked
        dims = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        t = empty(*shape, **kw)
        assert t.numel() * t.element_size() <= size[0], f"allocated {list(dims)} from a {size[0]}-byte file"
        return t

    monkeypatch.setattr(torch, "empty", guarded)
    failures, said = [], set()
    tracemalloc.start()
    try:
        for name, raw in cases:
            path.write_bytes(raw)
            size[0] = len(raw)
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            try:
                with RankFile(path) as f:
                    for k in f.table:
                        f.read(k)
                    f.verify()
                failures.append(f"{name}: loaded without an error")
            except CorruptFile as e:
                msg = str(e)
                if not msg.startswith(f"{path}: ") or "\n" in msg:
                    failures.append(f"{name}: not one line naming the file: {msg!r}")
                said.add(msg.split(": ", 1)[1][:30])
            except BaseException as e:  # noqa: BLE001 (the failure this test exists to find)
                failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
            peak = tracemalloc.get_traced_memory()[1] - before
            if peak > 64 * len(raw) + (2 << 20):
                failures.append(f"{name}: {peak} bytes of Python heap for a {len(raw)}-byte file")
    finally:
        tracemalloc.stop()
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures[:40])
    assert not sentinel.exists()
    assert len(said) > 40  # the messages say what is wrong, not one blanket line


# ------------------------------------------------------------------------------------ (d) confinement
def _two_versions(root: Path) -> tuple[Path, Path]:
    with Checkpointer(root, keep_last=None) as ck:
        for step in (1, 2):
            ck.save(step, {"model": {"w": torch.full((4,), float(step))}, "step": step})
    return tuple(versions(root))  # type: ignore[return-value]


@pytest.mark.parametrize("name", ["../../x.bin", "ABS", "sub/x.bin", "..", "MANIFEST.json", ".hidden.bin"])
def test_manifest_names_stay_inside_the_version_folder(tmp_path, name, capsys):
    root = tmp_path / "run"
    old, new = _two_versions(root)
    outside = tmp_path / "x.bin"
    outside.write_bytes((new / "stage-000.bin").read_bytes())
    name = str(outside) if name == "ABS" else name
    body = mf.read(new)
    body["files"][name] = body["files"].pop("stage-000.bin")
    write_manifest(new, body)
    with pytest.raises(CorruptFile, match="not a checkpoint file's name"):
        mf.read(new)
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="not a checkpoint file's name"):
        assert ck.load()["step"] == 1
    assert cli(["verify", str(root)]) == 1
    assert "not a checkpoint file's name" in capsys.readouterr().out


@pytest.mark.parametrize("target", ["outside", "a loop"])
def test_a_symlink_out_of_the_version_folder_is_refused(tmp_path, target, capsys):
    root = tmp_path / "run"
    old, new = _two_versions(root)
    outside = tmp_path / "elsewhere.bin"
    (new / "stage-000.bin").rename(outside)
    (new / "stage-000.bin").symlink_to(outside if target == "outside" else new / "stage-000.bin")
    says = "symlink out of its version folder" if target == "outside" else "symlink loop"
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match=says):
        assert ck.load()["step"] == 1
    (new / mf.MANIFEST).rename(new / "m.json")
    (new / mf.MANIFEST).symlink_to(new / mf.MANIFEST if target == "a loop" else new / "m.json")
    assert cli(["verify", str(root)]) == 1
    assert "UNUSABLE" in capsys.readouterr().out


def test_retention_never_deletes_through_a_symlinked_version(tmp_path):
    other = tmp_path / "other-run"
    with Checkpointer(other) as ck:
        ck.save(0, {"model": {"w": torch.ones(2)}})
    (theirs,) = versions(other)
    half = other / mf.version_name(0, "0000beef", 0)  # another run's incomplete save
    half.mkdir()
    (half / "rank-00000.bin").write_bytes(b"theirs")
    root = tmp_path / "run"
    root.mkdir()
    (root / theirs.name).symlink_to(theirs)  # an old complete version, as retention sees it
    (root / half.name).symlink_to(half)  # an incomplete one of another session
    assert remove_version(root / theirs.name) is False
    with Checkpointer(root, keep_last=1) as ck:
        for step in (1, 2, 3):
            ck.save(step, {"model": {"w": torch.full((2,), float(step))}})
    assert (theirs / mf.MANIFEST).exists() and (theirs / "stage-000.bin").exists()
    assert (half / "rank-00000.bin").read_bytes() == b"theirs"
    assert [p.name for p in versions(root) if not p.is_symlink()] == [versions(root)[-1].name]


def test_manifest_fields_are_checked(tmp_path):
    root = tmp_path / "run"
    old, new = _two_versions(root)
    good = mf.read(new)
    bad = [("time", "x"), ("time", 1e300), ("step", 7), ("bytes", -1), ("metadata", []),
           ("metadata", {"metrics": 1}), ("order", [1]), ("files", []),
           ("layout", {"world": 1, "local": False, "node_of": []})]
    for key, value in bad:
        write_manifest(new, {**good, key: value})
        with pytest.raises(CorruptFile):
            mf.read(new)
    for field, value in (("rank", 1), ("kind", "x"), ("stage", "0"), ("size", -1), ("header_crc", 1 << 32),
                         ("entries", [1]), ("copies", [{"holder": 5, "size": 1, "header_crc": 0}])):
        files = json.loads(json.dumps(good["files"]))
        files["stage-000.bin"][field] = value
        write_manifest(new, {**good, "files": files})
        with pytest.raises(CorruptFile, match="not what a manifest holds"):
            mf.read(new)
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match="not what a manifest holds"):
        assert ck.load()["step"] == 1


# ------------------------------------------------------------------------------------- (e) exports
def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.BatchNorm3d(2), torch.nn.Flatten(),
                               torch.nn.Linear(2, 3).to(torch.bfloat16))


def test_exports_load_weights_only_and_into_the_model_strict(tmp_path, capsys):
    model = _model()
    model[1].running_mean.add_(0.5)
    model[1].num_batches_tracked.add_(3)
    run = tmp_path / "run"
    with Checkpointer(run / "checkpoints") as ck:
        ck.save(3, {"model": model.state_dict(), "rng": rng_state(), "step": 3,
                    "optimizer": {"hyper": {"0.weight": {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None}}},
                    "extra": {"blob": b"\x00\x01", "best": float("inf"), "seen": [1, 2]}})
    want = model.state_dict()

    def check(sd) -> None:
        fresh = _model()
        fresh.load_state_dict(sd, strict=True)
        for k, v in fresh.state_dict().items():
            assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k

    assert cli(["export", str(run), str(tmp_path / "m.pt")]) == 0  # a run directory: its checkpoints/
    assert "step 3" in capsys.readouterr().out
    check(torch.load(tmp_path / "m.pt", weights_only=True))
    assert cli(["export", str(run), str(tmp_path / "m.safetensors")]) == 0
    check(load_file(tmp_path / "m.safetensors"))
    assert cli(["export", str(run / "checkpoints"), str(tmp_path / "m.st"), "--format", "safetensors"]) == 0
    check(load_file(tmp_path / "m.st"))
    assert cli(["export", str(run), str(tmp_path / "all.pt"), "--all"]) == 0
    everything = torch.load(tmp_path / "all.pt", weights_only=True)
    check(everything["model"])
    assert everything["step"] == 3 and everything["extra"] == {"blob": b"\x00\x01", "best": float("inf"),
                                                               "seen": [1, 2]}
    assert everything["optimizer"]["hyper"]["0.weight"]["betas"] == (0.9, 0.999)
    for f in ("m.pt", "m.safetensors", "m.st", "all.pt"):
        check(load_weights(tmp_path / f))
    capsys.readouterr()
    assert cli(["export", str(run), str(tmp_path / "x.safetensors"), "--all"]) == 2
    assert cli(["export", str(run), str(tmp_path / "x.pt"), "--entry", "rng"]) == 1
    assert cli(["export", str(tmp_path / "nowhere"), str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 3 and "Traceback" not in err
    (tmp_path / "evil.pt").write_bytes(pickle.dumps(payloads(tmp_path / "SENTINEL")["os.system"], protocol=2))
    with pytest.raises(CheckpointError, match="evil.pt: not a safetensors file or a weights-only"):
        load_weights(tmp_path / "evil.pt")
    assert not (tmp_path / "SENTINEL").exists()


def test_a_format_1_version_loads_and_exports_weights_only(tmp_path):
    """An old version (pickled headers, numpy's RNG state as an ndarray) still loads and exports."""
    root = tmp_path / "run"
    with Checkpointer(root) as ck:
        ck.save(1, {"model": {"w": torch.arange(3.0)}, "rng": {"python": random.getstate(), "numpy": 0},
                    "step": 1})
    (vdir,) = versions(root)
    np.random.seed(7)
    numpy_state = np.random.get_state()
    for path in sorted(vdir.glob("*.bin")):
        magic, data, _ = split(path.read_bytes())
        with RankFile(path) as f:
            values = dict(f.flat_tree.values)
        if path.name.startswith("rank"):
            values["rng/numpy"] = numpy_state
        rewrite(vdir, path.name, assemble(MAGIC_V1, data, legacy_header(path, values)))
    with Checkpointer(root) as ck:
        state = ck.load()
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.arange(3.0))
    assert np.array_equal(state["rng"]["numpy"][1], numpy_state[1])
    assert cli(["export", str(root), str(tmp_path / "all.pt"), "--all"]) == 0
    assert torch.equal(torch.load(tmp_path / "all.pt", weights_only=True)["rng"]["numpy"][1],
                       torch.from_numpy(numpy_state[1]))


# --------------------------------------------------------------------------- (f) refused at save time
@pytest.mark.parametrize("value,says", [({1, 2}, "holds a set"), (object(), "holds a object"),
                                        (np.zeros(2), "holds a ndarray"), (torch.Size([2]), "holds a Size"),
                                        ((1, {3}), r"holds a set \(at \[1\]\)"), (1j, "holds a complex")])
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_what_a_checkpoint_does_not_store_is_refused_at_save_naming_the_key(tmp_path, value, says):
    with Checkpointer(tmp_path) as ck:
        with pytest.raises(TypeError, match=f"checkpoint state key 'extra/foo' {says}"):
            ck.save(1, {"model": {"w": torch.ones(1)}, "extra": {"foo": value}})
        assert ck.latest() is None
        with pytest.raises(TypeError, match="'model/q' is a tensor of dtype complex32"):
            ck.save(1, {"model": {"q": torch.zeros(2, dtype=torch.complex32)}})
        ck.save(2, {"model": {"w": torch.ones(1)}, "extra": {"n": np.float32(0.5), "k": {None: 1, 2.5: 2}}})
        assert ck.load()["extra"] == {"n": 0.5, "k": {None: 1, 2.5: 2}}
