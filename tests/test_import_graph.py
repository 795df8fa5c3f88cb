"""The import graph of src/tmas, read from the source: no circle between modules or between packages, and no module
importing one from a layer above its own (docs/architecture.md, "The layers").

Every import counts: at module level, inside functions, and under ``TYPE_CHECKING`` (a circle in the types is still
one for a reader). A package (or top-level module) not placed in ``LAYERS`` fails the test, so a new one is placed.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# Top first; a package may import from its own layer (the circle checks keep that acyclic) and the layers below.
LAYERS: tuple[tuple[str, ...], ...] = (
    # Entry points; the package root reaches the public API lazily, the test helpers start the proxy.
    ("tmas", "__main__", "cli", "serve", "view", "testing"),
    # Running problem sets: the public API, runs, sweeps, their planning, and problem data (the filter runs a model).
    ("api", "runner", "sweep", "planning", "data"),
    ("reports", "rl", "pool"),
    ("grading",),
    ("methods",),
    ("agents", "memory"),
    ("llm", "store"),
    ("config", "errors", "version", "problems", "jsonl", "files", "answers", "answer_classes", "answer_rules"),
)

Graph = Mapping[str, set[str]]


def _modules(src: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((src / "tmas").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """Module -> the tmas modules it imports (``from tmas.x import y`` names module ``tmas.x.y`` where that is one)."""
    modules = _modules(src)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        names: list[str] = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names += [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
        found = {known(name) for name in names if name == "tmas" or name.startswith("tmas.")}
        graph[module] = {name for name in found if name is not None and name != module}
    return graph


def package_of(module: str) -> str:
    """``tmas.grading.judge`` -> ``grading``; ``tmas.runner`` -> ``runner``; the root -> ``tmas``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def package_graph(graph: Graph) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {package_of(m): set() for m in graph}
    for module, imported in graph.items():
        out[package_of(module)] |= {package_of(i) for i in imported} - {package_of(module)}
    return out


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components with more than one member (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def upward(graph: Graph, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every import of a module in a layer above the importer's, as ``importer -> imported``."""
    level = {package: depth for depth, packages in enumerate(layers) for package in packages}
    return [
        f"{module} -> {imported}"
        for module, imports in sorted(graph.items())
        for imported in sorted(imports)
        if level[package_of(imported)] < level[package_of(module)]
    ]


def test_every_package_has_a_layer() -> None:
    placed = {package for packages in LAYERS for package in packages}
    assert sorted({package_of(m) for m in import_graph()} - placed) == []


def test_no_module_imports_another_that_imports_it_back() -> None:
    assert circles(import_graph()) == []


def test_no_package_imports_another_that_imports_it_back() -> None:
    assert circles(package_graph(import_graph())) == []


def test_no_module_imports_from_a_layer_above() -> None:
    assert upward(import_graph()) == []


def test_the_checks_find_a_circle_and_an_upward_import(tmp_path: Path) -> None:
    for name, text in {
        "tmas/__init__.py": "",
        "tmas/config.py": "from tmas.runner import run\n",
        "tmas/runner.py": "import tmas.config\n",
        "tmas/grading/__init__.py": "",
        "tmas/grading/one.py": "if TYPE_CHECKING:\n    from tmas.grading import two\n",
        "tmas/grading/two.py": "def f() -> None:\n    from tmas.grading.one import g\n",
        "tmas/reports/__init__.py": "",
        "tmas/reports/table.py": "from tmas.grading.one import g\n",
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text, encoding="utf-8")
    graph = import_graph(tmp_path)
    assert circles(graph) == [["tmas.config", "tmas.runner"], ["tmas.grading.one", "tmas.grading.two"]]
    assert circles(package_graph(graph)) == [["config", "runner"]]
    assert upward(graph) == ["tmas.config -> tmas.runner"]
