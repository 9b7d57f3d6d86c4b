"""Rules of the code's shape that a reviewer would otherwise check by hand (no process group, no
model). The two that read code (the import graph, the layer-type tests) are also run on small examples
that break them, so that neither can pass by seeing nothing:

* the import graph of ``hybridpar/`` and ``cosmoflow/`` has no cycle, counting imports inside
  functions and the package ``__init__`` files an import runs (importing ``a.b`` runs ``a/__init__``
  first); ``TYPE_CHECKING`` blocks never run and do not count;
* the modules once caught in a cycle import first in a fresh interpreter, with their package's root
  ``__init__`` not run (it would otherwise fix the order: ``hybridpar.grid`` imported fine only after
  it);
* ``hybridpar/nn`` (the layers) imports nothing from ``hybridpar/pipeline`` (the engine built on them);
* no two hybridpar modules share a basename;
* no hybridpar module outside ``hybridpar/nn/`` tests a torch layer's type, however spelled
  (``isinstance``/``issubclass`` of ``nn.X``, ``torch.nn.X`` or a name imported from ``torch.nn``,
  ``type(m) is X``, ``m.__class__ == X``, ``case nn.X():``): a layer's facts live in its registry
  entry. ``cosmoflow/`` is the application: its own model may ask.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from collections import Counter
from functools import lru_cache
from pathlib import Path

import hybridpar

ROOT = Path(hybridpar.__file__).parent.parent
SCANNED = ("hybridpar", "cosmoflow")
PACKAGE = ROOT / "hybridpar"
ALLOWED_TYPES = {"Module", "Parameter", "Sequential", "ModuleList", "ModuleDict", "ParameterList",
                 "ParameterDict", "LazyModuleMixin"}  # containers, and a state of any module: not layers
FIRST = ("hybridpar.grid", "hybridpar.process.launchers", "hybridpar.flops", "hybridpar.nn",
         "cosmoflow.experiments.reference")
"""Modules once caught in a cycle: each is imported first, on its own, in a fresh interpreter."""


# ------------------------------------------------------------------------------------ the import graph
def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name (a package by its ``__init__``)."""
    out = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _parents(name: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``name`` does, outermost first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of nodes inside ``if TYPE_CHECKING:`` blocks (never run)."""
    return {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test).endswith("TYPE_CHECKING") for b in node.body for n in ast.walk(b)}


def _imports(name: str, path: Path, modules: dict[str, Path]) -> dict[str, int]:
    """The scanned modules whose code runs when ``name``'s code does (at any depth of it), each with the
    line of the first import that runs it.

    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so those count, except the
    packages enclosing ``name`` itself: they have started before ``name`` runs, whatever imported it.
    ``from a import X`` with ``X`` not a submodule needs ``a/__init__`` to have defined ``X``, so it counts
    even where ``a`` encloses ``name``.
    """
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    enclosing = set(_parents(name))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def runs(target: str, needs_attribute: bool, line: int) -> None:
        for m in [*_parents(target), target]:
            if m in modules and m != name and (m not in enclosing or (needs_attribute and m == target)):
                found.setdefault(m, line)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                runs(a.name, False, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    runs(sub, False, node.lineno)
                else:
                    runs(base, True, node.lineno)
    return found


@lru_cache
def _graph(root: Path, packages: tuple[str, ...]) -> tuple[dict[str, dict[str, int]], dict[str, Path]]:
    modules = _modules(root, packages)
    return {name: _imports(name, path, modules) for name, path in modules.items()}, modules


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _say(comp: list[str], graph: dict[str, dict[str, int]], modules: dict[str, Path], root: Path) -> str:
    """One cycle through ``comp`` (shortest from its first module back to it), each step with the line
    that makes it."""
    start, prev, todo = comp[0], {}, [comp[0]]
    while todo and start not in prev:
        nxt = []
        for v in todo:
            for w in sorted(graph[v]):
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    path, v = [start], prev[start]
    while v != start:
        path.append(v)
        v = prev[v]
    path = [start, *reversed(path[1:]), start]
    steps = [f"  {a} -> {b}  ({modules[a].relative_to(root)}:{graph[a][b]})" for a, b in zip(path, path[1:])]
    return f"import cycle among {len(comp)} modules ({', '.join(comp)}):\n" + "\n".join(steps)


def test_no_import_cycle_counting_init_files_and_function_level_imports():
    graph, modules = _graph(ROOT, SCANNED)
    said = [_say(c, graph, modules, ROOT) for c in _cycles(graph)]
    print("\n".join(said))
    assert not said, "\n".join(said)


def test_the_cycle_rule_sees_init_files_and_function_level_imports(tmp_path):
    """A cycle made only by a package ``__init__`` and an import inside a function is found, a
    TYPE_CHECKING import is not an edge, and each step names its file and line."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg.sub import b\n",
        "pkg/sub/__init__.py": "from pkg.sub.c import X\n",
        "pkg/sub/b.py": "",
        "pkg/sub/c.py": "from pkg import a\nX = 1\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "from pkg import d\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph, modules = _graph(tmp_path, ("pkg",))
    assert _cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.c"]]
    said = _say(["pkg.a", "pkg.sub", "pkg.sub.c"], graph, modules, tmp_path)
    assert "pkg.a -> pkg.sub  (pkg/a.py:2)" in said and "pkg.sub.c -> pkg.a  (pkg/sub/c.py:1)" in said, said


def test_layers_import_nothing_from_the_pipeline():
    graph, modules = _graph(ROOT, SCANNED)

    def inside(m: str, pkg: str) -> bool:
        return m == pkg or m.startswith(pkg + ".")

    said = [f"{modules[m].relative_to(ROOT)}:{line} imports {t}"
            for m in sorted(graph) if inside(m, "hybridpar.nn")
            for t, line in sorted(graph[m].items()) if inside(t, "hybridpar.pipeline")]
    assert not said, "\n".join(said)


_FIRST_IMPORT = textwrap.dedent("""
    import importlib, os, sys, traceback, types
    import h5py, numpy, torch, yaml  # what every child imports anyway: once, here
    root, children = sys.argv[1], {}
    for name in sys.argv[2:]:
        pid = os.fork()
        if pid == 0:  # a child that has imported nothing of the scanned packages
            try:
                top = name.partition(".")[0]
                bare = types.ModuleType(top)  # the root's __init__ would run first and fix the order
                bare.__path__ = [os.path.join(root, top)]
                sys.modules[top] = bare
                importlib.import_module(name)
            except BaseException:
                os.write(2, f"importing {name} first:\\n{traceback.format_exc()}".encode())
                os._exit(1)
            os._exit(0)
        children[pid] = name
    failed = sorted(name for pid, name in children.items() if os.waitpid(pid, 0)[1])
    print("failed:", " ".join(failed))
    sys.exit(1 if failed else 0)
""")


def test_fragile_modules_import_first_in_a_fresh_interpreter():
    """One interpreter imports torch once, then forks a child per module, which imports it first."""
    proc = subprocess.run([sys.executable, "-c", _FIRST_IMPORT, str(ROOT), *FIRST], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]


def test_no_two_modules_share_a_basename():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not [n for n, k in names.items() if k > 1], names.most_common(5)


# ------------------------------------------------------------------------- asking a layer its type
def _torch_names(tree: ast.AST) -> dict[str, str]:
    """What each name bound by an import in ``tree`` stands for, where it is ``torch`` or inside it."""
    out = {"nn": "torch.nn"}  # a bare ``nn`` is torch's unless the file binds it otherwise
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out[a.asname or a.name.partition(".")[0]] = a.name if a.asname else a.name.partition(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _torch_layer(node: ast.AST, names: dict[str, str]) -> str | None:
    """The dotted torch layer type ``node`` names (``torch.nn.Conv3d``), or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in names:
        return None
    dotted = ".".join([names[node.id], *reversed(parts)])
    last = dotted.rpartition(".")[2]
    if dotted.startswith("torch.nn.") and last.lstrip("_")[:1].isupper() and last not in ALLOWED_TYPES:
        return dotted
    return None


def _layer_types_in(node: ast.AST, names: dict[str, str]) -> list[str]:
    """The layer types ``node`` (a type, or a tuple or union of them) names: torch's, and the library's
    own tuples of them (``CONV_ND``, ``..._NORM``, ``..._BASE``)."""
    out = []
    for t in ast.walk(node):
        found = _torch_layer(t, names)
        if found:
            out.append(found)
        elif isinstance(t, ast.Name) and t.id.isupper() and t.id.endswith(("_ND", "NORM", "_BASE")):
            out.append(t.id)
    return out


def _is_type_of(node: ast.AST) -> bool:
    """``type(x)`` or ``x.__class__``."""
    return (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "type" and len(node.args) == 1) \
        or (isinstance(node, ast.Attribute) and node.attr == "__class__")


def _asks_layer_type(source: str) -> list[tuple[int, str]]:
    """Each place ``source`` tests an object's type against a layer type: (line, the expression)."""
    tree = ast.parse(source)
    names = _torch_names(tree)
    said = []
    for node in ast.walk(tree):
        types: list[str] = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass") \
                and len(node.args) == 2:
            types = _layer_types_in(node.args[1], names)
        elif isinstance(node, ast.Compare) and any(_is_type_of(s) for s in [node.left, *node.comparators]):
            types = [t for s in [node.left, *node.comparators] for t in _layer_types_in(s, names)]
        elif isinstance(node, ast.MatchClass):
            types = _layer_types_in(node.cls, names)
        if types:
            said.append((node.lineno, ast.unparse(node)))
    return said


def test_no_layer_type_asked_outside_nn():
    said = [f"{path.relative_to(ROOT)}:{line} {text}" for path in sorted(PACKAGE.rglob("*.py"))
            if not path.is_relative_to(PACKAGE / "nn") for line, text in _asks_layer_type(path.read_text())]
    assert not said, "ask the layer's registry entry instead:\n" + "\n".join(said)


def test_the_layer_type_rule_sees_every_spelling():
    asked = {
        "from torch import nn\nisinstance(m, nn.Conv3d)": 2,
        "import torch\nisinstance(m, (torch.nn.Conv3d, torch.nn.MaxPool3d))": 2,
        "import torch.nn as tnn\nissubclass(c, tnn.modules.conv._ConvNd)": 2,
        "from torch.nn import Conv3d\nisinstance(m, Conv3d)": 2,
        "from torch.nn import Conv3d as C\nok = isinstance(m, int | C)": 2,
        "from torch.nn.modules.batchnorm import _BatchNorm\nisinstance(m, _BatchNorm)": 2,
        "from torch import nn\ntype(m) is nn.Conv3d": 2,
        "import torch\nif type(m) in (torch.nn.Conv3d, torch.nn.Linear):\n    pass": 2,
        "from torch import nn\nm.__class__ != nn.BatchNorm3d": 2,
        "from torch.nn import Conv3d\nmatch m:\n    case Conv3d():\n        pass": 3,
        "isinstance(m, CONV_ND)": 1,
    }
    for source, line in asked.items():
        assert [s[0] for s in _asks_layer_type(source)] == [line], source
    fine = [
        "from torch import nn\nisinstance(m, (nn.Module, nn.Parameter))",
        "import torch\ntype(t) not in (torch.Tensor, torch.nn.Parameter)",
        "from torch import nn\nx = nn.Conv3d(1, 1, 3)\ntype(x) is dict",
        "from hybridpar import nn\nisinstance(m, nn.registry.LayerEntry) and False",
        "import torch\nisinstance(f, torch.nn.functional.relu.__class__)",
    ]
    assert [s for s in fine if _asks_layer_type(s)] == []
