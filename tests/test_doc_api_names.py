"""Every dotted name under ``tmas`` the README and the pages under docs/ write in backticks (a module, a class, a
function, a member: `tmas.api.aresume`, `tmas.runner.Unreachable`) is one a user can import or reach."""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
NAME = re.compile(r"`(tmas(?:\.[A-Za-z_]\w*)+)")
# Written like a dotted name but none: the config file, and the reply's `tmas` object's field (docs/serve.md).
NOT_PYTHON = {"tmas.toml", "tmas.notices"}


def reach(name: str) -> Any:
    """The object ``name`` names: its longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: ModuleType | Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise ModuleNotFoundError(name)


def test_a_name_that_is_not_there_is_found_missing() -> None:
    reach("tmas.runner.StoreFailed")
    with pytest.raises(AttributeError):
        reach("tmas.errors.StoreError")


@pytest.mark.parametrize("page", PAGES)
def test_documented_python_names_exist(page: str) -> None:
    names = set(NAME.findall((ROOT / page).read_text())) - NOT_PYTHON
    missing = []
    for name in sorted(names):
        try:
            reach(name)
        except (AttributeError, ModuleNotFoundError) as exc:
            missing.append(f"{name} ({exc})")
    assert not missing, f"{page} names what tmas does not have: {missing}"
