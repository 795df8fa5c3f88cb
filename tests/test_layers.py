"""Imports point down only (docs/architecture.md, "The layers"): checked on the source, module by module."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "tmas"


def _imports(path: Path) -> set[str]:
    """The tmas modules ``path`` imports, at module level or inside functions (TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            if node.module == "tmas":
                found.update(f"tmas.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name == "tmas" or name.startswith("tmas.")}


def _files(package: str) -> list[Path]:
    root = SRC / package
    return sorted(root.rglob("*.py")) if root.is_dir() else [SRC / f"{package}.py"]


def _offenders(packages: list[str], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for package in packages:
        for path in _files(package):
            for name in sorted(_imports(path)):
                if name in forbidden or name.startswith(tuple(f"{f}." for f in forbidden)):
                    out.append(f"{path.relative_to(SRC)} imports {name}")
    return out


def test_config_is_below_the_llm_layer() -> None:
    assert _offenders(["config"], ("tmas.llm",)) == []


def test_the_store_does_not_import_the_package_root() -> None:
    # `tmas` (the root) lazily reaches the public API, which sits above everything; the version has its own module.
    assert [str(p.relative_to(SRC)) for p in _files("store") if {"tmas", "tmas.__version__"} & _imports(p)] == []
    assert _offenders(["store"], ("tmas.api",)) == []


def test_the_credits_writer_does_not_import_the_viewer() -> None:
    assert (
        _offenders(["pool", "grading", "reports", "rl", "methods", "agents", "memory", "llm", "store"], ("tmas.view",))
        == []
    )


def test_methods_agents_and_memory_see_the_model_only_through_the_protocol() -> None:
    # The HTTP client is built by the entry points (runner, CLI commands, builders); logic takes a ChatModel.
    assert _offenders(["methods", "agents", "memory"], ("tmas.llm.client",)) == []
