"""The package's layers (``STYLE.md``), held by reading every module's imports.

Every import counts: module level, under ``if TYPE_CHECKING:`` and inside functions (a
deferred import is an arrow all the same). The rules:

- no import circle between shardio's modules;
- no upward import (L0 errors ... L7 cli); runtime goes through read/, not staging/ or storage/;
- torch and DALI only in runtime/, dali/, checkpoint/ and bench/;
- no module imports the package face ``shardio`` itself;
- a package face imports none of its submodules at import time (names load on first use);
- ``import shardio.read.reader`` loads no stager, exporter, HTTP server or torch.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "shardio"

LAYERS = {
    "errors": 0, "units": 0, "_check": 0, "_lazy": 0, "_version": 0, "_env": 0, "_pool": 0,
    "_deprecated": 0,
    "storage": 1, "order": 1, "topology": 1,
    "format": 2, "metrics": 2,
    "writers": 3, "staging": 3, "cache": 3, "parity": 3,
    "packing": 4, "read": 4,
    "tools": 5, "runtime": 5, "dali": 5,
    "checkpoint": 5,
    "bench": 6,
    "cli": 7, "__main__": 7,
}  # fmt: skip
TORCH_HOMES = {"runtime", "dali", "bench", "checkpoint"}
# DALI's face is the use (``import shardio.dali`` checks for DALI, then loads its pipeline
# module, which imports no DALI until a pipeline is built).
EAGER_FACES = {"shardio.dali"}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: pathlib.Path) -> Iterator[tuple[str, ast.stmt, bool]]:
    """(imported module, the statement, whether it runs at import time) for every import."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    tree = ast.parse(path.read_text(), str(path))
    eager: set[int] = set()

    def mark(body: list[ast.stmt]) -> None:  # module-level statements, outside TYPE_CHECKING
        for stmt in body:
            eager.add(id(stmt))
            if isinstance(stmt, ast.If) and "TYPE_CHECKING" not in ast.unparse(stmt.test):
                mark(stmt.body)
                mark(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                mark(stmt.body)
                for handler in stmt.handlers:
                    mark(handler.body)

    mark(tree.body)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node, id(node) in eager
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                full = f"{module}.{alias.name}"
                yield (full if full in MODULES else module), node, id(node) in eager


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


EDGES = {
    name: [(target, node, eager) for target, node, eager in _imports(name, path)]
    for name, path in MODULES.items()
}


def test_every_module_has_a_layer() -> None:
    unknown = sorted({t for m in MODULES if (t := _top(m)) is not None and t not in LAYERS})
    assert not unknown, f"give these a layer in LAYERS: {unknown}"


def test_no_import_circle() -> None:
    graph = {
        name: {t for t, _, _ in edges if t in MODULES and t != name and t != "shardio"}
        for name, edges in EDGES.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    assert not circles, f"import circles: {circles}"


def _violations() -> list[str]:
    found = []
    for name, edges in EDGES.items():
        here = _top(name)
        if here is None:
            continue  # the face: lazy names of every layer
        for target, node, _eager in edges:
            where = f"{MODULES[name].relative_to(PACKAGE.parent)}:{node.lineno}"
            root = target.split(".")[0]
            if root in {"torch", "nvidia"} and here not in TORCH_HOMES:
                found.append(f"{where}: {target} outside {sorted(TORCH_HOMES)}")
            if root != "shardio":
                continue
            there = _top(target)
            if there is None:
                found.append(f"{where}: imports the package face (import from its module)")
            elif LAYERS.get(there, -1) > LAYERS.get(here, -1):
                found.append(f"{where}: upward, L{LAYERS[here]} {here} -> L{LAYERS[there]} {there}")
            elif here == "runtime" and there in {"staging", "storage"}:
                found.append(f"{where}: runtime -> {there} (go through read/)")
    return found


def test_imports_follow_the_layers() -> None:
    assert not _violations(), "\n".join(_violations())


def test_package_faces_import_no_submodule_at_import_time() -> None:
    eager = []
    for name, path in MODULES.items():
        if path.name != "__init__.py" or name in EAGER_FACES:
            continue
        for target, node, at_import in EDGES[name]:
            # The face of shardio may import the bottom layer (errors, _lazy, _version).
            if at_import and target.startswith(name + ".") and LAYERS.get(_top(target) or "") != 0:
                eager.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {target}")
    assert not eager, "\n".join(eager)


@pytest.mark.parametrize(
    ("statement", "what"),
    [
        ("import shardio.read.reader", "the reader"),
        ("import shardio.order; shardio.order.OrderSpec", "the order spec"),
        ("import shardio.metrics.read", "the read counters"),
    ],
)
def test_reading_loads_no_stager_exporter_http_server_or_torch(statement: str, what: str) -> None:
    probe = (
        f"import sys; {statement}; "
        "print(' '.join(sorted(m for m in sys.modules if m == 'torch' or m == 'http.server' "
        "or m.startswith(('shardio.staging.stage', 'shardio.staging.ahead', 'shardio.metrics.'"
        "'prometheus', 'shardio.metrics._http', 'shardio.runtime', 'shardio.packing')))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == [], f"{what} ({statement}) loaded {out}"


def test_no_lazy_name_is_also_a_submodule() -> None:
    # Importing ``pkg.name`` sets the attribute ``name`` of ``pkg`` to the module, which then
    # hides the lazy name for good (``from shardio.metrics import snapshot`` got a module).
    clashes = []
    for name, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)
                and isinstance(node.value, ast.Dict)
            ):
                for key in node.value.keys:
                    if isinstance(key, ast.Constant) and f"{name}.{key.value}" in MODULES:
                        clashes.append(f"{name}.{key.value}")
    assert not clashes, clashes


def test_unit_tests_mirror_the_packages() -> None:
    """tests/unit/<name>/ holds the tests of shardio/<name>/, and nothing else is a folder
    there (the fault, property, conformance, integration, pfs, scripts and gpu suites live
    beside tests/unit)."""
    unit = pathlib.Path(__file__).resolve().parent
    folders = {p.name for p in unit.iterdir() if p.is_dir() and not p.name.startswith("_")}
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert folders <= packages, f"not a package of shardio: {sorted(folders - packages)}"
