"""Every generator family's answers against an independent brute force."""

from __future__ import annotations

import itertools
import json
from math import gcd
from pathlib import Path
from typing import Any

import pytest

from tmas.data.generators import FAMILIES, TILE_SETS, generate
from tmas.errors import InputError
from tmas.problems import load_problems


def brute_tilings(n: int, blocks: tuple[int, ...]) -> int:
    """Fill a 2 x n grid cell by cell (first empty cell in column-major order), trying every tile placement."""
    shapes = [(1, 2), (2, 1)] + [(w, 2) for w in blocks]  # (width, height)

    def fill(grid: frozenset[tuple[int, int]]) -> int:
        empty = next(((c, r) for c in range(n) for r in range(2) if (c, r) not in grid), None)
        if empty is None:
            return 1
        c0, r0 = empty
        total = 0
        for w, h in shapes:
            cells = {(c0 + dc, r0 + dr) for dc in range(w) for dr in range(h)}
            if all(c < n and r < 2 and (c, r) not in grid for c, r in cells):
                total += fill(grid | cells)
        return total

    return fill(frozenset())


def brute(family: str, p: dict[str, Any]) -> int:
    if family == "tiling":
        return brute_tilings(p["n"], TILE_SETS[p["tiles"]])
    if family == "recurrence":
        a, b = p["a0"], p["a1"]
        for _ in range(p["n"] - 1):
            a, b = b, p["p"] * b + p["q"] * a
        value = b if p["n"] >= 1 else a
        return value % p["mod"] if p["mod"] else value
    if family == "modular":
        value = 1
        for _ in range(p["exponent"]):
            value = value * p["base"] % p["modulus"]
        return value % p["modulus"]
    if family == "combinatorics":
        return sum(
            all(b - a > 1 for a, b in itertools.pairwise(s))
            for s in itertools.combinations(range(1, p["n"] + 1), p["k"])
        )
    if family == "digits":
        return sum(sum(map(int, str(k))) == p["target"] for k in range(1, p["limit"] + 1))
    if family == "diophantine":
        coefficients, total = p["coefficients"], p["total"]
        ranges = [range(total // c + 1) for c in coefficients]
        return sum(
            sum(c * x for c, x in zip(coefficients, xs, strict=True)) == total for xs in itertools.product(*ranges)
        )
    if family == "coprime":
        return sum(gcd(k, p["modulus"]) == 1 for k in range(1, p["limit"] + 1))
    raise AssertionError(family)


def test_there_are_at_least_six_families() -> None:
    assert len(FAMILIES) >= 6


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("level", [1, 2, 3])
def test_answers_match_brute_force(family: str, level: int) -> None:
    for record in generate(family, 4, seed=7, level=level):
        if family == "tiling" and record["params"]["n"] > 16:
            continue  # the enumeration grows exponentially; the recurrence is exercised by smaller boards
        assert record["answer"] == str(brute(family, record["params"])), record


def test_the_paper_case_study_count() -> None:
    # Appendix C: 2x4 board with 2x1, 2x2 and 2x4 tiles has T_4 = 12 tilings.
    assert brute_tilings(4, (2, 4)) == 12
    from tmas.data.generators import tilings_2xn

    assert tilings_2xn(4, (2, 4)) == 12


def test_generation_is_seeded_and_writes_loadable_jsonl(tmp_path: Path) -> None:
    first = list(generate("all", 3, seed=1, level=2))
    assert first == list(generate("all", 3, seed=1, level=2))
    assert first != list(generate("all", 3, seed=2, level=2))
    assert len({r["problem_id"] for r in first}) == len(first) == 3 * len(FAMILIES)
    path = tmp_path / "g.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in first))
    problems = load_problems(path)
    assert problems[0].metadata["family"] == "tiling" and problems[0].answer is not None


def test_bad_arguments_are_refused_before_writing() -> None:
    with pytest.raises(InputError, match="unknown family"):
        generate("nope", 1)
    with pytest.raises(InputError, match="levels"):
        generate("tiling", 1, level=9)
