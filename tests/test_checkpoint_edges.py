"""Checkpoint edges (issue 46): every read of a crafted file is one CorruptFile naming it, and ``export``
replaces nothing it was not asked to.

Checked against:
* a stage file that is a directory, a FIFO or a symlink to its own folder: ``RankFile`` raises CorruptFile
  naming the path (was a raw IsADirectoryError naming a descriptor), ``Checkpointer.load`` falls back to
  the older version, and ``verify``/``export`` say so in one line naming the path;
* a format-2 header, its manifest agreeing, whose tree holds an empty key (at the root, where it joins to
  the root again, and inside a dict), a key repeated in one container, a sequence whose keys are not its
  indices, or a key that is both a tensor and a value: CorruptFile at read, load falls back, and
  ``export``/``diff`` are one line with exit 1 (were RecursionError); a state with an empty key is
  refused at save naming it;
* format-1 headers whose numpy values state a dtype outside the allow-list (void, item size -1), an item
  size that is not the dtype's (2**40; float32 stated as 8 bytes and backed by 8 bytes an element, a swap
  with consistent byte counts), or bytes that are not shape x item size: CorruptFile; real numpy values
  (an RNG state, numbers, a big-endian array, a dtype) still load;
* ``export``: onto an existing file without ``--overwrite`` is exit 2, one line, the file byte for byte as
  it was; into a missing folder exit 2, one line saying the folder is not created; the file gets mode
  0666 & ~umask (safetensors too); a write that fails leaves neither the file nor a temporary one.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridpar.checkpoint import Checkpointer, CheckpointError, CorruptFile
from hybridpar.checkpoint import manifest as mf
from hybridpar.checkpoint.__main__ import main as cli
from hybridpar.checkpoint.format import END, FOOTER, MAGIC, MAGIC_V1, RankFile
from hybridpar.checkpoint.header import TensorEntry
from hybridpar.checkpoint.legacy_numpy import DtypeSpec

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------- helpers
def two_versions(root: Path) -> tuple[Path, Path]:
    """Versions of steps 1 and 2 (model in ``stage-000.bin``, the rest in ``global.bin``), oldest first."""
    with Checkpointer(root, keep_last=None) as ck:
        for step in (1, 2):
            ck.save(step, {"model": {"w": torch.full((4,), float(step)), "b": torch.zeros(2)},
                           "opt": [torch.ones(1), {"lr": 0.1}], "step": step})
    old, new = sorted(p for p in root.iterdir() if mf.parse_name(p.name))
    return old, new


def parts(raw: bytes) -> tuple[bytes, bytes, bytes]:
    """(magic, data region, header) of a rank file."""
    hlen = FOOTER.unpack(raw[-FOOTER.size:])[0]
    start = len(raw) - FOOTER.size - hlen
    return raw[:8], raw[8:start], raw[start:-FOOTER.size]


def rewrite(path: Path, magic: bytes, header: bytes) -> None:
    """Give the rank file at ``path`` a new header, its manifest updated to agree (a crafted version)."""
    _, data, _ = parts(path.read_bytes())
    raw = magic + data + header + FOOTER.pack(len(header), zlib.crc32(header), END)
    path.write_bytes(raw)
    body = mf.read(path.parent)
    body["files"][path.name].update(size=len(raw), header_crc=zlib.crc32(header))
    body["bytes"] = sum(r["size"] for r in body["files"].values())
    (path.parent / mf.MANIFEST).write_bytes(mf.encode(body))


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def falls_back(root: Path, says: str) -> None:
    """``Checkpointer.load`` skips the newest version, naming the problem, and loads step 1."""
    with Checkpointer(root) as ck, pytest.warns(UserWarning, match=says):
        assert ck.load()["step"] == 1


# --------------------------------------------------------------------------- rank files not regular
@pytest.mark.parametrize("kind", ["directory", "FIFO", "symlink to its folder"])
def test_a_rank_file_that_is_not_a_file_is_one_line_and_load_falls_back(tmp_path, kind, capsys):
    root = tmp_path / "run"
    _, new = two_versions(root)
    path = new / "stage-000.bin"
    path.unlink()
    {"directory": path.mkdir, "FIFO": lambda: os.mkfifo(path),
     "symlink to its folder": lambda: path.symlink_to(".")}[kind]()
    says = f"{path}: not a regular file"
    with pytest.raises(CorruptFile, match=says):
        RankFile(path)
    falls_back(root, says)
    assert cli(["verify", str(root)]) == 1
    assert says in capsys.readouterr().out
    assert cli(["export", str(root), str(tmp_path / "m.pt")]) == 1
    assert says in one_line(capsys)


# ------------------------------------------------------------------------------------ keys in a tree
def _empty_at_root(doc: dict) -> None:
    doc["tree"]["containers"][""][1].append("")


def _empty_in_a_dict(doc: dict) -> None:
    doc["tree"]["containers"]["model"][1].append("")


def _repeated(doc: dict) -> None:
    doc["tree"]["containers"]["model"][1].append("w")


def _not_indices(doc: dict) -> None:
    doc["tree"]["containers"]["model"] = ["list", [0, 0]]


def _tensor_and_value(doc: dict) -> None:
    doc["tree"]["values"]["model/w"] = 1


KEYS = {"empty key at the root": (_empty_at_root, "container '<root>' has an empty key"),
        "empty key in a dict": (_empty_in_a_dict, "container 'model' has an empty key"),
        "repeated key": (_repeated, "container 'model' repeats the key 'w'"),
        "sequence keys not indices": (_not_indices, "list container 'model' has keys"),
        "tensor and value": (_tensor_and_value, "key 'model/w' is both a tensor and a value")}


@pytest.mark.parametrize("case", list(KEYS))
def test_empty_or_repeated_keys_are_refused_at_read(tmp_path, case, capsys):
    craft, says = KEYS[case]
    root = tmp_path / "run"
    _, new = two_versions(root)
    path = new / "stage-000.bin"
    doc = json.loads(parts(path.read_bytes())[2])
    craft(doc)
    rewrite(path, MAGIC, json.dumps(doc).encode())
    with pytest.raises(CorruptFile, match=f"{path}: {says}"):
        RankFile(path)
    falls_back(root, says)
    assert cli(["export", str(root), str(tmp_path / "m.pt")]) == 1
    assert says in one_line(capsys)
    assert cli(["diff", str(root), "1", "2"]) == 1
    assert says in one_line(capsys)


@pytest.mark.parametrize("state", [{"": torch.ones(1)}, {"model": {"": 1}}])
def test_an_empty_key_is_refused_at_save_naming_it(tmp_path, state):
    with Checkpointer(tmp_path) as ck, pytest.raises(ValueError, match="key '' at .* is empty"):
        ck.save(1, state)


# --------------------------------------------------------------------------------- format-1 dtypes
class Reduced:
    """Pickles as ``fn(*args)`` followed by ``__setstate__(state)``, as numpy's own values do."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def dtype(name: str, elsize: int = -1, order: str = "<") -> Reduced:
    return Reduced(np.dtype, (name, False, True), (3, order, None, None, None, elsize, -1, 0))


