"""The paper grids (examples/papers/*.toml): they parse and expand to the published configurations, their cost is
the count worked by hand, and every one runs end to end in process at a small size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import scripted_settings
from tmas.config import Settings
from tmas.data.case_import import read_rarebench, read_supergpqa
from tmas.memory.embedders import EndpointEmbedder
from tmas.memory.pool import Pool
from tmas.memory.pool_entry import PoolEntry
from tmas.methods import create_method
from tmas.planning.estimate import calls_per_problem
from tmas.problems import Problem
from tmas.store.run_store import RunStore
from tmas.sweep import SweepSpec, expand, load_spec, run_sweep, with_grid_sampling
from tmas.testing import ScriptedModel, SimScript

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PAPERS = EXAMPLES / "papers"
GRIDS = sorted(p.name for p in PAPERS.glob("*.toml"))

# Points per grid (shared points run once: Figure 3's default N = 8, M = 8, epsilon = 0.2 is in all three studies).
POINTS = {
    "embedded_demo.toml": 2,
    "tmas_table1_imo50.toml": 6,
    "tmas_table1_hle100.toml": 6,
    "tmas_table2_ablation.toml": 4,
    "tmas_figure3_sensitivity.toml": 10,
    "tmas_b2_additional.toml": 6,
    "mattrl_table1_medicine.toml": 2,
    "mattrl_table2_math.toml": 3,
    "mattrl_table3_education.toml": 3,
    "mattrl_team_size.toml": 4,
    "mattrl_credit.toml": 3,
    "mattrl_fewshot.toml": 1,
}


def test_every_grid_is_listed() -> None:
    assert sorted(POINTS) == GRIDS


@pytest.mark.parametrize("name", GRIDS)
def test_grid_parses_and_names_what_it_needs(name: str) -> None:
    spec = load_spec(PAPERS / name)
    points = expand(spec)
    assert len(points) == POINTS[name]
    about = spec.about
    assert about is not None and about.benchmark and about.expects and about.tables
    assert "TMAS_BASE_URL" in about.env and "TMAS_MODEL" in about.env
    assert spec.problems
    if name.startswith("tmas_"):
        assert spec.sampling is not None and (spec.sampling.temperature, spec.sampling.top_p) == (1.0, 0.95)
    for point in points:
        create_method(point.method, point.params)


def full(point_method: str, params: dict[str, Any]) -> dict[str, Any]:
    return create_method(point_method, params).params.model_dump(mode="json")


def test_table1_points_are_the_papers_settings() -> None:
    points = {p.method: full(p.method, p.params) for p in expand(load_spec(PAPERS / "tmas_table1_imo50.toml"))}
    assert set(points) == {"majority", "self_refine", "verify_refine", "pacore", "rse", "tmas"}
    tmas = points["tmas"]
    assert (tmas["n"], tmas["m"], tmas["iterations"], tmas["epsilon"]) == (8, 8, 20, 0.2)
    assert tmas["sampling"]["solution"] == {**tmas["sampling"]["solution"], "temperature": 1.0, "top_p": 0.95}
    # The output length is the preset's, not a number in the grid.
    assert (
        "max_tokens"
        not in (load_spec(PAPERS / "tmas_table1_imo50.toml").sampling or Settings().sampling).model_fields_set
    )
    assert (points["majority"]["k"], points["majority"]["iterations"]) == (64, 1)
    assert (points["verify_refine"]["n"], points["verify_refine"]["m"]) == (8, 1)
    assert points["pacore"]["responses_per_round"] == 8
    assert all(points[m]["iterations"] == 20 for m in ("self_refine", "verify_refine", "pacore", "rse", "tmas"))
    # Calls per problem: 64 + 160 + 320 + 161 + 312 + 1,640 = 2,657; on 50 problems 132,850.
    spec = load_spec(PAPERS / "tmas_table1_imo50.toml")
    per_problem = sum(calls_per_problem(create_method(p.method, p.params)).total for p in expand(spec))
    assert per_problem == 2657 and per_problem * 50 == 132_850


def test_ablation_and_sensitivity_points() -> None:
    ablation = [full(p.method, p.params) for p in expand(load_spec(PAPERS / "tmas_table2_ablation.toml"))]
    assert {(a["no_guideline"], a["no_experience"]) for a in ablation} == {
        (False, False),
        (True, False),
        (False, True),
        (True, True),
    }
    assert all(a["iterations"] == 12 for a in ablation)
    sens = [full(p.method, p.params) for p in expand(load_spec(PAPERS / "tmas_figure3_sensitivity.toml"))]
    assert sorted({s["epsilon"] for s in sens}) == [0.0, 0.1, 0.2, 0.4, 1.0]
    assert sorted({s["m"] for s in sens}) == [4, 8, 16] and sorted({s["n"] for s in sens}) == [2, 4, 8, 12]


def test_grid_sampling_sits_under_the_command_line() -> None:
    spec = load_spec(PAPERS / "tmas_table1_hle100.toml")
    base = Settings.model_validate({"sampling": {"temperature": 0.3, "max_tokens": 4096}})
    merged = with_grid_sampling(base, spec, set())
    assert (merged.sampling.temperature, merged.sampling.top_p, merged.sampling.max_tokens) == (1.0, 0.95, 4096)
    flagged = with_grid_sampling(base, spec, {"temperature"})
    assert flagged.sampling.temperature == 0.3


# ---------------------------------------------------------------------------------------------- end to end (sim)

SMALL: dict[str, dict[str, Any]] = {
    "tmas": {"n": 2, "m": 1, "iterations": 2},
    "majority": {"k": 2},
    "self_refine": {"n": 2, "iterations": 2},
    "rse": {"n": 2, "iterations": 2},
    "verify_refine": {"n": 2, "m": 1, "iterations": 2},
    "pacore": {"responses_per_round": 2, "iterations": 2},
    "mattrl": {"iterations": 1},
    "cot": {},
}


def shrink(spec: SweepSpec, problems: Path) -> SweepSpec:
    """The grid at CI size: its studies and axes as they are, small N, M, T, k, on the given problems."""
    small = spec.model_copy(deep=True)
    small.problems = str(problems)
    for study in small.study:
        study.params = {**study.params, **{k: v for m in study.all_methods() for k, v in SMALL[m].items()}}
    return small


def write(path: Path, problems: list[Problem]) -> Path:
    path.write_text("".join(p.model_dump_json() + "\n" for p in problems))
    return path


ARITHMETIC = [Problem(problem_id=f"a{i}", question=f"What is {i + 6}*9?", answer=str((i + 6) * 9)) for i in range(2)]


def problems_for(name: str, tmp_path: Path) -> Path:
    if "medicine" in name or "team_size" in name or "credit" in name or "fewshot" in name:
        cases = list(read_rarebench(EXAMPLES / "mattrl" / "medicine_rarebench.jsonl"))[:2]
        return write(tmp_path / "medicine.jsonl", cases)
    if "education" in name:
        return write(
            tmp_path / "education.jsonl", list(read_supergpqa(EXAMPLES / "mattrl" / "education_supergpqa.jsonl"))[:2]
        )
    return write(tmp_path / "problems.jsonl", ARITHMETIC)


async def make_pools(spec: SweepSpec, model: ScriptedModel) -> None:
    """Small pools at the paths the grid names (relative to the working directory), embedded by ``model``."""
    paths = {p.params["pool"] for p in expand(spec) if p.params.get("pool")}
    embed = EndpointEmbedder(model)
    for path in paths:
        pool = Pool.create(path, embed.name)
        entry = PoolEntry(id="e1", action="state the evidence first", experience="rank by the sharpest sign")
        await pool.add([entry], embed)
        pool.save()


@pytest.mark.slow
@pytest.mark.parametrize("name", GRIDS)
async def test_grid_runs_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    # Every point of the grid, in process on one scripted model.
    monkeypatch.chdir(tmp_path)  # pool paths are relative to the working directory
    spec = shrink(load_spec(PAPERS / name), problems_for(name, tmp_path))
    base = scripted_settings(endpoint__model="Qwen/Qwen3-30B-A3B-Thinking-2507")
    settings = with_grid_sampling(base, spec, set())
    model = ScriptedModel(SimScript(), settings)
    await make_pools(spec, model)
    summary = await run_sweep(spec, settings, tmp_path / "sweep", model=model)
    assert [o.status for o in summary.outcomes] == ["new"] * len(expand(spec))
    for outcome in summary.outcomes:
        assert outcome.summary is not None and outcome.summary.failed == 0, outcome.point.name
        run = tmp_path / "sweep" / "runs" / outcome.point.name
        with RunStore(run, create=False) as store:
            assert store.get_meta("paper_benchmark") == spec.about.benchmark if spec.about else True
            calls = store.call_counts()["calls"]
            sent = store.get_meta("settings")["sampling"]
        bound = calls_per_problem(create_method(outcome.point.method, outcome.point.params)).upper_total
        assert 0 < calls <= bound * outcome.summary.problems
        if name.startswith("tmas_"):
            assert (sent["temperature"], sent["top_p"]) == (1.0, 0.95)
    if name.startswith("tmas_"):
        # What was asked: every call of every method at the paper's temperature and top_p.
        assert {(call.body["temperature"], call.body["top_p"]) for call in model.calls} == {(1.0, 0.95)}
