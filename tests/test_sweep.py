"""``tmas sweep``: grid expansion, one run per point, resume after an interruption without repeating finished work,
and the combined report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import settings_for
from tmas.errors import ConfigError
from tmas.methods.base import ProblemResult
from tmas.runner import Unreachable
from tmas.sweep import PointOutcome, Study, SweepSpec, expand, load_spec, report_sweep, run_sweep
from tmas.testing import SimScript, SimServer

PROBLEMS = [("p1", "What is 12*11?", "132"), ("p2", "What is 7*8?", "56"), ("p3", "What is 9*9?", "81")]


def write_problems(path: Path) -> str:
    path.write_text("".join(json.dumps({"problem_id": i, "question": q, "answer": a}) + "\n" for i, q, a in PROBLEMS))
    return str(path)


def spec_for(problems: str) -> SweepSpec:
    return SweepSpec(
        problems=problems,
        study=[
            Study(name="baselines", methods=["cot", "majority"], params={}, grid={}),
            Study(name="refine", method="self_refine", params={"iterations": 2}, grid={"n": [1, 2]}),
        ],
    )


def test_expand_dedups_points_shared_by_studies() -> None:
    spec = SweepSpec(
        problems="x",
        study=[
            Study(name="ablation", method="tmas", params={"n": 2, "m": 1}, variants=[{}, {"no_guideline": True}]),
            Study(name="epsilon", method="tmas", params={"n": 2, "m": 1}, grid={"epsilon": [0.2, 1.0]}),
        ],
    )
    points = expand(spec)
    # epsilon = 0.2 is the default: the same run as the ablation study's plain point.
    assert len(points) == 3
    assert points[0].studies == ["ablation", "epsilon"]
    assert {p.name for p in points} == {
        "tmas__m=1__n=2",
        "tmas__m=1__n=2__no_guideline=true",
        "tmas__epsilon=1.0__m=1__n=2",
    }


def test_bad_points_fail_before_any_call() -> None:
    spec = SweepSpec(problems="x", study=[Study(method="tmas", grid={"m": [0, 4]})])
    with pytest.raises(ConfigError, match="'m'"):
        expand(spec)


def test_grid_file(tmp_path: Path) -> None:
    write_problems(tmp_path / "problems.jsonl")
    grid = tmp_path / "grid.toml"
    grid.write_text(
        'problems = "problems.jsonl"\nbudget = { calls = 4 }\n\n'
        '[[study]]\nname = "eps"\nmethod = "tmas"\nparams = { n = 2, m = 1 }\ngrid = { epsilon = [0.0, 1.0] }\n'
    )
    spec = load_spec(grid)
    assert spec.problems == str(tmp_path / "problems.jsonl")
    assert [p.name for p in expand(spec)] == [
        "tmas__epsilon=0.0__m=1__n=2__budget_calls=4",
        "tmas__epsilon=1.0__m=1__n=2__budget_calls=4",
    ]


async def test_sweep_resumes_after_interruption_without_repeating_finished_runs(tmp_path: Path) -> None:
    problems = write_problems(tmp_path / "problems.jsonl")
    spec = spec_for(problems)
    names = [p.name for p in expand(spec)]
    assert names == ["cot", "majority", "self_refine__iterations=2__n=1", "self_refine__iterations=2__n=2"]

    # The uninterrupted sweep, for reference.
    with SimServer(SimScript()) as ref:
        settings = settings_for(ref, concurrency=1)
        await run_sweep(spec, settings, tmp_path / "ref")
        total = ref.stats().total_requests

    # The same sweep, cut off by the endpoint going away in the middle of the third point (after its first problem).
    sim = SimServer(SimScript()).start()
    port = int(sim.base_url.rsplit(":", 1)[1].split("/")[0])
    settings = settings_for(sim, concurrency=1)
    finished: list[str] = []
    solved_in_third: list[str] = []

    def on_point(outcome: PointOutcome) -> None:
        finished.append(outcome.point.name)

    def on_result(result: ProblemResult) -> None:
        if len(finished) == 2:
            solved_in_third.append(result.problem_id)
            sim.stop()

    with pytest.raises(Unreachable):
        await run_sweep(spec, settings, tmp_path / "sweep", on_point=on_point, on_result=on_result)
    first = sim.stats().total_requests
    assert finished == names[:2] and solved_in_third == ["p1"]

    with SimServer(SimScript(), port=port) as again:
        summary = await run_sweep(spec, settings, tmp_path / "sweep")
        resumed = again.requests
    assert [o.status for o in summary.outcomes] == ["skipped", "skipped", "resumed", "new"]
    # Nothing finished was asked again: the two runs together made exactly the uninterrupted sweep's requests,
    # and the resumed point asked only about the problems it had not finished.
    assert first + len(resumed) == total
    # p1 was finished in the third point before the cut: it is asked about only in the fourth (n=2, 2 iterations).
    assert sum(r.problem_id == "p1" for r in resumed) == 2 * 2

    # A third run does nothing at all.
    with SimServer(SimScript(), port=port) as idle:
        summary = await run_sweep(spec, settings, tmp_path / "sweep")
        assert idle.stats().total_requests == 0
    assert [o.status for o in summary.outcomes] == ["skipped"] * 4
    manifest = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert all(p["finished"] for p in manifest["points"].values())


@pytest.mark.slow
async def test_sweep_report_has_every_curve(sim: SimServer, tmp_path: Path) -> None:
    from tmas.grading.grades import GradeConfig

    spec = spec_for(write_problems(tmp_path / "problems.jsonl"))
    await run_sweep(spec, settings_for(sim), tmp_path / "sweep")
    written = await report_sweep(spec, tmp_path / "sweep", GradeConfig(mode="rules"), None)
    report = written["markdown"].read_text()
    for label in ("cot", "majority", "self_refine [sim-model] (n=1)", "self_refine [sim-model] (n=2)"):
        assert f"| {label if '[' in label else label + ' [sim-model]'} |" in report
    assert any(k.startswith("frontier_") and k.endswith(".png") for k in written)
    assert "Accuracy (%) at equal completion-token budgets" in report
    assert (tmp_path / "sweep" / "report" / "refine" / "report.md").exists()