def numpy_fn(module: str, name: str):
    import importlib  # noqa: PLC0415

    return getattr(importlib.import_module(f"numpy._core.{module}"), name)


def array(buf: bytes, dt: Reduced, shape: tuple[int, ...]) -> Reduced:
    return Reduced(numpy_fn("numeric", "_frombuffer"), (bytearray(buf), dt, shape, "C"))


def number(dt: Reduced, data: bytes) -> Reduced:
    return Reduced(numpy_fn("multiarray", "scalar"), (dt, data))


def legacy_pickle(obj) -> bytes:
    """``pickle.dumps`` as format 1 wrote it: TensorEntry under the module name old headers use."""
    old = TensorEntry.__module__
    TensorEntry.__module__ = "hybridpar.checkpoint.format"
    try:
        return pickle.dumps(obj, protocol=5)
    finally:
        TensorEntry.__module__ = old


def as_format_1(path: Path, value) -> None:
    """Rewrite ``path`` as a format-1 file whose tree holds ``value`` under the key ``crafted``."""
    with RankFile(path) as f:
        table, tree = list(f.table.values()), f.flat_tree
    root_kind, root_keys = tree.containers[""]
    containers = {**tree.containers, "": (root_kind, [*root_keys, "crafted"])}
    values = {**tree.values, "crafted": value}
    doc = {"format": 1, "tensors": table, "tree": legacy_pickle((values, containers))}
    rewrite(path, MAGIC_V1, legacy_pickle(doc))


DTYPES = {
    "void dtype, item size -1": (number(dtype("V4", -1, "|"), b"abcd"), "numpy dtype 'V4', not one of"),
    "item size 2**40": (number(dtype("f4", 1 << 40), b"abcd"), "states item size 1099511627776, its real "
                                                                "size is 4"),
    "float32 stated 8 bytes": (array(bytes(16), dtype("f4", 8), (2,)),
                               "states item size 8, its real size is 4"),
    "bytes not shape x size": (array(bytes(8), dtype("f8"), (2,)), "holds 16 bytes, its data is 8"),
    "number of 8 bytes as f4": (number(dtype("f4"), bytes(8)), "numpy float32 number is 8 bytes, not 4"),
    "a structured dtype": (number(Reduced(np.dtype, ("f4", False, True),
                                          (3, "<", None, ("a",), {"a": 1}, -1, -1, 0)), b"abcd"),
                           "not a plain numeric dtype's"),
}


