"""MATTRL's domains are declared objects (``tmas.methods.mattrl_domains``): nothing outside the declarations compares a
domain's name, and every declaration is whole (a grader that exists, features for the router, one procedure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from name_comparisons import name_comparisons
from tmas.grading.registry import GRADERS
from tmas.methods.mattrl_domains import DOMAINS

SRC = Path(__file__).resolve().parents[1] / "src" / "tmas"
DECLARATIONS = SRC / "methods" / "mattrl_domains"


def domain_name_comparisons(path: Path) -> list[str]:
    """Comparisons of a value with a declared domain's name (``== "medicine"``, ``in ("math", ...)``) in one file."""
    return name_comparisons(path, set(DOMAINS))


def outside_the_declarations(src: Path) -> list[Path]:
    declarations = src / "methods" / "mattrl_domains"
    return [p for p in sorted(src.rglob("*.py")) if declarations not in p.parents]


def test_no_code_outside_the_declarations_compares_a_domain_name() -> None:
    assert [hit for p in outside_the_declarations(SRC) for hit in domain_name_comparisons(p)] == []


def test_the_comparison_finder_finds_one(tmp_path: Path) -> None:
    """The check above can fail: planted comparisons are found, one per name compared."""
    planted = tmp_path / "pkg" / "planted.py"
    planted.parent.mkdir()
    planted.write_text('def f(d):\n    return d == "medicine" or d in ("math", "x") or "education" != d\n')
    assert len(domain_name_comparisons(planted)) == 3


@pytest.mark.parametrize("name", sorted(DOMAINS))
def test_each_declaration_is_whole(name: str) -> None:
    domain = DOMAINS[name]
    assert domain.name == name
    # One procedure: a deliberation with its peer review, or a teaching dialogue.
    assert (domain.review is None) == domain.teaching
    # Its grader is a registered one, and a domain graded by its own grader reports metrics.
    assert domain.grader is None or domain.grader in GRADERS
    assert bool(domain.metrics) == (domain.grader is not None)
    # The report's table of those metrics says what they are.
    assert bool(domain.metrics_note) == bool(domain.metrics)
    # The router reads the same features of every case of the domain.
    assert domain.case_features("", {}) and set(domain.case_features("Q?", {})) == set(domain.case_features("", {}))
    assert 1 <= len(domain.default_team(3, {})) <= 3
