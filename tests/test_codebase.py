"""Rules of the code's shape that a reviewer would otherwise check by hand (no process group, no
model): the package's import graph has no cycle, even counting imports inside functions; no two
modules share a basename; no module outside ``hybridpar/nn/`` asks ``isinstance`` of a torch layer
type (a layer's facts live in its registry entry)."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import hybridpar

PACKAGE = Path(hybridpar.__file__).parent
ALLOWED_TYPES = {"Module", "Parameter", "Sequential", "ModuleList", "ModuleDict", "ParameterList",
                 "ParameterDict"}  # containers, not layers


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every hybridpar module ``name`` imports, at any depth of its code (TYPE_CHECKING blocks aside:
    they never run)."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and ast.unparse(node.test).endswith("TYPE_CHECKING") for b in node.body for n in ast.walk(b)}
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def test_no_import_cycle_counting_function_level_imports():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                cycle = visit(n)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_two_modules_share_a_basename():
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert not [n for n, k in names.items() if k > 1], names.most_common(5)


def test_no_isinstance_on_torch_layer_types_outside_nn():
    said = []
    for path in PACKAGE.rglob("*.py"):
        if path.is_relative_to(PACKAGE / "nn"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance"):
                continue
            if len(node.args) == 2:
                for t in ast.walk(node.args[1]):
                    if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "nn" \
                            and t.attr not in ALLOWED_TYPES:
                        said.append(f"{path.relative_to(PACKAGE)}:{node.lineno} isinstance(..., nn.{t.attr})")
                    if isinstance(t, ast.Name) and t.id.isupper() and t.id.endswith(("_ND", "NORM", "_BASE")):
                        said.append(f"{path.relative_to(PACKAGE)}:{node.lineno} isinstance(..., {t.id})")
    assert not said, "\n".join(said)
