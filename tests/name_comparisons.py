"""The AST check behind the tests that keep a registered name (a method's, a MATTRL domain's) from being compared
outside its own declarations."""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path


def name_comparisons(path: Path, names: Collection[str]) -> list[str]:
    """Comparisons of a value with one of ``names`` (``== "tmas"``, ``in ("math", ...)``) in one file, as
    ``FILE:LINE compares with 'NAME'``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.Compare):
            continue
        for side in [node.left, *node.comparators]:
            consts = side.elts if isinstance(side, ast.Tuple | ast.List | ast.Set) else [side]
            hits = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
            found += [f"{path.name}:{node.lineno} compares with {h!r}" for h in hits]
    return found