@pytest.mark.parametrize("case", list(DTYPES))
def test_format_1_numpy_dtypes_come_from_an_allow_list_with_real_sizes(tmp_path, case):
    value, says = DTYPES[case]
    root = tmp_path / "run"
    _, new = two_versions(root)
    path = new / "global.bin"
    as_format_1(path, value)
    with pytest.raises(CorruptFile, match=f"{path}: .*{says}"):
        RankFile(path)


def test_real_numpy_values_in_format_1_still_load(tmp_path):
    root = tmp_path / "run"
    _, new = two_versions(root)
    path = new / "global.bin"
    rng = np.random.RandomState(3).get_state()
    value = {"rng": rng, "f": np.float32(2.5), "c": np.complex64(1j), "big": np.arange(3, dtype=">i8"),
             "dt": np.dtype("f8"), "b": np.bool_(True)}
    as_format_1(path, value)
    with RankFile(path) as f:
        got = f.flat_tree.values["crafted"]
    assert np.array_equal(got["rng"][1], rng[1]) and got["rng"][1].dtype == np.uint32
    assert got["f"] == np.float32(2.5) and type(got["f"]) is np.float32 and got["c"] == np.complex64(1j)
    assert got["big"].dtype == np.dtype(">i8") and list(got["big"]) == [0, 1, 2]
    assert got["dt"] == np.dtype("f8") and got["b"] == np.True_
    assert not any(isinstance(v, DtypeSpec) for v in got.values())


# ------------------------------------------------------------------------------------------- export
def test_export_never_replaces_a_file_unasked(tmp_path, capsys):
    root = tmp_path / "run"
    two_versions(root)
    out = tmp_path / "m.pt"
    out.write_bytes(b"someone else's file")
    assert cli(["export", str(root), str(out)]) == 2
    assert f"output {out} exists; pass --overwrite to replace it" in one_line(capsys)
    assert out.read_bytes() == b"someone else's file"
    assert cli(["export", str(root), str(out), "--overwrite"]) == 0
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((4,), 2.0))
    assert cli(["export", str(root), str(tmp_path)]) == 2
    assert "is a directory" in one_line(capsys)


def test_export_into_a_missing_folder_is_one_line(tmp_path, capsys):
    root = tmp_path / "run"
    two_versions(root)
    assert cli(["export", str(root), str(tmp_path / "nope" / "m.pt")]) == 2
    assert f"output folder {tmp_path / 'nope'} does not exist; export does not create folders" \
        in one_line(capsys)
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_exports_get_the_users_umask(tmp_path, umask, capsys):
    root = tmp_path / "run"
    two_versions(root)
    out = tmp_path / "out"
    out.mkdir()
    old = os.umask(umask)
    try:
        for name in ("m.pt", "m.safetensors"):
            assert cli(["export", str(root), str(out / name)]) == 0
            assert (out / name).stat().st_mode & 0o777 == 0o666 & ~umask, name
    finally:
        os.umask(old)
    assert sorted(p.name for p in out.iterdir()) == ["m.pt", "m.safetensors"]  # no temporary left


def test_a_failed_export_leaves_nothing(tmp_path, capsys, monkeypatch):
    root = tmp_path / "run"
    two_versions(root)
    out = tmp_path / "out"
    out.mkdir()

    def full_disk(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(torch, "save", full_disk)
    assert cli(["export", str(root), str(out / "m.pt")]) == 1
    assert f"{out / 'm.pt'}: cannot write (No space left on device)" in one_line(capsys)
    assert list(out.iterdir()) == []


def test_write_new_is_a_checkpoint_error_naming_the_file(tmp_path):
    from hybridpar.checkpoint.export import write_new  # noqa: PLC0415

    def boom(tmp: Path) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    with pytest.raises(CheckpointError, match=r"m\.pt: cannot write \(Permission denied\)"):
        write_new(tmp_path / "m.pt", boom)
    assert list(tmp_path.iterdir()) == []


def test_a_manifest_that_is_a_directory_leaks_no_descriptor(tmp_path):
    """MANIFEST.json a directory: one CorruptFile naming it, every descriptor opened for it closed
    (counted in /proc/self/fd, 50 reads), and load falls back to the older version."""
    root = tmp_path / "run"
    _, new = two_versions(root)
    (new / mf.MANIFEST).unlink()
    (new / mf.MANIFEST).mkdir()
    fds = Path("/proc/self/fd")
    if not fds.is_dir():
        pytest.skip("no /proc/self/fd to count descriptors in")
    before = len(list(fds.iterdir()))
    for _ in range(50):
        with pytest.raises(CorruptFile, match=f"{new / mf.MANIFEST}: "):
            mf.read(new)
    assert len(list(fds.iterdir())) == before
    falls_back(root, str(new / mf.MANIFEST))
