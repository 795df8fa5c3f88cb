"""The paper's comparisons as sweep grids (examples/mattrl_*.toml): they load, expand to the intended points, and
every point's parameters are valid for its method."""

from __future__ import annotations

from pathlib import Path

from tmas.methods import create_method
from tmas.sweep import expand, load_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_studies_grid_points() -> None:
    points = expand(load_spec(EXAMPLES / "mattrl_studies.toml"))
    for point in points:
        create_method(point.method, point.params)
    mattrl = [p.params for p in points if p.method == "mattrl"]
    # Table 2 (3 points), Figure 2 (team sizes 1/3/7/9), Table 4 (3 pools): shared points run once.
    assert [p.method for p in points].count("cot") == 1
    assert sorted(p.get("team_size", 3) for p in mattrl if "pool" not in p) == [1, 3, 7, 9]
    assert sorted(p["pool"] for p in mattrl if "pool" in p) == ["pools/difference", "pools/naive", "pools/shapley"]
    assert len(points) == 8
    shared = next(p for p in points if p.params.get("pool") == "pools/naive")
    assert sorted(shared.studies) == ["credit", "table2"]


def test_fewshot_grid() -> None:
    spec = load_spec(EXAMPLES / "mattrl_fewshot.toml")
    assert spec.problems is not None and spec.problems.endswith("problems_fewshot.jsonl")
    [point] = expand(spec)
    create_method(point.method, point.params)
    assert point.params == {"iterations": 3, "team_size": 3}
