"""The papers' published cells as data, and the report's "paper beside ours" table on a scripted run."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from pathlib import Path

import pytest

from conftest import settings_for
from tmas.grading.grades import GradeConfig
from tmas.problems import Problem
from tmas.reports.paper_numbers import load_cells, matching_cells, paper_methods, paper_model, setting_differences
from tmas.reports.report import build_report
from tmas.runner import RunState, prepare_run, run_problems
from tmas.testing import SimServer

M30, M4 = "Qwen3-30B-A3B-Thinking-2507", "Qwen3-4B-Thinking-2507"


def cell(source: str, row: str, column: str, model: str | None = None) -> float:
    found = [
        c
        for c in load_cells()
        if c.source == source and c.row == row and c.column == column and model in (None, c.model)
    ]
    assert len(found) == 1, (source, row, column, found)
    return found[0].value


def test_cell_counts_per_table() -> None:
    by_source: dict[tuple[str, str], int] = defaultdict(int)
    for c in load_cells():
        by_source[(c.paper, c.source)] += 1
    # TMAS Tables 3-6: 5 methods x 20 iterations; 7-8: 4 checkpoints x 20; 9-10: 1 x 20.
    assert [by_source[("TMAS", f"Table {n}")] for n in range(3, 11)] == [100] * 4 + [80] * 2 + [20] * 2
    # Table 1: 5 iterative methods x 12 columns x 2 models, MV@64 x 2 x 2, w/ Hybrid-RL x 12. Table 2: 4 x 12.
    assert by_source[("TMAS", "Table 1")] == 136 and by_source[("TMAS", "Table 2")] == 48
    # MATTRL: Table 1 4 x 5, Table 2 3, Table 3 3 x 3, Tables 4-6 3 x 4.
    assert [by_source[("MATTRL", f"Table {n}")] for n in range(1, 7)] == [20, 3, 9, 12, 12, 12]


def test_cells_published_twice_agree() -> None:
    # Table 1's columns are cells of Tables 3-8, Table 2's TMAS row is Table 3's first twelve: a transcription error
    # in either copy would show here.
    values: dict[tuple[str, str, str, int | None, str], set[float]] = defaultdict(set)
    count: dict[tuple[str, str, str, int | None, str], int] = defaultdict(int)
    for c in load_cells():
        k = (c.model, c.benchmark, c.method, c.iteration, c.metric)
        values[k].add(c.value)
        count[k] += 1
    shared = [k for k in values if count[k] > 1]
    assert len(shared) == 172  # 168 TMAS cells, and MATTRL's Hit@1-10 row in Tables 1, 4, 5, 6
    assert all(len(values[k]) == 1 for k in shared)


def test_spot_checks_read_off_the_papers() -> None:
    assert cell("Table 1", "TMAS", "It19 (IMO)", M30) == 40.50  # and the text: "reaches 40.50"
    assert cell("Table 1", "TMAS", "It19 (HLE)", M30) == 35.38
    assert {c.value for c in load_cells() if c.method == "MV@64" and c.model == M4} == {6.00, 15.40}
    assert cell("Table 2", "w/o both", "It0") == 8.61
    assert cell("Table 3", "RSE", "It8") == 35.00
    assert cell("Table 8", "TMAS (Step-190)", "It19") == 28.16
    assert cell("Table 10", "TMAS (Vanilla-RL)", "It0") == 15.78
    assert cell("Table 2", "Acc", "MATTRL") == 0.36
    assert cell("Table 3", "Multi-Agent", "Acc_{post}") == 0.73
    assert cell("Table 4", "Difference", "Hit@1") == 0.40
    assert cell("Table 1", "MATTRL", "MRR") == 0.51


def test_method_names_and_models() -> None:
    assert paper_methods("tmas", {"no_guideline": True, "no_experience": False}) == ["TMAS w/o guideline"]
    assert paper_methods("tmas", {"no_guideline": True, "no_experience": True}) == ["TMAS w/o both"]
    assert paper_methods("mattrl", {"pool": "pools/medicine-difference"}) == ["MATTRL", "MATTRL (difference credit)"]
    assert paper_methods("mattrl", {"pool": None}) == ["Multi-Agent"]
    assert paper_model("Qwen/Qwen3-30B-A3B-Thinking-2507-FP8") == M30
    # The longest published name the served name contains: the RL-trained model, not its base.
    assert paper_model("org/Qwen3-4B-Thinking-2507+Hybrid-RL") == f"{M4}+Hybrid-RL"
    assert paper_model("my-model") is None and paper_model("my-model", M4) == M4
    cells = matching_cells(M30, "hle-math-100", "rse", {"n": 8})
    assert len(cells) == 20 + 6 and all(c.method == "RSE" and c.benchmark == "HLE-Math-100" for c in cells)
    assert setting_differences("tmas", {"n": 2, "m": 8, "epsilon": 0.2}) == ["n=2 (paper 8)"]
    # MATTRL's setting: 3 experts, at most 3 rounds (4.1), K = 8 entries a retrieval (A.7).
    assert setting_differences("mattrl", {"team_size": 3, "iterations": 3, "top_k": 8}) == []
    assert setting_differences("mattrl", {"team_size": 2, "iterations": 3, "top_k": 4}) == [
        "team_size=2 (paper 3)",
        "top_k=4 (paper 8)",
    ]
    # PaCoRe's paper passes the messages whole: its None is no cut, said as such rather than as Python's None.
    assert setting_differences("pacore", {"responses_per_round": 8, "message_chars": 1500}) == [
        "message_chars=1500 (paper: not set)"
    ]
    assert setting_differences("pacore", {"responses_per_round": 8, "message_chars": None}) == []


async def _paper_benchmark_run(sim: SimServer, run_dir: Path) -> None:
    """A TMAS run (n=2, m=1, two iterations) of two problems on the paper's 30B model, recorded as a paper grid
    records its benchmark, on a subset of its own."""
    problems = [Problem(problem_id=f"p{i}", question=f"What is {i + 4}*6?", answer=str((i + 4) * 6)) for i in range(2)]
    settings = settings_for(
        sim, endpoint__model=f"Qwen/{M30}", method__name="tmas", method__params={"n": 2, "m": 1, "iterations": 2}
    )
    store, settings, todo = prepare_run(run_dir, settings, problems, resume=False)
    with store:
        store.set_meta("dataset", "my-subset")
        store.set_meta("paper_benchmark", "IMO-AnswerBench-50")
        await run_problems(settings, todo, store, state=RunState())


@pytest.mark.slow
async def test_report_puts_the_published_cell_beside_a_scripted_run(sim: SimServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "tmas"
    await _paper_benchmark_run(sim, run_dir)
    written = await build_report([run_dir], tmp_path / "report", GradeConfig(mode="rules"), None)
    report = written["markdown"].read_text()
    assert "### Paper beside ours" in report
    label = f"tmas [Qwen/{M30}]"
    setting = "n=2 (paper 8); m=1 (paper 8)"
    # The scripted server answers every arithmetic question right: Pass@1 100% at It0 and It1.
    assert (
        f"| {label} | TMAS | {M30} | It0 | pass@1 | 10.88 | 100.00 | +89.12 | TMAS Table 2, TMAS Table 3 | {setting} |"
        in report
    )
    tables = "TMAS Table 1, TMAS Table 2, TMAS Table 3"
    assert f"| {label} | TMAS | {M30} | It1 | pass@1 | 22.06 | 100.00 | +77.94 | {tables} | {setting} |" in report
    assert "It2 | pass@1" not in report
    assert "18 matched cells lie beyond the runs' last iterations" in report  # It2..It19 of Table 3


async def test_no_paper_table_for_an_unknown_model(sim: SimServer, tmp_path: Path) -> None:
    problems = [Problem(problem_id="p0", question="What is 3*6?", answer="18")]
    settings = settings_for(sim, method__name="cot")
    store, settings, todo = prepare_run(tmp_path / "cot", settings, problems, resume=False)
    with store:
        store.set_meta("dataset", "hle-math-100")
        await run_problems(settings, todo, store, state=RunState())
    written = await build_report([tmp_path / "cot"], tmp_path / "report", GradeConfig(mode="rules"), None)
    assert "Paper beside ours" not in written["markdown"].read_text()


@pytest.mark.slow
async def test_a_run_short_of_problems_says_so_beside_the_papers_figures(sim: SimServer, tmp_path: Path) -> None:
    run_dir = tmp_path / "tmas"
    await _paper_benchmark_run(sim, run_dir)
    # Stopped before p1 began: the run stands on p0 alone, as its Pass@1 tables say.
    with sqlite3.connect(run_dir / "run.sqlite") as db:
        for table in ("results", "iterations"):
            db.execute(f"DELETE FROM {table} WHERE problem_id = 'p1'")
    written = await build_report([run_dir], tmp_path / "report", GradeConfig(mode="rules"), None)
    report = written["markdown"].read_text()
    label = f"tmas [Qwen/{M30}]"
    assert f"| {label} | 100.00 (1 of 2 problems) | 100.00 (1 of 2 problems) |" in report
    # Beside the paper's figure over its whole benchmark, the run's value says it stands on one of its two problems.
    row = next(line for line in report.splitlines() if line.startswith(f"| {label} | TMAS | {M30} | It1 | pass@1 |"))
    assert row.split(" | ")[6] == "100.00 (1 of 2 problems)"
    assert "not every problem" in report.split("### Paper beside ours")[1].split("|")[0]
